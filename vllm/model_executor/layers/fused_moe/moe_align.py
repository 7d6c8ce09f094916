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

Three implementations, all with no host sync (so a decode step that calls them can be
captured in a CUDA graph) and the same buffers, chosen by shape where the kernels run
(CUDA, or the interpreter on CPU):

- up to ``max_kernel_pairs`` pairs (decode-sized steps), one launch of
  ``moe_align_kernel``: a single program counts, lays out the runs and places the pairs;
- larger steps, two launches parallel over chunks of pairs (``moe_align_count_kernel``:
  each chunk's counts per expert and each pair's rank in its chunk;
  ``moe_align_place_kernel``: every program sums the chunks' counts, places its chunk's
  pairs and writes its share of the padding and of ``expert_ids``), in place of the ~30
  launches of the torch ops (a stable sort's several among them), ~60 us of small kernels
  on an H200 at a 4096-token step against ~10;
- where the kernels cannot run (CPU without the interpreter, more than
  ``MAX_KERNEL_EXPERTS`` experts), torch ops on the ids' device: ``scatter_add_`` counts
  (not ``bincount``, whose CUDA path reads the maximum back), a stable sort,
  ``searchsorted``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm.model_executor.layers.fused_moe.fused_moe_kernels import (
    moe_align_count_kernel,
    moe_align_kernel,
    moe_align_place_kernel,
)
from vllm.triton_utils import triton
from vllm.triton_utils.host import recording
from vllm.triton_utils.launch import CachedLauncher

INDEX_DTYPES = (torch.int32, torch.int64)
# The one-program kernel's defaults: the largest step it takes, and its one-hot tile
# (CHUNK pairs x the experts rounded up to a power of two) in elements.
MAX_KERNEL_PAIRS = 1024
TILE_ELEMENTS = 4096
MAX_KERNEL_EXPERTS = 1024
# The two-launch path: at most this many chunks (programs of the count kernel), each of at
# least MIN_CHUNK_TILES one-hot tiles of pairs; at most PLACE_ROWS rows of padding per
# program of the place kernel (more programs than chunks when the rows need them).
MAX_CHUNKS = 128
MIN_CHUNK_TILES = 8
PLACE_ROWS = 512

_ALIGN = CachedLauncher(moe_align_kernel)
_COUNT = CachedLauncher(moe_align_count_kernel)
_PLACE = CachedLauncher(moe_align_place_kernel)


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
    device). Where the kernels run, steps of up to ``max_kernel_pairs`` pairs take the
    one-program kernel (0: never) and larger ones the two-launch path, each launched with
    ``num_warps``. Inside ``precompile()`` both paths' variants for every (block_size,
    num_warps) of ``variant_configs`` (the caller's table) are registered whichever path
    this step takes, so a later step compiles none."""
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
    if not runs:
        _align_torch(topk_ids, block_size, num_experts, sorted_ids, expert_ids, total)
        return sorted_ids, expert_ids, total
    one_program = num_pairs <= max_kernel_pairs
    experts = triton.next_power_of_2(num_experts)
    chunk = max(16, min(256, TILE_ELEMENTS // experts))
    fixed = dict(EXPERTS=experts, CHUNK=chunk)
    ids = topk_ids.contiguous().view(-1)  # the kernels read it with unit stride
    pairs = sorted({(block_size, num_warps), *variant_configs})

    def variants(with_block: bool):
        def make() -> list[dict]:
            if with_block:
                return [dict(BLOCK_M=b, num_warps=w, **fixed) for b, w in pairs]
            return [dict(num_warps=w, **fixed) for w in sorted({w for _, w in pairs})]

        return make

    # Inside precompile() the launches only record, both paths' (whichever this step takes).
    if one_program or recording():
        args = (ids, sorted_ids, expert_ids, total, num_pairs, num_experts, num_blocks)
        cx = dict(BLOCK_M=block_size, num_warps=num_warps, **fixed)
        _ALIGN((1,), args, cx, variants(True))
    if not one_program or recording():
        _align_chunks(ids, num_experts, num_blocks, block_size, num_warps, fixed,
                      (sorted_ids, expert_ids, total), variants)  # fmt: skip
    return sorted_ids, expert_ids, total


def _chunk_span(num_pairs: int, chunk: int) -> int:
    """Pairs per program of the two-launch path: whole one-hot tiles, at least
    MIN_CHUNK_TILES of them, few enough that there are at most MAX_CHUNKS programs."""
    tiles = max(MIN_CHUNK_TILES, -(-num_pairs // (MAX_CHUNKS * chunk)))
    return tiles * chunk


def _align_chunks(ids, num_experts, num_blocks, block_size, num_warps, fixed, out,
                  variants) -> None:  # fmt: skip
    sorted_ids, expert_ids, total = out
    num_pairs = ids.numel()
    span = _chunk_span(num_pairs, fixed["CHUNK"])
    num_chunks = -(-num_pairs // span)
    counts = torch.empty(num_chunks, fixed["EXPERTS"], dtype=torch.int32, device=ids.device)
    rank = torch.empty(num_pairs, dtype=torch.int32, device=ids.device)
    cx = dict(num_warps=num_warps, **fixed)
    _COUNT((num_chunks,), (ids, counts, rank, num_pairs, span), cx, variants(False))
    programs = max(num_chunks, -(-num_blocks * block_size // PLACE_ROWS))
    blocks_per = -(-num_blocks // programs)
    args = (ids, counts, rank, sorted_ids, expert_ids, total, num_pairs, num_experts,
            num_chunks, num_blocks, span, blocks_per)  # fmt: skip
    cx = dict(BLOCK_M=block_size, num_warps=num_warps, **fixed)
    _PLACE((programs,), args, cx, variants(True))


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
