"""Unified attention benchmark: decode-heavy and mixed steps over a paged KV cache.

    python -m benchmarks.kernels.benchmark_unified_attention [--out DIR] [--cases ...]
        [--dtype bf16] [--num-heads 32] [--num-kv-heads 8] [--head-size 128]
        [--block-size 16] [--providers triton torch_ref]

Each case is one continuous-batching step: sequences of (query tokens, cached context),
physical blocks shuffled. Before timing, the Triton op runs once and is compared with
the fp32 reference (``unified_attention_ref``) under the tests' tolerance for the dtype;
a mismatch is reported and the run exits 1 without timing.

Providers: ``triton`` (ours, one launch for the whole step) and ``torch_ref`` (the fp32
PyTorch reference: a per-sequence gather + softmax loop, the CPU path; slow, a floor
for what the kernel must beat). Times: ``triton.testing.do_bench`` median with p20/p80
(microseconds), and for decode-only steps also a CUDA-graph replay time per call (warm
L2, no launch overhead: what the engine's decode graphs see). Bytes: K/V of every
visible token read once + q read + out written; GB/s against the same GPU's measured
device-copy bandwidth (``benchmark_utils.copy_gbps``). TFLOP/s counts 4 * H * D per
(query, visible key) pair.

Needs a CUDA GPU (``--help`` works anywhere). ``--out DIR`` writes
DIR/unified_attention_bench.{csv,md,json} with the GPU, torch/triton versions, git sha
and the command.
"""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

# Steps: name -> ((q_len, context_len, count), ...), decodes first as the scheduler orders.
CASES: dict[str, tuple[tuple[int, int, int], ...]] = {
    "decode_64x1k": ((1, 1023, 64),),
    "decode_256x2k": ((1, 2047, 256),),
    "decode_16x8k": ((1, 8191, 16),),
    "decode_4x32k": ((1, 32767, 4),),  # few long sequences: no split-KV, few programs
    "mixed_255dec+1x2048": ((1, 1023, 255), (2048, 0, 1)),
    "mixed_64dec+4x512c2k": ((1, 2047, 64), (512, 2048, 4)),
    "prefill_1x4096": ((4096, 0, 1),),
    "prefill_8x512c1k": ((512, 1024, 8),),
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOLERANCES = {  # as tests/kernels/attention/attn_utils.py
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
COLUMNS = [
    "case",
    "provider",
    "tokens",
    "seqs",
    "us_p50",
    "us_p20",
    "us_p80",
    "graph_us",
    "MB",
    "GB/s",
    "%copy",
    "TFLOP/s",
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 2)[2],
    )
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    p.add_argument(
        "--providers", nargs="+", choices=["triton", "torch_ref"], default=["triton", "torch_ref"]
    )
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--rep-ms", type=int, default=100, help="do_bench measuring time per case")
    p.add_argument("--out", type=Path, help="directory for the csv/md/json results")
    return p.parse_args(argv)


def build_step(spec, args, dtype, gen):
    """A step on the GPU: q, a cache holding exactly the step's tokens, metadata."""
    seqs = [(q, c) for q, c, n in spec for _ in range(n)]
    bs, kvh, d = args.block_size, args.num_kv_heads, args.head_size
    seq_lens = [q + c for q, c in seqs]
    needs = [-(-n // bs) for n in seq_lens]
    num_blocks = sum(needs)
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seqs), max(needs), dtype=torch.int32)
    at = 0
    for i, need in enumerate(needs):
        table[i, :need] = perm[at : at + need]
        at += need
    cache = torch.randn(2, num_blocks, bs, kvh, d, device="cuda", dtype=dtype)
    num_tokens = sum(q for q, _ in seqs)
    q = torch.randn(num_tokens, args.num_heads, d, device="cuda", dtype=dtype)
    qsl = torch.tensor([0] + [q for q, _ in seqs], dtype=torch.int64).cumsum(0)
    hints = dict(
        num_decodes=next((i for i, (ql, _) in enumerate(seqs) if ql != 1), len(seqs)),
        max_query_len=max(ql for ql, _ in seqs),
        max_seq_len=max(seq_lens),
    )
    meta = dict(
        query_start_loc=qsl.to(torch.int32).cuda(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_table=table.cuda(),
    )
    elem = cache.element_size()
    nbytes = 2 * sum(seq_lens) * kvh * d * elem + 2 * q.numel() * elem
    pairs = sum(ql * c + ql * (ql + 1) // 2 for ql, c in seqs)
    flops = 4 * pairs * args.num_heads * d
    return q, cache, meta, hints, nbytes, flops, all(ql == 1 for ql, _ in seqs)


def git_sha() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_case(name, args, dtype, copy) -> list[dict] | None:
    """The case's rows, one per provider; None when the op disagrees with the reference."""
    import triton.testing

    from benchmarks.kernels.benchmark_utils import graph_samples, summarize
    from vllm.model_executor.layers.attention.ops.unified_attention import (
        unified_attention,
        unified_attention_ref,
    )

    scale = args.head_size**-0.5
    gen = torch.Generator().manual_seed(len(name))
    q, cache, meta, hints, nbytes, flops, decode_only = build_step(CASES[name], args, dtype, gen)
    out = torch.full_like(q, float("nan"))
    unified_attention(q, cache, out, scale=scale, **meta, **hints)
    ref = unified_attention_ref(q, cache, torch.empty_like(q), scale=scale, **meta)
    if torch.isnan(out).any() or not torch.allclose(out, ref, **TOLERANCES[dtype]):
        err = (out.float() - ref.float()).abs().nan_to_num(float("inf")).max().item()
        print(f"{name}: MISMATCH vs the reference (max abs err {err:.3g}); not timed")
        return None
    fns = {
        "triton": lambda: unified_attention(q, cache, out, scale=scale, **meta, **hints),
        "torch_ref": lambda: unified_attention_ref(q, cache, out, scale=scale, **meta),
    }
    rows = []
    for provider in args.providers:
        fn = fns[provider]
        p50, p20, p80 = triton.testing.do_bench(fn, rep=args.rep_ms, quantiles=[0.5, 0.2, 0.8])
        graph = None
        if decode_only and provider == "triton":
            graph = summarize(graph_samples(fn))[0]
        us = p50 * 1e3
        rows.append({
            "case": name, "provider": provider, "tokens": q.shape[0],
            "seqs": meta["seq_lens"].shape[0], "us_p50": round(us, 1),
            "us_p20": round(p20 * 1e3, 1), "us_p80": round(p80 * 1e3, 1),
            "graph_us": None if graph is None else round(graph, 1),
            "MB": round(nbytes / 1e6, 1), "GB/s": round(nbytes / us / 1e3, 1),
            "%copy": round(100 * nbytes / us / 1e3 / copy, 1),
            "TFLOP/s": round(flops / us / 1e6, 1),
        })  # fmt: skip
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmark_unified_attention needs a CUDA GPU (see --help)", file=sys.stderr)
        return 2
    import triton

    from benchmarks.kernels.benchmark_utils import copy_gbps

    dtype = DTYPES[args.dtype]
    copy = copy_gbps()
    rows, failed = [], []
    for name in args.cases:
        case_rows = run_case(name, args, dtype, copy)
        if case_rows is None:
            failed.append(name)
        else:
            rows += case_rows
        torch.cuda.empty_cache()

    header = (
        f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
        f"{triton.__version__}, git {git_sha()}, {args.dtype}, heads {args.num_heads}/"
        f"{args.num_kv_heads} x {args.head_size}, block {args.block_size}, copy {copy:.0f} GB/s"
    )
    table = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    table += [
        "| " + " | ".join("" if r[c] is None else str(r[c]) for c in COLUMNS) + " |" for r in rows
    ]
    print(header)
    print("\n".join(table))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        command = "python " + shlex.join(sys.argv)
        stem = args.out / "unified_attention_bench"
        with open(f"{stem}.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(rows)
        Path(f"{stem}.md").write_text(f"{header}\n\n`{command}`\n\n" + "\n".join(table) + "\n")
        Path(f"{stem}.json").write_text(
            json.dumps(
                {"header": header, "command": command, "rows": rows, "failed": failed}, indent=1
            )
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
