"""Group the (token, k) pairs by expert, each expert's run padded to the GEMM's block size.

``topk_ids`` (tokens, top_k) names each token's experts. Pair p = token * top_k + k is a
row of the grouped GEMMs. ``moe_align_block_size`` returns

- ``sorted_token_ids`` (num_blocks * block_size,) int32: the pairs of expert 0, padded with
  the id ``num_pairs`` (out of range: the kernels mask it) to a multiple of ``block_size``,
  then expert 1's, ...; the tail after the last expert is padding too;
- ``expert_ids`` (num_blocks,) int32: the expert of each block of ``block_size`` rows,
  -1 for the blocks after the last expert's (the kernels skip them);
- ``num_tokens_post_padded`` (1,) int32: how many rows the experts' runs take.

Sizes depend only on (num_pairs, num_experts, block_size): the worst case is every used
expert wasting block_size - 1 rows, and at most min(num_experts, num_pairs) experts are
used, so ``num_blocks = cdiv(num_pairs + min(E, num_pairs) * (block_size - 1),
block_size)``. Everything is torch on the ids' device with no host sync (no
``.item()``, no ``bincount``, whose CUDA path reads the maximum back), so a decode step
that calls it can be captured in a CUDA graph. Within an expert the pairs keep their
order (a stable sort).
"""

from __future__ import annotations

import torch

INDEX_DTYPES = (torch.int32, torch.int64)


def max_num_blocks(num_pairs: int, num_experts: int, block_size: int) -> int:
    """The number of blocks the worst case fills (see the module docstring)."""
    worst = num_pairs + min(num_experts, num_pairs) * (block_size - 1)
    return -(-worst // block_size)


def moe_align_block_size(
    topk_ids: torch.Tensor, block_size: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_token_ids, expert_ids, num_tokens_post_padded) as in the module docstring.
    ``topk_ids`` must hold expert ids in [0, num_experts) (not checked: that would read the
    device)."""
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        shape = getattr(topk_ids, "shape", None)
        raise ValueError(f"topk_ids must be (num_tokens, top_k), got {shape}")
    if topk_ids.dtype not in INDEX_DTYPES:
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    num_blocks = max_num_blocks(num_pairs, num_experts, block_size)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + (block_size - 1)) // block_size * block_size
    ends = padded.cumsum(0)
    starts = ends - padded
    order = torch.sort(flat, stable=True).indices
    by_expert = flat[order]
    first = counts.cumsum(0) - counts  # where each expert's pairs start, unpadded
    rank = torch.arange(num_pairs, device=device) - first[by_expert]
    dest = starts[by_expert] + rank
    sorted_ids = torch.full((num_blocks * block_size,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(num_blocks, device=device) * block_size
    expert_ids = torch.searchsorted(ends, block_starts, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    total = ends[-1:].to(torch.int32)
    return sorted_ids, expert_ids, total
