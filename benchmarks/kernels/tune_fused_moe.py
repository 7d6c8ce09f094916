"""Sweep the fused-MoE launch table per shape and token bucket, and write the device's table
(``vllm/model_executor/layers/fused_moe/configs/fused_moe/NVIDIA_H200.json`` on an H200).

    python -m benchmarks.kernels.tune_fused_moe [--shapes granite-4.0-h-small,nemotron-3-nano]
        [--tokens 1,16,64,256,1024,4096] [--reps 10] [--out PATH] [--json F]
    python -m benchmarks.kernels.tune_fused_moe --smoke --out DIR    # CPU, interpreter

Shapes (``SHAPES``: hidden, experts, intermediate, top_k, gated): the benchmark's two
(``benchmark_fused_moe``) and granite-4.0-h-tiny's MoE (hidden 1536, 64 experts of 512,
top 6, SwiGLU; ``GRANITE_4_0_H_TINY``), the MoE model of the end-to-end benchmarks
(nemotron-3-nano is the other). bf16, random weights and softmax top-k routing as
``benchmark_fused_moe.Case`` draws them, at each bucket's token count.

Per (shape, bucket), starting from the entry the op reads now (``launch_config``): first
BLOCK_M (shared by the alignment and both GEMMs) with the gate/up tile, each of
``GATE_UP[bucket]`` at each of ``BLOCK_M[bucket]`` (down as the entry has it); then the
down tile, each of ``DOWN[bucket]`` at the winner; then the whole entries of
``WHOLE[bucket]`` (BLOCK_M and both tiles at once); then, each from the best so far, every
other ``GROUP_SIZE_M`` of ``GROUPS`` for gate/up and for down (the grid order: 1, a row
block's column blocks side by side, upstream's order; 1024, every row block per column
block, the order before the swizzle) and the other side of ``MASK_ROWS`` (padding rows
load nothing) in both GEMMs; last, where the step has at most E pairs, the other side of
the unsorted path at the best so far (``align.max_unsorted_pairs``: 0 if the step skips
the alignment now, else its pairs). These last stages compile their candidates together
just before timing them. The lists come from the compile report
(``moe_compile_report``, docs/fused_moe.md): BLOCK_M >= 64 where tokens allow (wgmma; 16
and 32 compile to mma.sync), 8 warps with the large tiles, no spilling variant. Every
candidate of a shape is compiled first, in parallel (``launch.precompile``); each is then
run once and checked against the fp32 reference (rel-L2 under ``benchmark_fused_moe.TOL``)
before it is timed (``ColdTimer``, median of ``--reps``, the whole op: alignment, two GEMMs,
top-k sum); a failing candidate is reported and skipped. The winners are written under
``table_key(E, H, I, dtype, tokens)`` into the device's table, keeping its other entries,
with a ``meta`` block (command, commit, device, date, Triton, the default's and the
winner's time per case).

Budget (the two benchmark shapes on an H200, the default arguments): per case at most
2 x 5 + 4 + 2 + 2 x 2 + 1 + 1 = 22 candidates (6 buckets x 2 shapes: at most 240 timings of
10 cold calls, each ~0.5 ms of flush and sleep plus the call, under 15 s in all, and 12
fp32 references, seconds). Compiles dominate: about 50 distinct kernel variants per shape
at ~3 s each, over 16 cores in parallel threads, ~30 s per shape, then up to 6 per case
for the last two stages (two parallel compiles of ~3 s per case, ~40 s per shape). With
start-up and weights (Granite's 1.8 GB drawn once) about 3.5 minutes; the three shapes
stay under 6.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

from benchmarks.kernels.benchmark_fused_moe import SHAPES as BENCH_SHAPES
from benchmarks.kernels.benchmark_fused_moe import TOL, Case, measure, rel
from benchmarks.kernels.benchmark_utils import summarize

SHAPES = {**BENCH_SHAPES, "granite-4.0-h-tiny": (1536, 64, 512, 6, True)}
SMOKE_SHAPES = {"smoke-gated": (32, 8, 24, 2, True), "smoke-relu2": (24, 6, 16, 2, False)}
DEFAULT_SHAPES = "granite-4.0-h-small,nemotron-3-nano"
BUCKETS = (1, 16, 64, 256, 1024, 4096)


def _tile(n, k, w, s) -> dict:
    return dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)


_SMALL_UP = [_tile(64, 64, 4, 3), _tile(32, 128, 4, 4), _tile(64, 128, 4, 4),
             _tile(32, 64, 4, 3), _tile(128, 64, 4, 3)]  # fmt: skip
_SMALL_DOWN = [_tile(64, 64, 4, 3), _tile(64, 128, 4, 4), _tile(128, 64, 4, 3),
               _tile(32, 128, 4, 4)]  # fmt: skip
_LARGE_UP = [_tile(64, 64, 8, 3), _tile(128, 64, 8, 3), _tile(64, 64, 4, 3),
             _tile(64, 128, 8, 3), _tile(64, 64, 8, 4)]  # fmt: skip
_LARGE_DOWN = [_tile(128, 64, 8, 3), _tile(64, 64, 8, 3), _tile(256, 64, 8, 3),
               _tile(128, 64, 8, 4)]  # fmt: skip
BLOCK_M = {1: (16,), 16: (16,), 64: (16, 32), 256: (64, 32), 1024: (64, 128), 4096: (128, 64)}
GATE_UP = {1: _SMALL_UP, 16: _SMALL_UP, 64: _SMALL_UP, 256: _LARGE_UP, 1024: _LARGE_UP,
           4096: _LARGE_UP}  # fmt: skip
DOWN = {1: _SMALL_DOWN, 16: _SMALL_DOWN, 64: _SMALL_DOWN, 256: _LARGE_DOWN,
        1024: _LARGE_DOWN, 4096: _LARGE_DOWN}  # fmt: skip
# Whole entries (BLOCK_M, gate/up tile, down tile) timed after the two greedy stages: a
# large tile pays only with BLOCK_M 128 and both GEMMs at it together, which the greedy
# stages (BLOCK_M with the old down tile first) never reach. Upstream's H100 table for
# Nemotron-3-Nano takes M 128, N 256, K 64, 8 warps, 4 stages from 2048 tokens on.
_WIDE = (128, _tile(256, 64, 8, 4), _tile(256, 64, 8, 4))
WHOLE = {1024: (_WIDE, (64, _tile(256, 64, 8, 4), _tile(256, 64, 8, 4))),
         4096: (_WIDE, (128, _tile(128, 64, 8, 4), _tile(256, 64, 8, 4)))}  # fmt: skip
SMOKE_LISTS = ({1: (16,), 16: (16, 32)}, [_tile(16, 32, 1, 1), _tile(32, 16, 1, 1)],
               [_tile(16, 16, 1, 1), _tile(32, 32, 1, 1)])  # fmt: skip
SMOKE_WHOLE = {16: ((32, _tile(32, 32, 1, 1), _tile(16, 32, 1, 1)),)}
# GROUP_SIZE_M: upstream's order (1), groups of 8 row blocks, the old column-major order.
GROUPS = (1, 8, 1024)
SMOKE_GROUPS = (1, 3)

PARTS = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "GROUP_SIZE_M", "MASK_ROWS")


def resolved(entry: dict, part: str) -> dict:
    """The part's tile as the op reads it: the entry's top level, its part dict over it."""
    own = {**entry, **entry.get(part, {})}
    return {k: own[k] for k in PARTS if k in own}


def candidate(base: dict, block_m: int, up: dict, down: dict) -> dict:
    return dict(resolved(base, "gate_up"), BLOCK_M=block_m, gate_up=dict(up), down=dict(down),
                **{k: v for k, v in base.items() if k in ("sum", "align")})  # fmt: skip


class Sweep:
    """One shape's cases and the op run at a given entry (``launch_config`` replaced)."""

    def __init__(self, shape, buckets, dtype, device):
        from vllm.model_executor.layers.fused_moe import fused_moe as fm

        self.fm, self.shape = fm, shape
        self.cases = {t: Case(shape, t, dtype, device, seed=t) for t in buckets}
        self.refs: dict[int, torch.Tensor] = {}
        self.real = fm.launch_config

    def run(self, tokens: int, entry: dict | None):
        fm, case = self.fm, self.cases[tokens]
        given = lambda *a: json.loads(json.dumps(entry))  # noqa: E731 - a fresh copy per call
        fm.launch_config = self.real if entry is None else given
        fm._align_variants.cache_clear()
        try:
            return fm.fused_experts(case.x, case.w13, case.w2, case.weights, case.ids,
                                    case.activation, case.gated)  # fmt: skip
        finally:
            fm.launch_config = self.real
            fm._align_variants.cache_clear()

    def precompile(self, entries: list[tuple[int, dict]]) -> float:
        from vllm.triton_utils.launch import precompile

        t0 = time.perf_counter()
        with precompile():
            for tokens, entry in entries:
                self.run(tokens, entry)
        return time.perf_counter() - t0

    def check(self, tokens: int, entry: dict | None) -> float:
        if tokens not in self.refs:
            self.refs[tokens] = self.cases[tokens].reference()
        return rel(self.run(tokens, entry), self.refs[tokens])


def with_part(entry: dict, part: str, **given) -> dict:
    """A copy of ``entry`` with ``given`` set in its ``part`` dict (``align``, ``down``...)."""
    out = json.loads(json.dumps(entry))
    out[part] = {**out.get(part, {}), **given}
    return out


def order_candidates(entry: dict, part: str, groups) -> list[dict]:
    have = resolved(entry, part).get("GROUP_SIZE_M", 1)
    return [with_part(entry, part, GROUP_SIZE_M=g) for g in groups if g != have]


def mask_candidates(entry: dict) -> list[dict]:
    """Both GEMMs with the other side of MASK_ROWS (``fused_moe.mask_rows``)."""
    from vllm.model_executor.layers.fused_moe import fused_moe as fm

    now = fm.mask_rows(entry, "gate_up")
    return [with_part(with_part(entry, "gate_up", MASK_ROWS=not now), "down", MASK_ROWS=not now)]


def unsorted_candidates(entry: dict, tokens: int, shape) -> list[dict]:
    """The other side of the unsorted path where the step could take it (pairs <= E)."""
    _, experts, _, top_k, _ = shape
    pairs = tokens * top_k
    if pairs > experts:
        return []
    from vllm.model_executor.layers.fused_moe import fused_moe as fm

    now = fm.max_unsorted_pairs(entry, experts)
    return [with_part(entry, "align", max_unsorted_pairs=0 if pairs <= now else pairs)]


def tune_case(sweep: Sweep, tokens: int, lists, args, timer, log) -> dict:
    block_ms, ups, downs = (lst[tokens] if isinstance(lst, dict) else lst for lst in lists[:3])
    groups, wholes = lists[3], lists[4].get(tokens, ())
    base = sweep.fm.launch_config(tokens, *_shape_args(sweep.shape), args.dtype)

    def timed(entry):
        try:
            err = sweep.check(tokens, entry)
        except OutOfResources as e:  # e.g. a whole entry's N 256 gate/up tile, gated
            if entry is None:
                raise
            log(f"    {_short(entry)}: does not fit the device ({e})")
            return math.inf
        if not (math.isfinite(err) and err < TOL[args.dtype]):
            log(f"    {_short(entry) if entry else 'table'}: FAILED check, rel {err:.2e}")
            return math.inf
        us = summarize(measure(lambda: sweep.run(tokens, entry), args.reps, timer))[0]
        log(f"    {_short(entry) if entry else 'table'}: {us:.1f} us (rel {err:.1e})")
        return us

    default_us = timed(None)
    best = (math.inf, None)
    down0 = resolved(base, "down")
    for bm in block_ms:
        for up in ups:
            entry = candidate(base, bm, up, down0)
            best = min(best, (timed(entry), entry), key=lambda r: r[0])
    winner = best[1]
    for down in downs if winner is not None else ():  # none passed: nothing to build on
        entry = candidate(base, winner["BLOCK_M"], winner["gate_up"], down)
        best = min(best, (timed(entry), entry), key=lambda r: r[0])
    if wholes and winner is not None:
        entries = [candidate(base, bm, up, down) for bm, up, down in wholes]
        try:
            sweep.precompile([(tokens, e) for e in entries])
        except OutOfResources:  # one does not fit: each compiles when timed, and is skipped
            pass
        for entry in entries:
            best = min(best, (timed(entry), entry), key=lambda r: r[0])
    # Each stage's candidates come from the best entry so far and compile together.
    stages = (lambda e: [*order_candidates(e, "gate_up", groups),
                         *order_candidates(e, "down", groups), *mask_candidates(e)],
              lambda e: unsorted_candidates(e, tokens, sweep.shape))  # fmt: skip
    for stage in stages if winner is not None else ():
        entries = stage(best[1])
        if entries:
            sweep.precompile([(tokens, e) for e in entries])
        for entry in entries:
            best = min(best, (timed(entry), entry), key=lambda r: r[0])
    us, entry = best
    if not us < default_us:  # nothing beat what the op reads now: keep it
        us, entry = default_us, base
    return dict(tokens=tokens, default_us=default_us, us=us, entry=entry)


def _shape_args(shape) -> tuple[int, int, int]:
    hidden, experts, inter, _, _ = shape
    return experts, hidden, inter


def _short(entry: dict) -> str:
    from vllm.model_executor.layers.fused_moe import fused_moe as fm

    def cut(part):
        t = resolved(entry, part)
        g, mask = t.get("GROUP_SIZE_M", 1), fm.mask_rows(entry, part)
        tile = f"N{t['BLOCK_N']} K{t['BLOCK_K']} w{t['num_warps']} s{t['num_stages']}"
        return f"{tile} g{g}{' mask' if mask else ''}"

    unsorted = entry.get("align", {}).get("max_unsorted_pairs")
    tail = "" if unsorted is None else f" unsorted<={unsorted}"
    return f"M{entry['BLOCK_M']} up[{cut('gate_up')}] down[{cut('down')}]{tail}"


def all_entries(sweep: Sweep, buckets, lists, dtype) -> list[tuple[int, dict]]:
    """Entries whose launches hold every kernel variant the sweep can time, for the
    parallel precompile: a down variant depends on BLOCK_M and the down tile only."""
    out = []
    for t in buckets:
        block_ms, ups, downs = (lst[t] if isinstance(lst, dict) else lst for lst in lists[:3])
        base = sweep.fm.launch_config(t, *_shape_args(sweep.shape), dtype)
        for bm in block_ms:
            out += [(t, candidate(base, bm, u, resolved(base, "down"))) for u in ups]
            out += [(t, candidate(base, bm, ups[0], d)) for d in downs]
    return out


def fm_module():
    from vllm.model_executor.layers.fused_moe import fused_moe as fm

    return fm


def write(path: Path, results: dict, dtype, args, device: str) -> None:
    from benchmarks.common.run_info import git_sha
    from vllm.triton_utils import configs

    old = json.loads(path.read_text()) if path.is_file() else {"entries": {}}
    entries = dict(old["entries"])
    times = {}
    for name, rows in results.items():
        experts, hidden, inter = _shape_args(args.shape_table[name])
        for r in rows:
            key = configs.table_key(E=experts, H=hidden, I=inter, dtype=dtype, tokens=r["tokens"])
            entries[key] = r["entry"]
            times[f"{name}@{r['tokens']}"] = [round(r["default_us"], 1), round(r["us"], 1)]
    meta = dict(
        command="python -m benchmarks.kernels.tune_fused_moe " + " ".join(args.argv),
        commit=git_sha(),
        device=device,
        date_utc=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
        triton=__import__("triton").__version__,
        note="measured: per shape@tokens, [the table it started from, the entry written] "
        f"median cold us of the whole op: {times}",
    )
    configs.write_table(path, entries, meta)
    print(f"wrote {path}: {len(times)} entries")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=None, help=f"of {sorted(SHAPES)}; {DEFAULT_SHAPES}")
    p.add_argument("--tokens", default=",".join(map(str, BUCKETS)))
    p.add_argument("--reps", type=int, default=None, help="timed calls (10; smoke 1)")
    p.add_argument("--out", default=None, help="table path, or a folder (smoke: required)")
    p.add_argument("--json", default=None, help="every timing, as JSON")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, CPU, interpreter, fp32")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    from vllm.model_executor.layers.fused_moe.fused_moe import TOKEN_BUCKETS
    from vllm.triton_utils import configs

    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module imports
        if args.out is None:
            raise ValueError("--smoke needs --out DIR (the table goes to a temporary folder)")
        args.shape_table, args.device, args.dtype = SMOKE_SHAPES, "cpu", torch.float32
        lists, timer = (*SMOKE_LISTS, SMOKE_GROUPS, SMOKE_WHOLE), None
        device = "cpu (smoke)"
        default_tokens = "1,16"
    else:
        if not torch.cuda.is_available():
            sys.exit("tune_fused_moe: needs a CUDA GPU (or --smoke)")
        from benchmarks.kernels.benchmark_utils import ColdTimer

        args.shape_table, args.device, args.dtype = SHAPES, "cuda", torch.bfloat16
        lists, device = (BLOCK_M, GATE_UP, DOWN, GROUPS, WHOLE), torch.cuda.get_device_name()
        timer = ColdTimer()
        default_tokens = ",".join(map(str, BUCKETS))
    names = args.shapes or ",".join(args.shape_table if args.smoke else DEFAULT_SHAPES.split(","))
    names = names.split(",")
    bad = [n for n in names if n not in args.shape_table]
    if bad:
        raise ValueError(f"--shapes: unknown {bad}; known {sorted(args.shape_table)}")
    tokens_arg = default_tokens if args.tokens == p.get_default("tokens") else args.tokens
    buckets = [int(t) for t in tokens_arg.split(",")]
    if not args.smoke and [t for t in buckets if t not in TOKEN_BUCKETS]:
        raise ValueError(f"--tokens: {buckets} must be launch-table buckets {TOKEN_BUCKETS}")
    args.reps = args.reps or (1 if args.smoke else 10)
    results = {}
    for name in names:
        sweep = Sweep(args.shape_table[name], buckets, args.dtype, args.device)
        seconds = sweep.precompile(all_entries(sweep, buckets, lists, args.dtype))
        print(f"{name}: candidates compiled in {seconds:.0f} s", flush=True)
        results[name] = []
        for t in buckets:
            print(f"  {t} tokens:", flush=True)
            results[name].append(tune_case(sweep, t, lists, args, timer, print))
            r = results[name][-1]
            print(f"  -> {_short(r['entry'])}: {r['us']:.1f} us (table: {r['default_us']:.1f})")
    out = Path(args.out) if args.out else fm_module().CONFIG_DIR
    if out.suffix != ".json":
        out = out / f"{configs.device_file_name()}.json"
    write(out, results, args.dtype, args, device)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
