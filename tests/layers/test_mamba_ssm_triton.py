"""The fused selective-state-update kernel vs the PyTorch path (``selective_state_update_torch``).

On CPU the kernel runs under the Triton interpreter (tests/conftest.py sets it), small fp32
and fp16 cases, the reference oracles, dispatch, argument errors and the op's opcheck. The
GPU-only cases (bf16, the Codestral-7B shape, CUDA graphs and int64 addressing) are in
test_mamba_ssm_triton_gpu.py; ``Case``, ``build`` and ``check_against_torch`` in
ssm_update_utils.py (inputs drawn on the CPU from a generator seeded by the case id, then
moved, so a case has the same data on both boxes).
"""

from __future__ import annotations

import pytest
import torch

from tests.layers.ssm_update_utils import Case, build, check_against_torch
from tests.models.mamba2_utils import FP16, assert_close
from vllm.model_executor.layers.mamba.ops.causal_conv1d_ref import NULL_BLOCK_ID, PAD_SLOT_ID
from vllm.model_executor.layers.mamba.ops.mamba_ssm_ref import ssm_scan_ref
from vllm.model_executor.layers.mamba.ops.mamba_ssm_torch import (
    selective_state_update,
    selective_state_update_torch,
)
from vllm.model_executor.layers.mamba.ops.mamba_ssm_triton import selective_state_update_triton

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
