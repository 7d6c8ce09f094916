"""Triton kernels of the model's two norms, each one pass over its rows.

RMSNorm with the residual add fused (as vLLM's ``fused_add_rms_norm``)::

    s = x + residual            (when a residual is given; written back into ``residual``)
    y = w * s / sqrt(mean(s^2) + eps)

and Mamba2's gated, grouped RMSNorm::

    g = x * silu(z)
    y = w * g / sqrt(mean_group(g^2) + eps)      over groups of ``group_size`` channels

Rows are tokens: x, z, residual and y are (num_rows, hidden) with stride(-1) == 1 (rows may
be strided). Math is fp32; y is stored in its own dtype, the residual in its own. Unfused,
the PyTorch versions (``layernorm.py``, which stay the CPU path and the reference) read and
write fp32 copies of the rows about ten times: 25 ms of a 2048-token step of the
Codestral-7B shape went to the gated norm alone.

One program per (row, group); a group wider than ``BLOCK`` is walked twice (sum of
squares, then the normalised store), its second read mostly from cache. Under Triton's
interpreter (CPU tensors), whose cost is per operation whatever the tile, a program takes a
block of rows instead (``ROWS``): the test suite's engines run their norms in a fraction of
the programs. The row count is not specialised on (``do_not_specialize``), so one compiled
variant serves every step.
"""

from __future__ import annotations

import torch

from vllm.tensor_checks import FLOAT_DTYPES, check_tensor
from vllm.triton_utils import HAS_TRITON, tl, triton
from vllm.triton_utils.launch import CachedLauncher

_MAX_BLOCK = 4096
_INTERPRETER_TILE = 4096


@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    y_ptr,
    num_rows,
    hidden,
    group_size,
    eps,
    stride_x_row,
    stride_res_row,
    stride_y_row,
    HAS_RESIDUAL: tl.constexpr,
    HAS_GATE: tl.constexpr,
    BLOCK: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
    ROWS: tl.constexpr,
):
    # Gated: res_ptr is z (the gate), never written. Otherwise, with HAS_RESIDUAL,
    # res_ptr is the residual, read and overwritten with x + residual.
    i_g = tl.program_id(1).to(tl.int64)
    col0 = i_g * group_size
    if ROWS > 1:  # a block of rows per program, one pass (SINGLE_PASS): _config says when
        o_r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        o_c = tl.arange(0, BLOCK)
        m2 = (o_r < num_rows)[:, None] & (o_c < group_size)[None, :]
        b_s = tl.load(x_ptr + o_r[:, None] * stride_x_row + col0 + o_c[None, :], mask=m2,
                      other=0.0).to(tl.float32)  # fmt: skip
        p_r2 = res_ptr + o_r[:, None] * stride_res_row + col0 + o_c[None, :]
        if HAS_GATE:
            b_z = tl.load(p_r2, mask=m2, other=0.0).to(tl.float32)
            b_s = b_s * b_z * tl.sigmoid(b_z)
        elif HAS_RESIDUAL:
            b_s += tl.load(p_r2, mask=m2, other=0.0).to(tl.float32)
            tl.store(p_r2, b_s.to(res_ptr.dtype.element_ty), mask=m2)
        b_rstd = tl.rsqrt(tl.sum(b_s * b_s, axis=1) / group_size + eps)
        b_w = tl.load(w_ptr + col0 + o_c, mask=o_c < group_size, other=0.0).to(tl.float32)
        b_y = b_s * b_rstd[:, None] * b_w[None, :]
        p_y2 = y_ptr + o_r[:, None] * stride_y_row + col0 + o_c[None, :]
        tl.store(p_y2, b_y.to(y_ptr.dtype.element_ty), mask=m2)
    else:
        i_row = tl.program_id(0).to(tl.int64)
        p_x = x_ptr + i_row * stride_x_row + col0
        p_r = res_ptr + i_row * stride_res_row + col0
        p_y = y_ptr + i_row * stride_y_row + col0
        o = tl.arange(0, BLOCK)
        b_sq = tl.zeros([BLOCK], dtype=tl.float32)
        if SINGLE_PASS:
            m = o < group_size
            b_s = tl.load(p_x + o, mask=m, other=0.0).to(tl.float32)
            if HAS_GATE:
                b_z = tl.load(p_r + o, mask=m, other=0.0).to(tl.float32)
                b_s = b_s * b_z * tl.sigmoid(b_z)
            elif HAS_RESIDUAL:
                b_s += tl.load(p_r + o, mask=m, other=0.0).to(tl.float32)
                tl.store(p_r + o, b_s.to(res_ptr.dtype.element_ty), mask=m)
            b_rstd = tl.rsqrt(tl.sum(b_s * b_s, axis=0) / group_size + eps)
            b_w = tl.load(w_ptr + col0 + o, mask=m, other=0.0).to(tl.float32)
            tl.store(p_y + o, (b_s * b_rstd * b_w).to(y_ptr.dtype.element_ty), mask=m)
        else:
            for start in range(0, group_size, BLOCK):
                oc = start + o
                m = oc < group_size
                b_s = tl.load(p_x + oc, mask=m, other=0.0).to(tl.float32)
                if HAS_GATE:
                    b_z = tl.load(p_r + oc, mask=m, other=0.0).to(tl.float32)
                    b_s = b_s * b_z * tl.sigmoid(b_z)
                elif HAS_RESIDUAL:
                    b_s += tl.load(p_r + oc, mask=m, other=0.0).to(tl.float32)
                    tl.store(p_r + oc, b_s.to(res_ptr.dtype.element_ty), mask=m)
                b_sq += b_s * b_s
            b_rstd = tl.rsqrt(tl.sum(b_sq, axis=0) / group_size + eps)
            for start in range(0, group_size, BLOCK):
                oc = start + o
                m = oc < group_size
                if HAS_GATE:
                    b_s = tl.load(p_x + oc, mask=m, other=0.0).to(tl.float32)
                    b_z = tl.load(p_r + oc, mask=m, other=0.0).to(tl.float32)
                    b_s = b_s * b_z * tl.sigmoid(b_z)
                elif HAS_RESIDUAL:
                    b_s = tl.load(p_r + oc, mask=m, other=0.0).to(tl.float32)
                else:
                    b_s = tl.load(p_x + oc, mask=m, other=0.0).to(tl.float32)
                b_w = tl.load(w_ptr + col0 + oc, mask=m, other=0.0).to(tl.float32)
                tl.store(p_y + oc, (b_s * b_rstd * b_w).to(y_ptr.dtype.element_ty), mask=m)


_LAUNCH = CachedLauncher(_rms_norm_kernel)


def use_norm_kernel(x: torch.Tensor) -> bool:
    """CUDA tensors run the kernel; CPU tensors only under the interpreter."""
    return HAS_TRITON and (x.is_cuda or (x.device.type == "cpu" and _LAUNCH.runs_cpu_tensors()))


def _config(group_size: int, elem_size: int, interpreted: bool) -> dict:
    # 16 bytes per thread per load; a 4096-channel bf16 row is one 8-warp pass.
    block = min(triton.next_power_of_2(group_size), _MAX_BLOCK)
    num_warps = max(1, min(8, block * elem_size // (16 * 32)))
    single = group_size <= block
    # Under the interpreter (CPU tensors) a program costs per operation, whatever its tile:
    # there a program takes _INTERPRETER_TILE elements' rows, a fixed count (the row count is
    # not specialised on there either: the start-up's warm-up launches every variant). The
    # GPU takes one row per program (ROWS = 1).
    rows = max(1, _INTERPRETER_TILE // block) if interpreted and single else 1
    return dict(BLOCK=block, SINGLE_PASS=single, ROWS=rows, num_warps=num_warps)


def _check(name, t, x, hidden) -> None:
    check_tensor(name, t, x.device, 2, FLOAT_DTYPES)
    if t.shape != x.shape or t.stride(1) != 1:
        raise ValueError(
            f"{name} must be (num_rows, {hidden}) with stride(1) == 1 like x, got shape "
            f"{tuple(t.shape)} strides {t.stride()}"
        )


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    group_size: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """y of the module docstring (``gate``: the gated norm; else ``residual``, updated in
    place, or the plain norm); y in ``out_dtype`` (default: the weight's dtype)."""
    check_tensor("x", x, x.device, 2, FLOAT_DTYPES)
    rows, hidden = x.shape
    if x.stride(1) != 1:
        raise ValueError(f"x must have stride(1) == 1, got strides {x.stride()}")
    check_tensor("weight", weight, x.device, 1, FLOAT_DTYPES)
    if weight.shape[0] != hidden or weight.stride(0) != 1:
        raise ValueError(f"weight must be contiguous ({hidden},), got {tuple(weight.shape)}")
    if gate is not None and residual is not None:
        raise ValueError("give a gate (the gated norm) or a residual, not both")
    for name, t in (("gate", gate), ("residual", residual)):
        if t is not None:
            _check(name, t, x, hidden)
    group = hidden if group_size is None else group_size
    if group < 1 or hidden % group:
        raise ValueError(f"group_size={group} must divide hidden={hidden}")
    y = torch.empty(rows, hidden, dtype=out_dtype or weight.dtype, device=x.device)
    if rows == 0:
        return y
    second = gate if gate is not None else residual
    cfg = _config(group, x.element_size(), not x.is_cuda)
    args = (
        x,
        x if second is None else second,
        weight,
        y,
        rows,
        hidden,
        group,
        float(eps),
        x.stride(0),
        0 if second is None else second.stride(0),
        y.stride(0),
    )
    constexprs = dict(HAS_RESIDUAL=residual is not None, HAS_GATE=gate is not None, **cfg)
    _LAUNCH((triton.cdiv(rows, cfg["ROWS"]), hidden // group), args, constexprs)
    return y
