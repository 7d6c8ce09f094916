"""The CUDA causal-conv1d ops under a CUDA graph (forward and update replayed with new
lines and padded rows) and under torch.library.opcheck.

Everything needs the built ops and a GPU (mark gpu).
"""

from __future__ import annotations

import pytest
import torch

from vllm import _custom_ops as cuda_ops
from vllm._custom_ops import causal_conv1d_fwd_cuda, causal_conv1d_update_cuda
from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
    PAD_SLOT_ID,
    causal_conv1d_ref,
    causal_conv1d_update_ref,
)

from .conv_cuda_utils import width_major
from .conv_utils import assert_close, assert_no_nan, gen_for, make_bias, make_pool, make_weight

FP16, BF16 = torch.float16, torch.bfloat16
gpu = pytest.mark.gpu


# --- CUDA graphs, torch.library ----------------------------------------------------------


@gpu
def test_cuda_graph_update_and_fwd_with_padded_rows(nan_poison):
    g = gen_for("cuda-graph")
    dtype, dim, width, batch, num_lines = BF16, 2064, 4, 16, 24
    weight, bias = make_weight(dim, width, dtype, "cuda", g), make_bias(dim, dtype, "cuda", g)
    pool = width_major(make_pool(num_lines, dim, width - 1, dtype, "cuda", g))
    x = torch.randn(batch, dim, generator=g).to(dtype=dtype, device="cuda")
    px = torch.randn(64, dim, generator=g).to(dtype=dtype, device="cuda").t()
    pqsl = torch.tensor([0, 40, 41, 64], dtype=torch.int32, device="cuda")
    pidx = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    pinit = torch.tensor([True, False, True], device="cuda")
    idx = torch.arange(3, 3 + batch, dtype=torch.int32, device="cuda")
    out = torch.empty(batch, dim, dtype=dtype, device="cuda")
    pout = torch.empty(64, dim, dtype=dtype, device="cuda").t()

    def step():
        causal_conv1d_fwd_cuda(
            px, weight, bias, pool, pqsl, pidx, pinit, True, PAD_SLOT_ID, out=pout
        )
        causal_conv1d_update_cuda(x, pool, weight, bias, True, idx, PAD_SLOT_ID, out=out)

    saved = pool.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    pool.copy_(saved)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for replay in range(3):
        n_real = (16, 9, 1)[replay]
        lines = 3 + torch.randperm(num_lines - 3, generator=g)[:batch]
        lines[n_real:] = PAD_SLOT_ID
        idx.copy_(lines)
        x.copy_(torch.randn(batch, dim, generator=g).to(dtype))
        pidx.copy_(torch.tensor([[0, 1, 2], [2, PAD_SLOT_ID, 0], [1, 0, PAD_SLOT_ID]][replay]))
        before, ref_pool = pool.clone(), pool.clone()
        ref_p = causal_conv1d_ref(
            px, weight, bias, ref_pool, pqsl, pidx, pinit, pad_slot_id=PAD_SLOT_ID
        )
        ref = causal_conv1d_update_ref(
            x, ref_pool, weight, bias, "silu", idx, pad_slot_id=PAD_SLOT_ID
        )
        out.fill_(float("nan"))
        pout.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_no_nan(out)
        assert_no_nan(pout)
        assert_close(out, ref)
        assert_close(pout, ref_p)
        assert not out[n_real:].any(), "padded rows must be zero"
        assert torch.equal(pool, ref_pool), f"replay {replay}"
        used = set(lines[:n_real].tolist()) | {i for i in pidx.tolist() if i != PAD_SLOT_ID}
        for line in range(num_lines):
            if line not in used:
                assert torch.equal(pool[line], before[line]), f"replay {replay}: line {line}"


@gpu
def test_opcheck():
    g = gen_for("cuda-opcheck")
    dtype, dim, width = FP16, 64, 4
    weight, bias = make_weight(dim, width, dtype, "cuda", g), make_bias(dim, dtype, "cuda", g)
    pool = width_major(make_pool(4, dim, width - 1, dtype, "cuda", g))
    x = torch.randn(9, dim, generator=g).to(dtype=dtype, device="cuda").t()
    qsl = torch.tensor([0, 5, 9], dtype=torch.int32, device="cuda")
    idx = torch.tensor([3, 1], dtype=torch.int32, device="cuda")
    init = torch.tensor([True, False], device="cuda")
    assert cuda_ops.cuda_ops_available()
    ops = torch.ops._C_conv
    out = torch.empty(9, dim, dtype=dtype, device="cuda").t()
    torch.library.opcheck(
        ops.causal_conv1d_fwd.default,
        (x, weight, bias, pool, qsl, idx, init, True, PAD_SLOT_ID, 0, out),
    )
    xu = x.t()[:2].contiguous()
    outu = torch.empty_like(xu)
    torch.library.opcheck(
        ops.causal_conv1d_update.default, (xu, pool, weight, None, False, idx, PAD_SLOT_ID, outu)
    )
