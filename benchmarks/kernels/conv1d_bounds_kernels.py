"""Triton kernels of conv1d_bounds.py: the floors it times against the causal-conv1d ops.

Each mirrors one of the op's kernels (vllm/model_executor/layers/mamba/ops/causal_conv1d.py)
with one cost taken out; the programs, tiles and loops are the op's.

- ``_empty_kernel``: nothing; launched on the op's grid (launch and scheduling).
- ``_grid_copy_kernel``: the forward's grid, program order and rolling window of rows, loads
  and stores only, no metadata loads; heads move the state lines.
- ``_fwd_no_metadata_kernel``: the forward kernel, its arithmetic through the op's own
  ``_fwd_piece``, with sequence bounds and lines computed from two lengths instead of loaded.
- ``_decode_copy_kernel``: the decode kernel's grid and loads (line = sequence), no arithmetic.
- ``_chain_kernel``: index load -> store, or index -> state row -> store.

Sequences are laid out as sequence 0 of ``first_len`` tokens, then sequences of ``rest_len``
(the four cases' layouts), on lines 0..batch-1 of the pool (same bytes as the op's shuffled
lines). ``sel`` is 0 at run time: a select on it keeps loads alive that a pure copy would
not use (the halo rows, the history), at one select per stored element.
"""

import triton
import triton.language as tl

from vllm.model_executor.layers.mamba.ops.causal_conv1d import _fwd_piece

# Run-time values, never compiled in (Triton would make a 1 a constant): the variants know
# the layout no earlier than the op does.
_RUNTIME = ["num_tokens", "n_tiles", "batch", "first_len", "rest_len", "use_hist"]


@triton.jit
def _empty_kernel(x_ptr):
    pass


@triton.jit
def _bounds(seq, first_len, rest_len):
    """[start, end) of sequence seq: sequence 0 has first_len tokens, the others rest_len."""
    start = tl.where(seq == 0, 0, first_len + (seq - 1) * rest_len)
    return start, start + tl.where(seq == 0, first_len, rest_len)


@triton.jit(do_not_specialize=[*_RUNTIME, "sel"])
def _grid_copy_kernel(x_ptr, state_ptr, out_ptr, num_tokens, n_tiles, dim, batch, first_len,
                      rest_len, use_hist, stride_x_t, stride_state_line, stride_state_col,
                      stride_out_t, sel, KERNEL_WIDTH: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                      HEAD_S: tl.constexpr):  # fmt: skip
    # The op's program order (pieces x feature blocks, features fastest). Tiles copy their
    # rows through the op's rolling window; out[t] = x[t] unless sel (0 at run time) picks
    # the row W-1 before it, which keeps the halo loads alive. Heads write each sequence's
    # last W-1 inputs (old history where shorter) into line seq, as the op's heads do.
    pid = tl.program_id(0).to(tl.int64)
    n_blocks_d = tl.cdiv(dim, BLOCK_D)
    i_p = pid // n_blocks_d
    o_d = (pid % n_blocks_d).to(tl.int32) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < dim
    if i_p < n_tiles:
        t0 = i_p * BLOCK_T
        t_end = tl.minimum(num_tokens, t0 + BLOCK_T)
        b_win = ()
        for j in tl.static_range(KERNEL_WIDTH - 1):
            p = t0 - (KERNEL_WIDTH - 1) + j
            b_win = b_win + (tl.load(x_ptr + p * stride_x_t + o_d, mask=m_d & (p >= 0)),)
        for g0 in range(t0, t_end, BLOCK_G):
            b_rows = b_win
            for j in tl.static_range(BLOCK_G):
                m = m_d & (g0 + j < t_end)
                b_rows = b_rows + (tl.load(x_ptr + (g0 + j) * stride_x_t + o_d, mask=m),)
            for r in tl.static_range(BLOCK_G):
                v = tl.where(sel != 0, b_rows[r], b_rows[r + KERNEL_WIDTH - 1])
                tl.store(out_ptr + (g0 + r) * stride_out_t + o_d, v, mask=m_d & (g0 + r < t_end))
            b_win = b_rows[BLOCK_G:]
    else:
        for i in tl.static_range(HEAD_S):
            seq = (i_p - n_tiles) * HEAD_S + i
            start, end = _bounds(seq, first_len, rest_len)
            ok = m_d & (seq < batch)
            p_line = state_ptr + seq * stride_state_line
            b_new = ()
            for j in tl.static_range(KERNEL_WIDTH - 1):
                p = end - (KERNEL_WIDTH - 1) + j
                b_x = tl.load(x_ptr + p * stride_x_t + o_d, mask=ok & (p >= start))
                p_h = p_line + (p - start + KERNEL_WIDTH - 1) * stride_state_col + o_d
                b_h = tl.load(p_h, mask=ok & (p < start) & (use_hist != 0), other=0.0)
                b_new = b_new + (tl.where(p >= start, b_x.to(b_h.dtype), b_h),)
            tl.debug_barrier()
            for j in tl.static_range(KERNEL_WIDTH - 1):
                tl.store(p_line + j * stride_state_col + o_d, b_new[j], mask=ok)


@triton.jit
def _decodes_const(x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, s0, batch, first_len, rest_len,
                   use_hist, o_d, m_d, stride_x_t, stride_w_d, stride_state_line,
                   stride_state_col, stride_out_t, KERNEL_WIDTH: tl.constexpr,
                   HAS_BIAS: tl.constexpr, SILU: tl.constexpr, HEAD_S: tl.constexpr):  # fmt: skip
    """The op's ``_fwd_decodes``, sequence bounds and lines (line = seq) from constants."""
    rows = ()
    for i in tl.static_range(HEAD_S):
        seq = s0 + i
        start, end = _bounds(seq, first_len, rest_len)
        one = (seq < batch) & (end - start == 1)
        hist = one & (use_hist != 0)
        p_line = state_ptr + seq * stride_state_line
        win = ()
        for j in tl.static_range(KERNEL_WIDTH - 1):
            win = win + (tl.load(p_line + j * stride_state_col + o_d, mask=m_d & hist, other=0.0),)
        b_x = tl.load(x_ptr + start * stride_x_t + o_d, mask=m_d & one, other=0.0)
        rows = rows + ((start, one, p_line, win, b_x),)
    if HAS_BIAS:
        b_bias = tl.load(bias_ptr + o_d, mask=m_d, other=0.0).to(tl.float32)
    else:
        b_bias = tl.zeros(o_d.shape, dtype=tl.float32)
    b_ws = ()
    for k in tl.static_range(KERNEL_WIDTH):
        b_ws = b_ws + (tl.load(w_ptr + o_d * stride_w_d + k, mask=m_d, other=0.0).to(tl.float32),)
    for i in tl.static_range(HEAD_S):
        start, one, p_line, win, b_x = rows[i]
        acc = b_bias + b_x.to(tl.float32) * b_ws[KERNEL_WIDTH - 1]
        for k in tl.static_range(KERNEL_WIDTH - 1):
            acc += win[k].to(tl.float32) * b_ws[k]
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        acc = tl.where(one, acc, 0.0)
        tl.store(out_ptr + start * stride_out_t + o_d, acc.to(out_ptr.dtype.element_ty),
                 mask=m_d & one)  # fmt: skip
        for j in tl.static_range(KERNEL_WIDTH - 2):
            tl.store(p_line + j * stride_state_col + o_d, win[j + 1], mask=m_d & one)
        p_last = p_line + (KERNEL_WIDTH - 2) * stride_state_col + o_d
        tl.store(p_last, b_x.to(state_ptr.dtype.element_ty), mask=m_d & one)


@triton.jit(do_not_specialize=_RUNTIME)
def _fwd_no_metadata_kernel(x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, num_tokens, n_tiles, dim,
                            batch, first_len, rest_len, use_hist, stride_x_t, stride_w_d,
                            stride_state_line, stride_state_col, stride_out_t,
                            KERNEL_WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr,
                            SILU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr,
                            BLOCK_D: tl.constexpr, HEAD_S: tl.constexpr):  # fmt: skip
    # The op's _causal_conv1d_fwd_kernel with every metadata load replaced by arithmetic.
    pid = tl.program_id(0).to(tl.int64)
    n_blocks_d = tl.cdiv(dim, BLOCK_D)
    i_p = pid // n_blocks_d
    o_d = (pid % n_blocks_d).to(tl.int32) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < dim
    if i_p < n_tiles:
        t_tile = i_p * BLOCK_T
        seq = tl.where(t_tile < first_len, 0, 1 + (t_tile - first_len) // rest_len)
        start, end = _bounds(seq, first_len, rest_len)
        head_end = tl.minimum(end, tl.cdiv(start + KERNEL_WIDTH - 1, BLOCK_T) * BLOCK_T)
        t_end = tl.where(t_tile < head_end, t_tile, tl.minimum(end, t_tile + BLOCK_T))
        t0 = tl.where(seq < 0, start, t_tile)  # as the op: hides that t0 % BLOCK_T == 0
        _fwd_piece(
            x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, start, end, t0, t_end, seq, False,
            o_d, o_d, m_d, stride_x_t, stride_w_d, stride_state_line, stride_state_col,
            stride_out_t, -1, KERNEL_WIDTH, HAS_BIAS, SILU, False, BLOCK_G,
        )  # fmt: skip
    else:
        s0 = (i_p - n_tiles) * HEAD_S
        if HEAD_S > 1:
            _decodes_const(
                x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, s0, batch, first_len, rest_len,
                use_hist, o_d, m_d, stride_x_t, stride_w_d, stride_state_line,
                stride_state_col, stride_out_t, KERNEL_WIDTH, HAS_BIAS, SILU, HEAD_S,
            )  # fmt: skip
        for i in tl.static_range(HEAD_S):
            seq = s0 + i
            start, end = _bounds(seq, first_len, rest_len)
            if (seq < batch) & ((HEAD_S == 1) | (end - start != 1)):
                head_end = tl.minimum(end, tl.cdiv(start + KERNEL_WIDTH - 1, BLOCK_T) * BLOCK_T)
                _fwd_piece(
                    x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, start, end, start, head_end,
                    seq, use_hist != 0, o_d, o_d, m_d, stride_x_t, stride_w_d,
                    stride_state_line, stride_state_col, stride_out_t, -1, KERNEL_WIDTH,
                    HAS_BIAS, SILU, True, BLOCK_G,
                )  # fmt: skip


@triton.jit
def _decode_copy_kernel(x_ptr, state_ptr, out_ptr, dim, stride_x, stride_state_line,
                        stride_state_col, stride_out, sel, KERNEL_WIDTH: tl.constexpr,
                        BLOCK_D: tl.constexpr):  # fmt: skip
    # The decode kernel's grid and loads (line = sequence, no index), no arithmetic: out is
    # the token (or, if sel, the oldest history column), the line is shifted by one token.
    i_b = tl.program_id(0).to(tl.int64)
    o_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < dim
    p_line = state_ptr + i_b * stride_state_line
    b_win = ()
    for j in tl.static_range(KERNEL_WIDTH - 1):
        b_win = b_win + (tl.load(p_line + j * stride_state_col + o_d, mask=m_d),)
    b_x = tl.load(x_ptr + i_b * stride_x + o_d, mask=m_d)
    b_win = b_win + (b_x.to(b_win[0].dtype),)
    v = tl.where(sel != 0, b_win[0].to(b_x.dtype), b_x)
    tl.store(out_ptr + i_b * stride_out + o_d, v, mask=m_d)
    for j in tl.static_range(KERNEL_WIDTH - 1):
        tl.store(p_line + j * stride_state_col + o_d, b_win[j + 1], mask=m_d)


@triton.jit
def _chain_kernel(idx_ptr, state_ptr, out_ptr, dim, stride_state_line, DEPTH: tl.constexpr,
                  BLOCK_D: tl.constexpr):  # fmt: skip
    # DEPTH 1: out = the sequence's line index; 2: out = column 0 of that line.
    i_b = tl.program_id(0).to(tl.int64)
    o_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < dim
    line = tl.load(idx_ptr + i_b).to(tl.int64)
    if DEPTH == 1:
        v = (line + o_d * 0).to(out_ptr.dtype.element_ty)
    else:
        v = tl.load(state_ptr + line * stride_state_line + o_d, mask=m_d)
        v = v.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + i_b * dim + o_d, v, mask=m_d)
