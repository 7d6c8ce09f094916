"""The fused-MoE Triton kernels: two grouped GEMMs over the expert-sorted (token, k) pairs,
the sum of each token's k rows, and the alignment (its contract in ``moe_align``): one
program for small steps (``moe_align_kernel``), two launches parallel over chunks of pairs
for larger ones (``moe_align_count_kernel``, ``moe_align_place_kernel``).

Rows are the pairs p = token * top_k + k in the order of ``sorted_token_ids``
(``moe_align``): block m of BLOCK_M rows belongs to expert ``expert_ids[m]`` (-1: an unused
block, the program returns), and a row whose id is ``num_pairs`` is padding (its stores are
masked). The grid is sized for the worst case, so it depends on shapes only.
``UNSORTED`` (tiny steps, no alignment ran): block m is pair m alone, ``expert_ids`` is
``topk_ids`` flattened, the block's other rows are padding (upstream's naive block
assignment).

The grid is one-dimensional: ``num_blocks`` row blocks x the column blocks of the output.
Programs are taken in groups of ``GROUP_SIZE_M`` row blocks that walk the column blocks
together, rows fastest within a group (``_block_of``). With 1 (the default) a row block's
programs run side by side, so its gathered rows of x (or h) are read from DRAM once and
reused from L2 across every column block, and an expert's next row block, num_cols programs
later, finds the weight tile still in L2; a group as large as the grid is the column-major
order (every row block for column block 0, then 1, ...), which streams all of h once per
column block of the down GEMM.

- ``moe_gate_up_kernel``: h[p] = act(x[token] W_gate[e]^T) * (x[token] W_up[e]^T) with
  W13[e] = [W_gate; W_up] (2I, H) (``IS_ACT_AND_MUL``), or act(x[token] W13[e]^T) with
  W13[e] (I, H) for experts without a gate (Nemotron-H's relu^2 MLP). One program per
  (block of rows, block of BLOCK_N intermediate columns): one weight tile and one dot per
  K step, 2 x BLOCK_N wide when gated (gate row j and up row j interleaved, split after
  the loop), so the activation is applied in registers and only h (pairs, I) is written,
  in the activation dtype.
- ``moe_down_kernel``: y[p] = w[p] * (h[p] W2[e]^T), W2[e] (H, I), the routing weight
  applied to the fp32 accumulator; y (pairs, H) is written, a row per pair.
- ``moe_sum_kernel``: out[t] = sum_k y[t * top_k + k] in fp32, in a fixed order.

No atomics: each output element is written by one program, the top-k sum has a fixed
order (results do not depend on scheduling and are the same run to run), and bf16/fp16
outputs need no zeroed fp32 scratch or atomic adds in a narrow type. The cost is one
(pairs, H) write and read, small beside the weights the GEMMs stream. With top_k == 1 the
down kernel writes the output directly (no sum).

The K loops load without column masks (``EVEN_K``: no K mask either when BLOCK_K divides
K): columns past the end read the last weight row, and only the store is masked. Padding
rows either read row 0 of x (h), or, with ``MASK_ROWS`` (the launch table's choice; on
for BLOCK_M <= 64 by default), load nothing: at decode sizes nearly every row of a block
is padding (15 of 16 at one token), and unmasked they all read the same line of x (h),
which every program then asks the L2 for at every K step, several times over (upstream
masks them; docs/fused_moe.md). The row mask is loop-invariant: 3 to 6 more SASS per
K-loop trip on sm_90 at 16 and 128 rows, 4 fewer at 64-row wgmma tiles.
Accumulation is fp32; fp32 inputs use IEEE dots (``DOT_PRECISION``), narrow ones the
tensor cores. Offsets of a token's, a pair's or an expert's rows are int64.
"""

from __future__ import annotations

from vllm.triton_utils import tl, triton

ACTIVATIONS = {"silu": 0, "relu2": 1}


@triton.jit
def _activation(g, ACTIVATION: tl.constexpr):
    if ACTIVATION == 0:  # silu
        return g * tl.sigmoid(g)
    else:  # relu^2 (Nemotron-H)
        r = tl.maximum(g, 0.0)
        return r * r


@triton.jit
def _block_of(num_blocks, num_cols, GROUP_SIZE_M: tl.constexpr):
    """(row block, column block) of this program in the grouped order (module docstring)."""
    pid = tl.program_id(0)
    if GROUP_SIZE_M == 1:
        return pid // num_cols, pid % num_cols
    per_group = GROUP_SIZE_M * num_cols
    first = (pid // per_group) * GROUP_SIZE_M
    rows = tl.minimum(num_blocks - first, GROUP_SIZE_M)
    return first + (pid % per_group) % rows, (pid % per_group) // rows


@triton.jit
def _block_rows(sorted_ids_ptr, expert_ids_ptr, i_m, num_pairs,
                UNSORTED: tl.constexpr, BLOCK_M: tl.constexpr):  # fmt: skip
    """(expert, pair ids) of row block i_m: its expert (-1: unused) and BLOCK_M pair ids,
    ``num_pairs`` for padding. Unsorted, block i_m is pair i_m alone."""
    o_r = tl.arange(0, BLOCK_M)
    i_m = i_m.to(tl.int64)
    expert = tl.load(expert_ids_ptr + i_m).to(tl.int64)
    if UNSORTED:
        pair = tl.where(o_r == 0, i_m, num_pairs.to(tl.int64))
    else:
        pair = tl.load(sorted_ids_ptr + i_m * BLOCK_M + o_r).to(tl.int64)
    return expert, pair


# ``num_pairs`` and ``num_blocks`` change with every batch: they must not select a variant.
@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def moe_gate_up_kernel(
    x_ptr, w_ptr, h_ptr, sorted_ids_ptr, expert_ids_ptr,
    num_pairs, num_blocks, hidden, inter, top_k,
    stride_x_t, stride_x_h, stride_w_e, stride_w_n, stride_w_h, stride_h_p, stride_h_n,
    IS_ACT_AND_MUL: tl.constexpr,
    ACTIVATION: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UNSORTED: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    MASK_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):  # fmt: skip
    i_m, i_n = _block_of(num_blocks, tl.cdiv(inter, BLOCK_N), GROUP_SIZE_M)
    expert, pair = _block_rows(sorted_ids_ptr, expert_ids_ptr, i_m, num_pairs, UNSORTED,
                               BLOCK_M)  # fmt: skip
    if expert < 0:
        return
    m_m = pair < num_pairs
    # The K loop's loads carry no column mask, and no row mask unless MASK_ROWS: padding
    # rows read x's row 0 and columns past ``inter`` the last gate (up) row of W13, real
    # data whose products land only in accumulator rows and columns the masked store drops
    # (each output element's dot reads its own row and column only, so the stored values
    # are unchanged). MASK_ROWS: padding rows load nothing (zeros).
    token = tl.where(m_m, pair // top_k, 0)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < inter
    # One weight tile and one dot per K step. Gated: 2 x BLOCK_N columns interleaved, 2j
    # the gate row of intermediate column j and 2j + 1 its up row, split after the loop.
    N_W: tl.constexpr = 2 * BLOCK_N if IS_ACT_AND_MUL else BLOCK_N
    o_c = tl.arange(0, N_W)
    if IS_ACT_AND_MUL:
        o_w = tl.minimum(i_n * BLOCK_N + o_c // 2, inter - 1) + (o_c % 2) * inter
    else:
        o_w = tl.minimum(i_n * BLOCK_N + o_c, inter - 1)
    o_k = tl.arange(0, BLOCK_K)
    p_x = x_ptr + token[:, None] * stride_x_t + o_k[None, :] * stride_x_h
    # W13[e] is (rows, H); the tile is read transposed, (BLOCK_K, N_W).
    p_w = w_ptr + expert * stride_w_e + o_w[None, :] * stride_w_n + o_k[:, None] * stride_w_h
    acc = tl.zeros((BLOCK_M, N_W), dtype=tl.float32)
    # The weight tile is loaded first: its address does not wait for the pair ids, so the
    # pipeline's first weight loads leave while the rows' token ids are still in flight.
    for k0 in range(0, hidden, BLOCK_K):
        if EVEN_K:  # BLOCK_K divides H: no K mask
            b_w = tl.load(p_w)
            if MASK_ROWS:
                b_x = tl.load(p_x, mask=m_m[:, None], other=0.0)
            else:
                b_x = tl.load(p_x)
        else:
            m_k = o_k < hidden - k0
            b_w = tl.load(p_w, mask=m_k[:, None], other=0.0)
            if MASK_ROWS:
                b_x = tl.load(p_x, mask=m_m[:, None] & m_k[None, :], other=0.0)
            else:
                b_x = tl.load(p_x, mask=m_k[None, :], other=0.0)
        acc = tl.dot(b_x, b_w, acc, input_precision=DOT_PRECISION)
        p_x += BLOCK_K * stride_x_h
        p_w += BLOCK_K * stride_w_h
    if IS_ACT_AND_MUL:
        acc_g, acc_u = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
        b_h = _activation(acc_g, ACTIVATION) * acc_u
    else:
        b_h = _activation(acc, ACTIVATION)
    p_h = h_ptr + pair[:, None] * stride_h_p + o_n[None, :] * stride_h_n
    tl.store(p_h, b_h.to(h_ptr.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def moe_down_kernel(
    h_ptr, w_ptr, y_ptr, topk_weights_ptr, sorted_ids_ptr, expert_ids_ptr,
    num_pairs, num_blocks, hidden, inter,
    stride_h_p, stride_h_k, stride_w_e, stride_w_n, stride_w_k, stride_y_p, stride_y_n,
    DOT_PRECISION: tl.constexpr,
    UNSORTED: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    MASK_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):  # fmt: skip
    i_m, i_n = _block_of(num_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_SIZE_M)
    expert, pair = _block_rows(sorted_ids_ptr, expert_ids_ptr, i_m, num_pairs, UNSORTED,
                               BLOCK_M)  # fmt: skip
    if expert < 0:
        return
    m_m = pair < num_pairs
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < hidden
    o_k = tl.arange(0, BLOCK_K)
    # Unmasked columns in the K loop, and rows unless MASK_ROWS, as in the gate/up kernel:
    # padding rows read h's row 0, columns past H the last row of W2; the store drops both.
    row = tl.where(m_m, pair, 0)
    o_w = tl.minimum(o_n, hidden - 1)
    p_h = h_ptr + row[:, None] * stride_h_p + o_k[None, :] * stride_h_k
    p_w = w_ptr + expert * stride_w_e + o_w[None, :] * stride_w_n + o_k[:, None] * stride_w_k
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):  # weights first, as in the gate/up kernel
        if EVEN_K:  # BLOCK_K divides I: no K mask
            b_w = tl.load(p_w)
            if MASK_ROWS:
                b_h = tl.load(p_h, mask=m_m[:, None], other=0.0)
            else:
                b_h = tl.load(p_h)
        else:
            m_k = o_k < inter - k0
            b_w = tl.load(p_w, mask=m_k[:, None], other=0.0)
            if MASK_ROWS:
                b_h = tl.load(p_h, mask=m_m[:, None] & m_k[None, :], other=0.0)
            else:
                b_h = tl.load(p_h, mask=m_k[None, :], other=0.0)
        acc = tl.dot(b_h, b_w, acc, input_precision=DOT_PRECISION)
        p_h += BLOCK_K * stride_h_k
        p_w += BLOCK_K * stride_w_k
    b_rw = tl.load(topk_weights_ptr + pair, mask=m_m, other=0.0).to(tl.float32)
    acc = acc * b_rw[:, None]
    p_y = y_ptr + pair[:, None] * stride_y_p + o_n[None, :] * stride_y_n
    tl.store(p_y, acc.to(y_ptr.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


@triton.jit
def moe_sum_kernel(
    y_ptr, out_ptr, hidden,
    stride_y_t, stride_y_k, stride_y_n, stride_o_t, stride_o_n,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    i_t = tl.program_id(0).to(tl.int64)
    o_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < hidden
    p_y = y_ptr + i_t * stride_y_t + o_n * stride_y_n
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(p_y + k * stride_y_k, mask=m_n, other=0.0).to(tl.float32)
    tl.store(out_ptr + i_t * stride_o_t + o_n * stride_o_n, acc.to(out_ptr.dtype.element_ty),
             mask=m_n)  # fmt: skip


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def moe_align_kernel(
    ids_ptr, sorted_ids_ptr, expert_ids_ptr, total_ptr,
    num_pairs, num_experts, num_blocks,
    BLOCK_M: tl.constexpr,
    EXPERTS: tl.constexpr,
    CHUNK: tl.constexpr,
):  # fmt: skip
    # One program does the whole alignment (``moe_align``'s contract) for a small step:
    # counts per expert, padded runs, each block's expert, padding ids, then every pair at
    # its expert's start plus its rank among the expert's earlier pairs (a stable order).
    # Pairs are read CHUNK at a time against all EXPERTS (a power of two >= E) one-hot.
    o_e = tl.arange(0, EXPERTS)
    o_c = tl.arange(0, CHUNK)
    counts = tl.zeros([EXPERTS], dtype=tl.int32)
    for c0 in range(0, num_pairs, CHUNK):
        m_c = c0 + o_c < num_pairs
        ids = tl.load(ids_ptr + c0 + o_c, mask=m_c, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == o_e[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(total_ptr, total)
    # Block b's expert: how many runs end at or before its first row (empty runs and the
    # experts past E end where the previous run does); -1 past the last run.
    for b0 in range(0, num_blocks, CHUNK):
        o_b = b0 + o_c
        row = o_b * BLOCK_M
        expert = tl.sum((ends[None, :] <= row[:, None]).to(tl.int32), axis=1)
        expert = tl.where(row < total, expert, -1)
        tl.store(expert_ids_ptr + o_b, expert, mask=o_b < num_blocks)
    num_rows = num_blocks * BLOCK_M
    for r0 in range(0, num_rows, CHUNK):
        pad = tl.zeros([CHUNK], dtype=tl.int32) + num_pairs
        tl.store(sorted_ids_ptr + r0 + o_c, pad, mask=r0 + o_c < num_rows)
    tl.debug_barrier()  # the padding is written before any pair lands on it
    offset = ends - padded  # where each expert's next pair goes
    for c0 in range(0, num_pairs, CHUNK):
        m_c = c0 + o_c < num_pairs
        ids = tl.load(ids_ptr + c0 + o_c, mask=m_c, other=-1).to(tl.int32)
        hit = (ids[:, None] == o_e[None, :]).to(tl.int32)
        before = tl.cumsum(hit, axis=0) - hit  # earlier pairs of this chunk, same expert
        pos = tl.sum(hit * (before + offset[None, :]), axis=1)
        ok = m_c & (ids >= 0) & (ids < num_experts)
        tl.store(sorted_ids_ptr + pos, c0 + o_c, mask=ok)
        offset += tl.sum(hit, axis=0)


# The alignment of larger steps in two launches, parallel over chunks of ``span`` pairs
# (``moe_align``'s contract, the same buffers as ``moe_align_kernel``'s): counts and ranks
# per chunk, then every program sums the chunks' counts (the runs' layout), places its
# chunk's pairs at their expert's start plus the earlier chunks' and its rank, and writes
# the padding ids and the experts of its share of the rows and blocks. Each element has one
# writer: deterministic, no atomics, no memset.
@triton.jit(do_not_specialize=["num_pairs", "span"])
def moe_align_count_kernel(
    ids_ptr, counts_ptr, rank_ptr,
    num_pairs, span,
    EXPERTS: tl.constexpr,
    CHUNK: tl.constexpr,
):  # fmt: skip
    # Chunk c's pairs per expert (counts[c, :]) and each pair's rank among the chunk's
    # earlier pairs of its expert (rank[p]), CHUNK pairs at a time against all EXPERTS.
    i_c = tl.program_id(0)
    o_e = tl.arange(0, EXPERTS)
    o_c = tl.arange(0, CHUNK)
    seen = tl.zeros([EXPERTS], dtype=tl.int32)
    for s0 in range(0, span, CHUNK):
        o_p = i_c * span + s0 + o_c
        m_p = o_p < num_pairs
        ids = tl.load(ids_ptr + o_p, mask=m_p, other=-1).to(tl.int32)
        hit = (ids[:, None] == o_e[None, :]).to(tl.int32)
        before = tl.cumsum(hit, axis=0) - hit + seen[None, :]
        tl.store(rank_ptr + o_p, tl.sum(hit * before, axis=1), mask=m_p)
        seen += tl.sum(hit, axis=0)
    tl.store(counts_ptr + i_c * EXPERTS + o_e, seen)


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "num_blocks", "span", "blocks_per"])
def moe_align_place_kernel(
    ids_ptr, counts_ptr, rank_ptr, sorted_ids_ptr, expert_ids_ptr, total_ptr,
    num_pairs, num_experts, num_chunks, num_blocks, span, blocks_per,
    BLOCK_M: tl.constexpr,
    EXPERTS: tl.constexpr,
    CHUNK: tl.constexpr,
):  # fmt: skip
    i_c = tl.program_id(0)
    o_e = tl.arange(0, EXPERTS)
    o_c = tl.arange(0, CHUNK)
    # Every expert's pairs (all chunks) and those of the chunks before this one.
    counts = tl.zeros([EXPERTS], dtype=tl.int32)
    earlier = tl.zeros([EXPERTS], dtype=tl.int32)
    for c0 in range(0, num_chunks, CHUNK):
        o_k = c0 + o_c
        b_n = tl.load(counts_ptr + o_k[:, None] * EXPERTS + o_e[None, :],
                      mask=(o_k < num_chunks)[:, None], other=0)  # fmt: skip
        counts += tl.sum(b_n, axis=0)
        earlier += tl.sum(tl.where((o_k < i_c)[:, None], b_n, 0), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    if i_c == 0:
        tl.store(total_ptr, total)
    # This chunk's pairs (the programs past the last chunk only write blocks and padding).
    base = starts + earlier
    if i_c < num_chunks:
        for s0 in range(0, span, CHUNK):
            o_p = i_c * span + s0 + o_c
            m_p = o_p < num_pairs
            ids = tl.load(ids_ptr + o_p, mask=m_p, other=-1).to(tl.int32)
            hit = (ids[:, None] == o_e[None, :]).to(tl.int32)
            rank = tl.load(rank_ptr + o_p, mask=m_p, other=0)
            ok = m_p & (ids >= 0) & (ids < num_experts)
            tl.store(sorted_ids_ptr + tl.sum(hit * base[None, :], axis=1) + rank, o_p, mask=ok)
    # This program's blocks: their expert (-1 past the last run) and their padding rows
    # (rows outside every run [start, start + count)), disjoint from the pairs' rows.
    first = i_c * blocks_per
    last = tl.minimum(first + blocks_per, num_blocks)
    for b0 in range(first, last, CHUNK):
        o_b = b0 + o_c
        row = o_b * BLOCK_M
        expert = tl.sum((ends[None, :] <= row[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + o_b, tl.where(row < total, expert, -1), mask=o_b < last)
    for r0 in range(first * BLOCK_M, last * BLOCK_M, CHUNK):
        o_r = r0 + o_c
        inside = (o_r[:, None] >= starts[None, :]) & (o_r[:, None] < (starts + counts)[None, :])
        pad = tl.sum(inside.to(tl.int32), axis=1) == 0
        tl.store(sorted_ids_ptr + o_r, tl.zeros([CHUNK], dtype=tl.int32) + num_pairs,
                 mask=pad & (o_r < last * BLOCK_M))  # fmt: skip
