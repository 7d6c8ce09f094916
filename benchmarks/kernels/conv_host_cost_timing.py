"""The host-cost benchmark's timing (benchmark_conv_host_cost.py has the method): the
back-to-back loop with its enqueue and loop times per call, their median and p20/p80, the
cProfile top list, and the context that stubs every kernel launch of the op module.
"""

from __future__ import annotations

import contextlib
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from vllm.model_executor.layers.mamba.ops import causal_conv1d as conv_ops
from vllm.triton_utils.launch import CachedLauncher


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_loop(fn: Callable[[], object], device, calls: int, reps: int) -> dict:
    """Back-to-back calls, no sync inside; per repetition the enqueue and loop time per call."""
    for _ in range(min(10, calls)):
        fn()
    _sync(device)
    enq, loop = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        _sync(device)
        t2 = time.perf_counter()
        enq.append((t1 - t0) / calls * 1e6)
        loop.append((t2 - t0) / calls * 1e6)
    return {"enqueue_us": _stats(enq), "loop_us": _stats(loop), "calls": calls, "reps": reps}


def _stats(samples: list[float]) -> dict:
    s = sorted(samples)

    def q(p):
        pos = p * (len(s) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)

    return {"median": statistics.median(s), "p20": q(0.2), "p80": q(0.8)}


def profile_top(fn: Callable[[], object], calls: int, top: int = 12) -> list[dict]:
    """The functions with the most own time per call, under cProfile."""
    fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (path, line, name), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        rows.append(
            {
                "function": f"{Path(path).name}:{line}({name})" if line else name,
                "own_us_per_call": tottime / calls * 1e6,
                "cum_us_per_call": cumtime / calls * 1e6,
                "calls_per_call": ncalls / calls,
            }
        )
    rows.sort(key=lambda r: -r["own_us_per_call"])
    return rows[:top]


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kw)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def stubbed_launches() -> Iterator[None]:
    """Every launcher of the op module launches nothing (the host path alone is timed)."""
    saved = []
    for value in vars(conv_ops).values():
        if isinstance(value, CachedLauncher):
            saved.append((value, value.kernel, value.direct))
            value.kernel, value.direct = _NoLaunch(), False
    clear = getattr(conv_ops, "clear_host_caches", None)
    if clear is not None:
        clear()  # cached launch plans hold compiled kernels: rebuild them as stubs
    try:
        yield
    finally:
        for launcher, kernel, direct in saved:
            launcher.kernel, launcher.direct = kernel, direct
        if clear is not None:
            clear()
