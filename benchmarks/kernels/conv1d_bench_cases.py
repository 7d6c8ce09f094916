"""The causal-conv1d benchmark's cases and their data (benchmark_causal_conv1d.py): the
fixed shape (bf16, width 4, a pool of 1024 lines), the prefill / mixed / decode cases with
the bytes each must move, and ``build_inputs``: the case's tensors, its metadata and the
fp32 reference's output and final state pool.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
    causal_conv1d_ref,
    causal_conv1d_update_ref,
    compute_causal_conv1d_metadata,
)

DEVICE = "cuda"
DTYPE = torch.bfloat16
WIDTH = 4
NUM_LINES = 1024
PREFILL_SEQS = (1, 16)
MIXED_PREFILL = 2048


@dataclasses.dataclass
class Case:
    kind: str  # "prefill", "mixed" or "decode"
    dim: int
    lens: list[int]
    init: list[bool]

    @property
    def tokens(self) -> int:
        return sum(self.lens)

    @property
    def seqs(self) -> int:
        return len(self.lens)

    @property
    def label(self) -> str:
        if self.kind == "prefill":
            return f"T={self.tokens} x{self.seqs}"
        if self.kind == "mixed":
            return f"{MIXED_PREFILL}+{self.seqs - 1}"
        return f"B={self.seqs}"

    def bytes_moved(self) -> int:
        es = torch.finfo(DTYPE).bits // 8
        w1 = WIDTH - 1
        tokens = 2 * self.tokens * self.dim  # x read, out written
        params = self.dim * (WIDTH + 1)  # weight, bias
        states = (sum(self.init) + self.seqs) * self.dim * w1  # read where init, written
        return es * (tokens + params + states)


def make_cases(kinds, dims, sizes) -> list[Case]:
    cases = []
    for dim in dims:
        if "prefill" in kinds:
            for tokens in sizes["prefill"]:
                for seqs in PREFILL_SEQS:
                    cases.append(Case("prefill", dim, [tokens // seqs] * seqs, [False] * seqs))
        if "mixed" in kinds:
            for n in sizes["mixed"]:
                cases.append(Case("mixed", dim, [MIXED_PREFILL] + [1] * n, [True] * (n + 1)))
        if "decode" in kinds:
            for b in sizes["decode"]:
                cases.append(Case("decode", dim, [1] * b, [True] * b))
    return cases


@dataclasses.dataclass
class Inputs:
    x: torch.Tensor  # (dim, tokens), feature-contiguous
    weight: torch.Tensor
    bias: torch.Tensor
    pool_w: torch.Tensor  # (lines, dim, W-1) width-contiguous (CUDA, Dao decode)
    pool_f: torch.Tensor  # the same values, feature-contiguous (Triton, vLLM)
    qsl: torch.Tensor
    idx: torch.Tensor
    lines: list[int]
    init: torch.Tensor
    meta: object
    ref_out: torch.Tensor  # fp32, shaped like the op's output
    ref_pool: torch.Tensor  # expected pool after the call, DTYPE, width-contiguous

    @property
    def x_rows(self) -> torch.Tensor:
        """x as (tokens, dim) rows: the decode ops' input."""
        return self.x.t()


def build_inputs(case: Case, seed: int) -> Inputs:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    dim = case.dim
    x = torch.randn(case.tokens, dim, device=DEVICE, generator=g).to(DTYPE).t()
    weight = (0.5 * torch.randn(dim, WIDTH, device=DEVICE, generator=g)).to(DTYPE)
    bias = (0.2 * torch.randn(dim, device=DEVICE, generator=g)).to(DTYPE)
    pool_w = torch.randn(NUM_LINES, dim, WIDTH - 1, device=DEVICE, generator=g).to(DTYPE)
    pool_f = pool_w.transpose(1, 2).contiguous().transpose(1, 2)
    perm = 1 + torch.randperm(NUM_LINES - 1, device=DEVICE, generator=g)[: case.seqs]
    idx = perm.to(torch.int32)
    qsl_cpu = torch.tensor([0] + list(_cumsum(case.lens)), dtype=torch.int32)
    qsl = qsl_cpu.to(DEVICE)
    init = torch.tensor(case.init, device=DEVICE)
    meta = compute_causal_conv1d_metadata(qsl_cpu, DEVICE) if case.kind != "decode" else None
    # The fp32 reference: inputs are bf16 values, so its states are exact bf16 values.
    ref_pool = pool_w.float()
    if case.kind == "decode":
        ref_out = causal_conv1d_update_ref(
            x.t().float(), ref_pool, weight.float(), bias.float(), "silu", idx
        )
    else:
        ref_out = causal_conv1d_ref(
            x.float(), weight.float(), bias.float(), ref_pool, qsl, idx, init, "silu"
        )
    return Inputs(
        x,
        weight,
        bias,
        pool_w,
        pool_f,
        qsl,
        idx,
        perm.tolist(),
        init,
        meta,
        ref_out,
        ref_pool.to(DTYPE),
    )


def _cumsum(values):
    total = 0
    for v in values:
        total += v
        yield total
