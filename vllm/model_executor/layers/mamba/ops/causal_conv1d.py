"""Triton causal-conv1d kernels for Mamba-family layers.

The operation, per feature ``d`` of a sequence with kernel width ``W``::

    y[t, d] = act(bias[d] + sum_{k<W} w[d, k] * xx[t - (W-1) + k, d])

where ``xx`` is the sequence's tokens preceded by W-1 columns of left context:
the sequence's cache line when it has an initial state, zeros otherwise.
``act`` is SiLU or identity. Products and sums are fp32; one cast at the store.

Tensors (logical shapes; the stride that must be 1 in brackets):

- ``x``: (dim, num_tokens) [dim] for ``causal_conv1d_fn``; the token stride may
  exceed dim (a view into a wider projection). Never copied.
- ``weight``: (dim, W) [W], 2 <= W <= 8.  ``bias``: (dim,) or None.
- ``conv_states``: (num_cache_lines, dim, state_len), state_len >= W-1, any of
  fp32/fp16/bf16 whatever x's dtype, any strides (the kernels take all three;
  only aliasing strides, a 0 over a dimension of size > 1, are refused).
  Feature-contiguous (stride(1) == 1: allocate (lines, state_len, dim) and
  transpose) is the fast layout; others, such as upstream's CUDA layout
  (lines, dim, state_len) contiguous, are served in place, with strided loads.
  Mutated in place.
- ``query_start_loc``: (batch+1,) int32; ``cache_indices``: (>= batch,) int32;
  ``has_initial_state``: (>= batch,) bool. Per-sequence arrays may be padded
  buffers longer than the batch: entries past ``batch`` are never read. All
  1-D arrays are contiguous.

Cache lines: the W-1 columns of history a sequence starts from are
``line[:, off : off + W - 1]``, ``off = num_accepted_tokens - 1`` in speculative
decoding and 0 otherwise. After a step over L tokens, with
``xx = cat(history, tokens)``, the first ``W - 1 + L - shift`` columns hold
``xx[:, shift:]``: ``shift = L`` normally (the last W-1 inputs) and
``shift = min(L, 1)`` in speculative decoding, so the next step can start from
any accepted prefix. Later columns are left as they are.

Padded rows (cache index == ``pad_slot_id``, or ``null_block_id``: upstream's
later name for the same marker, a keyword of both ops; both given with different
values is a ValueError) get zero outputs; their cache lines, and every line no
sequence names, are not touched.

``causal_conv1d_fn`` handles a whole continuous-batching step (fresh prefills,
chunked-prefill continuations and one-token decodes) in one launch, parallel
over features, sequences and tiles of tokens. The grid is sized from shapes
alone (tiles of the token stream plus one head piece per sequence), so it
needs no host data: a tile finds its sequence by binary search over
``query_start_loc`` or, faster, in the tile map of the step's metadata
(``compute_causal_conv1d_metadata``). Only a sequence's head piece reads and
writes its cache line, so states are read and written without a race.

``causal_conv1d_update`` serves decode and speculative decode with a grid of
(batch, feature blocks) fixed by shapes, and no host sync, so it can be
captured in a CUDA graph, padded rows included.

Host path: a call whose arguments have the layout of an earlier one (shapes, strides,
dtypes, devices, options) skips the checks through a cached launch plan and launches the
compiled kernel directly (``causal_conv1d_host.py``); the metadata builder is host work on
numpy with one copy to the device.

On CPU tensors both ops run the fp32 references in ``causal_conv1d_ref``,
unless ``TRITON_INTERPRET=1``, in which case the Triton kernels run through
the interpreter. Without Triton the module still imports; CUDA calls then
raise a RuntimeError.
"""

import functools
from dataclasses import dataclass

import numpy as np
import torch

from vllm.model_executor.layers.mamba.ops.causal_conv1d_host import (
    PAD_DEFAULT,
    check_cache_indices_data,
    check_common,
    check_index,
    check_qsl,
    check_qsl_data,
    feature_contiguous,
    one_d_contiguous,
    pad_marker,
)
from vllm.model_executor.layers.mamba.ops.causal_conv1d_ref import (
    PAD_SLOT_ID,
    _is_silu,
    causal_conv1d_ref,
    causal_conv1d_update_ref,
)
from vllm.tensor_checks import FLOAT_DTYPES, check_default_lines, check_tensor
from vllm.triton_utils import HAS_TRITON, tl, triton
from vllm.triton_utils.host import (
    PlanCache,
    cdiv,
    direct_kernel,
    direct_stream,
    next_power_of_2,
    recording,
)
from vllm.triton_utils.launch import CachedLauncher

__all__ = [
    "PAD_SLOT_ID",
    "CausalConv1dMetadata",
    "causal_conv1d_fn",
    "causal_conv1d_ref",
    "causal_conv1d_update",
    "causal_conv1d_update_ref",
    "compute_causal_conv1d_metadata",
]


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
    live = line != pad_slot_id
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
        # Unrolled rather than a loop: a loop around the piece costs registers.
        for i in tl.static_range(HEAD_S):
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
                    line, use_hist & (line != pad_slot_id), o_d, o_sd, m_d, stride_x_t,
                    stride_w_d,
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
        live = one & (line != pad_slot_id)
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
    live = line != pad_slot_id
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
    live = line != pad_slot_id
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


# --------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------


@dataclass
class CausalConv1dMetadata:
    """Per-step data for ``causal_conv1d_fn``, built once and shared by every layer.

    ``tile_seq[p]`` is the sequence holding token ``p * block_t`` (p < number of
    tiles of ``block_t`` tokens); the kernel reads it instead of binary-searching
    ``query_start_loc`` in every program.
    """

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    tile_seq: torch.Tensor
    block_t: int
    num_tokens: int
    batch_size: int
    max_query_len: int


def compute_causal_conv1d_metadata(
    query_start_loc_cpu: torch.Tensor, device: torch.device | str
) -> CausalConv1dMetadata:
    """Build the step's metadata from host offsets; the copy to ``device`` is non-blocking.

    Host work only (numpy on the offsets, no device read), done once per step. On CUDA the
    offsets and the tile map travel in one pinned buffer and one copy; ``query_start_loc``
    and ``tile_seq`` are views of the device copy, each starting 16-byte aligned (the
    kernels' compiled variants assume aligned pointers).
    """
    qsl = query_start_loc_cpu
    if not isinstance(qsl, torch.Tensor) or qsl.device.type != "cpu":
        raise ValueError("query_start_loc_cpu must be a CPU tensor")
    if qsl.dim() != 1 or qsl.shape[0] < 1 or qsl.dtype != torch.int32:
        raise ValueError(
            f"query_start_loc_cpu must be a 1-D int32 tensor of batch+1 offsets, got "
            f"shape {tuple(qsl.shape)} dtype {qsl.dtype}"
        )
    # numpy calls on arrays this small cost about a microsecond each: few of them, and the
    # ufunc and ndarray methods (a third of np.searchsorted's or ndarray.min's cost)
    q = qsl.numpy()
    batch = q.shape[0] - 1
    ends = q[1:]
    if batch:
        lens = ends - q[:-1]
        if q[0] != 0 or np.minimum.reduce(lens) < 0:
            raise ValueError("query_start_loc_cpu must start at 0 and be non-decreasing")
        max_query_len = int(np.maximum.reduce(lens))
    elif q[0] != 0:
        raise ValueError("query_start_loc_cpu must start at 0 and be non-decreasing")
    else:
        max_query_len = 0
    num_tokens = int(q[-1])
    block_t = _fwd_block_t(num_tokens)
    n_tiles = -(-num_tokens // block_t)
    # tile_seq[p], the last sequence starting at or before token t = p * block_t, is the
    # number of sequence ends at or before t (query_start_loc[0] = 0 <= t always).
    starts = _tile_starts(block_t, n_tiles)
    device = device if isinstance(device, torch.device) else torch.device(device)
    if device.type == "cuda":
        off = (batch + 4) // 4 * 4  # batch + 1 offsets, rounded up to 16 bytes
        host = torch.empty(off + n_tiles, dtype=torch.int32, pin_memory=True)
        h = host.numpy()
        h[: batch + 1] = q
        h[off:] = ends.searchsorted(starts, "right")
        both = host.to(device, non_blocking=True)
        qsl_dev, tile_seq = both[: batch + 1], both[off:]
    else:
        tiles = ends.searchsorted(starts, "right").astype(np.int32)
        qsl_dev, tile_seq = qsl.to(device), torch.from_numpy(tiles).to(device)
    return CausalConv1dMetadata(
        query_start_loc=qsl_dev,
        query_start_loc_cpu=qsl,
        tile_seq=tile_seq,
        block_t=block_t,
        num_tokens=num_tokens,
        batch_size=batch,
        max_query_len=max_query_len,
    )


_TILE_STARTS: dict[int, np.ndarray] = {}


def _tile_starts(block_t: int, n_tiles: int) -> np.ndarray:
    """``arange(n_tiles) * block_t``, a view of a cached array grown as steps need."""
    starts = _TILE_STARTS.get(block_t)
    if starts is None or starts.shape[0] < n_tiles:
        size = max(n_tiles, 2 * (0 if starts is None else starts.shape[0]), 1024)
        starts = _TILE_STARTS[block_t] = np.arange(size, dtype=np.int32) * block_t
    return starts[:n_tiles]


# --------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------


def _use_kernel(x: torch.Tensor) -> bool:
    """CUDA tensors run the kernels; CPU tensors run them only under the interpreter
    (``CachedLauncher.runs_cpu_tensors``), else the reference."""
    if x.is_cuda:
        if not HAS_TRITON:
            raise RuntimeError("causal-conv1d on CUDA tensors needs Triton, which is not installed")
        return True
    return _LAUNCH_FWD.runs_cpu_tensors()


# --------------------------------------------------------------------------
# causal_conv1d_fn
# --------------------------------------------------------------------------


def _fwd_block_t(num_tokens: int) -> int:
    # Tokens per tile: long tiles amortise the W-1 rows of context each one
    # re-reads; short ones spread a small step over every SM. Chosen on an
    # H200 with benchmarks/kernels/tune_causal_conv1d.py.
    return 64 if num_tokens > _SMALL_STEP_TOKENS else 32


# Steps up to this many tokens take the small-step configuration of _fwd_config.
_SMALL_STEP_TOKENS = 32768


@functools.cache
def _fwd_configs(elem_size: int) -> dict[str, dict]:
    """The forward's launch configurations, by name: ``_fwd_config`` picks one, and the
    engine's start-up compiles them all (``_fwd_variants``). Shared: never mutate."""
    return {
        # Small steps of prefills (see _fwd_config): 16 rows in flight per program,
        # capped at 80 registers so that 25 warps fit on an SM instead of 10 (at 187
        # registers uncapped; the cap makes the compiler spill, a 440-byte stack frame
        # at sm_90, and still wins).
        "small_step": dict(
            BLOCK_G=16, BLOCK_D=8 // elem_size * 32 * 2, HEAD_S=1, num_warps=2, maxnreg=80
        ),
        # One 8-byte vector per thread per token row (beat 16 bytes on an H200: fewer
        # registers, more warps in flight); a program keeps BLOCK_G + W-1 rows in
        # registers.
        "tiles": dict(BLOCK_G=8, BLOCK_D=8 // elem_size * 32, HEAD_S=1, num_warps=1),
        # Head programs take 4 sequences each (a step of mostly decodes).
        "many_heads": dict(BLOCK_G=8, BLOCK_D=8 // elem_size * 32, HEAD_S=4, num_warps=1),
    }


def _fwd_config(num_tokens: int, dim: int, width: int, elem_size: int, batch: int) -> dict:
    # Head programs take 4 sequences when there are more sequences than tiles (a step
    # of mostly decodes): fewer, fuller programs (2048 + 255 decodes: 41.9 us vs 50.7 us
    # on an H200). Otherwise one each: that variant needs fewer registers (111 vs 168 at
    # sm_90), which the tiles of long prefills run faster with (16 x 512 tokens: 89 us vs
    # 124 us), and the heads of longer sequences are not walked one after another.
    # Small steps of prefills (sequences of 4 tiles on average, so no crowd of one-token
    # heads) take the small-step configuration. H200, dim 8448, tune --small-steps: 16 x
    # 512 tokens 85.2 us vs 88.0, 16 x 2048 300.9 vs 308.5 (64-token tiles), 16 x 128
    # 29.6 vs 30.9. Taken by 63 decodes next to a 2048-token prefill, it lost: 38.9 us vs
    # 33.0.
    return _fwd_configs(elem_size)[_fwd_config_name(num_tokens, batch)]


def _fwd_config_name(num_tokens: int, batch: int) -> str:
    """The name of ``_fwd_config``'s choice (see there)."""
    n_tiles = -(-num_tokens // _fwd_block_t(num_tokens))
    if num_tokens <= _SMALL_STEP_TOKENS and 4 * batch <= n_tiles:
        return "small_step"
    return "many_heads" if batch >= max(32, n_tiles) else "tiles"


def _fwd_variants(base: dict, elem_size: int) -> list[dict]:
    """Every constexpr set a forward launch like ``base`` can take: each configuration
    with each tile length ``_fwd_block_t`` gives (the small-step one only with the tile
    length of small steps)."""
    block_ts = sorted({_fwd_block_t(1), _fwd_block_t(_SMALL_STEP_TOKENS + 1)})
    out = []
    for name, cfg in _fwd_configs(elem_size).items():
        for block_t in block_ts:
            if name == "small_step" and block_t != _fwd_block_t(_SMALL_STEP_TOKENS):
                continue
            out.append({**base, "BLOCK_T": block_t, **cfg})
    return out


def _fwd_impl(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    silu: bool,
    pad_slot_id: int,
    tile_seq: torch.Tensor | None,
    block_t: int,
) -> torch.Tensor:
    if not _use_kernel(x):
        return causal_conv1d_ref(
            x,
            weight,
            bias,
            conv_states,
            query_start_loc,
            cache_indices,
            has_initial_state,
            "silu" if silu else None,
            pad_slot_id,
        )
    dim, num_tokens = x.shape
    batch = query_start_loc.shape[0] - 1
    width = weight.shape[1]
    out = torch.empty(num_tokens, dim, dtype=x.dtype, device=x.device).t()
    if block_t <= 0:
        block_t = _fwd_block_t(num_tokens)
    cfg = _fwd_config(num_tokens, dim, width, x.element_size(), batch)
    n_tiles = cdiv(num_tokens, block_t)
    n_heads = cdiv(batch, cfg["HEAD_S"])
    grid = ((n_tiles + n_heads) * cdiv(dim, cfg["BLOCK_D"]),)
    if grid[0] == 0:
        return out
    args = (
        x,
        weight,
        bias,
        conv_states,
        query_start_loc,
        cache_indices,
        has_initial_state,
        tile_seq,
        out,
        num_tokens,
        n_tiles,
        dim,
        batch,
        batch.bit_length(),
        pad_slot_id,
        x.stride(1),
        weight.stride(0),
        conv_states.stride(0),
        conv_states.stride(1),
        conv_states.stride(2),
        out.stride(1),
    )
    constexprs = dict(
        KERNEL_WIDTH=width,
        HAS_BIAS=bias is not None,
        SILU=silu,
        HAS_CACHE_INDICES=cache_indices is not None,
        HAS_INITIAL_STATE=has_initial_state is not None,
        HAS_TILE_SEQ=tile_seq is not None,
        STATE_D_CONTIG=feature_contiguous(conv_states),
        BLOCK_T=block_t,
        **cfg,
    )
    _LAUNCH_FWD(
        grid, args, constexprs, variants=lambda: _fwd_variants(constexprs, x.element_size())
    )
    return out


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
    pad_slot_id: int = PAD_DEFAULT,
    metadata: CausalConv1dMetadata | None = None,
    validate_data: bool = False,
    *,
    null_block_id: int | None = None,
) -> torch.Tensor:
    """Causal conv1d over a whole continuous-batching step, in one launch.

    Returns ``out`` (dim, num_tokens) in x's dtype with ``out.stride(0) == 1``,
    and updates the cache line of every non-padded sequence (see the module
    docstring). ``cache_indices=None`` means sequence b uses line b;
    ``has_initial_state=None`` means no sequence has one. ``cache_indices`` and
    ``has_initial_state`` may be longer than the batch (padded buffers): only
    their first ``batch = len(query_start_loc) - 1`` entries are read.

    ``conv_states`` may have any strides; feature-contiguous (``stride(1) == 1``)
    is the fast layout. A sequence whose cache index equals ``pad_slot_id`` (or
    ``null_block_id``, upstream's later name for the same marker; giving both
    with different values is an error) is a padded row.

    ``metadata`` from ``compute_causal_conv1d_metadata`` (built once per step)
    lets the kernel map tokens to sequences with one load. Without it the
    kernel binary-searches ``query_start_loc`` on the device; neither path
    syncs with the host. ``validate_data=True`` adds checks that read device
    data (and so sync).

    A call whose arguments have the layout of an earlier call skips the checks and
    launch decisions that depend on the layout only (see ``causal_conv1d_host.py``).
    """
    key = None
    if not validate_data and not torch.compiler.is_compiling():
        try:
            key = _fwd_key(x, weight, bias, conv_states, query_start_loc, cache_indices,
                           has_initial_state, activation, pad_slot_id, metadata,
                           null_block_id)  # fmt: skip
            plan = _FWD_PLANS.get(key)
        except _KEY_ERRORS:
            key = plan = None
        if plan is not None and (plan.on_cuda or _use_kernel(x)):
            out = plan.run(x, weight, bias, conv_states, query_start_loc, cache_indices,
                           has_initial_state, metadata, x.shape[1])  # fmt: skip
            if out is not None:
                return out
    check_tensor("x", x, x.device if isinstance(x, torch.Tensor) else None, 2, FLOAT_DTYPES)
    dim, num_tokens = x.shape
    if x.stride(0) != 1 and dim > 1:
        raise ValueError(
            f"x must be feature-contiguous (x.stride(0) == 1, shape (dim, num_tokens)), "
            f"got strides {x.stride()}"
        )
    check_common(x, weight, bias, conv_states, dim, "conv_states")
    pad_slot_id = pad_marker(pad_slot_id, null_block_id)
    batch = check_qsl(query_start_loc, x.device)
    check_index("cache_indices", cache_indices, x.device, batch)
    check_index("has_initial_state", has_initial_state, x.device, batch, torch.bool)
    silu = _is_silu(activation)
    tile_seq, block_t = None, 0
    if metadata is not None:
        if not isinstance(metadata, CausalConv1dMetadata):
            raise ValueError(
                "metadata must come from compute_causal_conv1d_metadata, got "
                f"{type(metadata).__name__}"
            )
        if metadata.num_tokens != num_tokens or metadata.batch_size != batch:
            raise ValueError(
                f"metadata was built for {metadata.num_tokens} tokens in "
                f"{metadata.batch_size} sequences, but x has {num_tokens} tokens and "
                f"query_start_loc {batch} sequences"
            )
        if metadata.tile_seq.device != x.device:
            raise ValueError(f"metadata is on {metadata.tile_seq.device}, x on {x.device}")
        tile_seq, block_t = metadata.tile_seq, metadata.block_t
    check_default_lines("cache_indices", cache_indices, batch, conv_states.shape[0])
    if validate_data:
        check_qsl_data("query_start_loc", query_start_loc, num_tokens)
        check_cache_indices_data(
            "cache_indices", cache_indices, conv_states.shape[0], batch, pad_slot_id
        )
    args = (
        x,
        weight,
        bias,
        conv_states,
        query_start_loc,
        cache_indices,
        has_initial_state,
        silu,
        pad_slot_id,
        tile_seq,
        block_t,
    )
    if torch.compiler.is_compiling():
        return torch.ops.vllm.causal_conv1d_fwd(*args)
    if (
        key is not None
        and _use_kernel(x)
        and one_d_contiguous(query_start_loc, cache_indices, has_initial_state)
    ):
        plan = _FwdPlan(x, weight, bias, conv_states, query_start_loc, cache_indices,
                        has_initial_state, silu, pad_slot_id, metadata is not None)  # fmt: skip
        out = plan.run(x, weight, bias, conv_states, query_start_loc, cache_indices,
                       has_initial_state, metadata, num_tokens)  # fmt: skip
        if out is None:
            raise AssertionError("a launch plan refused the step its checks accepted")
        _FWD_PLANS.put(key, plan)
        return out
    return _fwd_impl(*args)


# --------------------------------------------------------------------------
# causal_conv1d_update
# --------------------------------------------------------------------------


def _update_config(batch: int, dim: int, block_l: int, width: int) -> dict:
    # Enough programs to cover the GPU several times over, at least 32 features each.
    target = cdiv(batch * dim, 132 * 4)
    block_d = min(256, max(32, next_power_of_2(target)))
    block_c = next_power_of_2(width - 1 + block_l - 1)
    num_warps = 4 if block_d >= 128 else 1
    return dict(BLOCK_L=block_l, BLOCK_C=block_c, BLOCK_D=block_d, num_warps=num_warps)


@functools.cache
def _decode_configs(elem_size: int) -> dict[str, dict]:
    """The decode kernel's launch configurations, by name (``_decode_config`` picks one;
    the engine's start-up compiles them all). Shared: never mutate."""
    return {
        "lone": dict(BLOCK_D=64, num_warps=1),
        "batch": dict(BLOCK_D=4 // elem_size * 128, num_warps=4),
    }


def _decode_config(batch: int, dim: int, elem_size: int) -> dict:
    # 4 bytes per thread and 4 warps: the fastest on an H200 from 8 to 512
    # sequences (tune_causal_conv1d.py); a lone sequence is spread thinner.
    return _decode_configs(elem_size)["lone" if batch <= 2 else "batch"]


def _decode(x, conv_state, weight, bias, silu, conv_state_indices, pad_slot_id):
    batch, dim = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if batch == 0:
        return out
    cfg = _decode_config(batch, dim, x.element_size())
    grid = (batch, cdiv(dim, cfg["BLOCK_D"]))
    args = (
        x,
        weight,
        bias,
        conv_state,
        conv_state_indices,
        out,
        dim,
        pad_slot_id,
        x.stride(0),
        weight.stride(0),
        conv_state.stride(0),
        conv_state.stride(1),
        conv_state.stride(2),
        out.stride(0),
    )
    constexprs = dict(
        KERNEL_WIDTH=weight.shape[1],
        HAS_BIAS=bias is not None,
        SILU=silu,
        HAS_INDICES=conv_state_indices is not None,
        STATE_D_CONTIG=feature_contiguous(conv_state),
        **cfg,
    )
    variants = _decode_configs(x.element_size()).values()
    _LAUNCH_DECODE(grid, args, constexprs, variants=lambda: [{**constexprs, **c} for c in variants])
    return out


def _update_impl(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu: bool,
    conv_state_indices: torch.Tensor | None,
    num_accepted_tokens: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
    max_query_len: int,
    pad_slot_id: int,
) -> torch.Tensor:
    if not _use_kernel(x):
        return causal_conv1d_update_ref(
            x,
            conv_state,
            weight,
            bias,
            silu,
            conv_state_indices,
            num_accepted_tokens,
            query_start_loc,
            pad_slot_id,
        )
    width = weight.shape[1]
    if x.dim() == 2 and query_start_loc is None and num_accepted_tokens is None:
        return _decode(x, conv_state, weight, bias, silu, conv_state_indices, pad_slot_id)
    if query_start_loc is not None:
        batch = query_start_loc.shape[0] - 1
        dim = x.shape[1]
        seqlen = 0
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        strides_x = (0, x.stride(0))
        strides_out = (0, out.stride(0))
        hint = max_query_len if max_query_len > 0 else 4
    elif x.dim() == 2:
        batch, dim = x.shape
        seqlen = 1
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        strides_x = (x.stride(0), 0)
        strides_out = (out.stride(0), 0)
        hint = 1
    else:
        batch, dim, seqlen = x.shape
        out = torch.empty(batch, seqlen, dim, dtype=x.dtype, device=x.device).transpose(1, 2)
        strides_x = (x.stride(0), x.stride(2))
        strides_out = (out.stride(0), out.stride(2))
        hint = seqlen
    cfg = _update_config(batch, dim, min(next_power_of_2(max(hint, 1)), 8), width)
    grid = (batch, cdiv(dim, cfg["BLOCK_D"]))
    args = (
        x,
        weight,
        bias,
        conv_state,
        conv_state_indices,
        num_accepted_tokens,
        query_start_loc,
        out,
        dim,
        seqlen,
        pad_slot_id,
        strides_x[0],
        strides_x[1],
        weight.stride(0),
        conv_state.stride(0),
        conv_state.stride(1),
        conv_state.stride(2),
        strides_out[0],
        strides_out[1],
    )
    constexprs = dict(
        KERNEL_WIDTH=width,
        HAS_BIAS=bias is not None,
        SILU=silu,
        HAS_INDICES=conv_state_indices is not None,
        IS_SPEC=num_accepted_tokens is not None,
        IS_VARLEN=query_start_loc is not None,
        **cfg,
    )
    _LAUNCH_UPDATE(grid, args, constexprs)
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | bool | None = None,
    conv_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    max_query_len: int = -1,
    pad_slot_id: int = PAD_DEFAULT,
    metadata: CausalConv1dMetadata | None = None,
    validate_data: bool = False,
    *,
    null_block_id: int | None = None,
    cache_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode / speculative-decode step; returns ``out`` shaped like x.

    x is (batch, dim), (batch, dim, seqlen) with ``stride(1) == 1``, or with
    ``query_start_loc`` (num_tokens, dim). ``num_accepted_tokens`` turns on
    speculative decoding (see the module docstring for the cache-line window).
    ``max_query_len`` (or ``metadata.max_query_len``) only sizes the token
    tile of the varlen form; any length is computed correctly. The grid
    depends on shapes only and nothing syncs with the host, so the call can
    be captured in a CUDA graph.

    ``conv_state`` may have any strides (feature-contiguous is the fast layout).
    ``conv_state_indices`` and ``num_accepted_tokens`` may be longer than the
    batch (padded buffers): only their first ``batch`` entries are read. A row
    whose index equals ``pad_slot_id`` (or ``null_block_id``, upstream's later
    name; both with different values is an error) is padding.

    A call whose arguments have the layout of an earlier call skips the checks and launch
    decisions (see ``causal_conv1d_host.py``).
    """
    key = None
    if not validate_data and cache_seqlens is None and not torch.compiler.is_compiling():
        try:
            key = _update_key(x, conv_state, weight, bias, activation, conv_state_indices,
                              num_accepted_tokens, query_start_loc, max_query_len, pad_slot_id,
                              metadata, null_block_id)  # fmt: skip
            plan = _UPDATE_PLANS.get(key)
        except _KEY_ERRORS:
            key = plan = None
        if plan is not None and (plan.on_cuda or _use_kernel(x)):
            return plan.run(x, conv_state, weight, bias, conv_state_indices,
                            num_accepted_tokens, query_start_loc)  # fmt: skip
    if cache_seqlens is not None:
        raise ValueError(
            "cache_seqlens (circular-buffer conv state) is not supported; cache lines "
            "are kept in order, see num_accepted_tokens for speculative decoding"
        )
    check_tensor("x", x, x.device if isinstance(x, torch.Tensor) else None, None, FLOAT_DTYPES)
    if query_start_loc is not None:
        if x.dim() != 2:
            raise ValueError(
                f"with query_start_loc, x must be (num_tokens, dim), got shape {tuple(x.shape)}"
            )
        batch, dim, seqlen = check_qsl(query_start_loc, x.device), x.shape[1], None
    elif x.dim() == 2:
        batch, dim, seqlen = x.shape[0], x.shape[1], 1
    elif x.dim() == 3:
        batch, dim, seqlen = x.shape
    else:
        raise ValueError(
            f"x must be (batch, dim), (batch, dim, seqlen) or, with query_start_loc, "
            f"(num_tokens, dim); got shape {tuple(x.shape)}"
        )
    feat_stride = x.stride(1)
    if feat_stride != 1 and dim > 1:
        raise ValueError(f"x must be feature-contiguous (stride 1 along dim), got {x.stride()}")
    width = check_common(x, weight, bias, conv_state, dim, "conv_state")
    silu = _is_silu(activation)
    pad_slot_id = pad_marker(pad_slot_id, null_block_id)
    check_index("conv_state_indices", conv_state_indices, x.device, batch)
    if metadata is not None:
        if not isinstance(metadata, CausalConv1dMetadata):
            raise ValueError(
                "metadata must come from compute_causal_conv1d_metadata, got "
                f"{type(metadata).__name__}"
            )
        if metadata.batch_size != batch:
            raise ValueError(f"metadata was built for batch {metadata.batch_size}, got {batch}")
        if max_query_len <= 0:
            max_query_len = metadata.max_query_len
    state_len = conv_state.shape[2]
    if num_accepted_tokens is not None:
        check_index("num_accepted_tokens", num_accepted_tokens, x.device, batch)
        longest = seqlen if seqlen is not None else max_query_len
        if longest is not None and longest > 0 and state_len < width - 2 + longest:
            raise ValueError(
                f"conv_state state_len={state_len} is too short for speculative decoding of "
                f"{longest} tokens with width {width}: needs >= width-1+seqlen-1 = "
                f"{width - 2 + longest}"
            )
    check_default_lines("conv_state_indices", conv_state_indices, batch, conv_state.shape[0])
    if validate_data:
        check_cache_indices_data(
            "conv_state_indices", conv_state_indices, conv_state.shape[0], batch, pad_slot_id
        )
        lens = None
        if query_start_loc is not None:
            check_qsl_data("query_start_loc", query_start_loc, x.shape[0])
            q = query_start_loc.cpu()
            lens = q[1:] - q[:-1]
        if num_accepted_tokens is not None:
            acc = num_accepted_tokens[:batch].cpu()
            if lens is None:
                lens = torch.full((batch,), seqlen)
            live = (
                conv_state_indices[:batch].cpu() != pad_slot_id
                if conv_state_indices is not None
                else torch.ones(batch, dtype=torch.bool)
            )
            # History [acc-1, acc-1+W-1) and the written window must fit in the line.
            bad = live & (
                (acc < 1)
                | (acc - 1 + width - 1 > state_len)
                | (width - 1 + lens - lens.clamp(max=1) > state_len)
            )
            if bool(bad.any()):
                raise ValueError(
                    f"num_accepted_tokens out of range for state_len={state_len}, width={width}: "
                    f"needs 1 <= n and n-1+width-1 <= state_len"
                )
    args = (
        x,
        conv_state,
        weight,
        bias,
        silu,
        conv_state_indices,
        num_accepted_tokens,
        query_start_loc,
        max_query_len,
        pad_slot_id,
    )
    if torch.compiler.is_compiling():
        return torch.ops.vllm.causal_conv1d_update(*args)
    if (
        key is not None
        and _use_kernel(x)
        and one_d_contiguous(conv_state_indices, num_accepted_tokens, query_start_loc)
    ):
        if x.dim() == 2 and query_start_loc is None and num_accepted_tokens is None:
            plan = _DecodePlan(x, conv_state, weight, bias, silu, conv_state_indices, pad_slot_id)
        else:
            plan = _UpdatePlan(x, conv_state, weight, bias, silu, conv_state_indices,
                               num_accepted_tokens, query_start_loc, max_query_len,
                               pad_slot_id)  # fmt: skip
        _UPDATE_PLANS.put(key, plan)
        return plan.run(x, conv_state, weight, bias, conv_state_indices, num_accepted_tokens,
                        query_start_loc)  # fmt: skip
    return _update_impl(*args)


# --------------------------------------------------------------------------
# Launch plans (see causal_conv1d_host.py): repeated eager calls skip the checks
# --------------------------------------------------------------------------


def _update_key(x, conv_state, weight, bias, activation, conv_state_indices, num_accepted_tokens,
                query_start_loc, max_query_len, pad_slot_id, metadata, null_block_id):  # fmt: skip
    """Everything ``causal_conv1d_update``'s checks and launch decisions read. Python values
    come with their types (True == 1, -1.0 == -1 and the pad default == -1 must not share
    a plan: some of them are errors)."""
    return (
        x.shape, x.stride(), x.dtype, x.device,
        conv_state.shape, conv_state.stride(), conv_state.dtype, conv_state.device,
        weight.shape, weight.stride(), weight.dtype, weight.device,
        None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device),
        None if conv_state_indices is None else (
            conv_state_indices.shape, conv_state_indices.stride(), conv_state_indices.dtype,
            conv_state_indices.device),
        None if num_accepted_tokens is None else (
            num_accepted_tokens.shape, num_accepted_tokens.stride(), num_accepted_tokens.dtype,
            num_accepted_tokens.device),
        None if query_start_loc is None else (
            query_start_loc.shape, query_start_loc.stride(), query_start_loc.dtype,
            query_start_loc.device),
        activation, type(activation), max_query_len, type(max_query_len),
        pad_slot_id, type(pad_slot_id), null_block_id, type(null_block_id),
        None if metadata is None else (type(metadata), metadata.batch_size,
                                       metadata.max_query_len),
    )  # fmt: skip


def _fwd_key(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
             activation, pad_slot_id, metadata, null_block_id):  # fmt: skip
    """What ``causal_conv1d_fn``'s checks read, less what changes from step to step (the
    token count, the batch, the index arrays' lengths, the metadata: the plan checks those
    on every call)."""
    return (
        x.shape[0], x.stride(), x.dtype, x.device,
        weight.shape, weight.stride(), weight.dtype, weight.device,
        None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device),
        conv_states.shape, conv_states.stride(), conv_states.dtype, conv_states.device,
        query_start_loc.stride(), query_start_loc.dtype, query_start_loc.device,
        None if cache_indices is None else (cache_indices.stride(), cache_indices.dtype,
                                            cache_indices.device),
        None if has_initial_state is None else (has_initial_state.stride(),
                                                has_initial_state.dtype,
                                                has_initial_state.device),
        activation, type(activation), pad_slot_id, type(pad_slot_id),
        null_block_id, type(null_block_id), metadata is None,
    )  # fmt: skip


_KEY_ERRORS = (AttributeError, TypeError, IndexError)  # not tensors: the checks will say so
_I32_MAX = 2**31 - 1


class _Plan:
    """What every plan shares: its launcher, and the compiled kernels it launches directly.

    ``direct[key]`` is ``(launch, head, tail, device, get_device, get_stream)`` once the
    variant ``key`` is compiled (see ``FastKernel``); ``launched`` holds the variants the
    ``CachedLauncher`` has seen (under the interpreter, later launches skip its key).
    """

    launcher: CachedLauncher

    def __init__(self, x):
        self.on_cuda = x.is_cuda
        self.direct: dict = {}
        self.launched: set = set()

    def launch_general(self, grid, args, constexprs, variants, key=None) -> None:
        """Through the ``CachedLauncher``: a variant's first launch, and every launch the
        direct path declines (unaligned pointers, a precompile block, another current device,
        the interpreter). Afterwards the compiled kernel is kept for direct launches."""
        launcher = self.launcher
        if not launcher.direct and key in self.launched and not recording():
            launcher.kernel[grid](*args, **constexprs)
            return
        launcher(grid, args, constexprs, variants=variants)
        self.launched.add(key)
        if key not in self.direct:
            fast = direct_kernel(launcher, args, constexprs)
            if fast is not None:
                self.direct[key] = (fast.fn, fast.head, fast.tail, fast.device,
                                    torch._C._cuda_getDevice,
                                    torch._C._cuda_getCurrentRawStream)  # fmt: skip


class _DecodePlan(_Plan):
    """``causal_conv1d_update`` on one-token rows (the decode kernel), for one layout: every
    launch argument but the pointers is fixed."""

    launcher = _LAUNCH_DECODE

    def __init__(self, x, conv_state, weight, bias, silu, idx, pad_slot_id):
        super().__init__(x)
        batch, dim = x.shape
        self.batch = batch
        self.has_bias, self.has_idx = bias is not None, idx is not None
        cfg = _decode_config(batch, dim, x.element_size())
        self.grid = (batch, cdiv(dim, cfg["BLOCK_D"]))
        self.constexprs = dict(
            KERNEL_WIDTH=weight.shape[1],
            HAS_BIAS=bias is not None,
            SILU=silu,
            HAS_INDICES=idx is not None,
            STATE_D_CONTIG=feature_contiguous(conv_state),
            **cfg,
        )
        configs = _decode_configs(x.element_size()).values()
        self.variants = lambda: [{**self.constexprs, **c} for c in configs]
        # empty_like keeps a dense x's strides: used when that is the contiguous layout
        self.like = torch.empty_like(x).stride() == (dim, 1)
        self.shape, self.dtype, self.device = x.shape, x.dtype, x.device
        self.ints = (dim, pad_slot_id, x.stride(0), weight.stride(0), *conv_state.stride(), dim)

    def alloc(self, x):
        if self.like:
            return torch.empty_like(x)
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def run(self, x, conv_state, weight, bias, idx, *_):
        out = torch.empty_like(x) if self.like else self.alloc(x)
        if self.batch:
            self.launch(out, x, conv_state, weight, bias, idx)
        return out

    def launch(self, out, x, conv_state, weight, bias, idx):
        d = self.direct.get(None)
        if d is not None and not recording() and d[4]() == d[3]:
            px, ps, pw, po = x.data_ptr(), conv_state.data_ptr(), weight.data_ptr(), out.data_ptr()
            pb = bias.data_ptr() if self.has_bias else 0
            pi = idx.data_ptr() if self.has_idx else 0
            if not (px | ps | pw | po | pb | pi) & 15:
                d[0](*self.grid, 1, d[5](d[3]), *d[1], px, pw, pb or None, ps, pi or None, po,
                     *self.ints, *d[2])  # fmt: skip
                return
        args = (x, weight, bias, conv_state, idx, out, *self.ints)
        self.launch_general(self.grid, args, self.constexprs, self.variants)


class _UpdatePlan(_Plan):
    """``causal_conv1d_update`` through the general kernel (several tokens per row, varlen,
    speculative decoding), for one layout: every launch argument but the pointers is fixed."""

    launcher = _LAUNCH_UPDATE

    def __init__(self, x, conv_state, weight, bias, silu, idx, accepted, qsl, max_query_len,
                 pad_slot_id):  # fmt: skip
        super().__init__(x)
        self.shape, self.dtype, self.device = x.shape, x.dtype, x.device
        width = weight.shape[1]
        if qsl is not None:
            batch, dim, seqlen = qsl.shape[0] - 1, x.shape[1], 0
            self.out_strides = (dim, 1)
            strides_x, strides_out = (0, x.stride(0)), (0, dim)
            hint = max_query_len if max_query_len > 0 else 4
        elif x.dim() == 2:
            batch, dim = x.shape
            seqlen = 1
            self.out_strides = (dim, 1)
            strides_x, strides_out = (x.stride(0), 0), (dim, 0)
            hint = 1
        else:
            batch, dim, seqlen = x.shape
            self.out_strides = (seqlen * dim, 1, dim)
            strides_x, strides_out = (x.stride(0), x.stride(2)), (seqlen * dim, dim)
            hint = seqlen
        cfg = _update_config(batch, dim, min(next_power_of_2(max(hint, 1)), 8), width)
        self.grid = (batch, cdiv(dim, cfg["BLOCK_D"]))
        self.ints = (dim, seqlen, pad_slot_id, *strides_x, weight.stride(0), *conv_state.stride(),
                     *strides_out)  # fmt: skip
        self.constexprs = dict(
            KERNEL_WIDTH=width,
            HAS_BIAS=bias is not None,
            SILU=silu,
            HAS_INDICES=idx is not None,
            IS_SPEC=accepted is not None,
            IS_VARLEN=qsl is not None,
            **cfg,
        )

    def alloc(self, x):
        return torch.empty_strided(self.shape, self.out_strides, dtype=self.dtype,
                                   device=self.device)  # fmt: skip

    def run(self, x, conv_state, weight, bias, idx, accepted, qsl):
        out = self.alloc(x)
        if self.grid[0]:
            self.launch(out, x, conv_state, weight, bias, idx, accepted, qsl)
        return out

    def launch(self, out, x, conv_state, weight, bias, idx, accepted, qsl):
        d = self.direct.get(None)
        if d is not None and not recording() and d[4]() == d[3]:
            tensors = (x, weight, bias, conv_state, idx, accepted, qsl, out)
            ptrs = [t if t is None else t.data_ptr() for t in tensors]
            acc = 0
            for p in ptrs:
                acc |= p or 0
            if not acc & 15:
                d[0](*self.grid, 1, d[5](d[3]), *d[1], *ptrs, *self.ints, *d[2])
                return
        args = (x, weight, bias, conv_state, idx, accepted, qsl, out, *self.ints)
        self.launch_general(self.grid, args, self.constexprs, None)


class _FwdPlan(_Plan):
    """``causal_conv1d_fn`` for one layout. Per call it checks what changes from step to
    step, picks the configuration (from the token count and the batch, as ``_fwd_impl``)
    and launches that configuration's compiled kernel."""

    launcher = _LAUNCH_FWD

    def __init__(self, x, weight, bias, conv_states, qsl, idx, init, silu, pad_slot_id,
                 with_meta):  # fmt: skip
        super().__init__(x)
        dim = x.shape[0]
        self.dim, self.num_lines = dim, conv_states.shape[0]
        self.dtype, self.device = x.dtype, x.device
        self.es = x.element_size()
        self.has = (bias is not None, idx is not None, init is not None, with_meta)
        self.base = dict(
            KERNEL_WIDTH=weight.shape[1],
            HAS_BIAS=bias is not None,
            SILU=silu,
            HAS_CACHE_INDICES=idx is not None,
            HAS_INITIAL_STATE=init is not None,
            HAS_TILE_SEQ=with_meta,
            STATE_D_CONTIG=feature_contiguous(conv_states),
        )
        self.static_ints = (pad_slot_id, x.stride(1), weight.stride(0), *conv_states.stride(), dim)
        self.configs = {}  # (config name, BLOCK_T, wide) -> (constexprs, blocks, HEAD_S)

    def step(self, num_tokens, qsl, idx, init, metadata):
        """(variant, grid size, the step's int arguments), or None when the step does not fit
        the plan (the full checks then run and raise the right error)."""
        batch = qsl.shape[0] - 1
        if batch < 0:
            return None
        _, has_idx, has_init, with_meta = self.has
        if has_idx:
            if idx.shape[0] < batch:
                return None
        elif batch > self.num_lines:
            return None
        if has_init and init.shape[0] < batch:
            return None
        if with_meta:
            if (
                not isinstance(metadata, CausalConv1dMetadata)
                or metadata.num_tokens != num_tokens
                or metadata.batch_size != batch
                or metadata.tile_seq.device != self.device
            ):
                return None
            block_t = metadata.block_t
        else:
            block_t = _fwd_block_t(num_tokens)
        # a token count past int32 is a kernel variant of its own (Triton keys it so)
        key = (_fwd_config_name(num_tokens, batch), block_t, num_tokens > _I32_MAX)
        cfg = self.configs.get(key)
        if cfg is None:
            c = _fwd_configs(self.es)[key[0]]
            cfg = ({**self.base, "BLOCK_T": block_t, **c}, cdiv(self.dim, c["BLOCK_D"]),
                   c["HEAD_S"])  # fmt: skip
            self.configs[key] = cfg
        _, n_blocks_d, head_s = cfg
        n_tiles = -(-num_tokens // block_t)
        grid0 = (n_tiles - (-batch // head_s)) * n_blocks_d
        return key, grid0, (num_tokens, n_tiles, self.dim, batch, batch.bit_length())

    def alloc(self, num_tokens):
        return torch.empty_strided((self.dim, num_tokens), (1, self.dim), dtype=self.dtype,
                                   device=self.device)  # fmt: skip

    def run(self, x, weight, bias, conv_states, qsl, idx, init, metadata, num_tokens):
        step = self.step(num_tokens, qsl, idx, init, metadata)
        if step is None:
            return None
        out = self.alloc(num_tokens)
        if step[1]:
            self.launch(step, out, x, weight, bias, conv_states, qsl, idx, init, metadata)
        return out

    def launch(self, step, out, x, weight, bias, conv_states, qsl, idx, init, metadata):
        key, grid0, ints = step
        tile_seq = metadata.tile_seq if metadata is not None else None
        d = self.direct.get(key)
        if d is not None and not recording() and d[4]() == d[3]:
            has_bias, has_idx, has_init, with_meta = self.has
            px, pw, ps, pq, po = (x.data_ptr(), weight.data_ptr(), conv_states.data_ptr(),
                                  qsl.data_ptr(), out.data_ptr())  # fmt: skip
            pb = bias.data_ptr() if has_bias else 0
            pi = idx.data_ptr() if has_idx else 0
            ph = init.data_ptr() if has_init else 0
            pt = tile_seq.data_ptr() if with_meta else 0
            if not (px | pw | ps | pq | po | pb | pi | ph | pt) & 15:
                d[0](grid0, 1, 1, d[5](d[3]), *d[1], px, pw, pb or None, ps, pq, pi or None,
                     ph or None, pt or None, po, *ints, *self.static_ints, *d[2])  # fmt: skip
                return
        args = (x, weight, bias, conv_states, qsl, idx, init, tile_seq, out, *ints,
                *self.static_ints)  # fmt: skip
        constexprs = self.configs[key][0]
        variants = lambda: _fwd_variants(constexprs, self.es)  # noqa: E731
        self.launch_general((grid0,), args, constexprs, variants, key)


_UPDATE_PLANS = PlanCache()
_FWD_PLANS = PlanCache()


def clear_host_caches() -> None:
    """Forget every launch plan (the benchmark swaps kernels for stubs; tests start clean)."""
    _UPDATE_PLANS.clear()
    _FWD_PLANS.clear()


def host_path_pieces(op, *args, **kwargs) -> dict:
    """The pieces of an eager call's host path, each a callable that repeats just that piece
    with these arguments (for benchmarks/kernels/benchmark_conv_host_cost.py): the plan
    lookup (every check a repeated call makes), the output allocation, the stream lookup
    (GPU), the launch, and the whole call. Calls ``op`` once first, which builds the plan."""
    import inspect

    op(*args, **kwargs)
    bound = inspect.signature(op).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    if a.get("validate_data"):
        raise ValueError("validate_data=True calls take the full checks every time")
    if op is causal_conv1d_update:
        names = ("x", "conv_state", "weight", "bias", "activation", "conv_state_indices",
                 "num_accepted_tokens", "query_start_loc", "max_query_len", "pad_slot_id",
                 "metadata", "null_block_id")  # fmt: skip
        key_args = [a[n] for n in names]
        plan = _UPDATE_PLANS[_update_key(*key_args)]
        run_args = (a["x"], a["conv_state"], a["weight"], a["bias"], a["conv_state_indices"])
        if not isinstance(plan, _DecodePlan):
            run_args += (a["num_accepted_tokens"], a["query_start_loc"])
        out = plan.alloc(a["x"])
        pieces = {
            "plan lookup (checks)": lambda: _UPDATE_PLANS.get(_update_key(*key_args)),
            "output allocation": lambda: plan.alloc(a["x"]),
            "launch": lambda: plan.launch(out, *run_args),
        }
    elif op is causal_conv1d_fn:
        names = ("x", "weight", "bias", "conv_states", "query_start_loc", "cache_indices",
                 "has_initial_state", "activation", "pad_slot_id", "metadata",
                 "null_block_id")  # fmt: skip
        key_args = [a[n] for n in names]
        plan = _FWD_PLANS[_fwd_key(*key_args)]
        x, meta = a["x"], a["metadata"]
        step_args = (x.shape[1], a["query_start_loc"], a["cache_indices"],
                     a["has_initial_state"], meta)  # fmt: skip
        step = plan.step(*step_args)
        out = plan.alloc(x.shape[1])
        launch_args = (x, a["weight"], a["bias"], a["conv_states"], a["query_start_loc"],
                       a["cache_indices"], a["has_initial_state"], meta)  # fmt: skip
        pieces = {
            "plan lookup (checks)": lambda: _FWD_PLANS.get(_fwd_key(*key_args)),
            "step checks and config": lambda: plan.step(*step_args),
            "output allocation": lambda: plan.alloc(x.shape[1]),
            "launch": lambda: plan.launch(step, out, *launch_args),
        }
    else:
        raise ValueError(f"no host-path pieces for {op!r}")
    if plan.on_cuda:
        device = a["x"].device.index
        pieces["stream lookup"] = lambda: direct_stream(device)
    pieces["whole call"] = lambda: op(*args, **kwargs)
    return pieces


# --------------------------------------------------------------------------
# torch.library registration (for torch.compile and opcheck)
# --------------------------------------------------------------------------


# The ops are the implementations themselves (their annotations give the schemas); the
# eager path calls the same functions directly.
_causal_conv1d_fwd_op = torch.library.custom_op(
    "vllm::causal_conv1d_fwd", _fwd_impl, mutates_args=("conv_states",)
)


@_causal_conv1d_fwd_op.register_fake
def _(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, silu,
      pad_slot_id, tile_seq, block_t):  # fmt: skip
    return x.new_empty(x.shape[1], x.shape[0]).t()


_causal_conv1d_update_op = torch.library.custom_op(
    "vllm::causal_conv1d_update", _update_impl, mutates_args=("conv_state",)
)


@_causal_conv1d_update_op.register_fake
def _(x, conv_state, weight, bias, silu, conv_state_indices, num_accepted_tokens,
      query_start_loc, max_query_len, pad_slot_id):  # fmt: skip
    if x.dim() == 3 and query_start_loc is None:
        return x.new_empty(x.shape[0], x.shape[2], x.shape[1]).transpose(1, 2)
    return x.new_empty(x.shape)
