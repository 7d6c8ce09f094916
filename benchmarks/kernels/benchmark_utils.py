"""GPU timing shared by the kernel benchmarks (method: ../shared/design/anchors-h200.md).

- cold: the GPU time of one call with a cold L2. Before each call the L2 is flushed
  (``zero_`` of 256 MB) and the GPU is kept busy with ``torch.cuda._sleep`` (~200 us),
  so the host has enqueued the whole call before the GPU reaches it; CUDA events
  bracket only the call, so host launch cost is hidden. Floor: ~3.4 us on an H200.
  A call that syncs with the host inside (``.tolist()``, ``.item()``) defeats this:
  its cold time includes its host time.
- graph: ``calls`` calls captured in one CUDA graph, replayed; time per call, warm L2.
- host: an eager back-to-back loop with one sync at the end, per call: the larger of
  the host (Python + launch) cost and the GPU time.

Scripts import it as ``benchmarks.kernels.benchmark_utils`` (they run as modules from the
repository root: ``python -m benchmarks.kernels.<script>``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

SLEEP_CYCLES = 400_000  # ~200 us at the H200's ~2 GHz: longer than any call's host work
FLUSH_BYTES = 256 * 1024 * 1024  # > the 60 MB L2


def percentile(samples: list[float], q: float) -> float:
    """The q-quantile (0..1) of samples, linearly interpolated."""
    s = sorted(samples)
    if len(s) == 1:
        return s[0]
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(samples: list[float]) -> tuple[float, float, float]:
    """(median, p20, p80)."""
    return statistics.median(samples), percentile(samples, 0.2), percentile(samples, 0.8)


class ColdTimer:
    """Cold-L2 GPU time of single calls; owns the flush buffer."""

    def __init__(self):
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")

    def samples(self, fn: Callable[[], object], reps: int) -> list[float]:
        """Microseconds of `reps` calls of fn, each after an L2 flush and a GPU sleep."""
        fn()
        torch.cuda.synchronize()
        pairs = []
        for _ in range(reps):
            self.flush.zero_()
            torch.cuda._sleep(SLEEP_CYCLES)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize()
        return [s.elapsed_time(e) * 1e3 for s, e in pairs]


def graph_samples(fn: Callable[[], object], calls: int = 20, replays: int = 15) -> list[float]:
    """Microseconds per call of `calls` calls captured in one CUDA graph, per replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm up (compiles, allocates) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return times


def host_us(fn: Callable[[], object], n: int = 200, warmup: int = 10) -> float:
    """Microseconds per call of an eager back-to-back loop (one sync at the end)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def copy_gbps(nbytes: int = 4 * 1024**3, reps: int = 10, timer: ColdTimer | None = None) -> float:
    """Device-copy bandwidth, (bytes read + written) / cold median time, in GB/s."""
    timer = timer or ColdTimer()
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = statistics.median(timer.samples(lambda: dst.copy_(src), reps))
    return 2 * nbytes / us / 1e3


# Single-number forms used by tune_causal_conv1d.py.


def cold_us(fn: Callable[[], object], n: int = 25) -> float:
    return statistics.median(ColdTimer().samples(fn, n))


def graph_us(fn: Callable[[], object], n: int = 20) -> float:
    return statistics.median(graph_samples(fn, calls=n, replays=20))
