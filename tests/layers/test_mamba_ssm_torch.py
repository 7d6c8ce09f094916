"""The PyTorch selective scan (chunked varlen + recurrent decode) vs the per-token reference."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from tests.models.mamba2_utils import FP16, FP32, assert_close, gen_for
from vllm.model_executor.layers.mamba.ops.causal_conv1d import PAD_SLOT_ID
from vllm.model_executor.layers.mamba.ops.mamba_ssm_ref import ssm_scan_ref
from vllm.model_executor.layers.mamba.ops.mamba_ssm_torch import (
    chunk_scan_varlen,
    plan_chunked_scan,
    selective_state_update_torch,
)

NAMES = {FP32: "fp32", FP16: "fp16"}


@dataclass(frozen=True)
class ScanCase:
    lens: tuple[int, ...]
    chunk: int
    groups: int = 1
    heads: int = 4
    dtype: torch.dtype = FP32
    limit: tuple[float, float] = (0.0, math.inf)

    @property
    def id(self) -> str:
        lim = "" if self.limit == (0.0, math.inf) else "_lim"
        lens = "-".join(map(str, self.lens))
        return f"L{lens}_C{self.chunk}_G{self.groups}_H{self.heads}_{NAMES[self.dtype]}{lim}"


SCAN_CASES = [
    ScanCase((5,), 8),
    ScanCase((8,), 8),
    ScanCase((17,), 4),
    ScanCase((7, 1, 16, 0, 9, 3), 4, groups=2),
    ScanCase((13, 2, 6), 16, groups=4, heads=8),
    ScanCase((11, 4), 4, dtype=FP16),
    ScanCase((12, 5), 4, limit=(0.05, 0.5)),
]

HEADDIM, DSTATE = 3, 5


def make_inputs(case: ScanCase, num_tokens: int, key):
    gen = gen_for(key)
    H, G = case.heads, case.groups

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(case.dtype)

    # x and dt as strided views into a wider projection, as the layer hands them over.
    proj = rnd(num_tokens, H * HEADDIM + H + 7)
    x = proj[:, : H * HEADDIM].unflatten(-1, (H, HEADDIM))
    dt = proj[:, H * HEADDIM : H * HEADDIM + H]
    return dict(
        x=x,
        dt=dt,
        A=-torch.empty(H).uniform_(0.5, 3.0, generator=gen),
        B=rnd(num_tokens, G, DSTATE),
        C=rnd(num_tokens, G, DSTATE),
        D=torch.randn(H, generator=gen),
        dt_bias=0.5 * torch.randn(H, generator=gen),
    )


@pytest.mark.parametrize("case", SCAN_CASES, ids=lambda c: c.id)
def test_chunk_scan_matches_reference(case: ScanCase):
    lens = torch.tensor(case.lens)
    n, T = len(case.lens), int(lens.sum())
    inp = make_inputs(case, T, case.id)
    gen = gen_for("state", case.id)
    pool = torch.randn(n + 2, case.heads, HEADDIM, DSTATE, generator=gen)
    slots = 1 + torch.randperm(n + 1, generator=gen)[:n]  # line 0 is the null line
    init = torch.rand(n, generator=gen) < 0.6
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    scan_args = dict(D=inp["D"], dt_bias=inp["dt_bias"], dt_softplus=True, dt_limit=case.limit)

    ref_pool = pool.clone()
    y_ref = ssm_scan_ref(
        inp["x"],
        inp["dt"],
        inp["A"],
        inp["B"],
        inp["C"],
        qsl,
        ref_pool,
        slots,
        init,
        **scan_args,
    )
    initial = torch.where(init[:, None, None, None], pool[slots], 0.0)
    y, final = chunk_scan_varlen(
        inp["x"],
        inp["dt"],
        inp["A"],
        inp["B"],
        inp["C"],
        plan_chunked_scan(lens, case.chunk),
        initial,
        **scan_args,
    )
    assert y.dtype == case.dtype and y.shape == inp["x"].shape
    assert_close(y, y_ref.to(case.dtype), "scan", case.dtype)
    assert_close(final, ref_pool[slots], "scan", FP32)


def test_chunk_size_does_not_change_the_result():
    case = ScanCase((23, 9, 1), 4, groups=2)
    lens = torch.tensor(case.lens)
    inp = make_inputs(case, int(lens.sum()), "chunk-invariance")
    initial = torch.randn(3, case.heads, HEADDIM, DSTATE, generator=gen_for("ci"))
    results = [
        chunk_scan_varlen(
            **inp, layout=plan_chunked_scan(lens, c), initial_states=initial, dt_softplus=True
        )
        for c in (1, 4, 16, 64)
    ]
    for y, final in results[1:]:
        assert_close(y, results[0][0], "scan")
        assert_close(final, results[0][1], "scan")


def test_chunk_scan_writes_given_out_and_keeps_initial_states():
    case = ScanCase((6, 3), 4)
    lens = torch.tensor(case.lens)
    inp = make_inputs(case, 9, "out")
    initial = torch.randn(2, case.heads, HEADDIM, DSTATE, generator=gen_for("init"))
    before = initial.clone()
    out = torch.full((9, case.heads, HEADDIM), float("nan"))
    y, _ = chunk_scan_varlen(
        **inp, layout=plan_chunked_scan(lens, 4), initial_states=initial, out=out
    )
    assert y is out and not torch.isnan(out).any()
    assert torch.equal(initial, before)


def test_plan_chunked_scan_layout():
    lens = torch.tensor([7, 0, 16, 1, 9])
    L = 4
    lay = plan_chunked_scan(lens, L)
    assert lay.num_chunks == sum(-(-n // L) for n in lens.tolist())
    # Every token sits in exactly one valid cell, and cells map back to their token.
    assert lay.grid_valid.sum() == lens.sum()
    assert torch.equal(lay.grid_token[lay.token_grid], torch.arange(int(lens.sum())))
    assert lay.grid_valid[lay.token_grid].all()
    # No chunk mixes sequences, and a chunk holds consecutive positions of its sequence.
    tok_seq = torch.repeat_interleave(torch.arange(5), lens)
    chunk_of_tok = lay.token_grid // L
    for k in range(lay.num_chunks):
        seqs = tok_seq[chunk_of_tok == k]
        assert seqs.numel() >= 1 and (seqs == seqs[0]).all()
    # Steps cover the chunks in order; active sequences shrink along the positions.
    firsts = [f for f, _ in lay.steps]
    counts = [c for _, c in lay.steps]
    assert firsts[0] == 0 and counts == sorted(counts, reverse=True)
    assert sum(counts) == lay.num_chunks
    assert lay.seq_order.tolist()[:1] == [2]  # the longest sequence first


def test_plan_rejects_bad_input():
    with pytest.raises(ValueError, match="non-negative"):
        plan_chunked_scan(torch.tensor([3, -1]), 4)
    with pytest.raises(ValueError, match="chunk_size"):
        plan_chunked_scan(torch.tensor([3]), 0)


@pytest.mark.parametrize("groups", [1, 2], ids=lambda g: f"G{g}")
def test_selective_state_update_matches_reference_with_pads(groups):
    heads, lines = 4, 6  # line 0 is the null line, lines 1..5 are slots
    case = ScanCase((1,) * 5, 1, groups=groups, heads=heads)
    inp = make_inputs(case, 5, f"update-{groups}")
    pool = torch.randn(lines, heads, HEADDIM, DSTATE, generator=gen_for("pool", groups))
    idx = torch.tensor([3, PAD_SLOT_ID, 2, PAD_SLOT_ID, 4], dtype=torch.int32)
    scan_args = dict(D=inp["D"], dt_bias=inp["dt_bias"], dt_softplus=True)

    ref_pool = pool.clone()
    y_ref = ssm_scan_ref(
        inp["x"],
        inp["dt"],
        inp["A"],
        inp["B"],
        inp["C"],
        torch.arange(6),
        ref_pool,
        idx,
        torch.ones(5, dtype=torch.bool),
        **scan_args,
    )
    work = pool.clone()
    y = selective_state_update_torch(
        work,
        inp["x"],
        inp["dt"],
        inp["A"],
        inp["B"],
        inp["C"],
        state_batch_indices=idx,
        **scan_args,
    )
    assert_close(y, y_ref, "scan")
    assert torch.equal(y[1], torch.zeros_like(y[1])) and torch.equal(y[3], torch.zeros_like(y[3]))
    assert_close(work[[3, 2, 4]], ref_pool[[3, 2, 4]], "scan")
    for untouched in (0, 1, 5):
        assert torch.equal(work[untouched], pool[untouched])


def test_selective_state_update_equals_one_token_chunk_scan():
    case = ScanCase((1, 1, 1), 1, groups=2)
    inp = make_inputs(case, 3, "decode-vs-chunk")
    pool = torch.randn(4, case.heads, HEADDIM, DSTATE, generator=gen_for("p"))
    work = pool.clone()
    y_dec = selective_state_update_torch(work, **inp, dt_softplus=True)
    y_chk, final = chunk_scan_varlen(
        **inp,
        layout=plan_chunked_scan(torch.tensor(case.lens), 8),
        initial_states=pool[:3],
        dt_softplus=True,
    )
    assert_close(y_dec, y_chk, "scan")
    assert_close(work[:3], final, "scan")


def test_scan_shape_errors():
    case = ScanCase((4,), 4)
    inp = make_inputs(case, 4, "errors")
    lay = plan_chunked_scan(torch.tensor([4]), 4)
    bad = dict(inp, dt=inp["dt"][:, :3])
    with pytest.raises(ValueError, match="dt must be"):
        chunk_scan_varlen(**bad, layout=lay)
    with pytest.raises(ValueError, match="tokens"):
        chunk_scan_varlen(**inp, layout=plan_chunked_scan(torch.tensor([5]), 4))
    with pytest.raises(ValueError, match="initial_states"):
        chunk_scan_varlen(**inp, layout=lay, initial_states=torch.zeros(2, 4, HEADDIM, DSTATE))
    with pytest.raises(ValueError, match="state must be"):
        selective_state_update_torch(torch.zeros(3, 4, HEADDIM, DSTATE + 1), **inp)
