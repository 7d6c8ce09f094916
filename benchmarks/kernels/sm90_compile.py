"""Compiling recorded kernel launches for sm_90 on a machine without a GPU, for the compile
reports (ssd_compile_report, conv1d_compile_report, moe_compile_report, ssd_compile_compare,
tests/kernels/mamba/selective_scan_compile.py): a recorder that stands in for
``launch._SESSION``, the JIT's binding and specialisation, a cold timed compile with the
ptxas that ships with Triton, what cuobjdump reads off the cubin, and the loops of its SASS
(nvdisasm). The reports turn Triton's interpreter off before importing any kernel; this
module imports Triton lazily."""

from __future__ import annotations

import collections
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
    text = run_tool("cuobjdump", compiled.asm["cubin"], "-res-usage") or ""
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


def tools_dir() -> Path:
    """The CUDA tools Triton's NVIDIA backend ships (ptxas, cuobjdump, nvdisasm)."""
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def run_tool(name: str, cubin: bytes, *flags: str) -> str | None:
    """stdout of one of those tools run on ``cubin``, or None where it is missing."""
    tool = tools_dir() / name
    if not tool.is_file():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), *flags, f.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip


_OPCODE = re.compile(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")
_LABEL = re.compile(r"\s*(\.L_x_\d+):")
_BACK = re.compile(r"BRA\s+`?\(?(\.L_x_\d+)\)?")


def sass_opcode(line: str) -> str | None:
    """The opcode of one nvdisasm line (predicate and modifiers dropped), or None."""
    m = _OPCODE.search(line)
    return m.group(1) if m else None


def sass_loops(cubin: bytes) -> tuple[list[str], list[tuple[collections.Counter, list[str]]]]:
    """(the SASS lines, and per loop, i.e. a branch back to an earlier label, its opcode
    counts and its lines from the label to the branch); ([], []) without nvdisasm. A
    kernel's trailing branch to itself is no loop."""
    text = run_tool("nvdisasm", cubin, "-c")
    if text is None:
        return [], []
    lines = text.splitlines()
    labels = {m.group(1): i for i, ln in enumerate(lines) if (m := _LABEL.match(ln))}
    loops = []
    for i, line in enumerate(lines):
        m = _BACK.search(line)
        if m and labels.get(m.group(1), i) < i - 1:
            body = lines[labels[m.group(1)] : i + 1]
            loops.append((collections.Counter(filter(None, map(sass_opcode, body))), body))
    return lines, loops
