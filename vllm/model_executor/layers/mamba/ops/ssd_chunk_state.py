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

``RELOAD_CS`` (launch table): the first pass stores the chunk's dt and cs from every program
(identical values), and the dot's loop loads each block's back after a CTA barrier, so a
trip computes its weights as ``exp2(cs[last] - cs[t]) * dt[t]`` instead of the dt's softplus
and a block cumsum again (a scan across the warps: 7 barriers and 10 shuffles per trip at
sm_90, docs/ssd.md "Compile comparison"). The weights then use the same cs as the chunk
scan and the decay. Off: each trip recomputes them from dt_raw.
"""

from __future__ import annotations

from vllm.model_executor.layers.mamba.ops.ssd_bmm import (
    LOG2E,
    STEP_POINTERS,
    _cb_rows,
    _dot_rhs_f32,
)
from vllm.model_executor.layers.mamba.ops.ssd_state_passing import (
    _pass_states,
    state_passing_programs,
)
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


@triton.jit
def _chain_step(
    acc,
    b_decay,
    p_states,
    m_st,
    i_c,
    i_h,
    i_seq,
    line,
    o_p,
    o_n,
    tile,
    seq_chunk_starts_ptr,
    has_init_ptr,
    chunk_lines_ptr,
    ssm_ptr,
    sync_ptr,
    pad_slot_id,
    stride_ssm_line,
    stride_ssm_h,
    stride_ssm_p,
    stride_ssm_n,
    stride_init,
    stride_chunk_lines,
    NHEADS: tl.constexpr,
    HEADDIM: tl.constexpr,
    DSTATE: tl.constexpr,
    TILES: tl.constexpr,
    HAS_INIT: tl.constexpr,
    HAS_CHUNK_LINES: tl.constexpr,
):
    """``FUSED_PASS``: launch 2's state chain, one step per chunk, done by the chunk's own
    program (a decoupled look-back). Chunk c's start state S (slot c of ``states``) is the
    sequence's initial state for its first chunk, else published by chunk c-1's program of
    the same tile; the program waits for that flag, takes it back to 0 (the sync buffer is
    all zeros between calls), and publishes ``decay * S + acc`` as chunk c+1's start (or
    writes it to the pool line after the last chunk). The arithmetic is launch 2's, in
    the same order: the results are bit-identical."""
    o_pool = i_h * stride_ssm_h + o_p[:, None] * stride_ssm_p + o_n[None, :] * stride_ssm_n
    c0 = tl.load(seq_chunk_starts_ptr + i_seq).to(tl.int64)
    c1 = tl.load(seq_chunk_starts_ptr + i_seq + 1).to(tl.int64)
    flags = sync_ptr + 1 + tile  # flag of (chunk c, head h, tile): at c * NHEADS + h tiles
    if i_c == c0:
        if HAS_INIT:
            use_init = tl.load(has_init_ptr + i_seq * stride_init) != 0
        else:
            use_init = False
        b_s = tl.load(ssm_ptr + line * stride_ssm_line + o_pool, mask=m_st & use_init, other=0.0)
        b_s = b_s.to(tl.float32)
        # The chunk scan reads a first chunk's start only when there is an initial state.
        tl.store(p_states, b_s, mask=m_st & use_init)
    else:
        p_flag = flags + ((i_c - 1) * NHEADS + i_h) * TILES
        # One thread of the program spins (a scalar atomic), then a CTA barrier: the
        # acquire orders the loads below after the publisher's release.
        seen = tl.atomic_cas(p_flag, 1, 0, sem="acquire")
        while seen != 1:
            seen = tl.atomic_cas(p_flag, 1, 0, sem="acquire")
        b_s = tl.load(p_states, mask=m_st, other=0.0, cache_modifier=".cg")
    # One rounding, as launch 2's step: an fma in both (left to the compiler, the product
    # and the sum sat in different register layouts here and were not contracted, so the
    # GPU's chains differed from launch 2's in the last bits).
    b_s = tl.fma(b_s, b_decay, acc)
    if HAS_CHUNK_LINES:
        # The state at the chunk's end into its given line (prefix caching).
        chunk_line = tl.load(chunk_lines_ptr + i_c * stride_chunk_lines).to(tl.int64)
        tl.store(ssm_ptr + chunk_line * stride_ssm_line + o_pool,
                 b_s.to(ssm_ptr.dtype.element_ty),
                 mask=m_st & (chunk_line != pad_slot_id) & (chunk_line >= 0))  # fmt: skip
    if i_c + 1 < c1:
        tl.store(p_states + NHEADS * HEADDIM * DSTATE, b_s, mask=m_st)
        tl.debug_barrier()  # every thread's stores before the one release below
        tl.atomic_xchg(flags + (i_c * NHEADS + i_h) * TILES, 1, sem="release")
    else:
        tl.store(ssm_ptr + line * stride_ssm_line + o_pool, b_s.to(ssm_ptr.dtype.element_ty),
                 mask=m_st)  # fmt: skip


@triton.jit(do_not_specialize=list(STEP_POINTERS))
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
    chunk_seqs_ptr,
    seq_chunk_starts_ptr,
    state_indices_ptr,
    has_init_ptr,
    chunk_lines_ptr,
    ssm_ptr,
    sync_ptr,
    C_ptr,
    cb_ptr,
    num_state_programs,
    num_cb_programs,
    pad_slot_id,
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
    stride_ssm_line,
    stride_ssm_h,
    stride_ssm_p,
    stride_ssm_n,
    stride_idx,
    stride_init,
    stride_chunk_lines,
    stride_C_t,
    stride_C_g,
    stride_C_n,
    NHEADS: tl.constexpr,
    HEADDIM: tl.constexpr,
    DSTATE: tl.constexpr,
    HEADS_PER_GROUP: tl.constexpr,
    CHUNK: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
    HAS_DT_LIMIT: tl.constexpr,
    SPLIT: tl.constexpr,
    RELOAD_CS: tl.constexpr,
    FUSED_PASS: tl.constexpr,
    HAS_INIT: tl.constexpr,
    HAS_CHUNK_LINES: tl.constexpr,
    FOLD_CB: tl.constexpr,
    NGROUPS: tl.constexpr,
    CB_BLOCK_T: tl.constexpr,
    CB_BLOCK_N: tl.constexpr,
    CB_STAGES: tl.constexpr,
    PASS_BLOCK_SP: tl.constexpr,
    PASS_BLOCK_SN: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    N_NB: tl.constexpr = (DSTATE + BLOCK_N - 1) // BLOCK_N
    N_PB: tl.constexpr = (HEADDIM + BLOCK_P - 1) // BLOCK_P
    BLOCK_L: tl.constexpr = triton.next_power_of_2(CHUNK)
    if FUSED_PASS:
        # A ticket instead of the program id: a program waits only on programs with
        # smaller tickets, which have started and so are resident (no deadlock whatever
        # order the hardware starts programs in). The last ticket resets the counter.
        i_pid = tl.atomic_add(sync_ptr, 1, sem="relaxed")
        if i_pid == tl.num_programs(0) - 1:
            tl.atomic_xchg(sync_ptr, 0, sem="relaxed")
    else:
        i_pid = tl.program_id(0)
    if FOLD_CB:
        # Launch 2's jobs after the chunk programs (tickets past them, so they fill the SMs
        # the chains' last waits leave idle): CB, then the sequences without chunks.
        if i_pid >= num_state_programs:
            i_job = i_pid - num_state_programs
            if i_job < num_cb_programs:
                _cb_rows(i_job, C_ptr, B_ptr, chunk_starts_ptr, cb_ptr, stride_C_t, stride_C_g,
                         stride_C_n, stride_B_t, stride_B_g, stride_B_n, NGROUPS, DSTATE,
                         CHUNK, CB_BLOCK_T, CB_BLOCK_N, CB_STAGES)  # fmt: skip
            else:
                _pass_states(i_job - num_cb_programs, states_ptr, decay_ptr, ssm_ptr,
                             state_indices_ptr, has_init_ptr, seq_chunk_starts_ptr,
                             chunk_lines_ptr, pad_slot_id, stride_ssm_line, stride_ssm_h,
                             stride_ssm_p, stride_ssm_n, stride_idx, stride_init,
                             stride_chunk_lines, NHEADS, HEADDIM, DSTATE, HAS_INIT,
                             HAS_CHUNK_LINES, True, PASS_BLOCK_SP, PASS_BLOCK_SN)  # fmt: skip
            return
    i_nb = i_pid % N_NB
    i_pb = (i_pid // N_NB) % N_PB
    i_h = (i_pid // (N_NB * N_PB)) % NHEADS
    i_c = (i_pid // (N_NB * N_PB * NHEADS)).to(tl.int64)
    i_g = i_h // HEADS_PER_GROUP
    start = tl.load(chunk_starts_ptr + i_c)
    clen = tl.load(chunk_starts_ptr + i_c + 1) - start
    if FUSED_PASS:
        i_seq = tl.load(chunk_seqs_ptr + i_c).to(tl.int64)
        line = tl.load(state_indices_ptr + i_seq * stride_idx).to(tl.int64)
        live = (line != pad_slot_id) & (line >= 0)
        skip = (clen == 0) & (~live)
    else:
        skip = clen == 0
    if skip:
        # A CUDA graph's padded chunk layout: its spare chunks hold no rows and belong to a
        # padded sequence, whose state passing and outputs read none of this chunk's work.
        # (Fused: a live sequence's chunk always runs, so its successor never waits in vain.)
        return
    row0 = start.to(tl.int64)

    # cs in log2 units (dA * log2(e)): every decay below is one exp2.
    b_A = tl.load(A_ptr + i_h * stride_A_h).to(tl.float32) * LOG2E
    b_bias = 0.0
    if HAS_DT_BIAS:
        b_bias = tl.load(dt_bias_ptr + i_h * stride_dt_bias_h).to(tl.float32)
    p_dt = dt_ptr + row0 * stride_dt_t + i_h * stride_dt_h

    # The whole chunk's dt first: its total decay (each token's weight is its decay to the
    # chunk's end), and, from one program per (chunk, head), dt, cs and the decay.
    o_l = tl.arange(0, BLOCK_L)
    m_l = o_l < clen
    b_dt_l = _chunk_dt(p_dt + o_l * stride_dt_t, m_l, b_bias, dt_min, dt_max, DT_SOFTPLUS,
                       HAS_DT_LIMIT)  # fmt: skip
    p_ws = (i_c * NHEADS + i_h) * CHUNK
    if RELOAD_CS:
        # Every program of (chunk, head) stores the same dt and cs; the barrier makes this
        # CTA's stores visible to its own loads below (the loop reads them back).
        b_cs_l = tl.cumsum(b_dt_l * b_A, axis=0)
        b_total = tl.sum(tl.where(o_l == clen - 1, b_cs_l, 0.0))  # cs[last], exactly
        tl.store(dt_out_ptr + p_ws + o_l, b_dt_l, mask=m_l)
        tl.store(cs_out_ptr + p_ws + o_l, b_cs_l, mask=m_l)
        if not FUSED_PASS:  # fused, the chain step takes the decay in registers
            if (i_pb == 0) & (i_nb == 0):
                tl.store(decay_ptr + i_c * NHEADS + i_h, tl.exp2(b_total))
        tl.debug_barrier()
    else:
        b_total = tl.sum(b_dt_l * b_A)
        if (i_pb == 0) & (i_nb == 0):
            tl.store(dt_out_ptr + p_ws + o_l, b_dt_l, mask=m_l)
            tl.store(cs_out_ptr + p_ws + o_l, tl.cumsum(b_dt_l * b_A, axis=0), mask=m_l)
            if not FUSED_PASS:
                tl.store(decay_ptr + i_c * NHEADS + i_h, tl.exp2(b_total))

    # state (P x N) = x^T (P x T) @ (w * B) (T x N) per block of BLOCK_T tokens: x^T comes
    # from memory as the dot's first operand; the fp32 weighted B is the split one.
    o_t = tl.arange(0, BLOCK_T)
    o_p = i_pb * BLOCK_P + tl.arange(0, BLOCK_P)
    o_n = i_nb * BLOCK_N + tl.arange(0, BLOCK_N)
    m_p = o_p < HEADDIM
    m_n = o_n < DSTATE
    # Scalar 64-bit bases, 32-bit offset tensors (nothing 64-bit is carried by the loop).
    p_x = x_ptr + row0 * stride_x_t + i_h * stride_x_h
    o_x = o_p[:, None] * stride_x_p + o_t[None, :] * stride_x_t
    p_B = B_ptr + row0 * stride_B_t + i_g * stride_B_g
    o_B = o_t[:, None] * stride_B_t + o_n[None, :] * stride_B_n
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    b_prefix = 0.0
    for t0 in range(0, clen, BLOCK_T):
        m_t = (t0 + o_t) < clen
        if RELOAD_CS:
            b_dt = tl.load(dt_out_ptr + p_ws + t0 + o_t, mask=m_t, other=0.0)
            b_cs = tl.load(cs_out_ptr + p_ws + t0 + o_t, mask=m_t, other=0.0)
            b_w = tl.exp2(b_total - b_cs) * b_dt
        else:
            b_dt = _chunk_dt(p_dt + (t0 + o_t) * stride_dt_t, m_t, b_bias, dt_min, dt_max,
                             DT_SOFTPLUS, HAS_DT_LIMIT)  # fmt: skip
            b_dA = b_dt * b_A
            b_w = tl.exp2(b_total - b_prefix - tl.cumsum(b_dA, axis=0)) * b_dt
            b_prefix += tl.sum(b_dA)
        b_x = tl.load(p_x + t0 * stride_x_t + o_x, mask=m_p[:, None] & m_t[None, :], other=0.0)
        b_B = tl.load(p_B + t0 * stride_B_t + o_B, mask=m_t[:, None] & m_n[None, :], other=0.0)
        acc = _dot_rhs_f32(b_x, b_B.to(tl.float32) * b_w[:, None], acc, SPLIT)

    p_states = states_ptr + (i_c * NHEADS + i_h) * (HEADDIM * DSTATE)
    p_states = p_states + o_p[:, None] * DSTATE + o_n[None, :]
    m_st = m_p[:, None] & m_n[None, :]
    if FUSED_PASS:
        if live:
            _chain_step(acc, tl.exp2(b_total), p_states, m_st, i_c, i_h, i_seq, line, o_p, o_n,
                        i_pb * N_NB + i_nb, seq_chunk_starts_ptr, has_init_ptr,
                        chunk_lines_ptr, ssm_ptr, sync_ptr, pad_slot_id, stride_ssm_line,
                        stride_ssm_h, stride_ssm_p, stride_ssm_n, stride_init,
                        stride_chunk_lines, NHEADS, HEADDIM, DSTATE, N_PB * N_NB, HAS_INIT,
                        HAS_CHUNK_LINES)  # fmt: skip
    else:
        tl.store(p_states, acc, mask=m_st)


_LAUNCH = CachedLauncher(_ssd_chunk_state_kernel)


def chunk_state_programs(num_chunks: int, nheads: int, headdim: int, dstate: int, cfg: dict) -> int:
    """Launch 1's grid: one program per (chunk, head, headdim block, dstate block)."""
    return num_chunks * nheads * -(-headdim // cfg["BLOCK_P"]) * -(-dstate // cfg["BLOCK_N"])


def chunk_state_tiles(headdim: int, dstate: int, cfg: dict) -> int:
    """Programs per (chunk, head): headdim blocks x dstate blocks."""
    return -(-headdim // cfg["BLOCK_P"]) * -(-dstate // cfg["BLOCK_N"])


def sync_elements(num_chunks: int, nheads: int, headdim: int, dstate: int, cfg: dict) -> int:
    """int32 elements of ``FUSED_PASS``'s sync buffer: the ticket counter, then one flag per
    (chunk, head, tile)."""
    return 1 + num_chunks * nheads * chunk_state_tiles(headdim, dstate, cfg)


_SYNC: dict = {}  # keyed by ``_device_key``


def _device_key(device):
    """``device`` as a ``torch.device`` with its index: "cuda" and "cuda:0" (the current
    device) name one buffer. A tensor's device, the call path's, already is one."""
    import torch

    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def existing_sync_buffer(device):
    """The sync buffer ``device`` has (None when no fused chunk state ran there yet)."""
    return _SYNC.get(_device_key(device))


def sync_buffer(device, elements: int):
    """The device's zeroed int32 sync buffer of at least ``elements`` (``FUSED_PASS``).

    Every call leaves it all zeros (each flag is taken back by the program that waited on
    it, the counter by the last ticket), so one buffer serves every call on the device,
    one after the other on a stream: launches of the fused chunk state on two streams at
    once must not share it. Grown (never shrunk) by doubling, from 64Ki elements (256 KiB:
    512 chunks at the Codestral shape)."""
    import torch

    device = _device_key(device)
    buf = _SYNC.get(device)
    if buf is None or buf.numel() < elements:
        size = max(elements, 1 << 16, 0 if buf is None else 2 * buf.numel())
        buf = torch.zeros(size, dtype=torch.int32, device=device)
        _SYNC[device] = buf
    return buf


def launch_chunk_state(x, dt, A, dt_bias, B, C, chunks, ssm_states, state_indices, init,
                       chunk_lines, pad_slot_id: int, ws, flags: dict, cfg: dict,
                       passing_cfg: dict) -> tuple:  # fmt: skip
    """Launch 1 over ``ws`` (the call's ``SSDWorkspace``); ``flags`` are the dt constexprs
    (HAS_DT_BIAS, DT_SOFTPLUS, HAS_DT_LIMIT) plus dt_min/dt_max, ``cfg`` the launch config.
    With ``FUSED_PASS`` it also chains the states (launch 2's pass, which then handles only
    sequences without chunks): ``chunks`` (``ssd_launch.Chunks``), the pool, the sequences'
    lines and flags, the chunks' lines as launch 2 takes them. With ``FOLD_CB`` as well it
    runs launch 2's two jobs too, CB and the sequences without chunks, with launch 2's
    blocks (``passing_cfg``), and launch 2 is not made. Returns what it launched:
    (launcher, grid, args, constexprs)."""
    num_chunks = chunks.num_chunks
    _, nheads, headdim = x.shape
    ngroups, dstate = B.shape[1:]
    num_state = chunk_state_programs(num_chunks, nheads, headdim, dstate, cfg)
    fused = bool(cfg.get("FUSED_PASS", False))
    fold = bool(cfg.get("FOLD_CB", False))
    if fold and not fused:
        raise ValueError("the SSD's chunk_state launch config FOLD_CB needs FUSED_PASS")
    num_cb = num_pass = 0
    if fold:
        num_pass, num_cb = state_passing_programs(
            chunks.num_seqs, num_chunks, nheads, headdim, dstate, ngroups, chunks.chunk_size,
            passing_cfg,
        )  # fmt: skip
    grid = (num_state + num_cb + num_pass,)
    sync = chunks.chunk_starts
    if fused:
        sync = sync_buffer(x.device, sync_elements(num_chunks, nheads, headdim, dstate, cfg))
    args = (
        x,
        dt,
        A,
        x if dt_bias is None else dt_bias,
        B,
        chunks.chunk_starts,
        ws.states,
        ws.dt,
        ws.cs,
        ws.decay,
        chunks.chunk_seqs,
        chunks.seq_chunk_starts,
        state_indices,
        state_indices if init is None else init,
        state_indices if chunk_lines is None else chunk_lines,
        ssm_states,
        sync,
        C,
        ws.cb,
        num_state,
        num_cb,
        pad_slot_id,
        flags["dt_min"],
        flags["dt_max"],
        *x.stride(),
        *dt.stride(),
        A.stride(0),
        0 if dt_bias is None else dt_bias.stride(0),
        *B.stride(),
        *ssm_states.stride(),
        state_indices.stride(0),
        0 if init is None else init.stride(0),
        0 if chunk_lines is None else chunk_lines.stride(0),
        *C.stride(),
    )
    constexprs = dict(
        NHEADS=nheads,
        HEADDIM=headdim,
        DSTATE=dstate,
        HEADS_PER_GROUP=nheads // ngroups,
        CHUNK=ws.dt.shape[-1],
        HAS_DT_BIAS=flags["HAS_DT_BIAS"],
        DT_SOFTPLUS=flags["DT_SOFTPLUS"],
        HAS_DT_LIMIT=flags["HAS_DT_LIMIT"],
        HAS_INIT=init is not None,
        HAS_CHUNK_LINES=chunk_lines is not None,
        NGROUPS=ngroups,
        # Launch 2's blocks for the folded jobs (fixed values without FOLD_CB: one variant).
        CB_BLOCK_T=passing_cfg["BLOCK_T"] if fold else 16,
        CB_BLOCK_N=passing_cfg["BLOCK_N"] if fold else 16,
        CB_STAGES=passing_cfg.get("num_stages", 1) if fold else 1,
        PASS_BLOCK_SP=passing_cfg["BLOCK_SP"] if fold else 1,
        PASS_BLOCK_SN=passing_cfg["BLOCK_SN"] if fold else 1,
        **{"FUSED_PASS": fused, "FOLD_CB": fold, **cfg},
    )
    _LAUNCH(grid, args, constexprs)
    return _LAUNCH, grid, args, constexprs
