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
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compile the real kernels

import torch

from benchmarks.kernels.sm90_compile import LaunchRecorder, compile_cold, resources

SHAPES = {
    "codestral": dict(nheads=128, headdim=64, dstate=128, ngroups=8, chunk=256),
    "granite": dict(nheads=128, headdim=64, dstate=256, ngroups=1, chunk=256),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def record_launches(shape: dict, dtype, out_dtype, changes: dict) -> list:
    from vllm.model_executor.layers.mamba.ops import ssd_combined
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import NULL_BLOCK_ID
    from vllm.model_executor.layers.mamba.ops.ssd_launch import PLANS
    from vllm.triton_utils import launch

    original = ssd_combined.ssd_configs

    def patched(*args):
        table = {k: dict(v) if isinstance(v, dict) else v for k, v in original(*args).items()}
        # The entry's own configs; a many-chunks chunk state (``ssd_configs``' "many") is
        # reported by naming its keys with --set (e.g. chunk_state.FUSED_PASS=true).
        table["many"] = None
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
    recorder = LaunchRecorder(first_only=True)
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
    for launcher, largs, constexprs in record_launches(shape, dtype, out_dtype, changes):
        try:
            compiled, seconds = compile_cold(launcher.kernel, largs, constexprs)
        except Exception as err:  # a config that does not compile is the finding
            print(f"{launcher.name:34s} FAILED: {type(err).__name__}: {str(err)[:300]}")
            continue
        res = resources(compiled)
        cfg = {k: v for k, v in constexprs.items() if k.startswith(("BLOCK", "num_", "SPLIT"))}
        print(f"{launcher.name:34s} regs {res['regs']:3d} stack {res['stack']:4d} local "
              f"{res['local']:4d} shared {res['shared']:6d} compile {seconds:5.2f} s  "
              f"{cfg}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
