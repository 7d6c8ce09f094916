"""Triton unified attention: a whole continuous-batching step in one launch, paged KV.

The operation, for query token j of sequence i (its q_len = qsl[i+1] - qsl[i] tokens are
the last q_len of its seq_lens[i] tokens, so it sits at position p = seq_lens[i] - q_len
+ j) and query head h, reading kv head h // (num_heads // num_kv_heads)::

    out[t, h] = sum_{n <= p} softmax_n(scale * q[t, h] . K_i[n]) * V_i[n]

where K_i[n] = kv_cache[0, block_table[i, n // block_size], n % block_size] (V alike,
index 1). Decodes (q_len 1), fresh prefills and chunked prefills with cached context go
through the same program. The softmax is online (running max and sum, fp32), scores and
the output are accumulated in fp32, and out is cast once at the store; P is rounded to
the input dtype for the P @ V product (tensor cores), as FlashAttention does.

Tensors (logical shapes; the stride that must be 1 in brackets):

- ``q``, ``out``: (num_tokens, num_heads, head_size) [head_size]; other strides free (q
  may be a view into a fused QKV projection). ``out`` is written, nothing else is.
- ``kv_cache``: (2, num_blocks, block_size, num_kv_heads, head_size) [head_size], q's
  dtype (fp32, fp16 or bf16). Read only.
- ``query_start_loc``: (num_seqs+1,) int32, from 0, non-decreasing;
  ``seq_lens``: (num_seqs,) int32; ``block_table``: (num_seqs, max_blocks) int32 [max_blocks].

Padding: a sequence with seq_lens[i] == 0, or with no tokens (query_start_loc
repeating), does nothing; tokens no sequence owns (after query_start_loc[-1]) and rows
that see no key get out = 0. Nothing of a padded row is read from the cache.

CUDA graphs: the grid and every constexpr come from shapes (num_tokens, num_seqs, heads,
head_size, block_size, block-table width) and the optional host hints; the lengths are
read on the device, so a captured decode graph stays valid as its sequences grow. The
launcher never reads device data.

Layout of the work: program (b, g) takes kv head g and a block of BLOCK_Q query tokens
of one sequence, with the group's num_heads // num_kv_heads query heads stacked into
BLOCK_M = BLOCK_Q * group rows, so each K/V tile loaded feeds every head that shares it.
Query blocks are numbered sequence by sequence: sequence i's start at
qsl[i] // BLOCK_Q + i, so num_tokens // BLOCK_Q + num_seqs + 1 programs cover every
sequence and the padding tail (a last pseudo-sequence of the unowned tokens); a program
finds its sequence by binary search over query_start_loc, and spare ones exit at once.

On CPU tensors the op runs ``unified_attention_ref`` unless ``TRITON_INTERPRET=1``, in
which case the kernel runs through Triton's interpreter.
"""

import math

import torch

from vllm.model_executor.layers.attention.ops.checks import check_unified_attention_args
from vllm.model_executor.layers.attention.ops.unified_attention_ref import unified_attention_ref
from vllm.triton_utils import HAS_TRITON, tl, triton
from vllm.triton_utils.launch import CachedLauncher

__all__ = ["unified_attention", "unified_attention_ref"]

_LOG2E = math.log2(math.e)


@triton.jit(do_not_specialize=["num_tokens", "num_seqs", "n_search"])
def _unified_attention_kernel(
    q_ptr,
    kv_ptr,
    out_ptr,
    qsl_ptr,
    seq_lens_ptr,
    bt_ptr,
    qk_scale,
    num_tokens,
    num_seqs,
    n_search,
    max_blocks,
    stride_q_t,
    stride_q_h,
    stride_kv_kv,
    stride_kv_blk,
    stride_kv_slot,
    stride_kv_h,
    stride_out_t,
    stride_out_h,
    stride_bt_s,
    GROUP: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_kvh = tl.program_id(1).to(tl.int64)

    # The sequence of this query block: the last i in [0, num_seqs] whose first block
    # qsl[i] // BLOCK_Q + i is <= i_b (i == num_seqs: the unowned tokens at the end).
    lo = i_b * 0
    hi = lo + num_seqs + 1
    for _ in range(n_search):
        active = lo < hi
        mid = (lo + hi) // 2
        b_start = tl.load(qsl_ptr + mid, mask=active, other=0).to(tl.int64)
        go_right = active & (b_start // BLOCK_Q + mid <= i_b)
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(active & ~go_right, mid, hi)
    seq = tl.maximum(lo - 1, 0)  # >= 0 unless query_start_loc[0] > 0 (invalid)
    real = seq < num_seqs
    q_start = tl.load(qsl_ptr + seq).to(tl.int64)
    q_end = tl.load(qsl_ptr + seq + 1, mask=real, other=num_tokens).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq, mask=real, other=0).to(tl.int64)
    q_len = q_end - q_start
    q0 = (i_b - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first query of the block
    if q0 >= q_len:
        return
    ctx = seq_len - q_len  # tokens cached before this step's chunk

    o_m = tl.arange(0, BLOCK_M)
    o_qi = q0 + o_m // GROUP  # query index within the sequence
    o_tok = q_start + o_qi
    o_h = i_kvh * GROUP + o_m % GROUP
    m_row = (o_m < BLOCK_Q * GROUP) & (o_qi >= 0) & (o_qi < q_len) & (o_tok < num_tokens)
    o_d = tl.arange(0, HEAD_PAD)
    m_d = o_d < HEAD_SIZE
    p_q = q_ptr + o_tok[:, None] * stride_q_t + o_h[:, None] * stride_q_h + o_d[None, :]
    b_q = tl.load(p_q, mask=m_row[:, None] & m_d[None, :], other=0.0)
    q_pos = ctx + o_qi

    # Keys up to the block's last query position (never past the sequence's end).
    kv_end = tl.minimum(seq_len, ctx + tl.minimum(q0 + BLOCK_Q, q_len))
    b_m = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: no inf - inf
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    p_kv = kv_ptr + i_kvh * stride_kv_h
    p_bt = bt_ptr + seq * stride_bt_s
    for n0 in range(0, kv_end, TILE_N):
        o_n = tl.cast(n0, tl.int64) + tl.arange(0, TILE_N)
        m_n = o_n < kv_end
        o_lb = o_n // BLOCK_SIZE
        b_blk = tl.load(p_bt + o_lb, mask=m_n & (o_lb < max_blocks), other=0).to(tl.int64)
        o_kv = b_blk * stride_kv_blk + (o_n % BLOCK_SIZE) * stride_kv_slot
        m_kv = m_n[None, :] & m_d[:, None]
        b_kt = tl.load(p_kv + o_kv[None, :] + o_d[:, None], mask=m_kv, other=0.0)
        b_s = tl.dot(b_q, b_kt, input_precision=DOT_PRECISION) * qk_scale
        m_s = m_row[:, None] & m_n[None, :] & (o_n[None, :] <= q_pos[:, None])
        b_s = tl.where(m_s, b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_alpha = tl.exp2(b_m - b_m_new)
        b_p = tl.exp2(b_s - b_m_new[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        p_v = p_kv + stride_kv_kv + o_kv[:, None] + o_d[None, :]
        b_v = tl.load(p_v, mask=m_n[:, None] & m_d[None, :], other=0.0)
        b_pv = tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)
        b_acc = b_acc * b_alpha[:, None] + b_pv
        b_m = b_m_new

    # Rows that saw no key (padding) get 0.
    b_out = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]
    p_out = out_ptr + o_tok[:, None] * stride_out_t + o_h[:, None] * stride_out_h + o_d[None, :]
    tl.store(p_out, b_out.to(out_ptr.dtype.element_ty), mask=m_row[:, None] & m_d[None, :])


_LAUNCH = CachedLauncher(_unified_attention_kernel)


# --------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------

# Tiles per kind of step, as data (untuned: chosen for register budgets at head sizes up
# to 256 and awaiting a run of benchmarks/kernels/benchmark_unified_attention.py on the
# GPU box). "decode": one query token per program and head group, rows = the group's
# heads; "prefill": 64 query rows share each K/V tile. Heads padded past 128 halve the
# tiles so the fp32 accumulator (BLOCK_M x HEAD_PAD) stays in registers.
_CONFIGS = {
    "decode": dict(BLOCK_M=16, TILE_N=64, num_warps=4),
    "prefill": dict(BLOCK_M=64, TILE_N=64, num_warps=4),
}
_PREFILL_MIN_ROWS = 64  # query rows per sequence (tokens x group) that pay for BLOCK_M 64
_SHORT_SEQ_TILE = 32  # TILE_N when max_seq_len says every sequence is this short


def _config(
    num_tokens: int,
    num_seqs: int,
    group: int,
    head_pad: int,
    num_decodes,
    max_query_len,
    max_seq_len,
) -> dict:
    """Constexprs and launch options from shapes and the optional host hints only."""
    if max_query_len is not None:
        longest = max_query_len
    elif num_decodes is not None and num_decodes == num_seqs:
        longest = 1
    else:  # shapes alone: the mean query length
        longest = -(-num_tokens // max(num_seqs, 1))
    kind = "prefill" if longest * group >= _PREFILL_MIN_ROWS else "decode"
    cfg = dict(_CONFIGS[kind])
    if head_pad > 128:
        cfg["BLOCK_M"] = max(16, cfg["BLOCK_M"] // 2)
        cfg["TILE_N"] //= 2
    if max_seq_len is not None and max_seq_len <= _SHORT_SEQ_TILE:
        cfg["TILE_N"] = min(cfg["TILE_N"], _SHORT_SEQ_TILE)
    # Every head of a group in one program: BLOCK_M >= group.
    cfg["BLOCK_M"] = max(cfg["BLOCK_M"], triton.next_power_of_2(group))
    cfg["BLOCK_Q"] = cfg["BLOCK_M"] // group
    return cfg


def _variants(base: dict, head_pad: int, group: int) -> list[dict]:
    """Every constexpr set a launch like ``base`` could take (for the engine's precompile)."""
    unique = {}
    for longest in (1, _PREFILL_MIN_ROWS):  # a decode and a prefill configuration
        for max_seq_len in (None, 1):
            cfg = {**base, **_config(1, 1, group, head_pad, None, longest, max_seq_len)}
            unique[tuple(sorted(cfg.items()))] = cfg
    return list(unique.values())


def _use_kernel(q: torch.Tensor) -> bool:
    if q.is_cuda:
        if not HAS_TRITON:
            raise RuntimeError("unified_attention on CUDA tensors needs Triton, which is missing")
        return True
    return _LAUNCH.runs_cpu_tensors()


def _impl(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    num_decodes: int | None,
    max_query_len: int | None,
    max_seq_len: int | None,
) -> None:
    if q.shape[0] == 0:
        return
    if not _use_kernel(q):
        unified_attention_ref(
            q,
            kv_cache,
            out,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=block_table,
            scale=scale,
            num_decodes=num_decodes,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
        )
        return
    num_tokens, num_heads, head_size = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    num_seqs = query_start_loc.shape[0] - 1
    group = num_heads // num_kv_heads
    head_pad = max(16, triton.next_power_of_2(head_size))
    cfg = _config(num_tokens, num_seqs, group, head_pad, num_decodes, max_query_len, max_seq_len)
    grid = (num_tokens // cfg["BLOCK_Q"] + num_seqs + 1, num_kv_heads)
    args = (
        q,
        kv_cache,
        out,
        query_start_loc,
        seq_lens,
        block_table,
        float(scale) * _LOG2E,
        num_tokens,
        num_seqs,
        (num_seqs + 1).bit_length(),
        block_table.shape[1],
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
    )
    base = dict(
        GROUP=group,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    _LAUNCH(grid, args, {**base, **cfg}, variants=lambda: _variants(base, head_pad, group))


def unified_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    num_decodes: int | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Attention of every query token of the step (see the module docstring); writes and
    returns ``out``.

    ``num_decodes`` (the leading one-token sequences), ``max_query_len`` and
    ``max_seq_len`` are optional host hints that only pick tiles; any lengths are
    computed correctly without them. A captured CUDA graph replays other steps than
    the one it was captured on, so while a stream is capturing ``max_seq_len`` (whose
    short-sequence tile would be baked in) is ignored.
    """
    check_unified_attention_args(
        q,
        kv_cache,
        out,
        query_start_loc,
        seq_lens,
        block_table,
        scale,
        num_decodes,
        max_query_len,
        max_seq_len,
    )
    if max_seq_len is not None and q.is_cuda and torch.cuda.is_current_stream_capturing():
        max_seq_len = None
    args = (q, kv_cache, out, query_start_loc, seq_lens, block_table, float(scale))
    hints = (num_decodes, max_query_len, max_seq_len)
    if torch.compiler.is_compiling():
        torch.ops.vllm.unified_attention(*args, *hints)
    else:
        _impl(*args, *hints)
    return out


# The op is the implementation itself (its annotations give the schema); eager calls go
# to the same function directly.
_unified_attention_op = torch.library.custom_op(
    "vllm::unified_attention", _impl, mutates_args=("out",)
)


@_unified_attention_op.register_fake
def _(
    q,
    kv_cache,
    out,
    query_start_loc,
    seq_lens,
    block_table,
    scale,
    num_decodes,
    max_query_len,
    max_seq_len,
):
    return None
