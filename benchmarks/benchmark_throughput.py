"""Offline throughput of the engine: requests/s, total tokens/s and output tokens/s.

Prompts come from a ShareGPT-format JSON file (``--dataset``: a list of
``{"conversations": [{"from": ..., "value": ...}, ...]}``; the first human turn is the
prompt, the first model turn's token count the output length unless ``--output-len``), or
from the synthetic generator below. Examples:

    python benchmarks/benchmark_throughput.py --model tiny --num-prompts 32
    python benchmarks/benchmark_throughput.py --model codestral-7b --load-format dummy \
        --dtype bfloat16 --num-prompts 200 --output-len 256 --out results.json

Synthetic lengths (no data set at hand): prompt and output lengths are drawn from
log-normal distributions, ``exp(N(log(median), sigma))``, clipped to
[4, --max-prompt-len] and [4, --max-output-len], with medians 150 and 180 tokens and
sigmas 1.0 and 0.9: a heavy right tail and a few-hundred-token bulk, the shape commonly
reported for ShareGPT conversations. These parameters are chosen by hand, not fitted to
ShareGPT; use ``--dataset`` for the real distribution. Prompt token ids are uniform over
the vocabulary (the dummy models have no tokenizer).

Before the timed run, the decode CUDA graphs the run can use are captured (on CUDA, unless
``--enforce-eager``; the capture time is printed) and two short generations warm up the
kernels (Triton compiles each variant on first use, the CUDA ops do not): the two longest
prompts (steps of few sequences and many tokens), then as many short prompts as the run
batches beside the longest (steps of many sequences), so no compile falls inside the
timed run. ``--profile`` then runs a short profiled generation (the first
``--profile-prompts`` requests cut to ``--profile-prompt-len`` tokens, each generating
``--profile-decode-steps`` + 1 tokens: a few mixed steps, then decode-only steps at the
run's batch size) and splits each step kind's wall time into conv, scan, matmul, other and
idle (host) time, as ``step_profile.py`` describes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_profile import MARKDOWN_HEADER, kernel_records, markdown_rows, summarize  # noqa: E402

PROFILE_PREFIX = "engine:"

NAMED_CONFIGS = {
    # Mamba-Codestral-7B's shape: Mamba2ModelConfig's defaults.
    "codestral-7b": {},
    # Small enough for a CPU run in seconds.
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_heads=8,
        head_dim=16,
        state_size=16,
        n_groups=1,
        chunk_size=16,
    ),
}


def synthetic_requests(args, vocab_size: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)

    def draw(median: float, sigma: float, hi: int) -> int:
        return max(4, min(hi, round(math.exp(rng.gauss(math.log(median), sigma)))))

    out = []
    for _ in range(args.num_prompts):
        plen = draw(150, 1.0, args.max_prompt_len)
        olen = args.output_len or draw(180, 0.9, args.max_output_len)
        out.append(([rng.randrange(vocab_size) for _ in range(plen)], olen))
    return out


def sharegpt_requests(args, tokenizer) -> list[tuple[list[int], int]]:
    data = json.loads(Path(args.dataset).read_text())
    rng = random.Random(args.seed)
    rng.shuffle(data)
    out = []
    for item in data:
        turns = item.get("conversations") or []
        human = next((t["value"] for t in turns if t.get("from") == "human"), None)
        reply = next((t["value"] for t in turns if t.get("from") in ("gpt", "model")), None)
        if human is None or (reply is None and not args.output_len):
            continue
        ids = tokenizer.encode(human)[: args.max_prompt_len]
        olen = args.output_len or min(args.max_output_len, len(tokenizer.encode(reply)))
        if len(ids) < 4 or olen < 4:
            continue  # vLLM's benchmark drops such short pairs too
        out.append((ids, olen))
        if len(out) == args.num_prompts:
            break
    if len(out) < args.num_prompts:
        raise SystemExit(f"{args.dataset} gave only {len(out)} usable prompts")
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model",
        default="tiny",
        help=f"a model directory or a named config: {', '.join(NAMED_CONFIGS)}",
    )
    p.add_argument(
        "--load-format",
        default=None,
        choices=["auto", "safetensors", "dummy"],
        help="default: dummy for a named config, auto for a directory",
    )
    p.add_argument("--dataset", default=None, help="ShareGPT-format JSON (default: synthetic)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="output tokens per request (default: from the data / generator)",
    )
    p.add_argument("--max-prompt-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--no-warmup", action="store_true", help="time from a cold start")
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

    import torch

    from vllm import LLM, SamplingParams
    from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig

    if args.model in NAMED_CONFIGS:
        model = Mamba2ModelConfig(**NAMED_CONFIGS[args.model])
        load_format = args.load_format or "dummy"
    else:
        model, load_format = args.model, args.load_format or "auto"
    phases = {}
    t0 = time.perf_counter()
    llm = LLM(
        model,
        load_format=load_format,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
    )
    phases["load_s"] = time.perf_counter() - t0
    runner = llm.engine.runner
    vocab = runner.model.config.vocab_size
    if args.dataset:
        requests = sharegpt_requests(args, llm.get_tokenizer())
    else:
        requests = synthetic_requests(args, vocab)
    prompts = [ids for ids, _ in requests]
    params = [
        SamplingParams(temperature=1.0, top_p=1.0, max_tokens=n, ignore_eos=True)
        for _, n in requests
    ]

    device = runner.device
    on_cuda = device.type == "cuda"
    capture = None
    if runner.graphs is not None:
        capture = capture_graphs(runner.graphs, min(len(requests), args.max_num_seqs))
        phases["capture_s"] = capture["seconds"]
    if not args.no_warmup:
        t0 = time.perf_counter()
        warm = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
        # Step shapes pick kernel variants (Triton compiles each on first use): a step of
        # few sequences and many tokens (the two longest prompts), and one of many
        # sequences (as many short prompts as the run batches, beside a long one).
        longest = sorted(prompts, key=len)[-2:]
        llm.generate(longest, warm, use_tqdm=False)
        many = [ids[:16] for ids in prompts[: min(len(prompts), args.max_num_seqs) - 1]]
        llm.generate(many + longest[-1:], warm, use_tqdm=False)
        phases["warmup_s"] = time.perf_counter() - t0

    steps_before = llm.engine.num_steps
    if on_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    if on_cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    phases["elapsed_s"] = elapsed

    n_prompt = sum(len(x) for x in prompts)
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    results = {
        "requests_per_s": len(requests) / elapsed,
        "total_tokens_per_s": (n_prompt + n_out) / elapsed,
        "output_tokens_per_s": n_out / elapsed,
        "elapsed_s": elapsed,
        "num_requests": len(requests),
        "prompt_tokens": n_prompt,
        "output_tokens": n_out,
        "setup": {
            "argv": sys.argv if argv is None else ["benchmark_throughput.py", *argv],
            "args": vars(args),
            "model_config": asdict(llm.engine.runner.model.config),
            "dtype": str(llm.engine.runner.model.dtype),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "conv_backend": llm.engine.runner.model.conv_backend.value,
            "VLLM_USE_TRITON_CONV1D": os.environ.get("VLLM_USE_TRITON_CONV1D", "1"),
            "torch": torch.__version__,
            "triton": triton_version(),
            "python": platform.python_version(),
            "engine_steps": llm.engine.num_steps - steps_before,
            "cuda_graphs": runner.graphs is not None,
        },
        "graph_capture": capture,
        "phases": phases,
    }
    print(
        f"Throughput: {results['requests_per_s']:.2f} requests/s, "
        f"{results['total_tokens_per_s']:.1f} total tokens/s, "
        f"{results['output_tokens_per_s']:.1f} output tokens/s "
        f"({len(requests)} requests, {n_prompt} prompt + {n_out} output tokens, "
        f"{elapsed:.2f} s, {args.model} on {results['setup']['device']}, "
        f"conv {results['setup']['conv_backend']})"
    )
    if args.profile:
        t0 = time.perf_counter()
        results["profile"] = profile_engine(llm, requests, args)
        phases["profile_s"] = time.perf_counter() - t0
        table = [
            *MARKDOWN_HEADER,
            *markdown_rows(results["setup"]["conv_backend"], results["profile"]),
        ]
        print("\n".join(table))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2, default=str))
        print(f"results written to {args.out}")
    return results


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def capture_graphs(graphs, max_batch: int) -> dict:
    """Capture the decode graphs a batch of up to ``max_batch`` can use; time and memory."""
    import torch

    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    t0 = time.perf_counter()
    sizes = graphs.capture(max_batch)
    torch.cuda.synchronize()
    info = {
        "graphs": len(sizes),
        "batch_sizes": sizes,
        "seconds": time.perf_counter() - t0,
        "memory_gib": (torch.cuda.memory_reserved() - reserved) / 2**30,
    }
    print(
        f"captured {len(sizes)} decode CUDA graphs (batch {sizes[0]}..{sizes[-1]}) in "
        f"{info['seconds']:.1f} s, +{info['memory_gib']:.2f} GiB reserved",
        flush=True,
    )
    return info


def profile_engine(llm, requests, args) -> dict:
    """Profile a short generation step by step (see the module docstring); the
    ``step_profile`` summary per step kind: mixed, decode (eager) or decode_graph."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from vllm import SamplingParams

    engine, runner = llm.engine, llm.engine.runner
    on_cuda = runner.device.type == "cuda"
    n = min(args.profile_prompts or len(requests), args.max_num_seqs, len(requests))
    params = SamplingParams(max_tokens=args.profile_decode_steps + 1, ignore_eos=True)
    for ids, _ in requests[:n]:
        engine.add_request(ids[: args.profile_prompt_len], params)

    # The kind of a step is known once the scheduler has made its batch: the runner's
    # execute is wrapped, for this run only, to note it.
    kinds: list[str] = []
    execute = runner.execute

    def noting_execute(batch):
        if batch.num_decodes < len(batch):
            kinds.append("mixed")
        elif runner.graphs is not None and runner.graphs.fits(len(batch)):
            kinds.append("decode_graph")
        else:
            kinds.append("decode")
        return execute(batch)

    runner.execute = noting_execute
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    walls = {}
    try:
        with profile(activities=activities) as prof:
            while engine.has_unfinished_requests():
                name = f"{PROFILE_PREFIX}#{len(walls)}"
                t0 = time.perf_counter()
                with record_function(name):
                    engine.step()  # ends in a host sync: the sampled tokens
                    if on_cuda:
                        torch.cuda.synchronize()
                walls[name] = (time.perf_counter() - t0) * 1e3
    finally:
        del runner.execute
    steps = {name: (kind, wall) for (name, wall), kind in zip(walls.items(), kinds, strict=True)}
    records = kernel_records(prof.events(), PROFILE_PREFIX, on_cuda)
    summary = summarize(records, steps, PROFILE_PREFIX, graphed_kinds=("decode_graph",))
    summary["_requests"] = {"prompts": n, "prompt_len_max": args.profile_prompt_len}
    return summary


if __name__ == "__main__":
    main()
