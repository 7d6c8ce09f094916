"""benchmarks/common/step_profile.py: kernels land in the right step and category.

The CUDA path is fed a hand-made trace (this machine has no GPU): a kernel gets its
category from the mamba2 range open at its launch (matched through the correlation id),
else from its name, and its step from the step range its execution falls in.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from benchmarks.common import step_profile

CPU, CUDA = DeviceType.CPU, DeviceType.CUDA


def event(name, start_ms, end_ms, device=CPU, corr=0, user=False):
    return SimpleNamespace(
        name=name,
        id=corr,
        device_type=device,
        time_range=SimpleNamespace(start=start_ms * 1e3, end=end_ms * 1e3),
        is_user_annotation=user,
        self_cpu_time_total=(end_ms - start_ms) * 1e3,
    )


TRACE = [
    event("step:mixed#0", 0, 100),
    event("mamba2::conv", 10, 20),
    event("cuLaunchKernelEx", 12, 12.01, corr=7),
    event("mamba2::ssm_scan", 20, 40),
    event("cudaLaunchKernel", 25, 25.01, corr=8),
    event("cudaLaunchKernel", 45, 45.01, corr=9),
    event("step:decode_graph#0", 100, 200),
    event("cudaGraphLaunch", 110, 110.5, corr=10),
    # device side
    event("mamba2::conv", 30, 35, device=CUDA, user=True),  # GPU annotation: not a kernel
    event("_causal_conv1d_fwd_kernel", 30, 35, device=CUDA, corr=7),
    event("vectorized_elementwise_kernel", 35, 45, device=CUDA, corr=8),
    event("sm90_xmma_gemm_bf16bf16_bf16f32", 50, 70, device=CUDA, corr=9),
    event("_causal_conv1d_update_kernel", 120, 121, device=CUDA, corr=10),
    event("index_elementwise_kernel", 121, 130, device=CUDA, corr=10),
    event("nvjet_tst_128x64", 130, 150, device=CUDA, corr=10),
    event("launch_not_recorded", 160, 161, device=CUDA, corr=99),
    event("after_every_step", 300, 302, device=CUDA, corr=98),
]


def test_cuda_attribution():
    records = step_profile.kernel_records(TRACE, "step:", on_cuda=True)
    assert len(records) == 8
    by_name = {r.name: r for r in records}
    assert step_profile.category(by_name["_causal_conv1d_fwd_kernel"]) == "conv"
    assert step_profile.category(by_name["vectorized_elementwise_kernel"]) == "scan"
    assert by_name["index_elementwise_kernel"].ranges == ("step:decode_graph#0",)
    summary = step_profile.summarize(
        records,
        {"step:mixed#0": ("mixed", 100.0), "step:decode_graph#0": ("decode_graph", 100.0)},
        "step:",
        graphed_kinds=("decode_graph",),
    )
    mixed, graph = summary["mixed"], summary["decode_graph"]
    assert mixed["ms"] == pytest.approx({"conv": 5, "scan": 10, "matmul": 20, "other": 0})
    assert mixed["idle_ms"] == pytest.approx(65) and mixed["steps"] == 1
    assert graph["ms"] == pytest.approx({"conv": 1, "scan": 0, "matmul": 20, "other": 10})
    assert graph["share"]["idle"] == pytest.approx(0.69)
    assert "graph" in graph["attributed_by"] and "ranges" in mixed["attributed_by"]
    assert summary["_unattributed_ms"] == pytest.approx(2)
    rows = step_profile.markdown_rows("triton", summary)
    assert rows[0].startswith("| triton | mixed | 1 | 100.00 | 5.0% | 10.0% | 20.0% |")


def test_cpu_attribution_uses_self_times():
    trace = [
        event("step:decode#0", 0, 10),
        event("mamba2::conv", 1, 4),
        event("aten::empty", 2, 3),
        event("aten::addmm", 5, 7),
    ]
    # self times as the profiler reports them: a range's own time excludes its children
    trace[0].self_cpu_time_total = 4e3
    trace[1].self_cpu_time_total = 2e3
    summary = step_profile.summarize(
        step_profile.kernel_records(trace, "step:", on_cuda=False),
        {"step:decode#0": ("decode", 10.0)},
        "step:",
    )
    assert summary["decode"]["ms"] == pytest.approx({"conv": 3, "scan": 0, "matmul": 2, "other": 4})
    assert summary["decode"]["idle_ms"] == pytest.approx(1)


def test_host_self_times_by_name_per_step():
    trace = [
        event("step:mixed#0", 0, 10),
        event("aten::linear", 1, 3),
        event("cuLaunchKernelEx", 4, 4.5),
        event("cuLaunchKernelEx", 5, 5.5),
        event("step:mixed#1", 10, 20),
        event("aten::linear", 11, 12),
        event("step:decode#0", 20, 30),
        event("aten::linear", 21, 29),
        event("_causal_conv1d_fwd_kernel", 4, 5, device=CUDA, corr=1),  # not host time
    ]
    trace[0].self_cpu_time_total = 7e3  # the step's own time: its Python between ops
    trace[4].self_cpu_time_total = 9e3
    records = step_profile.host_records(trace, "step:")
    assert all(r.name != "_causal_conv1d_fwd_kernel" for r in records)
    mixed = step_profile.top_by_name(records, "step:mixed#", num_steps=2)
    assert [m["name"] for m in mixed] == [
        "step:mixed#1",
        "step:mixed#0",
        "aten::linear",
        "cuLaunchKernelEx",
    ]
    by_name = {m["name"]: m for m in mixed}
    assert by_name["aten::linear"]["us_per_step"] == pytest.approx(1.5e3)
    assert by_name["aten::linear"]["per_step"] == 1.0
    assert by_name["cuLaunchKernelEx"]["us_per_step"] == pytest.approx(0.5e3)
    assert by_name["cuLaunchKernelEx"]["per_step"] == 1.0
    decode = step_profile.top_by_name(records, "step:decode#", num_steps=1)
    assert {d["name"] for d in decode} == {"step:decode#0", "aten::linear"}
