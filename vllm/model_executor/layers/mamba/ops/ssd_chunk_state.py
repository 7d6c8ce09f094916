"""SSD launch 1 of 3: each chunk's dt, its cumulative decay, and its contribution to the state.

For chunk c (rows ``t0 .. t0 + len - 1`` of one sequence) and head h (group g)::

    dt[l]  = clamp(softplus(dt_raw[t0 + l, h] + dt_bias[h]), *dt_limit)   (as asked)
    cs[l]  = sum_{j <= l} dt[j] * A[h]                                    (<= 0)
    state  = sum_l exp(cs[len-1] - cs[l]) * dt[l] * x[t0 + l, h] B[t0 + l, g]^T   (P x N)
    decay  = exp(cs[len-1])

``state`` is what the chunk adds to the SSM state at its end; ``decay`` how much of the state
at its start survives to its end. The state passing (launch 2) chains them per sequence; the
chunk scan (launch 3) reads ``dt`` and ``cs``. All outputs are fp32 buffers of the call's
workspace (``ssd_combined``): ``states`` (chunks, nheads, headdim, dstate), ``dt_out``,
``cs_out`` (chunks, nheads, chunk_size; positions past a chunk's end are not written), and
``decay`` (chunks, nheads).

One program per (chunk, head, headdim block, dstate block); it walks the chunk in blocks of
BLOCK_T tokens twice: once for the chunk's total decay, once for the dot, a tensor-core
product of the scaled x^T (P x T) with B (T x N).
"""

from __future__ import annotations

from vllm.model_executor.layers.mamba.ops.ssd_bmm import _dot_lhs_f32
from vllm.triton_utils import tl, triton
from vllm.triton_utils.launch import CachedLauncher


@triton.jit
def _softplus(x):
    # softplus = log1p(u), u = exp(x); tl has no log1p and log(1 + u) alone loses small u.
    # log(w) * u / (w - 1), w = 1 + u, is log1p(u) to rounding where log is accurate; below
    # u = 1/64 a 4-term series (relative error < 2e-8) needs no log. Past 20, softplus is x
    # itself (F.softplus's threshold).
    u = tl.exp(tl.minimum(x, 20.0))
    w = 1.0 + u
    via_log = tl.log(w) * (u / tl.where(w == 1.0, 1.0, w - 1.0))
    series = u * (1.0 - u * (0.5 - u * (0.3333333333333333 - 0.25 * u)))
    return tl.where(x > 20.0, x, tl.where(u < 0.015625, series, via_log))


@triton.jit
def _chunk_dt(
    p_dt,
    mask,
    dt_bias,
    dt_min,
    dt_max,
    DT_SOFTPLUS: tl.constexpr,
    HAS_DT_LIMIT: tl.constexpr,
):
    """The discretised dt of the rows ``p_dt`` points at, fp32; 0 where ``mask`` is off."""
    b_dt = tl.load(p_dt, mask=mask, other=0.0).to(tl.float32) + dt_bias
    if DT_SOFTPLUS:
        b_dt = _softplus(b_dt)
    if HAS_DT_LIMIT:
        b_dt = tl.minimum(tl.maximum(b_dt, dt_min), dt_max)
    return tl.where(mask, b_dt, 0.0)


@triton.jit(do_not_specialize=["chunk_starts_ptr"])
def _ssd_chunk_state_kernel(
    x_ptr,
    dt_ptr,
    A_ptr,
    dt_bias_ptr,
    B_ptr,
    chunk_starts_ptr,
    states_ptr,
    dt_out_ptr,
    cs_out_ptr,
    decay_ptr,
    nheads,
    headdim,
    dstate,
    heads_per_group,
    dt_min,
    dt_max,
    stride_x_t,
    stride_x_h,
    stride_x_p,
    stride_dt_t,
    stride_dt_h,
    stride_A_h,
    stride_dt_bias_h,
    stride_B_t,
    stride_B_g,
    stride_B_n,
    stride_states_c,
    stride_states_h,
    stride_states_p,
    stride_states_n,
    stride_cs_c,
    stride_cs_h,
    stride_decay_c,
    stride_decay_h,
    HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
    HAS_DT_LIMIT: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    i_pid = tl.program_id(0).to(tl.int64)
    n_nb = tl.cdiv(dstate, BLOCK_N)
    n_pb = tl.cdiv(headdim, BLOCK_P)
    i_nb = i_pid % n_nb
    i_pb = (i_pid // n_nb) % n_pb
    i_h = (i_pid // n_nb // n_pb) % nheads
    i_c = i_pid // n_nb // n_pb // nheads
    i_g = i_h // heads_per_group
    row0 = tl.load(chunk_starts_ptr + i_c).to(tl.int64)
    clen = tl.load(chunk_starts_ptr + i_c + 1).to(tl.int64) - row0
    n_t = tl.cdiv(clen, BLOCK_T)

    b_A = tl.load(A_ptr + i_h * stride_A_h).to(tl.float32)
    b_bias = 0.0
    if HAS_DT_BIAS:
        b_bias = tl.load(dt_bias_ptr + i_h * stride_dt_bias_h).to(tl.float32)
    p_dt = dt_ptr + (row0 + tl.arange(0, BLOCK_T).to(tl.int64)) * stride_dt_t + i_h * stride_dt_h

    # The chunk's total decay first: each token's weight is its decay to the chunk's end.
    b_total = 0.0
    for i_t in range(0, n_t):
        o_t = tl.cast(i_t, tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
        b_dt = _chunk_dt(
            p_dt + tl.cast(i_t, tl.int64) * BLOCK_T * stride_dt_t,
            o_t < clen,
            b_bias,
            dt_min,
            dt_max,
            DT_SOFTPLUS,
            HAS_DT_LIMIT,
        )
        b_total += tl.sum(b_dt * b_A)

    o_p = i_pb * BLOCK_P + tl.arange(0, BLOCK_P).to(tl.int64)
    o_n = i_nb * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    m_p = o_p < headdim
    m_n = o_n < dstate
    # One program per (chunk, head) writes dt, cs and the decay for the later launches.
    first = (i_pb == 0) & (i_nb == 0)
    p_cs = i_c * stride_cs_c + i_h * stride_cs_h
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    b_prefix = 0.0
    for i_t in range(0, n_t):
        o_t = tl.cast(i_t, tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
        m_t = o_t < clen
        b_dt = _chunk_dt(
            p_dt + tl.cast(i_t, tl.int64) * BLOCK_T * stride_dt_t,
            m_t,
            b_bias,
            dt_min,
            dt_max,
            DT_SOFTPLUS,
            HAS_DT_LIMIT,
        )
        b_dA = b_dt * b_A
        b_cs = b_prefix + tl.cumsum(b_dA, axis=0)
        b_prefix += tl.sum(b_dA)
        tl.store(dt_out_ptr + p_cs + o_t, b_dt, mask=m_t & first)
        tl.store(cs_out_ptr + p_cs + o_t, b_cs, mask=m_t & first)
        b_w = tl.where(m_t, tl.exp(b_total - b_cs) * b_dt, 0.0)

        rows = row0 + o_t
        p_x = x_ptr + rows[:, None] * stride_x_t + i_h * stride_x_h + o_p[None, :] * stride_x_p
        b_x = tl.load(p_x, mask=m_t[:, None] & m_p[None, :], other=0.0)
        p_B = B_ptr + rows[:, None] * stride_B_t + i_g * stride_B_g + o_n[None, :] * stride_B_n
        b_B = tl.load(p_B, mask=m_t[:, None] & m_n[None, :], other=0.0)
        b_xs = tl.trans(b_x.to(tl.float32) * b_w[:, None])  # (BLOCK_P, BLOCK_T)
        acc = _dot_lhs_f32(b_xs, b_B, acc, SPLIT)

    p_states = (
        states_ptr
        + i_c * stride_states_c
        + i_h * stride_states_h
        + o_p[:, None] * stride_states_p
        + o_n[None, :] * stride_states_n
    )
    tl.store(p_states, acc, mask=m_p[:, None] & m_n[None, :])
    tl.store(decay_ptr + i_c * stride_decay_c + i_h * stride_decay_h, tl.exp(b_total), mask=first)


_LAUNCH = CachedLauncher(_ssd_chunk_state_kernel)


def chunk_state_programs(num_chunks: int, nheads: int, headdim: int, dstate: int, cfg: dict) -> int:
    """Launch 1's grid: one program per (chunk, head, headdim block, dstate block)."""
    return num_chunks * nheads * -(-headdim // cfg["BLOCK_P"]) * -(-dstate // cfg["BLOCK_N"])


def launch_chunk_state(x, dt, A, dt_bias, B, chunk_starts, ws, flags: dict, cfg: dict) -> tuple:
    """Launch 1 over ``ws`` (the call's ``SSDWorkspace``); ``flags`` are the dt constexprs
    (HAS_DT_BIAS, DT_SOFTPLUS, HAS_DT_LIMIT) plus dt_min/dt_max, ``cfg`` the launch config.
    Returns what it launched: (launcher, grid, args, constexprs)."""
    num_chunks = chunk_starts.shape[0] - 1
    _, nheads, headdim = x.shape
    ngroups, dstate = B.shape[1:]
    grid = (chunk_state_programs(num_chunks, nheads, headdim, dstate, cfg),)
    args = (
        x,
        dt,
        A,
        x if dt_bias is None else dt_bias,
        B,
        chunk_starts,
        ws.states,
        ws.dt,
        ws.cs,
        ws.decay,
        nheads,
        headdim,
        dstate,
        nheads // ngroups,
        flags["dt_min"],
        flags["dt_max"],
        *x.stride(),
        *dt.stride(),
        A.stride(0),
        0 if dt_bias is None else dt_bias.stride(0),
        *B.stride(),
        *ws.states.stride(),
        *ws.dt.stride()[:2],
        *ws.decay.stride(),
    )
    constexprs = dict(
        HAS_DT_BIAS=flags["HAS_DT_BIAS"],
        DT_SOFTPLUS=flags["DT_SOFTPLUS"],
        HAS_DT_LIMIT=flags["HAS_DT_LIMIT"],
        **cfg,
    )
    _LAUNCH(grid, args, constexprs)
    return _LAUNCH, grid, args, constexprs
