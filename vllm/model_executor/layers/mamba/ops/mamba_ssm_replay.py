"""Replayed Mamba2 decode (ReplaySSM): the state is read every step, written every L-th.

A pool line's state h0 stays as it was written last; the ring beside it keeps each later
decode step's inputs (x, B, and dt after bias/softplus/clamp), n of them (0 <= n <= L-1).
For head h of a row (group g, a = A[h] < 0, this step's dt, x, B, C)::

    s_k   = dt_k a                          for ring entries k < n, and s_now = dt a
    w_k   = exp(s_{k+1} + ... + s_{n-1} + s_now) dt_k        (decay from after k to now)
    h_now = exp(s_0 + ... + s_{n-1} + s_now) h0 + sum_k w_k x_k B_k^T + dt x B^T
    y     = h_now C + D x  =  exp(sum s) (h0 C) + sum_k w_k (B_k . C) x_k + dt (B . C) x + D x

An ordinary step (n < L-1) reads h0 once, computes y by the right-hand form (h_now is never
formed) and appends (x, B, dt) at entry n; the L-th step (n == L-1, the flush) computes y
the same way, then forms h_now, writes it to the pool line in the pool's dtype, and sets
n = 0. So each line is read every
step but written every L-th: at L = 16 a decode moves about 17/32 of the every-step
update's state bytes. Each row keeps its own phase (its counter), so rows flush on their
own steps and nothing is decided on the host: the launch depends on shapes only and can
be captured in a CUDA graph. The math is fp32 whatever the dtypes; ring values are exactly
what the every-step kernel consumes (dt through the same ``discretize_dt``).

``replay_ssm_materialise`` folds the ring of given lines into their states (counters to 0),
for anything about to read a state: a prefill that continues a line (the SSD), and the
``materialise`` hook of the model runner. Lines whose ``has_initial_state`` is False only
get their counters reset: their old state is about to be replaced.

Tensors (logical shapes; any strides; lines addressed in int64), ``ReplayedSSMState``:

- ``state`` (lines, nheads, headdim, dstate) fp32/fp16/bf16; ``ring_x`` (lines, nheads,
  L-1, headdim) and ``ring_B`` (lines, ngroups, L-1, dstate) in the activation dtype;
  ``ring_dt`` (lines, nheads, L-1) fp32; ``count`` (lines, nheads, headdim) int8, one copy
  of the line's n per state row: a program owns the counters of its rows, so any block of
  rows per program is race-free (programs of one row run in any order).
- ``x`` (batch, nheads, headdim), ``dt`` (batch, nheads) before the bias, ``B``, ``C``
  (batch, ngroups, dstate), ``A``, ``D``, ``dt_bias`` (nheads,), ``state_batch_indices``
  (batch,) int32/int64, distinct lines for real rows; ``out`` (batch, nheads, headdim).

Mutated in place: ``state`` (flushing rows), the ring, ``count``; ``out`` is written in
full. Padded rows (``pad_slot_id``) read and write nothing and get y = 0. Launch
configurations come from ``configs/replayssm/`` (``vllm.triton_utils.configs``). CUDA
tensors run the kernel, CPU tensors run it under ``TRITON_INTERPRET=1`` and the fp32
reference (``mamba_ssm_replay_ref``) otherwise.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import torch

from vllm.model_executor.layers.mamba.ops.causal_conv1d_ref import PAD_SLOT_ID
from vllm.model_executor.layers.mamba.ops.mamba_ssm_replay_ref import (
    ReplayedSSMState,
    replay_materialise_ref,
    replay_update_ref,
)
from vllm.model_executor.layers.mamba.ops.mamba_ssm_triton import discretize_dt
from vllm.tensor_checks import FLOAT_DTYPES, check_state_update_shapes, check_tensor
from vllm.triton_utils import configs, tl, triton
from vllm.triton_utils.host import recording
from vllm.triton_utils.launch import CachedLauncher

__all__ = ["ReplayedSSMState", "replay_ssm_materialise", "replay_ssm_update"]

_NO_LIMIT = (0.0, math.inf)
_INDEX_DTYPES = (torch.int32, torch.int64)
CONFIG_DIR = Path(__file__).parent / "configs" / "replayssm"
# Batch sizes the launch tables are keyed by: a batch takes the first >= it (else the last).
BATCH_BUCKETS = (1, 8, 32, 128, 512)


@triton.jit
def _ring_weights(p_rdt, stride_rdt_k, b_n, b_a, b_now, RING: tl.constexpr, BLOCK_K: tl.constexpr):
    """The decay weights of the ring's valid entries (k < n): w_k = exp(s_{k+1} + ... +
    s_{n-1} + s_now) dt_k, and the whole window's decay exp(s_0 + ... + s_{n-1} + s_now).
    The later entries' decays are summed term by term (a masked sum), never as differences
    of cumulative sums, which would lose the small ones; invalid entries have dt = 0."""
    o_k = tl.arange(0, BLOCK_K)
    m_k = (o_k < b_n) & (o_k < RING)
    b_rdt = tl.load(p_rdt + o_k * stride_rdt_k, mask=m_k, other=0.0)
    b_s = b_rdt * b_a
    b_later = tl.sum(tl.where(o_k[None, :] > o_k[:, None], b_s[None, :], 0.0), axis=1)
    b_w = tl.exp(b_later + b_now) * b_rdt
    b_decay = tl.exp(tl.sum(b_s, axis=0) + b_now)
    return b_w, b_decay


@triton.jit
def _fold_tile(b_h, b_X, b_w, b_n, p_rx, p_rB, stride_rx_k, stride_rx_p, stride_rB_k,
               stride_rB_n, o_p, o_n, o_k, m_p, m_n, m_k,
               FLUSH_DOT: tl.constexpr, FLUSH_XSPLIT: tl.constexpr):  # fmt: skip
    """A state tile (BLOCK_P rows x BLOCK_N of dstate, fp32, already decayed) plus the ring:
    h += sum_k w_k x_k B_k^T over the valid entries (k < n)."""
    if FLUSH_DOT:
        # The ring as one tensor-core product: (x_k w_k) over k times the ring's B tile,
        # fp32 operands (entries k >= n are zero in b_X) split in three tf32 products
        # (about fp32's accuracy; an "ieee" fp32 dot spills at every tile:
        # benchmarks/kernels/replay_compile_report.py).
        p_Bt = p_rB + o_k[:, None] * stride_rB_k + o_n[None, :] * stride_rB_n
        b_Bt = tl.load(p_Bt, mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_XW = b_X * b_w[None, :]
        if FLUSH_XSPLIT and p_rB.dtype.element_ty != tl.float32:
            # "xsplit": the ring's B is exact in its 16-bit dtype, so only the weighted x
            # needs splitting: three parts of that dtype (hi, mid, lo: about fp32's 24
            # bits), each product with B exact and summed in fp32 by the tensor core. Half
            # tf32x3's products, 16-bit operands.
            ty = p_rB.dtype.element_ty
            b_hi = b_XW.to(ty)
            b_rest = b_XW - b_hi.to(tl.float32)
            b_mid = b_rest.to(ty)
            b_lo = (b_rest - b_mid.to(tl.float32)).to(ty)
            b_h = tl.dot(b_hi, b_Bt, acc=b_h)
            b_h = tl.dot(b_mid, b_Bt, acc=b_h)
            b_h = tl.dot(b_lo, b_Bt, acc=b_h)
        else:
            b_h += tl.dot(b_XW, b_Bt.to(tl.float32), input_precision="tf32x3")
    else:
        # One rank-1 fp32 update per valid entry (plain fp32 FMAs, no operand tiles held
        # in registers; each entry's loads wait on the loop).
        for k in range(0, b_n):
            w_k = tl.sum(tl.where(o_k == k, b_w, 0.0), axis=0)
            b_xk = tl.load(p_rx + k * stride_rx_k + o_p * stride_rx_p, mask=m_p, other=0.0)
            b_Bk = tl.load(p_rB + k * stride_rB_k + o_n * stride_rB_n, mask=m_n, other=0.0)
            b_h += (w_k * b_xk.to(tl.float32))[:, None] * b_Bk.to(tl.float32)[None, :]
    return b_h


@triton.jit(do_not_specialize=["idx_ptr"])
def _replay_bc_kernel(
    ring_B_ptr, count_ptr, B_ptr, C_ptr, idx_ptr, bc_ptr,
    dstate, heads_per_group, pad_slot_id,
    stride_rB_line, stride_rB_group, stride_rB_k, stride_rB_n,
    stride_cnt_line, stride_cnt_head,
    stride_B_b, stride_B_g, stride_B_n, stride_C_b, stride_C_g, stride_C_n,
    stride_idx_b, stride_bc_b, stride_bc_g,
    RING: tl.constexpr,
    BLOCK_KB: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    # "bc_pre": one program per (row, group) computes the step's products B_k . C of the
    # ring's valid entries (k < n) and B . C of this step (at entry RING), once for the
    # group's heads, which then read BLOCK_KB floats instead of the ring's B tiles.
    i_b = tl.program_id(0).to(tl.int64)
    i_g = tl.program_id(1)
    line = tl.load(idx_ptr + i_b * stride_idx_b).to(tl.int64)
    if line == pad_slot_id:
        return
    i_h = (i_g * heads_per_group).to(tl.int64)  # the group's first head: every head's n
    b_n = tl.load(count_ptr + line * stride_cnt_line + i_h * stride_cnt_head).to(tl.int32)
    o_k = tl.arange(0, BLOCK_KB)
    m_k = (o_k < b_n) & (o_k < RING)
    p_rB = ring_B_ptr + line * stride_rB_line + i_g.to(tl.int64) * stride_rB_group
    p_B = B_ptr + i_b * stride_B_b + i_g * stride_B_g
    p_C = C_ptr + i_b * stride_C_b + i_g * stride_C_g
    o_n = tl.arange(0, BLOCK_N)  # the whole dstate
    m_n = o_n < dstate
    b_C = tl.load(p_C + o_n * stride_C_n, mask=m_n, other=0.0).to(tl.float32)
    p_Bs = p_rB + o_k[:, None] * stride_rB_k + o_n[None, :] * stride_rB_n
    b_Bs = tl.load(p_Bs, mask=m_k[:, None] & m_n[None, :], other=0.0).to(tl.float32)
    b_Bcur = tl.load(p_B + o_n * stride_B_n, mask=m_n, other=0.0).to(tl.float32)
    b_Bs = tl.where(o_k[:, None] == RING, b_Bcur[None, :], b_Bs)
    b_bc = tl.sum(b_Bs * b_C[None, :], axis=1)
    p_bc = bc_ptr + i_b * stride_bc_b + i_g.to(tl.int64) * stride_bc_g
    tl.store(p_bc + o_k, b_bc, mask=o_k <= RING)


# The lines may be a slice of the step's index buffer at any offset (the prefills' follow
# the decodes'): their alignment must not select the compiled variant (nor bc_pre's buffer's).
@triton.jit(do_not_specialize=["idx_ptr", "init_ptr", "bc_ptr"])
def _replay_ssm_kernel(
    state_ptr, ring_x_ptr, ring_B_ptr, ring_dt_ptr, count_ptr,
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, idx_ptr, init_ptr, out_ptr, bc_ptr,
    headdim, dstate, heads_per_group, pad_slot_id, dt_min, dt_max,
    stride_state_line, stride_state_head, stride_state_p, stride_state_n,
    stride_rx_line, stride_rx_head, stride_rx_k, stride_rx_p,
    stride_rB_line, stride_rB_group, stride_rB_k, stride_rB_n,
    stride_rdt_line, stride_rdt_head, stride_rdt_k,
    stride_cnt_line, stride_cnt_head, stride_cnt_p,
    stride_x_b, stride_x_h, stride_x_p, stride_dt_b, stride_dt_h, stride_A_h,
    stride_B_b, stride_B_g, stride_B_n, stride_C_b, stride_C_g, stride_C_n,
    stride_D_h, stride_dt_bias_h, stride_idx_b, stride_init_b,
    stride_out_b, stride_out_h, stride_out_p, stride_bc_b, stride_bc_g,
    RING: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STEP: tl.constexpr,
    HAS_INIT: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
    HAS_DT_LIMIT: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    N_TILES: tl.constexpr,
    FLUSH_DOT: tl.constexpr,
    FLUSH_XSPLIT: tl.constexpr,
    BC_PRE: tl.constexpr,
    FUSE_FLUSH: tl.constexpr,
    PART: tl.constexpr,
):  # fmt: skip
    # One program per (block of BLOCK_P state rows, head, row); the row's programs are
    # adjacent in launch order, so its ring entries come from memory once. The state is
    # streamed in N_TILES tiles of (BLOCK_P, BLOCK_N) along dstate. STEP: a decode step
    # (output, then append or flush); else materialise (flush, no output). PART 0: the
    # whole step; a step split in two launches: PART 1 the output and the appends (a full
    # ring's row is marked with a count of -1: a row its append just filled must not
    # flush), then PART 2 the marked rows' flushes (other rows return at once), so the
    # ordinary steps' kernel holds no flush code.
    # Addressing: a line's and a head's offsets are int64 scalars, a tile's are int32.
    i_p = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2).to(tl.int64)
    i_g = i_h // heads_per_group
    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)
    o_t = tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    m_p = o_p < headdim
    line = tl.load(idx_ptr + i_b * stride_idx_b).to(tl.int64)
    if line == pad_slot_id:
        # A padded row reads and writes nothing but its output: zeros.
        if STEP and PART != 2:
            p_out = out_ptr + i_b * stride_out_b + i_h.to(tl.int64) * stride_out_h
            tl.store(
                p_out + o_p * stride_out_p,
                tl.zeros([BLOCK_P], tl.float32).to(out_ptr.dtype.element_ty),
                mask=m_p,
            )
        return

    p_cnt = count_ptr + line * stride_cnt_line + i_h.to(tl.int64) * stride_cnt_head
    b_n = tl.load(p_cnt + i_p * BLOCK_P * stride_cnt_p).to(tl.int32)
    if PART == 2:  # only the rows PART 1 marked full (count -1), with their RING entries
        if b_n >= 0:
            return
        b_n = b_n * 0 + RING
    m_k = (o_k < b_n) & (o_k < RING)
    p_s = state_ptr + line * stride_state_line + i_h.to(tl.int64) * stride_state_head
    p_rx = ring_x_ptr + line * stride_rx_line + i_h.to(tl.int64) * stride_rx_head
    p_rB = ring_B_ptr + line * stride_rB_line + i_g.to(tl.int64) * stride_rB_group
    p_rdt = ring_dt_ptr + line * stride_rdt_line + i_h.to(tl.int64) * stride_rdt_head
    b_a = tl.load(A_ptr + i_h * stride_A_h).to(tl.float32)
    p_X = p_rx + o_p[:, None] * stride_rx_p + o_k[None, :] * stride_rx_k
    b_X = tl.load(p_X, mask=m_p[:, None] & m_k[None, :], other=0.0).to(tl.float32)
    if STEP:
        b_dt = tl.load(dt_ptr + i_b * stride_dt_b + i_h * stride_dt_h).to(tl.float32)
        if HAS_DT_BIAS:
            b_dt += tl.load(dt_bias_ptr + i_h * stride_dt_bias_h).to(tl.float32)
        b_dt = discretize_dt(b_dt, dt_min, dt_max, DT_SOFTPLUS, HAS_DT_LIMIT)
        b_now = b_dt * b_a
        flush = b_n >= RING
        p_x = x_ptr + i_b * stride_x_b + i_h * stride_x_h
        b_x = tl.load(p_x + o_p * stride_x_p, mask=m_p, other=0.0)
        b_xf = b_x.to(tl.float32)
        p_B = B_ptr + i_b * stride_B_b + i_g * stride_B_g
        p_C = C_ptr + i_b * stride_C_b + i_g * stride_C_g
    else:
        b_dt = 0.0
        b_now = 0.0
        flush = b_n > 0
        if HAS_INIT:
            flush = flush & (tl.load(init_ptr + i_b * stride_init_b) != 0)
    b_w, b_decay = _ring_weights(p_rdt, stride_rdt_k, b_n, b_a, b_now, RING, BLOCK_K)
    keep = False  # PART 1: a full ring is left for PART 2, marked by a count of -1
    if PART == 1:
        keep = flush
        flush = False

    if STEP and PART != 2:
        # y from h0 and the ring, whether or not this step flushes (so the state's loads
        # wait for the line only, not for its counter; a flush's y is the same h_now C):
        #   y = exp(sum s) (h0 . C) + sum_k w_k (B_k . C) x_k + dt (B . C) x.
        b_hc = tl.zeros([BLOCK_P], tl.float32)
        b_cb = tl.zeros([BLOCK_K], tl.float32)
        b_bc = tl.zeros([BLOCK_N], tl.float32)
        for t in tl.static_range(N_TILES):
            o_n = t * BLOCK_N + o_t
            m_n = o_n < dstate
            p_st = p_s + o_p[:, None] * stride_state_p + o_n[None, :] * stride_state_n
            b_h0 = tl.load(p_st, mask=m_p[:, None] & m_n[None, :], other=0.0).to(tl.float32)
            b_C = tl.load(p_C + o_n * stride_C_n, mask=m_n, other=0.0).to(tl.float32)
            b_hc += tl.sum(b_h0 * b_C[None, :], axis=1)
            if not BC_PRE:
                p_Bs = p_rB + o_k[:, None] * stride_rB_k + o_n[None, :] * stride_rB_n
                b_Bs = tl.load(p_Bs, mask=m_k[:, None] & m_n[None, :], other=0.0)
                b_cb += tl.sum(b_Bs.to(tl.float32) * b_C[None, :], axis=1)
                b_Bcur = tl.load(p_B + o_n * stride_B_n, mask=m_n, other=0.0)
                b_bc += b_Bcur.to(tl.float32) * b_C
            if FUSE_FLUSH:
                # fuse_flush: a flushing row folds and writes this tile from the h0 it has
                # just read (y still comes from h0 by the right-hand form), so the flush
                # reads no tile a second time; the state's loads still wait on nothing.
                if flush:
                    b_h = _fold_tile(b_h0 * b_decay, b_X, b_w, b_n, p_rx, p_rB, stride_rx_k,
                                     stride_rx_p, stride_rB_k, stride_rB_n, o_p, o_n, o_k,
                                     m_p, m_n, m_k, FLUSH_DOT, FLUSH_XSPLIT)  # fmt: skip
                    b_Bn = tl.load(p_B + o_n * stride_B_n, mask=m_n, other=0.0)
                    b_h += (b_dt * b_xf)[:, None] * b_Bn.to(tl.float32)[None, :]
                    tl.store(p_st, b_h.to(state_ptr.dtype.element_ty),
                             mask=m_p[:, None] & m_n[None, :])  # fmt: skip
        if BC_PRE:
            # B_k . C and B . C from _replay_bc_kernel (this row and group, this step):
            # the ring's B tiles are not read for the output.
            p_bc = bc_ptr + i_b * stride_bc_b + i_g.to(tl.int64) * stride_bc_g
            b_cb = tl.load(p_bc + o_k, mask=m_k, other=0.0)
            b_bcnow = tl.load(p_bc + RING)
        else:
            b_bcnow = tl.sum(b_bc, axis=0)
        b_y = b_decay * b_hc + tl.sum(b_X * (b_w * b_cb)[None, :], axis=1)
        b_y += (b_dt * b_bcnow) * b_xf
        if HAS_D:
            b_y += tl.load(D_ptr + i_h * stride_D_h).to(tl.float32) * b_xf
        p_out = out_ptr + i_b * stride_out_b + i_h.to(tl.int64) * stride_out_h
        tl.store(p_out + o_p * stride_out_p, b_y.to(out_ptr.dtype.element_ty), mask=m_p)

    if flush:
        # h = exp(sum s) h0 + sum_k w_k x_k B_k^T (+ dt x B^T), per dstate tile, written
        # back in the pool's dtype (the tiles were just read: they come from the cache);
        # with fuse_flush a whole decode step has written them in its output pass.
        for t in tl.static_range(0 if FUSE_FLUSH and STEP and PART == 0 else N_TILES):
            o_n = t * BLOCK_N + o_t
            m_n = o_n < dstate
            m_s = m_p[:, None] & m_n[None, :]
            p_st = p_s + o_p[:, None] * stride_state_p + o_n[None, :] * stride_state_n
            b_h = tl.load(p_st, mask=m_s, other=0.0).to(tl.float32) * b_decay
            b_h = _fold_tile(b_h, b_X, b_w, b_n, p_rx, p_rB, stride_rx_k, stride_rx_p,
                             stride_rB_k, stride_rB_n, o_p, o_n, o_k, m_p, m_n, m_k,
                             FLUSH_DOT, FLUSH_XSPLIT)  # fmt: skip
            if STEP:
                b_Bn = tl.load(p_B + o_n * stride_B_n, mask=m_n, other=0.0).to(tl.float32)
                b_h += (b_dt * b_xf)[:, None] * b_Bn[None, :]
            tl.store(p_st, b_h.to(state_ptr.dtype.element_ty), mask=m_s)
        b_n_new = b_n * 0
    elif keep:
        b_n_new = b_n * 0 - 1
    else:
        if STEP:
            # Append this step at entry n: x by every program (its rows), dt by the head's
            # first program, B by its group's first head's.
            first = i_p == 0
            tl.store(p_rx + b_n * stride_rx_k + o_p * stride_rx_p, b_x, mask=m_p)
            tl.store(p_rdt + b_n * stride_rdt_k, b_dt.to(ring_dt_ptr.dtype.element_ty),
                     mask=first)  # fmt: skip
            lead = first & (i_h % heads_per_group == 0)
            for t in tl.static_range(N_TILES):
                o_n = t * BLOCK_N + o_t
                m_n = o_n < dstate
                b_Bapp = tl.load(p_B + o_n * stride_B_n, mask=m_n & lead, other=0.0)
                tl.store(p_rB + b_n * stride_rB_k + o_n * stride_rB_n, b_Bapp, mask=m_n & lead)
            b_n_new = b_n + 1
        else:
            b_n_new = b_n * 0
    tl.store(p_cnt + o_p * stride_cnt_p, tl.zeros([BLOCK_P], tl.int32) + b_n_new, mask=m_p)


# Launch with the compiled kernel cached by its specialisation (host cost).
_LAUNCH = CachedLauncher(_replay_ssm_kernel)
_LAUNCH_BC = CachedLauncher(_replay_bc_kernel)


@functools.cache
def _engine_defaults() -> dict:
    with (CONFIG_DIR / "engine_default.json").open() as f:
        return json.load(f)["devices"]


def default_on(device: torch.device, state_dtype: torch.dtype) -> bool:
    """Whether ``use_replayssm`` left unset turns replayed decode on for ``device`` and an SSM
    state of ``state_dtype``: only where ``configs/replayssm/engine_default.json`` lists the
    GPU as on (for every state dtype, or for this one: ``{"float32": true, ...}``), where
    replay measured faster at every batch from 8 and no slower at 1 (issue 30's rule); off
    elsewhere, and for a state dtype the entry does not name."""
    if device.type != "cuda":
        return False
    on = _engine_defaults().get(configs.device_file_name(device), {}).get("use_replayssm")
    if isinstance(on, dict):
        on = on.get(str(state_dtype).removeprefix("torch."))
    return on is True


def use_replay_kernel(x: torch.Tensor) -> bool:
    """CUDA tensors run the kernel; CPU tensors only under the interpreter."""
    return x.is_cuda or (x.device.type == "cpu" and _LAUNCH.runs_cpu_tensors())


def batch_bucket(batch: int) -> int:
    return next((b for b in BATCH_BUCKETS if b >= batch), BATCH_BUCKETS[-1])


def launch_config(batch: int, headdim: int, dstate: int, state_dtype: torch.dtype) -> dict:
    """The table's entry (``configs/replayssm/``) for this shape and batch bucket: BLOCK_P
    (state rows per program, capped at the head), BLOCK_N (the dstate tile the state is
    streamed in; absent: the whole dstate), num_warps and optionally num_stages and flush
    (``_blocks``)."""
    return dict(_config(batch_bucket(batch), headdim, dstate, state_dtype))


@functools.cache  # a lookup builds a key and walks the tables: not per launch
def _config(bucket: int, headdim: int, dstate: int, state_dtype: torch.dtype) -> dict:
    key = configs.table_key(batch=bucket, dstate=dstate, headdim=headdim, state_dtype=state_dtype)
    return configs.lookup(CONFIG_DIR, key)


FLUSHES = ("loop", "tf32x3", "xsplit")


def _blocks(cfg: dict, headdim: int, dstate: int, step: bool = True) -> dict:
    """The constexprs a configuration gives at this shape (tiles are powers of two).
    ``flush``: how a flush folds the ring into the state, "loop" (default: a rank-1 fp32
    update per entry), "tf32x3" (one ``tl.dot`` in three tf32 products, where both tiles
    are at least 16, ``tl.dot``'s least; else the loop), "xsplit" (as tf32x3, but three
    products of 16-bit operands: the weighted x in three parts of the ring's dtype times
    the ring's B as stored; with fp32 rings tf32x3). ``bc_pre``: a decode step's products
    B_k . C computed once per row and group by a launch ahead (``BC_PRE``), not by each
    head's programs from the ring's B tiles. ``fuse_flush``: a flushing row of a whole decode
    step folds and writes each state tile in the output pass, from the tile that pass read
    (no second read). ``split_flush``: a decode step as two launches
    (``SPLIT``, taken off by ``_launch``): the outputs and appends, whose kernel then holds
    no flush code, and the full rings' flushes. bc_pre and fuse_flush are a decode step's
    options: off for a materialisation (``step`` False)."""
    full_p, full_n = triton.next_power_of_2(headdim), triton.next_power_of_2(dstate)
    block_n = min(int(cfg.get("BLOCK_N", full_n)), full_n)
    block_p = min(int(cfg["BLOCK_P"]), full_p)
    flush = cfg.get("flush", "loop")
    if flush not in FLUSHES:
        raise ValueError(f"replayssm launch table: flush must be one of {FLUSHES}, got {flush!r}")
    dot = flush in ("tf32x3", "xsplit") and block_p >= 16 and block_n >= 16
    out = dict(
        BLOCK_P=block_p,
        BLOCK_N=block_n,
        N_TILES=triton.cdiv(full_n, block_n),
        num_warps=int(cfg.get("num_warps", 1)),
        FLUSH_DOT=dot,
        FLUSH_XSPLIT=dot and flush == "xsplit",
        BC_PRE=step and bool(cfg.get("bc_pre", False)),
        FUSE_FLUSH=step and bool(cfg.get("fuse_flush", False)),
        SPLIT=bool(cfg.get("split_flush", False)),
    )
    if "num_stages" in cfg:
        out["num_stages"] = int(cfg["num_stages"])
    return out


def _parts(blocks: dict, step: bool) -> tuple[int, ...]:
    """The launches' PART values for ``_blocks``' constexprs (``SPLIT`` taken off them): a
    split decode step's two, else the whole step or materialisation in one."""
    return (1, 2) if blocks.pop("SPLIT") and step else (0,)


def _check(rs: ReplayedSSMState, x: torch.Tensor, tensors: dict) -> None:
    device = x.device
    check_tensor("state", rs.state, device, 4, FLOAT_DTYPES)
    for name in ("ring_x", "ring_B"):
        check_tensor(name, getattr(rs, name), device, 4, FLOAT_DTYPES)
    check_tensor("ring_dt", rs.ring_dt, device, 3, (torch.float32,))
    check_tensor("count", rs.count, device, 3, (torch.int8,))
    rs.check()
    for name, t in tensors.items():
        if t is not None:
            dtypes = _INDEX_DTYPES if name == "state_batch_indices" else FLOAT_DTYPES
            if name == "has_initial_state":
                dtypes = (torch.bool, torch.int32, torch.int8)
            check_tensor(name, t, device, None, dtypes)


def _launch(
    state: torch.Tensor,
    ring_x: torch.Tensor,
    ring_B: torch.Tensor,
    ring_dt: torch.Tensor,
    count: torch.Tensor,
    x: torch.Tensor | None,
    dt: torch.Tensor | None,
    A: torch.Tensor,
    B: torch.Tensor | None,
    C: torch.Tensor | None,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_lo: float,
    dt_hi: float,
    indices: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    pad_slot_id: int,
    out: torch.Tensor | None,
) -> None:
    """One launch: a decode step when ``x`` is given, else the materialisation of
    ``indices``' lines (``has_initial_state`` None: all of them continue)."""
    batch = indices.shape[0]
    _, nheads, headdim, dstate = state.shape
    ngroups, ring = ring_B.shape[1], ring_x.shape[2]
    if batch == 0:
        return
    step = x is not None
    cfg = _blocks(launch_config(batch, headdim, dstate, state.dtype), headdim, dstate, step)
    parts = _parts(cfg, step)
    bc = None
    if cfg["BC_PRE"]:
        bc = _launch_bc(ring_B, count, B, C, indices, nheads // ngroups, pad_slot_id, ring)
    elif step and recording() and _any_bc_pre(headdim, dstate, state.dtype):
        # Inside precompile(): bc_pre's launch ahead is recorded when any bucket takes it.
        _launch_bc(ring_B, count, B, C, indices, nheads // ngroups, pad_slot_id, ring)
    grid = (triton.cdiv(headdim, cfg["BLOCK_P"]), nheads, batch)
    # Absent tensors pass ``state`` (never read: their flag compiles the load away) and
    # stride 0; a materialisation has no step tensors.
    none = state
    if step:
        step_strides = (*x.stride(), *dt.stride(), A.stride(0), *B.stride(), *C.stride())
        step_tensors = (x, dt, A, B, C)
    else:
        step_strides = (0,) * 3 + (0,) * 2 + (A.stride(0),) + (0,) * 6
        step_tensors = (none, none, A, none, none)
    args = (
        state, ring_x, ring_B, ring_dt, count,
        *step_tensors,
        none if D is None else D,
        none if dt_bias is None else dt_bias,
        indices,
        none if has_initial_state is None else has_initial_state,
        none if out is None else out,
        ring_dt if bc is None else bc,  # fp32 either way: one compiled variant
        headdim, dstate, nheads // ngroups, pad_slot_id, dt_lo, dt_hi,
        *state.stride(), *ring_x.stride(), *ring_B.stride(), *ring_dt.stride(), *count.stride(),
        *step_strides,
        0 if D is None else D.stride(0),
        0 if dt_bias is None else dt_bias.stride(0),
        indices.stride(0),
        0 if has_initial_state is None else has_initial_state.stride(0),
        *((0, 0, 0) if out is None else out.stride()),
        *((0, 0) if bc is None else bc.stride()[:2]),
    )  # fmt: skip
    constexprs = dict(
        RING=ring,
        BLOCK_K=max(16, triton.next_power_of_2(ring)),
        STEP=step,
        HAS_INIT=has_initial_state is not None,
        HAS_D=D is not None,
        HAS_DT_BIAS=dt_bias is not None,
        DT_SOFTPLUS=bool(dt_softplus),
        HAS_DT_LIMIT=(dt_lo, dt_hi) != _NO_LIMIT,
        **cfg,
    )

    def variants() -> list[dict]:
        seen = {}
        for b in BATCH_BUCKETS:
            cfg_b = launch_config(b, headdim, dstate, state.dtype)
            blocks = _blocks(cfg_b, headdim, dstate, step)
            for part in _parts(blocks, step):
                c = {**constexprs, **blocks, "PART": part}
                seen[tuple(sorted(c.items()))] = c
        return list(seen.values())

    for part in parts:  # a split step: outputs and appends, then the full rings' flushes
        _LAUNCH(grid, args, {**constexprs, "PART": part}, variants)


def _any_bc_pre(headdim: int, dstate: int, state_dtype: torch.dtype) -> bool:
    return any(
        launch_config(b, headdim, dstate, state_dtype).get("bc_pre", False) for b in BATCH_BUCKETS
    )


def _launch_bc(ring_B, count, B, C, indices, heads_per_group, pad_slot_id, ring):
    """``bc_pre``'s launch ahead of the step: (batch, ngroups, BLOCK_KB) fp32 products,
    entries k < n of the ring's B_k . C and entry ``ring`` this step's B . C."""
    batch, ngroups, dstate = B.shape
    kb = max(16, triton.next_power_of_2(ring + 1))
    bc = torch.empty((batch, ngroups, kb), dtype=torch.float32, device=B.device)
    args = (
        ring_B, count, B, C, indices, bc, dstate, heads_per_group, pad_slot_id,
        *ring_B.stride(), *count.stride()[:2], *B.stride(), *C.stride(), indices.stride(0),
        *bc.stride()[:2],
    )  # fmt: skip
    constexprs = dict(RING=ring, BLOCK_KB=kb, BLOCK_N=triton.next_power_of_2(dstate), num_warps=1)
    _LAUNCH_BC((batch, ngroups), args, constexprs)
    return bc


def replay_ssm_update(
    rs: ReplayedSSMState,
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
    pad_slot_id: int = PAD_SLOT_ID,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One replayed decode step for each row (the module docstring); same arguments and
    result as ``selective_state_update``, with ``rs`` in place of the state pool.
    ``state_batch_indices`` None: row b uses line b. Returns ``out``."""
    check_state_update_shapes(rs.state, x, dt, A, B, C, D, dt_bias, state_batch_indices, out)
    if state_batch_indices is None:
        state_batch_indices = torch.arange(x.shape[0], dtype=torch.int32, device=x.device)
    tensors = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias, out=out)
    _check(rs, x, {**tensors, "state_batch_indices": state_batch_indices})
    if rs.ring_B.shape[1] != B.shape[1]:
        raise ValueError(f"ring_B has {rs.ring_B.shape[1]} groups, B {B.shape[1]}")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if not use_replay_kernel(x):
        return replay_update_ref(
            rs, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit, state_batch_indices,
            pad_slot_id, out,
        )  # fmt: skip
    lo, hi = (float(v) for v in dt_limit)
    args = (*rs.tensors(), x, dt, A, B, C, D, dt_bias, bool(dt_softplus), lo, hi,
            state_batch_indices, None, pad_slot_id, out)  # fmt: skip
    if torch.compiler.is_compiling():
        torch.ops.vllm.replay_ssm(*args)
    else:
        _launch(*args)
    return out


def replay_ssm_materialise(
    rs: ReplayedSSMState,
    A: torch.Tensor,
    slots: torch.Tensor,
    has_initial_state: torch.Tensor | None = None,
    pad_slot_id: int = PAD_SLOT_ID,
) -> None:
    """Fold the buffered steps of lines ``slots`` (distinct but for ``pad_slot_id``,
    int32/int64) into their states and reset their counters; a line whose
    ``has_initial_state`` is False is only reset; an entry on ``pad_slot_id`` (a padded
    prefill of a CUDA graph's step, on the null line) touches nothing. ``A`` (nheads,) is
    the layer's (negative) A."""
    _check(rs, A, {"state_batch_indices": slots, "has_initial_state": has_initial_state})
    if tuple(A.shape) != (rs.state.shape[1],):
        raise ValueError(f"A must be (nheads={rs.state.shape[1]},), got {tuple(A.shape)}")
    if has_initial_state is not None and has_initial_state.shape != slots.shape:
        raise ValueError("has_initial_state must be shaped like slots")
    if not use_replay_kernel(A):
        replay_materialise_ref(rs, A, slots, has_initial_state, pad_slot_id)
        return
    args = (*rs.tensors(), None, None, A, None, None, None, None, False, 0.0, math.inf,
            slots, has_initial_state, pad_slot_id, None)  # fmt: skip
    if torch.compiler.is_compiling():
        torch.ops.vllm.replay_ssm(*args)
    else:
        _launch(*args)


# The op is the launcher itself (its annotations give the schema).
_replay_ssm_op = torch.library.custom_op(
    "vllm::replay_ssm",
    _launch,
    mutates_args=("state", "ring_x", "ring_B", "ring_dt", "count", "out"),
)


@_replay_ssm_op.register_fake
def _(state, ring_x, ring_B, ring_dt, count, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_lo,
      dt_hi, indices, has_initial_state, pad_slot_id, out):  # fmt: skip
    return None
