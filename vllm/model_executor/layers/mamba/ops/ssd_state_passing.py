"""SSD launch 2 of 3: the states across each sequence's chunks, and (second job) the chunks' CB.

Per sequence i (line ``state_indices[i]``, chunks ``c0 .. c1 - 1``) and head h::

    S = pool[line, h] if has_initial_state[i] else 0
    for c in c0 .. c1 - 1:
        start[c] = S                       (stored in place of chunk c's contribution)
        S = decay[c, h] * S + state[c, h]
    pool[line, h] = S                      (in the pool's dtype)

The initial state is read straight from its pool line and the final state written straight
back: no gather or scatter copy. A sequence on the padded-row marker (``pad_slot_id``)
reads and writes no line and passes nothing (no output reads its start states). A sequence
without chunks (no tokens) leaves its initial state, or zeros without one. The start state
of a sequence's first chunk is stored only when it has an initial state (otherwise it is
zero, and the chunk scan skips the term).

The chain is sequential per sequence, so the programs are few and wait on memory; the same
launch runs the CB job (``ssd_bmm._cb_rows``), which needs only the inputs, on the SMs they
leave idle. Programs ``[0, num_pass_programs)`` pass states, one per (sequence, head, tile of
BLOCK_SP x BLOCK_SN state elements); the rest compute CB, one per (chunk, group, block row).
"""

from __future__ import annotations

from vllm.model_executor.layers.mamba.ops.ssd_bmm import STEP_POINTERS, _cb_rows
from vllm.triton_utils import tl, triton
from vllm.triton_utils.launch import CachedLauncher


@triton.jit
def _pass_states(
    i_job,
    states_ptr,
    decay_ptr,
    ssm_ptr,
    state_indices_ptr,
    has_init_ptr,
    seq_chunk_starts_ptr,
    chunk_lines_ptr,
    pad_slot_id,
    stride_ssm_line,
    stride_ssm_h,
    stride_ssm_p,
    stride_ssm_n,
    stride_idx,
    stride_init,
    stride_chunk_lines,
    NHEADS: tl.constexpr,
    HEADDIM: tl.constexpr,
    DSTATE: tl.constexpr,
    HAS_INIT: tl.constexpr,
    HAS_CHUNK_LINES: tl.constexpr,
    SKIP_CHUNKED: tl.constexpr,
    BLOCK_SP: tl.constexpr,
    BLOCK_SN: tl.constexpr,
):
    N_TN: tl.constexpr = (DSTATE + BLOCK_SN - 1) // BLOCK_SN
    N_TP: tl.constexpr = (HEADDIM + BLOCK_SP - 1) // BLOCK_SP
    i_tn = i_job % N_TN
    i_tp = (i_job // N_TN) % N_TP
    i_h = (i_job // (N_TN * N_TP)) % NHEADS
    i_s = i_job // (N_TN * N_TP * NHEADS)

    line = tl.load(state_indices_ptr + i_s * stride_idx).to(tl.int64)
    live = (line != pad_slot_id) & (line >= 0)
    if HAS_INIT:
        use_init = live & (tl.load(has_init_ptr + i_s * stride_init) != 0)
    else:
        use_init = live & False
    c0 = tl.load(seq_chunk_starts_ptr + i_s).to(tl.int64)
    c1 = tl.load(seq_chunk_starts_ptr + i_s + 1).to(tl.int64)
    # A padded sequence's carried states are read by nobody (its outputs start from zeros,
    # its final state and chunk states have no line): skip its chain. Its chunks may be the
    # empty spare chunks of a CUDA graph's padded layout, whose contributions were never
    # written (ssd_chunk_state returns at once on an empty chunk).
    c1 = tl.where(live, c1, c0)
    if SKIP_CHUNKED:
        # Launch 1 chained this sequence's chunks (its FUSED_PASS); only a sequence without
        # chunks is left here, to keep its initial state or get zeros.
        if c0 < c1:
            return

    o_p = i_tp * BLOCK_SP + tl.arange(0, BLOCK_SP)
    o_n = i_tn * BLOCK_SN + tl.arange(0, BLOCK_SN)
    m = (o_p < HEADDIM)[:, None] & (o_n < DSTATE)[None, :]
    o_pool = i_h * stride_ssm_h + o_p[:, None] * stride_ssm_p + o_n[None, :] * stride_ssm_n
    b_s = tl.load(ssm_ptr + line * stride_ssm_line + o_pool, mask=m & use_init, other=0.0)
    b_s = b_s.to(tl.float32)
    p_st = states_ptr + i_h * (HEADDIM * DSTATE) + o_p[:, None] * DSTATE + o_n[None, :]
    p_decay = decay_ptr + i_h
    # Each chunk's contribution is loaded one step ahead, so the chain waits on one load
    # per step, not on a load after a store.
    has = c0 < c1
    b_next = tl.load(p_st + c0 * (NHEADS * HEADDIM * DSTATE), mask=m & has, other=0.0)
    b_next_decay = tl.load(p_decay + c0 * NHEADS, mask=has, other=0.0)
    for c in range(c0, c1):
        i_c = tl.cast(c, tl.int64)
        b_cur = b_next
        b_decay = b_next_decay
        has = i_c + 1 < c1
        p_cur = p_st + i_c * (NHEADS * HEADDIM * DSTATE)
        b_next = tl.load(p_cur + NHEADS * HEADDIM * DSTATE, mask=m & has, other=0.0)
        b_next_decay = tl.load(p_decay + (i_c + 1) * NHEADS, mask=has, other=0.0)
        tl.store(p_cur, b_s, mask=m & ((i_c > c0) | use_init))
        b_s = tl.fma(b_s, b_decay, b_cur)  # one rounding, as the fused chain step
        if HAS_CHUNK_LINES:
            # The state at the chunk's end into its given line (prefix caching).
            chunk_line = tl.load(chunk_lines_ptr + i_c * stride_chunk_lines).to(tl.int64)
            tl.store(
                ssm_ptr + chunk_line * stride_ssm_line + o_pool,
                b_s.to(ssm_ptr.dtype.element_ty),
                mask=m & live & (chunk_line != pad_slot_id) & (chunk_line >= 0),
            )
    tl.store(ssm_ptr + line * stride_ssm_line + o_pool, b_s.to(ssm_ptr.dtype.element_ty),
             mask=m & live)  # fmt: skip


@triton.jit(
    do_not_specialize=[n for n in STEP_POINTERS if n != "chunk_seqs_ptr"] + ["num_pass_programs"]
)
def _ssd_state_passing_kernel(
    states_ptr,
    decay_ptr,
    ssm_ptr,
    state_indices_ptr,
    has_init_ptr,
    seq_chunk_starts_ptr,
    chunk_lines_ptr,
    C_ptr,
    B_ptr,
    chunk_starts_ptr,
    cb_ptr,
    num_pass_programs,
    pad_slot_id,
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
    stride_B_t,
    stride_B_g,
    stride_B_n,
    NHEADS: tl.constexpr,
    HEADDIM: tl.constexpr,
    DSTATE: tl.constexpr,
    NGROUPS: tl.constexpr,
    CHUNK: tl.constexpr,
    HAS_INIT: tl.constexpr,
    HAS_CHUNK_LINES: tl.constexpr,
    SKIP_CHUNKED: tl.constexpr,
    BLOCK_SP: tl.constexpr,
    BLOCK_SN: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    i_pid = tl.program_id(0)
    if i_pid < num_pass_programs:
        _pass_states(
            i_pid,
            states_ptr,
            decay_ptr,
            ssm_ptr,
            state_indices_ptr,
            has_init_ptr,
            seq_chunk_starts_ptr,
            chunk_lines_ptr,
            pad_slot_id,
            stride_ssm_line,
            stride_ssm_h,
            stride_ssm_p,
            stride_ssm_n,
            stride_idx,
            stride_init,
            stride_chunk_lines,
            NHEADS,
            HEADDIM,
            DSTATE,
            HAS_INIT,
            HAS_CHUNK_LINES,
            SKIP_CHUNKED,
            BLOCK_SP,
            BLOCK_SN,
        )
    else:
        _cb_rows(
            i_pid - num_pass_programs,
            C_ptr,
            B_ptr,
            chunk_starts_ptr,
            cb_ptr,
            stride_C_t,
            stride_C_g,
            stride_C_n,
            stride_B_t,
            stride_B_g,
            stride_B_n,
            NGROUPS,
            DSTATE,
            CHUNK,
            BLOCK_T,
            BLOCK_N,
            None,
        )


_LAUNCH = CachedLauncher(_ssd_state_passing_kernel)


def state_passing_programs(
    num_seqs: int, num_chunks: int, nheads: int, headdim: int, dstate: int, ngroups: int,
    chunk_size: int, cfg: dict,
) -> tuple[int, int]:  # fmt: skip
    """Launch 2's two jobs: (state-passing programs, one per sequence, head and state tile;
    CB programs, one per chunk, group and block row)."""
    tiles = -(-headdim // cfg["BLOCK_SP"]) * -(-dstate // cfg["BLOCK_SN"])
    return num_seqs * nheads * tiles, num_chunks * ngroups * -(-chunk_size // cfg["BLOCK_T"])


def launch_state_passing(
    B,
    C,
    layout,
    ssm_states,
    state_indices,
    has_initial_state,
    chunk_lines,
    ws,
    cfg: dict,
    pad_slot_id: int,
    skip_chunked: bool = False,
) -> tuple | None:
    """Launch 2 over ``ws`` (the call's ``SSDWorkspace``): start states in place, final
    states (and, with ``chunk_lines``, each chunk's end state) into the pool, CB into
    ``ws.cb``. ``skip_chunked``: launch 1 chained the states (its ``FUSED_PASS``), so only
    sequences without chunks are passed here. Returns what it launched: (launcher, grid,
    args, constexprs), or None when there was nothing to launch."""
    nheads, headdim, dstate = ssm_states.shape[1:]
    ngroups = B.shape[1]
    num_pass, num_cb = state_passing_programs(
        layout.num_seqs, layout.num_chunks, nheads, headdim, dstate, ngroups,
        layout.chunk_size, cfg,
    )  # fmt: skip
    if num_pass + num_cb == 0:
        return None
    init = has_initial_state
    args = (
        ws.states,
        ws.decay,
        ssm_states,
        state_indices,
        state_indices if init is None else init,
        layout.seq_chunk_starts,
        state_indices if chunk_lines is None else chunk_lines,
        C,
        B,
        layout.chunk_starts,
        ws.cb,
        num_pass,
        pad_slot_id,
        *ssm_states.stride(),
        state_indices.stride(0),
        0 if init is None else init.stride(0),
        0 if chunk_lines is None else chunk_lines.stride(0),
        *C.stride(),
        *B.stride(),
    )
    constexprs = dict(
        NHEADS=nheads,
        HEADDIM=headdim,
        DSTATE=dstate,
        NGROUPS=ngroups,
        CHUNK=layout.chunk_size,
        HAS_INIT=init is not None,
        HAS_CHUNK_LINES=chunk_lines is not None,
        SKIP_CHUNKED=bool(skip_chunked),
        **cfg,
    )
    _LAUNCH((num_pass + num_cb,), args, constexprs)
    return _LAUNCH, (num_pass + num_cb,), args, constexprs
