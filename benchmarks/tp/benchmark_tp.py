"""Tensor parallelism on the Codestral-7B shape: TP=N (default 2) against TP=1 (issue 16).

    python -m benchmarks.tp.benchmark_tp --out tp.json --md tp.md          # 2 GPUs, NCCL, bf16
    python -m benchmarks.tp.benchmark_tp --model tiny --device cpu --max-num-seqs 4 \
        --max-num-batched-tokens 32 --logits-len 8 --decode-batches 1,4 --prefill-len 16 \
        --num-prompts 2 --input-len 4 --output-len 3                     # 2 CPU ranks, gloo

Dummy weights of one seed: every tensor-parallel size holds the weights of one rank (a
shard draws the full tensor with the one-rank generator and keeps its slice; see
tests/distributed/test_hybrid_tp.py::test_two_ranks_equal_one_rank_gloo, its dummy-weight
check), so the
runs differ only in how the computation is split.

Each configuration is a fresh process (tp_bench_run.py, which says how steps are run):
TP=1 and TP=N in the run's dtype (bf16 on a GPU), then, unless the dtype is fp32 or
``--no-reference``, TP=1 in fp32 with the logits steps only (the yardstick).

(a) **Logits**: a fixed prefill step, a mixed step (decodes, a continued prefill, a new
    prompt) and ``--logits-decode-steps`` decode steps: max |TP=N - TP=1|, the share of rows
    whose argmax agrees, and against the fp32 run max |TP=1 - fp32| (bf16's own error) and
    max |TP=N - fp32|; their ratio says whether TP=N is as close to fp32 as TP=1 is (within
    tolerance: at most ``BF16_ERROR_FACTOR`` times, the hybrid tests' bound against HF).
(b) **Throughput** of ``LLM(..., tensor_parallel_size=...)``: ``--num-prompts`` prompts of
    ``--input-len`` random tokens, ``--output-len`` greedy tokens each (ignore_eos); and the
    **latency** of single steps: decodes at each ``--decode-batches`` size (CUDA graphs
    where captured) and one ``--prefill-len`` prefill, wall ms of the engine's step call.
(c) **All-reduce cost**: every collective each timed step makes at TP=N is recorded (op,
    shape, dtype, the layer it ran in); each distinct all-reduce is then timed alone on the
    model's group through ``tensor_model_parallel_all_reduce``, and reported per layer and
    per step (count x time) beside the step's latency.

Results: ``--out`` (JSON, written after every configuration) and ``--md``. On GPUs
NVLink multicast stays off in every rank's environment (``MULTICAST_OFF_ENV``: the device
notes' KINDS.md). ``--budget-s`` bounds the whole run: a configuration that would start
after it is skipped, one still running at it is killed, and the results say which. A
TP=1 or TP=N run that fails is run once more with ``enforce_eager`` (no CUDA graphs); the
results name the failure, and the exit code is 1 after any failure or logits out of
tolerance.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks.common.launch import module_argv, tree_env
from benchmarks.common.model_shapes import NAMED_CONFIGS, named_config
from benchmarks.common.run_info import git_sha, write_results
from benchmarks.tp import tp_bench_report as report
from benchmarks.tp.tp_bench_run import logits_prompt_lens


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="codestral-7b", choices=sorted(NAMED_CONFIGS))
    p.add_argument("--tp", type=int, default=2, help="the size set against TP=1")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--mamba-ssm-cache-dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--logits-len", type=int, default=64, help="the first prompt's tokens")
    p.add_argument("--logits-decode-steps", type=int, default=3)
    p.add_argument("--no-reference", action="store_true", help="no fp32 TP=1 run")
    p.add_argument("--decode-batches", type=_ints, default=[1, 32, 128, 256])
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--allreduce-warmup", type=int, default=5)
    p.add_argument("--allreduce-iters", type=int, default=20)
    p.add_argument("--allreduce-repeats", type=int, default=5)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--budget-s", type=float, default=330.0, help="bound on the whole run")
    p.add_argument("--out", default=None, help="results as JSON")
    p.add_argument("--md", default=None, help="results as markdown")
    args = p.parse_args(argv)
    n = args.logits_len
    logits_tokens = sum(logits_prompt_lens(n))
    if args.tp < 2:
        p.error("--tp must be >= 2 (it is set against TP=1)")
    if min(args.decode_batches, default=0) < 1 or max(args.decode_batches) > args.max_num_seqs:
        p.error("--decode-batches must be in 1 .. --max-num-seqs")
    if max(args.prefill_len, logits_tokens) > args.max_num_batched_tokens:
        p.error(
            f"--prefill-len and the logits' first step ({logits_tokens} tokens for "
            "--logits-len) must fit --max-num-batched-tokens"
        )
    if args.max_num_seqs < 4 or n < 4:
        p.error("the logits steps need --max-num-seqs >= 4 and --logits-len >= 4")
    return args


def specs(args) -> list[tuple[str, dict]]:
    """(name, spec) of each configuration, in run order."""
    base = {
        k: getattr(args, k)
        for k in (
            "model",
            "device",
            "dtype",
            "mamba_ssm_cache_dtype",
            "seed",
            "max_num_seqs",
            "max_num_batched_tokens",
            "enforce_eager",
            "logits_len",
            "logits_decode_steps",
            "decode_batches",
            "prefill_len",
            "warmup",
            "iters",
            "allreduce_warmup",
            "allreduce_iters",
            "allreduce_repeats",
            "num_prompts",
            "input_len",
            "output_len",
        )
    }
    out = [("tp1", {**base, "tp": 1, "role": "bench"})]
    out.append((f"tp{args.tp}", {**base, "tp": args.tp, "role": "bench"}))
    if args.dtype != "float32" and not args.no_reference:
        ref = {**base, "tp": 1, "role": "reference", "dtype": "float32", "enforce_eager": True}
        ref.update(max_num_seqs=4, max_num_batched_tokens=sum(logits_prompt_lens(args.logits_len)))
        out.append(("reference_fp32", ref))
    return out


def run_child(name: str, spec: dict, work: Path, timeout_s: float) -> tuple[dict | None, str]:
    """One configuration in a fresh process (its own session, so that a run past its time
    is killed with the rank processes it started); its results, or None and why."""
    spec_path, out, logits = (work / f"{name}{ext}" for ext in (".spec.json", ".json", ".pt"))
    spec_path.write_text(json.dumps(spec))
    argv = module_argv("benchmarks.tp.tp_bench_run", str(spec_path), str(out), str(logits))
    print(f"benchmark_tp: {name}: {' '.join(argv[1:])}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=tree_env(), start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None, f"{name} was killed after {timeout_s:.3g} s (the budget)"
    if rc != 0 or not out.exists():
        return None, f"{name} failed (exit code {rc}; its output is above in the log)"
    res = json.loads(out.read_text())
    res["wall_s"] = time.perf_counter() - t0
    print(f"benchmark_tp: {name} done in {res['wall_s']:.1f} s", flush=True)
    return res, ""


def setup(args, argv) -> dict:
    cfg = named_config(args.model)
    shape = {
        k: getattr(cfg, k)
        for k in ("hidden_size", "num_hidden_layers", "num_heads", "head_dim", "n_groups")
    }
    shape["state_size"], shape["vocab_size"] = cfg.state_size, cfg.vocab_size
    return {
        "model": args.model,
        "shape": shape,
        "model_config": asdict(cfg),
        "tp": args.tp,
        "device": args.device,
        "backend": "nccl" if args.device == "cuda" else "gloo",
        "dtype": args.dtype,
        "mamba_ssm_cache_dtype": args.mamba_ssm_cache_dtype,
        "seed": args.seed,
        "commit": git_sha(),
        "VLLM_RUN_SHA": os.environ.get("VLLM_RUN_SHA"),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "argv": ["benchmark_tp.py", *argv],
        "args": vars(args),
    }


def summarize(res: dict, logits: dict, n: int) -> None:
    """The figures of the runs so far (``report``), into ``res``."""
    runs, name = res["runs"], f"tp{n}"
    if "tp1" in logits and name in logits:
        steps = runs[name]["logits_steps"]
        res["logits"] = report.compare_logits(
            logits["tp1"], logits[name], logits.get("reference_fp32"), steps
        )
    if "tp1" in runs and name in runs:
        layers = res["setup"]["shape"]["num_hidden_layers"]
        res["steps"] = report.step_table(runs["tp1"], runs[name], layers)
        res["throughput"] = report.throughput_table(runs["tp1"], runs[name])
    if name in runs:
        res["all_reduce"] = runs[name].get("all_reduce", [])
        res["setup"]["environment"] = runs[name]["environment"]
        res["setup"]["rank0_device"] = runs[name]["rank0_device"]
    res["markdown"] = report.markdown(res)


def main(argv=None) -> dict:
    t_start = time.perf_counter()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    import torch

    from vllm.distributed.parallel_state import MULTICAST_OFF_ENV

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.device == "cuda" and torch.cuda.device_count() < args.tp:
        raise SystemExit(
            f"benchmark_tp: --tp {args.tp} needs {args.tp} GPUs, "
            f"{torch.cuda.device_count()} visible"
        )
    # NVLink multicast off in every rank (the children and their workers inherit it),
    # whatever the caller's environment says: it can take a shared host's GPUs down.
    os.environ.update(MULTICAST_OFF_ENV)
    res = {"setup": setup(args, argv), "runs": {}, "skipped": []}
    logits = {}
    with tempfile.TemporaryDirectory(prefix="benchmark_tp_") as tmp:
        for name, spec in specs(args):
            left = args.budget_s - (time.perf_counter() - t_start)
            if left <= 0:
                res["skipped"].append(f"{name}: the budget of {args.budget_s:g} s was spent")
                continue
            run, why = run_child(name, spec, Path(tmp), left)
            left = args.budget_s - (time.perf_counter() - t_start)
            if run is None and spec["role"] == "bench" and not spec["enforce_eager"] and left > 0:
                # Once more without CUDA graphs (captured NCCL collectives are the least
                # tried part): eager figures beat none from a scarce machine.
                res["skipped"].append(f"{why}; run again with enforce_eager")
                run, why = run_child(name, {**spec, "enforce_eager": True}, Path(tmp), left)
            if run is None:
                res["skipped"].append(why)
            else:
                res["runs"][name] = run
                logits[name] = torch.load(Path(tmp) / f"{name}.pt")
            summarize(res, logits, args.tp)
            write_results(res, args.out, args.md)
    res["wall_s"] = time.perf_counter() - t_start
    summarize(res, logits, args.tp)
    write_results(res, args.out, args.md)
    print(res["markdown"])
    return res


def failed(res: dict) -> bool:
    """A configuration did not run, or the logits are out of tolerance."""
    return bool(res["skipped"]) or not res.get("logits", {}).get("within_tolerance", False)


if __name__ == "__main__":
    sys.exit(1 if failed(main()) else 0)
