"""SSD launch 3 of 3: every chunk's outputs, from its start state and its own tokens.

For chunk c (rows ``t0 + l``, sequence i), head h (group g), with ``dt``, ``cs`` from launch 1,
``CB`` and the start state ``S`` (P x N) from launch 2::

    y[t0 + l, h] = exp(cs[l]) * S C[t0 + l, g]                                    (carried)
                 + sum_{s <= l} CB[l, s] * exp(cs[l] - cs[s]) * dt[s] * x[t0 + s, h]  (local)
                 + D[h] * x[t0 + l, h]

Both sums are tensor-core dots per block of BLOCK_T rows: C (T x N) @ S^T (N x P), and the
causal weights (T x T) @ x (T x P) over the blocks s <= l. The first chunk of a sequence
without an initial state has S = 0 and skips the first dot. A sequence on ``PAD_SLOT_ID``
gets y = 0, as in the reference. Only the rows of the chunks are written.

One program per (chunk, group, head of the group, headdim block), heads of a group next to
each other so that the group's CB and C blocks are read from L2 while they are hot; each
program walks its chunk's block rows.
"""

from __future__ import annotations

from vllm.model_executor.layers.mamba.ops.causal_conv1d_ref import PAD_SLOT_ID
from vllm.model_executor.layers.mamba.ops.ssd_bmm import _dot_lhs_f32, _dot_rhs_f32
from vllm.triton_utils import tl, triton
from vllm.triton_utils.launch import CachedLauncher


@triton.jit(
    do_not_specialize=[
        "chunk_starts_ptr",
        "chunk_seqs_ptr",
        "seq_chunk_starts_ptr",
        "state_indices_ptr",
        "has_init_ptr",
    ]
)
def _ssd_chunk_scan_kernel(
    x_ptr,
    C_ptr,
    cb_ptr,
    states_ptr,
    dt_ptr,
    cs_ptr,
    D_ptr,
    out_ptr,
    chunk_starts_ptr,
    chunk_seqs_ptr,
    seq_chunk_starts_ptr,
    state_indices_ptr,
    has_init_ptr,
    headdim,
    dstate,
    ngroups,
    heads_per_group,
    pad_slot_id,
    stride_x_t,
    stride_x_h,
    stride_x_p,
    stride_C_t,
    stride_C_g,
    stride_C_n,
    stride_cb_c,
    stride_cb_g,
    stride_cb_l,
    stride_cb_s,
    stride_states_c,
    stride_states_h,
    stride_states_p,
    stride_states_n,
    stride_cs_c,
    stride_cs_h,
    stride_D_h,
    stride_out_t,
    stride_out_h,
    stride_out_p,
    stride_idx,
    stride_init,
    HAS_D: tl.constexpr,
    HAS_INIT: tl.constexpr,
    SPLIT: tl.constexpr,
    SPLIT_STATE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROW_BLOCKS: tl.constexpr,
):
    # ROW_BLOCKS > 1: that many programs share a (chunk, head, headdim block), each doing
    # every ROW_BLOCKS-th row block (more, shorter programs); 1: one walks them all.
    i_pid = tl.program_id(0).to(tl.int64)
    i_rb = i_pid % ROW_BLOCKS
    i_pid = i_pid // ROW_BLOCKS
    n_pb = tl.cdiv(headdim, BLOCK_P)
    i_pb = i_pid % n_pb
    i_hg = (i_pid // n_pb) % heads_per_group
    i_g = (i_pid // n_pb // heads_per_group) % ngroups
    i_c = i_pid // n_pb // heads_per_group // ngroups
    i_h = i_g * heads_per_group + i_hg

    row0 = tl.load(chunk_starts_ptr + i_c).to(tl.int64)
    clen = tl.load(chunk_starts_ptr + i_c + 1).to(tl.int64) - row0
    i_seq = tl.load(chunk_seqs_ptr + i_c).to(tl.int64)
    live = tl.load(state_indices_ptr + i_seq * stride_idx).to(tl.int64) != pad_slot_id
    first = tl.load(seq_chunk_starts_ptr + i_seq).to(tl.int64) == i_c
    if HAS_INIT:
        has_start = (~first) | (tl.load(has_init_ptr + i_seq * stride_init) != 0)
    else:
        has_start = ~first
    has_start = has_start & live

    o_p = i_pb * BLOCK_P + tl.arange(0, BLOCK_P).to(tl.int64)
    m_p = o_p < headdim
    b_D = 0.0
    if HAS_D:
        b_D = tl.load(D_ptr + i_h * stride_D_h).to(tl.float32)
    p_x = x_ptr + i_h * stride_x_h + o_p[None, :] * stride_x_p
    p_C = C_ptr + i_g * stride_C_g
    p_cs = cs_ptr + i_c * stride_cs_c + i_h * stride_cs_h
    p_dt = dt_ptr + i_c * stride_cs_c + i_h * stride_cs_h
    p_S = (
        states_ptr + i_c * stride_states_c + i_h * stride_states_h + o_p[None, :] * stride_states_p
    )
    p_cb = cb_ptr + i_c * stride_cb_c + i_g * stride_cb_g
    p_out = out_ptr + i_h * stride_out_h + o_p[None, :] * stride_out_p

    for i_l in range(i_rb, tl.cdiv(clen, BLOCK_T), ROW_BLOCKS):
        o_l = tl.cast(i_l, tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
        m_l = o_l < clen
        b_cs_l = tl.load(p_cs + o_l, mask=m_l, other=0.0)
        acc = tl.zeros([BLOCK_T, BLOCK_P], dtype=tl.float32)
        if has_start:
            for i_n in range(0, tl.cdiv(dstate, BLOCK_N)):
                o_n = tl.cast(i_n, tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
                m_n = o_n < dstate
                p_Cl = p_C + (row0 + o_l[:, None]) * stride_C_t + o_n[None, :] * stride_C_n
                b_C = tl.load(p_Cl, mask=m_l[:, None] & m_n[None, :], other=0.0)
                # S^T: (BLOCK_N, BLOCK_P)
                b_S = tl.load(
                    p_S + o_n[:, None] * stride_states_n,
                    mask=m_n[:, None] & m_p[None, :],
                    other=0.0,
                )
                acc = _dot_rhs_f32(b_C, b_S, acc, SPLIT_STATE)
            acc = acc * tl.exp(b_cs_l)[:, None]

        # Source blocks up to the row block's diagonal.
        n_s = tl.cdiv(tl.minimum((tl.cast(i_l, tl.int64) + 1) * BLOCK_T, clen), BLOCK_S)
        for i_s in range(0, n_s):
            o_s = tl.cast(i_s, tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S).to(tl.int64)
            m_s = o_s < clen
            b_cb = tl.load(
                p_cb + o_l[:, None] * stride_cb_l + o_s[None, :] * stride_cb_s,
                mask=m_l[:, None] & m_s[None, :],
                other=0.0,
            )
            b_cs_s = tl.load(p_cs + o_s, mask=m_s, other=0.0)
            b_dt_s = tl.load(p_dt + o_s, mask=m_s, other=0.0)
            causal = (o_l[:, None] >= o_s[None, :]) & m_s[None, :]
            # -inf above the diagonal, so no exp overflows; the select keeps CB blocks the
            # CB job did not write (past the diagonal block) out of the sum.
            b_seg = tl.where(causal, b_cs_l[:, None] - b_cs_s[None, :], float("-inf"))
            b_w = tl.where(causal, b_cb * tl.exp(b_seg) * b_dt_s[None, :], 0.0)
            b_xs = tl.load(
                p_x + (row0 + o_s[:, None]) * stride_x_t,
                mask=m_s[:, None] & m_p[None, :],
                other=0.0,
            )
            acc = _dot_lhs_f32(b_w, b_xs, acc, SPLIT)

        m_y = m_l[:, None] & m_p[None, :]
        if HAS_D:
            b_x = tl.load(p_x + (row0 + o_l[:, None]) * stride_x_t, mask=m_y, other=0.0)
            acc += b_D * b_x.to(tl.float32)
        acc = tl.where(live, acc, 0.0)
        p_y = p_out + (row0 + o_l[:, None]) * stride_out_t
        tl.store(p_y, acc.to(out_ptr.dtype.element_ty), mask=m_y)


_LAUNCH = CachedLauncher(_ssd_chunk_scan_kernel)


def chunk_scan_programs(num_chunks: int, nheads: int, headdim: int, cfg: dict) -> int:
    """Launch 3's grid: one program per (chunk, head, headdim block, row-block lane)."""
    return num_chunks * nheads * -(-headdim // cfg["BLOCK_P"]) * cfg["ROW_BLOCKS"]


def launch_chunk_scan(
    x, C, D, layout, state_indices, has_initial_state, ws, out, cfg: dict
) -> tuple:
    """Launch 3 over ``ws`` (the call's ``SSDWorkspace``): y of every chunk into ``out``.
    Returns what it launched: (launcher, grid, args, constexprs)."""
    _, nheads, headdim = x.shape
    ngroups, dstate = C.shape[1:]
    grid = (chunk_scan_programs(layout.num_chunks, nheads, headdim, cfg),)
    init = has_initial_state
    args = (
        x,
        C,
        ws.cb,
        ws.states,
        ws.dt,
        ws.cs,
        x if D is None else D,
        out,
        layout.chunk_starts,
        layout.chunk_seqs,
        layout.seq_chunk_starts,
        state_indices,
        state_indices if init is None else init,
        headdim,
        dstate,
        ngroups,
        nheads // ngroups,
        PAD_SLOT_ID,
        *x.stride(),
        *C.stride(),
        *ws.cb.stride(),
        *ws.states.stride(),
        *ws.cs.stride()[:2],
        0 if D is None else D.stride(0),
        *out.stride(),
        state_indices.stride(0),
        0 if init is None else init.stride(0),
    )
    constexprs = dict(HAS_D=D is not None, HAS_INIT=init is not None, **cfg)
    _LAUNCH(grid, args, constexprs)
    return _LAUNCH, grid, args, constexprs
