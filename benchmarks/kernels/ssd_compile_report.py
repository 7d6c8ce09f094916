"""Compile the SSD's three kernels for sm_90 on a machine without a GPU, and report what
ptxas made of them: registers, spills, stack and shared memory per kernel.

    python -m benchmarks.kernels.ssd_compile_report [--shape codestral|granite]
        [--dtype bf16] [--set chunk_scan.BLOCK_K=32 ...]

The op's launches are recorded (not run) for a small step of the model's shape, with the
configuration ``ssd_configs`` gives plus the ``--set`` changes; each recorded launch is
bound and specialised as Triton's JIT would bind it on the GPU (16-byte aligned pointers,
ints equal to 1 or divisible by 16), compiled for ``cuda:90`` with the ptxas that ships
with Triton (each into an empty cache folder, timed: a cold start's compile on this CPU),
and its cubin read back with the cuobjdump beside it. Nothing runs: this
costs no device time, and a configuration that spills or overflows shared memory shows
here first.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile the real kernels

import torch

HERE = Path(__file__).resolve().parent

SHAPES = {
    "codestral": dict(nheads=128, headdim=64, dstate=128, ngroups=8, chunk=256),
    "granite": dict(nheads=128, headdim=64, dstate=256, ngroups=1, chunk=256),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class _Recorder:
    """Stands in for ``launch._SESSION``: keeps each launch instead of running it."""

    def __init__(self):
        self.launches = []

    def add(self, launcher, grid, args, variants):
        self.launches.append((launcher, args, variants[0]))


def record_launches(shape: dict, dtype, out_dtype, changes: dict) -> list:
    from vllm.model_executor.layers.mamba.ops import ssd_combined
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import NULL_BLOCK_ID
    from vllm.model_executor.layers.mamba.ops.ssd_launch import PLANS
    from vllm.triton_utils import launch

    original = ssd_combined.ssd_configs

    def patched(*args):
        table = {k: dict(v) if isinstance(v, dict) else v for k, v in original(*args).items()}
        for name, value in changes.items():
            kernel, _, key = name.partition(".")
            if key:
                table[kernel][key] = value
            else:
                table[kernel] = value
        return table

    H, P, N, G, L = (shape[k] for k in ("nheads", "headdim", "dstate", "ngroups", "chunk"))
    T = 2 * L + 3
    x = torch.randn(T, H, P).to(dtype)
    B, C = torch.randn(T, G, N).to(dtype), torch.randn(T, G, N).to(dtype)
    dt = torch.randn(T, H).to(dtype)
    pool = torch.zeros(4, H, P, N)
    layout = ssd_combined.plan_ssd_chunks(torch.tensor([0, L + 1, T], dtype=torch.int32), L)
    recorder = _Recorder()
    ssd_combined.ssd_configs = patched
    PLANS.clear()
    launch._SESSION = recorder
    try:
        ssd_combined._launch(
            x, None, dt, -torch.rand(H), B, C, layout.chunk_starts, layout.chunk_seqs,
            layout.seq_chunk_starts, L, pool, torch.tensor([0, 2], dtype=torch.int32),
            torch.tensor([True, False]).view(torch.uint8).view(torch.bool), None,
            torch.randn(H), torch.randn(H), True, 0.0, float("inf"),
            torch.empty(T, H, P, dtype=out_dtype), NULL_BLOCK_ID,
        )  # fmt: skip
    finally:
        launch._SESSION = None
        ssd_combined.ssd_configs = original
        PLANS.clear()
    return recorder.launches


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--shape",
        default="codestral",
        help=f"{' | '.join(SHAPES)} | H,P,N,G,L (heads, headdim, dstate, groups, chunk)",
    )
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--out-dtype", choices=DTYPES, default=None)
    p.add_argument("--set", nargs="*", default=[], help="kernel.KEY=VALUE changes")
    args = p.parse_args(argv)
    changes = {}
    for item in args.set:
        key, value = item.split("=", 1)
        changes[key] = value if not value.lstrip("-").isdigit() else int(value)
        if value in ("True", "False"):
            changes[key] = value == "True"
    dtype = DTYPES[args.dtype]
    out_dtype = DTYPES[args.out_dtype or args.dtype]
    if args.shape in SHAPES:
        shape = SHAPES[args.shape]
    else:
        shape = dict(zip(("nheads", "headdim", "dstate", "ngroups", "chunk"),
                         map(int, args.shape.split(",")), strict=True))  # fmt: skip
    import triton

    for launcher, largs, constexprs in record_launches(shape, dtype, out_dtype, changes):
        triton.knobs.cache.dir = tempfile.mkdtemp(prefix="ssd_compile_")  # a cold compile
        t0 = time.perf_counter()
        try:
            res = resources(compile_sm90(launcher.kernel, largs, constexprs))
        except Exception as err:  # a config that does not compile is the finding
            print(f"{launcher.name:34s} FAILED: {type(err).__name__}: {str(err)[:300]}")
            continue
        seconds = time.perf_counter() - t0
        cfg = {k: v for k, v in constexprs.items() if k.startswith(("BLOCK", "num_", "SPLIT"))}
        print(f"{launcher.name:34s} regs {res['regs']:3d} stack {res['stack']:4d} local "
              f"{res['local']:4d} shared {res['shared']:6d} compile {seconds:5.2f} s  "
              f"{cfg}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
