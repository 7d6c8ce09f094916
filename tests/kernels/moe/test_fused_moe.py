"""The fused-MoE kernels (the interpreter on CPU) against the fp32 per-expert reference:
tokens 1, 3, 17, 64, top-k 1/2/8, 4 to 16 experts, fp32 and fp16 (the interpreter's bf16
dot is wrong), gated SiLU and ungated relu^2 experts; and the op's argument errors."""

from __future__ import annotations

import json

import pytest
import torch

from tests.kernels.moe.moe_utils import TOLERANCES, distinct_ids, expert_weights, gen_for
from vllm.model_executor.layers.fused_moe import fused_moe as fused_moe_module
from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts, fused_moe
from vllm.model_executor.layers.fused_moe.fused_moe_ref import fused_experts_ref
from vllm.model_executor.layers.fused_moe.router import select_experts
from vllm.triton_utils.launch import launch_misses, precompile

FP32, FP16 = torch.float32, torch.float16
HIDDEN, INTER = 32, 24  # INTER is no power of two: the column tiles are masked

CASES = [  # tokens, top_k, experts, dtype, activation
    (1, 1, 4, FP32, "silu"),
    (1, 8, 12, FP16, "silu"),
    (3, 2, 8, FP32, "relu2"),
    (3, 8, 8, FP16, "silu"),
    (17, 2, 5, FP16, "relu2"),
    (17, 8, 16, FP32, "silu"),
    (64, 1, 16, FP16, "silu"),
    (64, 2, 6, FP32, "silu"),
    (64, 8, 16, FP16, "relu2"),
]


def _inputs(tokens, top_k, experts, dtype, activation, device):
    gen = gen_for("fused-moe", tokens, top_k, experts, str(dtype), activation)
    gated = activation == "silu"
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    w13, w2 = expert_weights(experts, HIDDEN, INTER, dtype, gen, act_and_mul=gated)
    ids = distinct_ids(tokens, top_k, experts, gen)
    weights = torch.rand(tokens, top_k, generator=gen)
    return [t.to(device) for t in (x, w13, w2, weights, ids)], gated


@pytest.fixture
def kernels_only(monkeypatch, device):
    """The op must take the kernel path: its reference fallback raises."""
    if device.type == "cpu" and not fused_moe_module.use_moe_kernel(torch.empty(1)):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1 set before the kernels were imported")

    def no_fallback(*args):
        raise AssertionError("the fp32 reference ran instead of the kernels")

    monkeypatch.setattr(fused_moe_module, "fused_experts_ref", no_fallback)


@pytest.mark.parametrize("tokens, top_k, experts, dtype, activation", CASES)
def test_kernels_match_reference(tokens, top_k, experts, dtype, activation, device, kernels_only):
    (x, w13, w2, weights, ids), gated = _inputs(tokens, top_k, experts, dtype, activation, device)
    out = fused_experts(x, w13, w2, weights, ids, activation, gated)
    ref = fused_experts_ref(x, w13, w2, weights, ids, activation, gated)
    assert out.dtype == dtype and out.shape == (tokens, HIDDEN)
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCES[dtype])


def test_strided_input_and_routed_op(device, kernels_only):
    """x a column slice (row stride > H), int64 ids, routing from logits."""
    (x, w13, w2, _, _), gated = _inputs(17, 2, 8, FP32, "silu", device)
    wide = torch.zeros(17, 2 * HIDDEN, device=device)
    wide[:, 5 : 5 + HIDDEN] = x
    x = wide[:, 5 : 5 + HIDDEN]
    logits = torch.randn(17, 8, generator=gen_for("logits")).to(device)
    out = fused_moe(x, w13, w2, logits, 2, renormalize=True)
    weights, ids = select_experts(logits, 2, renormalize=True)
    ref = fused_experts_ref(x, w13, w2, weights, ids.long())
    torch.testing.assert_close(out, ref, **TOLERANCES[FP32])
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids.long()), ref)


def test_no_tokens(device, kernels_only):
    (x, w13, w2, weights, ids), _ = _inputs(3, 2, 4, FP32, "silu", device)
    out = fused_experts(x[:0], w13, w2, weights[:0], ids[:0])
    assert out.shape == (0, HIDDEN)


def test_reference_is_the_fallback_without_the_kernels(monkeypatch):
    (x, w13, w2, weights, ids), _ = _inputs(3, 2, 4, FP32, "silu", torch.device("cpu"))
    monkeypatch.setattr(fused_moe_module, "use_moe_kernel", lambda x: False)
    ref = fused_experts_ref(x, w13, w2, weights, ids)
    assert torch.equal(fused_experts(x, w13, w2, weights, ids), ref)


def test_precompile_registers_every_bucket_variant(device, kernels_only):
    (x, w13, w2, weights, ids), _ = _inputs(3, 2, 4, FP32, "silu", device)
    with precompile() as report:
        fused_experts(x, w13, w2, weights, ids)
    # fp32: BLOCK_M 16 up to 64 tokens, 64 above (the dtype=float32 entries), at these tiny
    # N/K tiles: 2 variants per GEMM and of the alignment.
    assert report.variants["moe_gate_up_kernel"] == 2
    assert report.variants["moe_down_kernel"] == 2
    assert report.variants["moe_sum_kernel"] == 1
    assert report.variants["moe_align_kernel"] == 2
    # The chunked alignment of larger steps: its count kernel has no BLOCK_M.
    assert report.variants["moe_align_count_kernel"] == 1
    assert report.variants["moe_align_place_kernel"] == 2
    # Every later step size selects a variant compiled above (decode to a prefill aligned
    # in chunks): no launch misses.
    before = launch_misses()
    for tokens in (1, 17, 64, 300, 600):
        (x, w13, w2, weights, ids), _ = _inputs(tokens, 2, 4, FP32, "silu", device)
        fused_experts(x, w13, w2, weights, ids)
    assert launch_misses() == before


def test_reference_hand_checked():
    # One token, two experts of H = I = 1: x = 2, expert e computes w2 * silu(g x) * (u x).
    x = torch.tensor([[2.0]])
    w13 = torch.tensor([[[1.0], [3.0]], [[0.5], [-1.0]]])  # (E=2, 2I=2, H=1)
    w2 = torch.tensor([[[2.0]], [[4.0]]])
    weights, ids = torch.tensor([[0.25, 0.75]]), torch.tensor([[1, 0]])
    silu = torch.nn.functional.silu
    e0 = 2.0 * silu(torch.tensor(2.0)) * 6.0
    e1 = 4.0 * silu(torch.tensor(1.0)) * -2.0
    expected = 0.75 * e0 + 0.25 * e1
    torch.testing.assert_close(fused_experts_ref(x, w13, w2, weights, ids), expected.view(1, 1))


def _bad(name):
    (x, w13, w2, weights, ids), _ = _inputs(3, 2, 4, FP32, "silu", torch.device("cpu"))
    args = dict(x=x, w13=w13, w2=w2, topk_weights=weights, topk_ids=ids)
    args[name] = {
        "x": x[None],
        "w13": w13[:, :INTER],
        "w2": w2.half(),
        "topk_weights": weights[:, :1],
        "topk_ids": ids.float(),
    }[name]
    return args


@pytest.mark.parametrize("name", ["x", "w13", "w2", "topk_weights", "topk_ids"])
def test_errors_name_the_argument(name):
    with pytest.raises(ValueError, match=name):
        fused_experts(**_bad(name))


def test_other_errors():
    (x, w13, w2, weights, ids), _ = _inputs(3, 2, 4, FP32, "silu", torch.device("cpu"))
    with pytest.raises(ValueError, match="activation"):
        fused_experts(x, w13, w2, weights, ids, activation="gelu")
    with pytest.raises(ValueError, match="w13"):
        fused_experts(x, w13, w2, weights, ids, is_act_and_mul=False)
    with pytest.raises(ValueError, match="x has hidden size 31"):
        fused_experts(x[:, :31], w13, w2, weights, ids)
    with pytest.raises(ValueError, match="router_logits"):
        fused_moe(x, w13, w2, torch.zeros(4, 4), 2)


@pytest.mark.parametrize("hidden, inter, dtype", [(40, 48, FP32), (80, 40, FP16)])
def test_uneven_k_and_partial_column_tiles(hidden, inter, dtype, device, kernels_only):
    """H and I no multiple of the tiles: the K loop's masked path (EVEN_K False, both GEMMs)
    and weight rows clamped past the last column; gated and ungated."""
    gen = gen_for("fused-moe-uneven", hidden, inter, str(dtype))
    x = torch.randn(17, hidden, generator=gen).to(dtype).to(device)
    ids = distinct_ids(17, 3, 6, gen).to(device)
    weights = torch.rand(17, 3, generator=gen).to(device)
    for activation, gated in (("silu", True), ("relu2", False)):
        w13, w2 = expert_weights(6, hidden, inter, dtype, gen, act_and_mul=gated)
        w13, w2 = w13.to(device), w2.to(device)
        out = fused_experts(x, w13, w2, weights, ids, activation, gated)
        ref = fused_experts_ref(x, w13, w2, weights, ids, activation, gated)
        torch.testing.assert_close(out.float(), ref.float(), **TOLERANCES[dtype])


def test_unmasked_k_loop_equals_the_masked_one(device, kernels_only, monkeypatch):
    """Where BLOCK_K divides K the loop loads without masks (padding rows read row 0, tail
    columns the last weight row): bit for bit what the masked loop gives."""
    (x, w13, w2, weights, ids), gated = _inputs(17, 8, 16, FP32, "silu", device)
    even = fused_experts(x, w13, w2, weights, ids)
    real = fused_moe_module._gemm_constexprs
    assert real({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64}, "gate_up", INTER, HIDDEN)["EVEN_K"]
    monkeypatch.setattr(fused_moe_module, "_gemm_constexprs",
                        lambda *a: dict(real(*a), EVEN_K=False))  # fmt: skip
    assert torch.equal(fused_experts(x, w13, w2, weights, ids), even)


@pytest.mark.parametrize(
    "entry, field",
    [
        ({"BLOCK_M": 16, "BLOCK_N": 48, "BLOCK_K": 32}, "BLOCK_N"),
        ({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "down": {"BLOCK_K": 24}}, "down.BLOCK_K"),
        ({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 6}, "num_warps"),
        ({"BLOCK_M": "16", "BLOCK_N": 32, "BLOCK_K": 32}, "BLOCK_M"),
    ],
)
def test_a_launch_table_entry_triton_cannot_take_is_named(entry, field, tmp_path, monkeypatch):
    """A hand-edited table with a tile or warp count that is not a power of two: a
    ValueError naming the shape and the field, not Triton's compile error."""
    (tmp_path / "default.json").write_text(json.dumps({"entries": {"*": entry}}))
    monkeypatch.setattr(fused_moe_module, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # default.json only
    fused_moe_module._config.cache_clear()
    try:
        with pytest.raises(ValueError, match=rf"tokens=16: {field} must be a power of two"):
            fused_moe_module.launch_config(3, 8, 32, 24, torch.float32)
    finally:
        fused_moe_module._config.cache_clear()
