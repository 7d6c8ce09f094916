"""The Triton SSD's argument checks (a ValueError that names the argument), its dispatch rule,
and its torch.library registration (opcheck)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.mamba.ssd_utils import Case, build, run_ssd
from vllm.model_executor.layers.mamba.ops import NULL_BLOCK_ID
from vllm.model_executor.layers.mamba.ops.ssd_combined import (
    mamba_chunk_scan_combined_varlen,
    plan_ssd_chunks,
    use_ssd_kernel,
)
from vllm.model_executor.layers.mamba.ops.ssd_launch import PLANS

CASE = Case((6, 3), groups=2)


def _call(device, **changes):
    inp = build(CASE, device)
    layout = changes.pop("layout", plan_ssd_chunks(inp.qsl, CASE.chunk).to(device))
    kw = dict(inp.kwargs, ssm_states=inp.pool, layout=layout)
    kw.update(changes)
    return mamba_chunk_scan_combined_varlen(**kw)


@pytest.mark.parametrize(
    "changes,match",
    [
        (lambda kw: dict(dt=kw["dt"][:, :3]), "dt must be"),
        (lambda kw: dict(C=kw["C"][:, :, :5]), "B and C must be"),
        (lambda kw: dict(B=kw["B"].double()), "B must have dtype"),
        (lambda kw: dict(B=kw["B"].half()), "B and C must have x's dtype"),
        (lambda kw: dict(D=kw["D"][:2]), "D must be"),
        (lambda kw: dict(dt_bias=kw["dt_bias"][:1]), "dt_bias must be"),
        (lambda kw: dict(x=kw["x"].to(torch.int32)), "x must have dtype"),
        (lambda kw: dict(ssm_states=kw["pool"][..., :4]), "ssm_states must be"),
        (lambda kw: dict(ssm_states=kw["pool"].double()), "ssm_states must have dtype"),
        (lambda kw: dict(out=kw["x"][:, :2].clone()), "out must be shaped like x"),
        (lambda kw: dict(state_indices=kw["state_indices"][:1]), "state_indices must be"),
        (lambda kw: dict(state_indices=kw["state_indices"].float()), "state_indices must have"),
        (
            lambda kw: dict(has_initial_state=kw["has_initial_state"].int()),
            "has_initial_state must have dtype",
        ),
        (
            lambda kw: dict(has_initial_state=kw["has_initial_state"][:1]),
            "has_initial_state must be",
        ),
        (lambda kw: dict(layout="chunks"), "layout must be an SSDChunkLayout"),
        (
            lambda kw: dict(layout=plan_ssd_chunks(torch.tensor([0, 40], dtype=torch.int32), 8)),
            "layout covers token rows up to 40",
        ),
    ],
    ids=[
        "dt", "C", "B_double", "B_dtype", "D", "dt_bias", "x_int", "states_shape",
        "states_dtype", "out", "indices_shape", "indices_dtype", "init_dtype", "init_shape",
        "layout_type", "layout_rows",
    ],
)  # fmt: skip
def test_bad_arguments_raise_value_error(changes, match, device):
    inp = build(CASE, device)
    kw = dict(inp.kwargs, pool=inp.pool)
    change = changes(kw)
    if "layout" in change and not isinstance(change["layout"], str):
        change["layout"] = change["layout"].to(device)
    with pytest.raises(ValueError, match=match):
        _call(device, **change)


@pytest.mark.gpu
def test_layout_on_another_device_is_an_error():
    device = torch.device("cuda")  # CUDA data, a layout left on the CPU
    inp = build(CASE, device)
    with pytest.raises(ValueError, match=r"layout.chunk_starts is on cpu.*layout.to\(device\)"):
        _call(device, layout=plan_ssd_chunks(inp.qsl, CASE.chunk))


def test_layout_counts_must_match_the_indices(device):
    layout = plan_ssd_chunks(torch.tensor([3, 9, 12, 12], dtype=torch.int32), 8).to(device)
    with pytest.raises(ValueError, match=r"state_indices must be \(num_seqs=3,\)"):
        _call(device, layout=layout)


def test_dispatch(device, monkeypatch):
    """CUDA tensors run the kernels; CPU tensors only under the interpreter, otherwise the
    call says where the CPU path is."""
    x = torch.empty(1, device=device)
    assert use_ssd_kernel(x)
    if device.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert not use_ssd_kernel(x)
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1.*chunk_scan_varlen"):
            _call(device)


def _op_args(case: Case, device):
    inp = build(case, device)
    kw = inp.kwargs
    lay = plan_ssd_chunks(inp.qsl, case.chunk).to(device)
    lo, hi = kw["dt_limit"]
    return (kw["x"], None, kw["dt"], kw["A"], kw["B"], kw["C"], lay.chunk_starts,
            lay.chunk_seqs, lay.seq_chunk_starts, lay.chunk_size, inp.pool,
            kw["state_indices"], kw["has_initial_state"], None, kw["D"], kw["dt_bias"],
            kw["dt_softplus"], lo, hi, kw["out"], NULL_BLOCK_ID)  # fmt: skip


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
    case = Case((5, 0, 9), pads=1, limit=(0.05, 0.6))
    torch.library.opcheck(
        torch.ops.vllm.mamba_chunk_scan_combined_varlen.default,
        _op_args(case, torch.device(device_name)),
    )


def test_op_writes_what_the_function_writes(device):
    """The registered op and the Python entry point are the same launch."""
    inp = build(CASE, device)
    y = run_ssd(CASE, inp, device)
    args = _op_args(CASE, device)
    torch.ops.vllm.mamba_chunk_scan_combined_varlen(*args)
    pool, out = args[10], args[19]
    assert torch.equal(out[3:12], y[3:12]) and torch.equal(pool, inp.pool)


def test_a_plan_serves_its_layout_and_leaves_bad_counts_to_the_checks(device):
    """Calls with one argument layout share one plan (made after the full checks); a call
    whose counts do not fit it gets the full checks' error, and the plan still serves."""
    PLANS.clear()
    _call(device)
    y = _call(device)
    assert len(PLANS) == 1
    bad = plan_ssd_chunks(torch.tensor([3, 9, 12, 12], dtype=torch.int32), 8).to(device)
    with pytest.raises(ValueError, match=r"state_indices must be \(num_seqs=3,\)"):
        _call(device, layout=bad)
    inp = build(CASE, device)
    with pytest.raises(ValueError, match="dt must be"):
        _call(device, dt=inp.kwargs["dt"][1:])
    with pytest.raises(ValueError, match="has_initial_state must be"):
        _call(device, has_initial_state=inp.kwargs["has_initial_state"][:1])
    assert len(PLANS) == 1
    assert torch.equal(_call(device)[3:12], y[3:12])
    # another layout of the same tensors (out=None: allocated) is another plan
    assert torch.equal(_call(device, out=None)[3:12], y[3:12])
    assert len(PLANS) == 2
