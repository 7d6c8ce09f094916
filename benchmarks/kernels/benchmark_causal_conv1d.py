"""Causal-conv1d benchmark: our Triton ops, our CUDA ops, the torch reference, and
Dao-AILab's ``causal_conv1d`` package when it is importable.

    python -m benchmarks.kernels.benchmark_causal_conv1d [--quick] [--dims 8448 ...]
        [--cases prefill mixed decode] [--providers triton cuda torch dao] [--out DIR]

bf16, width 4, SiLU, bias; state pools of 1024 lines, sequences on shuffled lines.

- prefill: 2048, 8192, 32768 and 131072 tokens as 1 and as 16 equal sequences, no
  initial state.
- mixed: one 2048-token prefill with an initial state, then 15, 63 or 255 one-token
  decodes with initial states. Triton: one ``causal_conv1d_fn`` call. CUDA: the forward
  op on the prefill and the update op on the decodes, both writing into one output.
  Dao: its update on the decodes, its fn on the prefill with initial and final states,
  and a copy of the final state into the line (the old vLLM CUDA path; no concat).
- decode: 1, 8, 32, 128, 256 and 512 sequences of one token.

Each provider keeps its state pool in its own layout (Triton: feature-contiguous;
CUDA and Dao decode: width-contiguous; Dao mixed: feature-contiguous, as vLLM had it).
Before timing, each provider runs once on the case's data and is compared with the fp32
reference: every output within 2e-2 + 1e-2 * |ref| and no NaN, and the state pool equal
to the reference's, bit for bit (Dao's varlen prefill writes no states: not checked).
A provider that fails is not timed, and the run exits with 1.

Times (benchmark_utils.py): "cold" GPU time of one call (L2 flushed, host launch hidden
behind a GPU sleep), median with p20/p80, for every case; CUDA-graph replay (warm L2)
for mixed and decode; "host" = one eager call in a back-to-back loop (the larger of host
and GPU cost). The torch reference syncs with the host inside, so its cold time includes
its host time; it is not graph-captured. GB/s = bytes the op must move (x read, out
written, weight, bias, states read and written) / time; % copy is of the device-copy
bandwidth measured at the start of the same run.

Writes OUT/causal_conv1d_bench.{csv,md,json,png} with the GPU, versions, git sha and the
command line. ``--quick`` (one dim, fewer sizes and repetitions) runs in a few minutes.

Cases and their data: conv1d_bench_cases.py; providers: conv1d_bench_providers.py; the
result row, tables and plot: conv1d_bench_report.py.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch

from benchmarks.kernels.benchmark_utils import (
    ColdTimer,
    copy_gbps,
    graph_samples,
    host_us,
    summarize,
)
from benchmarks.kernels.conv1d_bench_cases import Case, Inputs, build_inputs, make_cases
from benchmarks.kernels.conv1d_bench_providers import (
    DEFAULT_PROVIDERS,
    OUR_PROVIDERS,
    PROVIDERS,
    ROW_BYTES,
    Provider,
    cuda_provider,
    dao_provider,
    load_dao,
    torch_provider,
    triton_provider,
)
from benchmarks.kernels.conv1d_bench_report import REPO, Result, environment, markdown, plot
from vllm import _custom_ops as cuda_ops

SIZES = {
    False: dict(
        dims=(4096, 8448, 10240),
        prefill=(2048, 8192, 32768, 131072),
        mixed=(15, 63, 255),
        decode=(1, 8, 32, 128, 256, 512),
        cold_reps=30,
        graph_replays=15,
        host_calls=200,
    ),
    True: dict(
        dims=(8448,),
        prefill=(2048, 8192, 131072),
        mixed=(15, 255),
        decode=(1, 32, 512),
        cold_reps=15,
        graph_replays=10,
        host_calls=100,
    ),
}
TIME_BUDGET_S = 1.5  # per measurement of one provider on one case


# --------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------


def check(provider: Provider, inp: Inputs, res: Result) -> None:
    """Run once on a fresh pool and compare with the reference (sets res.status)."""
    pool = provider.pool.clone()
    result = provider.run(pool)
    out = provider.collect(result).float()
    ref = inp.ref_out
    diff = (out - ref).abs()
    finite = not bool(torch.isnan(out).any())
    within = bool((diff <= 2e-2 + 1e-2 * ref.abs()).all())
    res.max_abs_err = diff.max().item() if diff.numel() else 0.0
    res.rel_l2 = (diff.norm() / ref.norm().clamp_min(1e-30)).item() if diff.numel() else 0.0
    if provider.checks_states:
        res.states_exact = torch.equal(pool, inp.ref_pool)
    ok = finite and within and res.states_exact is not False
    if not ok:
        res.status = "FAIL"
        res.note = (
            f"nan={not finite} within_tol={within} states_exact={res.states_exact}; " + res.note
        ).strip("; ")


def measure(provider: Provider, case: Case, res: Result, sizes, timer, copy):
    pool = provider.pool.clone()

    def call():
        return provider.run(pool)

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    call()
    torch.cuda.synchronize()
    est_s = time.perf_counter() - t0  # one warm eager call: sizes the repetitions
    reps = max(5, min(sizes["cold_reps"], int(TIME_BUDGET_S / (est_s + 4e-4))))
    res.cold_us, res.cold_p20, res.cold_p80 = summarize(timer.samples(call, reps))
    nbytes = case.bytes_moved()
    res.cold_gbps = nbytes / res.cold_us / 1e3
    res.cold_pct_copy = 100 * res.cold_gbps / copy
    if provider.graphable and case.kind in ("mixed", "decode"):
        try:
            samples = graph_samples(call, calls=20, replays=sizes["graph_replays"])
        except Exception as e:  # a provider that cannot be captured is reported, not fatal
            res.note = f"{res.note}; graph capture failed: {type(e).__name__}".strip("; ")
        else:
            res.graph_us, res.graph_p20, res.graph_p80 = summarize(samples)
            res.graph_gbps = nbytes / res.graph_us / 1e3
            res.graph_pct_copy = 100 * res.graph_gbps / copy
    if res.provider != "torch":
        n = max(5, min(sizes["host_calls"], int(TIME_BUDGET_S / max(est_s, 1e-5))))
        res.host_us = host_us(call, n=n)


def run_case(case, providers, sizes, timer, copy, dao, seed) -> list[Result]:
    inp = build_inputs(case, seed)
    results = []
    for name in providers:
        res = Result(
            case.kind, case.dim, case.label, case.tokens, case.seqs, name, case.bytes_moved() / 1e6
        )
        if name in ROW_BYTES and not cuda_ops.cuda_ops_available():
            res.status, res.note = "n/a", "CUDA ops not built"
        elif ROW_BYTES.get(name) and case.kind == "decode":
            res.status, res.note = "n/a", "no forward call in decode"
        elif name == "dao" and dao is None:
            res.status, res.note = "n/a", "causal_conv1d not importable"
        else:
            try:
                if name == "triton":
                    provider = triton_provider(case, inp)
                elif name in ROW_BYTES:
                    provider = cuda_provider(case, inp, ROW_BYTES[name])
                elif name == "torch":
                    provider = torch_provider(case, inp)
                else:
                    provider = dao_provider(case, inp, dao)
                res.note = provider.note
                check(provider, inp, res)
                if res.status == "ok":
                    measure(provider, case, res, sizes, timer, copy)
            except Exception as e:  # reported in the results; the run goes on
                res.status = "ERROR"
                res.note = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            torch.cuda.synchronize()
        results.append(res)
        print(_progress_line(res), flush=True)
    del inp
    torch.cuda.empty_cache()
    return results


def _progress_line(r: Result) -> str:
    parts = [f"{r.kind:7s} D={r.dim:<5d} {r.case:16s} {r.provider:8s} {r.status:5s}"]
    if r.status == "ok":
        parts.append(f"cold {r.cold_us:9.1f} us ({r.cold_pct_copy:5.1f}% copy)")
        if not math.isnan(r.graph_us):
            parts.append(f"graph {r.graph_us:8.2f} us")
        if not math.isnan(r.host_us):
            parts.append(f"host {r.host_us:8.1f} us")
        parts.append(f"maxerr {r.max_abs_err:.3g}")
    if r.note:
        parts.append(f"[{r.note}]")
    return "  ".join(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one dim, fewer sizes and reps")
    parser.add_argument("--dims", type=int, nargs="+", help="dims (default: per --quick)")
    parser.add_argument(
        "--cases",
        nargs="+",
        choices=("prefill", "mixed", "decode"),
        default=["prefill", "mixed", "decode"],
    )
    parser.add_argument(
        "--providers", nargs="+", choices=PROVIDERS, default=list(DEFAULT_PROVIDERS)
    )
    parser.add_argument(
        "--out", type=Path, default=REPO / "docs" / "benchmarks" / "raw", help="output directory"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmark_causal_conv1d: needs a CUDA GPU", file=sys.stderr)
        return 2
    sizes = SIZES[args.quick]
    dims = tuple(args.dims) if args.dims else sizes["dims"]
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    dao, dao_note = load_dao()
    timer = ColdTimer()
    copy = copy_gbps(timer=timer)
    torch.cuda.empty_cache()
    env = environment(args, copy)
    print(
        f"{env['gpu']}: device copy {copy:.0f} GB/s; CUDA ops {env['cuda_ops']}; dao {dao_note}",
        flush=True,
    )

    results = []
    for i, case in enumerate(make_cases(args.cases, dims, sizes)):
        results += run_case(case, args.providers, sizes, timer, copy, dao, args.seed + i)
    copy_end = copy_gbps(timer=timer)
    torch.cuda.empty_cache()

    stem = args.out / "causal_conv1d_bench"
    fields = [f.name for f in dataclasses.fields(Result)]
    with open(f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(dataclasses.asdict(r) for r in results)
    env["copy_gbps_end"] = round(copy_end, 1)
    env["dao"] = dao_note
    env["seconds"] = round(time.perf_counter() - started, 1)
    with open(f"{stem}.json", "w") as f:
        json.dump(
            {"environment": env, "results": [dataclasses.asdict(r) for r in results]}, f, indent=1
        )
    table = markdown(env, results, copy_end, dao_note)
    Path(f"{stem}.md").write_text(table)
    png = plot(results, Path(f"{stem}.png"), copy)
    print()
    print(table)
    print(f"wrote {stem}.csv, .json, .md; plot: {png}; {env['seconds']} s")
    bad = [r for r in results if r.status in ("FAIL", "ERROR") and r.provider in OUR_PROVIDERS]
    if bad:
        print(f"{len(bad)} of our provider runs failed their check or raised", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
