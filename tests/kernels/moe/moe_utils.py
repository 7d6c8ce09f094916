"""Helpers shared by the fused-MoE tests: tie-free router inputs, distinct expert ids,
expert weights, the tolerance table.

Inputs are drawn on the CPU from a generator seeded by the case, then moved to the
device, so a case has the same data on the CPU box and on the GPU box.
"""

from __future__ import annotations

import zlib

import torch

# Kernel vs the fp32 reference, by dtype. The kernels round the intermediate h to the
# activation dtype and each (token, k) row before the top-k sum; the reference does not.
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=6e-2, rtol=6e-2),
}


def gen_for(*key) -> torch.Generator:
    """A CPU generator seeded from ``key`` (e.g. the case)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def distinct_ids(tokens: int, top_k: int, num_experts: int, gen) -> torch.Tensor:
    """(tokens, top_k) int32: each token's k experts, distinct, in random order."""
    rows = [torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)]
    return torch.stack(rows).to(torch.int32) if rows else torch.empty(0, top_k, dtype=torch.int32)


def tie_free_logits(tokens: int, num_experts: int, gen, step: float = 0.37) -> torch.Tensor:
    """(tokens, E) fp32 logits, each row a permutation of ``step * (i - E / 2)``: any two
    experts of a token differ by at least ``step``, so no top-k can tie."""
    base = step * (torch.arange(num_experts, dtype=torch.float32) - num_experts / 2)
    return torch.stack([base[torch.randperm(num_experts, generator=gen)] for _ in range(tokens)])


def grouped_scores(tokens: int, num_groups: int, gen) -> torch.Tensor:
    """(tokens, 2 * num_groups) sigmoid scores in groups of two (2 <= num_groups <= 4),
    tie-free by construction. In each token the group ranked r (a random permutation)
    holds 0.25 + 0.125 r +- d_r, so group sums (the sum of a group's two best) are 0.25
    apart; d_r = 0.01 (r + 1) + 0.003, except for the runner-up group, d = 0.19: its best
    expert beats every expert of the best group, so a grouped choice differs from a plain
    top-k. All scores are at least 0.02 apart."""
    if not 2 <= num_groups <= 4:
        raise ValueError(f"num_groups must be in [2, 4], got {num_groups}")
    out = torch.empty(tokens, num_groups, 2)
    for t in range(tokens):
        rank = torch.randperm(num_groups, generator=gen).float()
        half = 0.25 + 0.125 * rank
        d = torch.where(rank == num_groups - 2, 0.19, 0.01 * (rank + 1) + 0.003)
        out[t, :, 0], out[t, :, 1] = half + d, half - d
    return out.reshape(tokens, 2 * num_groups)


def logit(p: torch.Tensor) -> torch.Tensor:
    """The logits whose sigmoid is ``p``."""
    return torch.log(p) - torch.log1p(-p)


def expert_weights(num_experts, hidden, inter, dtype, gen, act_and_mul=True):
    """(w13 (E, 2I or I, H), w2 (E, H, I)) scaled for unit-variance outputs."""
    rows = (2 if act_and_mul else 1) * inter
    w13 = torch.randn(num_experts, rows, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    return w13.to(dtype), w2.to(dtype)


def as_rows(ids: torch.Tensor, weights: torch.Tensor):
    """A token's (ids, weights) sorted by id: the router's order is unspecified."""
    order = ids.long().argsort(dim=-1)
    return ids.long().gather(1, order), weights.float().gather(1, order)


def limit_kernel_pairs(patcher, most: int) -> None:
    """Every launch table entry with ``align.max_kernel_pairs`` = ``most`` (``patcher``: a
    pytest MonkeyPatch or its context), so small tests take the two-launch alignment."""
    from vllm.model_executor.layers.fused_moe import fused_moe as fm

    table = fm.launch_config

    def entry(*args):
        cfg = dict(table(*args))  # a copy: the real entry is cached
        cfg["align"] = {**cfg.get("align", {}), "max_kernel_pairs": most}
        return cfg

    patcher.setattr(fm, "launch_config", entry)
