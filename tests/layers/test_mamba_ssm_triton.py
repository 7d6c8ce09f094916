"""The fused selective-state-update kernel vs the PyTorch path (``selective_state_update_torch``).

On CPU the kernel runs under the Triton interpreter (tests/conftest.py sets it), small fp32
and fp16 cases; the ``gpu`` tests add bf16, the Codestral-7B shape, CUDA graphs and int64
addressing. Inputs are drawn on the CPU from a generator seeded by the case id, then moved,
so a case has the same data on both boxes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from tests.models.mamba2_utils import BF16, FP16, FP32, assert_close, gen_for
from vllm.model_executor.layers.mamba.ops.causal_conv1d_ref import NULL_BLOCK_ID, PAD_SLOT_ID
from vllm.model_executor.layers.mamba.ops.mamba_ssm_ref import ssm_scan_ref
from vllm.model_executor.layers.mamba.ops.mamba_ssm_torch import (
    selective_state_update,
    selective_state_update_torch,
)
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


CPU_CASES = [
    Case(1, indices=None),
    Case(1, heads=2, headdim=6, dstate=16, pads=1),
    Case(3, groups=2, pads=1, strided=True),
    Case(4, heads=6, headdim=5, dstate=24, groups=3, pads=2, indices=torch.int64),
    # headdim over one BLOCK_P with a tail: 80 = 64 + 16 rows at dstate 24, 12 = 8 + 4 at 200.
    Case(2, heads=2, headdim=80, dstate=24, groups=2, pads=1),
    Case(2, heads=2, headdim=12, dstate=200, limit=(0.05, 0.6), strided=True),
    Case(3, D=False, dt_bias=False, softplus=False),
    Case(3, heads=2, dt_bias=False, limit=(0.0, 0.5)),
    Case(3, heads=4, groups=4, dtype=FP16, pads=1),
    Case(3, dtype=FP16, state_dtype=FP16, pads=1, strided=True),
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.id)
def test_kernel_matches_torch(case: Case, device, nan_poison):
    check_against_torch(case, build(case, device))


def test_kernel_matches_per_token_reference(device):
    """Against the plain per-token reference too (an oracle independent of the torch path)."""
    case = Case(4, groups=2, pads=1)
    inp = build(case, device)
    kw = inp.kwargs
    ref_pool = inp.state.clone()
    y_ref = ssm_scan_ref(
        kw["x"],
        kw["dt"],
        kw["A"],
        kw["B"],
        kw["C"],
        torch.arange(case.batch + 1),
        ref_pool,
        kw["state_batch_indices"],
        torch.ones(case.batch, dtype=torch.bool),
        D=kw["D"],
        dt_bias=kw["dt_bias"],
        dt_softplus=True,
    )
    y = selective_state_update_triton(inp.state, **kw)
    assert_close(y, y_ref, "scan")
    live = [line for line in inp.lines if line != NULL_BLOCK_ID]
    assert_close(inp.state[live], ref_pool[live], "scan")


def test_repeated_steps_follow_the_reference(device):
    """Three decode steps in a row, the state carried in the pool between them."""
    case = Case(2, heads=2, groups=2)
    pool, ref_pool = None, None
    for step in range(3):
        inp = build(case, device, key=("steps", step))
        if pool is None:
            pool, ref_pool = inp.state, inp.state.clone()
        kw = dict(inp.kwargs, state_batch_indices=torch.tensor([4, 1], device=device))
        y = selective_state_update_triton(pool, **kw)
        y_ref = selective_state_update_torch(ref_pool, **kw)
        assert_close(y, y_ref, "scan", msg=f"step {step}")
    assert_close(pool, ref_pool, "scan")


def test_softplus_keeps_its_relative_accuracy(device):
    """From a zero state the new state is dt * x B^T, so kernel / torch = 1 up to dt's
    relative error: at dt = -30 and -12 softplus ~ exp(dt) (log(1 + exp(dt)) would be 100%
    and 2% off), -4.2 and -4.1 sit on either side of the kernel's switch to a series, and
    at 19 and 25 softplus is dt itself (past the threshold)."""
    case = Case(1, heads=6, D=False, dt_bias=False)
    inp = build(case, device)
    inp.state.zero_()
    dt = torch.tensor([[-30.0, -12.0, -4.2, -4.1, 19.0, 25.0]], device=device)
    kw = dict(inp.kwargs, dt=dt)
    ref_pool = inp.state.clone()
    selective_state_update_triton(inp.state, **kw)
    selective_state_update_torch(ref_pool, **kw)
    line = inp.lines[0]
    ratio = inp.state[line] / ref_pool[line]
    assert_close(ratio, torch.ones_like(ratio), "scan")


def test_pad_slot_id_matters_only_with_indices(device):
    """Without indices row b uses line b, even when b equals pad_slot_id (or is line 0,
    the default marker's)."""
    case = Case(3, indices=None)
    for marker in (1, NULL_BLOCK_ID):
        inp = build(case, device, key=marker)
        ref_pool = inp.state.clone()
        y = selective_state_update_triton(inp.state, **inp.kwargs, pad_slot_id=marker)
        y_ref = selective_state_update_torch(ref_pool, **inp.kwargs, pad_slot_id=marker)
        assert y[marker].abs().sum() > 0
        assert_close(y, y_ref, "scan")
        assert_close(inp.state, ref_pool, "scan")
    y = selective_state_update_triton(inp.state, **inp.kwargs)
    assert y[0].abs().sum() > 0


def test_empty_batch(device):
    case = Case(1)
    inp = build(case, device)
    batched = ("x", "dt", "B", "C", "state_batch_indices")
    kw = {k: (v[:0] if k in batched else v) for k, v in inp.kwargs.items()}
    before = inp.state.clone()
    y = selective_state_update_triton(inp.state, **kw)
    assert y.shape == (0, case.heads, case.headdim)
    assert torch.equal(inp.state, before)


def test_dispatch(device, monkeypatch):
    """selective_state_update runs the kernel on CUDA tensors, and on CPU ones only under the
    interpreter (the two paths agree on every line, so the test asks which one ran)."""
    from vllm.model_executor.layers.mamba.ops import mamba_ssm_torch

    ran = []
    for name in ("selective_state_update_triton", "selective_state_update_torch"):
        real = getattr(mamba_ssm_torch, name)
        monkeypatch.setattr(
            mamba_ssm_torch, name, lambda *a, _n=name, _f=real: ran.append(_n) or _f(*a)
        )
    inp = build(Case(2, pads=1), device)
    selective_state_update(inp.state, **inp.kwargs)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    selective_state_update(inp.state, **inp.kwargs)
    on_cpu = "selective_state_update_torch" if device.type == "cpu" else ran[0]
    assert ran == ["selective_state_update_triton", on_cpu]


def _errors_of(fn, state, **kwargs) -> str:
    with pytest.raises(ValueError) as err:
        fn(state, **kwargs)
    return str(err.value)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda kw, s: (dict(kw, dt=kw["dt"][:, :2]), s), "dt must be"),
        (lambda kw, s: (dict(kw, C=kw["C"][:, :, :3]), s), "B and C must be"),
        (lambda kw, s: (dict(kw, D=kw["D"][:2]), s), "D must be"),
        (lambda kw, s: (kw, s[:, :, :, :3]), "state must be"),
        (lambda kw, s: (dict(kw, out=kw["x"][:, :2].clone()), s), "out must be shaped like x"),
        (
            lambda kw, s: (dict(kw, state_batch_indices=kw["state_batch_indices"][:1]), s),
            "state_batch_indices must be",
        ),
        (lambda kw, s: (dict(kw, state_batch_indices=None), s[:1]), "without indices"),
    ],
    ids=["dt", "C", "D", "state", "out", "indices", "lines"],
)
def test_shape_errors_match_the_torch_path(change, match, device):
    inp = build(Case(2, groups=2), device)
    kwargs, state = change(inp.kwargs, inp.state)
    msg = _errors_of(selective_state_update_triton, state, **kwargs)
    assert match in msg
    assert msg == _errors_of(selective_state_update_torch, state, **kwargs)


def test_kernel_argument_errors(device, monkeypatch):
    inp = build(Case(2), device)
    kw = inp.kwargs
    with pytest.raises(ValueError, match="state_batch_indices must have dtype"):
        selective_state_update_triton(
            inp.state, **dict(kw, state_batch_indices=kw["state_batch_indices"].float())
        )
    with pytest.raises(ValueError, match="x must have dtype"):
        selective_state_update_triton(inp.state, **dict(kw, x=kw["x"].to(torch.int32)))
    with pytest.raises(ValueError, match="state must have dtype"):
        selective_state_update_triton(inp.state.double(), **kw)
    if device.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            selective_state_update_triton(inp.state, **kw)


def _op_args(case: Case, device):
    inp = build(case, device)
    kw = inp.kwargs
    out = torch.empty(kw["x"].shape, dtype=case.dtype, device=device)
    lo, hi = kw["dt_limit"]
    return (inp.state, kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], kw["D"], kw["dt_bias"],
            kw["dt_softplus"], lo, hi, kw["state_batch_indices"], PAD_SLOT_ID, out)  # fmt: skip


_CPU_KERNEL = pytest.param(
    "cpu",
    marks=pytest.mark.skipif(
        torch.cuda.is_available(),
        reason="CPU tensors run the kernel only under the Triton interpreter, which the "
        "tests turn on only on machines without a GPU",
    ),
)


@pytest.mark.parametrize("device_name", [_CPU_KERNEL, pytest.param("cuda", marks=pytest.mark.gpu)])
def test_opcheck(device_name):
    case = Case(2, heads=2, groups=2, pads=1, limit=(0.05, 0.6))
    torch.library.opcheck(
        torch.ops.vllm.selective_state_update.default, _op_args(case, torch.device(device_name))
    )


# --- GPU --------------------------------------------------------------------------------

CODESTRAL = dict(heads=128, headdim=64, dstate=128, groups=8)

GPU_CASES = [
    Case(1, **CODESTRAL, dtype=BF16, indices=None),
    Case(4, **CODESTRAL, dtype=BF16, pads=1, strided=True),
    Case(7, **CODESTRAL, dtype=BF16, state_dtype=BF16, pads=2),
    Case(16, **CODESTRAL, dtype=FP32, pads=3, indices=torch.int64),
    Case(5, heads=24, headdim=80, dstate=256, groups=3, dtype=BF16, pads=1, strided=True),
    Case(5, heads=8, headdim=48, dstate=64, dtype=FP16, limit=(0.0, 0.1)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_gpu_kernel_matches_torch(case: Case, nan_poison):
    check_against_torch(case, build(case, torch.device("cuda")), run=selective_state_update)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(20), ids=lambda s: f"seed{s}")
def test_gpu_random_cases(seed, nan_poison):
    g = gen_for("gpu-random", seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    groups = pick([1, 2, 4])
    batch = pick([1, 2, 3, 8, 33])
    case = Case(
        batch,
        heads=groups * pick([1, 3, 8]),
        headdim=pick([16, 50, 64, 96]),
        dstate=pick([16, 24, 64, 128, 200, 256]),
        groups=groups,
        dtype=pick([FP32, FP16, BF16]),
        state_dtype=pick([FP32, FP32, BF16]),
        pads=pick([0, batch // 2]),
        D=pick([True, False]),
        dt_bias=pick([True, False]),
        limit=pick([NO_LIMIT, (0.01, 0.3)]),
        strided=pick([True, False]),
    )
    check_against_torch(case, build(case, torch.device("cuda")), run=selective_state_update)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_cuda_graph_replay_equals_eager(dtype, nan_poison):
    """Capture one decode update, then replay it with new lines (pads included) and inputs."""
    case = Case(8, **CODESTRAL, dtype=dtype, pads=0)
    num_lines = case.num_lines
    device = torch.device("cuda")
    static = build(case, device, key="graph-static")
    pool = static.state
    kw = dict(static.kwargs, out=torch.empty(case.batch, 128, 64, dtype=dtype, device=device))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        selective_state_update(pool.clone(), **kw)  # compiles the kernel outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        selective_state_update(pool, **kw)

    g = gen_for("graph-replays", dtype)
    for replay, n_real in enumerate([8, 5, 1]):
        fresh = build(case, device, key=("graph-replay", replay))
        for name in ("x", "dt", "B", "C"):
            kw[name].copy_(fresh.kwargs[name])
        lines = 1 + torch.randperm(num_lines - 1, generator=g)[: case.batch]
        lines[n_real:] = NULL_BLOCK_ID
        kw["state_batch_indices"].copy_(lines)
        before, ref_pool = pool.clone(), pool.clone()
        y_ref = selective_state_update_torch(ref_pool, **dict(kw, out=None))
        kw["out"].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not torch.isnan(kw["out"]).any()
        assert_close(kw["out"], y_ref, "scan", dtype, msg=f"replay {replay}")
        assert not kw["out"][n_real:].any()
        live = lines[:n_real].tolist()
        assert_close(pool[live], ref_pool[live], "scan")
        for line in sorted(set(range(num_lines)) - set(live)):
            assert torch.equal(pool[line], before[line]), f"replay {replay}: line {line}"


@pytest.mark.gpu_big_memory
@pytest.mark.gpu
def test_int64_line_offsets():
    """A pool past 2**31 elements: the last lines are addressed without overflow."""
    heads, headdim, dstate = 8, 64, 128  # 65536 elements per line
    num_lines = 2**31 // (heads * headdim * dstate) + 4  # 4 GiB in bf16
    device = torch.device("cuda")
    pool = torch.zeros(num_lines, heads, headdim, dstate, dtype=BF16, device=device)
    case = Case(3, heads=heads, headdim=headdim, dstate=dstate, dtype=BF16, state_dtype=BF16)
    small = build(case, device, key="int64")
    targets = [num_lines - 2, num_lines - 4, 1]
    pool[targets] = small.state[:3]
    kw = dict(small.kwargs, state_batch_indices=torch.tensor(targets, device=device))
    y = selective_state_update(pool, **kw)
    ref = small.state[:3].clone()
    y_ref = selective_state_update_torch(ref, **dict(kw, state_batch_indices=None))
    assert_close(y, y_ref, "scan", BF16)
    assert_close(pool[targets], ref, "scan", BF16)
    assert not pool[num_lines - 1].any() and not pool[num_lines - 3].any()
