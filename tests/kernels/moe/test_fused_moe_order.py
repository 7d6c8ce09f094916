"""The fused-MoE GEMMs' grid order (``GROUP_SIZE_M``) and the unsorted path of tiny steps
(one block per pair, no alignment), the kernels under the interpreter on the CPU (fp32 and
fp16: the interpreter's bf16 dot is wrong): every output tile is computed once in every
order, every order and both paths give the same bits, and the fp32 reference's values; the
launch table selects each; precompile registers the unsorted variants."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.kernels.moe.moe_utils import TOLERANCES, distinct_ids, expert_weights, gen_for
from vllm.model_executor.layers.fused_moe import fused_moe as fm
from vllm.model_executor.layers.fused_moe.fused_moe_kernels import _block_of
from vllm.model_executor.layers.fused_moe.fused_moe_ref import fused_experts_ref
from vllm.triton_utils import tl, triton
from vllm.triton_utils.launch import launch_misses, precompile

FP32, FP16 = torch.float32, torch.float16
HIDDEN, INTER = 32, 24


@triton.jit
def _order_kernel(out_ptr, num_blocks, num_cols, GROUP_SIZE_M: tl.constexpr):
    i_m, i_n = _block_of(num_blocks, num_cols, GROUP_SIZE_M)
    tl.store(out_ptr + tl.program_id(0), i_m * num_cols + i_n)


@pytest.mark.parametrize("num_blocks, num_cols", [(1, 1), (7, 3), (24, 2), (5, 9)])
@pytest.mark.parametrize("group", [1, 2, 3, 1024])
def test_grid_order_visits_every_tile_once(num_blocks, num_cols, group, kernels):
    out = torch.full((num_blocks * num_cols,), -1, dtype=torch.int32, device=kernels)
    _order_kernel[(out.numel(),)](out, num_blocks, num_cols, GROUP_SIZE_M=group)
    cells = out.long().cpu()
    assert torch.equal(cells.sort().values, torch.arange(out.numel()))
    pid = torch.arange(out.numel())
    if group == 1:  # a row block's column blocks side by side (upstream's order)
        assert torch.equal(cells, pid)
    if group >= num_blocks:  # every row block at column block 0, then at 1, ...
        assert torch.equal(cells, pid % num_blocks * num_cols + pid // num_blocks)


def _inputs(tokens, top_k, experts, dtype, activation, device, distinct=True, hidden=HIDDEN,
            inter=INTER):  # fmt: skip
    gen = gen_for("fused-moe-order", tokens, top_k, experts, str(dtype), activation)
    gated = activation == "silu"
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13, w2 = expert_weights(experts, hidden, inter, dtype, gen, act_and_mul=gated)
    if distinct:
        ids = distinct_ids(tokens, top_k, experts, gen)
    else:  # repeated experts within and across tokens
        ids = torch.randint(0, experts, (tokens, top_k), generator=gen, dtype=torch.int32)
    weights = torch.rand(tokens, top_k, generator=gen)
    return [t.to(device) for t in (x, w13, w2, weights, ids)], gated


def _table(monkeypatch, **parts) -> None:
    """The op reads its table's entry with ``parts`` merged into its part dicts."""
    real = fm.launch_config

    def entry(*args):
        cfg = copy.deepcopy(real(*args))  # the real one is cached: never change it
        for part, given in parts.items():
            cfg[part] = {**cfg.get(part, {}), **given}
        return cfg

    monkeypatch.setattr(fm, "launch_config", entry)


def _run(inputs, activation, gated):
    return fm.fused_experts(*inputs, activation, gated)


@pytest.mark.parametrize("dtype, activation", [(FP32, "silu"), (FP16, "relu2"),
                                               (FP16, "silu"), (FP32, "relu2")])  # fmt: skip
def test_every_group_size_gives_the_same_bits(dtype, activation, kernels, monkeypatch,
                                              nan_poison):  # fmt: skip
    """64 tokens x top 4 over 8 experts at BLOCK_M 16: 24 row blocks, 2 column blocks in
    each GEMM (BLOCK_N 16); groups of 1, 2, 5 (a short last group) and the whole grid."""
    inputs, gated = _inputs(64, 4, 8, dtype, activation, kernels)
    ref = fused_experts_ref(*inputs, activation, gated)
    outs = []
    for group in (1, 2, 5, 1024):
        tile = {"BLOCK_N": 16, "GROUP_SIZE_M": group}
        with monkeypatch.context() as m:
            _table(m, gate_up=tile, down=tile)
            outs.append(_run(inputs, activation, gated))
    torch.testing.assert_close(outs[0].float(), ref.float(), **TOLERANCES[dtype])
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@pytest.mark.parametrize("dtype, activation, hidden, inter",
                         [(FP32, "silu", 32, 24), (FP16, "relu2", 32, 24),
                          (FP16, "silu", 40, 32), (FP32, "relu2", 40, 32)])  # fmt: skip
def test_masked_rows_give_the_same_bits(dtype, activation, hidden, inter, kernels, monkeypatch,
                                        nan_poison):  # fmt: skip
    """MASK_ROWS (padding rows load zeros) against rows read unmasked, at BLOCK_K 16: each
    K loop with and without a K mask (H 32 and I 32 divide by 16, H 40 and I 24 do not)."""
    inputs, gated = _inputs(17, 3, 8, dtype, activation, kernels, hidden=hidden, inter=inter)
    ref = fused_experts_ref(*inputs, activation, gated)
    outs = []
    for mask in (False, True):
        tile = {"BLOCK_K": 16, "MASK_ROWS": mask}
        with monkeypatch.context() as m:
            _table(m, gate_up=tile, down=tile)
            outs.append(_run(inputs, activation, gated))
    torch.testing.assert_close(outs[1].float(), ref.float(), **TOLERANCES[dtype])
    assert torch.equal(outs[0], outs[1])
    gate_up = fm._gemm_constexprs({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 16}, "up", 24, 32)
    down = fm._gemm_constexprs({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 16}, "down", 32, 24)
    assert gate_up["EVEN_K"] and gate_up["MASK_ROWS"]  # the default: on up to 64 rows
    assert not down["EVEN_K"] and not down["MASK_ROWS"]


UNSORTED_CASES = [  # tokens, top_k, experts, dtype, activation, max_unsorted_pairs
    (1, 2, 16, FP32, "relu2", None),  # the default rule: 2 pairs <= 16 // 4
    (1, 3, 16, FP16, "silu", None),
    (1, 1, 4, FP32, "silu", None),  # top_k 1: the down GEMM writes the output
    (5, 3, 8, FP16, "relu2", 15),  # experts repeated across (and within) tokens
    (4, 2, 6, FP32, "silu", 8),
]


@pytest.mark.parametrize("tokens, top_k, experts, dtype, activation, most", UNSORTED_CASES)
def test_unsorted_steps_skip_the_alignment(tokens, top_k, experts, dtype, activation, most,
                                           kernels, monkeypatch, nan_poison):  # fmt: skip
    inputs, gated = _inputs(tokens, top_k, experts, dtype, activation, kernels,
                            distinct=most is None)  # fmt: skip
    ref = fused_experts_ref(*inputs, activation, gated)
    sorted_path = fm.moe_align_block_size

    def no_alignment(*args):
        raise AssertionError("the alignment ran on an unsorted step")

    with monkeypatch.context() as m:
        if most is not None:
            _table(m, align={"max_unsorted_pairs": most})
        m.setattr(fm, "moe_align_block_size", no_alignment)
        out = _run(inputs, activation, gated)
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCES[dtype])
    calls = []
    with monkeypatch.context() as m:
        _table(m, align={"max_unsorted_pairs": 0})
        m.setattr(fm, "moe_align_block_size", lambda *a: calls.append(1) or sorted_path(*a))
        sorted_out = _run(inputs, activation, gated)
    assert calls and torch.equal(out, sorted_out)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a (1, k) view with stride 2, whose reshape(-1) is a strided view."""
    out = torch.stack([t, t], dim=-1)[..., 0]
    assert not out.is_contiguous() and out.reshape(-1).stride() == (2,)
    return out


def test_unsorted_needs_int32_contiguous_ids(kernels, monkeypatch):
    """int64 or strided ids take the sorted path (the compiled variants key on the ids'
    pointer), with the same result; strided one-token ids and weights are read right (the
    kernels read them flat with unit stride)."""
    inputs, gated = _inputs(1, 2, 16, FP32, "silu", kernels)
    x, w13, w2, weights, ids = inputs
    want = _run(inputs, "silu", gated)
    calls = []
    real = fm.moe_align_block_size
    monkeypatch.setattr(fm, "moe_align_block_size", lambda *a: calls.append(1) or real(*a))
    for other in (ids.long(), _strided(ids)):
        before = len(calls)
        assert torch.equal(fm.fused_experts(x, w13, w2, weights, other), want)
        assert len(calls) == before + 1
    assert torch.equal(fm.fused_experts(x, w13, w2, _strided(weights), ids), want)


def test_precompile_registers_the_unsorted_variants(kernels):
    """16 experts, top 2: 1 and 2 tokens are unsorted (at most 16 // 4 pairs), 3 are not.
    A one-token step in precompile() records the sorted path (the alignment kernels get
    registered) and both sides of the buckets that can be unsorted."""
    inputs, _ = _inputs(1, 2, 16, FP32, "silu", kernels)
    with precompile() as report:
        fm.fused_experts(*inputs)
    # BLOCK_M 16 up to 64 tokens, sorted and unsorted; 64 above (fp32 table), sorted.
    assert report.variants["moe_gate_up_kernel"] == 3
    assert report.variants["moe_down_kernel"] == 3
    assert report.variants["moe_align_kernel"] == 2
    assert report.variants["moe_align_count_kernel"] == 1
    assert report.variants["moe_align_place_kernel"] == 2
    before = launch_misses()
    for tokens in (1, 2, 3, 17, 64, 300, 600):
        step, _ = _inputs(tokens, 2, 16, FP32, "silu", kernels)
        fm.fused_experts(*step)
    assert launch_misses() == before
