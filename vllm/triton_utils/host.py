"""Direct launches: what lets a repeated eager call of a Triton op cost little more than its
launch. The one place outside ``launch.py`` that touches Triton's private launch state.

An op keeps launch plans (``PlanCache``) keyed by everything its checks read; a plan holds
the compiled kernels its calls launch, taken from their ``CachedLauncher`` once compiled:

- ``direct_kernel(launcher, args, constexprs)``: the compiled kernel for these arguments,
  as a ``DirectKernel``, to be called as ``fn(grid0, grid1, grid2, stream, *head, *args,
  *tail)`` with raw data pointers (ints) for tensors and None for absent ones: the Triton
  launcher's C entry point, so neither Triton's Python binding nor the launch cache's key
  runs, and no tensor pays ``data_ptr()`` plus ``cuPointerGetAttribute`` inside it.
- ``DirectLaunches``: for ops of several launches (the SSD), each launch's compiled kernel
  with its pointer arguments named by the call's tensor each one was (matched by identity
  when the launches were recorded) and its integer arguments, so that a later call passes
  only its pointers and the few integers that change per step.

A compiled kernel is the one Triton selects for 16-byte aligned pointers; a call with an
unaligned pointer, inside ``precompile()`` (``recording()``), on another current device, or
under the interpreter (nothing is compiled) goes through the ``CachedLauncher`` instead.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from vllm.triton_utils import launch as _launch


def recording() -> bool:
    """A ``precompile()`` block is recording launches: nothing may run."""
    return _launch._SESSION is not None


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` without its cost: Triton 3.6 makes it a constexpr function whose host
    calls unwrap their arguments (about 2 us each on the development machine)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def current_device() -> int:
    """The current CUDA device index (the raw binding: no Python wrapper)."""
    return torch._C._cuda_getDevice()


def current_stream(device: int) -> int:
    """The current raw stream of a device index."""
    return torch._C._cuda_getCurrentRawStream(device)


class PlanCache(dict):
    """Launch plans by argument layout. Bounded: a caller whose layouts never repeat (a new
    batch size per call, say) clears it now and then instead of growing it without end."""

    def __init__(self, max_size: int = 1024):
        super().__init__()
        self.max_size = max_size

    def put(self, key, plan) -> None:
        if len(self) >= self.max_size:
            self.clear()
        self[key] = plan


class DirectKernel:
    """One compiled kernel, for launching through the Triton launcher's C entry point:

        fn(grid0, grid1, grid2, stream, *head, *args, *tail)

    ``args`` are the kernel's runtime arguments, tensors given as their data pointers
    (ints) and absent ones as None; ``tail`` holds the compiled kernel's constexpr values.
    ``device`` is the CUDA device whose context holds the kernel.
    """

    __slots__ = ("fn", "head", "tail", "device")

    def __init__(self, compiled, tail: tuple, device: int):
        run = compiled.run
        c_launch = getattr(run, "launch", None)
        scratch = (getattr(run, "global_scratch_size", 1), getattr(run, "profile_scratch_size", 1))
        if c_launch is not None and scratch == (0, 0):
            # CudaLauncher.__call__ only allocates scratch (none here) and calls launch().
            self.fn = c_launch
            self.head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None,
                         None, compiled.packed_metadata, None, None, None)  # fmt: skip
        else:
            self.fn = run
            self.head = (compiled.function, compiled.packed_metadata, None, None, None)
        self.tail = tail
        self.device = device


def _aligned(args: Iterable) -> bool:
    return not any(isinstance(a, torch.Tensor) and a.data_ptr() % 16 for a in args)


def direct_kernel(launcher, args: tuple, constexprs: dict) -> DirectKernel | None:
    """The compiled kernel ``launcher`` holds for these arguments, or None: not compiled yet,
    not a GPU launcher, a precompile block recording, or a pointer that is not 16-byte
    aligned (direct launches use the kernel compiled for aligned pointers only)."""
    if not launcher.direct or recording() or not _aligned(args):
        return None
    entry = launcher.cache.get(launcher.key(args, constexprs))
    if entry is None:
        return None
    compiled, tail = entry
    return DirectKernel(compiled, tail, torch.cuda.current_device())


def direct_stream(device: int) -> int | None:
    """The raw stream to launch on, or None when a direct launch must not be made: a
    precompile block records launches, or another device is current."""
    if recording() or current_device() != device:
        return None
    return current_stream(device)


class DirectLaunches:
    """The launches of one call of a multi-launch op, kept for direct launches.

    ``capture(done, sources, per_step)`` takes what the call launched (``(launcher, grid,
    args, constexprs)`` per launch) and the call's tensors by name; each launch's leading
    tensor arguments must each be one of those tensors (by identity), its other arguments
    are kept as they were, except the first ``per_step[launcher]`` integers, which the caller
    gives per call. ``ready`` once every launcher in ``order`` is kept; then ``launch(ptrs,
    grids, step_ints)`` launches them in order (``ptrs``: name -> data pointer; a launch
    with grid 0 is skipped). ``aligned`` names the pointers that must be 16-byte aligned
    for the kept kernels (the ones Triton keys on)."""

    def __init__(self, order: list[str]):
        self.order = order
        self.kernels: dict[str, tuple] = {}
        self.aligned: set[str] = set()
        self.failed = False  # a pointer argument was none of the call's tensors
        self.direct: tuple | None = None

    @property
    def ready(self) -> bool:
        return self.direct is not None

    def capture(self, done: list[tuple], sources: dict, per_step: dict) -> None:
        names_by_id: dict = {}
        for name, t in sources.items():
            if t is not None:
                names_by_id.setdefault(id(t), name)
        for launcher, _, args, constexprs in done:
            if launcher.name in self.kernels:
                continue
            k = 0
            while k < len(args) and isinstance(args[k], torch.Tensor):
                k += 1
            names = tuple(names_by_id.get(id(a)) for a in args[:k])
            if None in names:
                self.failed = True
                return
            fast = direct_kernel(launcher, args, constexprs)
            if fast is None:
                return  # not compiled, recording, or an unaligned pointer: a later call
            n_step = per_step.get(launcher.name, 0)
            self.kernels[launcher.name] = (fast.fn, fast.head, names, args[k + n_step :],
                                           fast.tail)  # fmt: skip
            self.aligned |= {names[i] for i in range(k) if launcher.keys_alignment(i)}
        if all(name in self.kernels for name in self.order):
            self.direct = tuple(self.kernels[name] for name in self.order)

    def launch(self, device: int, ptrs: dict, grids: tuple, step_ints: tuple) -> bool:
        """Launch every kept kernel; False (nothing launched) when a direct launch must not
        be made (see ``direct_stream``) or a pointer is not aligned."""
        stream = direct_stream(device)
        if stream is None:
            return False
        acc = 0
        for name in self.aligned:
            acc |= ptrs[name]
        if acc & 15:
            return False
        for (fn, head, names, ints, tail), grid, step in zip(self.direct, grids, step_ints,
                                                              strict=True):  # fmt: skip
            if grid:
                fn(grid, 1, 1, stream, *head, *[ptrs[n] for n in names], *step, *ints, *tail)
        return True
