"""Host side of Mamba1's selective scan (``selective_scan.py``): the launch table lookup, the
chunk plan, and the argument checks, which read shapes, strides, dtypes and devices (index
data only on CPU tensors, where reading it costs no sync) and raise a ValueError naming the
argument."""

from __future__ import annotations

from pathlib import Path

import torch

from vllm.model_executor.layers.mamba.ops.causal_conv1d_host import (
    check_cache_indices_data,
    check_index,
)
from vllm.model_executor.layers.mamba.ops.causal_conv1d_ref import marker_for
from vllm.tensor_checks import FLOAT_DTYPES, check_default_lines, check_tensor
from vllm.triton_utils.configs import lookup_first, table_key
from vllm.triton_utils.host import cdiv, next_power_of_2

CONFIG_DIR = Path(__file__).parent / "configs" / "selective_scan"
INDEX_DTYPES = (torch.int32, torch.int64)
_MAX_TILE = 4096  # state elements per program: BLOCK_D x next_pow2(dstate)
UNROLLS = (1, 2, 4)  # rows whose loads the prefill scan issues together


def scan_config(dim: int, dstate: int, dtype: torch.dtype) -> dict:
    keys = [table_key(dim=dim, dstate=dstate, dtype=dtype), table_key(dtype=dtype)]
    return lookup_first(CONFIG_DIR, keys)


def launch_options(entry: dict, dim: int, dstate: int) -> dict:
    """A table entry's BLOCK_D cut to the shape, with BLOCK_N = next_pow2(dstate)."""
    block_n = next_power_of_2(dstate)
    block_d = min(entry["BLOCK_D"], next_power_of_2(dim), max(1, _MAX_TILE // block_n))
    opts = {k: v for k, v in entry.items() if k != "BLOCK_D"}
    return dict(BLOCK_D=block_d, BLOCK_N=block_n, **opts)


def chunk_options(cfg: dict, dim: int, dstate: int, final: bool = False) -> dict:
    """``launch_options`` of the prefill scan's launch 1 (the table's ``chunk`` entry) or,
    ``final``, launch 3 (the rescan: ``chunk`` with the latency knobs of the optional
    ``rescan`` entry over it; the two launches share BLOCK_D, so their grids and slots
    agree). Knobs a table leaves out take their plain values (PREFETCH off, UNROLL 1).
    ValueError naming the knob for a value the kernel does not take."""
    entry = dict({"PREFETCH": False, "UNROLL": 1}, **cfg["chunk"])
    rescan = cfg.get("rescan", {}) if final else {}
    if set(rescan) - {"PREFETCH", "UNROLL"}:
        raise ValueError(f"rescan may set only PREFETCH and UNROLL, got {sorted(rescan)}")
    opts = launch_options(dict(entry, **rescan), dim, dstate)
    if opts["UNROLL"] not in UNROLLS or isinstance(opts["UNROLL"], bool):
        raise ValueError(f"chunk UNROLL must be one of {UNROLLS}, got {opts['UNROLL']!r}")
    if not isinstance(opts["PREFETCH"], bool):
        raise ValueError(f"chunk PREFETCH must be a bool, got {opts['PREFETCH']!r}")
    return opts


def check_chunk_len(chunk_len) -> None:
    if chunk_len is not None and (
        isinstance(chunk_len, bool) or not isinstance(chunk_len, int) or chunk_len < 1
    ):
        raise ValueError(f"chunk_len must be a positive int or None, got {chunk_len!r}")


def chunk_plan(num_tokens: int, batch: int, dim: int, dstate: int, dtype: torch.dtype,
               chunk_len: int | None = None) -> tuple[int, int]:  # fmt: skip
    """(chunk length, chunks per sequence at most) for a step, from shapes only.

    One chunk per sequence while channel blocks x sequences already reach the table's
    ``target_programs`` (the cheapest: no state pass, no rescan); otherwise chunks of at
    least ``min_chunk_len`` tokens, short enough to give about that many programs.
    ``chunk_len`` (tests, sweeps) overrides the rule."""
    if chunk_len is None:
        cfg = scan_config(dim, dstate, dtype)
        blocks = cdiv(dim, chunk_options(cfg, dim, dstate)["BLOCK_D"])
        if blocks * batch >= cfg["target_programs"]:
            chunk_len = num_tokens
        else:
            chunk_len = max(cfg["min_chunk_len"], cdiv(num_tokens * blocks, cfg["target_programs"]))
    else:
        check_chunk_len(chunk_len)
    chunk_len = max(1, min(chunk_len, num_tokens))
    return chunk_len, cdiv(num_tokens, chunk_len)


def scratch_slots(batch: int, num_tokens: int, chunk_len: int) -> int:
    """Slots of a chunked scan's scratch (a state and a dt sum each): chunk c of sequence b
    has slot b + qsl[b] // chunk_len + c, below this count."""
    return batch + num_tokens // chunk_len


# --------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------


def _check_pad(pad_slot_id) -> None:
    if isinstance(pad_slot_id, bool) or not isinstance(pad_slot_id, int):
        raise ValueError(f"pad_slot_id must be an int, got {pad_slot_id!r}")


def _check_rows(name, t, device, rows, width, width_name, unit=True) -> None:
    """``t`` is (rows, width) on ``device`` with a float dtype, unit stride along width."""
    check_tensor(name, t, device, 2, FLOAT_DTYPES)
    if tuple(t.shape) != (rows, width):
        raise ValueError(
            f"{name} must be (num_tokens={rows}, {width_name}={width}), got {tuple(t.shape)}"
        )
    if unit and width > 1 and t.stride(1) != 1:
        raise ValueError(
            f"{name} must have unit stride along {width_name} (stride(1) == 1; the row "
            f"stride may be anything), got strides {t.stride()}"
        )


def _check_params(A, D, delta_bias, dim, device, contiguous) -> int:
    """A (dim, dstate); D and delta_bias (dim,) or None. Returns dstate."""
    check_tensor("A", A, device, 2, FLOAT_DTYPES)
    if A.shape[0] != dim or A.shape[1] < 1:
        raise ValueError(f"A must be (dim={dim}, dstate), got {tuple(A.shape)}")
    for name, t in (("D", D), ("delta_bias", delta_bias)):
        if t is None:
            continue
        check_tensor(name, t, device, 1, FLOAT_DTYPES)
        if t.shape[0] != dim:
            raise ValueError(f"{name} must be (dim={dim},), got {tuple(t.shape)}")
        if contiguous and dim > 1 and t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    return A.shape[1]


def _check_pool(ssm_states, device, dim, dstate) -> None:
    check_tensor("ssm_states", ssm_states, device, 3, FLOAT_DTYPES)
    if tuple(ssm_states.shape[1:]) != (dim, dstate):
        raise ValueError(
            f"ssm_states must be (num_lines, dim={dim}, dstate={dstate}), got "
            f"{tuple(ssm_states.shape)}"
        )


def _check_qsl(qsl, device, num_tokens) -> int:
    check_tensor("query_start_loc", qsl, device, 1, INDEX_DTYPES)
    if qsl.shape[0] < 1:
        raise ValueError("query_start_loc must have batch+1 >= 1 entries")
    if qsl.shape[0] > 1 and qsl.stride(0) != 1:
        raise ValueError(f"query_start_loc must be contiguous, got strides {qsl.stride()}")
    if qsl.device.type == "cpu":
        q = qsl.long()
        if int(q[0]) < 0 or bool((q[1:] < q[:-1]).any()) or int(q[-1]) > num_tokens:
            raise ValueError(
                f"query_start_loc must be non-decreasing within [0, num_tokens={num_tokens}], "
                f"got {q.tolist()}"
            )
    return qsl.shape[0] - 1


def check_scan_args(u, delta, A, B, C, qsl, ssm_states, cache_indices, has_initial_state,
                     D, z, delta_bias, pad_slot_id, out) -> None:  # fmt: skip
    device = u.device if isinstance(u, torch.Tensor) else None
    check_tensor("u", u, device, 2, FLOAT_DTYPES)
    num_tokens, dim = u.shape
    _check_rows("u", u, device, num_tokens, dim, "dim")
    _check_rows("delta", delta, device, num_tokens, dim, "dim")
    if z is not None:
        _check_rows("z", z, device, num_tokens, dim, "dim")
    if out is not None:
        _check_rows("out", out, device, num_tokens, dim, "dim")
    dstate = _check_params(A, D, delta_bias, dim, device, contiguous=True)
    _check_rows("B", B, device, num_tokens, dstate, "dstate")
    _check_rows("C", C, device, num_tokens, dstate, "dstate")
    _check_pool(ssm_states, device, dim, dstate)
    _check_pad(pad_slot_id)
    batch = _check_qsl(qsl, device, num_tokens)
    if cache_indices is not None:
        check_tensor("cache_indices", cache_indices, device, 1, INDEX_DTYPES)
        check_index("cache_indices", cache_indices, device, batch, cache_indices.dtype)
    check_index("has_initial_state", has_initial_state, device, batch, torch.bool)
    check_default_lines("cache_indices", cache_indices, batch, ssm_states.shape[0])
    if device.type == "cpu":
        marker = marker_for(pad_slot_id, cache_indices)
        check_cache_indices_data("cache_indices", cache_indices, ssm_states.shape[0], batch, marker)


def check_update_args(ssm_states, u, delta, A, B, C, D, z, delta_bias, indices, pad_slot_id,
                       out) -> None:  # fmt: skip
    device = u.device if isinstance(u, torch.Tensor) else None
    check_tensor("u", u, device, 2, FLOAT_DTYPES)
    batch, dim = u.shape
    for name, t in (("delta", delta), ("z", z), ("out", out)):
        if t is not None:
            check_tensor(name, t, device, 2, FLOAT_DTYPES)
            if t.shape != u.shape:
                raise ValueError(f"{name} must be (batch={batch}, dim={dim}), got {tuple(t.shape)}")
    dstate = _check_params(A, D, delta_bias, dim, device, contiguous=False)
    for name, t in (("B", B), ("C", C)):
        check_tensor(name, t, device, 2, FLOAT_DTYPES)
        if tuple(t.shape) != (batch, dstate):
            raise ValueError(
                f"{name} must be (batch={batch}, dstate={dstate}), got {tuple(t.shape)}"
            )
    _check_pool(ssm_states, device, dim, dstate)
    _check_pad(pad_slot_id)
    if indices is None:
        check_default_lines("state_batch_indices", indices, batch, ssm_states.shape[0])
        return
    check_tensor("state_batch_indices", indices, device, 1, INDEX_DTYPES)
    if tuple(indices.shape) != (batch,):
        raise ValueError(
            f"state_batch_indices must be (batch={batch},), got {tuple(indices.shape)}"
        )
    if device.type == "cpu":
        check_cache_indices_data(
            "state_batch_indices", indices, ssm_states.shape[0], batch, pad_slot_id
        )
