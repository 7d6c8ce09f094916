"""GPU-only: causal_conv1d_update captured in a CUDA graph and replayed with new tokens,
lines and padded rows (one-token decodes; speculative varlen rows).

Skipped without a CUDA GPU (see tests/conftest.py); they run on the GPU box.
"""

from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
    PAD_SLOT_ID,
    causal_conv1d_update,
    causal_conv1d_update_ref,
)

from .conv_utils import assert_close, assert_no_nan, gen_for, make_bias, make_pool, make_weight

pytestmark = pytest.mark.gpu

FP32, BF16 = torch.float32, torch.bfloat16


# --- CUDA graphs ------------------------------------------------------------------------


def _capture(fn):
    """Warm up on a side stream, then capture ``fn``; returns (graph, static output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(warmup=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(warmup=False)
    return graph, out


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_cuda_graph_decode_with_padded_rows(dtype, nan_poison):
    g = gen_for("graph-decode", dtype)
    batch, dim, width, num_lines = 16, 2064, 4, 24
    weight, bias = make_weight(dim, width, dtype, "cuda", g), make_bias(dim, dtype, "cuda", g)
    pool = make_pool(num_lines, dim, width - 1, dtype, "cuda", g)
    static_x = torch.randn(batch, dim, generator=g).to(dtype=dtype, device="cuda")
    static_idx = torch.arange(batch, dtype=torch.int32, device="cuda")

    def step(warmup):
        p = pool.clone() if warmup else pool
        return causal_conv1d_update(static_x, p, weight, bias, "silu", static_idx)

    graph, static_out = _capture(step)
    for replay in range(3):
        n_real = [16, 11, 5][replay]
        lines = torch.randperm(num_lines, generator=g)[:batch]
        lines[n_real:] = PAD_SLOT_ID
        static_idx.copy_(lines)
        static_x.copy_(torch.randn(batch, dim, generator=g).to(dtype))
        pool_before, ref_pool = pool.clone(), pool.clone()
        ref = causal_conv1d_update_ref(static_x, ref_pool, weight, bias, "silu", static_idx)
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_no_nan(static_out)
        assert_close(static_out, ref)
        assert not static_out[n_real:].any(), "padded rows must be zero"
        assert torch.equal(pool, ref_pool)
        used = set(lines[:n_real].tolist())
        for line in range(num_lines):
            if line not in used:
                assert torch.equal(pool[line], pool_before[line]), f"replay {replay}: line {line}"


def test_cuda_graph_varlen_spec_with_padded_rows(nan_poison):
    """Speculative decode under a graph: varlen rows, zero-length padded rows at the end."""
    g = gen_for("graph-spec")
    dtype, dim, width, num_lines, max_len = BF16, 1024, 4, 12, 4
    batch, num_tokens = 8, 16
    weight, bias = make_weight(dim, width, dtype, "cuda", g), make_bias(dim, dtype, "cuda", g)
    pool = make_pool(num_lines, dim, width - 1 + max_len - 1, dtype, "cuda", g)
    static_x = torch.randn(num_tokens, dim, generator=g).to(dtype=dtype, device="cuda")
    static_qsl = torch.tensor([0, 4, 8, 12, 16, 16, 16, 16, 16], dtype=torch.int32, device="cuda")
    static_idx = torch.tensor([0, 1, 2, 3] + [PAD_SLOT_ID] * 4, dtype=torch.int32, device="cuda")
    static_acc = torch.ones(batch, dtype=torch.int32, device="cuda")

    def step(warmup):
        p = pool.clone() if warmup else pool
        return causal_conv1d_update(
            static_x,
            p,
            weight,
            bias,
            "silu",
            static_idx,
            static_acc,
            static_qsl,
            max_query_len=max_len,
        )

    graph, static_out = _capture(step)
    replays = [
        ([4, 4, 4, 4, 0, 0, 0, 0], [5, 0, 7, PAD_SLOT_ID]),
        ([1, 3, 4, 2, 4, 2, 0, 0], [9, 2, 11, 4, 0, PAD_SLOT_ID]),
        ([2, 1, 1, 4, 4, 4, 0, 0], [1, 3, PAD_SLOT_ID, 6, 8, 10]),
    ]
    for replay, (lens, lines) in enumerate(replays):
        lines = lines + [PAD_SLOT_ID] * (batch - len(lines))
        qsl = [0]
        for n in lens:
            qsl.append(qsl[-1] + n)
        static_qsl.copy_(torch.tensor(qsl, dtype=torch.int32))
        static_idx.copy_(torch.tensor(lines, dtype=torch.int32))
        static_acc.copy_(torch.tensor([1 + (b * 7 + replay) % max_len for b in range(batch)]))
        static_x.copy_(torch.randn(num_tokens, dim, generator=g).to(dtype))
        pool_before, ref_pool = pool.clone(), pool.clone()
        ref = causal_conv1d_update_ref(
            static_x, ref_pool, weight, bias, "silu", static_idx, static_acc, static_qsl
        )
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_no_nan(static_out)
        assert_close(static_out, ref)
        assert torch.equal(pool, ref_pool)
        for b, line in enumerate(lines):
            if line == PAD_SLOT_ID:
                assert not static_out[qsl[b] : qsl[b + 1]].any(), f"replay {replay}: pad row {b}"
        used = {line for line in lines if line != PAD_SLOT_ID}
        for line in range(num_lines):
            if line not in used:
                assert torch.equal(pool[line], pool_before[line]), f"replay {replay}: line {line}"
