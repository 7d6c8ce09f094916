"""The Triton kernels of causal-conv1d (``causal_conv1d.py`` is the op: its docstring gives
the formula, each tensor's logical shape and strides, and the cache-line rules).

- ``_causal_conv1d_fwd_kernel``: a whole continuous-batching step (``causal_conv1d_fn``),
  parallel over features, sequences and tiles of tokens; only a sequence's head piece
  reads and writes its cache line.
- ``_causal_conv1d_update_kernel``: decode and speculative decode, several tokens per row
  and varlen (``causal_conv1d_update``).
- ``_causal_conv1d_decode_kernel``: one token per row (``causal_conv1d_update``'s decode).

Each has a ``CachedLauncher`` (``_LAUNCH_*``) that keys calls on Triton's specialisation.
"""

from vllm.triton_utils import tl, triton
from vllm.triton_utils.launch import CachedLauncher

# --------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------


@triton.jit
def _count_starts_le(t, qsl_ptr, batch, n_search):
    """Number of sequences b < batch with query_start_loc[b] <= t, by binary search.

    The sequence holding token t is this count minus one (empty sequences are
    skipped because the count takes the last start not after t).
    """
    lo = t * 0
    hi = lo + batch
    for _ in range(n_search):
        active = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(qsl_ptr + mid, mask=active, other=0)
        go_right = active & (v <= t)
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(active & (v > t), mid, hi)
    return lo


@triton.jit
def _state_feature_offsets(o_d, stride_state_d, STATE_D_CONTIG: tl.constexpr):
    """Offsets of features ``o_d`` within a cache line.

    Feature-contiguous pools (the fast path) use ``o_d`` itself, so their code is the
    same as with no stride at all. Other layouts (e.g. (lines, dim, state_len)
    contiguous, the CUDA layout) scale by the feature stride in 64 bits: a line may
    span more than 2^31 elements when features are its outer axis.
    """
    if STATE_D_CONTIG:
        return o_d
    else:
        return o_d.to(tl.int64) * stride_state_d


@triton.jit
def _fwd_piece(
    x_ptr,
    w_ptr,
    bias_ptr,
    state_ptr,
    out_ptr,
    start,
    end,
    t0,
    t_end,
    line,
    use_hist,
    o_d,
    o_sd,
    m_d,
    stride_x_t,
    stride_w_d,
    stride_state_line,
    stride_state_col,
    stride_out_t,
    pad_slot_id,
    KERNEL_WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    IS_HEAD: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    """Outputs of tokens [t0, t_end) of the sequence [start, end) on line ``line``.

    The W-1 rows before t0 are tokens (a tile) or the cache line's history or zeros
    (a head, t0 == start). A head then writes the sequence's final state.
    """
    live = (line != pad_slot_id) & (line >= 0)
    p_line = state_ptr + line * stride_state_line
    if HAS_BIAS:
        b_bias = tl.load(bias_ptr + o_d, mask=m_d, other=0.0).to(tl.float32)
    else:
        b_bias = tl.zeros(o_d.shape, dtype=tl.float32)
    b_ws = ()
    for k in tl.static_range(KERNEL_WIDTH):
        b_w = tl.load(w_ptr + o_d * stride_w_d + k, mask=m_d, other=0.0)
        b_ws = b_ws + (b_w.to(tl.float32),)

    b_win = ()
    for j in tl.static_range(KERNEL_WIDTH - 1):
        p = t0 - (KERNEL_WIDTH - 1) + j
        m_x = m_d & (p >= start) & (t0 < t_end) & live
        b_v = tl.load(x_ptr + p * stride_x_t + o_d, mask=m_x, other=0.0).to(tl.float32)
        if IS_HEAD:
            p_h = p_line + (p - start + KERNEL_WIDTH - 1) * stride_state_col + o_sd
            b_v += tl.load(p_h, mask=m_d & (p < start) & use_hist, other=0.0).to(tl.float32)
        b_win = b_win + (b_v,)

    for g0 in range(t0, t_end, BLOCK_G):
        b_rows = b_win
        for j in tl.static_range(BLOCK_G):
            p_row = x_ptr + (g0 + j) * stride_x_t + o_d
            b_row = tl.load(p_row, mask=m_d & (g0 + j < t_end) & live, other=0.0)
            b_rows = b_rows + (b_row.to(tl.float32),)
        for r in tl.static_range(BLOCK_G):
            acc = b_bias
            for k in tl.static_range(KERNEL_WIDTH):
                acc += b_rows[r + k] * b_ws[k]
            if SILU:
                acc = acc / (1.0 + tl.exp(-acc))
            acc = tl.where(live, acc, 0.0)
            p_out = out_ptr + (g0 + r) * stride_out_t + o_d
            tl.store(p_out, acc.to(out_ptr.dtype.element_ty), mask=m_d & (g0 + r < t_end))
        b_win = b_rows[BLOCK_G:]

    if IS_HEAD:
        # The sequence's last W-1 inputs (the old history for a sequence shorter
        # than W-1), written after every read of the line.
        if live:
            b_new = ()
            for j in tl.static_range(KERNEL_WIDTH - 1):
                p = end - (KERNEL_WIDTH - 1) + j
                b_x = tl.load(x_ptr + p * stride_x_t + o_d, mask=m_d & (p >= start), other=0.0)
                p_h = p_line + (p - start + KERNEL_WIDTH - 1) * stride_state_col + o_sd
                b_h = tl.load(p_h, mask=m_d & (p < start) & use_hist, other=0.0)
                b_new = b_new + (tl.where(p >= start, b_x.to(state_ptr.dtype.element_ty), b_h),)
            tl.debug_barrier()
            for j in tl.static_range(KERNEL_WIDTH - 1):
                tl.store(p_line + j * stride_state_col + o_sd, b_new[j], mask=m_d)


@triton.jit(do_not_specialize=["num_tokens", "n_tiles", "batch", "n_search"])
def _causal_conv1d_fwd_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    state_ptr,
    qsl_ptr,
    cache_idx_ptr,
    has_init_ptr,
    tile_seq_ptr,
    out_ptr,
    num_tokens,
    n_tiles,
    dim,
    batch,
    n_search,
    pad_slot_id,
    stride_x_t,
    stride_w_d,
    stride_state_line,
    stride_state_d,
    stride_state_col,
    stride_out_t,
    KERNEL_WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    HAS_CACHE_INDICES: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr,
    HAS_TILE_SEQ: tl.constexpr,
    STATE_D_CONTIG: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_S: tl.constexpr,
):
    # Programs: (piece, feature block), features fastest.
    # - Pieces p < n_tiles are tiles: the tokens of [p*BLOCK_T, (p+1)*BLOCK_T)
    #   past their sequence's head. Their W-1 rows of context are tokens of the
    #   same sequence.
    # - Pieces n_tiles + h hold the heads of sequences [h*HEAD_S, (h+1)*HEAD_S).
    #   A sequence's head is its tokens up to the first multiple of BLOCK_T at
    #   least W-1 tokens past its start; the head reads the cache line and
    #   writes it back, and nothing else touches the line, so there is no race.
    #   One-token sequences (decodes) of the group are done together, all
    #   their loads issued before any store.
    # Every piece lies in one sequence, so a program walks its rows with a
    # rolling window of 1-D row vectors and no per-row lookups.
    pid = tl.program_id(0).to(tl.int64)
    n_blocks_d = tl.cdiv(dim, BLOCK_D)
    i_d = pid % n_blocks_d
    i_p = pid // n_blocks_d
    # Feature offsets in int32 (dim < 2^31); token offsets go into 64-bit row pointers.
    o_d = i_d.to(tl.int32) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < dim
    o_sd = _state_feature_offsets(o_d, stride_state_d, STATE_D_CONTIG)
    if i_p < n_tiles:
        t_tile = i_p * BLOCK_T
        if HAS_TILE_SEQ:
            seq = tl.load(tile_seq_ptr + i_p).to(tl.int64)
        else:
            seq = _count_starts_le(t_tile, qsl_ptr, batch, n_search).to(tl.int64) - 1
        start = tl.load(qsl_ptr + seq).to(tl.int64)
        end = tl.load(qsl_ptr + seq + 1).to(tl.int64)
        head_end = tl.minimum(end, tl.cdiv(start + KERNEL_WIDTH - 1, BLOCK_T) * BLOCK_T)
        # A tile the head covers has nothing left to do.
        t_end = tl.where(t_tile < head_end, t_tile, tl.minimum(end, t_tile + BLOCK_T))
        if HAS_CACHE_INDICES:
            line = tl.load(cache_idx_ptr + seq).to(tl.int64)
        else:
            line = seq
        # max(., start) changes nothing (an active tile starts past its head) but
        # hides that t0 is a multiple of BLOCK_T: knowing it, the compiler spends
        # ~50% more registers on the row loop (148 vs 101 at sm_90), which costs
        # occupancy.
        t0 = tl.where(seq < 0, start, t_tile)
        _fwd_piece(
            x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, start, end, t0, t_end, line,
            False, o_d, o_sd, m_d, stride_x_t, stride_w_d, stride_state_line, stride_state_col,
            stride_out_t, pad_slot_id, KERNEL_WIDTH, HAS_BIAS, SILU, False, BLOCK_G,
        )  # fmt: skip
    else:
        s0 = (i_p - n_tiles) * HEAD_S
        if HEAD_S > 1:
            _fwd_decodes(
                x_ptr, w_ptr, bias_ptr, state_ptr, qsl_ptr, cache_idx_ptr, has_init_ptr,
                out_ptr, s0, batch, o_d, o_sd, m_d, pad_slot_id, stride_x_t, stride_w_d,
                stride_state_line, stride_state_col, stride_out_t, KERNEL_WIDTH, HAS_BIAS,
                SILU, HAS_CACHE_INDICES, HAS_INITIAL_STATE, HEAD_S,
            )  # fmt: skip
        # A loop, not unrolled: HEAD_S copies of the piece made Triton's coalescing pass
        # (quadratic in the memory ops) most of the many_heads variants' compile, the long
        # pole of a cold start (10.5-12.9 s on the H200 box's CPU; 2.4 s as a loop, the
        # same 128 registers at sm_90, the same outputs, step times 0.97-1.02x:
        # benchmarks/kernels/conv1d_compile_report.py, docs/benchmarks/causal_conv1d_h200.md).
        for i in range(HEAD_S):
            seq = s0 + i
            valid = seq < batch
            start = tl.load(qsl_ptr + seq, mask=valid, other=0).to(tl.int64)
            end = tl.load(qsl_ptr + seq + 1, mask=valid, other=0).to(tl.int64)
            if valid & ((HEAD_S == 1) | (end - start != 1)):
                head_end = tl.minimum(end, tl.cdiv(start + KERNEL_WIDTH - 1, BLOCK_T) * BLOCK_T)
                if HAS_CACHE_INDICES:
                    line = tl.load(cache_idx_ptr + seq).to(tl.int64)
                else:
                    line = seq
                if HAS_INITIAL_STATE:
                    use_hist = tl.load(has_init_ptr + seq).to(tl.int1)
                else:
                    use_hist = False
                _fwd_piece(
                    x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, start, end, start, head_end,
                    line, use_hist & (line != pad_slot_id) & (line >= 0), o_d, o_sd, m_d,
                    stride_x_t, stride_w_d,
                    stride_state_line, stride_state_col, stride_out_t, pad_slot_id,
                    KERNEL_WIDTH, HAS_BIAS, SILU, True, BLOCK_G,
                )  # fmt: skip


@triton.jit
def _fwd_decodes(
    x_ptr,
    w_ptr,
    bias_ptr,
    state_ptr,
    qsl_ptr,
    cache_idx_ptr,
    has_init_ptr,
    out_ptr,
    s0,
    batch,
    o_d,
    o_sd,
    m_d,
    pad_slot_id,
    stride_x_t,
    stride_w_d,
    stride_state_line,
    stride_state_col,
    stride_out_t,
    KERNEL_WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    HAS_CACHE_INDICES: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr,
    HEAD_S: tl.constexpr,
):
    """The one-token sequences among [s0, s0 + HEAD_S): every load, then every store."""
    # Loads: for each sequence, its token and its W-1 columns of history.
    rows = ()
    for i in tl.static_range(HEAD_S):
        seq = s0 + i
        valid = seq < batch
        start = tl.load(qsl_ptr + seq, mask=valid, other=0).to(tl.int64)
        end = tl.load(qsl_ptr + seq + 1, mask=valid, other=0).to(tl.int64)
        if HAS_CACHE_INDICES:
            line = tl.load(cache_idx_ptr + seq, mask=valid, other=pad_slot_id).to(tl.int64)
        else:
            line = seq
        one = valid & (end - start == 1)
        live = one & (line != pad_slot_id) & (line >= 0)
        if HAS_INITIAL_STATE:
            hist = live & tl.load(has_init_ptr + seq, mask=valid, other=0).to(tl.int1)
        else:
            hist = live & False
        p_line = state_ptr + line * stride_state_line
        win = ()
        for j in tl.static_range(KERNEL_WIDTH - 1):
            p_h = p_line + j * stride_state_col + o_sd
            win = win + (tl.load(p_h, mask=m_d & hist, other=0.0),)
        b_x = tl.load(x_ptr + start * stride_x_t + o_d, mask=m_d & live, other=0.0)
        rows = rows + ((start, one, live, p_line, win, b_x),)
    if HAS_BIAS:
        b_bias = tl.load(bias_ptr + o_d, mask=m_d, other=0.0).to(tl.float32)
    else:
        b_bias = tl.zeros(o_d.shape, dtype=tl.float32)
    b_ws = ()
    for k in tl.static_range(KERNEL_WIDTH):
        b_w = tl.load(w_ptr + o_d * stride_w_d + k, mask=m_d, other=0.0)
        b_ws = b_ws + (b_w.to(tl.float32),)
    # Stores: the output row, and the history shifted by one token.
    for i in tl.static_range(HEAD_S):
        start, one, live, p_line, win, b_x = rows[i]
        acc = b_bias + b_x.to(tl.float32) * b_ws[KERNEL_WIDTH - 1]
        for k in tl.static_range(KERNEL_WIDTH - 1):
            acc += win[k].to(tl.float32) * b_ws[k]
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        acc = tl.where(live, acc, 0.0)
        p_out = out_ptr + start * stride_out_t + o_d
        tl.store(p_out, acc.to(out_ptr.dtype.element_ty), mask=m_d & one)
        for j in tl.static_range(KERNEL_WIDTH - 2):
            tl.store(p_line + j * stride_state_col + o_sd, win[j + 1], mask=m_d & live)
        p_last = p_line + (KERNEL_WIDTH - 2) * stride_state_col + o_sd
        tl.store(p_last, b_x.to(state_ptr.dtype.element_ty), mask=m_d & live)


@triton.jit
def _causal_conv1d_update_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    state_ptr,
    idx_ptr,
    accepted_ptr,
    qsl_ptr,
    out_ptr,
    dim,
    seqlen,
    pad_slot_id,
    stride_x_seq,
    stride_x_t,
    stride_w_d,
    stride_state_line,
    stride_state_d,
    stride_state_col,
    stride_out_seq,
    stride_out_t,
    KERNEL_WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    HAS_INDICES: tl.constexpr,
    IS_SPEC: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (sequence, feature block); the grid depends on shapes
    # only, so the kernel can be captured in a CUDA graph.
    i_b = tl.program_id(0).to(tl.int64)
    i_d = tl.program_id(1).to(tl.int64)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D).to(tl.int64)
    m_d = o_d < dim
    # 64-bit already; a feature stride of 1 is specialised to a constant by Triton.
    o_sd = o_d * stride_state_d
    if HAS_INDICES:
        line = tl.load(idx_ptr + i_b).to(tl.int64)
    else:
        line = i_b
    live = (line != pad_slot_id) & (line >= 0)
    if IS_VARLEN:
        tok0 = tl.load(qsl_ptr + i_b).to(tl.int64)
        n_tok = tl.load(qsl_ptr + i_b + 1).to(tl.int64) - tok0
        p_x0 = x_ptr + tok0 * stride_x_t
        p_out0 = out_ptr + tok0 * stride_out_t
    else:
        n_tok = seqlen
        p_x0 = x_ptr + i_b * stride_x_seq
        p_out0 = out_ptr + i_b * stride_out_seq
    if IS_SPEC:
        off = tl.load(accepted_ptr + i_b).to(tl.int64) - 1
    else:
        off = 0
    p_line = state_ptr + line * stride_state_line

    # Outputs. Window position q < W-1 reads history column off + q, later
    # positions read the tokens.
    for l0 in range(0, n_tok, BLOCK_L):
        o_l = l0 + tl.arange(0, BLOCK_L).to(tl.int64)
        m_l = (o_l < n_tok) & live
        acc = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
        for k in tl.static_range(KERNEL_WIDTH):
            q = o_l + k
            from_h = q < KERNEL_WIDTH - 1
            p_h = p_line + (off + q)[:, None] * stride_state_col + o_sd[None, :]
            b_h = tl.load(p_h, mask=(m_l & from_h)[:, None] & m_d[None, :], other=0.0)
            p_x = p_x0 + (q - (KERNEL_WIDTH - 1))[:, None] * stride_x_t + o_d[None, :]
            b_x = tl.load(p_x, mask=(m_l & ~from_h)[:, None] & m_d[None, :], other=0.0)
            b_v = tl.where(from_h[:, None], b_h.to(tl.float32), b_x.to(tl.float32))
            b_w = tl.load(w_ptr + o_d * stride_w_d + k, mask=m_d, other=0.0).to(tl.float32)
            acc += b_v * b_w[None, :]
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        acc = tl.where(live, acc, 0.0)
        p_out = p_out0 + o_l[:, None] * stride_out_t + o_d[None, :]
        tl.store(
            p_out, acc.to(out_ptr.dtype.element_ty), mask=(o_l < n_tok)[:, None] & m_d[None, :]
        )

    # Write back xx[shift:] into the first W-1+L-shift columns. Each chunk
    # reads columns at or after the ones it writes, so a barrier between its
    # reads and its writes is enough.
    tl.debug_barrier()
    if live:
        if IS_SPEC:
            shift = tl.minimum(n_tok, 1)
        else:
            shift = n_tok
        n_write = KERNEL_WIDTH - 1 + n_tok - shift
        for c0 in range(0, n_write, BLOCK_C):
            o_c = c0 + tl.arange(0, BLOCK_C).to(tl.int64)
            m_c = o_c < n_write
            q = o_c + shift
            from_h = q < KERNEL_WIDTH - 1
            p_h = p_line + (off + q)[:, None] * stride_state_col + o_sd[None, :]
            b_h = tl.load(p_h, mask=(m_c & from_h)[:, None] & m_d[None, :], other=0.0)
            p_x = p_x0 + (q - (KERNEL_WIDTH - 1))[:, None] * stride_x_t + o_d[None, :]
            b_x = tl.load(p_x, mask=(m_c & ~from_h)[:, None] & m_d[None, :], other=0.0)
            b_v = tl.where(from_h[:, None], b_h, b_x.to(state_ptr.dtype.element_ty))
            tl.debug_barrier()
            p_dst = p_line + o_c[:, None] * stride_state_col + o_sd[None, :]
            tl.store(p_dst, b_v, mask=m_c[:, None] & m_d[None, :])


@triton.jit
def _causal_conv1d_decode_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    state_ptr,
    idx_ptr,
    out_ptr,
    dim,
    pad_slot_id,
    stride_x_seq,
    stride_w_d,
    stride_state_line,
    stride_state_d,
    stride_state_col,
    stride_out_seq,
    KERNEL_WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    HAS_INDICES: tl.constexpr,
    STATE_D_CONTIG: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # The common decode: one token per sequence, no speculation. One program
    # per (sequence, feature block) reads the W-1 history columns and the
    # token as 1-D vectors, and writes the output and the shifted history.
    i_b = tl.program_id(0).to(tl.int64)
    o_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < dim
    o_sd = _state_feature_offsets(o_d, stride_state_d, STATE_D_CONTIG)
    if HAS_INDICES:
        line = tl.load(idx_ptr + i_b).to(tl.int64)
    else:
        line = i_b
    # The token row exists for every program (a padded row's output is zeroed below), so
    # its load does not wait for the index load; only the state's loads and stores do.
    b_x = tl.load(x_ptr + i_b * stride_x_seq + o_d, mask=m_d, other=0.0)
    live = (line != pad_slot_id) & (line >= 0)
    p_line = state_ptr + line * stride_state_line
    b_win = ()
    for j in tl.static_range(KERNEL_WIDTH - 1):
        b_win = b_win + (tl.load(p_line + j * stride_state_col + o_sd, mask=m_d & live, other=0.0),)
    b_win = b_win + (b_x.to(state_ptr.dtype.element_ty),)
    if HAS_BIAS:
        acc = tl.load(bias_ptr + o_d, mask=m_d, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in tl.static_range(KERNEL_WIDTH):
        b_w = tl.load(w_ptr + o_d * stride_w_d + k, mask=m_d, other=0.0).to(tl.float32)
        if k == KERNEL_WIDTH - 1:
            acc += b_x.to(tl.float32) * b_w
        else:
            acc += b_win[k].to(tl.float32) * b_w
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    acc = tl.where(live, acc, 0.0)
    tl.store(out_ptr + i_b * stride_out_seq + o_d, acc.to(out_ptr.dtype.element_ty), mask=m_d)
    for j in tl.static_range(KERNEL_WIDTH - 1):
        tl.store(p_line + j * stride_state_col + o_sd, b_win[j + 1], mask=m_d & live)


# Launch with the compiled kernels cached by their specialisation (host cost).
_LAUNCH_FWD = CachedLauncher(_causal_conv1d_fwd_kernel)
_LAUNCH_UPDATE = CachedLauncher(_causal_conv1d_update_kernel)
_LAUNCH_DECODE = CachedLauncher(_causal_conv1d_decode_kernel)
