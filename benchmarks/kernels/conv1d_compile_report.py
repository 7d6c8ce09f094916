"""Compile every variant of the conv forward for sm_90 on a machine without a GPU, timing
each compile: what a cold start spends on the conv, and which variant is its long pole.

    python -m benchmarks.kernels.conv1d_compile_report [--dim 10240] [--dtype bf16]
        [--configs many_heads tiles ...] [--kernels-module NAME] [--json PATH]

A mixed step of the given feature count is recorded (not run) through ``causal_conv1d_fn``
with the flags the engine launches with (bias, silu, cache indices, initial states, step
metadata, a feature-contiguous state pool); the launch site's whole configuration table
(``_fwd_variants``, what the engine's start-up compiles) is then bound and specialised as
the JIT would bind it on the GPU and compiled for ``cuda:90`` with the ptxas that ships with
Triton, one variant at a time, each into an empty cache folder. ``--kernels-module`` compiles
the ``_causal_conv1d_fwd_kernel`` of another copy of ``causal_conv1d_kernels.py`` instead,
for a before/after: an older commit's, ``git show COMMIT:vllm/model_executor/layers/mamba/
ops/causal_conv1d_kernels.py > DIR/old_conv.py``, then ``PYTHONPATH=.:DIR`` and
``--kernels-module old_conv``. Seconds are this machine's CPU,
one compile at a time (the start-up compiles in parallel threads, so its long pole is the
slowest variant, not the sum).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compile the real kernels

import torch

from benchmarks.kernels.sm90_compile import LaunchRecorder, compile_cold, resources

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def record_variants(dim: int, dtype, width: int = 4) -> list:
    """(launcher, args, constexprs) of every forward variant a mixed step's launch site
    can select: a 300-token prefill and 40 decodes, all with initial states."""
    from vllm.model_executor.layers.mamba.ops import causal_conv1d as conv
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
        compute_causal_conv1d_metadata,
    )
    from vllm.triton_utils import launch

    lens = [300] + [1] * 40
    qsl = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(len(lens))], dtype=torch.int32)
    tokens, batch = int(qsl[-1]), len(lens)
    x = torch.randn(tokens, dim).to(dtype).t()
    weight, bias = torch.randn(dim, width).to(dtype), torch.randn(dim).to(dtype)
    pool = torch.zeros(batch + 1, width - 1, dim, dtype=dtype).transpose(1, 2)
    meta = compute_causal_conv1d_metadata(qsl, "cpu")
    recorder = LaunchRecorder()
    real = conv._use_kernel
    conv._use_kernel = lambda x: True  # record the launch instead of running the reference
    launch._SESSION = recorder
    try:
        conv._fwd_impl(
            x, weight, bias, pool, qsl, torch.arange(1, batch + 1, dtype=torch.int32),
            torch.ones(batch, dtype=torch.bool), True, 0, meta.tile_seq, meta.block_t,
        )  # fmt: skip
    finally:
        launch._SESSION = None
        conv._use_kernel = real
    return recorder.launches


def config_name(constexprs: dict, elem_size: int) -> str:
    from vllm.model_executor.layers.mamba.ops.causal_conv1d_host import _fwd_configs

    for name, cfg in _fwd_configs(elem_size).items():
        if all(constexprs.get(k) == v for k, v in cfg.items()):
            return name
    return "?"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=10240, help="features (Codestral-7B: 10240)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--configs", nargs="*", default=None, help="only these configurations")
    p.add_argument("--kernels-module", default=None, help="another causal_conv1d_kernels")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dtype = DTYPES[args.dtype]
    elem_size = torch.finfo(dtype).bits // 8
    kernel = None
    if args.kernels_module:
        kernel = importlib.import_module(args.kernels_module)._causal_conv1d_fwd_kernel
    rows = []
    for launcher, largs, constexprs in record_variants(args.dim, dtype):
        name = config_name(constexprs, elem_size)
        if args.configs and name not in args.configs:
            continue
        compiled, seconds = compile_cold(kernel or launcher.kernel, largs, constexprs)
        res = resources(compiled)
        rows.append(dict(config=name, BLOCK_T=constexprs["BLOCK_T"], compile_s=seconds,
                         regs=res["regs"], stack=res["stack"],
                         ptx_kb=len(compiled.asm["ptx"]) // 1024))  # fmt: skip
        r = rows[-1]
        print(f"{name:11s} BLOCK_T {r['BLOCK_T']:3d}: {seconds:6.2f} s  regs {r['regs']:3d} "
              f"stack {r['stack']:3d}  ptx {r['ptx_kb']} KiB", flush=True)  # fmt: skip
    if not rows:
        p.error(f"no variant matches --configs {args.configs}")
    slowest = max(rows, key=lambda r: r["compile_s"])
    total = sum(r["compile_s"] for r in rows)
    print(f"slowest: {slowest['config']} BLOCK_T {slowest['BLOCK_T']} "
          f"{slowest['compile_s']:.2f} s; all: {total:.2f} s")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(dim=args.dim, dtype=args.dtype, kernels_module=args.kernels_module,
                           variants=rows), f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
