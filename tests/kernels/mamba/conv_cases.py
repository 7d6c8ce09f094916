"""The cases of the causal-conv1d op tests and how their inputs are built and checked:
``FnCase`` (causal_conv1d_fn: prefill, chunked prefill and decode in one launch) and
``UpdCase`` (causal_conv1d_update), shared by the interpreter tests and the GPU and
CUDA-pathway tests (test_causal_conv1d.py, test_causal_conv1d_update.py,
test_causal_conv1d_gpu.py, test_causal_conv1d_cuda.py, test_causal_conv1d_cuda_update.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.model_executor.layers.mamba.ops.causal_conv1d import PAD_SLOT_ID

from .conv_utils import (
    DTYPE_NAMES,
    assert_close,
    assert_no_nan,
    gen_for,
    make_bias,
    make_pool,
    make_weight,
    make_x,
    qsl_from_lens,
    randn,
)


@dataclass(frozen=True)
class FnCase:
    seqlens: tuple[int, ...]
    dim: int
    width: int
    dtype: torch.dtype
    state_dtype: torch.dtype | None = None  # None: same as x
    state_len: int | None = None  # None: width - 1
    pads: tuple[int, ...] = ()  # sequences whose cache index is PAD_SLOT_ID
    init: str | tuple[bool, ...] = "random"  # "random", "all", "none", "default" or flags
    default_indices: bool = False  # cache_indices=None (sequence b uses line b)
    noncontig: bool = False  # x is a slice of a wider projection
    bias: bool = True
    activation: str | None = "silu"
    extra_lines: int = 3  # lines of the pool no sequence uses

    @property
    def id(self) -> str:
        w1 = self.width - 1
        s = (
            f"B{len(self.seqlens)}_T{sum(self.seqlens)}_D{self.dim}_W{self.width}"
            f"_{DTYPE_NAMES[self.dtype]}"
        )
        if self.state_dtype not in (None, self.dtype):
            s += f"_state{DTYPE_NAMES[self.state_dtype]}"
        if self.state_len not in (None, w1):
            s += f"_sl{self.state_len}"
        if any(0 < n < w1 for n in self.seqlens):
            s += "_short"
        if 0 in self.seqlens:
            s += "_zerolen"
        if self.pads:
            s += "_pad"
        if isinstance(self.init, tuple):
            s += "_init" + "".join("1" if f else "0" for f in self.init)
        elif self.init != "random":
            s += f"_init{self.init}"
        if self.default_indices:
            s += "_noidx"
        if self.noncontig:
            s += "_nc"
        if not self.bias:
            s += "_nobias"
        if self.activation != "silu":
            s += f"_act{self.activation}"
        return s


@dataclass
class FnInputs:
    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    pool: torch.Tensor
    qsl: torch.Tensor
    indices: torch.Tensor | None
    init: torch.Tensor | None
    lines: list[int]  # cache line per sequence, PAD_SLOT_ID for pads


def build_fn_inputs(case: FnCase, device) -> FnInputs:
    g = gen_for(case.id)
    batch, num_tokens, w = len(case.seqlens), sum(case.seqlens), case.width
    x = make_x(case.dim, num_tokens, case.dtype, device, g, case.noncontig)
    weight = make_weight(case.dim, w, case.dtype, device, g)
    bias = make_bias(case.dim, case.dtype, device, g) if case.bias else None
    num_lines = batch + case.extra_lines
    pool = make_pool(
        num_lines, case.dim, case.state_len or w - 1, case.state_dtype or case.dtype, device, g
    )
    if case.default_indices:
        assert not case.pads
        lines, indices = list(range(batch)), None
    else:
        lines = torch.randperm(num_lines, generator=g)[:batch].tolist()
        for b in case.pads:
            lines[b] = PAD_SLOT_ID
        indices = torch.tensor(lines, dtype=torch.int32, device=device)
    if case.init == "default":
        init = None
    elif case.init == "all":
        init = torch.ones(batch, dtype=torch.bool)
    elif case.init == "none":
        init = torch.zeros(batch, dtype=torch.bool)
    elif case.init == "random":
        init = torch.rand(batch, generator=g) < 0.5
        if batch >= 2:
            init[0], init[-1] = True, False
    else:
        init = torch.tensor(case.init, dtype=torch.bool)
    if init is not None:
        init = init.to(device)
    return FnInputs(
        x, weight, bias, pool, qsl_from_lens(case.seqlens, device), indices, init, lines
    )


def check_fn_against_ref(
    case: FnCase, inp: FnInputs, out: torch.Tensor, pool_before, ref_out, ref_pool
):
    x, qsl = inp.x, inp.qsl.tolist()
    assert out.shape == x.shape and out.dtype == x.dtype
    assert out.stride(0) == 1, "out must be feature-contiguous"
    assert_no_nan(out)
    assert_close(out, ref_out)
    for b, line in enumerate(inp.lines):
        if line == PAD_SLOT_ID:
            seg = out[:, qsl[b] : qsl[b + 1]]
            assert torch.equal(seg, torch.zeros_like(seg)), f"pad row {b} not zero"
    assert torch.equal(inp.pool, ref_pool), "states differ from the reference"
    used = {line for line in inp.lines if line != PAD_SLOT_ID}
    for line in range(inp.pool.shape[0]):
        if line not in used:
            assert torch.equal(inp.pool[line], pool_before[line]), f"untouched line {line} changed"
    w1 = case.width - 1
    assert torch.equal(inp.pool[:, :, w1:], pool_before[:, :, w1:]), "columns past W-1 changed"


@dataclass(frozen=True)
class UpdCase:
    mode: str  # "tok": x (batch, dim); "multi": (batch, dim, seqlen); "varlen": (tokens, dim)
    seqlens: tuple[int, ...]  # tokens per sequence (all 1 for "tok", all equal for "multi")
    dim: int
    width: int
    dtype: torch.dtype
    state_dtype: torch.dtype | None = None
    state_len: int | None = None  # None: the least the case needs
    pads: tuple[int, ...] = ()  # rows whose index is PAD_SLOT_ID
    accepted: tuple[int, ...] | None = None  # num_accepted_tokens (speculative decoding)
    default_indices: bool = False
    noncontig: bool = False
    bias: bool = True
    activation: str | None = "silu"
    extra_lines: int = 3

    @property
    def need_state_len(self) -> int:
        w1 = self.width - 1
        if self.accepted is None:
            return w1
        return w1 + max(max(self.seqlens) - 1, max(self.accepted) - 1)

    @property
    def id(self) -> str:
        n = len(self.seqlens)
        if self.mode == "tok":
            s = f"tok_B{n}"
        elif self.mode == "multi":
            s = f"multi_B{n}_L{self.seqlens[0]}"
        else:
            s = f"varlen_B{n}_T{sum(self.seqlens)}"
        s += f"_D{self.dim}_W{self.width}_{DTYPE_NAMES[self.dtype]}"
        if self.state_dtype not in (None, self.dtype):
            s += f"_state{DTYPE_NAMES[self.state_dtype]}"
        if self.state_len not in (None, self.need_state_len):
            s += f"_sl{self.state_len}"
        if self.mode == "varlen" and 0 in self.seqlens:
            s += "_zerolen"
        if self.pads:
            s += "_pad"
        if self.accepted is not None:
            s += "_spec" + "".join(map(str, self.accepted))
        if self.default_indices:
            s += "_noidx"
        if self.noncontig:
            s += "_nc"
        if not self.bias:
            s += "_nobias"
        if self.activation != "silu":
            s += f"_act{self.activation}"
        return s


@dataclass
class UpdInputs:
    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    pool: torch.Tensor
    indices: torch.Tensor | None
    accepted: torch.Tensor | None
    qsl: torch.Tensor | None
    lines: list[int]


def make_update_x(mode, seqlens, dim, dtype, device, gen, noncontig=False) -> torch.Tensor:
    """x for causal_conv1d_update, feature-contiguous; ``noncontig``: a slice of a projection."""
    pad = 40 if noncontig else 0
    if mode == "tok":
        t = randn((len(seqlens), dim + pad), gen, dtype, device)
        return t[:, pad // 2 : pad // 2 + dim]
    if mode == "multi":
        t = randn((len(seqlens), seqlens[0], dim + pad), gen, dtype, device)
        return t[:, :, pad // 2 : pad // 2 + dim].transpose(1, 2)
    t = randn((sum(seqlens), dim + pad), gen, dtype, device)
    return t[:, pad // 2 : pad // 2 + dim]


def build_update_inputs(case: UpdCase, device) -> UpdInputs:
    g = gen_for(case.id)
    batch = len(case.seqlens)
    x = make_update_x(case.mode, case.seqlens, case.dim, case.dtype, device, g, case.noncontig)
    weight = make_weight(case.dim, case.width, case.dtype, device, g)
    bias = make_bias(case.dim, case.dtype, device, g) if case.bias else None
    num_lines = batch + case.extra_lines
    state_len = case.state_len or case.need_state_len
    pool = make_pool(num_lines, case.dim, state_len, case.state_dtype or case.dtype, device, g)
    if case.default_indices:
        lines, indices = list(range(batch)), None
    else:
        lines = torch.randperm(num_lines, generator=g)[:batch].tolist()
        for b in case.pads:
            lines[b] = PAD_SLOT_ID
        indices = torch.tensor(lines, dtype=torch.int32, device=device)
    accepted = None
    if case.accepted is not None:
        accepted = torch.tensor(case.accepted, dtype=torch.int32, device=device)
    qsl = qsl_from_lens(case.seqlens, device) if case.mode == "varlen" else None
    return UpdInputs(x, weight, bias, pool, indices, accepted, qsl, lines)
