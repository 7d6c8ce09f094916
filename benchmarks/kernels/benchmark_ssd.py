"""SSD (Mamba2 chunked scan) benchmark: every provider side by side, one run.

    python benchmarks/kernels/benchmark_ssd.py --out DIR [--cases 1x2048 16x512_init ...]
        [--providers triton torch mamba_ssm mamba_ssm_batch] [--reps 25]
    python benchmarks/kernels/benchmark_ssd.py --smoke --out DIR     # CPU, interpreter

Providers, each called the way a serving engine calls it on a prefill step (state pool
in, final states written to the sequences' pool lines):

- ``triton``: ours, ``ssd_combined.mamba_chunk_scan_combined_varlen`` with the step's
  ``plan_ssd_chunks`` layout (built on the host once per step: outside the timed call;
  its host cost is the "plan us" column).
- ``torch``: ours, ``mamba_ssm_torch.chunk_scan_varlen`` with ``plan_chunked_scan``, the
  pool gather and scatter around it as ``MambaMixer2`` does.
- ``mamba_ssm``: mamba_ssm 2.3.2's ``mamba_chunk_scan_combined`` on the packed batch
  (``seq_idx`` + ``cu_seqlens``, final states from ``return_varlen_states``), the states
  written into the pool. With initial states and several sequences it refuses; its error
  is recorded as the result (no number).
- ``mamba_ssm_batch``: the same op on a padded batch (``(seqs, len, ...)``, with initial
  states), which equal-length cases allow: how HF transformers calls it.

Codestral layer shape (128 heads of 64, state 128, 8 groups, chunk 256), bf16
activations, fp32 state pool, D, dt_bias, softplus. FLOPs and bytes: ssd_bench_cases.py.

Before timing, every provider runs once on a fresh copy of the pool and is compared with
an fp32 token-by-token recurrence: rel-L2 of y and of the final states under TOL, no NaN,
and the pool lines of no sequence untouched. A failure is reported and not timed; the run
then exits 1.

Times are "cold" (anchors-h200.md section 2, benchmark_utils.ColdTimer): L2 flushed by
zeroing 256 MB, the GPU kept busy by ``torch.cuda._sleep`` so the host is ahead, CUDA
events around the one call; median of ``--reps`` calls with p20/p80. A provider that
syncs inside (ours: no; torch's chunk layout loop: no) would show its host time. % copy is
of a 4 GiB device copy and % mm of a bf16 8192^3 matmul, both measured in the same run.
``--smoke`` runs tiny cases, for the tests: on the GPU where there is one, else on the CPU
under TRITON_INTERPRET=1 (fp32; wall-clock medians that measure Python, not kernels).

Writes DIR/ssd_bench.{csv,md,json}: GPU, torch/triton versions, git sha, the command.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import shlex
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from benchmark_utils import ColdTimer, copy_gbps, summarize  # noqa: E402
from ssd_bench_cases import CASES, SMOKE_CASES, build_inputs, reference, rel_l2  # noqa: E402
from ssd_bench_providers import first_line, load_ops, make_provider  # noqa: E402

PROVIDERS = ("triton", "torch", "mamba_ssm", "mamba_ssm_batch")
OURS = ("triton", "torch")
TOL = {"bfloat16": 1e-2, "float16": 5e-3, "float32": 1e-3}  # rel-L2, y and states


@dataclasses.dataclass
class Result:
    case: str
    provider: str
    tokens: int
    seqs: int
    status: str = "ok"  # ok, FAIL, ERROR, refused, n/a
    note: str = ""
    us: float = float("nan")
    p20: float = float("nan")
    p80: float = float("nan")
    plan_us: float = float("nan")
    gflop: float = 0.0
    mbytes: float = 0.0
    tflops: float = float("nan")
    gbps: float = float("nan")
    pct_copy: float = float("nan")
    pct_mm: float = float("nan")
    y_rel_l2: float = float("nan")
    state_rel_l2: float = float("nan")
    vs_mamba_ssm: float = float("nan")  # this time / mamba_ssm's (varlen, else batch)


def check(run, case, inp, res, tol) -> None:
    import torch

    pool = inp.pool.clone()
    y = run(pool)
    if inp.x.is_cuda:
        torch.cuda.synchronize()
    res.y_rel_l2 = rel_l2(y, inp.ref_y)
    res.state_rel_l2 = rel_l2(pool[inp.idx.long()], inp.ref_states)
    others = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
    others[inp.idx.long()] = False
    untouched = torch.equal(pool[others], inp.pool[others])
    nan = bool(torch.isnan(y).any())
    if nan or not untouched or max(res.y_rel_l2, res.state_rel_l2) > tol:
        res.status = "FAIL"
        res.note = f"nan={nan} other_lines_untouched={untouched} tol={tol:g}"


def measure(run, plan, inp, res, timer, rates, reps) -> None:
    pool = inp.pool.clone()
    if timer is None:  # CPU smoke: wall clock
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            run(pool)
            samples.append((time.perf_counter() - t0) * 1e6)
    else:
        samples = timer.samples(lambda: run(pool), reps)
    res.us, res.p20, res.p80 = summarize(samples)
    if plan is not None:
        t = []
        for _ in range(5):
            t0 = time.perf_counter()
            plan()
            t.append((time.perf_counter() - t0) * 1e6)
        res.plan_us = statistics.median(t)
    res.tflops = res.gflop / res.us * 1e3
    res.gbps = res.mbytes / res.us * 1e3
    res.pct_copy = 100 * res.gbps / rates["copy_gbps"]
    res.pct_mm = 100 * res.tflops / rates["matmul_tflops"]


def run_case(case, args, ops, timer, rates, seed) -> list[Result]:
    import torch

    inp = build_inputs(case, args.dtype, args.state_dtype, args.device, seed)
    inp.ref_y, inp.ref_states = reference(case, inp)
    act, st = inp.x.element_size(), inp.pool.element_size()
    results = []
    for name in args.providers:
        res = Result(
            case.name,
            name,
            case.tokens,
            case.seqs,
            gflop=case.flops() / 1e9,
            mbytes=case.bytes_moved(act, st) / 1e6,
        )
        try:
            made = make_provider(name, case, inp, ops)
            if isinstance(made, str):
                res.status, res.note = "n/a", made
            else:
                run, plan = made
                check(run, case, inp, res, TOL[str(args.dtype).removeprefix("torch.")])
                if res.status == "ok":
                    measure(run, plan, inp, res, timer, rates, args.reps)
        except Exception as err:  # recorded, never faked: mamba_ssm's refusals land here
            refused = name.startswith("mamba_ssm") and isinstance(err, AssertionError | ValueError)
            res.status = "refused" if refused else "ERROR"
            res.note = first_line(err)
        if inp.x.is_cuda:
            torch.cuda.synchronize()
        results.append(res)
        print(_line(res), flush=True)
    ok = {r.provider: r for r in results if r.status == "ok"}
    base = ok.get("mamba_ssm") or ok.get("mamba_ssm_batch")
    for r in results:
        if base is not None and r.status == "ok":
            r.vs_mamba_ssm = r.us / base.us
    del inp
    if args.device == "cuda":
        torch.cuda.empty_cache()  # the next case's inputs and pools start from a clean pool
    return results


def _line(r: Result) -> str:
    text = f"{r.case:14s} {r.provider:16s} {r.status:7s}"
    if r.status == "ok":
        text += (
            f" {r.us:10.1f} us [{r.p20:.1f}, {r.p80:.1f}]  {r.tflops:6.1f} TFLOP/s"
            f"  {r.gbps:7.1f} GB/s  y {r.y_rel_l2:.2e}  states {r.state_rel_l2:.2e}"
        )
    return text + (f"  [{r.note}]" if r.note else "")


def device_rates(device, timer) -> dict:
    """Device-copy GB/s ((read + written) / time) and bf16 matmul TFLOP/s, cold medians."""
    import torch

    if timer is None:  # CPU: small sizes, wall clock, for the smoke run's columns only
        a = torch.empty(64 << 20, dtype=torch.uint8)
        b, m = torch.empty_like(a), torch.randn(512, 512)
        t0 = time.perf_counter()
        b.copy_(a)
        t1 = time.perf_counter()
        m @ m
        t2 = time.perf_counter()
        return {
            "copy_gbps": 2 * a.numel() / (t1 - t0) / 1e9,
            "matmul_tflops": 2 * 512**3 / (t2 - t1) / 1e12,
        }
    copy = copy_gbps(timer=timer)
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    us = statistics.median(timer.samples(lambda: a @ b, 10))
    return {"copy_gbps": copy, "matmul_tflops": 2 * n**3 / us / 1e6}


def environment(args, rates) -> dict:
    import torch
    import triton
    from run_info import git_sha

    return {
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "git_sha": git_sha(),
        "command": "python " + shlex.join(["benchmarks/kernels/benchmark_ssd.py", *args.argv]),
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "dtype": str(args.dtype).removeprefix("torch."),
        "state_dtype": str(args.state_dtype).removeprefix("torch."),
        **{k: round(v, 1) for k, v in rates.items()},
    }


def _f(v, d=1) -> str:
    return "" if v != v else f"{v:.{d}f}"  # NaN -> empty


def markdown(env, results, ops) -> str:
    mamba = ops.get("mamba_ssm")
    lines = [
        "# SSD (Mamba2 chunked scan) benchmark",
        "",
        f"- GPU: {env['gpu']}; torch {env['torch']} (CUDA {env['cuda']}); triton {env['triton']}",
        f"- git: {env['git_sha']}; {env['date_utc']} UTC",
        f"- command: `{env['command']}`",
        f"- {env['dtype']} activations, {env['state_dtype']} state pool; cold L2, one call, "
        "median [p20, p80]; plan = host layout build (outside the timed call)",
        f"- device copy {env['copy_gbps']:.0f} GB/s, bf16 matmul {env['matmul_tflops']:.0f} "
        "TFLOP/s (both measured at the start of this run)",
        "- mamba_ssm: "
        + (
            f"{mamba.version} ({mamba.path})"
            if hasattr(mamba, "version")
            else str(mamba or "not requested")
        ),
        "",
        "| case | provider | status | us [p20, p80] | plan us | GFLOP | MB | TFLOP/s | GB/s "
        "| % copy | % mm | y rel-L2 | state rel-L2 | / mamba_ssm |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for r in results:
        status = r.status
        if r.note:
            notes.append(f"{r.case} / {r.provider}: {r.note}")
            status += f" [{len(notes)}]"
        time_cell = f"{r.us:.1f} [{r.p20:.1f}, {r.p80:.1f}]" if r.status == "ok" else ""
        err = "" if r.y_rel_l2 != r.y_rel_l2 else f"{r.y_rel_l2:.1e}"
        serr = "" if r.state_rel_l2 != r.state_rel_l2 else f"{r.state_rel_l2:.1e}"
        lines.append(
            f"| {r.case} | {r.provider} | {status} | {time_cell} | {_f(r.plan_us)} | "
            f"{r.gflop:.4g} | {r.mbytes:.4g} | {_f(r.tflops)} | {_f(r.gbps)} | "
            f"{_f(r.pct_copy)} | {_f(r.pct_mm)} | {err} | {serr} | {_f(r.vs_mamba_ssm, 2)} |"
        )
    lines += ["", *(f"[{i}] {n}" for i, n in enumerate(notes, 1))]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny cases (CPU: interpreted)")
    p.add_argument("--cases", nargs="+", help="case names (default: all of the mode)")
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    p.add_argument("--reps", type=int, default=None, help="timed calls (default 25; smoke 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="output directory")
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    import torch

    on_cuda = torch.cuda.is_available()
    if not on_cuda and not args.smoke:
        print("benchmark_ssd: needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    if not on_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module imports
    table = SMOKE_CASES if args.smoke else CASES
    names = args.cases or list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        p.error(f"unknown cases {unknown}; this mode has {list(table)}")
    args.device = "cuda" if on_cuda else "cpu"
    args.dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    args.state_dtype = torch.float32
    args.reps = args.reps or (3 if args.smoke else 25)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    timer = ColdTimer() if args.device == "cuda" else None
    rates = device_rates(args.device, timer)
    env = environment(args, rates)
    print(
        f"{env['gpu']}: copy {rates['copy_gbps']:.0f} GB/s, bf16 matmul "
        f"{rates['matmul_tflops']:.0f} TFLOP/s",
        flush=True,
    )
    ops = load_ops(args.providers)
    results = []
    for i, name in enumerate(names):
        results += run_case(table[name], args, ops, timer, rates, args.seed + i)
    env["seconds"] = round(time.perf_counter() - started, 1)
    stem = args.out / "ssd_bench"
    with open(f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[x.name for x in dataclasses.fields(Result)])
        writer.writeheader()
        writer.writerows(dataclasses.asdict(r) for r in results)
    rows = [dataclasses.asdict(r) for r in results]
    Path(f"{stem}.json").write_text(json.dumps({"environment": env, "results": rows}, indent=1))
    text = markdown(env, results, ops)
    Path(f"{stem}.md").write_text(text)
    print("\n" + text + f"wrote {stem}.csv, .json, .md; {env['seconds']} s")
    bad = [r for r in results if r.provider in OURS and r.status in ("FAIL", "ERROR")]
    bad += [r for r in results if r.status == "FAIL"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
