"""Helpers shared by the attention-op tests: a random paged step and the tolerance table.

Inputs are drawn on the CPU from a generator seeded by the case id, then moved to the
device, so a case has the same data on the CPU box and on the GPU box. Every cache slot
no sequence owns holds NaN (free blocks, the tail of a sequence's last block, the block
that unused block-table columns name), so a kernel that reads past a sequence's end
fails loudly.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

# The ONE tolerance table: attention outputs vs the fp32 reference, by dtype. Scores and
# sums are fp32 in both; the kernel rounds P to the input dtype for P @ V and casts the
# output once, so the budget is a few units in the last place of the dtype.
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}

DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
PAD = -1  # a sequence's context length that marks it as padding (seq_len 0)


def gen_for(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def randn(shape, gen, dtype, device) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, **TOLERANCES[expected.dtype], msg=msg or None)


def assert_no_nan(t: torch.Tensor) -> None:
    assert not torch.isnan(t).any(), "output has NaN: an element was unwritten or read NaN"


@dataclass
class Step:
    q: torch.Tensor  # (num_tokens, num_heads, head_size)
    kv_cache: torch.Tensor  # (2, num_blocks, block_size, num_kv_heads, head_size)
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    poison_block: int  # a block no sequence owns (NaN)

    def kwargs(self) -> dict:
        return dict(
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_table=self.block_table,
        )


def make_step(
    seqs: tuple[tuple[int, int], ...],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device,
    gen: torch.Generator,
    pad_tokens: int = 0,
    noncontig: bool = False,
    extra_cols: int = 2,
) -> Step:
    """``seqs``: (q_len, context_len) per sequence, context PAD for a padded one (seq_len
    0). Physical blocks are a random permutation; ``pad_tokens`` tokens after the last
    sequence belong to none."""
    seq_lens = [0 if c == PAD else c + q for q, c in seqs]
    needs = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needs) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    poison = perm.pop()
    width = max(needs, default=0) + extra_cols
    table = torch.full((len(seqs), width), poison, dtype=torch.int32)
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), float("nan"))
    for i, (n, need) in enumerate(zip(seq_lens, needs, strict=True)):
        blocks = [perm.pop() for _ in range(need)]
        table[i, :need] = torch.tensor(blocks, dtype=torch.int32)
        pos = torch.arange(n)
        slots = torch.tensor(blocks, dtype=torch.int64)[pos // block_size] * block_size
        flat = cache.view(2, num_blocks * block_size, num_kv_heads, head_size)
        flat[:, slots + pos % block_size] = torch.randn(
            (2, n, num_kv_heads, head_size), generator=gen
        )
    num_tokens = sum(q for q, _ in seqs) + pad_tokens
    if noncontig:  # q as the head slice of a wider projection: strides (H+3)*D, D, 1
        wide = randn((num_tokens, num_heads + 3, head_size), gen, dtype, device)
        q = wide[:, 1 : 1 + num_heads]
    else:
        q = randn((num_tokens, num_heads, head_size), gen, dtype, device)
    qsl = [0]
    for q_len, _ in seqs:
        qsl.append(qsl[-1] + q_len)
    return Step(
        q=q,
        kv_cache=cache.to(dtype=dtype, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=table.to(device),
        poison_block=poison,
    )
