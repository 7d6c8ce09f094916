"""SSD launch 3 of 3: every chunk's outputs, from its start state and its own tokens.

For chunk c (rows ``t0 + l``, sequence i), head h (group g), with ``dt``, ``cs`` from launch 1,
``CB`` and the start state ``S`` (P x N) from launch 2::

    y[t0 + l, h] = exp(cs[l]) * S C[t0 + l, g]                                    (carried)
                 + sum_{s <= l} CB[l, s] * exp(cs[l] - cs[s]) * dt[s] * x[t0 + s, h]  (local)
                 + D[h] * x[t0 + l, h]

Both sums are tensor-core dots per block of BLOCK_T rows: C (T x N) @ S^T (N x P), and the
causal weights (T x T) @ x (T x P) over the blocks s <= l. The first chunk of a sequence
without an initial state has S = 0 and skips the first dot. A sequence on the padded-row
marker (``pad_slot_id``) gets y = 0, as in the reference. Only the rows of the chunks are written.

One program per (chunk, group, head of the group, headdim block), heads of a group next to
each other so that the group's CB and C blocks are read from L2 while they are hot; each
program walks its chunk's block rows. ``HEADS`` 2 (launch table key; 1 by default) gives a
program two neighbouring heads of one group: each CB and C block it loads serves both,
halving the kernel's largest L2 reads (the fp32 CB blocks and C), for a second accumulator.
Each head's arithmetic and its order are those of a one-head program: bit-identical.
"""

from __future__ import annotations

from vllm.model_executor.layers.mamba.ops.ssd_bmm import STEP_POINTERS, _dot_lhs_f32, _dot_rhs_f32
from vllm.triton_utils import tl, triton
from vllm.triton_utils.launch import CachedLauncher


@triton.jit
def _off_diagonal(b_cb, p_cs, p_dt, p_x, o_k, o_xk, k0, stride_x_t, b_cs_m, m_p, acc,
                  BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
    """One source block below the diagonal block for one head: its decays factor through the
    block's last row r, exp2(cs[l] - cs[r]) * exp2(cs[r] - cs[s]), both <= 1, so the block
    takes BLOCK_M + BLOCK_K exponentials instead of BLOCK_M * BLOCK_K."""
    b_cs_k = tl.load(p_cs + k0 + o_k)
    b_cs_r = tl.load(p_cs + k0 + (BLOCK_K - 1))
    b_dt_k = tl.load(p_dt + k0 + o_k)
    b_rows = tl.exp2(b_cs_m - b_cs_r)
    b_cols = tl.exp2(b_cs_r - b_cs_k) * b_dt_k
    b_w = b_cb * b_rows[:, None] * b_cols[None, :]
    b_x = tl.load(p_x + k0 * stride_x_t + o_xk, mask=m_p[None, :], other=0.0)
    return _dot_lhs_f32(b_w, b_x, acc, SPLIT)


@triton.jit
def _diagonal(b_cb, o_m, p_cs, p_dt, p_x, o_s, m_s, o_xk, k0, stride_x_t, b_cs_m, m_p, acc,
              SPLIT: tl.constexpr):  # fmt: skip
    """One source block of the diagonal block for one head: the decay per element, -inf
    above the diagonal (no exp2 overflows); the select keeps CB blocks the CB job did not
    write out of the sum."""
    b_cs_k = tl.load(p_cs + o_s, mask=m_s, other=0.0)
    b_dt_k = tl.load(p_dt + o_s, mask=m_s, other=0.0)
    causal = (o_m[:, None] >= o_s[None, :]) & m_s[None, :]
    b_seg = tl.where(causal, b_cs_m[:, None] - b_cs_k[None, :], float("-inf"))
    b_w = tl.where(causal, b_cb.to(tl.float32) * tl.exp2(b_seg) * b_dt_k[None, :], 0.0)
    b_x = tl.load(p_x + k0 * stride_x_t + o_xk, mask=m_s[:, None] & m_p[None, :], other=0.0)
    return _dot_lhs_f32(b_w, b_x, acc, SPLIT)


@triton.jit
def _store_rows(acc, live, i_h, p_x, o_m, o_p, m_y, m_p, z_ptr, D_ptr, out_ptr, row0,
                stride_x_t, stride_x_p, stride_z_t, stride_z_h, stride_z_p, stride_D_h,
                stride_D_p, stride_out_t, stride_out_h, stride_out_p, HAS_D: tl.constexpr,
                D_HAS_HDIM: tl.constexpr, HAS_Z: tl.constexpr):  # fmt: skip
    """One head's rows: + D x, times silu(z), zeros for a padded sequence, stored."""
    if HAS_D:
        o_xm = o_m[:, None] * stride_x_t + o_p[None, :] * stride_x_p
        b_x = tl.load(p_x + o_xm, mask=m_y, other=0.0).to(tl.float32)
        if D_HAS_HDIM:
            b_D = tl.load(D_ptr + i_h * stride_D_h + o_p * stride_D_p, mask=m_p, other=0.0)
            acc += b_x * b_D.to(tl.float32)[None, :]
        else:
            acc += b_x * tl.load(D_ptr + i_h * stride_D_h).to(tl.float32)
    if HAS_Z:
        p_z = z_ptr + row0 * stride_z_t + i_h * stride_z_h
        p_z = p_z + o_m[:, None] * stride_z_t + o_p[None, :] * stride_z_p
        b_z = tl.load(p_z, mask=m_y, other=0.0).to(tl.float32)
        acc = acc * b_z * tl.sigmoid(b_z)
    acc = tl.where(live, acc, 0.0)
    p_y = out_ptr + row0 * stride_out_t + i_h * stride_out_h
    p_y = p_y + o_m[:, None] * stride_out_t + o_p[None, :] * stride_out_p
    tl.store(p_y, acc.to(out_ptr.dtype.element_ty), mask=m_y)


@triton.jit(do_not_specialize=[n for n in STEP_POINTERS if n != "chunk_lines_ptr"])
def _ssd_chunk_scan_kernel(
    x_ptr,
    z_ptr,
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
    pad_slot_id,
    stride_x_t,
    stride_x_h,
    stride_x_p,
    stride_z_t,
    stride_z_h,
    stride_z_p,
    stride_C_t,
    stride_C_g,
    stride_C_n,
    stride_D_h,
    stride_D_p,
    stride_out_t,
    stride_out_h,
    stride_out_p,
    stride_idx,
    stride_init,
    NHEADS: tl.constexpr,
    HEADDIM: tl.constexpr,
    DSTATE: tl.constexpr,
    NGROUPS: tl.constexpr,
    CHUNK: tl.constexpr,
    HAS_D: tl.constexpr,
    D_HAS_HDIM: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_INIT: tl.constexpr,
    SPLIT: tl.constexpr,
    SPLIT_STATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREFETCH: tl.constexpr,
    HEADS: tl.constexpr,
):
    # Programs: row block fastest (the heaviest, last, first), then headdim block, then the
    # heads (a group's heads are neighbours: its CB and C blocks are read from L2), chunks.
    N_MB: tl.constexpr = (CHUNK + BLOCK_M - 1) // BLOCK_M
    N_PB: tl.constexpr = (HEADDIM + BLOCK_P - 1) // BLOCK_P
    N_HB: tl.constexpr = NHEADS // HEADS
    tl.static_assert((NHEADS // NGROUPS) % HEADS == 0, "HEADS must divide a group's heads")
    tl.static_assert(HEADS == 1 or not PREFETCH, "PREFETCH takes one head a program")
    i_pid = tl.program_id(0)
    i_mb = N_MB - 1 - i_pid % N_MB
    i_pb = (i_pid // N_MB) % N_PB
    i_h = (i_pid // (N_MB * N_PB)) % N_HB * HEADS  # the program's first head
    i_c = (i_pid // (N_MB * N_PB * N_HB)).to(tl.int64)
    i_g = i_h // (NHEADS // NGROUPS)

    start = tl.load(chunk_starts_ptr + i_c)
    clen = tl.load(chunk_starts_ptr + i_c + 1) - start
    m0 = i_mb * BLOCK_M
    if m0 >= clen:
        return
    row0 = start.to(tl.int64)
    i_seq = tl.load(chunk_seqs_ptr + i_c).to(tl.int64)
    line = tl.load(state_indices_ptr + i_seq * stride_idx).to(tl.int64)
    live = (line != pad_slot_id) & (line >= 0)
    first = tl.load(seq_chunk_starts_ptr + i_seq).to(tl.int64) == i_c
    if HAS_INIT:
        has_start = (~first) | (tl.load(has_init_ptr + i_seq * stride_init) != 0)
    else:
        has_start = ~first
    has_start = has_start & live

    o_m = m0 + tl.arange(0, BLOCK_M)
    o_k = tl.arange(0, BLOCK_K)
    o_p = i_pb * BLOCK_P + tl.arange(0, BLOCK_P)
    m_m = o_m < clen
    m_p = o_p < HEADDIM
    p_ws = (i_c * NHEADS + i_h) * CHUNK  # dt and cs of (chunk, head)
    b_cs_m = tl.load(cs_ptr + p_ws + o_m, mask=m_m, other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
    # The second head (HEADS 2): its workspace rows, start state and x one head further.
    b_cs_m1 = b_cs_m
    acc1 = acc
    if HEADS == 2:
        b_cs_m1 = tl.load(cs_ptr + p_ws + CHUNK + o_m, mask=m_m, other=0.0)

    # Carried: exp2(cs[l]) * C[l] @ S^T, S the chunk's start state (P x N).
    if has_start:
        o_n = tl.arange(0, BLOCK_N)
        p_C = C_ptr + row0 * stride_C_t + i_g * stride_C_g
        p_C = p_C + o_m[:, None] * stride_C_t + o_n[None, :] * stride_C_n
        p_S = states_ptr + (i_c * NHEADS + i_h) * (HEADDIM * DSTATE)
        p_S = p_S + o_n[:, None] + o_p[None, :] * DSTATE  # S^T: (BLOCK_N, BLOCK_P)
        for n0 in tl.static_range(0, DSTATE, BLOCK_N):
            m_n = (n0 + o_n) < DSTATE
            m_S = m_n[:, None] & m_p[None, :]
            b_C = tl.load(p_C + n0 * stride_C_n, mask=m_m[:, None] & m_n[None, :], other=0.0)
            b_S = tl.load(p_S + n0, mask=m_S, other=0.0)
            acc = _dot_rhs_f32(b_C, b_S, acc, SPLIT_STATE)
            if HEADS == 2:
                b_S = tl.load(p_S + HEADDIM * DSTATE + n0, mask=m_S, other=0.0)
                acc1 = _dot_rhs_f32(b_C, b_S, acc1, SPLIT_STATE)
        acc = acc * tl.exp2(b_cs_m)[:, None]
        if HEADS == 2:
            acc1 = acc1 * tl.exp2(b_cs_m1)[:, None]

    # Local: sum_{s <= l} CB[l, s] exp2(cs[l] - cs[s]) dt[s] x[s], per block of BLOCK_K
    # sources (_off_diagonal below the diagonal block, _diagonal on it), each CB block
    # loaded once for the program's heads.
    # Scalar 64-bit bases, 32-bit offset tensors (nothing 64-bit is carried by the loops).
    p_cb = cb_ptr + (i_c * NGROUPS + i_g) * (CHUNK * CHUNK)
    o_cb = o_m[:, None] * CHUNK + o_k[None, :]
    p_x = x_ptr + row0 * stride_x_t + i_h * stride_x_h
    o_xk = o_k[:, None] * stride_x_t + o_p[None, :] * stride_x_p
    p_cs = cs_ptr + p_ws
    p_dt = dt_ptr + p_ws
    if PREFETCH:
        # The loop's loads one source block ahead, into registers (the launch keeps one
        # stage: a pipelined register-operand wgmma races). Block 0 before the loop (x
        # masked off when m0 = 0; the rest lies in this chunk's workspace); the last trip's
        # loads masked off (no block past m0 is read). One head a program (ssd_configs).
        n_cb = tl.load(p_cb + o_cb, mask=m_m[:, None], other=0.0)
        n_cs_k = tl.load(p_cs + o_k)
        n_cs_r = tl.load(p_cs + (BLOCK_K - 1))
        n_dt_k = tl.load(p_dt + o_k)
        n_x = tl.load(p_x + o_xk, mask=(o_k < m0)[:, None] & m_p[None, :], other=0.0)
        for k0 in range(0, m0, BLOCK_K):
            b_cb = n_cb.to(tl.float32)
            b_cs_k = n_cs_k
            b_cs_r = n_cs_r
            b_dt_k = n_dt_k
            b_x = n_x
            k1 = k0 + BLOCK_K
            more = k1 < m0
            n_cb = tl.load(p_cb + k1 + o_cb, mask=m_m[:, None] & more, other=0.0)
            n_cs_k = tl.load(p_cs + k1 + o_k, mask=more & (o_k >= 0), other=0.0)
            n_cs_r = tl.load(p_cs + k1 + (BLOCK_K - 1), mask=more, other=0.0)
            n_dt_k = tl.load(p_dt + k1 + o_k, mask=more & (o_k >= 0), other=0.0)
            n_x = tl.load(p_x + k1 * stride_x_t + o_xk, mask=m_p[None, :] & more, other=0.0)
            b_rows = tl.exp2(b_cs_m - b_cs_r)
            b_cols = tl.exp2(b_cs_r - b_cs_k) * b_dt_k
            b_w = b_cb * b_rows[:, None] * b_cols[None, :]
            acc = _dot_lhs_f32(b_w, b_x, acc, SPLIT)
    else:
        for k0 in range(0, m0, BLOCK_K):  # every source row < m0 < clen: no masks but rows'
            b_cb = tl.load(p_cb + k0 + o_cb, mask=m_m[:, None], other=0.0).to(tl.float32)
            acc = _off_diagonal(b_cb, p_cs, p_dt, p_x, o_k, o_xk, k0, stride_x_t, b_cs_m, m_p,
                                acc, BLOCK_K, SPLIT)  # fmt: skip
            if HEADS == 2:
                acc1 = _off_diagonal(b_cb, p_cs + CHUNK, p_dt + CHUNK, p_x + stride_x_h, o_k,
                                     o_xk, k0, stride_x_t, b_cs_m1, m_p, acc1, BLOCK_K,
                                     SPLIT)  # fmt: skip
    for k0 in range(m0, tl.minimum(m0 + BLOCK_M, clen), BLOCK_K):
        o_s = k0 + o_k
        m_s = o_s < clen
        b_cb = tl.load(p_cb + k0 + o_cb, mask=m_m[:, None] & m_s[None, :], other=0.0)
        acc = _diagonal(b_cb, o_m, p_cs, p_dt, p_x, o_s, m_s, o_xk, k0, stride_x_t, b_cs_m, m_p,
                        acc, SPLIT)  # fmt: skip
        if HEADS == 2:
            acc1 = _diagonal(b_cb, o_m, p_cs + CHUNK, p_dt + CHUNK, p_x + stride_x_h, o_s, m_s,
                             o_xk, k0, stride_x_t, b_cs_m1, m_p, acc1, SPLIT)  # fmt: skip

    m_y = m_m[:, None] & m_p[None, :]
    _store_rows(acc, live, i_h, p_x, o_m, o_p, m_y, m_p, z_ptr, D_ptr, out_ptr, row0, stride_x_t,
                stride_x_p, stride_z_t, stride_z_h, stride_z_p, stride_D_h, stride_D_p,
                stride_out_t, stride_out_h, stride_out_p, HAS_D, D_HAS_HDIM, HAS_Z)  # fmt: skip
    if HEADS == 2:
        _store_rows(acc1, live, i_h + 1, p_x + stride_x_h, o_m, o_p, m_y, m_p, z_ptr, D_ptr,
                    out_ptr, row0, stride_x_t, stride_x_p, stride_z_t, stride_z_h, stride_z_p,
                    stride_D_h, stride_D_p, stride_out_t, stride_out_h, stride_out_p, HAS_D,
                    D_HAS_HDIM, HAS_Z)  # fmt: skip


_LAUNCH = CachedLauncher(_ssd_chunk_scan_kernel)


def chunk_scan_programs(num_chunks: int, nheads: int, headdim: int, chunk_size: int,
                        cfg: dict) -> int:  # fmt: skip
    """Launch 3's grid: one program per (chunk, HEADS heads, headdim block, row block)."""
    heads = nheads // cfg.get("HEADS", 1)
    return num_chunks * heads * -(-headdim // cfg["BLOCK_P"]) * -(-chunk_size // cfg["BLOCK_M"])


def launch_chunk_scan(x, z, C, D, layout, state_indices, has_initial_state, ws, out,
                      cfg: dict, pad_slot_id: int) -> tuple:  # fmt: skip
    """Launch 3 over ``ws`` (the call's ``SSDWorkspace``): y of every chunk into ``out``.
    Returns what it launched: (launcher, grid, args, constexprs)."""
    _, nheads, headdim = x.shape
    ngroups, dstate = C.shape[1:]
    grid = (chunk_scan_programs(layout.num_chunks, nheads, headdim, layout.chunk_size, cfg),)
    init = has_initial_state
    D2 = D is not None and D.dim() == 2
    args = (
        x,
        x if z is None else z,
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
        pad_slot_id,
        *x.stride(),
        *((0, 0, 0) if z is None else z.stride()),
        *C.stride(),
        0 if D is None else D.stride(0),
        D.stride(1) if D2 else 0,
        *out.stride(),
        state_indices.stride(0),
        0 if init is None else init.stride(0),
    )
    constexprs = dict(
        NHEADS=nheads,
        HEADDIM=headdim,
        DSTATE=dstate,
        NGROUPS=ngroups,
        CHUNK=layout.chunk_size,
        HAS_D=D is not None,
        D_HAS_HDIM=D2,
        HAS_Z=z is not None,
        HAS_INIT=init is not None,
        **cfg,
    )
    _LAUNCH(grid, args, constexprs)
    return _LAUNCH, grid, args, constexprs
