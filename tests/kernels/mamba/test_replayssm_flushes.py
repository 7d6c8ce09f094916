"""The replayed decode kernel's launch configurations and flush variants (``flush`` "loop",
"tf32x3", "xsplit"; ``split_flush``; ``bc_pre``; ``fuse_flush``): each against the every-step
update, or against the loop's flush bit for bit or to rounding; xsplit's launches are
asserted to have taken it (below the dot tiles it falls back to the loop)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.mamba.replay_utils import (
    BF16,
    FP16,
    Case,
    draw,
    flush_run,
    indices,
    make_rs,
    params,
    rel,
    run_against_every_step,
    step_kw,
)
from vllm.model_executor.layers.mamba.ops import mamba_ssm_replay
from vllm.model_executor.layers.mamba.ops.mamba_ssm_replay import replay_ssm_update
from vllm.triton_utils.launch import launch_misses, precompile

# Launch configurations other than the default table's: several row blocks per head (with
# a tail), the state streamed in several dstate tiles (the last one partly masked), warps.
# The flush as one tl.dot ("tf32x3") where both tiles are >= 16; an 8-row tile with a dot
# flush falls back to the loop. A step split in two launches (split_flush: outputs and
# appends, then the full rings' flushes). bc_pre: the B_k . C products by a launch ahead.
CONFIGS = [
    dict(BLOCK_P=8, BLOCK_N=16, num_warps=1),
    dict(BLOCK_P=16, BLOCK_N=32, num_warps=2),
    dict(BLOCK_P=64, BLOCK_N=64, num_warps=4),
    dict(BLOCK_P=16, BLOCK_N=16, num_warps=1, flush="tf32x3"),
    dict(BLOCK_P=32, BLOCK_N=32, num_warps=2, flush="tf32x3"),
    dict(BLOCK_P=8, BLOCK_N=32, num_warps=1, flush="tf32x3"),
    dict(BLOCK_P=8, BLOCK_N=16, num_warps=1, split_flush=True),
    dict(BLOCK_P=16, BLOCK_N=32, num_warps=2, bc_pre=True, split_flush=True),
    dict(BLOCK_P=16, BLOCK_N=32, num_warps=2, flush="tf32x3", split_flush=True),
    dict(BLOCK_P=32, BLOCK_N=32, num_warps=2, flush="xsplit", bc_pre=True),
    dict(BLOCK_P=16, BLOCK_N=32, num_warps=2, flush="xsplit"),  # fp32 rings: as tf32x3
    dict(BLOCK_P=8, BLOCK_N=16, num_warps=1, bc_pre=True),
    dict(BLOCK_P=16, BLOCK_N=32, num_warps=2, flush="tf32x3", bc_pre=True, split_flush=True),
    dict(BLOCK_P=8, BLOCK_N=16, num_warps=1, fuse_flush=True),
    dict(BLOCK_P=16, BLOCK_N=16, num_warps=2, flush="tf32x3", fuse_flush=True, bc_pre=True),
    dict(BLOCK_P=16, BLOCK_N=32, num_warps=1, flush="xsplit", fuse_flush=True, split_flush=True),
]


def _cfg_id(c: dict) -> str:
    split = "_split" if c.get("split_flush") else ""
    split += "_bcpre" if c.get("bc_pre") else ""
    split += "_fused" if c.get("fuse_flush") else ""
    return "P{BLOCK_P}_N{BLOCK_N}_w{num_warps}".format(**c) + f"_{c.get('flush', 'loop')}{split}"


def test_flush_choice_is_checked_and_falls_back_below_dot_tiles():
    blocks = mamba_ssm_replay._blocks
    assert blocks(dict(BLOCK_P=32, BLOCK_N=32, flush="tf32x3"), 64, 128)["FLUSH_DOT"]
    assert not blocks(dict(BLOCK_P=8, BLOCK_N=32, flush="tf32x3"), 64, 128)["FLUSH_DOT"]
    assert not blocks(dict(BLOCK_P=32, BLOCK_N=32), 64, 128)["FLUSH_DOT"]
    xs = blocks(dict(BLOCK_P=32, BLOCK_N=32, flush="xsplit"), 64, 128)
    assert xs["FLUSH_DOT"] and xs["FLUSH_XSPLIT"]
    xs = blocks(dict(BLOCK_P=8, BLOCK_N=32, flush="xsplit"), 64, 128)  # below: the loop
    assert not xs["FLUSH_DOT"] and not xs["FLUSH_XSPLIT"]
    assert blocks(dict(BLOCK_P=8, split_flush=True), 64, 128)["SPLIT"]
    assert not blocks(dict(BLOCK_P=8), 64, 128)["SPLIT"]
    assert blocks(dict(BLOCK_P=8, bc_pre=True), 64, 128)["BC_PRE"]
    assert blocks(dict(BLOCK_P=8, fuse_flush=True), 64, 128)["FUSE_FLUSH"]
    assert not blocks(dict(BLOCK_P=8), 64, 128)["FUSE_FLUSH"]
    assert not blocks(dict(BLOCK_P=8), 64, 128)["BC_PRE"]
    with pytest.raises(ValueError, match="flush"):
        blocks(dict(BLOCK_P=32, flush="ieee"), 64, 128)
    with pytest.raises(ValueError, match="flush"):  # taken out: measured losers
        blocks(dict(BLOCK_P=32, flush="unroll"), 64, 128)


def test_precompile_records_bc_pre_of_another_bucket(device, monkeypatch):
    """A warm-up step whose bucket has no bc_pre still compiles the launch ahead when
    another bucket takes it (the engine's warm-up runs batches 1 and 2 only): a later
    step in that bucket misses no variant."""
    cfg = dict(BLOCK_P=8, BLOCK_N=16, num_warps=1)
    monkeypatch.setattr(mamba_ssm_replay, "launch_config",
                        lambda b, *a: dict(cfg, bc_pre=b > 8))  # fmt: skip
    case = Case(batch=12, heads=2, headdim=8, dstate=16, groups=1, L=4)
    gen = torch.Generator().manual_seed(3)
    rs = make_rs(case, case.batch + 3, device, gen)
    p = params(case, device, gen)
    idx = indices(case, case.batch + 3, device, gen)
    x, dt, B, C = draw(case, device, gen)
    with precompile():  # a 3-row step: bucket 8, no bc_pre
        replay_ssm_update(rs, x[:3], dt[:3], p["A"], B[:3], C[:3], **step_kw(p),
                          state_batch_indices=idx[:3])  # fmt: skip
    launched, real = [], mamba_ssm_replay._launch_bc
    monkeypatch.setattr(mamba_ssm_replay, "_launch_bc",
                        lambda *a: launched.append(1) or real(*a))  # fmt: skip
    misses = launch_misses()
    replay_ssm_update(rs, x, dt, p["A"], B, C, **step_kw(p), state_batch_indices=idx)
    assert launched, "the 12-row step (bucket 32) did not take bc_pre"
    assert launch_misses() == misses, "precompile missed bc_pre's launch ahead"


@pytest.mark.parametrize("split", [False, True], ids=["one-launch", "split"])
def test_precomputed_bc_over_a_longer_ring(device, monkeypatch, split):
    """bc_pre with 5 ring entries, through every count of entries twice: each step reads
    the launch ahead's products, each entry's at its own index (a shifted or stale product
    fails against the every-step update); also with the step split in two launches."""
    cfg = dict(BLOCK_P=8, BLOCK_N=16, num_warps=1, bc_pre=True, split_flush=split)
    monkeypatch.setattr(mamba_ssm_replay, "launch_config", lambda *a: dict(cfg))
    run_against_every_step(Case(batch=3, heads=2, headdim=8, dstate=16, groups=1, L=6), device)


def check_xsplit_flush(act: torch.dtype, device, monkeypatch) -> None:
    """The xsplit flush (three 16-bit tensor-core products: the weighted x split, the ring's
    B as stored) against the loop's fp32 FMAs: outputs and states to fp32 rounding, and
    the launches took it (dot tiles, a 16-bit ring)."""
    case = Case(batch=3, heads=4, headdim=32, dstate=32, groups=2, L=6, act=act)
    seen, real = [], mamba_ssm_replay._blocks
    monkeypatch.setattr(mamba_ssm_replay, "_blocks", lambda *a: seen.append(real(*a)) or seen[-1])
    (ya, sa, ca), (yb, sb, cb) = (
        flush_run(case, dict(BLOCK_P=16, BLOCK_N=16, num_warps=1, flush=f), device, monkeypatch)
        for f in ("loop", "xsplit")
    )
    assert any(b["FLUSH_XSPLIT"] and b["FLUSH_DOT"] for b in seen), "xsplit never launched"
    assert rel(yb, ya) < 1e-6 and rel(sb, sa) < 1e-6 and torch.equal(ca, cb)


def test_xsplit_flush_is_fp32_exact(device, monkeypatch):
    check_xsplit_flush(FP16, device, monkeypatch)


# bf16 on the GPU only: Triton 3.6's interpreter computes bf16 tl.dot wrongly.
@pytest.mark.gpu
def test_xsplit_flush_is_fp32_exact_bf16(monkeypatch):
    check_xsplit_flush(BF16, torch.device("cuda"), monkeypatch)


@pytest.mark.parametrize("cfg", CONFIGS, ids=_cfg_id)
def test_launch_configs_agree(cfg, device, monkeypatch):
    """Every tiling computes the same steps, flushes and materialisation."""
    monkeypatch.setattr(mamba_ssm_replay, "launch_config", lambda *a: dict(cfg))
    run_against_every_step(Case(batch=3, heads=4, headdim=20, dstate=40, groups=2, L=3), device)


@pytest.mark.parametrize("act", [torch.float32, FP16], ids=["fp32", "fp16"])
def test_precomputed_bc_equals_each_programs_own(act, device, monkeypatch):
    """bc_pre (the B_k . C products by a launch ahead, once per row and group) against each
    program's own products: outputs to fp32 rounding (the same sums over dstate, in
    another order), states and counters equal (a flush does not read them); padded rows
    included, and the launch ahead ran on every step."""
    case = Case(batch=3, heads=4, headdim=20, dstate=40, groups=2, L=5, act=act)
    launches, real = [], mamba_ssm_replay._launch_bc
    monkeypatch.setattr(
        mamba_ssm_replay, "_launch_bc", lambda *a: launches.append(a[3].shape) or real(*a)
    )
    (ya, sa, ca), (yb, sb, cb) = (
        flush_run(case, dict(BLOCK_P=8, BLOCK_N=16, num_warps=1, bc_pre=pre), device, monkeypatch)
        for pre in (False, True)
    )
    assert len(launches) == case.L + 2, "bc_pre's launch ahead did not run on every step"
    assert rel(yb, ya) < 1e-6 and torch.equal(sb, sa) and torch.equal(cb, ca)


@pytest.mark.parametrize("flush", ["loop", "tf32x3"])
def test_fused_flush_equals_two_passes(flush, device, monkeypatch):
    """fuse_flush (a flushing row folds each tile in the output pass, from the h0 it read)
    makes the two passes' computations: outputs, states and counters bit for bit, the
    materialisation (never fused) included; its launches took it."""
    case = Case(batch=3, heads=4, headdim=20, dstate=40, groups=2, L=5)
    seen, real = [], mamba_ssm_replay._blocks
    monkeypatch.setattr(mamba_ssm_replay, "_blocks", lambda *a: seen.append(real(*a)) or seen[-1])
    (ya, sa, ca), (yb, sb, cb) = (
        flush_run(
            case,
            dict(BLOCK_P=16, BLOCK_N=16, num_warps=1, flush=flush, fuse_flush=f),
            device,
            monkeypatch,
        )  # fmt: skip
        for f in (False, True)
    )
    assert any(b["FUSE_FLUSH"] for b in seen), "fuse_flush never launched"
    assert torch.equal(ya, yb) and torch.equal(sa, sb) and torch.equal(ca, cb)
