"""The fused-MoE Triton kernels: two grouped GEMMs over the expert-sorted (token, k) pairs,
the sum of each token's k rows, and the one-program alignment of small steps
(``moe_align_kernel``, its contract in ``moe_align``).

Rows are the pairs p = token * top_k + k in the order of ``sorted_token_ids``
(``moe_align``): block m of BLOCK_M rows belongs to expert ``expert_ids[m]`` (-1: an unused
block, the program returns), and a row whose id is ``num_pairs`` is padding (its loads and
stores are masked). The grid is sized for the worst case, so it depends on shapes only.

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

The K loops load without row or column masks (``EVEN_K``: none at all when BLOCK_K divides
K): padding rows read row 0 and columns past the end the last weight row, and only the
store is masked. Accumulation is fp32; fp32 inputs use IEEE dots (``DOT_PRECISION``),
narrow ones the tensor cores. Offsets of a token's, a pair's or an expert's rows are int64.
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


# ``num_pairs`` changes with every batch: it must not select a compiled variant.
@triton.jit(do_not_specialize=["num_pairs"])
def moe_gate_up_kernel(
    x_ptr, w_ptr, h_ptr, sorted_ids_ptr, expert_ids_ptr,
    num_pairs, hidden, inter, top_k,
    stride_x_t, stride_x_h, stride_w_e, stride_w_n, stride_w_h, stride_h_p, stride_h_n,
    IS_ACT_AND_MUL: tl.constexpr,
    ACTIVATION: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):  # fmt: skip
    i_m = tl.program_id(0)
    i_n = tl.program_id(1)
    expert = tl.load(expert_ids_ptr + i_m).to(tl.int64)
    if expert < 0:
        return
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + o_m).to(tl.int64)
    m_m = pair < num_pairs
    # The K loop's loads carry no row or column mask: padding rows read x's row 0 and
    # columns past ``inter`` read its last gate (up) row of W13, real data whose products
    # land only in accumulator rows and columns the masked store drops (each output
    # element's dot reads its own row and column only, so the stored values are unchanged).
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
    for k0 in range(0, hidden, BLOCK_K):
        if EVEN_K:  # BLOCK_K divides H: no mask at all
            b_x = tl.load(p_x)
            b_w = tl.load(p_w)
        else:
            m_k = o_k < hidden - k0
            b_x = tl.load(p_x, mask=m_k[None, :], other=0.0)
            b_w = tl.load(p_w, mask=m_k[:, None], other=0.0)
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


@triton.jit(do_not_specialize=["num_pairs"])
def moe_down_kernel(
    h_ptr, w_ptr, y_ptr, topk_weights_ptr, sorted_ids_ptr, expert_ids_ptr,
    num_pairs, hidden, inter,
    stride_h_p, stride_h_k, stride_w_e, stride_w_n, stride_w_k, stride_y_p, stride_y_n,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):  # fmt: skip
    i_m = tl.program_id(0)
    i_n = tl.program_id(1)
    expert = tl.load(expert_ids_ptr + i_m).to(tl.int64)
    if expert < 0:
        return
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + o_m).to(tl.int64)
    m_m = pair < num_pairs
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < hidden
    o_k = tl.arange(0, BLOCK_K)
    # Unmasked rows and columns in the K loop, as in the gate/up kernel: padding rows read
    # h's row 0, columns past H the last row of W2; the store drops both.
    row = tl.where(m_m, pair, 0)
    o_w = tl.minimum(o_n, hidden - 1)
    p_h = h_ptr + row[:, None] * stride_h_p + o_k[None, :] * stride_h_k
    p_w = w_ptr + expert * stride_w_e + o_w[None, :] * stride_w_n + o_k[:, None] * stride_w_k
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        if EVEN_K:  # BLOCK_K divides I: no mask at all
            b_h = tl.load(p_h)
            b_w = tl.load(p_w)
        else:
            m_k = o_k < inter - k0
            b_h = tl.load(p_h, mask=m_k[None, :], other=0.0)
            b_w = tl.load(p_w, mask=m_k[:, None], other=0.0)
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
