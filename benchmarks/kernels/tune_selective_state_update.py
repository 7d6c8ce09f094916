"""Sweep the decode state update's launch configuration (``mamba_ssm_triton._update_config``).

    python -m benchmarks.kernels.tune_selective_state_update [--batches 64,128,256] [--json F]

One layer of the Codestral-7B decode step (128 heads x 64 x 128 state, 8 groups, bf16
activations, the pool's lines shuffled), state pool fp32 and bf16. Each configuration is
checked against ``selective_state_update_torch`` first, then timed cold (the state lines of
a batch are 256-512 MiB, far past the L2, so "cold" is what a decode step sees). Bytes
counted: every state line read and written once, plus x, dt, B, C and out. The table gives
GB/s and the share of the device-copy bandwidth measured in the same run, best first.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from benchmarks.kernels.benchmark_utils import ColdTimer, copy_gbps, summarize
from vllm.model_executor.layers.mamba.ops import mamba_ssm_triton as ssm
from vllm.model_executor.layers.mamba.ops.mamba_ssm_torch import (
    selective_state_update_torch,
)

H, P, N, G = 128, 64, 128, 8


def make_case(batch: int, state_dtype: torch.dtype, gen: torch.Generator):
    lines = batch + 8
    state = torch.randn(lines, H, P, N, generator=gen).to("cuda", state_dtype)
    x = torch.randn(batch, H, P, generator=gen).to("cuda", torch.bfloat16)
    dt = torch.randn(batch, H, generator=gen).to("cuda", torch.bfloat16)
    B = torch.randn(batch, G, N, generator=gen).to("cuda", torch.bfloat16)
    C = torch.randn(batch, G, N, generator=gen).to("cuda", torch.bfloat16)
    A = -torch.rand(H, generator=gen).add(0.5).cuda()
    D = torch.rand(H, generator=gen).cuda()
    dt_bias = torch.rand(H, generator=gen).cuda() - 3
    idx = (1 + torch.randperm(lines - 1, generator=gen)[:batch]).to("cuda", torch.int32)
    kwargs = dict(D=D, dt_bias=dt_bias, dt_softplus=True, state_batch_indices=idx)
    nbytes = 2 * batch * H * P * N * state.element_size() + 2 * x.numel() * 2
    return state, (x, dt, A, B, C), kwargs, nbytes


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="64,128,256")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    timer = ColdTimer()
    gbps = copy_gbps(timer=timer)
    print(f"device copy: {gbps:.0f} GB/s")
    default = ssm._update_config
    configs = [
        dict(BLOCK_P=bp, BLOCK_N=128, num_warps=nw)
        for bp, nw in itertools.product((4, 8, 16, 32, 64), (1, 2, 4, 8))
        if bp * 128 // (32 * nw) >= 4  # at least 4 state elements per thread
    ]
    results = {"copy_gbps": gbps, "default": default(1, H, P, N), "cases": {}}
    gen = torch.Generator().manual_seed(0)
    for batch, sdt in itertools.product(map(int, args.batches.split(",")), ("fp32", "bf16")):
        dtype = torch.float32 if sdt == "fp32" else torch.bfloat16
        state, tensors, kwargs, nbytes = make_case(batch, dtype, gen)
        ref_state = state.clone()
        want = selective_state_update_torch(ref_state, *tensors, **kwargs)
        rows = []
        for cfg in configs:
            ssm._update_config = lambda *a, cfg=cfg: dict(cfg)
            try:
                s = state.clone()
                got = ssm.selective_state_update_triton(s, *tensors, **kwargs)
                err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                serr = ((s.float() - ref_state.float()).norm() / ref_state.float().norm()).item()
                ok = err < 2e-2 and serr < 2e-2
                work = state.clone()
                us, lo, hi = summarize(
                    timer.samples(
                        lambda w=work, t=tensors, k=kwargs: ssm.selective_state_update_triton(
                            w, *t, **k
                        ),
                        args.reps,
                    )
                )
            except Exception as e:  # a config that fails to compile is reported, not fatal
                print(f"B{batch} {sdt} {cfg}: FAILED {type(e).__name__}: {e}")
                continue
            finally:
                ssm._update_config = default
            rows.append(
                dict(cfg=cfg, us=us, p20=lo, p80=hi, ok=ok, err=err, gbps=nbytes / us / 1e3)
            )
        rows.sort(key=lambda r: r["us"])
        name = f"B{batch}_state{sdt}"
        results["cases"][name] = rows
        print(f"\n{name}: {nbytes / 2**20:.0f} MiB moved; default {default(batch, H, P, N)}")
        for r in rows[:8]:
            c = r["cfg"]
            print(
                f"  P{c['BLOCK_P']:<3d} w{c['num_warps']}  {r['us']:8.1f} us "
                f"[{r['p20']:.1f}, {r['p80']:.1f}]  {r['gbps']:6.0f} GB/s "
                f"{100 * r['gbps'] / gbps:5.1f}% of copy  ok={r['ok']}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
