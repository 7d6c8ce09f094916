"""Shared helpers of the selective-state-update kernel tests (test_mamba_ssm_triton.py and
test_mamba_ssm_triton_gpu.py): the ``Case`` description, ``build`` (its inputs, drawn on
the CPU from a generator seeded by the case id, then moved, so a case has the same data on
both boxes) and ``check_against_torch`` (the kernel against ``selective_state_update_torch``
on copies of the pool).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tests.models.mamba2_utils import BF16, FP16, FP32, assert_close, gen_for
from vllm.model_executor.layers.mamba.ops.causal_conv1d_ref import NULL_BLOCK_ID
from vllm.model_executor.layers.mamba.ops.mamba_ssm_torch import selective_state_update_torch
from vllm.model_executor.layers.mamba.ops.mamba_ssm_triton import selective_state_update_triton

NAMES = {FP32: "fp32", FP16: "fp16", BF16: "bf16"}
NO_LIMIT = (0.0, math.inf)


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int = 4
    headdim: int = 8
    dstate: int = 16
    groups: int = 1
    dtype: torch.dtype = FP32  # x, dt, B, C and out
    state_dtype: torch.dtype = FP32
    pads: int = 0
    indices: torch.dtype | None = torch.int32  # None: row b uses line b
    D: bool = True
    dt_bias: bool = True
    softplus: bool = True
    limit: tuple[float, float] = NO_LIMIT
    strided: bool = False  # every tensor a non-contiguous view, as the layer hands them over

    @property
    def id(self) -> str:
        parts = [
            f"B{self.batch}_H{self.heads}_P{self.headdim}_N{self.dstate}_G{self.groups}",
            NAMES[self.dtype],
        ]
        if self.state_dtype != FP32:
            parts.append(f"state{NAMES[self.state_dtype]}")
        if self.pads:
            parts.append(f"pad{self.pads}")
        if self.indices is None:
            parts.append("noidx")
        elif self.indices == torch.int64:
            parts.append("idx64")
        parts += [name for name, off in (("noD", not self.D), ("nobias", not self.dt_bias)) if off]
        if not self.softplus:
            parts.append("nosoftplus")
        if self.limit != NO_LIMIT:
            parts.append("lim")
        if self.strided:
            parts.append("strided")
        return "_".join(parts)

    @property
    def num_lines(self) -> int:
        return self.batch + 3  # the null line 0, and some lines no row names


@dataclass
class Inputs:
    state: torch.Tensor
    kwargs: dict  # everything else selective_state_update takes
    lines: list[int]  # the line of each row; NULL_BLOCK_ID (the null line 0) for a padded row


def build(case: Case, device, key=None) -> Inputs:
    gen = gen_for("ssm-update", key or case.id)
    b, H, P, N, G = case.batch, case.heads, case.headdim, case.dstate, case.groups

    def rnd(*shape, dtype=case.dtype, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(dtype=dtype, device=device)

    if case.strided:
        # x | dt and B | C as column blocks of wider projections, the pool as a layer of a
        # bigger pool with its dstate axis strided, out with padding between rows.
        proj = rnd(b, H * P + H + 7)
        x = proj[:, : H * P].unflatten(-1, (H, P))
        dt_raw = proj[:, H * P : H * P + H]
        bc = rnd(b, 2 * G * N + 5)
        B = bc[:, : G * N].unflatten(-1, (G, N))
        C = bc[:, G * N + 5 :].unflatten(-1, (G, N))
        big = rnd(2, case.num_lines, H, N, P + 3, dtype=case.state_dtype)
        state = big[1, ..., :P].transpose(-1, -2)
        out = torch.full((b, H, P + 2), float("nan"), dtype=case.dtype, device=device)[..., :P]
    else:
        x, dt_raw = rnd(b, H, P), rnd(b, H)
        B, C = rnd(b, G, N), rnd(b, G, N)
        state = rnd(case.num_lines, H, P, N, dtype=case.state_dtype)
        out = None
    if case.softplus:
        dt = (0.5 * dt_raw.float()).to(case.dtype)
    else:
        dt = (0.1 + dt_raw.float().abs()).to(case.dtype)  # the step itself: positive

    lines = 1 + torch.randperm(case.num_lines - 1, generator=gen)[:b]  # line 0: null line
    lines[torch.randperm(b, generator=gen)[: case.pads]] = NULL_BLOCK_ID
    if case.indices is None:
        assert case.pads == 0, "padded rows need indices"
        lines = torch.arange(b)
        indices = None
    else:
        indices = lines.to(dtype=case.indices, device=device)
    f32 = dict(dtype=FP32, device=device)
    kwargs = dict(
        x=x,
        dt=dt,
        A=-torch.empty(H).uniform_(0.5, 3.0, generator=gen).to(**f32),
        B=B,
        C=C,
        D=torch.randn(H, generator=gen).to(**f32) if case.D else None,
        dt_bias=(0.5 * torch.randn(H, generator=gen)).to(**f32) if case.dt_bias else None,
        dt_softplus=case.softplus,
        dt_limit=case.limit,
        state_batch_indices=indices,
        out=out,
    )
    return Inputs(state, kwargs, lines.tolist())


def check_against_torch(case: Case, inp: Inputs, run=selective_state_update_triton) -> None:
    """Run the kernel and the PyTorch path on copies of the pool; compare outputs and the
    whole pool."""
    before, ref_pool = inp.state.clone(), inp.state.clone()
    ref_kwargs = dict(inp.kwargs, out=None)
    y_ref = selective_state_update_torch(ref_pool, **ref_kwargs)
    y = run(inp.state, **inp.kwargs)
    if inp.kwargs["out"] is not None:
        assert y is inp.kwargs["out"]
    assert y.dtype == case.dtype and y.shape == (case.batch, case.heads, case.headdim)
    assert not torch.isnan(y).any(), "an output element was not written"
    assert_close(y, y_ref, "scan", case.dtype)
    indexed = inp.kwargs["state_batch_indices"] is not None  # without indices none is padded
    live = [line for line in inp.lines if line != NULL_BLOCK_ID or not indexed]
    pad_rows = [r for r, line in enumerate(inp.lines) if line == NULL_BLOCK_ID and indexed]
    assert not y[pad_rows].any(), "padded rows must give y = 0"
    if live:
        assert_close(inp.state[live], ref_pool[live], "scan", case.state_dtype)
    # Every other line, the null line included, is bit-identical on both paths: padded rows
    # read and write no line.
    for line in sorted(set(range(case.num_lines)) - set(live)):
        assert torch.equal(inp.state[line], before[line]), f"line {line} was touched"
        assert torch.equal(ref_pool[line], before[line]), f"line {line} was touched (torch)"
