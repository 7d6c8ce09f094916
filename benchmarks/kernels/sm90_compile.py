"""Compiling recorded kernel launches for sm_90 on a machine without a GPU, for the compile
reports (ssd_compile_report, conv1d_compile_report): a recorder that stands in for
``launch._SESSION``, the JIT's binding and specialisation, a cold timed compile with the
ptxas that ships with Triton, and what cuobjdump reads off the cubin. The reports turn
Triton's interpreter off before importing any kernel; this module imports Triton lazily."""

from __future__ import annotations

import re
import subprocess
import tempfile
import time
from pathlib import Path


class LaunchRecorder:
    """Stands in for ``launch._SESSION``: keeps each launch instead of running it, with
    every variant its site could select (or only the one asked for, ``first_only``)."""

    def __init__(self, first_only: bool = False):
        self.first_only = first_only
        self.launches = []

    def add(self, launcher, grid, args, variants):
        for constexprs in variants[:1] if self.first_only else variants:
            self.launches.append((launcher, args, constexprs))


def compile_sm90(kernel, args, constexprs):
    """Bind and specialise as the JIT does, then compile for cuda:90."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **constexprs)
    options, signature, consts, attrs = kernel._pack_args(backend, constexprs, bound,
                                                          specialization, options)  # fmt: skip
    src = ASTSource(kernel, signature, consts, attrs)
    return compile(src, target=target, options=options.__dict__)


def compile_cold(kernel, args, constexprs):
    """(compiled, seconds): ``compile_sm90`` into an empty cache folder, as a cold start."""
    import triton

    triton.knobs.cache.dir = tempfile.mkdtemp(prefix="sm90_compile_")
    t0 = time.perf_counter()
    compiled = compile_sm90(kernel, args, constexprs)
    return compiled, time.perf_counter() - t0


def resources(compiled) -> dict:
    import triton

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([str(tools / "cuobjdump"), "-res-usage", f.name],
                              capture_output=True, text=True).stdout  # fmt: skip
    found = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text))
    spills = re.findall(r"(\d+) bytes spill stores", compiled.asm.get("ptx", "") or "")
    return dict(
        regs=int(found.get("REG", -1)),
        stack=int(found.get("STACK", -1)),
        local=int(found.get("LOCAL", -1)),
        shared_static=int(found.get("SHARED", -1)),
        shared=compiled.metadata.shared,
        spill_note=spills,
    )
