"""Triton kernel of the Mamba2 decode step: the one-token selective-state update, fused.

Per sequence b, head h (group g = h // (nheads // ngroups)), with state S (headdim x dstate)::

    dt = clamp(softplus(dt_raw[b, h] + dt_bias[h]), *dt_limit)     (softplus when asked)
    S  = exp(dt * A[h]) * S + dt * x[b, h] B[b, g]^T
    y[b, h] = S C[b, g] + D[h] * x[b, h]

The math is fp32; S is stored back in the pool's dtype and y in out's dtype, one cast each.
Each state element is read once and written once: at the Codestral-7B shape (128 heads x
64 x 128, fp32) that is 4 MiB each way per sequence and layer, and nothing else the step
touches comes close, so the kernel runs at memory speed where the PyTorch path
(``mamba_ssm_torch.selective_state_update_torch``) makes about eleven passes.

Tensors (logical shapes; any strides, every one honoured; lines addressed in int64):

- ``state``: (num_lines, nheads, headdim, dstate), fp32/fp16/bf16, updated in place.
- ``x``: (batch, nheads, headdim); ``dt``: (batch, nheads) before the bias;
  ``B``, ``C``: (batch, ngroups, dstate); ``A``, ``D``, ``dt_bias``: (nheads,).
- ``state_batch_indices``: (batch,) int32/int64, each row's line (None: row b uses line b).
  Lines of real rows must be distinct.
- ``out``: (batch, nheads, headdim), written in full.

Padded rows (index == ``pad_slot_id``; by default ``NULL_BLOCK_ID`` = 0, the pool's null
line; ``PAD_SLOT_ID`` = -1 when passed) get y = 0 and neither read nor write any line, on
this path and on the PyTorch one alike. The grid, (batch, nheads,
headdim blocks), depends on shapes only and nothing syncs with the host, so the call can be
captured in a CUDA graph.

``mamba_ssm_torch.selective_state_update`` dispatches by ``use_ssm_kernel``: CUDA tensors
run this kernel, CPU tensors run it only under ``TRITON_INTERPRET=1`` (the PyTorch path
otherwise). Without Triton the module imports, and a call raises RuntimeError.
"""

from __future__ import annotations

import math

import torch

from vllm.model_executor.layers.mamba.ops.causal_conv1d_ref import NULL_BLOCK_ID
from vllm.tensor_checks import FLOAT_DTYPES, check_state_update_shapes, check_tensor
from vllm.triton_utils import HAS_TRITON, tl, triton
from vllm.triton_utils.launch import CachedLauncher

__all__ = ["selective_state_update_triton", "use_ssm_kernel"]

_NO_LIMIT = (0.0, math.inf)
_INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def discretize_dt(b_dt, dt_min, dt_max, DT_SOFTPLUS: tl.constexpr, HAS_DT_LIMIT: tl.constexpr):
    """dt after the bias: softplus (when asked) then the clamp, in fp32. Shared with the
    replayed update (``mamba_ssm_replay``), so both paths consume bit-identical dt."""
    if DT_SOFTPLUS:
        # softplus = log1p(u), u = exp(dt), with no log1p in tl: log(1 + u) alone would lose
        # small u entirely. log(w) * u / (w - 1), w = 1 + u, is log1p(u) to rounding
        # (Goldberg's trick) where log is accurate; below u = 1/64 a series (relative error
        # < 2e-8) needs no log, however rough the GPU's log is near 1. Past 20, softplus
        # is dt itself (F.softplus's threshold).
        b_u = tl.exp(tl.minimum(b_dt, 20.0))
        b_w = 1.0 + b_u
        b_log = tl.log(b_w) * (b_u / tl.where(b_w == 1.0, 1.0, b_w - 1.0))
        b_series = b_u * (1.0 - b_u * (0.5 - b_u * (0.3333333333333333 - 0.25 * b_u)))
        b_sp = tl.where(b_u < 0.015625, b_series, b_log)
        b_dt = tl.where(b_dt > 20.0, b_dt, b_sp)
    if HAS_DT_LIMIT:
        b_dt = tl.minimum(tl.maximum(b_dt, dt_min), dt_max)
    return b_dt


@triton.jit
def _selective_state_update_kernel(
    state_ptr,
    x_ptr,
    dt_ptr,
    A_ptr,
    B_ptr,
    C_ptr,
    D_ptr,
    dt_bias_ptr,
    idx_ptr,
    out_ptr,
    headdim,
    dstate,
    heads_per_group,
    pad_slot_id,
    dt_min,
    dt_max,
    stride_state_line,
    stride_state_head,
    stride_state_p,
    stride_state_n,
    stride_x_b,
    stride_x_h,
    stride_x_p,
    stride_dt_b,
    stride_dt_h,
    stride_A_h,
    stride_B_b,
    stride_B_g,
    stride_B_n,
    stride_C_b,
    stride_C_g,
    stride_C_n,
    stride_D_h,
    stride_dt_bias_h,
    stride_idx_b,
    stride_out_b,
    stride_out_h,
    stride_out_p,
    HAS_D: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
    HAS_DT_LIMIT: tl.constexpr,
    HAS_INDICES: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One program per (sequence, head, block of BLOCK_P state rows): it holds the
    # [BLOCK_P, BLOCK_N] state tile in registers between its one load and its one store.
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_p = tl.program_id(2).to(tl.int64)
    i_g = i_h // heads_per_group
    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P).to(tl.int64)
    o_n = tl.arange(0, BLOCK_N).to(tl.int64)
    m_p = o_p < headdim
    m_n = o_n < dstate
    if HAS_INDICES:
        line = tl.load(idx_ptr + i_b * stride_idx_b).to(tl.int64)
        live = (line != pad_slot_id) & (line >= 0)
        if (line == pad_slot_id) | (line < 0):
            # A padded row: y = 0 and nothing else. A mixed step's CUDA graph pads the
            # decode rows to its bucket, so most of its programs can be these: they must
            # cost no more than their one store.
            p_out = out_ptr + i_b * stride_out_b + i_h * stride_out_h + o_p * stride_out_p
            tl.store(p_out, tl.zeros([BLOCK_P], dtype=tl.float32).to(out_ptr.dtype.element_ty),
                     mask=m_p)  # fmt: skip
            return
    else:
        line = i_b
        live = i_b >= 0
    m_s = (m_p[:, None] & m_n[None, :]) & live

    b_dt = tl.load(dt_ptr + i_b * stride_dt_b + i_h * stride_dt_h).to(tl.float32)
    if HAS_DT_BIAS:
        b_dt += tl.load(dt_bias_ptr + i_h * stride_dt_bias_h).to(tl.float32)
    b_dt = discretize_dt(b_dt, dt_min, dt_max, DT_SOFTPLUS, HAS_DT_LIMIT)
    b_decay = tl.exp(b_dt * tl.load(A_ptr + i_h * stride_A_h).to(tl.float32))

    p_x = x_ptr + i_b * stride_x_b + i_h * stride_x_h + o_p * stride_x_p
    b_x = tl.load(p_x, mask=m_p, other=0.0).to(tl.float32)
    p_B = B_ptr + i_b * stride_B_b + i_g * stride_B_g + o_n * stride_B_n
    b_B = tl.load(p_B, mask=m_n, other=0.0).to(tl.float32)
    p_C = C_ptr + i_b * stride_C_b + i_g * stride_C_g + o_n * stride_C_n
    b_C = tl.load(p_C, mask=m_n, other=0.0).to(tl.float32)

    p_s = (
        state_ptr
        + line * stride_state_line
        + i_h * stride_state_head
        + o_p[:, None] * stride_state_p
        + o_n[None, :] * stride_state_n
    )
    b_s = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)
    b_s = b_s * b_decay + (b_dt * b_x)[:, None] * b_B[None, :]
    tl.store(p_s, b_s.to(state_ptr.dtype.element_ty), mask=m_s)

    b_y = tl.sum(b_s * b_C[None, :], axis=1)
    if HAS_D:
        b_y += tl.load(D_ptr + i_h * stride_D_h).to(tl.float32) * b_x
    b_y = tl.where(live, b_y, 0.0)
    p_out = out_ptr + i_b * stride_out_b + i_h * stride_out_h + o_p * stride_out_p
    tl.store(p_out, b_y.to(out_ptr.dtype.element_ty), mask=m_p)


# Launch with the compiled kernel cached by its specialisation (host cost).
_LAUNCH = CachedLauncher(_selective_state_update_kernel)


def use_ssm_kernel(x: torch.Tensor) -> bool:
    """CUDA tensors run the kernel; CPU tensors run it only under the interpreter
    (``CachedLauncher.runs_cpu_tensors``)."""
    return x.is_cuda or (x.device.type == "cpu" and _LAUNCH.runs_cpu_tensors())


def _update_config(batch: int, nheads: int, headdim: int, dstate: int) -> dict:
    # 4096 state elements per program on one warp (128 per thread): at dstate 128 a tile is
    # 32 rows, 16 KiB of fp32. H200 sweep (tune_selective_state_update.py, Codestral
    # shape): 285.7 us for 128 sequences with an fp32 pool (88.3% of copy) against 298.7
    # for 16 rows on 4 warps; 4.4-5.1% faster at 128 and 256 sequences, fp32 and bf16
    # pools (docs/benchmarks/selective_state_update_h200.md).
    block_n = max(1, triton.next_power_of_2(dstate))
    block_p = min(triton.next_power_of_2(headdim), max(1, 4096 // block_n))
    num_warps = max(1, min(4, block_p * block_n // 4096))
    return dict(BLOCK_P=block_p, BLOCK_N=block_n, num_warps=num_warps)


def _check_kernel_args(state, x, dt, A, B, C, D, dt_bias, state_batch_indices, out) -> None:
    device = x.device
    check_tensor("x", x, device, 3, FLOAT_DTYPES)
    for name, t in (("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("dt_bias", dt_bias)):
        if t is not None:
            check_tensor(name, t, device, None, FLOAT_DTYPES)
    check_tensor("state", state, device, None, FLOAT_DTYPES)
    if out is not None:
        check_tensor("out", out, device, None, FLOAT_DTYPES)
    if state_batch_indices is not None:
        check_tensor("state_batch_indices", state_batch_indices, device, None, _INDEX_DTYPES)
    check_state_update_shapes(state, x, dt, A, B, C, D, dt_bias, state_batch_indices, out)
    if not HAS_TRITON:
        raise RuntimeError("the selective-state-update kernel needs Triton, which is not installed")
    if not use_ssm_kernel(x):
        raise RuntimeError(
            f"the selective-state-update kernel runs on CUDA tensors, or on CPU tensors under "
            f"TRITON_INTERPRET=1 (set before the kernel is imported); x is on {device} "
            "(selective_state_update runs the PyTorch path there)"
        )


def _launch(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_lo: float,
    dt_hi: float,
    state_batch_indices: torch.Tensor | None,
    pad_slot_id: int,
    out: torch.Tensor,
) -> None:
    indices = state_batch_indices
    batch, nheads, headdim = x.shape
    ngroups, dstate = B.shape[1:]
    if x.numel() == 0:
        return
    cfg = _update_config(batch, nheads, headdim, dstate)
    grid = (batch, nheads, triton.cdiv(headdim, cfg["BLOCK_P"]))
    # An absent optional tensor passes x (never read: its flag compiles the load away) and
    # stride 0.
    args = (
        state,
        x,
        dt,
        A,
        B,
        C,
        x if D is None else D,
        x if dt_bias is None else dt_bias,
        x if indices is None else indices,
        out,
        headdim,
        dstate,
        nheads // ngroups,
        pad_slot_id,
        dt_lo,
        dt_hi,
        *state.stride(),
        *x.stride(),
        *dt.stride(),
        A.stride(0),
        *B.stride(),
        *C.stride(),
        0 if D is None else D.stride(0),
        0 if dt_bias is None else dt_bias.stride(0),
        0 if indices is None else indices.stride(0),
        *out.stride(),
    )
    constexprs = dict(
        HAS_D=D is not None,
        HAS_DT_BIAS=dt_bias is not None,
        DT_SOFTPLUS=bool(dt_softplus),
        HAS_DT_LIMIT=(dt_lo, dt_hi) != _NO_LIMIT,
        HAS_INDICES=indices is not None,
        **cfg,
    )
    _LAUNCH(grid, args, constexprs)


def selective_state_update_triton(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = _NO_LIMIT,
    state_batch_indices: torch.Tensor | None = None,
    pad_slot_id: int = NULL_BLOCK_ID,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fused kernel behind ``selective_state_update`` (same arguments and result); see
    the module docstring. Runs on CUDA tensors, or on CPU tensors under the interpreter."""
    _check_kernel_args(state, x, dt, A, B, C, D, dt_bias, state_batch_indices, out)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dt_lo, dt_hi = (float(v) for v in dt_limit)
    args = (state, x, dt, A, B, C, D, dt_bias, bool(dt_softplus), dt_lo, dt_hi,
            state_batch_indices, pad_slot_id, out)  # fmt: skip
    if torch.compiler.is_compiling():
        torch.ops.vllm.selective_state_update(*args)
    else:
        _launch(*args)
    return out


# --------------------------------------------------------------------------
# torch.library registration (for torch.compile and opcheck)
# --------------------------------------------------------------------------


# The op is the launcher itself (its annotations give the schema).
_selective_state_update_op = torch.library.custom_op(
    "vllm::selective_state_update", _launch, mutates_args=("state", "out")
)


@_selective_state_update_op.register_fake
def _(state, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_lo, dt_hi, state_batch_indices,
      pad_slot_id, out):  # fmt: skip
    return None
