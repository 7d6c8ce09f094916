"""Launch Triton kernels with little host work, and compile every variant ahead of time.

``JITFunction.run`` binds arguments, reads Triton's knobs, checks globals and builds
launch metadata on every call: tens of microseconds on the host, more than a decode
step's GPU time. ``CachedLauncher`` keeps each compiled kernel under a key that holds
everything Triton specialises a compiled kernel on (argument dtypes, 16-byte alignment
of pointers, ints equal to 1 or divisible by 16 and their width, the constexprs and
launch options; arguments the kernel marks ``do_not_specialize`` or
``do_not_specialize_on_alignment`` contribute only what Triton still keys on), so a hit is
exactly the kernel Triton would pick, launched directly. A miss goes through
``kernel[grid](...)``, which compiles (or finds) and launches it, and is counted.

Ahead-of-time compilation (the engine's start-up): inside ``precompile()`` a launch does
not run. The launcher instead records the variants its launch site could select for
these arguments: the caller's ``variants`` callable, which returns every constexpr set of
the launch site's configuration table (the same table its rule picks from), or just the
constexprs given. When the block ends, every variant not compiled yet is compiled, in
parallel threads (Triton releases the GIL while compiling), then loaded (its C launcher
built, its module on the device), in parallel threads too, and entered in the launcher's
cache. A dummy step run through the model inside the block therefore compiles every
kernel variant that any step can pick, without touching device data.

Under ``TRITON_INTERPRET=1`` every call takes the ordinary path, but the launcher still
keys each call, so misses are counted (and ``precompile`` registers variants) the same way.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from vllm import envs
from vllm.triton_utils import HAS_TRITON

_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1

# Every launcher made, for statistics and the warm-up's bookkeeping.
_LAUNCHERS: list[CachedLauncher] = []


def _flag_set(kernel, attr: str, names: list[str]) -> frozenset[int]:
    given = getattr(kernel, attr, None)
    if given is None:  # the interpreter keeps the decorator's arguments in ``kwargs``
        given = getattr(kernel, "kwargs", {}).get(attr)
    given = given or ()
    return frozenset(i for i, n in enumerate(names) if i in given or n in given)


def _arg_names(kernel) -> list[str]:
    names = getattr(kernel, "arg_names", None)
    if names is None:
        import inspect

        names = list(inspect.signature(kernel.fn).parameters)
    return list(names)


class CachedLauncher:
    """``launcher(grid, args, constexprs)`` == ``kernel[grid](*args, **constexprs)``.

    ``args`` are the kernel's runtime parameters, in order, ahead of its constexpr
    parameters; ``constexprs`` holds the constexpr parameters and launch options
    (``num_warps``, ``num_stages``, ``maxnreg``). ``variants``, when given, returns every
    constexpr dict the launch site's rule could choose for arguments like these (the
    given one included); it is called only inside ``precompile()``.
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self.name = getattr(getattr(kernel, "fn", kernel), "__name__", repr(kernel))
        self.cache: dict = {}
        self.seen: set = set()  # keys launched or precompiled (the interpreter has no cache)
        self.misses = 0  # launches of a variant that was not compiled (or registered) yet
        self.direct = hasattr(kernel, "device_caches")  # a JITFunction, not the interpreter
        names = _arg_names(kernel)
        self._plain = _flag_set(kernel, "do_not_specialize", names)
        self._unaligned = _flag_set(kernel, "do_not_specialize_on_alignment", names)
        _LAUNCHERS.append(self)

    def runs_cpu_tensors(self) -> bool:
        """CPU tensors may go to the kernel: Triton is installed, its interpreter is on
        (TRITON_INTERPRET=1) and the kernel was built for it, i.e. the variable was set
        before the kernel's module was imported. Set later, as by a CPU run inside a
        process that imported the kernels for the GPU, the kernel is a compiled one,
        which cannot read CPU tensors."""
        return HAS_TRITON and envs.TRITON_INTERPRET and not self.direct

    def keys_alignment(self, i: int) -> bool:
        """Whether the 16-byte alignment of pointer argument ``i`` selects the compiled
        kernel (Triton specialises on it unless the kernel marks it otherwise)."""
        return i not in self._plain and i not in self._unaligned

    def _spec(self, i: int, arg) -> object:
        if isinstance(arg, torch.Tensor):
            return (arg.dtype, self.keys_alignment(i) and arg.data_ptr() % 16 == 0)
        if arg is None:
            return None
        if isinstance(arg, bool):
            return ("b", arg)
        if isinstance(arg, int):
            wide = not _I32_MIN <= arg <= _I32_MAX
            if i in self._plain:
                return ("i", wide)
            return ("i", arg == 1, arg % 16 == 0, wide)
        if isinstance(arg, float):
            return ("f",)
        raise TypeError(f"unsupported kernel argument type {type(arg).__name__}")

    def key(self, args: tuple, constexprs: dict) -> tuple:
        """What the compiled kernel for these arguments depends on."""
        device = torch.cuda.current_device() if self.direct else None
        specs = tuple(map(self._spec, range(len(args)), args))
        return (device, specs, tuple(constexprs.items()))

    def __call__(
        self,
        grid: tuple[int, ...],
        args: tuple,
        constexprs: dict,
        variants: Callable[[], list[dict]] | None = None,
    ) -> None:
        if _SESSION is not None:
            _SESSION.add(self, grid, args, variants() if variants else [constexprs])
            return
        key = self.key(args, constexprs)
        if not self.direct:
            if key not in self.seen:
                self.seen.add(key)
                self.misses += 1
            self.kernel[grid](*args, **constexprs)
            return
        entry = self.cache.get(key)
        if entry is None:
            self.misses += 1
            compiled = self.kernel[grid](*args, **constexprs)
            self._enter(key, args, constexprs, compiled)
            return
        compiled, tail = entry
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = torch.cuda.current_stream(key[0]).cuda_stream
        compiled.run(
            grid[0],
            g1,
            g2,
            stream,
            compiled.function,
            compiled.packed_metadata,
            None,
            None,
            None,
            *args,
            *tail,
        )

    def _enter(self, key, args, constexprs, compiled) -> None:
        names = self.kernel.arg_names[len(args) :]
        tail = tuple(constexprs[n] for n in names)
        compiled._init_handles()
        self.cache[key] = (compiled, tail)
        self.seen.add(key)


@dataclass
class PrecompileReport:
    """What one ``precompile()`` block asked for: the variants per kernel its launch sites
    can select, how many of them were new (compiled now, the others were already in the
    launchers' caches), and the seconds the compiling took."""

    variants: dict[str, int] = field(default_factory=dict)
    num_new: int = 0
    seconds: float = 0.0
    # Per kernel, when its last new variant finished compiling, in seconds from the
    # compiling's start: the largest is the long pole of a cold start.
    finished_s: dict[str, float] = field(default_factory=dict)

    @property
    def num_variants(self) -> int:
        return sum(self.variants.values())


class _Session:
    def __init__(self):
        self.asked: set = set()  # (launcher id, key) of every variant asked for
        self.pending: dict = {}  # (launcher id, key) -> (launcher, key, grid, args, constexprs)

    def add(self, launcher: CachedLauncher, grid, args, variants: list[dict]) -> None:
        for constexprs in variants:
            key = launcher.key(args, constexprs)
            self.asked.add((id(launcher), launcher.name, key))
            if key in launcher.seen or (id(launcher), key) in self.pending:
                continue
            self.pending[id(launcher), key] = (launcher, key, grid, args, constexprs)

    def compile_all(self, report: PrecompileReport, max_workers: int | None) -> None:
        for _, name, _ in self.asked:
            report.variants[name] = report.variants.get(name, 0) + 1
        jobs = list(self.pending.values())
        report.num_new = len(jobs)
        compiled = [j for j in jobs if j[0].direct]
        for launcher, key, *_ in jobs:
            if not launcher.direct:
                launcher.seen.add(key)  # the interpreter runs the source: nothing to build
        if not compiled:
            return
        from triton.runtime._async_compile import AsyncCompileMode

        workers = max_workers or min(len(compiled), os.cpu_count() or 1)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=workers) as pool:
            with AsyncCompileMode(pool):
                futures = [
                    launcher.kernel.warmup(*args, grid=grid, **constexprs)
                    for launcher, key, grid, args, constexprs in compiled
                ]
                for (launcher, *_), fut in zip(compiled, futures, strict=True):
                    if hasattr(fut, "future"):  # Triton's FutureKernel
                        fut.future.add_done_callback(_finish_clock(report, launcher.name, t0))
            kernels = [f.result() if hasattr(f, "result") else f for f in futures]
            # Loading a kernel builds its C launcher first (a compiler run per new argument
            # signature, about 0.25 s each) and then the module: on the same threads, each
            # on the device the variant was keyed on (key[0]), or the load lands on device 0.
            list(pool.map(_load, [j[1][0] for j in compiled], kernels))
        for (launcher, key, _, args, constexprs), kernel in zip(compiled, kernels, strict=True):
            launcher._enter(key, args, constexprs, kernel)


_CLOCK_LOCK = threading.Lock()  # compiles finish on the pool's threads


def _finish_clock(report: PrecompileReport, name: str, t0: float):
    def done(_future) -> None:
        t = time.perf_counter() - t0
        with _CLOCK_LOCK:
            report.finished_s[name] = max(report.finished_s.get(name, 0.0), t)

    return done


def _load(device: int, kernel) -> None:
    with torch.cuda.device(device):
        kernel._init_handles()


_SESSION: _Session | None = None


@contextlib.contextmanager
def _filled_allocations() -> Iterator[None]:
    """PyTorch fills every new tensor (NaN for floats, the largest value for integers).
    Inside ``precompile`` no kernel writes its outputs, yet the PyTorch ops between launches
    (an activation, the logits' matmul) read them: without a fill they would read memory
    nothing ever wrote, which compute-sanitizer's initcheck reports by the hundred and
    which would hide a real report. The fill needs PyTorch's deterministic mode; only
    warned about here (an op without a deterministic implementation still runs).

    The mode is set through ``torch._C._set_deterministic_algorithms``, the switch that
    ``torch.use_deterministic_algorithms`` flips after importing ``torch._inductor`` (to
    copy the flag into Inductor's config, which nothing here compiles with): that import
    alone took 2 s of a CPU start-up and about 4 s of a Codestral-7B start-up on the H200."""
    import torch.utils.deterministic as det

    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    was_fill = det.fill_uninitialized_memory
    torch._C._set_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*deterministic.*")
            yield
    finally:
        det.fill_uninitialized_memory = was_fill
        torch._C._set_deterministic_algorithms(was_on, warn_only=was_warn)


@contextlib.contextmanager
def precompile(max_workers: int | None = None) -> Iterator[PrecompileReport]:
    """Inside the block launches do not run; each records its launch site's variants.
    On exit every variant not compiled yet is compiled (in parallel) and cached; the
    yielded report then says how many per kernel and how long it took."""
    global _SESSION
    if _SESSION is not None:
        raise RuntimeError("precompile() blocks do not nest")
    report = PrecompileReport()
    session = _SESSION = _Session()
    try:
        with _filled_allocations():
            yield report
    finally:
        _SESSION = None
    t0 = time.perf_counter()
    session.compile_all(report, max_workers)
    report.seconds = time.perf_counter() - t0


def launch_misses() -> dict[str, int]:
    """Launches so far, per kernel, of a variant that had not been compiled before."""
    out: dict[str, int] = {}
    for launcher in _LAUNCHERS:
        out[launcher.name] = out.get(launcher.name, 0) + launcher.misses
    return out
