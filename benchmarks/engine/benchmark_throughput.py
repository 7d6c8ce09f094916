"""Offline throughput: requests/s, total tokens/s and output tokens/s, from a cold start.

    python -m benchmarks.engine.benchmark_throughput --model tiny --num-prompts 32
    python -m benchmarks.engine.benchmark_throughput --model codestral-7b --dtype bfloat16 \
        --num-prompts 128 --input-len 512 --output-len 256 --prefill-run --out r.json
    python -m benchmarks.engine.benchmark_throughput --backend hf --model codestral-7b \
        --dtype bfloat16 --num-prompts 128 --input-len 512 --output-len 256 --prefill-run
    python -m benchmarks.engine.benchmark_throughput --model lfm2-1.2b --dtype bfloat16 \
        --num-prompts 128 --input-len 512 --output-len 256 --max-model-len 768
    VLLM_USE_TRITON_CONV1D=0 python -m benchmarks.engine.benchmark_throughput --model bamba-9b \
        --dtype bfloat16 --num-prompts 200 --output-len 256 --out bamba_cuda_conv.json

Named shapes (dummy weights; model_shapes.py): the Mamba2 ones of ``NAMED_CONFIGS``
(``codestral-7b``, ``tiny``), the Bamba hybrids of ``HYBRID_CONFIGS`` (``bamba-9b``:
ibm-fms/Bamba-9B's shape, ``bamba-tiny`` for a CPU run) and the other architectures of
``ARCH_CONFIGS`` (``falcon-mamba-7b``, ``lfm2-1.2b``, ``granite-4.0-h-tiny``,
``nemotron-3-nano``, each with a ``*-cpu`` stand-in, and ``mamba-cpu``); or a model
directory of any registered architecture.

Backends: ``vllm`` (this project's ``vllm.LLM``) and ``hf`` (HF transformers' model class
of the same architecture, ``.generate`` on the same requests and model shape:
hf_generate.py).
Requests (bench_setup.py): ``--input-len`` / ``--output-len`` fix every prompt's and
output's length (random token ids), as vLLM's throughput benchmark does; else
``--dataset`` (ShareGPT JSON) or synthetic ShareGPT-like lengths. Every request generates
exactly its output length (``ignore_eos``); ``--temperature 0`` is greedy.

Cold by default: the process compiles into a fresh empty Triton cache (bench_setup.py;
``--triton-cache-dir DIR`` for a given one), and the benchmark runs no warm-up of its own:
the engine compiles its kernel variants and captures its decode CUDA graphs while
``LLM(...)`` starts (``llm.engine.startup`` has the split, recorded as
``engine_startup``). Recorded: ``startup_s`` (script start to a ready engine) and
``first_token_s`` (script start to the end of a first 1-token generation of one prompt,
done right after start-up; ``--no-first-token`` skips it), then the timed run.
``step_stats`` (vllm backend; vllm/benchmarks/step_stats.py): the engine's step count,
tokens per step, step times (with and without prefill, and their pieces) and the share of
the timed run's wall time spent inside engine steps, for comparison with a server's (`vllm
bench serve`'s ``server_step_stats``).

``--prefill-run`` adds, after the timed run, a second timed run of the same prompts with
one output token each: prompt tokens / its time is the prefill throughput
(``prefill_tokens_per_s``; a run with ``--output-len 1`` measures the same thing alone).

``--profile`` (vllm) then runs a short profiled generation (the first
``--profile-prompts`` requests cut to ``--profile-prompt-len`` tokens, each generating
``--profile-decode-steps`` + 1 tokens) and splits each step kind's wall time into conv,
scan, matmul, other and idle (host) time, as ``step_profile.py`` describes.
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()  # "script start" of startup_s and first_token_s

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
from dataclasses import asdict  # noqa: E402
from pathlib import Path  # noqa: E402

# None imports torch or triton: the Triton cache is set before either is loaded.
from benchmarks.common.bench_setup import make_requests, triton_cache  # noqa: E402
from benchmarks.common.model_shapes import named_config, shape_names  # noqa: E402
from benchmarks.common.run_info import git_sha, triton_version  # noqa: E402
from benchmarks.common.step_profile import MARKDOWN_HEADER, markdown_rows  # noqa: E402
from benchmarks.engine.engine_profile import profile_engine  # noqa: E402
from vllm.benchmarks import step_stats  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=["vllm", "hf"], default="vllm")
    p.add_argument("--model", default="tiny", help=f"a directory or {', '.join(shape_names())}")
    p.add_argument(
        "--load-format",
        default=None,
        choices=["auto", "safetensors", "dummy"],
        help="default: dummy for a named config, auto for a directory",
    )
    p.add_argument("--dataset", default=None, help="ShareGPT-format JSON (default: synthetic)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=None, help="fixed prompt length")
    p.add_argument("--output-len", type=int, default=None, help="fixed output length")
    p.add_argument("--max-prompt-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--long-prefill-token-threshold", type=int, default=None, help="the engine's")
    p.add_argument(
        "--mamba-ssm-cache-dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="the SSM state pool's dtype (default: the engine's)",
    )
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument(
        "--use-replayssm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replayed decode (default: the engine's, the GPU's: docs/replayssm.md)",
    )
    p.add_argument("--replayssm-buffer-len", type=int, default=None, help="default: the engine's")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="default: the config's (Bamba-9B: 262144, whose block tables a step copies whole)",
    )
    p.add_argument("--block-size", type=int, default=None, help="KV-cache block (hybrids)")
    p.add_argument(
        "--gpu-memory-utilization", type=float, default=None, help="sizes the KV cache (hybrids)"
    )
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--triton-cache-dir", default=None, help="default: a fresh empty one")
    p.add_argument("--no-first-token", action="store_true")
    p.add_argument("--prefill-run", action="store_true", help="also time a 1-token run")
    p.add_argument("--hf-batch-size", type=int, default=None, help="default: all prompts")
    p.add_argument("--hf-kernels", choices=["auto", "mamba_ssm", "torch"], default="auto")
    p.add_argument("--no-hf-warmup", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--profile", action="store_true", help="a short profiled run after timing")
    p.add_argument(
        "--profile-prompts",
        type=int,
        default=None,
        help="default: as many as the run's batch (num prompts, at most max-num-seqs)",
    )
    p.add_argument("--profile-prompt-len", type=int, default=64)
    p.add_argument("--profile-decode-steps", type=int, default=3)
    args = p.parse_args(argv)
    if args.input_len is not None and (args.dataset or args.output_len is None):
        p.error("--input-len needs --output-len and no --dataset")
    if args.backend == "hf" and (args.input_len is None or args.profile):
        p.error("--backend hf needs --input-len and --output-len, and has no --profile")
    return args


def main(argv=None) -> dict:
    t_start = _T0 if argv is None else time.perf_counter()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    with triton_cache(args.triton_cache_dir) as cache:
        results = run(args, t_start, cache)
    results["setup"]["argv"] = ["benchmark_throughput.py", *argv]
    results["triton_cache"] = cache
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2, default=str))
        print(f"results written to {args.out}")
    return results


def run(args, t_start: float, cache: dict) -> dict:
    import torch

    from vllm.model_executor.models.registry import load_model_config

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.model in shape_names():
        model = config = named_config(args.model)
        args.load_format = args.load_format or "dummy"
    else:
        model, args.load_format = args.model, args.load_format or "auto"
        config = load_model_config(args.model)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.backend == "hf":
        from benchmarks.common.hf_generate import run_hf, versions

        requests = make_requests(args, config.vocab_size)
        res = run_hf(args, model, config, requests, t_start)
        setup = {"model_config": asdict(config), **versions()}
    else:
        res, requests, setup = run_vllm(args, model, t_start)
    prompts = [ids for ids, _ in requests]
    n_prompt = sum(len(x) for x in prompts)
    elapsed, n_out = res["elapsed_s"], res["output_tokens"]
    phases = {
        k: res[k]
        for k in (
            "startup_s",
            "first_token_s",
            "warmup_s",
            "elapsed_s",
            "prefill_run_s",
            "profile_s",
        )
        if k in res
    }
    results = {
        "backend": args.backend,
        "requests_per_s": len(requests) / elapsed,
        "total_tokens_per_s": (n_prompt + n_out) / elapsed,
        "output_tokens_per_s": n_out / elapsed,
        "elapsed_s": elapsed,
        "num_requests": len(requests),
        "prompt_tokens": n_prompt,
        "output_tokens": n_out,
        "startup_s": res["startup_s"],
        "first_token_s": res.get("first_token_s"),
        "prefill_tokens_per_s": n_prompt / res["prefill_run_s"] if "prefill_run_s" in res else None,
        "setup": {
            "args": vars(args),
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "torch": torch.__version__,
            "triton": triton_version(),
            "python": platform.python_version(),
            "commit": git_sha(),
            **setup,
        },
        "phases": phases,
        **{k: res[k] for k in ("engine_startup", "hf", "profile", "step_stats") if k in res},
    }
    prefill = results["prefill_tokens_per_s"]
    print(
        f"Throughput ({args.backend}): {results['requests_per_s']:.2f} requests/s, "
        f"{results['total_tokens_per_s']:.1f} total tokens/s, "
        f"{results['output_tokens_per_s']:.1f} output tokens/s "
        f"({len(requests)} requests, {n_prompt} prompt + {n_out} output tokens, "
        f"{elapsed:.2f} s, {args.model} on {results['setup']['device']}; start-up "
        f"{res['startup_s']:.1f} s"
        + (f", first token {res['first_token_s']:.1f} s" if "first_token_s" in res else "")
        + (f"; prefill {prefill:.0f} tok/s" if prefill else "")
        + f"; Triton cache {cache_label(cache)})"
    )
    if "step_stats" in res:
        print(step_stats.format_block(res["step_stats"], "Engine steps (timed run)"))
    if "profile" in res:
        table = [*MARKDOWN_HEADER, *markdown_rows(setup["conv_backend"], res["profile"])]
        print("\n".join(table))
    return results


def run_vllm(args, model, t_start: float):
    import torch

    from vllm import LLM, SamplingParams

    extra = {}
    for name in (
        "mamba_ssm_cache_dtype",
        "max_model_len",
        "block_size",
        "gpu_memory_utilization",
        "num_gpu_blocks_override",
        "long_prefill_token_threshold",
        "use_replayssm",
        "replayssm_buffer_len",
    ):
        if getattr(args, name) is not None:
            extra[name] = getattr(args, name)
    llm = LLM(
        model,
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        **extra,
    )
    on_cuda = args.device == "cuda"

    def sync():
        if on_cuda:
            torch.cuda.synchronize()

    sync()
    res = {"startup_s": time.perf_counter() - t_start}
    startup = getattr(llm.engine, "startup", None)
    if isinstance(startup, dict):
        res["engine_startup"] = startup
    runner = llm.engine.runner
    requests = make_requests(args, runner.model.config.vocab_size, llm.get_tokenizer())
    prompts = [ids for ids, _ in requests]
    params = [
        SamplingParams(temperature=args.temperature, top_p=1.0, max_tokens=n, ignore_eos=True)
        for _, n in requests
    ]
    if not args.no_first_token:
        one = SamplingParams(temperature=args.temperature, max_tokens=1, ignore_eos=True)
        llm.generate(prompts[:1], one, use_tqdm=False)
        sync()
        res["first_token_s"] = time.perf_counter() - t_start
    steps_before = llm.engine.num_steps
    sync()
    totals_before = llm.engine.step_totals.as_dict()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    sync()
    res["elapsed_s"] = time.perf_counter() - start
    totals = step_stats.diff(llm.engine.step_totals.as_dict(), totals_before)
    res["step_stats"] = step_stats.summarize(totals, res["elapsed_s"])
    res["output_tokens"] = sum(len(o.outputs[0].token_ids) for o in outputs)
    steps = llm.engine.num_steps - steps_before
    if args.prefill_run:
        one = SamplingParams(temperature=args.temperature, max_tokens=1, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, one, use_tqdm=False)
        sync()
        res["prefill_run_s"] = time.perf_counter() - start
    config = runner.model.config
    setup = {
        "model_config": asdict(config),
        "dtype": str(runner.model.dtype),
        "mamba_ssm_cache_dtype": str(getattr(llm.engine.config, "mamba_ssm_cache_dtype", None)),
        # in effect (None given: the variable's or the device's default, cache_engine.py)
        "use_replayssm": bool(runner.pool is not None and runner.pool.replay_len),
        "use_replayssm_given": getattr(llm.engine.config, "use_replayssm", None),
        "replayssm_buffer_len": getattr(llm.engine.config, "replayssm_buffer_len", None),
        "ssm_state_dtype": state_dtype(runner),
        "conv_backend": runner.model.conv_backend.value,
        "VLLM_USE_TRITON_CONV1D": os.environ.get("VLLM_USE_TRITON_CONV1D", "1"),
        "engine_steps": steps,
        "cuda_graphs": runner.graphs is not None,
    }
    if args.profile:
        t0 = time.perf_counter()
        res["profile"] = profile_engine(llm, requests, args)
        res["profile_s"] = time.perf_counter() - t0
    return res, requests, setup


def cache_label(cache: dict) -> str:
    if cache["cold"]:
        return "cold" + (" (given folder, empty)" if cache["given"] else "")
    if cache["triton_imported_before"]:
        return "not cold: triton was imported before in this process"
    return f"warm: {cache['entries_at_start']} entries at start"


def state_dtype(runner) -> str | None:
    pool = getattr(runner, "pool", None)
    state = getattr(pool, "ssm_state", None)
    return str(state.dtype) if state is not None else None


if __name__ == "__main__":
    main()
