"""Host-side work of the causal-conv1d launchers: argument checks, and the pieces that let a
repeated eager call cost little more than its launch.

Checks. Every function here reads shapes, strides, dtypes, devices and Python values only
(never device data, so no sync) and raises a ValueError that names the argument. The
``*_data`` checks, used with ``validate_data=True``, read the index tensors (and sync).

Launch plans. ``causal_conv1d.py`` keeps, per op, a cache of launch plans keyed by everything
its checks read (``vllm.triton_utils.host.PlanCache``): a call whose arguments have the
layout of an earlier one finds its plan with one dict lookup and skips the checks and the
launch decisions. A plan launches its compiled kernel directly
(``vllm.triton_utils.host.direct_kernel``, which says when it must not).
"""

from __future__ import annotations

import torch

from vllm.model_executor.layers.mamba.ops.causal_conv1d_ref import PAD_SLOT_ID
from vllm.tensor_checks import FLOAT_DTYPES, check_conv_weight_bias, check_tensor

# --------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------


def check_common(x, weight, bias, conv_states, dim, states_name) -> int:
    """weight (dim, W), bias (dim,) contiguous or None, and the state pool (num_lines, dim,
    state_len >= W-1) of any non-aliasing strides, all on x's device; returns W."""
    width = check_conv_weight_bias(weight, bias, dim, x.device, FLOAT_DTYPES)
    check_tensor(states_name, conv_states, x.device, 3, FLOAT_DTYPES)
    if conv_states.shape[1] != dim:
        raise ValueError(
            f"{states_name} must be (num_cache_lines, dim={dim}, state_len), "
            f"got {tuple(conv_states.shape)}"
        )
    if conv_states.shape[2] < width - 1:
        raise ValueError(
            f"{states_name} state_len must be >= width-1 = {width - 1}, got {conv_states.shape[2]}"
        )
    # Any strides are served in place (the kernels take all three), except a pool whose
    # elements alias: a stride of 0 over a dimension of size > 1 (e.g. from expand) would
    # make two cache positions one, and torch refuses in-place writes to those as well.
    for size, stride in zip(conv_states.shape, conv_states.stride(), strict=True):
        if stride == 0 and size > 1:
            raise ValueError(
                f"{states_name} has overlapping elements (a stride of 0, as from expand; "
                f"strides {conv_states.stride()}): it is updated in place"
            )
    if bias is not None and bias.stride(0) != 1 and dim > 1:
        raise ValueError(f"bias must be contiguous (stride(0) == 1), got strides {bias.stride()}")
    return width


def feature_contiguous(conv_states: torch.Tensor) -> bool:
    """The pool's fast layout: features adjacent in memory (stride(1) == 1)."""
    return conv_states.stride(1) == 1


def check_index(name, t, device, batch, dtype=torch.int32) -> None:
    """A per-sequence array: 1-D, contiguous, at least ``batch`` entries (callers pass
    padded buffers; the entries past ``batch`` are never read)."""
    if t is None:
        return
    check_tensor(name, t, device, 1, (dtype,))
    if t.shape[0] < batch:
        raise ValueError(
            f"{name} must have at least batch={batch} entries (entries past batch are "
            f"ignored), got {t.shape[0]}"
        )
    if t.stride(0) != 1 and t.shape[0] > 1:
        raise ValueError(f"{name} must be contiguous (stride(0) == 1), got strides {t.stride()}")


def check_qsl(qsl, device) -> int:
    """``query_start_loc``: 1-D int32, contiguous, batch+1 >= 1 offsets; returns batch."""
    check_tensor("query_start_loc", qsl, device, 1, (torch.int32,))
    if qsl.shape[0] < 1:
        raise ValueError("query_start_loc must have batch+1 >= 1 entries")
    if qsl.stride(0) != 1 and qsl.shape[0] > 1:
        raise ValueError(
            f"query_start_loc must be contiguous (stride(0) == 1), got strides {qsl.stride()}"
        )
    return qsl.shape[0] - 1


class DefaultPadSlotId(int):
    """``PAD_SLOT_ID`` as the default of ``pad_slot_id``: equal to it, and recognisable,
    so that a ``null_block_id`` next to an explicit, different ``pad_slot_id`` is an
    error rather than a silent choice of one of them."""

    def __repr__(self) -> str:
        return "PAD_SLOT_ID"


PAD_DEFAULT = DefaultPadSlotId(PAD_SLOT_ID)


def pad_marker(pad_slot_id, null_block_id) -> int:
    """The index that marks a padded row: ``null_block_id`` (upstream's 2026 name) or
    ``pad_slot_id``; both given with different values is a ValueError."""
    if isinstance(pad_slot_id, bool) or not isinstance(pad_slot_id, int):
        raise ValueError(f"pad_slot_id must be an int, got {pad_slot_id!r}")
    if null_block_id is None:
        return int(pad_slot_id)
    if isinstance(null_block_id, bool) or not isinstance(null_block_id, int):
        raise ValueError(f"null_block_id must be an int or None, got {null_block_id!r}")
    if type(pad_slot_id) is not DefaultPadSlotId and pad_slot_id != null_block_id:
        raise ValueError(
            f"pad_slot_id={pad_slot_id} and null_block_id={null_block_id} both name the "
            "padded-row index, with different values; give one of them"
        )
    return int(null_block_id)


def check_cache_indices_data(name, indices, num_lines, batch, pad_slot_id) -> None:
    """Reads the first ``batch`` indices: real lines in range, none twice."""
    if indices is None:
        return
    idx = indices[:batch].cpu()
    real = idx[idx != pad_slot_id]
    if bool(((real < 0) | (real >= num_lines)).any()):
        raise ValueError(f"{name} has entries outside [0, {num_lines}) that are not pad_slot_id")
    if real.unique().numel() != real.numel():
        raise ValueError(f"{name} has duplicate cache lines among non-padded sequences")


def check_qsl_data(name, qsl, num_tokens) -> None:
    q = qsl.cpu()
    if int(q[0]) != 0 or bool((q[1:] < q[:-1]).any()) or int(q[-1]) != num_tokens:
        raise ValueError(
            f"{name} must start at 0, be non-decreasing and end at num_tokens={num_tokens}"
        )


def one_d_contiguous(*tensors) -> bool:
    """Each tensor is None or has stride (1,): only then is a plan keyed by strides exact for
    every length (a strided view of one entry passes the checks, of two it does not)."""
    return all(t is None or t.stride() == (1,) for t in tensors)
