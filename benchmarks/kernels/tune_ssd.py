"""Sweep the Triton SSD's launch configurations one kernel at a time, and write the best into
the device's launch table (``vllm/model_executor/layers/mamba/ops/configs/ssd/``).

    python -m benchmarks.kernels.tune_ssd [--cases 1x2048 1x8192 16x512_init]
        [--json F] [--write [PATH]] [--upstream-split] [--kernels chunk_state ...]

For each case (``ssd_bench_cases``: bf16 activations, fp32 pool) each variant changes one
kernel's constexprs (or the workspace's CB dtype) from the configuration ``ssd_configs``
gives. Every variant is compiled first, in parallel (``vllm.triton_utils.launch
.precompile``), then run twice on the same inputs: the two results must agree bit for bit
(the kernels' only atomics, those of ``FUSED_PASS``, order its look-back and change no
value, so a difference is a race, such as a pipelined wgmma whose register operand is
overwritten) and match the fp32 recurrence (rel-L2 of y and of the final
states); only then is it timed cold (a ~2 ms GPU sleep before each call, L2 flushed, median
of ``--reps``). The two runs differ on purpose: the first is a fresh plan's call (the
general launch path) over a workspace filled with NaN bytes, the second the plan's direct
launch over a zeroed workspace, so a kernel that reads workspace it did not write, or a
direct launch that differs from the general one, shows. A profiler pass splits the default
configuration's time (and, with
``--upstream-split``, upstream vLLM 0.33's) by kernel.

``--write`` picks, per kernel, the variant with the least total time over the cases among
the correct ones, times that combination against the default, and writes it (if faster)
under the case shape's key into the device's table (or PATH), keeping the table's other
entries. The table's ``meta`` records the command, commit, device and times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks.kernels.benchmark_ssd import LONG_SLEEP_CYCLES, cold_samples
from benchmarks.kernels.benchmark_utils import ColdTimer
from benchmarks.kernels.ssd_bench_cases import CASES, build_inputs, reference, rel_l2
from vllm.model_executor.layers.mamba.ops import ssd_combined
from vllm.model_executor.layers.mamba.ops.ssd_launch import PLANS
from vllm.triton_utils import configs
from vllm.triton_utils.launch import precompile

HERE = Path(__file__).resolve().parent

# (kernel, changes); "default" first. Variants that lost by 10% or more on the H200 are not
# swept again (the list and the numbers: docs/benchmarks/ssd_h200.md, "Sweep").
VARIANTS = [("default", {})]
VARIANTS += [
    ("chunk_scan", c)
    for c in (
        dict(BLOCK_K=32),
        dict(BLOCK_K=32, maxnreg=128),
        dict(BLOCK_K=32, BLOCK_N=64),
        dict(BLOCK_N=64),
        dict(BLOCK_M=128, BLOCK_K=32, num_warps=8),
        # PREFETCH: the source loop's loads one block ahead in registers, with and without
        # the 128-register cap (measured: docs/benchmarks/ssd_h200.md).
        dict(BLOCK_K=32, PREFETCH=True),
        dict(BLOCK_K=32, PREFETCH=True, maxnreg=None),
        # HEADS 2: a program for two heads of a group, each CB and C block loaded once for
        # both (sm_90 at Codestral: 193 registers uncapped, 168 with a 12-byte stack; 8 warps
        # fit 128 without spills).
        dict(BLOCK_K=32, HEADS=2, maxnreg=None),
        dict(BLOCK_K=32, HEADS=2, maxnreg=168),
        dict(BLOCK_K=32, HEADS=2, num_warps=8, maxnreg=128),
    )
]
VARIANTS += [
    ("chunk_state", c)
    for c in (
        dict(BLOCK_N=64),
        dict(BLOCK_T=64),
        dict(num_stages=3),
        dict(num_stages=1),
        dict(maxnreg=128),
        dict(maxnreg=128, num_stages=3),
        # The tables' RELOAD_CS: off, and with 3 stages.
        dict(RELOAD_CS=False),
        dict(RELOAD_CS=True, num_stages=3),
        # FUSED_PASS: launch 1 chains the states (a decoupled look-back), launch 2 only
        # computes CB. Its epilogue holds the start state beside the accumulator: 198
        # registers at Codestral (2 programs an SM), 168 with a 96-byte stack (3 an SM).
        # Measured: docs/benchmarks/ssd_h200.md (H200 and H100 sections).
        dict(FUSED_PASS=True),
        dict(FUSED_PASS=True, maxnreg=168),
        dict(FUSED_PASS=True, maxnreg=168, num_stages=3),
        dict(FUSED_PASS=True, num_stages=2),
        dict(FUSED_PASS=True, BLOCK_P=32),  # half the epilogue's registers, B read twice
        # FOLD_CB: launch 2's CB in launch 1 too (two launches). 249 registers, 64 KiB
        # shared at Codestral (2 programs an SM); with 32-wide headdim blocks 148 (3).
        dict(FUSED_PASS=True, FOLD_CB=True),
        dict(FUSED_PASS=True, FOLD_CB=True, BLOCK_P=32),
    )
]
VARIANTS += [
    ("state_passing", c)
    for c in (
        dict(BLOCK_N=64),
        dict(BLOCK_SP=32, num_warps=8),
        dict(BLOCK_T=32),
        dict(num_stages=2),  # pipelines the CB loop, but 80 KiB shared per program
    )
]
VARIANTS += [("cb", dict(cb_16bit=True))]
# Precision traded for time: measured for the record, never taken (docs/ssd.md, "Precision").
NEVER_TAKEN = ({"SPLIT_STATE": False}, {"SPLIT": False}, {"cb_16bit": True})


def patched(kernel: str, changes: dict):
    original = ssd_combined.ssd_configs

    def table(*args):
        base = original(*args)
        out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items() if k != "many"}
        if kernel == "cb":
            if changes.get("cb_16bit") and args[6] != torch.float32:
                out["cb_dtype"] = args[5]
        elif kernel in out:
            out[kernel].update(changes)
        elif kernel == "combined":
            for name, c in changes.items():
                if name == "cb":
                    if c.get("cb_16bit") and args[6] != torch.float32:
                        out["cb_dtype"] = args[5]
                else:
                    out[name].update(c)
        # The table's many-chunks chunk state (ssd_configs' "many") stays for the variants
        # of the other kernels, over their changes; a chunk-state variant replaces it.
        many = base["many"]
        state_changed = kernel == "chunk_state" or (
            kernel == "combined" and "chunk_state" in changes
        )
        out["many"] = None
        if many is not None and not state_changed:
            out["many"] = {**out, "chunk_state": many["chunk_state"],
                           "many_chunks": many["many_chunks"]}  # fmt: skip
        return out

    return original, table


class poisoned_workspace:
    """Fill every byte workspace the SSD allocates in the block with ``byte``."""

    def __init__(self, byte: int):
        self.byte = byte

    def __enter__(self):
        from vllm.model_executor.layers.mamba.ops import ssd_launch

        self.module, self.empty = ssd_launch.torch, ssd_launch.torch.empty
        empty, byte = self.empty, self.byte

        def filled(*args, **kwargs):
            t = empty(*args, **kwargs)
            if t.dtype == torch.uint8:
                t.fill_(byte)
            return t

        self.module.empty = filled

    def __exit__(self, *exc):
        self.module.empty = self.empty


def run_variant(kernel, changes, call):
    original, table = patched(kernel, changes)
    ssd_combined.ssd_configs = table
    PLANS.clear()  # plans keep the configuration they were made with
    try:
        return call()
    finally:
        ssd_combined.ssd_configs = original
        PLANS.clear()


def kernel_split(call, reps: int = 5) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA":
            out[e.key[:60]] = round(e.device_time_total / reps, 1)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def upstream_call(case, inp):
    """Upstream vLLM 0.33's op on the case (ssd_bench_providers), or None without it."""
    from benchmarks.kernels.ssd_bench_providers import (
        compile_autotune_configs_in_parallel,
        load_ops,
        make_provider,
    )

    compile_autotune_configs_in_parallel()
    ops = load_ops(["upstream"])
    made = make_provider("upstream", case, inp, ops)
    return None if isinstance(made, str) else made[0]


def measure(name, timer, reps, variants, upstream_split) -> dict:
    case = CASES[name]
    inp = build_inputs(case, torch.bfloat16, torch.float32, "cuda", seed=0)
    ref_y, ref_s = reference(case, inp)
    layout = ssd_combined.plan_ssd_chunks(inp.qsl_cpu, case.shape.chunk).to("cuda")
    out = torch.empty_like(inp.x)
    kw = dict(D=inp.D, dt_bias=inp.dt_bias, dt_softplus=True, out=out)

    def call(pool):
        return ssd_combined.mamba_chunk_scan_combined_varlen(
            inp.x, inp.dt, inp.A, inp.B, inp.C, layout, pool, inp.idx, inp.init, **kw
        )

    pool = inp.pool.clone()
    with precompile() as report:
        for kernel, changes in variants:
            run_variant(kernel, changes, lambda: call(pool))
    print(f"\n{name}: compiled {report.num_new} variants in {report.seconds:.1f} s", flush=True)
    split = run_variant("default", {}, lambda: kernel_split(lambda: call(pool)))
    print("  default by kernel: " + ", ".join(f"{k} {v} us" for k, v in split.items()))
    result = dict(split=split, rows=[])
    if upstream_split:
        run = upstream_call(case, inp)
        if run is not None:
            up_pool = inp.pool.clone()
            result["upstream_split"] = kernel_split(lambda: run(up_pool))
            print("  upstream by kernel: " + ", ".join(
                f"{k} {v} us" for k, v in result["upstream_split"].items()))  # fmt: skip
    for kernel, changes in variants:
        row = dict(kernel=kernel, changes=changes)
        try:

            def two_runs():
                runs = []
                for byte in (255, 0):  # a fresh plan (general path), then its direct launch
                    p = inp.pool.clone()
                    with poisoned_workspace(byte):
                        y = call(p).clone()
                    runs.append((y, p))
                return runs

            (y0, p0), (y1, p1) = run_variant(kernel, changes, two_runs)
            row["deterministic"] = bool(torch.equal(y0, y1) and torch.equal(p0, p1))
            row["nan"] = bool(torch.isnan(y0).any())
            row["y"] = rel_l2(y0, ref_y)
            row["s"] = rel_l2(p0.index_select(0, inp.idx.long()), ref_s)
            timed = inp.pool.clone()

            def timing(timed=timed):
                return cold_samples(timer, lambda: call(timed), reps, LONG_SLEEP_CYCLES)

            samples = run_variant(kernel, changes, timing)
            row["us"] = statistics.median(samples)
        except Exception as e:  # a variant that fails is reported, not fatal
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        row["ok"] = (
            "error" not in row
            and row["deterministic"]
            and not row["nan"]
            and row["y"] < 5e-3
            and row["s"] < 5e-3
        )
        result["rows"].append(row)
    base = result["rows"][0].get("us", float("nan"))
    for r in sorted(result["rows"], key=lambda r: r.get("us", 1e18)):
        if "error" in r:
            print(f"  FAILED {r['kernel']} {r['changes']}: {r['error']}")
            continue
        flag = "ok " if r["ok"] else ("RACE" if not r["deterministic"] else "BAD")
        print(f"  {r['us']:8.1f} us {base / r['us']:5.2f}x {flag} y {r['y']:.1e} "
              f"s {r['s']:.1e}  {r['kernel']} {r['changes']}")  # fmt: skip
    return result


def best_per_kernel(results: dict) -> dict:
    """Per kernel, the variant (or none) with the least total time over the cases, among
    those correct in every case and not trading precision."""
    totals: dict = {}
    for res in results.values():
        for r in res["rows"]:
            key = (r["kernel"], json.dumps(r["changes"], sort_keys=True))
            if not r["ok"] or r["changes"] in NEVER_TAKEN:
                totals[key] = float("inf")
            elif totals.get(key, 0.0) != float("inf"):
                totals[key] = totals.get(key, 0.0) + r["us"]
    default = totals.get(("default", "{}"), float("inf"))
    best: dict = {}
    for (kernel, changes), total in totals.items():
        if kernel == "default" or total >= default:
            continue
        if kernel not in best or total < best[kernel][1]:
            best[kernel] = (json.loads(changes), total)
    return {k: v[0] for k, v in best.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="+", default=["1x2048", "1x8192", "16x512_init"])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--json", default=None)
    p.add_argument("--write", nargs="?", const="", default=None, help="write the table")
    p.add_argument("--upstream-split", action="store_true")
    p.add_argument("--kernels", nargs="+", default=None,
                   help="sweep only these kernels' variants (chunk_state, state_passing, "
                        "chunk_scan, cb); the default configuration is always timed")  # fmt: skip
    p.add_argument("--with-key", default=None,
                   help="sweep only the variants setting this table key (e.g. HEADS)")  # fmt: skip
    args = p.parse_args(argv)
    variants = VARIANTS
    if args.kernels:
        unknown = set(args.kernels) - {k for k, _ in VARIANTS[1:]}
        if unknown:
            p.error(f"--kernels: no variants of {sorted(unknown)}")
        variants = [v for v in VARIANTS if v[0] == "default" or v[0] in args.kernels]
    if args.with_key:
        variants = [v for v in variants if v[0] == "default" or args.with_key in v[1]]
        if len(variants) == 1:
            p.error(f"--with-key: no variant sets {args.with_key}")
    timer = ColdTimer()
    results = {n: measure(n, timer, args.reps, variants, args.upstream_split) for n in args.cases}
    summary = dict(results=results)
    best = best_per_kernel(results)
    print(f"\nbest per kernel: {best}")
    if best:
        combined = [("default", {}), ("combined", best)]
        summary["combined"] = {n: measure(n, timer, args.reps, combined, False)["rows"]
                               for n in args.cases}  # fmt: skip
    if args.write is not None:
        write(args, best, summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1, default=str))


def write(args, best: dict, summary: dict) -> None:
    from benchmarks.common.run_info import git_sha

    shapes = {CASES[n].shape for n in args.cases}
    if len(shapes) != 1:
        raise SystemExit("--write needs cases of one model shape")
    (shape,) = shapes
    rows = summary.get("combined", {})
    ok = rows and all(r[1]["ok"] and r[1]["us"] < r[0]["us"] for r in rows.values())
    key = ssd_combined.ssd_config_key(shape.nheads, shape.headdim, shape.dstate, shape.ngroups,
                                      shape.chunk, torch.bfloat16, torch.bfloat16)  # fmt: skip
    # What the sweep started from: the entry ssd_configs read (this shape's, else general).
    dtype_key = configs.table_key(dtype=torch.bfloat16)
    entry = configs.lookup_first(ssd_combined.CONFIG_FOLDER, [key, dtype_key])
    if ok:
        for kernel, changes in best.items():
            if kernel == "cb":
                entry["cb_16bit"] = bool(changes.get("cb_16bit"))
            else:
                entry[kernel].update(changes)
    path = Path(args.write or ssd_combined.CONFIG_FOLDER / f"{configs.device_file_name()}.json")
    old = json.loads(path.read_text()) if path.is_file() else {"entries": {}}
    entries = dict(old["entries"], **{key: entry})
    times = {n: [round(r[0]["us"], 1), round(r[1]["us"], 1)] for n, r in rows.items()}
    meta = dict(
        command="python -m benchmarks.kernels.tune_ssd " + " ".join(sys.argv[1:]),
        commit=git_sha(),
        device=torch.cuda.get_device_name(),
        date_utc=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
        triton=__import__("triton").__version__,
        note=f"{key}: default vs this entry, cold us per case: {times}"
        + ("" if ok else " (the combination did not beat the default: default kept)"),
    )
    configs.write_table(path, entries, meta)
    print(f"wrote {path} [{key}]: {entry}")


if __name__ == "__main__":
    main()
