"""End-to-end throughput with each causal-conv1d backend: Triton against the CUDA ops.

    python benchmarks/benchmark_e2e.py --out e2e.json --md e2e_h200.md [--profile]
    python benchmarks/benchmark_e2e.py --model tiny --device cpu --num-prompts 4 \\
        --output-lens 2,4 --max-prompt-len 8 --max-num-seqs 4 --max-num-batched-tokens 16

Runs ``benchmark_throughput.py`` once per (output length, backend), each in a fresh process
(``VLLM_USE_TRITON_CONV1D`` is read when the model is built, and the 7B model's memory goes
back with its process), on the same requests: ``--num-prompts`` prompts from the synthetic
ShareGPT-like generator of ``benchmark_throughput.py`` (log-normal lengths, median 150,
clipped to ``--max-prompt-len``; same seed for every run) unless ``--dataset`` names a
ShareGPT file, each generating exactly the output length (``ignore_eos``). Defaults: the
Mamba-Codestral-7B shape with dummy bf16 weights, output lengths 256 and 1024,
``max_num_seqs`` 256, ``max_num_batched_tokens`` 4096, decode steps through CUDA graphs
(captured before timing). Writes requests/s, total and output tokens/s and elapsed time per
run, and the Triton / CUDA ratio per output length, as JSON (``--out``) and a markdown
table (``--md``, also printed). The CUDA backend is skipped, with the reason, when its ops
are not built. ``--profile`` adds, to each backend's first run, a short profiled
generation after the timed one (see ``benchmark_throughput.py``): the share of mixed and
decode step time in conv, scan, matmul, other kernels and idle (host) time.

Time budget (H200, 7B shape). The PyTorch SSM scan is the bottleneck of a decode step: it
reads and writes each sequence's 4 MiB fp32 state per layer about eleven times (gather,
decay, outer product, sum, output, scatter), ~2.8 GiB per sequence per step over 64
layers, ~0.75 ms per sequence-step at H200 bandwidth, plus ~4 ms of weight reads per step.
With the default 100 prompts (a decode step of 100 sequences, ~80 ms) a run of output
length L takes ~L x 85 ms plus a few seconds of prefill: ~25 s at 256 and ~90 s at 1024;
each process adds ~15 s (start-up, 7B dummy weights, Triton compile on first use, capture
of the graphs up to the run's batch) and ``--profile`` ~15 s per backend. All four runs
and the profile: ~5.5 minutes. 200 prompts would double the decode time (~9 minutes),
hence the default of 100; ``--num-prompts 200`` gives the issue's count where the time is
there. ``--budget-s`` (default 360) skips the runs of an output length whose predicted
time (from the runs done: start-up + elapsed scaled by the output length) no longer fits,
and says so; 0 turns the guard off.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark_throughput import NAMED_CONFIGS  # noqa: E402
from run_info import cuda_skip_reason, git_sha  # noqa: E402
from step_profile import MARKDOWN_HEADER, markdown_rows  # noqa: E402

THROUGHPUT = Path(__file__).resolve().parent / "benchmark_throughput.py"
BACKEND_ENV = {"triton": "1", "cuda": "0"}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="codestral-7b", help="tiny, codestral-7b or a directory")
    p.add_argument("--load-format", default=None, help="as benchmark_throughput.py")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--device", default="auto")
    p.add_argument("--backends", default="triton,cuda", help="comma-separated: triton, cuda")
    p.add_argument("--output-lens", default="256,1024", help="comma-separated output lengths")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--max-prompt-len", type=int, default=1024)
    p.add_argument("--dataset", default=None, help="ShareGPT-format JSON (default: synthetic)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="profile each backend's first run")
    p.add_argument("--budget-s", type=float, default=360.0, help="0: no time guard")
    p.add_argument("--timeout-s", type=float, default=None, help="per run (default: none)")
    p.add_argument("--out", default=None, help="write all results as JSON here")
    p.add_argument("--md", default=None, help="write the markdown results here")
    args = p.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not args.backends or set(args.backends) - set(BACKEND_ENV):
        p.error(f"--backends must name triton and/or cuda, got {args.backends}")
    try:
        args.output_lens = [int(x) for x in args.output_lens.split(",") if x.strip()]
    except ValueError:
        p.error(f"--output-lens must be comma-separated integers, got {args.output_lens!r}")
    if not args.output_lens or min(args.output_lens) < 1:
        p.error("--output-lens needs positive lengths")
    return args


def child_argv(args, output_len: int, out: Path, profile: bool) -> list[str]:
    argv = [
        sys.executable,
        str(THROUGHPUT),
        *("--model", args.model, "--device", args.device, "--seed", str(args.seed)),
        *("--num-prompts", str(args.num_prompts), "--output-len", str(output_len)),
        *("--max-prompt-len", str(args.max_prompt_len)),
        *("--max-num-seqs", str(args.max_num_seqs)),
        *("--max-num-batched-tokens", str(args.max_num_batched_tokens)),
        *("--out", str(out)),
    ]
    for flag, value in (
        ("--dtype", args.dtype),
        ("--load-format", args.load_format),
        ("--dataset", args.dataset),
    ):
        if value is not None:
            argv += [flag, value]
    if args.enforce_eager:
        argv.append("--enforce-eager")
    if profile:
        argv.append("--profile")
    return argv


def predict_s(done: list[dict], backend: str, output_len: int) -> float | None:
    """Wall seconds of a run, from the runs done: its start-up plus its timed generation
    scaled by output length (decode dominates), from the same backend where possible."""
    ok = [r for r in done if "result" in r]
    same = [r for r in ok if r["backend"] == backend] or ok
    if not same:
        return None
    r = same[-1]
    phases = r["result"]["phases"]
    startup = r["wall_s"] - phases["elapsed_s"] - phases.get("profile_s", 0.0)
    return startup + phases["elapsed_s"] * output_len / r["output_len"]


def run_one(args, backend: str, output_len: int, profile: bool, work: Path, on_cuda: bool):
    out = work / f"{backend}_{output_len}.json"
    env = dict(os.environ, VLLM_USE_TRITON_CONV1D=BACKEND_ENV[backend])
    if not on_cuda:
        env.setdefault("TRITON_INTERPRET", "1")  # as scripts/test.sh: the kernels, interpreted
    argv = child_argv(args, output_len, out, profile)
    print(f"\n=== {backend}, output len {output_len}: {' '.join(argv[1:])}", flush=True)
    run = {"backend": backend, "output_len": output_len, "argv": argv[1:]}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(argv, env=env, timeout=args.timeout_s)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = None
    run["wall_s"] = time.perf_counter() - t0
    if rc == 0 and out.is_file():
        res = json.loads(out.read_text())
        run["result"] = res
        expected = res["num_requests"] * output_len
        run["output_tokens_ok"] = res["output_tokens"] == expected
        if not run["output_tokens_ok"]:
            print(f"!!! {res['output_tokens']} output tokens, expected {expected}", flush=True)
    else:
        why = f"timed out after {args.timeout_s} s" if rc is None else f"exit status {rc}"
        run["error"] = f"{why} (the run's own output above says more)"
        print(f"!!! {backend}, output len {output_len}: {run['error']}", flush=True)
    return run


def speedups(runs: list[dict]) -> dict[int, float]:
    """Output tok/s of Triton over CUDA, per output length with both runs done."""
    tput = {
        (r["backend"], r["output_len"]): r["result"]["output_tokens_per_s"]
        for r in runs
        if "result" in r
    }
    lens = sorted({length for _, length in tput})
    return {
        n: tput["triton", n] / tput["cuda", n]
        for n in lens
        if ("triton", n) in tput and ("cuda", n) in tput
    }


def markdown(results: dict) -> str:
    s = results["setup"]
    first = next((r["result"]["setup"] for r in results["runs"] if "result" in r), {})
    named = s["model"] in NAMED_CONFIGS
    weights = s["load_format"] or ("dummy" if named else "auto")
    decode = "eager" if not first.get("cuda_graphs") else "CUDA graphs, captured before timing"
    prompts = (
        f"ShareGPT file {s['dataset']}"
        if s["dataset"]
        else "synthetic ShareGPT-like lengths (log-normal, median 150, sigma 1.0, clipped to "
        f"[4, {s['max_prompt_len']}], seed {s['seed']})"
    )
    lines = [
        f"# End-to-end throughput: Triton vs CUDA causal-conv1d ({s['model']})",
        "",
        f"- Device: {first.get('device', '?')}; torch {first.get('torch', '?')}; triton "
        f"{first.get('triton', '?')}; "
        f"git {s['git_sha']}; {s['date']}",
        f"- Command: `{s['command']}`",
        f"- Workload: {s['num_prompts']} prompts, {prompts}; each generates exactly the output "
        f"length (ignore_eos); {str(first.get('dtype', '?')).removeprefix('torch.')}, "
        f"{weights} weights; max_num_seqs {s['max_num_seqs']}, max_num_batched_tokens "
        f"{s['max_num_batched_tokens']}; decode-only steps: {decode}; one fresh process per "
        "run, warmed up before timing.",
        "",
        "| output len | backend | requests/s | total tok/s | output tok/s | elapsed s "
        "| prompt tok | output tok | steps |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results["runs"]:
        if "result" not in r:
            why = r.get("error") or r.get("skipped")
            lines.append(f"| {r['output_len']} | {r['backend']} | {why} | | | | | | |")
            continue
        x = r["result"]
        lines.append(
            f"| {r['output_len']} | {r['backend']} | {x['requests_per_s']:.3f} | "
            f"{x['total_tokens_per_s']:.1f} | {x['output_tokens_per_s']:.1f} | "
            f"{x['elapsed_s']:.1f} | {x['prompt_tokens']} | {x['output_tokens']} | "
            f"{x['setup']['engine_steps']} |"
        )
    if results["triton_over_cuda"]:
        lines += [
            "",
            "| output len | Triton / CUDA (output tok/s) |",
            "| ---: | ---: |",
            *(f"| {n} | {v:.3f}x |" for n, v in results["triton_over_cuda"].items()),
        ]
    skipped = results.get("skipped_backends") or {}
    for name, why in skipped.items():
        lines += ["", f"Backend {name} skipped: {why}."]
    profiled = [r for r in results["runs"] if "profile" in r.get("result", {})]
    if profiled:
        lines += [
            "",
            "## Where the step time goes (--profile)",
            "",
            "A short profiled generation after each backend's first run; shares of the mean "
            "step wall time. In CUDA-graph decode steps kernels are told apart by name only "
            "(the scan's kernels count as other/matmul there).",
            "",
            *MARKDOWN_HEADER,
        ]
        for r in profiled:
            lines += markdown_rows(r["backend"], r["result"]["profile"])
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    on_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.dtype is None:
        args.dtype = "bfloat16" if on_cuda else "float32"
    start = time.perf_counter()
    results: dict = {
        "setup": {
            **{k: v for k, v in vars(args).items() if k not in ("out", "md")},
            "command": " ".join(
                ["python benchmarks/benchmark_e2e.py", *(sys.argv[1:] if argv is None else argv)]
            ),
            "git_sha": git_sha(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "python": platform.python_version(),
        },
        "runs": [],
        "skipped_backends": {},
    }
    backends = []
    for name in args.backends:
        reason = cuda_skip_reason(on_cuda) if name == "cuda" else None
        if reason:
            print(f"backend cuda skipped: {reason}", flush=True)
            results["skipped_backends"][name] = reason
        else:
            backends.append(name)
    profiled: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="e2e_") as work:
        for length in args.output_lens:
            used = time.perf_counter() - start
            predicted = [predict_s(results["runs"], b, length) for b in backends]
            if args.budget_s and None not in predicted and used + sum(predicted) > args.budget_s:
                why = (
                    f"skipped: predicted {sum(predicted):.0f} s for this output length, "
                    f"{args.budget_s - used:.0f} s of --budget-s {args.budget_s:.0f} left"
                )
                print(f"output len {length}: {why}", flush=True)
                results["runs"] += [
                    {"backend": b, "output_len": length, "skipped": why} for b in backends
                ]
                continue
            for b in backends:
                profile = args.profile and b not in profiled
                profiled.add(b)
                run = run_one(args, b, length, profile, Path(work), on_cuda)
                results["runs"].append(run)
                write(results, args)  # a run killed later leaves these results behind
    results["total_s"] = time.perf_counter() - start
    write(results, args)
    print("\n" + results["markdown"], flush=True)
    return results


def write(results: dict, args) -> None:
    results["triton_over_cuda"] = speedups(results["runs"])
    results["markdown"] = markdown(results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    if args.md:
        Path(args.md).write_text(results["markdown"])


if __name__ == "__main__":
    main()
