"""Generate a few tokens with ``vllm.LLM``: the whole path, request to sampled token.

    python examples/generate_demo.py [--max-tokens N] [--prompt TEXT ...] [--json PATH]
    python examples/generate_demo.py --model path/to/mamba2   # an HF Mamba2 directory

Without ``--model``: on a CUDA GPU the Mamba-Codestral-7B shape with random bf16 weights;
without one a tiny Mamba2 (2 layers, hidden 64) with random fp32 weights, made on the spot,
its Triton conv kernels run by Triton's interpreter. Random weights know no language: the
text is noise (bytes of the byte-level fallback tokenizer, U+FFFD where they are not
UTF-8); what the demo shows is that prompts go in, tokens come out, and how fast. On the
CPU the speed is the interpreter's and says nothing about the kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import time

DEFAULT_PROMPTS = ["Mamba2 is a state space model that", "def causal_conv1d(x, weight):"]

# Enough to exercise every part (a grouped scan, chunked prefill) and still be instant.
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_heads=8,
    head_dim=16,
    state_size=16,
    n_groups=2,
    chunk_size=16,
)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="an HF Mamba2 directory (default: random)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--json", metavar="PATH", help="also write the outputs as JSON")
    args = p.parse_args(argv)

    import torch

    on_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if not on_cuda:
        # Before the kernel modules are imported: Triton decides at decoration time.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from vllm import LLM, SamplingParams
    from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig

    if args.model:
        model, name, kwargs = args.model, args.model, {}
    elif on_cuda:
        model, name = Mamba2ModelConfig(), "Mamba-Codestral-7B shape, random bf16 weights"
        kwargs = dict(load_format="dummy", dtype="bfloat16")
    else:
        model, name = Mamba2ModelConfig(**TINY), "tiny Mamba2, random fp32 weights"
        kwargs = dict(load_format="dummy", dtype="float32")
    prompts = args.prompt or DEFAULT_PROMPTS
    t0 = time.perf_counter()
    llm = LLM(
        model,
        device="cuda" if on_cuda else "cpu",
        max_num_seqs=max(len(prompts), 2),
        seed=args.seed,
        **kwargs,
    )
    build_s = time.perf_counter() - t0
    runner = llm.engine.runner
    print(
        f"{name}: {runner.model.config.num_hidden_layers} layers on {runner.device}, "
        f"conv {runner.model.conv_backend.value}, built in {build_s:.1f} s",
        flush=True,
    )
    # No per-request seed: requests with one seed draw the same noise (the engine's
    # generator, seeded by --seed, keeps the run reproducible).
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True
    )
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if on_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    for o in outputs:
        c = o.outputs[0]
        print(f"\nprompt: {o.prompt!r}\noutput: {c.text!r}\ntokens: {c.token_ids}")
    print(
        f"\n{n_out} tokens for {len(prompts)} prompts in {seconds:.2f} s: "
        f"{n_out / seconds:.1f} tokens/s ({llm.engine.num_steps} engine steps)"
        + ("" if on_cuda else "; CPU: Triton interpreter speed, not kernel speed")
    )
    report = {
        "model": name,
        "device": torch.cuda.get_device_name() if on_cuda else "cpu",
        "conv_backend": runner.model.conv_backend.value,
        "build_s": build_s,
        "generate_s": seconds,
        "output_tokens": n_out,
        "tokens_per_s": n_out / seconds,
        "engine_steps": llm.engine.num_steps,
        "outputs": [
            {"prompt": o.prompt, "text": o.outputs[0].text, "token_ids": o.outputs[0].token_ids}
            for o in outputs
        ],
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
