"""The fused selective-state-update kernel on the GPU (``gpu`` tests): bf16, the Codestral-7B
shape, random cases, CUDA-graph replay and int64 addressing, against the PyTorch path
(``selective_state_update_torch``). The CPU/interpreter cases: test_mamba_ssm_triton.py;
helpers: ssm_update_utils.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.layers.ssm_update_utils import NO_LIMIT, Case, build, check_against_torch
from tests.models.mamba2_utils import BF16, FP16, FP32, assert_close, gen_for
from vllm.model_executor.layers.mamba.ops.causal_conv1d_ref import NULL_BLOCK_ID
from vllm.model_executor.layers.mamba.ops.mamba_ssm_torch import (
    selective_state_update,
    selective_state_update_torch,
)

CODESTRAL = dict(heads=128, headdim=64, dstate=128, groups=8)

GPU_CASES = [
    Case(1, **CODESTRAL, dtype=BF16, indices=None),
    Case(4, **CODESTRAL, dtype=BF16, pads=1, strided=True),
    Case(7, **CODESTRAL, dtype=BF16, state_dtype=BF16, pads=2),
    Case(16, **CODESTRAL, dtype=FP32, pads=3, indices=torch.int64),
    Case(5, heads=24, headdim=80, dstate=256, groups=3, dtype=BF16, pads=1, strided=True),
    Case(5, heads=8, headdim=48, dstate=64, dtype=FP16, limit=(0.0, 0.1)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_gpu_kernel_matches_torch(case: Case, nan_poison):
    check_against_torch(case, build(case, torch.device("cuda")), run=selective_state_update)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(20), ids=lambda s: f"seed{s}")
def test_gpu_random_cases(seed, nan_poison):
    g = gen_for("gpu-random", seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    groups = pick([1, 2, 4])
    batch = pick([1, 2, 3, 8, 33])
    case = Case(
        batch,
        heads=groups * pick([1, 3, 8]),
        headdim=pick([16, 50, 64, 96]),
        dstate=pick([16, 24, 64, 128, 200, 256]),
        groups=groups,
        dtype=pick([FP32, FP16, BF16]),
        state_dtype=pick([FP32, FP32, BF16]),
        pads=pick([0, batch // 2]),
        D=pick([True, False]),
        dt_bias=pick([True, False]),
        limit=pick([NO_LIMIT, (0.01, 0.3)]),
        strided=pick([True, False]),
    )
    check_against_torch(case, build(case, torch.device("cuda")), run=selective_state_update)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_cuda_graph_replay_equals_eager(dtype, nan_poison):
    """Capture one decode update, then replay it with new lines (pads included) and inputs."""
    case = Case(8, **CODESTRAL, dtype=dtype, pads=0)
    num_lines = case.num_lines
    device = torch.device("cuda")
    static = build(case, device, key="graph-static")
    pool = static.state
    kw = dict(static.kwargs, out=torch.empty(case.batch, 128, 64, dtype=dtype, device=device))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        selective_state_update(pool.clone(), **kw)  # compiles the kernel outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        selective_state_update(pool, **kw)

    g = gen_for("graph-replays", dtype)
    for replay, n_real in enumerate([8, 5, 1]):
        fresh = build(case, device, key=("graph-replay", replay))
        for name in ("x", "dt", "B", "C"):
            kw[name].copy_(fresh.kwargs[name])
        lines = 1 + torch.randperm(num_lines - 1, generator=g)[: case.batch]
        lines[n_real:] = NULL_BLOCK_ID
        kw["state_batch_indices"].copy_(lines)
        before, ref_pool = pool.clone(), pool.clone()
        y_ref = selective_state_update_torch(ref_pool, **dict(kw, out=None))
        kw["out"].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not torch.isnan(kw["out"]).any()
        assert_close(kw["out"], y_ref, "scan", dtype, msg=f"replay {replay}")
        assert not kw["out"][n_real:].any()
        live = lines[:n_real].tolist()
        assert_close(pool[live], ref_pool[live], "scan")
        for line in sorted(set(range(num_lines)) - set(live)):
            assert torch.equal(pool[line], before[line]), f"replay {replay}: line {line}"


@pytest.mark.gpu_big_memory
@pytest.mark.gpu
def test_int64_line_offsets():
    """A pool past 2**31 elements: the last lines are addressed without overflow."""
    heads, headdim, dstate = 8, 64, 128  # 65536 elements per line
    num_lines = 2**31 // (heads * headdim * dstate) + 4  # 4 GiB in bf16
    device = torch.device("cuda")
    pool = torch.zeros(num_lines, heads, headdim, dstate, dtype=BF16, device=device)
    case = Case(3, heads=heads, headdim=headdim, dstate=dstate, dtype=BF16, state_dtype=BF16)
    small = build(case, device, key="int64")
    targets = [num_lines - 2, num_lines - 4, 1]
    pool[targets] = small.state[:3]
    kw = dict(small.kwargs, state_batch_indices=torch.tensor(targets, device=device))
    y = selective_state_update(pool, **kw)
    ref = small.state[:3].clone()
    y_ref = selective_state_update_torch(ref, **dict(kw, state_batch_indices=None))
    assert_close(y, y_ref, "scan", BF16)
    assert_close(pool[targets], ref, "scan", BF16)
    assert not pool[num_lines - 1].any() and not pool[num_lines - 3].any()
