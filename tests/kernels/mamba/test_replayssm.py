"""The replayed decode update (``ops/mamba_ssm_replay``) against the every-step update.

Over 2L+2 steps of fresh inputs (so the flush boundaries L-1, L, L+1 and a second flush are
crossed) every output equals the every-step PyTorch update's on an fp32 copy of the state,
and the state after ``replay_ssm_materialise`` equals its state; the counters are read
back after every step. The kernel (interpreter on CPU, CUDA on the GPU box) also matches
the fp32 reference op for op: rings and counters exactly, states and outputs to rounding.
Padded rows leave every line alone; materialising a fresh line only empties its ring.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernels.mamba.replay_utils import (
    CASES,
    CUDA_CASES,
    Case,
    draw,
    indices,
    make_rs,
    params,
    run_against_every_step,
    seed,
    step_kw,
)
from vllm.model_executor.layers.mamba.ops.causal_conv1d_ref import NULL_BLOCK_ID, PAD_SLOT_ID
from vllm.model_executor.layers.mamba.ops.mamba_ssm_replay import (
    ReplayedSSMState,
    _replay_ssm_op,
    replay_ssm_materialise,
    replay_ssm_update,
)
from vllm.model_executor.layers.mamba.ops.mamba_ssm_replay_ref import (
    replay_materialise_ref,
    replay_update_ref,
)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_replayed_equals_every_step(case, device, nan_poison):
    run_against_every_step(case, device)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CUDA_CASES, ids=lambda c: c.id)
def test_replayed_equals_every_step_cuda(case):
    run_against_every_step(case, torch.device("cuda"))


@pytest.mark.parametrize("marker", [PAD_SLOT_ID, NULL_BLOCK_ID], ids=["pad-1", "null0"])
@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: c.id)
def test_kernel_matches_reference(case, marker, device):
    """Kernel vs ``replay_update_ref``: rings and counters equal, outputs and states to
    rounding (the reference forms every row's state; the kernel only the flushing ones).
    Padded rows (the engine's null line 0, or -1) write no line in either: every line of the
    pool is compared, the last one too (real rows may own it)."""
    gen = torch.Generator().manual_seed(1 + seed(case))
    lines = case.batch + 3
    rs = make_rs(case, lines, device, gen)
    twin = ReplayedSSMState(*(t.clone() for t in rs.tensors()))
    before = ReplayedSSMState(*(t.clone() for t in rs.tensors()))
    p = params(case, device, gen)
    idx = indices(case, lines, device, gen, marker)
    real_lines = idx[idx != marker].long()
    for step in range(case.L + 1):
        x, dt, B, C = draw(case, device, gen)
        y = replay_ssm_update(rs, x, dt, p["A"], B, C, **step_kw(p), state_batch_indices=idx,
                              pad_slot_id=marker)  # fmt: skip
        y_ref = torch.empty_like(y)
        replay_update_ref(twin, x, dt, p["A"], B, C, p["D"], p["dt_bias"], True, case.limit,
                          idx, marker, y_ref)  # fmt: skip
        torch.testing.assert_close(y, y_ref, atol=2e-5, rtol=2e-5, msg=f"step {step}")
        for name in ("ring_x", "ring_B", "count"):
            got, want = getattr(rs, name), getattr(twin, name)
            assert torch.equal(got, want), f"step {step}: {name}"
        torch.testing.assert_close(rs.ring_dt, twin.ring_dt)
        torch.testing.assert_close(rs.state, twin.state)
    untouched = torch.ones(lines, dtype=torch.bool, device=device)
    untouched[real_lines] = False
    for got, was in zip(twin.tensors(), before.tensors(), strict=True):
        assert torch.equal(got[untouched], was[untouched]), "the reference wrote a line no row owns"
    # The step's own indices materialised, its padded entries (a CUDA graph's padded
    # prefills) among them: those are skipped by both, the real lines folded and reset.
    replay_ssm_materialise(rs, p["A"], idx, pad_slot_id=marker)
    replay_materialise_ref(twin, p["A"], idx, None, marker)
    torch.testing.assert_close(rs.state[real_lines], twin.state[real_lines])
    assert not rs.count[real_lines].any() and not twin.count[real_lines].any()
    for t in (rs, twin):
        for got, was in zip(t.tensors(), before.tensors(), strict=True):
            assert torch.equal(got[untouched], was[untouched]), "a padded entry was written"


def test_checks_name_the_argument(device):
    case = Case()
    gen = torch.Generator().manual_seed(0)
    rs = make_rs(case, 6, device, gen)
    p = params(case, device, gen)
    x, dt, B, C = draw(case, device, gen)
    idx = torch.arange(case.batch, dtype=torch.int32, device=device)
    bad = ReplayedSSMState(rs.state, rs.ring_x, rs.ring_B, rs.ring_dt, rs.count.int())
    with pytest.raises(ValueError, match="count"):
        replay_ssm_update(bad, x, dt, p["A"], B, C, state_batch_indices=idx)
    short = ReplayedSSMState(rs.state, rs.ring_x[:, :, :1], rs.ring_B, rs.ring_dt, rs.count)
    with pytest.raises(ValueError, match="ring_B"):
        replay_ssm_update(short, x, dt, p["A"], B, C, state_batch_indices=idx)
    with pytest.raises(ValueError, match="A must be"):
        replay_ssm_materialise(rs, p["A"][:2], idx)


def test_opcheck(device):
    case = Case()
    gen = torch.Generator().manual_seed(3)
    rs = make_rs(case, 6, device, gen)
    p = params(case, device, gen)
    x, dt, B, C = draw(case, device, gen)
    idx = torch.tensor([4, PAD_SLOT_ID, 1], dtype=torch.int32, device=device)
    out = torch.empty_like(x)
    step = (*rs.tensors(), x, dt, p["A"], B, C, p["D"], p["dt_bias"], True, 0.0, math.inf,
            idx, None, PAD_SLOT_ID, out)  # fmt: skip
    materialise = (*rs.tensors(), None, None, p["A"], None, None, None, None, False, 0.0,
                   math.inf, idx[[0, 2]], torch.tensor([True, False], device=device),
                   PAD_SLOT_ID, None)  # fmt: skip
    for args in (step, materialise):
        torch.library.opcheck(_replay_ssm_op, args, test_utils=("test_schema", "test_faketensor"))
