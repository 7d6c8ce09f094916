"""Sweep the Triton SSD's launch configurations (``ssd_combined.ssd_configs``), one kernel at
a time, at the Codestral layer shape.

    python benchmarks/kernels/tune_ssd.py [--cases 1x2048 1x8192 16x512_init] [--json F]

For each case (``ssd_bench_cases``: bf16 activations, fp32 pool), each variant changes one
kernel's constexprs from the default table; every variant is compiled first, in parallel
(``vllm.triton_utils.launch.precompile``), then checked against the fp32 recurrence (rel-L2
of y and of the final states) and timed cold (median of ``--reps``). A profiler pass of the
default configuration splits its time by kernel. The table prints best first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark_utils import ColdTimer  # noqa: E402
from ssd_bench_cases import CASES, build_inputs, reference, rel_l2  # noqa: E402

from vllm.model_executor.layers.mamba.ops import ssd_combined  # noqa: E402
from vllm.model_executor.layers.mamba.ops.ssd_launch import PLANS  # noqa: E402
from vllm.triton_utils.launch import precompile  # noqa: E402

# (kernel, changes); "default" first.
VARIANTS = [("default", {})]
VARIANTS += [
    ("chunk_scan", c)
    for c in (
        dict(SPLIT_STATE=False),
        dict(SPLIT=True, SPLIT_STATE=True, num_stages=2),
        dict(SPLIT=True, SPLIT_STATE=True),
        dict(num_stages=2),
        dict(num_stages=3),
        dict(ROW_BLOCKS=2),
        dict(BLOCK_N=128),
        dict(BLOCK_S=64),
    )
]
VARIANTS += [
    ("chunk_state", c)
    for c in (
        dict(SPLIT=False),
        dict(BLOCK_N=64),
        dict(num_warps=8),
        dict(num_stages=1),
        dict(num_stages=3),
        dict(BLOCK_T=32),
        dict(BLOCK_T=128, num_warps=8),
        dict(SPLIT=False, BLOCK_N=64),
    )
]
VARIANTS += [
    ("state_passing", c)
    for c in (dict(num_warps=8), dict(BLOCK_N=64), dict(num_stages=2), dict(BLOCK_SP=32))
]


def patched(kernel: str, changes: dict):
    original = ssd_combined.ssd_configs

    def configs(*args):
        table = {k: dict(v) for k, v in original(*args).items()}
        if kernel in table:
            table[kernel].update(changes)
        return table

    return original, configs


def run_variant(kernel, changes, call):
    original, configs = patched(kernel, changes)
    ssd_combined.ssd_configs = configs
    PLANS.clear()  # plans keep the configuration they were made with
    try:
        return call()
    finally:
        ssd_combined.ssd_configs = original
        PLANS.clear()


def kernel_split(call, reps: int = 5) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and "ssd" in e.key:
            out[e.key] = e.device_time_total / reps
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="+", default=["1x2048", "1x8192", "16x512_init"])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    timer = ColdTimer()
    results = {}
    for name in args.cases:
        case = CASES[name]
        inp = build_inputs(case, torch.bfloat16, torch.float32, "cuda", seed=0)
        ref_y, ref_s = reference(case, inp)
        layout = ssd_combined.plan_ssd_chunks(inp.qsl_cpu, case.shape.chunk).to("cuda")
        out = torch.empty_like(inp.x)
        kw = dict(D=inp.D, dt_bias=inp.dt_bias, dt_softplus=True, out=out)

        def call(pool, inp=inp, layout=layout, kw=kw):
            return ssd_combined.mamba_chunk_scan_combined_varlen(
                inp.x, inp.dt, inp.A, inp.B, inp.C, layout, pool, inp.idx, inp.init, **kw
            )

        pool = inp.pool.clone()
        with precompile() as report:
            for kernel, changes in VARIANTS:
                run_variant(kernel, changes, lambda pool=pool, call=call: call(pool))
        print(f"\n{name}: compiled {report.num_new} variants in {report.seconds:.1f} s")
        split = kernel_split(lambda pool=pool, call=call: call(pool))
        print("  default by kernel: " + ", ".join(f"{k} {v:.0f} us" for k, v in split.items()))
        rows = []
        for kernel, changes in VARIANTS:
            pool = inp.pool.clone()
            try:
                y = run_variant(kernel, changes, lambda pool=pool, call=call: call(pool))
                ey = rel_l2(y, ref_y)
                es = rel_l2(pool.index_select(0, inp.idx.long()), ref_s)
                samples = run_variant(
                    kernel,
                    changes,
                    lambda pool=pool, call=call: timer.samples(lambda: call(pool), args.reps),
                )
            except Exception as e:  # a variant that fails is reported, not fatal
                print(f"  {kernel} {changes}: FAILED {type(e).__name__}: {str(e)[:200]}")
                continue
            rows.append(
                dict(kernel=kernel, changes=changes, us=statistics.median(samples), y=ey, s=es)
            )
        base = rows[0]["us"]
        results[name] = dict(split=split, rows=rows)
        for r in sorted(rows, key=lambda r: r["us"]):
            ok = "ok " if r["y"] < 5e-3 and r["s"] < 5e-3 else "BAD"
            print(
                f"  {r['us']:8.1f} us {base / r['us']:5.2f}x {ok} y {r['y']:.1e} s {r['s']:.1e}"
                f"  {r['kernel']} {r['changes']}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
