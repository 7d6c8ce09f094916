"""Host-side work of the causal-conv1d launchers: argument checks, and the pieces that let a
repeated eager call cost little more than its launch.

Checks. Every function here reads shapes, strides, dtypes, devices and Python values only
(never device data, so no sync) and raises a ValueError that names the argument. The
``*_data`` checks, used with ``validate_data=True``, read the index tensors (and sync).

Launch plans. ``causal_conv1d.py`` keeps, per op, a cache of launch plans keyed by everything
its checks read (``PlanCache``): a call whose arguments have the layout of an earlier one
finds its plan with one dict lookup and skips the checks and the launch decisions. A plan
launches its compiled kernel directly (``FastKernel``): the Triton launcher's C entry point
with raw data pointers, so neither Triton's Python binding nor the launch cache's key runs,
and no tensor pays ``data_ptr()`` plus ``cuPointerGetAttribute`` inside the launcher. The
compiled kernel is the one ``CachedLauncher`` holds for 16-byte aligned pointers; a call
with an unaligned pointer, inside ``precompile()``, on another current device, or under the
interpreter goes through the ``CachedLauncher`` instead (the interpreter runs the kernel's
source on CPU tensors: there is nothing compiled to launch).
"""

from __future__ import annotations

import torch

from vllm.model_executor.layers.mamba.ops.causal_conv1d_ref import PAD_SLOT_ID
from vllm.tensor_checks import FLOAT_DTYPES, check_conv_weight_bias, check_tensor
from vllm.triton_utils import launch as _launch

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


# --------------------------------------------------------------------------
# Launch plans: the cache and the direct launch
# --------------------------------------------------------------------------


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` without its cost: Triton 3.6 makes it a constexpr function whose host
    calls unwrap their arguments (about 2 us each on the development machine)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


class PlanCache(dict):
    """Launch plans by argument layout. Bounded: a caller whose layouts never repeat (a new
    batch size per call, say) clears it now and then instead of growing it without end."""

    def __init__(self, max_size: int = 1024):
        super().__init__()
        self.max_size = max_size

    def put(self, key, plan) -> None:
        if len(self) >= self.max_size:
            self.clear()
        self[key] = plan


def one_d_contiguous(*tensors) -> bool:
    """Each tensor is None or has stride (1,): only then is a plan keyed by strides exact for
    every length (a strided view of one entry passes the checks, of two it does not)."""
    return all(t is None or t.stride() == (1,) for t in tensors)


class FastKernel:
    """One compiled kernel, for launching through the Triton launcher's C entry point:

        fn(grid0, grid1, grid2, stream, *head, *args, *tail)

    ``args`` are the kernel's runtime arguments, tensors given as their data pointers
    (ints) and absent ones as None; ``tail`` holds the compiled kernel's constexpr values.
    ``device`` is the CUDA device whose context holds the kernel.
    """

    __slots__ = ("fn", "head", "tail", "device")

    def __init__(self, compiled, tail: tuple, device: int):
        run = compiled.run
        c_launch = getattr(run, "launch", None)
        scratch = (getattr(run, "global_scratch_size", 1), getattr(run, "profile_scratch_size", 1))
        if c_launch is not None and scratch == (0, 0):
            # CudaLauncher.__call__ only allocates scratch (none here) and calls launch().
            self.fn = c_launch
            self.head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None,
                         None, compiled.packed_metadata, None, None, None)  # fmt: skip
        else:
            self.fn = run
            self.head = (compiled.function, compiled.packed_metadata, None, None, None)
        self.tail = tail
        self.device = device


def fast_kernel(launcher, args: tuple, constexprs: dict) -> FastKernel | None:
    """The compiled kernel ``launcher`` holds for these arguments, or None: not compiled yet,
    not a GPU launcher, a precompile block recording, or a pointer that is not 16-byte
    aligned (the direct launches use the kernel compiled for aligned pointers only)."""
    if not launcher.direct or _launch._SESSION is not None:
        return None
    for a in args:
        if isinstance(a, torch.Tensor) and a.data_ptr() % 16:
            return None
    entry = launcher.cache.get(launcher.key(args, constexprs))
    if entry is None:
        return None
    compiled, tail = entry
    return FastKernel(compiled, tail, torch.cuda.current_device())


def direct_ok(device: int) -> int | None:
    """The raw stream to launch on, or None when a direct launch must not be made: a
    precompile block records launches, or another device is current."""
    if _launch._SESSION is not None or torch._C._cuda_getDevice() != device:
        return None
    return torch._C._cuda_getCurrentRawStream(device)
