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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    import torch

    from vllm import LLM, SamplingParams
    from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig

    if args.model in NAMED_CONFIGS:
        model = Mamba2ModelConfig(**NAMED_CONFIGS[args.model])
        load_format = args.load_format or "dummy"
    else:
        model, load_format = args.model, args.load_format or "auto"
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
    vocab = llm.engine.runner.model.config.vocab_size
    if args.dataset:
        requests = sharegpt_requests(args, llm.get_tokenizer())
    else:
        requests = synthetic_requests(args, vocab)
    prompts = [ids for ids, _ in requests]
    params = [
        SamplingParams(temperature=1.0, top_p=1.0, max_tokens=n, ignore_eos=True)
        for _, n in requests
    ]

    device = llm.engine.runner.device
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start

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
            "python": platform.python_version(),
            "engine_steps": llm.engine.num_steps,
        },
    }
    print(
        f"Throughput: {results['requests_per_s']:.2f} requests/s, "
        f"{results['total_tokens_per_s']:.1f} total tokens/s, "
        f"{results['output_tokens_per_s']:.1f} output tokens/s "
        f"({len(requests)} requests, {n_prompt} prompt + {n_out} output tokens, "
        f"{elapsed:.2f} s, {args.model} on {results['setup']['device']}, "
        f"conv {results['setup']['conv_backend']})"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2, default=str))
        print(f"results written to {args.out}")
    return results


if __name__ == "__main__":
    main()
