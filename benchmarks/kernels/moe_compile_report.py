"""Compile the fused-MoE GEMMs for sm_90 on a machine without a GPU, ours beside upstream
vLLM 0.33.0's ``fused_moe_kernel``, and report what ptxas made of each.

    python -m benchmarks.kernels.moe_compile_report [--shapes granite-4.0-h-small,...]
        [--tokens 256,4096] [--candidate JSON ...] [--no-upstream] [--json PATH]

For each shape and token count, ``fused_experts`` is called on CPU tensors that are never
written (``torch.empty``: the weights cost no memory) with its launches recorded, not run:
our gate/up and down launches at the launch table's entry for that bucket (``table``), and
at each ``--candidate`` (a launch-table entry as JSON, e.g. ``'{"BLOCK_M": 64, "BLOCK_N":
64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3, "down": {"BLOCK_N": 128}}'``). With
``.upstream`` on PYTHONPATH (docs/gpu_box.md), upstream's two ``fused_moe_kernel``
launches are recorded too, through its ``invoke_fused_moe_triton_kernel`` at what its
``get_default_config`` picks (an H200 has no bf16 table for these shapes). Each launch is
bound and specialised as the JIT would bind it on the GPU and compiled for ``cuda:90``.

Per variant: registers, spill bytes and stack (``ptxas -v`` on the PTX), shared memory;
``dot``: ``wgmma`` when the PTX holds Hopper's ``wgmma.mma_async``, ``mma.sync`` for the
Ampere path; ``cp.async`` / ``tma``: the PTX's asynchronous copies (pointer gathers, as both
kernels' loads are, become cp.async; TMA needs tensor descriptors); ``bufs``: the ring
depth of the K loop's shared-memory buffers in the TTGIR (``num_stages`` when the loads
are pipelined, 1 or absent when not); and the SASS of the K loop (the largest loop with an
MMA): instructions per trip, MMA instructions (HGMMA or HMMA), LDGSTS (cp.async),
barriers, and the integer / predicate instructions (address and mask arithmetic).
Instructions per trip divided by BLOCK_K and by the output columns of the trip (2 x
BLOCK_N for our gate/up) compare loops of different tiles. Nothing runs on a GPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile the real kernels

import torch

from benchmarks.kernels.sm90_compile import LaunchRecorder, compile_sm90, sass_loops, tools_dir

INT_OPS = ("IMAD", "IADD3", "ISETP", "SEL", "LOP3", "SHF", "LEA", "IABS", "PLOP3", "P2R",
           "R2P", "VIADD", "IMNMX", "UIADD3", "UIMAD", "ULEA", "USEL", "UISETP", "ULOP3",
           "USHF", "UMOV", "MOV")  # fmt: skip


def shapes() -> dict:
    from benchmarks.kernels.tune_fused_moe import SHAPES

    return SHAPES


def _inputs(shape, tokens: int, seed: int = 0):
    hidden, experts, inter, top_k, gated = shape
    rows = 2 * inter if gated else inter
    g = torch.Generator().manual_seed(seed)
    ids = torch.argsort(torch.rand(tokens, experts, generator=g), dim=1)[:, :top_k]
    weights = torch.full((tokens, top_k), 1.0 / top_k)
    x = torch.empty(tokens, hidden, dtype=torch.bfloat16)
    w13 = torch.empty(experts, rows, hidden, dtype=torch.bfloat16)
    w2 = torch.empty(experts, hidden, inter, dtype=torch.bfloat16)
    return x, w13, w2, weights, ids.to(torch.int32)


def record_ours(shape, tokens: int, entry: dict | None = None) -> dict[str, tuple]:
    """{"gate_up": (kernel, args, constexprs), "down": ...} of ``fused_experts`` at the
    table's entry for the bucket, or at ``entry`` in its place."""
    from vllm.model_executor.layers.fused_moe import fused_moe as fm
    from vllm.triton_utils import launch

    x, w13, w2, weights, ids = _inputs(shape, tokens)
    recorder = LaunchRecorder(first_only=True)
    real = fm.use_moe_kernel, fm.launch_config, fm._variants
    fm.use_moe_kernel = lambda x: True  # record the launches instead of the reference
    fm._variants = lambda *a: None  # the recorder keeps the launch's own constexprs
    if entry is not None:
        fm.launch_config = lambda *a: json.loads(json.dumps(entry))
    launch._SESSION = recorder
    try:
        fm.fused_experts(x, w13, w2, weights, ids, "silu" if shape[4] else "relu2", shape[4])
    finally:
        launch._SESSION = None
        fm.use_moe_kernel, fm.launch_config, fm._variants = real
    names = {"moe_gate_up_kernel": "gate_up", "moe_down_kernel": "down"}
    return {names[lr.name]: (lr.kernel, a, c) for lr, a, c in recorder.launches
            if lr.name in names}  # fmt: skip


def upstream_module():
    try:
        from upstream_vllm033.fused_moe import fused_moe as up
    except Exception as err:  # noqa: BLE001 - any import failure skips upstream
        return None, f"{type(err).__name__}: {err}"
    return up, None


def record_upstream(up, shape, tokens: int) -> tuple[dict, dict[str, tuple]]:
    """(config, {"w13": ..., "w2": ...}): upstream's two launches as the benchmark makes
    them (``benchmark_fused_moe.upstream_call``), at ``get_default_config``'s pick."""
    hidden, experts, inter, top_k, gated = shape
    x, w13, w2, weights, ids = _inputs(shape, tokens)
    cfg = up.get_default_config(tokens, experts, inter, hidden, top_k, None)
    bm, pairs = cfg["BLOCK_SIZE_M"], tokens * top_k
    # Its sorted-ids buffer: pairs + E * (BLOCK_M - 1) rows, fewer when pairs < E.
    em = pairs + experts * (bm - 1)
    if pairs < experts:
        em = min(em, pairs * bm)
    sorted_ids = torch.empty(em, dtype=torch.int32)
    expert_ids = torch.empty(triton_cdiv(em, bm), dtype=torch.int32)
    post = torch.empty(1, dtype=torch.int32)
    c1 = torch.empty(tokens, top_k, w13.shape[1], dtype=torch.bfloat16)
    c3 = torch.empty(tokens, top_k, hidden, dtype=torch.bfloat16)
    h = torch.empty(pairs, inter, dtype=torch.bfloat16)
    flags = dict(use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False,
                 use_int4_w4a16=False, per_channel_quant=False)  # fmt: skip
    caught = []

    class Catch:
        def __getitem__(self, grid):
            return lambda *args, **kw: caught.append((args, kw))

    real, up.fused_moe_kernel = up.fused_moe_kernel, Catch()
    try:
        ids3 = (sorted_ids, expert_ids, post)
        up.invoke_fused_moe_triton_kernel(x, w13, c1, None, None, weights, *ids3, False, top_k,
                                          cfg, up.tl.bfloat16, **flags)  # fmt: skip
        up.invoke_fused_moe_triton_kernel(h, w2, c3, None, None, weights, *ids3, True, 1, cfg,
                                          up.tl.bfloat16, **flags)  # fmt: skip
    finally:
        up.fused_moe_kernel = real
    return cfg, {n: (real, a, kw) for n, (a, kw) in zip(("w13", "w2"), caught, strict=True)}


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def ptxas_usage(ptx: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        text = subprocess.run([str(tools_dir() / "ptxas"), "--gpu-name", "sm_90a", "-v",
                               str(src), "-o", str(Path(d) / "k.cubin")],
                              capture_output=True, text=True, check=True).stderr  # fmt: skip
    num = lambda pat: int(m.group(1)) if (m := re.search(pat, text)) else -1  # noqa: E731
    return dict(
        regs=num(r"Used (\d+) registers"),
        spill_st=num(r"(\d+) bytes spill stores"),
        spill_ld=num(r"(\d+) bytes spill loads"),
        stack=num(r"(\d+) bytes stack frame"),
    )


def loop_sass(cubin: bytes) -> dict:
    """Counts over the largest loop of the SASS holding an MMA (the K loop)."""
    best: collections.Counter = collections.Counter()
    for ops, _ in sass_loops(cubin)[1]:
        if (ops["HGMMA"] or ops["HMMA"]) and sum(ops.values()) > sum(best.values()):
            best = ops
    return dict(loop=sum(best.values()), mma=best["HGMMA"] + best["HMMA"],
                ldgsts=best["LDGSTS"], ldg=best["LDG"], lds=best["LDS"] + best["LDSM"],
                bar=best["BAR"] + best["DEPBAR"] + best["WARPGROUP"],
                int=sum(best[o] for o in INT_OPS))  # fmt: skip


def inspect(compiled) -> dict:
    ptx, ttgir = compiled.asm["ptx"], compiled.asm["ttgir"]
    wgmma = len(re.findall(r"\bwgmma\.mma_async", ptx))
    mma = len(re.findall(r"\bmma\.sync", ptx))
    bufs = [int(n) for n in re.findall(r"ttg\.local_alloc\s*:.*?memdesc<(\d+)x\d+x\d+x", ttgir)]
    return dict(
        **ptxas_usage(ptx),
        shared=compiled.metadata.shared,
        dot="wgmma" if wgmma else ("mma.sync" if mma else "none"),
        cp_async=len(re.findall(r"\bcp\.async\.c[ag]\.shared", ptx)),
        tma=len(re.findall(r"\bcp\.async\.bulk\.tensor", ptx)),
        bufs=max(bufs, default=1),
        **loop_sass(compiled.asm["cubin"]),
    )


def tile_of(constexprs: dict) -> dict:
    keys = {"BLOCK_M": "M", "BLOCK_SIZE_M": "M", "BLOCK_N": "N", "BLOCK_SIZE_N": "N",
            "BLOCK_K": "K", "BLOCK_SIZE_K": "K", "num_warps": "w", "num_stages": "s"}  # fmt: skip
    return {v: constexprs[k] for k, v in keys.items() if k in constexprs}


def describe(launch: tuple) -> dict:
    kernel, args, constexprs = launch
    try:
        compiled = compile_sm90(kernel, args, constexprs)
    except Exception as err:  # a config that does not compile is the finding
        return dict(tile=tile_of(constexprs), error=f"{type(err).__name__}: {str(err)[:200]}")
    return dict(tile=tile_of(constexprs), **inspect(compiled))


def report(shape_names, tokens_list, candidates, with_upstream=True) -> list[dict]:
    up, why = upstream_module() if with_upstream else (None, "--no-upstream")
    if with_upstream and up is None:
        print(f"upstream skipped: {why}", file=sys.stderr)
    rows = []
    for name in shape_names:
        shape = shapes()[name]
        for tokens in tokens_list:
            entries = [("table", None)] + [(f"cand{i}", c) for i, c in enumerate(candidates)]
            for label, entry in entries:
                for part, launch in record_ours(shape, tokens, entry).items():
                    rows.append(dict(shape=name, tokens=tokens, who=f"ours:{label}", part=part,
                                     **describe(launch)))  # fmt: skip
            if up is not None:
                _, launches = record_upstream(up, shape, tokens)
                for part, launch in launches.items():
                    rows.append(dict(shape=name, tokens=tokens, who="upstream", part=part,
                                     **describe(launch)))  # fmt: skip
    return rows


def per_column(row: dict) -> float:
    """SASS instructions of one K-loop trip per (K element x output column) x 1000."""
    t = row["tile"]
    cols = t["N"] * (2 if row["part"] == "gate_up" and row["shape_gated"] else 1)
    return 1000 * row["loop"] / (t["K"] * cols * t["M"]) if row.get("loop") else float("nan")


def markdown(rows: list[dict]) -> str:
    head = (
        "| shape | tokens | who | part | M N K w s | regs | spill B | shared KB | dot | "
        "cp.async | bufs | loop instrs | mma | ldgsts | int | instrs/(MxNxK)x1e3 |"
    )
    out = [head, "|" + " --- |" * 16]
    for r in rows:
        t = r["tile"]
        tile = " ".join(str(t.get(k, "-")) for k in "MNKws")
        if "error" in r:
            out.append(f"| {r['shape']} | {r['tokens']} | {r['who']} | {r['part']} | {tile} | "
                       f"FAILED: {r['error']} |" + " |" * 10)  # fmt: skip
            continue
        r = dict(r, shape_gated=shapes()[r["shape"]][4])
        out.append(
            f"| {r['shape']} | {r['tokens']} | {r['who']} | {r['part']} | {tile} | {r['regs']} | "
            f"{r['spill_st'] + r['spill_ld']} | {r['shared'] / 1024:.0f} | {r['dot']} | "
            f"{r['cp_async']} | {r['bufs']} | {r['loop']} | {r['mma']} | {r['ldgsts']} | "
            f"{r['int']} | {per_column(r):.2f} |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="granite-4.0-h-small,nemotron-3-nano")
    p.add_argument("--tokens", default="256,4096")
    p.add_argument("--candidate", action="append", default=[], help="a table entry as JSON")
    p.add_argument("--no-upstream", action="store_true")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    names = args.shapes.split(",")
    unknown = [n for n in names if n not in shapes()]
    if unknown:
        raise ValueError(f"--shapes: unknown {unknown}; known {sorted(shapes())}")
    candidates = [json.loads(c) for c in args.candidate]
    rows = report(names, [int(t) for t in args.tokens.split(",")], candidates,
                  not args.no_upstream)  # fmt: skip
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
