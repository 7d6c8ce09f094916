"""Mamba1's selective scan and decode update compiled for the GPU, in bf16 at a mid-size
layer shape (the default chunk plan, other chunks, one chunk per sequence) against the fp32
references on the same bf16 inputs, and the decode update captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.mamba.selective_scan_utils import (
    ScanCase,
    check_against_reference,
    real_lines,
    rnd,
    scan_inputs,
)
from tests.models.mamba2_utils import BF16, FP32
from vllm.model_executor.layers.mamba.ops.selective_scan import (
    selective_scan_fn,
    selective_state_update_mamba1,
)
from vllm.model_executor.layers.mamba.ops.selective_scan_ref import (
    selective_scan_ref,
    selective_state_update_ref,
)

pytestmark = pytest.mark.gpu

GPU = torch.device("cuda")
MID = ScanCase((300, 1, 0, 77, 129), (3, 0, 5, 1, 7), (True, True, False, False, True),
               dim=256, dstate=16, dtype=BF16, num_lines=9, strided=True)  # fmt: skip


# None: the table's plan (chunks of 64 here); 100: other chunks; 512: one chunk each.
@pytest.mark.parametrize("chunk_len", [None, 100, 512])
@pytest.mark.parametrize("state_dtype", [FP32, BF16])
def test_gpu_scan_bf16(chunk_len, state_dtype, nan_poison):
    case = dataclasses.replace(MID, state_dtype=state_dtype)
    kw, pool = scan_inputs(case, GPU)
    touched = real_lines([ln for ln, n in zip(case.lines, case.lens, strict=True) if n], 0)
    check_against_reference(selective_scan_fn, selective_scan_ref, kw, pool, BF16, touched,
                            chunk_len=chunk_len)  # fmt: skip


def test_gpu_update_bf16_in_a_cuda_graph():
    batch, dim, dstate = 8, 256, 16
    rows = {n: rnd(batch, w, key=("gpu-upd", n)).to(BF16).to(GPU) for n, w in
            (("u", dim), ("delta", dim), ("z", dim), ("B", dstate), ("C", dstate))}  # fmt: skip
    A = -(0.2 + rnd(dim, dstate, key="gpu-A").abs()).to(GPU)
    D, bias = rnd(dim, key="gpu-D").to(GPU), rnd(dim, key="gpu-b").to(GPU)
    idx = torch.tensor([3, 0, 5, 1, 0, 7, 2, 4], dtype=torch.int32, device=GPU)
    pool = rnd(9, dim, dstate, key="gpu-pool").to(GPU)
    mine, theirs = pool.clone(), pool.clone()
    out = torch.empty_like(rows["u"])
    kw = dict(rows, A=A, D=D, delta_bias=bias, delta_softplus=True, state_batch_indices=idx)
    selective_state_update_mamba1(mine.clone(), **kw, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        selective_state_update_mamba1(mine, **kw, out=out)
    graph.replay()
    y_ref = selective_state_update_ref(theirs, **kw)
    torch.testing.assert_close(out.float(), y_ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    assert torch.equal(mine[0], pool[0]) and torch.equal(mine[6], pool[6])
