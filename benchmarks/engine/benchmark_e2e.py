"""End-to-end throughput with each causal-conv1d backend: Triton against the CUDA ops.

    python -m benchmarks.engine.benchmark_e2e --out e2e.json --md e2e_h200.md [--profile]
    python -m benchmarks.engine.benchmark_e2e --backends triton --output-lens 256 --cold-warm
    python -m benchmarks.engine.benchmark_e2e --model tiny --device cpu --num-prompts 4 \\
        --output-lens 2,4 --max-prompt-len 8 --max-num-seqs 4 --max-num-batched-tokens 16

Runs ``benchmark_throughput.py`` once per (output length, backend), each in a fresh process
(``VLLM_USE_TRITON_CONV1D`` is read when the model is built, and the 7B model's memory goes
back with its process), on the same requests: ``--num-prompts`` prompts from the synthetic
ShareGPT-like generator of ``benchmark_throughput.py`` (log-normal lengths, median 150,
clipped to ``--max-prompt-len``; same seed for every run), or of ``--input-len`` tokens
each, or from ``--dataset`` (a ShareGPT file), each generating exactly the output length
(``ignore_eos``). Defaults: the Mamba-Codestral-7B shape with dummy bf16 weights, output
lengths 256 and 1024, ``max_num_seqs`` 256, ``max_num_batched_tokens`` 4096.

Cold: every run compiles into its own fresh empty Triton cache (benchmark_throughput's
default) and nothing warms it up before timing (the engine compiles its kernels and
captures its decode CUDA graphs while it starts: that is the start-up column), so no
compile left over from an earlier run can hide. ``--triton-cache-dir DIR`` passes one
folder to every run instead. ``--cold-warm`` runs each (output length, backend) twice
with one cache folder of its own, empty for the first run and filled by it for the
second: cold against warm, in one command (the table adds warm / cold).

Writes requests/s, total and output tokens/s, elapsed and start-up time per run, and the
Triton / CUDA ratio per output length (cold runs), as JSON (``--out``) and a markdown
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
each process adds its start-up (7B dummy weights, the cold compile of every kernel
variant, the capture of the decode graphs) and ``--profile`` ~15 s per backend.
``--budget-s`` (default 360) skips the runs of an output length whose predicted time (from
the runs done: start-up + elapsed scaled by the output length) no longer fits, and says
so; 0 turns the guard off.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.common.launch import module_argv, tree_env
from benchmarks.common.model_shapes import NAMED_CONFIGS
from benchmarks.common.run_info import cuda_skip_reason, git_sha, write_results
from benchmarks.common.step_profile import MARKDOWN_HEADER, markdown_rows

THROUGHPUT = "benchmarks.engine.benchmark_throughput"
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
    p.add_argument("--input-len", type=int, default=None, help="fixed prompt length")
    p.add_argument("--dataset", default=None, help="ShareGPT-format JSON (default: synthetic)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="profile each backend's first run")
    p.add_argument("--triton-cache-dir", default=None, help="default: a fresh one per run")
    p.add_argument("--cold-warm", action="store_true", help="each run twice: cold, then warm")
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
    if args.cold_warm and args.triton_cache_dir:
        p.error("--cold-warm makes its own cache folders: no --triton-cache-dir with it")
    return args


def child_argv(args, output_len: int, out: Path, profile: bool, cache: str | None) -> list[str]:
    argv = [
        *module_argv(THROUGHPUT),
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
        ("--input-len", None if args.input_len is None else str(args.input_len)),
        ("--triton-cache-dir", cache),
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


def run_one(args, backend, output_len, profile, work: Path, on_cuda, cache=None, tag=""):
    """One child run; ``cache`` is its Triton cache folder (None: its own fresh one)."""
    out = work / f"{backend}_{output_len}{tag}.json"
    env = tree_env(VLLM_USE_TRITON_CONV1D=BACKEND_ENV[backend])
    if not on_cuda:
        env.setdefault("TRITON_INTERPRET", "1")  # as scripts/test.sh: the kernels, interpreted
    argv = child_argv(args, output_len, out, profile, cache)
    print(f"\n=== {backend}, output len {output_len}{tag}: {' '.join(argv[1:])}", flush=True)
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
    """Output tok/s of Triton over CUDA, per output length with both (cold) runs done."""
    tput = {
        (r["backend"], r["output_len"]): r["result"]["output_tokens_per_s"]
        for r in runs
        if "result" in r and r.get("cache") != "warm"
    }
    lens = sorted({length for _, length in tput})
    return {
        n: tput["triton", n] / tput["cuda", n]
        for n in lens
        if ("triton", n) in tput and ("cuda", n) in tput
    }


def warm_over_cold(runs: list[dict]) -> list[dict]:
    """Per (backend, output length) run cold and warm: warm / cold output tok/s, and the
    start-up seconds of each."""
    done = {(r["backend"], r["output_len"], r.get("cache")): r for r in runs if "result" in r}
    out = []
    for (backend, length, cache), cold in done.items():
        warm = done.get((backend, length, "warm"))
        if cache != "cold" or warm is None:
            continue
        c, w = cold["result"], warm["result"]
        out.append({
            "backend": backend,
            "output_len": length,
            "warm_over_cold": w["output_tokens_per_s"] / c["output_tokens_per_s"],
            "startup_cold_s": c.get("startup_s"),
            "startup_warm_s": w.get("startup_s"),
        })  # fmt: skip
    return out


def _s(v) -> str:
    return "" if v is None else f"{v:.1f}"


def markdown(results: dict) -> str:
    s = results["setup"]
    first = next((r["result"]["setup"] for r in results["runs"] if "result" in r), {})
    named = s["model"] in NAMED_CONFIGS
    weights = s["load_format"] or ("dummy" if named else "auto")
    decode = "eager" if not first.get("cuda_graphs") else "CUDA graphs, captured at start-up"
    if s["triton_cache_dir"]:
        cache = f"every run's Triton cache: {s['triton_cache_dir']} (given)"
    elif s["cold_warm"]:
        cache = "each run twice, on a Triton cache folder of its own: empty (cold), then warm"
    else:
        cache = "cold: a fresh empty Triton cache per run"
    prompts = (
        f"ShareGPT file {s['dataset']}"
        if s["dataset"]
        else f"{s['input_len']} random tokens each"
        if s["input_len"]
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
        f"run; {cache}; no warm-up before timing (the engine compiles its kernels and "
        "captures its graphs while it starts: the start-up column, script start to ready).",
        "",
        "| output len | backend | cache | requests/s | total tok/s | output tok/s | elapsed s "
        "| start-up s | first token s | prompt tok | output tok | steps |",
        "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results["runs"]:
        head = f"| {r['output_len']} | {r['backend']} | {r.get('cache', '')} |"
        if "result" not in r:
            why = r.get("error") or r.get("skipped")
            lines.append(f"{head} {why} | | | | | | | | |")
            continue
        x = r["result"]
        lines.append(
            f"{head} {x['requests_per_s']:.3f} | "
            f"{x['total_tokens_per_s']:.1f} | {x['output_tokens_per_s']:.1f} | "
            f"{x['elapsed_s']:.1f} | {_s(x.get('startup_s'))} | {_s(x.get('first_token_s'))} | "
            f"{x['prompt_tokens']} | {x['output_tokens']} | {x['setup']['engine_steps']} |"
        )
    if results["triton_over_cuda"]:
        lines += [
            "",
            "| output len | Triton / CUDA (output tok/s) |",
            "| ---: | ---: |",
            *(f"| {n} | {v:.3f}x |" for n, v in results["triton_over_cuda"].items()),
        ]
    if results.get("warm_over_cold"):
        lines += [
            "",
            "| output len | backend | warm / cold (output tok/s) | start-up cold s | warm s |",
            "| ---: | --- | ---: | ---: | ---: |",
            *(
                f"| {x['output_len']} | {x['backend']} | {x['warm_over_cold']:.3f} | "
                f"{_s(x['startup_cold_s'])} | {_s(x['startup_warm_s'])} |"
                for x in results["warm_over_cold"]
            ),
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
                [
                    "python -m benchmarks.engine.benchmark_e2e",
                    *(sys.argv[1:] if argv is None else argv),
                ]
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
            predicted *= 2 if args.cold_warm else 1
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
                for cache, tag, folder in cache_plan(args, Path(work), b, length):
                    run = run_one(args, b, length, profile, Path(work), on_cuda, folder, tag)
                    run["cache"] = cache
                    results["runs"].append(run)
                    write(results, args)  # a run killed later leaves these results behind
                    profile = False
    results["total_s"] = time.perf_counter() - start
    write(results, args)
    print("\n" + results["markdown"], flush=True)
    return results


def cache_plan(args, work: Path, backend: str, length: int):
    """(label, file tag, Triton cache folder or None) of each run of one (backend, length)."""
    if args.cold_warm:
        folder = str(work / f"triton_cache_{backend}_{length}")
        return [("cold", "_cold", folder), ("warm", "_warm", folder)]
    if args.triton_cache_dir:
        return [("given", "", args.triton_cache_dir)]
    return [("cold", "", None)]


def write(results: dict, args) -> None:
    results["triton_over_cuda"] = speedups(results["runs"])
    results["warm_over_cold"] = warm_over_cold(results["runs"])
    results["markdown"] = markdown(results)
    write_results(results, args.out, args.md)


if __name__ == "__main__":
    main()
