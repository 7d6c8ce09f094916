"""precompile() on the GPU: every new variant is compiled and loaded (its C launcher built,
its module on the device) by the block's worker threads, so the launches after it neither
compile nor load anything and run the right variant."""

from __future__ import annotations

import threading

import pytest
import torch

from vllm.triton_utils import HAS_TRITON
from vllm.triton_utils import launch as launch_mod

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _scale_kernel(x_ptr, y_ptr, n, FACTOR: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * FACTOR, mask=mask)


FACTORS = (2, 3, 5)


@pytest.mark.gpu
def test_precompile_loads_new_variants_in_worker_threads(monkeypatch):
    launcher = launch_mod.CachedLauncher(_scale_kernel)
    assert launcher.direct, "a compiled kernel is needed (TRITON_INTERPRET=1 is set)"
    loads = []
    real_load = launch_mod._load

    def recording_load(device, kernel):
        loads.append((device, threading.get_ident(), kernel.module))
        real_load(device, kernel)

    monkeypatch.setattr(launch_mod, "_load", recording_load)
    n = 1000
    x = torch.arange(n, dtype=torch.float32, device="cuda")
    y = torch.full_like(x, -1.0)
    grid = (triton.cdiv(n, 128),)
    with launch_mod.precompile() as report:
        launcher(
            grid,
            (x, y, n),
            {"FACTOR": FACTORS[0], "BLOCK": 128},
            variants=lambda: [{"FACTOR": f, "BLOCK": 128} for f in FACTORS],
        )
    assert torch.all(y == -1.0), "a launch ran inside precompile()"
    assert report.num_new == len(FACTORS)
    assert 0 < report.finished_s["_scale_kernel"] <= report.seconds
    assert len(loads) == len(FACTORS)
    main = threading.get_ident()
    assert all(d == torch.cuda.current_device() and t != main for d, t, _ in loads), loads
    assert all(module is None for *_, module in loads), "loaded before the parallel stage"
    assert len(launcher.cache) == len(FACTORS)
    assert all(compiled.module is not None for compiled, _ in launcher.cache.values())
    for f in FACTORS:
        launcher(grid, (x, y, n), {"FACTOR": f, "BLOCK": 128})
        torch.testing.assert_close(y, x * f, rtol=0, atol=0)
    assert launcher.misses == 0, "a launch after precompile() compiled a variant"


def test_finish_clock_keeps_each_kernels_latest_finish_across_threads():
    """The compile pool's threads report finishes concurrently: each kernel keeps its last."""
    report = launch_mod.PrecompileReport()
    t0 = launch_mod.time.perf_counter()
    clocks = [launch_mod._finish_clock(report, f"k{i % 3}", t0) for i in range(300)]
    threads = [threading.Thread(target=clock, args=(None,)) for clock in clocks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(report.finished_s) == ["k0", "k1", "k2"]
    after = launch_mod.time.perf_counter() - t0
    assert all(0 < s <= after for s in report.finished_s.values())
    # A later finish replaces an earlier one, an earlier one does not.
    late = report.finished_s["k0"]
    launch_mod._finish_clock(report, "k0", t0 + 3600.0)(None)  # "finished" before t0
    assert report.finished_s["k0"] == late
    launch_mod._finish_clock(report, "k0", t0 - 3600.0)(None)
    assert report.finished_s["k0"] > 3600.0
