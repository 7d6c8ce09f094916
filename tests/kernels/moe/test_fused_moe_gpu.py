"""The fused-MoE op on the GPU: bf16/fp16/fp32 against the fp32 reference at layer-like
shapes (the unsorted path at one token over 64 experts), no host sync on the whole path
(router, alignment, kernels), and a CUDA-graph capture replayed with new inputs; the
alignment's kernels against its torch ops."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.moe.moe_utils import TOLERANCES, distinct_ids, expert_weights, gen_for
from vllm.model_executor.layers.fused_moe import moe_align
from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts, fused_moe
from vllm.model_executor.layers.fused_moe.fused_moe_ref import fused_experts_ref
from vllm.model_executor.layers.fused_moe.moe_align import moe_align_block_size

pytestmark = pytest.mark.gpu

H, I = 256, 192


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "tokens, top_k, experts", [(1, 8, 64), (16, 2, 8), (64, 8, 32), (1000, 4, 16)]
)
def test_gpu_kernels_match_reference(tokens, top_k, experts, dtype):
    gen = gen_for("gpu", tokens, top_k, experts, str(dtype))
    x = torch.randn(tokens, H, generator=gen).to(dtype).cuda()
    w13, w2 = (t.cuda() for t in expert_weights(experts, H, I, dtype, gen))
    ids = distinct_ids(tokens, top_k, experts, gen).cuda()
    weights = torch.rand(tokens, top_k, generator=gen).cuda()
    out = fused_experts(x, w13, w2, weights, ids)
    ref = fused_experts_ref(x, w13, w2, weights, ids)
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCES[dtype])


def _layer_inputs(tokens: int):
    gen = gen_for("gpu-graph", tokens)
    x = torch.randn(tokens, H, generator=gen).bfloat16().cuda()
    logits = torch.randn(tokens, 16, generator=gen).cuda()
    return x, logits


def _run(x, logits, w13, w2):
    return fused_moe(
        x, w13, w2, logits, 4, scoring="sigmoid", renormalize=True, num_expert_group=4,
        topk_group=2, routed_scaling_factor=2.5,
    )  # fmt: skip


# 1 token: unsorted (4 pairs <= 16 // 4); 8: the one-program alignment; 400: the chunked one.
@pytest.mark.parametrize("tokens", [1, 8, 400])
def test_gpu_no_host_sync_and_cuda_graph_replay(tokens):
    w13, w2 = (t.cuda() for t in expert_weights(16, H, I, torch.bfloat16, gen_for("w")))
    x, logits = _layer_inputs(tokens)
    _run(x, logits, w13, w2)  # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run(x, logits, w13, w2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _run(x, logits, w13, w2)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _run(x, logits, w13, w2)
    new_x, new_logits = _layer_inputs(tokens + 1)
    x.copy_(new_x[:tokens])
    logits.copy_(new_logits[:tokens])
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(static_out, _run(x, logits, w13, w2), atol=0, rtol=0)


@pytest.mark.parametrize(
    "tokens, top_k, experts", [(128, 8, 128), (1, 8, 72), (300, 2, 16), (4096, 6, 128)]
)
def test_gpu_alignment_kernels_equal_torch(tokens, top_k, experts, monkeypatch):
    """The one-program kernel and the chunked kernels against the torch ops."""
    ids = distinct_ids(tokens, top_k, experts, gen_for("gpu-align", tokens)).cuda()
    one = moe_align_block_size(ids, 64, experts, max_kernel_pairs=10**6)
    chunks = moe_align_block_size(ids, 64, experts, max_kernel_pairs=0)
    monkeypatch.setattr(moe_align, "_kernel_runs", lambda *args: False)
    torch_ = moe_align_block_size(ids, 64, experts)
    for a, b, c in zip(one, chunks, torch_, strict=True):
        assert torch.equal(a, c) and torch.equal(b, c)
