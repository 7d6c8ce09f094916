"""fp32 PyTorch reference of ``unified_attention``: the CPU path and the tests' oracle.

Per sequence: gather its K and V from the paged cache through its block table, then a
masked softmax over ``scale * q @ k^T`` in fp32, cast once to out's dtype. No fused
kernels (no scaled_dot_product_attention, which may pick reduced-precision paths), so the
semantics are spelled out here. Unlike the kernel it reads the host data (a sync on a
GPU) and checks it: offsets that are not a valid split of the tokens, or a block table
entry outside the cache, are ValueErrors.
"""

from __future__ import annotations

import torch

from vllm.model_executor.layers.attention.ops.checks import check_unified_attention_args


def _check_data(qsl: list[int], lens: list[int], bt: torch.Tensor, num_tokens, kv_cache) -> None:
    if (
        qsl[0] != 0
        or any(b < a for a, b in zip(qsl[:-1], qsl[1:], strict=True))
        or qsl[-1] > num_tokens
    ):
        raise ValueError(
            f"query_start_loc must start at 0, be non-decreasing and end at most at "
            f"num_tokens={num_tokens}, got {qsl}"
        )
    if any(n < 0 for n in lens):
        raise ValueError(f"seq_lens must be >= 0, got {lens}")
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    for i, n in enumerate(lens):
        q_len = qsl[i + 1] - qsl[i]
        if n > 0 and q_len > n:
            raise ValueError(
                f"sequence {i}: seq_lens={n} counts this step's tokens, so it cannot be "
                f"less than its query length {q_len}"
            )
        need = -(-n // block_size)
        if need > bt.shape[1]:
            raise ValueError(
                f"sequence {i}: seq_len {n} needs {need} blocks of {block_size}, but "
                f"block_table has {bt.shape[1]} columns"
            )
        row = bt[i, :need]
        if need and bool(((row < 0) | (row >= num_blocks)).any()):
            raise ValueError(
                f"sequence {i}: block_table entries must be in [0, {num_blocks}), got "
                f"{row.tolist()}"
            )


def unified_attention_ref(
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
    """Writes ``out`` (same contract as ``unified_attention``) and returns it.

    The hints (``num_decodes``, ``max_query_len``, ``max_seq_len``) are checked, never
    needed: the reference reads the lengths themselves.
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
    num_tokens, num_heads, head_size = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    group = num_heads // num_kv_heads
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    bt = block_table.to(device="cpu", dtype=torch.int64)
    _check_data(qsl, lens, bt, num_tokens, kv_cache)
    # Tokens no sequence owns (padding) and rows that see no key stay 0.
    res = torch.zeros(num_tokens, num_heads, head_size, dtype=torch.float32, device=q.device)
    for i, n in enumerate(lens):
        start, end = qsl[i], qsl[i + 1]
        q_len = end - start
        if q_len == 0 or n == 0:
            continue
        blocks = bt[i, : -(-n // block_size)].to(q.device)
        k = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_size)[:n].float()
        v = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_size)[:n].float()
        k = k.repeat_interleave(group, dim=1)  # (n, num_heads, head_size)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("lhd,nhd->hln", q[start:end].float(), k) * float(scale)
        q_pos = torch.arange(n - q_len, n, device=q.device)
        visible = torch.arange(n, device=q.device)[None, :] <= q_pos[:, None]  # (q_len, n)
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        res[start:end] = torch.einsum("hln,nhd->lhd", probs, v)
    out.copy_(res)
    return out
