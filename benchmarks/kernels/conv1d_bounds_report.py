"""conv1d_bounds.py's measurements, what each isolates, and its markdown.

- ``ROWS``: every measurement a case may have (``op`` first), with what it isolates;
  ``LOWER_BOUNDS``: those that are floors the op cannot beat.
- ``kernel_info``: a compiled kernel's registers, spills, shared memory and an estimate of
  its resident programs per SM and waves.
- ``primary``: a measurement's time under the case's timer; ``markdown``: the tables.
"""

from __future__ import annotations

LOWER_BOUNDS = ("bandwidth", "torch_copy", "grid_copy", "empty", "chain_index_state")
ROWS = {  # measurement: what it isolates
    "op": "the op, as benchmark_causal_conv1d.py times it",
    "bandwidth": "bytes / device copy GB/s: pure bandwidth",
    "torch_copy": "torch copy of the same bytes: copy at this size (ramp-up, tail)",
    "grid_copy": "op's grid and tile, loads + stores only: access pattern of this grid",
    "no_metadata": "op's arithmetic, bounds/lines from constants: without the load chain",
    "op_direct": "op's kernel launched directly (control)",
    "chain_index": "index load -> store: one dependent latency",
    "chain_index_state": "index -> state row -> store: two dependent latencies",
    "empty": "empty kernel, same grid: launch and scheduling",
}


def kernel_info(compiled, num_warps: int, sms: int, programs: int) -> dict | None:
    """Registers, spills and shared memory of a compiled kernel; resident programs per SM
    (est.: 64K registers in 256-register units per warp, 64 warps, 32 blocks, 228 KB)."""
    if compiled is None or not hasattr(compiled, "n_regs"):
        return None
    regs, shared = compiled.n_regs, compiled.metadata.shared
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = 65536 // per_warp // num_warps
    by_smem = 233472 // (shared + 1024) if shared else 32
    resident = max(min(32, 64 // num_warps, by_regs, by_smem), 1)
    return {"n_regs": regs, "n_spills": compiled.n_spills, "shared": shared,
            "resident_per_sm_est": resident, "waves_est": programs / (sms * resident)}  # fmt: skip


def primary(res, key):
    """A measurement's time under the case's timer (cold; graph for decode), in us."""
    if key == "bandwidth":
        return res["bandwidth_floor_us"]
    t = res["times"].get(key, {}).get(res["timer"])
    return None if t is None else t["median"]


def _t(stats) -> str:
    if stats is None:
        return ""
    d = 2 if stats["median"] < 100 else 1
    return f"{stats['median']:.{d}f} [{stats['p20']:.{d}f}, {stats['p80']:.{d}f}]"


def markdown(env, cases) -> str:
    out = ["# Causal-conv1d small steps: op time against floors", "",
           f"- {env['gpu']}; torch {env['torch']}; triton {env['triton']}; git {env['git_sha']}"
           f"; {env['date_utc']} UTC", f"- command: `{env['command']}`",
           f"- device copy (4 GiB, cold median): {env['copy_gbps']} GB/s",
           "- us: median [p20, p80]; cold = L2 flushed, host hidden; graph = per call in a "
           "CUDA graph of 20. The case's timer (cold; graph for decode) gives `op - this`.",
           ""]  # fmt: skip
    for name, r in cases.items():
        k = r["kernels"]["op"] or {}
        cfg = ", ".join(f"{a}={b}" for a, b in r["config"].items())
        occ = (f"; op kernel ~{k['resident_per_sm_est']} programs/SM resident, "
               f"{k['waves_est']:.2f} waves" if k else "")  # fmt: skip
        regs = "; ".join(f"{n} {i['n_regs']}/{i['n_spills']}" for n, i in r["kernels"].items()
                         if i)  # fmt: skip
        out += [f"## {name} (dim {r['dim']}, {r['dtype']}, target {r['target_us']} us)", "",
                f"- grid {r['grid']}: {r['programs']} programs on {r['sms']} SMs "
                f"({r['programs_per_sm']:.1f} per SM), {cfg}{occ}",
                f"- bytes the op must move: {r['bytes'] / 1e6:.2f} MB",
                f"- registers/local (spill) bytes per thread: {regs or 'n/a'}; variants' "
                f"launch options {r['variant_options']}",
                "- checks: " + (", ".join(k + (" ok" if v else " FAILED (not timed)")
                                          for k, v in r["checks"].items())), "",
                "| measurement | cold us | graph us | op - this (us) | isolates |",
                "|---|---|---|---|---|"]  # fmt: skip
        for key, what in ROWS.items():
            if key == "bandwidth":
                cold = graph = "" if r["bandwidth_floor_us"] is None else (
                    f"{r['bandwidth_floor_us']:.2f}")  # fmt: skip
            elif key in r["times"]:
                cold, graph = _t(r["times"][key]["cold"]), _t(r["times"][key]["graph"])
            else:
                continue
            ex = r["excess_us"].get(key)
            mark = " (tightest)" if key == r["tightest_floor"] else ""
            out.append(f"| {key}{mark} | {cold} | {graph} | "
                       f"{'' if ex is None else f'{ex:.2f}'} | {what} |")  # fmt: skip
        if r["tightest_floor"]:
            t = r["tightest_floor"]
            out.append(
                f"\nTightest lower bound: {t}, {primary(r, t):.2f} us; op "
                f"{primary(r, 'op'):.2f} us, {r['excess_us'][t]:.2f} us above it."
            )
        out.append("")
    return "\n".join(out)
