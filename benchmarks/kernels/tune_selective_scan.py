"""Sweep Mamba1's selective-scan launch table on this GPU and write the device's table
(``vllm/model_executor/layers/mamba/ops/configs/selective_scan/<device>.json``).

    python -m benchmarks.kernels.tune_selective_scan --write [--reps 10] [--json F]
    python -m benchmarks.kernels.tune_selective_scan --smoke --write DIR/default.json  # CPU

falcon-mamba-7b's layer (dim 8192, dstate 16, bf16 activations, softplus, D, z, bias;
``benchmark_selective_scan.Case``). Prefill: 1 x 8192 and 16 x 512, every sequence from its
pool line's state, fp32 and bf16 pools. Decode: batches 1, 32, 128, 256, both pools.

Prefill candidates (whole table entries), pruned by the sm_90 compile
(tests/kernels/mamba/selective_scan_compile.py): BLOCK_D x num_warps only at one channel
per thread, (32, 1), (64, 2), (128, 4) (BLOCK_D 64 on 1 warp and 128 on 2 pay shuffles or
barriers per token, 371-381 instructions instead of 208-217); launch 1's knobs plain,
PREFETCH, UNROLL 2 (UNROLL 4 issues 4 of its 44 loads ahead at 242-248 registers), and
plain capped at 128 registers (``maxnreg``: launch 1 compiles to 168, 6 programs of 2 warps
per SM; at 128 it fits 8 with no spill in the sm_90 compile; the cap applies to launch 3
too, which needs 64-128);
launch 3's (``rescan``) plain, PREFETCH, UNROLL 2, PREFETCH + UNROLL 2, UNROLL 4 (PREFETCH +
UNROLL 4 spills); the chunk plan's ``target_programs`` 528, 792, 1056, 2112 (4, 6, 8, 16
programs per SM; launch 1 fits 4-6 by its registers) with min_chunk_len 64, plus 0 (one
chunk per sequence: target 1). 3 x 4 x 5 x 5 = 300 entries. Decode: the update's BLOCK_D
{32, 64, 128, 256} x num_warps {1, 2, 4}, 12, swept apart (the prefill's winner fixed).

Each candidate is run once and checked against the fp32 reference (rel-L2 of y and of the
final states under ``benchmark_selective_scan.TOL``), then timed cold (``ColdTimer``: L2
flushed, a GPU sleep hides the launches), median of ``--reps``. Candidates whose launches
at a case are the same (the rescan's knobs at a one-chunk plan, the target at 16 x 512)
share one measurement. The entry with the least summed time over the four prefill cases
wins; the top 5 are timed again with 3 x reps before the choice.

Time on an H200 (about 4 minutes at most): compiling the variants, 3 layouts x (4 + 5)
chunk-kernel knob sets x 2 pools + the state pass + 12 x 2 update variants, ~70 kernels in
parallel threads, ~45 s; references, ~4 x 2 s; prefill timing, at most 300 x 2 pools x
(1 x 8192: 10 reps x (~3.4 ms call + 0.3 ms flush and sleep) + a checked call, ~45 ms;
16 x 512: ~15 ms) = 36 s, less with the shared plans; re-timing, 5 x 4 x 30 reps x <4 ms
= 2.4 s; decode 12 x 8 x 11 x <0.5 ms = 0.5 s; the device-copy bandwidth, 1 s.

``--write`` writes the winner under ``dim=8192,dstate=16,dtype=bfloat16`` and a
``dtype=bfloat16`` fallback, keeping the file's other keys; the meta has the command,
commit, device, date and the winner's, the runner-up's and default.json's times.
``--smoke``: dim 8, dstate 4, fp16, a handful of candidates on the CPU under
TRITON_INTERPRET=1 (checks real, times the interpreter's wall clock).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks.kernels import benchmark_selective_scan as bench

PREFILL = ((1, 8192), (16, 512))
DECODE = (1, 32, 128, 256)
LAYOUTS = ((32, 1), (64, 2), (128, 4))
FIRST = (dict(PREFETCH=False, UNROLL=1), dict(PREFETCH=True, UNROLL=1),
         dict(PREFETCH=False, UNROLL=2), dict(PREFETCH=False, UNROLL=1, maxnreg=128))  # fmt: skip
RESCAN = (*FIRST[:3], dict(PREFETCH=True, UNROLL=2), dict(PREFETCH=False, UNROLL=4))
TARGETS = (528, 792, 1056, 2112, 0)  # 0: one chunk per sequence
UPDATE = [dict(BLOCK_D=b, num_warps=w) for b in (32, 64, 128, 256) for w in (1, 2, 4)]
SMOKE_PREFILL, SMOKE_DECODE = ((1, 70), (2, 8)), (1, 3)


def candidates(base: dict, smoke: bool) -> list[dict]:
    layouts = LAYOUTS[1:2] if smoke else LAYOUTS
    first = FIRST[::3] if smoke else FIRST  # plain and the register cap
    rescan = RESCAN[1::3] if smoke else RESCAN
    targets = (1056, 0) if smoke else TARGETS
    out = []
    for (bd, nw), f, r, t in itertools.product(layouts, first, rescan, targets):
        e = copy.deepcopy(base)
        e["chunk"] = dict(e["chunk"], BLOCK_D=bd, num_warps=nw, **f)
        e["rescan"] = dict(r)
        e["target_programs"], e["min_chunk_len"] = max(t, 1), 64
        out.append(e)
    return out


@contextlib.contextmanager
def using(entry: dict):
    """The op reads ``entry`` as its table (both the launches and the chunk plan)."""
    from vllm.model_executor.layers.mamba.ops import selective_scan, selective_scan_host

    saved = selective_scan.scan_config, selective_scan_host.scan_config

    def table(*_args):
        return copy.deepcopy(entry)

    selective_scan.scan_config = selective_scan_host.scan_config = table
    try:
        yield
    finally:
        selective_scan.scan_config, selective_scan_host.scan_config = saved


def signature(entry: dict, seqs: int, length: int) -> str:
    """What the launches of a prefill case depend on: candidates equal here share a time."""
    from vllm.model_executor.layers.mamba.ops.selective_scan_host import (
        chunk_options,
        chunk_plan,
    )

    with using(entry):
        chunk, n = chunk_plan(seqs * length, seqs, bench.DIM, bench.DSTATE, bench.ACT)
        parts = [chunk_options(entry, bench.DIM, bench.DSTATE), chunk]
        if n > 1:
            parts += [chunk_options(entry, bench.DIM, bench.DSTATE, True), entry["state_passing"]]
    return json.dumps(parts, sort_keys=True)


def timed(call, check, want, tol, reps, timer) -> dict:
    try:
        y, state = check()
        res = {"y_rel": bench.rel(y, want[0]), "state_rel": bench.rel(state, want[1])}
        res["ok"] = all(v == v and v < tol for v in res.values())
        if res["ok"]:
            res["us"] = statistics.median(bench.measure(call, reps, timer))
    except Exception as exc:  # noqa: BLE001 - a candidate that fails is reported, not fatal
        res = {"ok": False, "error": repr(exc)[:300]}
    return res


def precompile_all(work) -> None:
    """Compile every variant ``work`` launches, in parallel (no-op under the interpreter)."""
    from vllm.triton_utils.launch import precompile

    t0 = time.perf_counter()
    with precompile() as report:
        for entry, call in work:
            with using(entry):
                call()
    print(f"compiled {report.num_new} variants in {time.perf_counter() - t0:.1f} s", flush=True)


def sweep_prefill(cands, cases, reps, timer) -> list[dict]:
    """Per candidate: its checked time per case (shared among equal launch signatures)."""
    rows = [{"entry": e, "cases": {}} for e in cands]
    for name, (case, want) in cases.items():
        tol = bench.TOL[case.state_dtype]
        call, check = bench.prefill_provider("ours", case, None)
        precompile_all((e, call) for e in cands)
        seen: dict[str, dict] = {}
        for row in rows:
            sig = signature(row["entry"], case.seqs, case.length)
            if sig not in seen:
                with using(row["entry"]):
                    seen[sig] = timed(call, check, want, tol, reps, timer)
            row["cases"][name] = seen[sig]
        best = min((r["us"] for r in seen.values() if "us" in r), default=float("nan"))
        print(f"{name}: {len(seen)} distinct launch sets, best {best:.1f} us", flush=True)
    return rows


def total(row: dict) -> float:
    cases = row["cases"].values()
    return sum(c["us"] for c in cases) if all(c.get("ok") for c in cases) else float("inf")


def sweep_update(entry, cases, reps, timer) -> list[dict]:
    rows = []
    for upd in UPDATE:
        e = dict(copy.deepcopy(entry), update=dict(entry["update"], **upd))
        rows.append({"update": e["update"], "cases": {}})
    for name, (case, want) in cases.items():
        call, check = bench.update_call(case)
        precompile_all((dict(entry, update=r["update"]), call) for r in rows)
        for r in rows:
            with using(dict(entry, update=r["update"])):
                r["cases"][name] = timed(call, check, want, bench.TOL[case.state_dtype], reps,
                                         timer)  # fmt: skip
    return rows


def make_cases(smoke: bool, device: str):
    from vllm.model_executor.layers.mamba.ops.selective_scan_ref import (
        selective_state_update_ref,
    )

    prefill, decode = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        sd = str(dtype).removeprefix("torch.")
        for s, n in SMOKE_PREFILL if smoke else PREFILL:
            case = bench.Case(s, n, dtype, device, seed=s * 7 + n)
            prefill[f"{s}x{n}_{sd}"] = (case, case.reference(initial=True))
        for b in SMOKE_DECODE if smoke else DECODE:
            case = bench.Case(b, 1, dtype, device, seed=b)
            pool = case.pool0.to(torch.float32, copy=True)
            rows = (case.u, case.delta, case.A, case.B, case.C)
            y = selective_state_update_ref(
                pool, *rows, **case.params(), state_batch_indices=case.idx
            )
            decode[f"decode{b}_{sd}"] = (case, (y.float(), pool[case.idx.long()]))
    return prefill, decode


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=None, help="timed calls per candidate (10)")
    p.add_argument("--write", nargs="?", const="", default=None, help="write the table [PATH]")
    p.add_argument("--json", default=None, help="every candidate's checks and times")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, CPU, interpreter")
    args = p.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module imports
        bench.DIM, bench.DSTATE, bench.ACT = 8, 4, torch.float16
        device, timer, args.reps = "cpu", None, args.reps or 1
    elif not torch.cuda.is_available():
        sys.exit("tune_selective_scan: needs a CUDA GPU (or --smoke)")
    else:
        from benchmarks.kernels.benchmark_utils import ColdTimer

        device, timer, args.reps = "cuda", ColdTimer(), args.reps or 10
    from vllm.model_executor.layers.mamba.ops.selective_scan_host import scan_config

    base = scan_config(bench.DIM, bench.DSTATE, bench.ACT)  # what the op reads today
    prefill, decode = make_cases(args.smoke, device)
    rows = sweep_prefill(candidates(base, args.smoke), prefill, args.reps, timer)
    rows.sort(key=total)
    if not rows or total(rows[0]) == float("inf"):
        sys.exit("tune_selective_scan: no candidate passed its checks in every case")
    top = rows[:5] + [{"entry": base, "cases": {}, "default": True}]
    top = sweep_prefill([r["entry"] for r in top], prefill, 3 * args.reps, timer)
    top[-1]["default"] = True
    ranked = sorted((r for r in top[:-1] if total(r) < float("inf")), key=total)
    winner = copy.deepcopy(ranked[0]["entry"])
    upd = sweep_update(winner, decode, args.reps, timer)
    upd.sort(key=total)
    winner["update"] = upd[0]["update"]
    summary = {"winner": winner, "prefill": ranked[:2], "default": top[-1],
               "update": upd[:2], "all_prefill": rows}  # fmt: skip
    for label, r in zip(("winner", "runner-up"), ranked[:2], strict=False):
        print(f"{label}: {times(r)} {json.dumps(r['entry'], sort_keys=True)}")
    print(f"default.json: {times(top[-1])}")
    print(f"update: {upd[0]['update']} {times(upd[0])}")
    if args.write is not None:
        write(args, summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1, default=str))
    return summary


def times(row: dict) -> dict:
    return {k: round(v["us"], 1) if "us" in v else "FAIL" for k, v in row["cases"].items()}


def write(args, summary: dict) -> Path:
    from vllm.benchmarks.utils import git_sha
    from vllm.model_executor.layers.mamba.ops.selective_scan_host import CONFIG_DIR
    from vllm.triton_utils import configs

    key = configs.table_key(dim=bench.DIM, dstate=bench.DSTATE, dtype=bench.ACT)
    fallback = configs.table_key(dtype=bench.ACT)
    path = Path(args.write or CONFIG_DIR / f"{configs.device_file_name()}.json")
    old = json.loads(path.read_text()) if path.is_file() else {"entries": {}}
    entry = summary["winner"]
    entries = dict(old["entries"], **{key: entry, fallback: copy.deepcopy(entry)})
    runner = summary["prefill"][1:2]
    meta = dict(
        command="python -m benchmarks.kernels.tune_selective_scan " + " ".join(sys.argv[1:]),
        commit=git_sha(),
        device="cpu (smoke)" if args.smoke else torch.cuda.get_device_name(),
        date_utc=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
        triton=bench.triton_version(),
        keys=f"{key} tuned at its shape; {fallback}: the same entry for other shapes",
        winner_us=times(summary["prefill"][0]),
        runner_up=dict(us=times(runner[0]), entry=runner[0]["entry"]) if runner else None,
        default_json_us=times(summary["default"]),
        update_us=times(summary["update"][0]),
        update_runner_up=dict(us=times(summary["update"][1]), **summary["update"][1]["update"])
        if len(summary["update"]) > 1
        else None,
    )
    configs.write_table(path, entries, meta)
    print(f"wrote {path} [{key}, {fallback}]")
    return path


if __name__ == "__main__":
    main()
