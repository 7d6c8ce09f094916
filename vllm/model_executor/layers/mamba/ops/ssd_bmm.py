"""The SSD's matrix products: the dot helpers of every SSD kernel, and the chunks' C B^T.

``CB[c, g, l, s] = C[t0 + l, g] . B[t0 + s, g]`` for the rows ``t0 + l``, ``t0 + s`` of
chunk ``c`` (group g, the dot over dstate), for the causal blocks ``s <= l`` only; the chunk
scan weighs it by decay and dt per head (``ssd_chunk_scan``). It runs as the second job of
the state-passing launch (``ssd_state_passing``), whose sequential programs leave most of the
GPU idle; ``_cb_rows`` is one of its programs.

Precision of the dots (see docs/ssd.md). With 16-bit activations, C, B and x are exact in
their dtype, and a tensor-core dot of two such operands with fp32 accumulation is as exact
as fp32 math: every product is exact in fp32. The other operand of the SSD's dots is an fp32
value (decay * dt * x, a start state, decay * dt * CB) that the 16-bit dtype cannot hold;
``_dot_lhs_f32``/``_dot_rhs_f32`` split it into ``hi + lo``, both in the 16-bit dtype, and
take two dots, which keeps 16 significant bits (bf16) where one cast would keep 8: the error
of the scan stays at the fp32 PyTorch scan's level instead of doubling the bf16 output's
rounding error. With fp32 activations the dot takes fp32 operands as ``tf32x3`` (about fp32
accuracy on tensor cores).
"""

from __future__ import annotations

from vllm.triton_utils import tl, triton

# Decays are kept in log2 units (dA * log2(e)), so that each one is a single exp2.
LOG2E = tl.constexpr(1.4426950408889634)
# The step's layout and sequence pointers the SSD's kernels take: never specialised on (their
# alignment changes from step to step, and a new step must compile nothing).
STEP_POINTERS = (
    "chunk_starts_ptr",
    "chunk_seqs_ptr",
    "seq_chunk_starts_ptr",
    "state_indices_ptr",
    "has_init_ptr",
    "chunk_lines_ptr",
)


@triton.jit
def _dot_exact(a, b, acc):
    """``acc + a @ b`` for operands exact in their dtype (C, B, x)."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="tf32x3")
    return tl.dot(a, b, acc)


@triton.jit
def _dot_lhs_f32(a, b, acc, SPLIT: tl.constexpr):
    """``acc + a @ b`` where ``a`` is fp32 data and ``b`` is exact in its dtype."""
    if b.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="tf32x3")
    b_hi = a.to(b.dtype)
    acc = tl.dot(b_hi, b, acc)
    if SPLIT:
        acc = tl.dot((a - b_hi.to(tl.float32)).to(b.dtype), b, acc)
    return acc


@triton.jit
def _dot_rhs_f32(a, b, acc, SPLIT: tl.constexpr):
    """``acc + a @ b`` where ``a`` is exact in its dtype and ``b`` is fp32 data."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="tf32x3")
    b_hi = b.to(a.dtype)
    acc = tl.dot(a, b_hi, acc)
    if SPLIT:
        acc = tl.dot(a, (b - b_hi.to(tl.float32)).to(a.dtype), acc)
    return acc


@triton.jit
def _cb_rows(
    i_job,
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
    NGROUPS: tl.constexpr,
    DSTATE: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,
):
    """One program of CB: block row ``l`` of chunk ``c``, group ``g``, every causal block.
    ``STAGES``: its source loop's pipeline depth (None: the launch's ``num_stages``).
    ``cb`` is contiguous (chunks, NGROUPS, CHUNK, CHUNK), in its own dtype (fp32, or the
    16-bit activation dtype when the launch config asks for it)."""
    N_ROWS: tl.constexpr = (CHUNK + BLOCK_T - 1) // BLOCK_T
    i_l = i_job % N_ROWS
    i_g = (i_job // N_ROWS) % NGROUPS
    i_c = (i_job // N_ROWS // NGROUPS).to(tl.int64)
    start = tl.load(chunk_starts_ptr + i_c)
    clen = tl.load(chunk_starts_ptr + i_c + 1) - start
    row0 = start.to(tl.int64)

    o_l = i_l * BLOCK_T + tl.arange(0, BLOCK_T)
    o_t = tl.arange(0, BLOCK_T)
    o_n = tl.arange(0, BLOCK_N)
    m_l = o_l < clen
    p_C = C_ptr + row0 * stride_C_t + i_g * stride_C_g
    p_C = p_C + o_l[:, None] * stride_C_t + o_n[None, :] * stride_C_n
    p_B = B_ptr + row0 * stride_B_t + i_g * stride_B_g
    p_cb = cb_ptr + (i_c * NGROUPS + i_g) * (CHUNK * CHUNK) + o_l[:, None] * CHUNK
    # Blocks s <= l that hold tokens; none when the block row is past the chunk's end.
    n_cols = tl.minimum(i_l + 1, tl.cdiv(clen, BLOCK_T))
    # With one dstate block the C block is the same for every source block: loaded once
    # (the loop then loads only B^T; docs/ssd.md "Compile comparison").
    ONE_N: tl.constexpr = DSTATE <= BLOCK_N
    if ONE_N:
        b_C1 = tl.load(p_C, mask=m_l[:, None] & (o_n < DSTATE)[None, :], other=0.0)
    for i_s in tl.range(0, n_cols, num_stages=STAGES):
        o_s = i_s * BLOCK_T + o_t
        m_s = o_s < clen
        acc = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
        for n0 in tl.static_range(0, DSTATE, BLOCK_N):
            m_n = (n0 + o_n) < DSTATE
            if ONE_N:
                b_C = b_C1
            else:
                b_C = tl.load(p_C + n0 * stride_C_n, mask=m_l[:, None] & m_n[None, :],
                              other=0.0)  # fmt: skip
            # B^T: (BLOCK_N, BLOCK_T)
            p_Bt = p_B + o_s[None, :] * stride_B_t + (n0 + o_n)[:, None] * stride_B_n
            b_Bt = tl.load(p_Bt, mask=m_n[:, None] & m_s[None, :], other=0.0)
            acc = _dot_exact(b_C, b_Bt, acc)
        tl.store(
            p_cb + o_s[None, :], acc.to(cb_ptr.dtype.element_ty), mask=m_l[:, None] & m_s[None, :]
        )
