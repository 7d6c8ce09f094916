"""SSD (Mamba2 chunked scan) benchmark: every provider side by side, one run.

    python -m benchmarks.kernels.benchmark_ssd --out DIR [--cases 1x2048 16x512_init ...]
        [--providers triton torch mamba_ssm mamba_ssm_batch] [--reps 25]
    python -m benchmarks.kernels.benchmark_ssd --smoke --out DIR     # CPU, interpreter

Providers, each called the way a serving engine calls it on a prefill step (state pool
in, final states written to the sequences' pool lines):

- ``triton``: ours, ``ssd_combined.mamba_chunk_scan_combined_varlen`` with the step's
  ``plan_ssd_chunks`` layout (built on the host once per step: outside the timed call;
  its host cost is the "plan us" column).
- ``upstream``: upstream vLLM 0.33.0's Triton ``mamba_chunk_scan_combined_varlen`` as its
  Mamba2 mixer calls it (chunk metadata built beforehand, initial states gathered from the
  pool, final states written into the pool by its kernel). Its files are imported as the
  package ``upstream_vllm033`` (shimmed, never committed; ssd_bench_providers.py); without
  it on ``PYTHONPATH`` the provider is skipped with that reason.
- ``mamba_ssm``: mamba_ssm 2.3.2's ``mamba_chunk_scan_combined`` on the packed batch
  (``seq_idx`` + ``cu_seqlens``, final states from ``return_varlen_states``), the states
  written into the pool. With initial states and several sequences it refuses; its error
  is recorded as the result (no number).
- ``mamba_ssm_batch``: the same op on a padded batch (``(seqs, len, ...)``, with initial
  states), which equal-length cases allow: how HF transformers calls it.
- ``torch`` (on request): ours, ``mamba_ssm_torch.chunk_scan_varlen`` with
  ``plan_chunked_scan``, the pool gather and scatter around it as ``MambaMixer2`` did.

Cases: the Codestral layer shape (128 heads of 64, state 128, 8 groups, chunk 256) and
Granite-4.0-H's (state 256, one group), bf16 activations, fp32 state pool, D, dt_bias,
softplus. FLOPs and bytes: ssd_bench_cases.py.

Before timing, every provider runs once on a fresh copy of the pool (which also runs the
autotuners of upstream and mamba_ssm, whose choice then stays) and is compared with an
fp32 token-by-token recurrence: rel-L2 of y and of the final states under TOL, no NaN,
and the pool lines of no sequence untouched. A failure is reported and not timed; the run
then exits 1.

Timing, the same for every provider:

- ``us`` (the result): cold, GPU only. Before each call the L2 is flushed (256 MB zeroed)
  and the GPU is kept busy by ``torch.cuda._sleep`` for ~2 ms, longer than any provider's
  host work per call, so the host has enqueued the whole call before the GPU reaches it;
  CUDA events around the one call; median of ``--reps`` with p20/p80.
- ``cold200``: the same with the ~200 us sleep of anchors-h200.md (benchmark_utils): a
  provider whose host work per call is longer shows its host time here, not its GPU time.
- ``graph``: ``calls`` calls captured in one CUDA graph and replayed, per call (warm L2:
  the upstream numbers of the issue were taken this way).
- ``host``: an eager back-to-back loop, per call: the larger of host and GPU time.

% copy is of a 4 GiB device copy and % mm of a bf16 8192^3 matmul, both measured in the
same run. ``--smoke`` runs tiny cases, for the tests: on the GPU where there is one, else
on the CPU under TRITON_INTERPRET=1 (fp32; wall-clock medians that measure Python, not
kernels; only ``us``).

Writes DIR/ssd_bench.{csv,md,json}: GPU, torch/triton versions, git sha, the command; the
JSON also holds the config each of upstream's autotuners chose per key (``upstream_autotune``).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.kernels.benchmark_utils import (
    ColdTimer,
    copy_gbps,
    graph_samples,
    host_us,
    summarize,
)
from benchmarks.kernels.ssd_bench_cases import CASES, SMOKE_CASES, build_inputs, reference, rel_l2
from benchmarks.kernels.ssd_bench_providers import (
    compile_autotune_configs_in_parallel,
    first_line,
    load_ops,
    make_provider,
    upstream_autotune_choices,
)
from benchmarks.kernels.ssd_bench_report import environment, markdown, summary

HERE = Path(__file__).resolve().parent

PROVIDERS = ("triton", "upstream", "mamba_ssm", "mamba_ssm_batch", "torch")
DEFAULT_PROVIDERS = ("triton", "upstream", "mamba_ssm", "mamba_ssm_batch")
PEERS = ("upstream", "mamba_ssm", "mamba_ssm_batch")
OURS = ("triton", "torch")
LONG_SLEEP_CYCLES = 4_000_000  # ~2 ms at the H200's ~2 GHz
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
    cold200: float = float("nan")  # cold with anchors-h200's 200 us sleep
    graph: float = float("nan")  # CUDA-graph replay per call, warm L2
    host: float = float("nan")  # eager back-to-back loop per call
    vs_best_peer: float = float("nan")  # this time / the fastest peer's (upstream, mamba_ssm)


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


def cold_samples(timer, fn, reps: int, sleep_cycles: int) -> list[float]:
    """``ColdTimer.samples`` with a chosen GPU sleep before each call."""
    return timer.samples(fn, reps, sleep_cycles)


def measure(run, plan, inp, res, timer, rates, reps) -> None:
    pool = inp.pool.clone()
    if timer is None:  # CPU smoke: wall clock
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            run(pool)
            samples.append((time.perf_counter() - t0) * 1e6)
    else:
        from benchmarks.kernels.benchmark_utils import SLEEP_CYCLES

        samples = cold_samples(timer, lambda: run(pool), reps, LONG_SLEEP_CYCLES)
        res.cold200 = statistics.median(cold_samples(timer, lambda: run(pool), reps, SLEEP_CYCLES))
        us = statistics.median(samples)
        try:
            calls = max(2, min(20, round(5000 / us)))
            res.graph = statistics.median(graph_samples(lambda: run(pool), calls, replays=10))
        except Exception as err:  # not capturable (a host sync inside): say so
            res.note = f"graph: {first_line(err)}"[:200]
        res.host = host_us(lambda: run(pool), n=max(5, min(100, round(50000 / us))), warmup=3)
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
            refused = name in PEERS and isinstance(err, AssertionError | ValueError)
            res.status = "refused" if refused else "ERROR"
            res.note = first_line(err)
        if inp.x.is_cuda:
            torch.cuda.synchronize()
        results.append(res)
        print(_line(res), flush=True)
    peers = [r.us for r in results if r.status == "ok" and r.provider in PEERS]
    for r in results:
        if peers and r.status == "ok":
            r.vs_best_peer = r.us / min(peers)
    del inp
    if args.device == "cuda":
        torch.cuda.empty_cache()  # the next case's inputs and pools start from a clean pool
    return results


def _line(r: Result) -> str:
    text = f"{r.case:18s} {r.provider:16s} {r.status:7s}"
    if r.status == "ok":
        text += (
            f" {r.us:9.1f} us [{r.p20:.1f}, {r.p80:.1f}] cold200 {r.cold200:8.1f} graph"
            f" {r.graph:8.1f} host {r.host:8.1f}  {r.tflops:5.1f} TFLOP/s  y {r.y_rel_l2:.1e}"
            f"  states {r.state_rel_l2:.1e}"
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny cases (CPU: interpreted)")
    p.add_argument("--cases", nargs="+", help="case names (default: all of the mode)")
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(DEFAULT_PROVIDERS))
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
    if on_cuda:
        compile_autotune_configs_in_parallel()
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
    chosen = upstream_autotune_choices() if not isinstance(ops.get("upstream"), str) else {}
    record = {"environment": env, "results": rows, "upstream_autotune": chosen}
    Path(f"{stem}.json").write_text(json.dumps(record, indent=1))
    text = markdown(env, results, ops)
    Path(f"{stem}.md").write_text(text)
    print("\n" + text + f"wrote {stem}.csv, .json, .md; {env['seconds']} s")
    print(summary(results))
    bad = [r for r in results if r.provider in OURS and r.status in ("FAIL", "ERROR")]
    bad += [r for r in results if r.status == "FAIL"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
