"""SSD launch 2 of 3: the states across each sequence's chunks, and (second job) the chunks' CB.

Per sequence i (line ``state_indices[i]``, chunks ``c0 .. c1 - 1``) and head h::

    S = pool[line, h] if has_initial_state[i] else 0
    for c in c0 .. c1 - 1:
        start[c] = S                       (stored in place of chunk c's contribution)
        S = decay[c, h] * S + state[c, h]
    pool[line, h] = S                      (in the pool's dtype)

The initial state is read straight from its pool line and the final state written straight
back: no gather or scatter copy. A sequence on ``PAD_SLOT_ID`` reads and writes no line. A
sequence without chunks (no tokens) leaves its initial state, or zeros without one. The start
state of a sequence's first chunk is stored only when it has an initial state (otherwise it is
zero, and the chunk scan skips the term).

The chain is sequential per sequence, so the programs are few and wait on memory; the same
launch runs the CB job (``ssd_bmm._cb_rows``), which needs only the inputs, on the SMs they
leave idle. Programs ``[0, num_pass_programs)`` pass states, one per (sequence, head, tile of
BLOCK_SP x BLOCK_SN state elements); the rest compute CB, one per (chunk, group, block row).
"""

from __future__ import annotations

from vllm.model_executor.layers.mamba.ops.causal_conv1d_ref import PAD_SLOT_ID
from vllm.model_executor.layers.mamba.ops.ssd_bmm import _cb_rows
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
    nheads,
    headdim,
    dstate,
    pad_slot_id,
    stride_states_c,
    stride_states_h,
    stride_states_p,
    stride_states_n,
    stride_decay_c,
    stride_decay_h,
    stride_ssm_line,
    stride_ssm_h,
    stride_ssm_p,
    stride_ssm_n,
    stride_idx,
    stride_init,
    HAS_INIT: tl.constexpr,
    BLOCK_SP: tl.constexpr,
    BLOCK_SN: tl.constexpr,
):
    n_tn = tl.cdiv(dstate, BLOCK_SN)
    n_tp = tl.cdiv(headdim, BLOCK_SP)
    i_tn = i_job % n_tn
    i_tp = (i_job // n_tn) % n_tp
    i_h = (i_job // n_tn // n_tp) % nheads
    i_s = i_job // n_tn // n_tp // nheads

    line = tl.load(state_indices_ptr + i_s * stride_idx).to(tl.int64)
    live = line != pad_slot_id
    if HAS_INIT:
        use_init = live & (tl.load(has_init_ptr + i_s * stride_init) != 0)
    else:
        use_init = live & False
    c0 = tl.load(seq_chunk_starts_ptr + i_s).to(tl.int64)
    c1 = tl.load(seq_chunk_starts_ptr + i_s + 1).to(tl.int64)

    o_p = i_tp * BLOCK_SP + tl.arange(0, BLOCK_SP).to(tl.int64)
    o_n = i_tn * BLOCK_SN + tl.arange(0, BLOCK_SN).to(tl.int64)
    m = (o_p < headdim)[:, None] & (o_n < dstate)[None, :]
    p_line = (
        ssm_ptr
        + line * stride_ssm_line
        + i_h * stride_ssm_h
        + o_p[:, None] * stride_ssm_p
        + o_n[None, :] * stride_ssm_n
    )
    b_s = tl.load(p_line, mask=m & use_init, other=0.0).to(tl.float32)
    p_st = (
        states_ptr
        + i_h * stride_states_h
        + o_p[:, None] * stride_states_p
        + o_n[None, :] * stride_states_n
    )
    p_decay = decay_ptr + i_h * stride_decay_h
    # Each chunk's contribution is loaded one step ahead, so the chain waits on one load
    # per step, not on a load after a store.
    has = c0 < c1
    b_next = tl.load(p_st + c0 * stride_states_c, mask=m & has, other=0.0)
    b_next_decay = tl.load(p_decay + c0 * stride_decay_c, mask=has, other=0.0)
    for c in range(c0, c1):
        i_c = tl.cast(c, tl.int64)
        b_cur = b_next
        b_decay = b_next_decay
        has = i_c + 1 < c1
        b_next = tl.load(p_st + (i_c + 1) * stride_states_c, mask=m & has, other=0.0)
        b_next_decay = tl.load(p_decay + (i_c + 1) * stride_decay_c, mask=has, other=0.0)
        tl.store(p_st + i_c * stride_states_c, b_s, mask=m & ((i_c > c0) | use_init))
        b_s = b_s * b_decay + b_cur
    tl.store(p_line, b_s.to(ssm_ptr.dtype.element_ty), mask=m & live)


@triton.jit(
    do_not_specialize=[
        "state_indices_ptr",
        "has_init_ptr",
        "seq_chunk_starts_ptr",
        "chunk_starts_ptr",
        "num_pass_programs",
    ]
)
def _ssd_state_passing_kernel(
    states_ptr,
    decay_ptr,
    ssm_ptr,
    state_indices_ptr,
    has_init_ptr,
    seq_chunk_starts_ptr,
    C_ptr,
    B_ptr,
    chunk_starts_ptr,
    cb_ptr,
    num_pass_programs,
    nheads,
    headdim,
    dstate,
    ngroups,
    chunk_size,
    pad_slot_id,
    stride_states_c,
    stride_states_h,
    stride_states_p,
    stride_states_n,
    stride_decay_c,
    stride_decay_h,
    stride_ssm_line,
    stride_ssm_h,
    stride_ssm_p,
    stride_ssm_n,
    stride_idx,
    stride_init,
    stride_C_t,
    stride_C_g,
    stride_C_n,
    stride_B_t,
    stride_B_g,
    stride_B_n,
    stride_cb_c,
    stride_cb_g,
    stride_cb_l,
    stride_cb_s,
    HAS_INIT: tl.constexpr,
    BLOCK_SP: tl.constexpr,
    BLOCK_SN: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    i_pid = tl.program_id(0).to(tl.int64)
    if i_pid < num_pass_programs:
        _pass_states(
            i_pid,
            states_ptr,
            decay_ptr,
            ssm_ptr,
            state_indices_ptr,
            has_init_ptr,
            seq_chunk_starts_ptr,
            nheads,
            headdim,
            dstate,
            pad_slot_id,
            stride_states_c,
            stride_states_h,
            stride_states_p,
            stride_states_n,
            stride_decay_c,
            stride_decay_h,
            stride_ssm_line,
            stride_ssm_h,
            stride_ssm_p,
            stride_ssm_n,
            stride_idx,
            stride_init,
            HAS_INIT,
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
            ngroups,
            dstate,
            chunk_size,
            stride_C_t,
            stride_C_g,
            stride_C_n,
            stride_B_t,
            stride_B_g,
            stride_B_n,
            stride_cb_c,
            stride_cb_g,
            stride_cb_l,
            stride_cb_s,
            BLOCK_T,
            BLOCK_N,
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
    B, C, layout, ssm_states, state_indices, has_initial_state, ws, cfg: dict
) -> tuple | None:
    """Launch 2 over ``ws`` (the call's ``SSDWorkspace``): start states in place, final
    states into the pool, CB into ``ws.cb``. Returns what it launched: (launcher, grid,
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
        C,
        B,
        layout.chunk_starts,
        ws.cb,
        num_pass,
        nheads,
        headdim,
        dstate,
        ngroups,
        layout.chunk_size,
        PAD_SLOT_ID,
        *ws.states.stride(),
        *ws.decay.stride(),
        *ssm_states.stride(),
        state_indices.stride(0),
        0 if init is None else init.stride(0),
        *C.stride(),
        *B.stride(),
        *ws.cb.stride(),
    )
    grid, constexprs = (num_pass + num_cb,), dict(HAS_INIT=init is not None, **cfg)
    _LAUNCH(grid, args, constexprs)
    return _LAUNCH, grid, args, constexprs
