"""Launch a Triton kernel with less host work than ``kernel[grid](...)``.

``JITFunction.run`` binds arguments, reads Triton's knobs, checks globals and builds
launch metadata on every call: tens of microseconds on the host, more than a decode
step's GPU time. ``CachedLauncher`` keeps each compiled kernel under a key that holds
everything Triton specialises a compiled kernel on (argument dtypes, 16-byte alignment
of pointers, ints equal to 1 or divisible by 16 and their width, the constexprs and
launch options), so a hit is exactly the kernel Triton would pick, launched directly.
A miss goes through ``kernel[grid](...)``, which compiles (or finds) and launches it.

Under ``TRITON_INTERPRET=1`` every call takes the ordinary path.
"""

from __future__ import annotations

import torch

from vllm import envs
from vllm.triton_utils import HAS_TRITON

_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


def _spec(arg) -> object:
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if arg is None:
        return None
    if isinstance(arg, bool):
        return ("b", arg)
    if isinstance(arg, int):
        return ("i", arg == 1, arg % 16 == 0, _I32_MIN <= arg <= _I32_MAX)
    if isinstance(arg, float):
        return ("f",)
    raise TypeError(f"unsupported kernel argument type {type(arg).__name__}")


class CachedLauncher:
    """``launcher(grid, args, constexprs)`` == ``kernel[grid](*args, **constexprs)``.

    ``args`` are the kernel's runtime parameters, in order, ahead of its constexpr
    parameters; ``constexprs`` holds the constexpr parameters and launch options
    (``num_warps``, ``num_stages``).
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self.cache: dict = {}
        self.direct = hasattr(kernel, "device_caches")  # a JITFunction, not the interpreter

    def runs_cpu_tensors(self) -> bool:
        """CPU tensors may go to the kernel: Triton is installed, its interpreter is on
        (TRITON_INTERPRET=1) and the kernel was built for it, i.e. the variable was set
        before the kernel's module was imported. Set later, as by a CPU run inside a
        process that imported the kernels for the GPU, the kernel is a compiled one,
        which cannot read CPU tensors."""
        return HAS_TRITON and envs.TRITON_INTERPRET and not self.direct

    def __call__(self, grid: tuple[int, ...], args: tuple, constexprs: dict) -> None:
        if not self.direct:
            self.kernel[grid](*args, **constexprs)
            return
        device = torch.cuda.current_device()
        key = (device, tuple(map(_spec, args)), tuple(constexprs.items()))
        entry = self.cache.get(key)
        if entry is None:
            compiled = self.kernel[grid](*args, **constexprs)
            if hasattr(compiled, "result"):  # an asynchronous compile
                compiled = compiled.result()
            names = self.kernel.arg_names[len(args) :]
            tail = tuple(constexprs[n] for n in names)
            compiled._init_handles()
            self.cache[key] = (compiled, tail)
            return
        compiled, tail = entry
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = torch.cuda.current_stream(device).cuda_stream
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
