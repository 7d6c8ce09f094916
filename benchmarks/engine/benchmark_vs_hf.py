"""This project's engine against HF transformers on one workload: prefill and output tok/s.

    python -m benchmarks.engine.benchmark_vs_hf --out vs_hf.json --md vs_hf.md
    python -m benchmarks.engine.benchmark_vs_hf --model tiny --device cpu --num-prompts 2 \\
        --input-len 8 --output-len 3 --systems ours-2048-fp32,hf
    python -m benchmarks.engine.benchmark_vs_hf --model granite-4.0-h-tiny \\
        --systems ours-8192-fp32,hf --max-model-len 768 --out granite.json --md granite.md

Each system is one fresh process of ``benchmark_throughput.py`` on the same requests
(``--num-prompts`` prompts of ``--input-len`` random tokens, greedy, exactly
``--output-len`` new tokens each, random bf16 weights; ``--model`` any named shape of
model_shapes.py, Codestral-7B's by default, or a model directory)
with ``--prefill-run``: the timed generation, then the same prompts with one output token
each (prefill tok/s = prompt tokens / that run's time). Systems (``--systems``):

- ``ours-2048-fp32``, ``ours-8192-fp32``: ``vllm.LLM`` with max_num_batched_tokens 2048 or
  8192 and an fp32 SSM state pool; ``ours-2048-bf16``, ``ours-8192-bf16``: a bf16 pool.
  Cold: a fresh Triton cache per process, no warm-up (the engine's start-up compiles).
- ``hf``: transformers' class of the model's architecture (``Mamba2ForCausalLM``,
  ``FalconMambaForCausalLM``, ``Lfm2ForCausalLM``, ``GraniteMoeHybridForCausalLM``,
  ``NemotronHForCausalLM``, ...), ``.generate`` with all prompts in one batch (or
  ``--hf-batch-size``), with mamba_ssm's Triton scan and state update where they import
  (mamba_ssm_import.py; the Mamba2 family) and PyTorch's conv; warm (one short generation
  first). Which kernels it ran is in the table.

``max_num_seqs`` is the number of prompts (every request runs at once, as in HF's one
batch; also the number of state slots). Ratios are ours / HF. Time (H200, 128 x 512, 256
output tokens, defaults): each of ours ~20 s of generation + ~5 s of prefill run after its
cold start-up, HF ~20 + ~5 s after building the model: ~5 minutes for the four defaults.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.common.launch import module_argv, tree_env
from benchmarks.common.run_info import git_sha, write_results

THROUGHPUT = "benchmarks.engine.benchmark_throughput"
SYSTEMS = {
    f"ours-{n}-{dt}": ["--max-num-batched-tokens", str(n), "--mamba-ssm-cache-dtype", dtype]
    for n in (2048, 8192)
    for dt, dtype in (("fp32", "float32"), ("bf16", "bfloat16"))
}
SYSTEMS["hf"] = ["--backend", "hf"]
DEFAULT_SYSTEMS = "ours-2048-fp32,ours-8192-fp32,ours-8192-bf16,hf"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="codestral-7b")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--device", default="auto")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--systems", default=DEFAULT_SYSTEMS, help=f"of {', '.join(SYSTEMS)}")
    p.add_argument("--hf-kernels", default="auto", choices=["auto", "mamba_ssm", "torch"])
    p.add_argument("--hf-batch-size", type=int, default=None, help="default: all prompts")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="ours: the engine's (default: the config's; input + output len is enough)",
    )
    p.add_argument("--timeout-s", type=float, default=300.0, help="per system")
    p.add_argument("--out", default=None, help="all results as JSON")
    p.add_argument("--md", default=None, help="the markdown table")
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown or not args.systems:
        p.error(f"--systems must name some of {', '.join(SYSTEMS)}; unknown: {sorted(unknown)}")
    return args


def child_argv(args, system: str, out: Path) -> list[str]:
    argv = module_argv(THROUGHPUT, *SYSTEMS[system])
    argv += ["--model", args.model, "--device", args.device, "--dtype", args.dtype]
    argv += ["--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len)]
    argv += ["--output-len", str(args.output_len), "--temperature", "0", "--prefill-run"]
    argv += ["--max-num-seqs", str(args.num_prompts), "--out", str(out)]
    if system == "hf":
        argv += ["--hf-kernels", args.hf_kernels]
        if args.hf_batch_size is not None:
            argv += ["--hf-batch-size", str(args.hf_batch_size)]
    elif args.max_model_len is not None:
        argv += ["--max-model-len", str(args.max_model_len)]
    return argv


def run_system(args, system: str, work: Path, on_cuda: bool) -> dict:
    out = work / f"{system}.json"
    env = tree_env()
    if not on_cuda:
        env.setdefault("TRITON_INTERPRET", "1")
    argv = child_argv(args, system, out)
    print(f"\n=== {system}: {' '.join(argv[1:])}", flush=True)
    run = {"system": system, "argv": argv[1:]}
    t0 = time.perf_counter()
    try:
        rc = subprocess.run(argv, env=env, timeout=args.timeout_s).returncode
    except subprocess.TimeoutExpired:
        rc = None
    run["wall_s"] = time.perf_counter() - t0
    if rc == 0 and out.is_file():
        run["result"] = json.loads(out.read_text())
        expected = args.num_prompts * args.output_len
        if run["result"]["output_tokens"] != expected:
            run["error"] = f"{run['result']['output_tokens']} output tokens, expected {expected}"
    else:
        run["error"] = f"timed out after {args.timeout_s} s" if rc is None else f"exit status {rc}"
    if "error" in run:
        print(f"!!! {system}: {run['error']}", flush=True)
    return run


def _f(v, digits=0) -> str:
    return "" if v is None else f"{v:,.{digits}f}"


def _notes(x: dict) -> str:
    if x["backend"] != "hf":
        st = x["setup"]
        return f"state {str(st.get('ssm_state_dtype')).removeprefix('torch.')}, cold"
    hf = x["hf"]
    k = hf["kernels"]
    if k["fast_scan"] is None:
        scan = "no scan"
    elif k["fast_scan"]:
        kind = "Triton scan" if "mamba2_chunk_scan" in k else "scan"  # Mamba2's are Triton
        scan = f"mamba_ssm {hf.get('mamba_ssm')} {kind} + state update"
    else:
        scan = f"PyTorch scan ({hf.get('mamba_ssm_not_used_because')})"
    conv = "Dao CUDA conv" if k["fast_conv"] else "PyTorch conv"
    decode = hf.get("decode_ms_per_step_median")
    return (
        f"{scan}, {conv}; warm; batch {hf['batch_size']}; decode {_f(decode, 1)} ms/step; "
        f"prefill in the run {_f(hf.get('prefill_tokens_per_s_in_run'))} tok/s"
    )


def markdown(results: dict) -> str:
    s = results["setup"]
    runs = [r for r in results["runs"] if "result" in r]
    first = runs[0]["result"]["setup"] if runs else {}
    hf = next((r["result"] for r in runs if r["system"] == "hf"), None)
    lines = [
        f"# {s['model']}: this project vs HF transformers",
        "",
        f"- Device: {first.get('device', '?')}; torch {first.get('torch', '?')}; triton "
        f"{first.get('triton', '?')}; transformers {hf['setup'].get('transformers') if hf else '?'}"
        f"; git {s['git_sha']}; {s['date']}",
        f"- Command: `{s['command']}`",
        f"- Workload: {s['num_prompts']} prompts x {s['input_len']} random tokens, greedy, "
        f"exactly {s['output_len']} new tokens each (ignore_eos / min_new_tokens); "
        f"{s['dtype']} random weights; prefill tok/s from a second run with 1 output token.",
        "",
        "| system | prefill tok/s | output tok/s | elapsed s | start-up s | first token s "
        "| prefill / HF | output / HF | notes |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in results["runs"]:
        if "result" not in r:
            lines.append(f"| {r['system']} | {r['error']} | | | | | | | |")
            continue
        x = r["result"]
        ratio = ["", ""]
        if hf is not None and r["system"] != "hf":
            if x["prefill_tokens_per_s"] and hf["prefill_tokens_per_s"]:
                ratio[0] = f"{x['prefill_tokens_per_s'] / hf['prefill_tokens_per_s']:.2f}x"
            ratio[1] = f"{x['output_tokens_per_s'] / hf['output_tokens_per_s']:.2f}x"
        lines.append(
            f"| {r['system']} | {_f(x['prefill_tokens_per_s'])} | "
            f"{_f(x['output_tokens_per_s'])} | {x['elapsed_s']:.1f} | {_f(x['startup_s'], 1)} | "
            f"{_f(x.get('first_token_s'), 1)} | {ratio[0]} | {ratio[1]} | "
            f"{r.get('error', '') or _notes(x)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    on_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    args.device = "cuda" if on_cuda else "cpu"
    args.dtype = args.dtype or ("bfloat16" if on_cuda else "float32")
    results = {
        "setup": {
            **{k: v for k, v in vars(args).items() if k not in ("out", "md")},
            "command": " ".join(
                [
                    "python -m benchmarks.engine.benchmark_vs_hf",
                    *(sys.argv[1:] if argv is None else argv),
                ]
            ),
            "git_sha": git_sha(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        },
        "runs": [],
    }
    with tempfile.TemporaryDirectory(prefix="vs_hf_") as work:
        for system in args.systems:
            results["runs"].append(run_system(args, system, Path(work), on_cuda))
            write(results, args)  # a later run killed leaves these behind
    print("\n" + results["markdown"], flush=True)
    return results


def write(results: dict, args) -> None:
    results["markdown"] = markdown(results)
    write_results(results, args.out, args.md)


if __name__ == "__main__":
    main()
