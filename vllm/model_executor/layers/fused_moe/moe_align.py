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
block_size)``. Within an expert the pairs keep their order.

Two implementations, both with no host sync (so a decode step that calls them can be
captured in a CUDA graph), chosen by shape:

- up to ``max_kernel_pairs`` pairs (decode-sized steps), one launch of
  ``moe_align_kernel``: a single program counts, lays out the runs and places the pairs;
  it runs where the other kernels run (CUDA, or the interpreter on CPU);
- otherwise torch ops on the ids' device: ``scatter_add_`` counts (not ``bincount``,
  whose CUDA path reads the maximum back), a stable sort, ``searchsorted``: about fifteen
  small launches, negligible beside a prefill's GEMMs, and parallel over the pairs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm.model_executor.layers.fused_moe.fused_moe_kernels import moe_align_kernel
from vllm.triton_utils import triton
from vllm.triton_utils.host import recording
from vllm.triton_utils.launch import CachedLauncher

INDEX_DTYPES = (torch.int32, torch.int64)
# The one-program kernel's defaults: the largest step it takes, and its one-hot tile
# (CHUNK pairs x the experts rounded up to a power of two) in elements.
MAX_KERNEL_PAIRS = 1024
TILE_ELEMENTS = 4096
MAX_KERNEL_EXPERTS = 1024

_ALIGN = CachedLauncher(moe_align_kernel)


def max_num_blocks(num_pairs: int, num_experts: int, block_size: int) -> int:
    """The number of blocks the worst case fills (see the module docstring)."""
    worst = num_pairs + min(num_experts, num_pairs) * (block_size - 1)
    return -(-worst // block_size)


def moe_align_block_size(
    topk_ids: torch.Tensor,
    block_size: int,
    num_experts: int,
    max_kernel_pairs: int = MAX_KERNEL_PAIRS,
    num_warps: int = 4,
    variant_configs: Sequence[tuple[int, int]] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_token_ids, expert_ids, num_tokens_post_padded) as in the module docstring.
    ``topk_ids`` must hold expert ids in [0, num_experts) (not checked: that would read the
    device). Steps of up to ``max_kernel_pairs`` pairs take the one-program kernel where it
    can run (0: never), launched with ``num_warps``. Inside ``precompile()`` the kernel's
    variants for every (block_size, num_warps) of ``variant_configs`` (the caller's table)
    are registered whichever path this step takes, so a later decode step compiles none."""
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        shape = getattr(topk_ids, "shape", None)
        raise ValueError(f"topk_ids must be (num_tokens, top_k), got {shape}")
    if topk_ids.dtype not in INDEX_DTYPES:
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    num_pairs = topk_ids.numel()
    num_blocks = max_num_blocks(num_pairs, num_experts, block_size)
    device = topk_ids.device
    sorted_ids = torch.empty(num_blocks * block_size, dtype=torch.int32, device=device)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=device)
    total = torch.empty(1, dtype=torch.int32, device=device)
    runs = num_pairs > 0 and _kernel_runs(topk_ids, num_experts)
    use_kernel = runs and num_pairs <= max_kernel_pairs
    if use_kernel or (runs and recording()):
        experts = triton.next_power_of_2(num_experts)
        chunk = max(16, min(256, TILE_ELEMENTS // experts))
        args = (topk_ids.reshape(-1), sorted_ids, expert_ids, total, num_pairs, num_experts,
                num_blocks)  # fmt: skip
        fixed = dict(EXPERTS=experts, CHUNK=chunk)
        cx = dict(BLOCK_M=block_size, num_warps=num_warps, **fixed)

        def variants() -> list[dict]:
            pairs = {(block_size, num_warps), *variant_configs}
            return [dict(BLOCK_M=b, num_warps=w, **fixed) for b, w in sorted(pairs)]

        _ALIGN((1,), args, cx, variants)  # inside precompile() this only records
    if not use_kernel:
        _align_torch(topk_ids, block_size, num_experts, sorted_ids, expert_ids, total)
    return sorted_ids, expert_ids, total


def _kernel_runs(topk_ids: torch.Tensor, num_experts: int) -> bool:
    if num_experts > MAX_KERNEL_EXPERTS:
        return False
    return topk_ids.is_cuda or (topk_ids.device.type == "cpu" and _ALIGN.runs_cpu_tensors())


def _align_torch(topk_ids, block_size, num_experts, sorted_ids, expert_ids, total) -> None:
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + (block_size - 1)) // block_size * block_size
    ends = padded.cumsum(0)
    starts = ends - padded
    order = torch.sort(flat, stable=True).indices
    by_expert = flat[order]
    first = counts.cumsum(0) - counts  # where each expert's pairs start, unpadded
    rank = torch.arange(num_pairs, device=device) - first[by_expert]
    sorted_ids.fill_(num_pairs)
    sorted_ids.scatter_(0, starts[by_expert] + rank, order.to(torch.int32))
    block_starts = torch.arange(expert_ids.shape[0], device=device) * block_size
    found = torch.searchsorted(ends, block_starts, right=True)
    expert_ids.copy_(torch.where(found < num_experts, found, -1))
    total.copy_(ends[-1:])
