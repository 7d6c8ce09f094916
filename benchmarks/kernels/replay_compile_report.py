"""The replayed decode kernel (``_replay_ssm_kernel``) compiled for sm_90 on a CPU, per state
dtype, flush ("loop", "tf32x3", "xsplit"; "loop/split": a split step's first launch, which
holds no flush code; "/bc": with bc_pre, the step kernel reading the launch ahead's B_k . C;
"/fused": with fuse_flush) and tile: registers, stack (spills) and shared memory,
as cuobjdump reads them off the cubin (Triton's own ptxas; no GPU).

    python -m benchmarks.kernels.replay_compile_report [--tiles 32x32x1 64x64x2] [--json F]

Codestral-7B's layer (128 heads x 64, state 128, 8 groups), L = 16, batch 128, a decode
step's launch as the op makes it (recorded, not run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compile the real kernel

import torch  # noqa: E402

from benchmarks.kernels.sm90_compile import LaunchRecorder, compile_cold, resources  # noqa: E402

H, P, N, G, L, BATCH = 128, 64, 128, 8, 16, 128
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TILES = ("32x32x1", "16x64x1", "32x64x2", "64x64x2")  # BLOCK_P x BLOCK_N x num_warps


def zero_pool(state_dtype: torch.dtype, lines: int):
    """A ``ReplayedSSMState`` of ``lines`` lines at the layer's shape, bf16 rings, zeros."""
    from vllm.model_executor.layers.mamba.ops.mamba_ssm_replay_ref import ReplayedSSMState

    act = torch.bfloat16
    return ReplayedSSMState(
        torch.zeros(lines, H, P, N, dtype=state_dtype),
        torch.zeros(lines, H, L - 1, P, dtype=act),
        torch.zeros(lines, G, L - 1, N, dtype=act),
        torch.zeros(lines, H, L - 1, dtype=torch.float32),
        torch.zeros(lines, H, P, dtype=torch.int8),
    )


def recorded(state_dtype: torch.dtype, cfg: dict, kind: str = "step", batch: int = BATCH) -> list:
    """(kernel, args, constexprs) of every launch variant a decode step (``kind`` "step") or
    a materialisation ("materialise", "materialise_init": with ``has_initial_state``) makes
    with launch configuration ``cfg`` (recorded, not run; a split step's first is PART 1;
    ``bc_pre``'s launch ahead comes first)."""
    from vllm.model_executor.layers.mamba.ops import mamba_ssm_replay as rp
    from vllm.triton_utils import launch

    act = torch.bfloat16
    rs = zero_pool(state_dtype, batch + 1)
    A, D, dt_bias = torch.zeros(H), torch.zeros(H), torch.zeros(H)
    idx = torch.arange(1, batch + 1, dtype=torch.int32)
    if kind == "step":
        x, dt = torch.zeros(batch, H, P, dtype=act), torch.zeros(batch, H, dtype=act)
        B = torch.zeros(batch, G, N, dtype=act)
        step = (x, dt, A, B, B.clone(), D, dt_bias, True, 0.0, float("inf"), idx, None)
        out = torch.empty_like(x)
    else:
        init = torch.ones(batch, dtype=torch.bool) if kind == "materialise_init" else None
        step = (None, None, A, None, None, None, None, False, 0.0, float("inf"), idx, init)
        out = None
    recorder = LaunchRecorder()
    real = rp.launch_config
    rp.launch_config = lambda *a: dict(cfg)
    launch._SESSION = recorder
    try:
        rp._launch(*rs.tensors(), *step, 0, out)
    finally:
        launch._SESSION = None
        rp.launch_config = real
    return [(launcher.kernel, args, c) for launcher, args, c in recorder.launches]


def record(state_dtype: torch.dtype, cfg: dict):
    """(kernel, args, constexprs) of one decode step's first launch of the step kernel with
    ``cfg``."""
    from vllm.model_executor.layers.mamba.ops import mamba_ssm_replay as rp

    return next(r for r in recorded(state_dtype, cfg) if r[0] is rp._replay_ssm_kernel)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiles", nargs="*", default=list(TILES), help="BLOCK_PxBLOCK_Nxwarps")
    p.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=list(DTYPES))
    flushes = ["loop", "tf32x3", "xsplit", "loop/split", "xsplit/bc", "loop/split+bc",
               "loop/fused", "xsplit/fused", "tf32x3/fused+bc"]  # fmt: skip
    p.add_argument("--flushes", nargs="*", default=flushes)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = []
    for dtype in args.dtypes:
        for flush in args.flushes:
            for tile in args.tiles:
                bp, bn, nw = (int(v) for v in tile.split("x"))
                # "<flush>/split": the step in two launches; the first (outputs and
                # appends, no flush code) is the one compiled here. "/bc": bc_pre (the
                # step kernel, which reads the products the launch ahead wrote).
                method, _, mods = flush.partition("/")
                mods = set(mods.split("+"))
                cfg = dict(BLOCK_P=bp, BLOCK_N=bn, num_warps=nw, flush=method,
                           split_flush="split" in mods, bc_pre="bc" in mods,
                           fuse_flush="fused" in mods)  # fmt: skip
                kernel, largs, constexprs = record(DTYPES[dtype], cfg)
                compiled, seconds = compile_cold(kernel, largs, constexprs)
                res = resources(compiled)
                row = dict(state_dtype=dtype, flush=flush, tile=tile, compile_s=seconds,
                           regs=res["regs"], stack=res["stack"], shared=res["shared"],
                           dot=bool(constexprs["FLUSH_DOT"]),
                           bc_pre=bool(constexprs["BC_PRE"]),
                           fused=bool(constexprs["FUSE_FLUSH"]),
                           xsplit=bool(constexprs["FLUSH_XSPLIT"]),
                           part=constexprs["PART"])  # fmt: skip
                rows.append(row)
                print(f"{dtype} {flush:10s} {tile:8s}: regs {row['regs']:3d} stack "
                      f"{row['stack']:5d} shared {row['shared']:5d}  ({seconds:.1f} s)",
                      flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(shape=dict(H=H, P=P, N=N, G=G, L=L, batch=BATCH), rows=rows,
                           flushes=args.flushes), f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
