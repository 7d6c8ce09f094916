"""Mamba1's selective scan (a step's prefill rows) and its decode update, on Triton.

Same arguments and meaning as ``selective_scan_ref`` (see its docstring for the math and
the layout): ``selective_scan_fn`` scans every prefill sequence of a step in one launch set
(three launches when sequences are cut into chunks over time, one otherwise; the kernels
are in ``selective_scan_kernels.py``, the table lookup, chunk plan and argument checks in
``selective_scan_host.py``, the design in docs/selective_scan.md);
``selective_state_update_mamba1`` is one fused decode step per row, with a grid fixed by
shapes and no host sync, so it can be captured in a CUDA graph.

Dispatch, as the other ops: CUDA tensors run the kernels; CPU tensors run them under
``TRITON_INTERPRET=1`` (set before the kernels are imported) and the fp32 references
otherwise. Outputs are in u's dtype (or written into ``out``); states go back in the pool's
dtype; the math is fp32. Rows whose line is the pad marker (``NULL_BLOCK_ID`` = 0 by
default, or any negative index) get zero outputs and read and write no line.

Layouts the kernels take: u, delta, z, out (num_tokens, dim) and B, C (num_tokens, dstate)
may be row views of wider tensors (any row stride) but need unit stride along the channel
(state) dimension; A and ssm_states take any strides; D and delta_bias are contiguous.
The decode update honours every stride. Bad arguments raise a ValueError naming them.
Checks that read index data (range, repeats, query_start_loc's order) run on CPU tensors
only, where reading them costs no sync.
"""

from __future__ import annotations

import torch

from vllm.model_executor.layers.mamba.ops.causal_conv1d_ref import NULL_BLOCK_ID, marker_for
from vllm.model_executor.layers.mamba.ops.selective_scan_host import (
    CONFIG_DIR,
    check_chunk_len,
    check_scan_args,
    check_update_args,
    chunk_options,
    chunk_plan,
    launch_options,
    scan_config,
    scratch_slots,
)
from vllm.model_executor.layers.mamba.ops.selective_scan_kernels import (
    LAUNCH_CHUNK,
    LAUNCH_STATE_PASSING,
    LAUNCH_UPDATE,
)
from vllm.model_executor.layers.mamba.ops.selective_scan_ref import (
    selective_scan_ref,
    selective_state_update_ref,
)
from vllm.triton_utils import HAS_TRITON
from vllm.triton_utils.host import cdiv, recording

__all__ = [
    "CONFIG_DIR",
    "chunk_plan",
    "selective_scan_fn",
    "selective_state_update_mamba1",
    "use_selective_scan_kernel",
]


def use_selective_scan_kernel(u: torch.Tensor) -> bool:
    """CUDA tensors run the kernels; CPU tensors only under the interpreter
    (``CachedLauncher.runs_cpu_tensors``), else the fp32 references."""
    if u.is_cuda:
        if not HAS_TRITON:
            raise RuntimeError("the selective scan on CUDA tensors needs Triton, not installed")
        return True
    return u.device.type == "cpu" and LAUNCH_CHUNK.runs_cpu_tensors()


# --------------------------------------------------------------------------
# Launches
# --------------------------------------------------------------------------


def _scan_launch(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    query_start_loc: torch.Tensor,
    ssm_states: torch.Tensor,
    cache_indices: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    delta_bias: torch.Tensor | None,
    delta_softplus: bool,
    pad_slot_id: int,
    chunk_len: int,
    out: torch.Tensor,
) -> None:
    """The launches behind ``selective_scan_fn`` (checked arguments; ``chunk_len`` 0: the
    launch table's rule). Registered as ``torch.ops.vllm.mamba1_selective_scan``."""
    num_tokens, dim = u.shape
    dstate = A.shape[1]
    batch = query_start_loc.shape[0] - 1
    if num_tokens == 0 or dim == 0:
        return
    if batch == 0:
        out.zero_()
        return
    # Every thread reads every column of B and C on every token: converted once here
    # (num_tokens x dstate each), the scan loop saves ~30 of ~250 instructions per token.
    B = B if B.dtype == torch.float32 else B.float()
    C = C if C.dtype == torch.float32 else C.float()
    cfg = scan_config(dim, dstate, u.dtype)
    chunk_len, n_chunks = chunk_plan(num_tokens, batch, dim, dstate, u.dtype, chunk_len or None)
    opts = chunk_options(cfg, dim, dstate)
    n_slots = scratch_slots(batch, num_tokens, chunk_len)
    if n_chunks > 1:
        hbuf = torch.empty((n_slots, dstate, dim), dtype=torch.float32, device=u.device)
        dtsum = torch.empty((n_slots, dim), dtype=torch.float32, device=u.device)
    else:
        hbuf = dtsum = torch.empty(1, dtype=torch.float32, device=u.device)
    # An absent optional tensor passes u (never read: its flag compiles the load away).
    args = (
        u, delta, A, B, C,
        u if D is None else D,
        u if z is None else z,
        u if delta_bias is None else delta_bias,
        query_start_loc,
        u if cache_indices is None else cache_indices,
        u if has_initial_state is None else has_initial_state,
        ssm_states, hbuf, dtsum, out,
        num_tokens, batch, batch.bit_length(), dim, dstate, chunk_len, pad_slot_id,
        u.stride(0), delta.stride(0), *A.stride(), B.stride(0), C.stride(0),
        0 if z is None else z.stride(0), out.stride(0), *ssm_states.stride(),
    )  # fmt: skip
    flags = dict(
        HAS_D=D is not None,
        HAS_Z=z is not None,
        HAS_BIAS=delta_bias is not None,
        SOFTPLUS=bool(delta_softplus),
        HAS_INDICES=cache_indices is not None,
        HAS_INIT=has_initial_state is not None,
    )
    grid = (n_slots, cdiv(dim, opts["BLOCK_D"]))
    LAUNCH_CHUNK(grid, args, dict(flags, FINAL=False, **opts))
    if n_chunks == 1 and not recording():  # start-up records every launch a step can make
        return
    sp = launch_options(cfg["state_passing"], dim, dstate)
    sp_args = (
        A, query_start_loc, u if cache_indices is None else cache_indices, ssm_states, hbuf,
        dtsum, dim, dstate, chunk_len, pad_slot_id, *A.stride(), *ssm_states.stride(),
    )  # fmt: skip
    sp_grid = (batch, cdiv(dim, sp["BLOCK_D"]))
    LAUNCH_STATE_PASSING(sp_grid, sp_args, dict(HAS_INDICES=flags["HAS_INDICES"], **sp))
    LAUNCH_CHUNK(grid, args, dict(flags, FINAL=True, **chunk_options(cfg, dim, dstate, True)))


def selective_scan_fn(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    query_start_loc: torch.Tensor,
    ssm_states: torch.Tensor,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    pad_slot_id: int = NULL_BLOCK_ID,
    out: torch.Tensor | None = None,
    *,
    chunk_len: int | None = None,
) -> torch.Tensor:
    """Scan every sequence of a varlen batch: y (num_tokens, dim) in u's dtype (or ``out``).

    Sequence b is rows ``query_start_loc[b]:query_start_loc[b + 1]``; it starts from line
    ``cache_indices[b]`` of ``ssm_states`` (line b without indices) when
    ``has_initial_state[b]``, from zeros otherwise, and leaves its final state there in the
    pool's dtype. Lines of real sequences must be distinct. ``chunk_len`` overrides the
    launch table's chunk length (tests and sweeps)."""
    check_scan_args(u, delta, A, B, C, query_start_loc, ssm_states, cache_indices,
                     has_initial_state, D, z, delta_bias, pad_slot_id, out)  # fmt: skip
    check_chunk_len(chunk_len)
    if not use_selective_scan_kernel(u):
        y = selective_scan_ref(u, delta, A, B, C, query_start_loc, ssm_states, cache_indices,
                               has_initial_state, D, z, delta_bias, delta_softplus,
                               pad_slot_id)  # fmt: skip
        return y.to(u.dtype) if out is None else out.copy_(y)
    if out is None:
        out = torch.empty(u.shape, dtype=u.dtype, device=u.device)
    args = (u, delta, A, B, C, query_start_loc, ssm_states, cache_indices, has_initial_state,
            D, z, delta_bias, bool(delta_softplus), int(pad_slot_id), chunk_len or 0,
            out)  # fmt: skip
    if torch.compiler.is_compiling():
        torch.ops.vllm.mamba1_selective_scan(*args)
    else:
        _scan_launch(*args)
    return out


def _update_launch(
    ssm_states: torch.Tensor,
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    delta_bias: torch.Tensor | None,
    delta_softplus: bool,
    state_batch_indices: torch.Tensor | None,
    pad_slot_id: int,
    out: torch.Tensor,
) -> None:
    batch, dim = u.shape
    dstate = A.shape[1]
    if batch == 0 or dim == 0:
        return
    idx = state_batch_indices
    opts = launch_options(scan_config(dim, dstate, u.dtype)["update"], dim, dstate)
    args = (
        ssm_states, u, delta, A, B, C,
        u if D is None else D,
        u if z is None else z,
        u if delta_bias is None else delta_bias,
        u if idx is None else idx,
        out, dim, dstate, pad_slot_id,
        *ssm_states.stride(), *u.stride(), *delta.stride(), *A.stride(), *B.stride(),
        *C.stride(),
        0 if D is None else D.stride(0),
        *((0, 0) if z is None else z.stride()),
        0 if delta_bias is None else delta_bias.stride(0),
        0 if idx is None else idx.stride(0),
        *out.stride(),
    )  # fmt: skip
    flags = dict(
        HAS_D=D is not None,
        HAS_Z=z is not None,
        HAS_BIAS=delta_bias is not None,
        SOFTPLUS=bool(delta_softplus),
        HAS_INDICES=idx is not None,
    )
    LAUNCH_UPDATE((batch, cdiv(dim, opts["BLOCK_D"])), args, dict(flags, **opts))


def selective_state_update_mamba1(
    ssm_states: torch.Tensor,
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    state_batch_indices: torch.Tensor | None = None,
    pad_slot_id: int = NULL_BLOCK_ID,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step per row: u, delta, z (batch, dim); B, C (batch, dstate). Row i updates
    line ``state_batch_indices[i]`` (line i without indices) in place and returns y
    (batch, dim) in u's dtype (or ``out``); padded rows get zeros and touch no line. No
    host sync and no allocation that depends on values: capturable in a CUDA graph."""
    check_update_args(ssm_states, u, delta, A, B, C, D, z, delta_bias, state_batch_indices,
                       pad_slot_id, out)  # fmt: skip
    if not use_selective_scan_kernel(u):
        y = selective_state_update_ref(ssm_states, u, delta, A, B, C, D, z, delta_bias,
                                       delta_softplus, state_batch_indices,
                                       pad_slot_id)  # fmt: skip
        return y.to(u.dtype) if out is None else out.copy_(y)
    if out is None:
        out = torch.empty(u.shape, dtype=u.dtype, device=u.device)
    marker = marker_for(pad_slot_id, state_batch_indices)
    args = (ssm_states, u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus),
            state_batch_indices, marker, out)  # fmt: skip
    if torch.compiler.is_compiling():
        torch.ops.vllm.mamba1_state_update(*args)
    else:
        _update_launch(*args)
    return out


# --------------------------------------------------------------------------
# torch.library registration (for torch.compile and opcheck)
# --------------------------------------------------------------------------


_scan_op = torch.library.custom_op(
    "vllm::mamba1_selective_scan", _scan_launch, mutates_args=("ssm_states", "out")
)
_update_op = torch.library.custom_op(
    "vllm::mamba1_state_update", _update_launch, mutates_args=("ssm_states", "out")
)


@_scan_op.register_fake
def _(u, delta, A, B, C, query_start_loc, ssm_states, cache_indices, has_initial_state, D, z,
      delta_bias, delta_softplus, pad_slot_id, chunk_len, out):  # fmt: skip
    return None


@_update_op.register_fake
def _(ssm_states, u, delta, A, B, C, D, z, delta_bias, delta_softplus, state_batch_indices,
      pad_slot_id, out):  # fmt: skip
    return None
