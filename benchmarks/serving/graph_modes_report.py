"""CUDA graph modes side by side: the table of gpu_check.sh's ``graph_modes`` step.

    python -m benchmarks.serving.graph_modes_report OUT/graph_modes [--modes M1 M2 ...]

The step runs serving_sweep.py once per ``cudagraph_mode`` (``FULL_DECODE_ONLY``: only
decode-only steps replay CUDA graphs; ``FULL``: mixed prefill + decode steps too), each
into ``OUT/graph_modes/<mode>/`` with ``sweep.json`` (its records: the server's, with
``startup_s``, and one per run, with ``item``, ``repeat``, ``rc`` and its ``result`` file,
the ``vllm bench serve`` result JSON). Per workload@rate this writes a markdown table, one
row per mode: output tok/s, TTFT median / p99, ITL median / p99, ITL p99 / median, the
steps with prefill and the decode-only steps that replayed a graph / ran eager (the
result's ``server_step_stats``; "absent" from a server that does not split them), the
server's start-up s. Repeats (``-r0``, ``-r1``, ...) are averaged, ``± sd`` over them
shown. Then every other mode against ``FULL_DECODE_ONLY``: TTFT median and output tok/s,
ratios of the means. ``graph_modes.md`` and ``graph_modes.json`` (every value) go beside
the mode folders; the markdown is printed too. What is missing (no sweep.json, a skipped
or failed run, no result file) is listed; the exit status is then 1, as it is when no run
has a result.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

BASELINE = "FULL_DECODE_ONLY"
ORDER = (BASELINE, "FULL", "NONE")
# The result keys averaged as they are.
FIGURES = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")
STEP_KEYS = (
    "num_steps_with_prefill_graph",
    "num_steps_with_prefill_eager",
    "num_steps_decode_only_graph",
    "num_steps_decode_only_eager",
)
RATIO_KEYS = ("median_ttft_ms", "output_throughput")


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def workload_rate(item: str) -> str:
    """``conv1-sharegpt-rate8`` -> ``sharegpt@8``."""
    rest = item.partition("-")[2]
    workload, _, rate = rest.rpartition("-rate")
    return f"{workload}@{rate}"


def read_mode(folder: Path, missing: list[str]) -> tuple[list[float], dict[str, list[dict]]]:
    """The server start-up seconds and, per workload@rate, the results of one mode's sweep;
    what is missing goes to ``missing``."""
    sweep = _load(folder / "sweep.json")
    if sweep is None:
        missing.append(f"{folder.name}: no readable sweep.json (the sweep did not finish)")
        return [], {}
    startups, results = [], {}
    for record in sweep.get("runs", []):
        name = record.get("name", "?")
        if name.startswith("server"):
            if record.get("startup_s") is not None:
                startups.append(float(record["startup_s"]))
            elif record.get("skipped"):
                missing.append(f"{folder.name}: {name} skipped ({record['skipped']})")
            continue
        if "result" not in record or name.startswith("offline"):
            continue
        if record.get("skipped"):
            missing.append(f"{folder.name}: {name} skipped ({record['skipped']})")
            continue
        if record.get("rc") not in (0, None):
            missing.append(f"{folder.name}: {name} failed (rc {record['rc']}, {record.get('log')})")
            continue
        res = _load(folder / record["result"])
        if res is None:
            missing.append(f"{folder.name}: {name}: no readable {record['result']}")
            continue
        results.setdefault(workload_rate(record.get("item", name)), []).append(res)
    return startups, results


def _stats(values: list[float]) -> dict | None:
    if not values:
        return None
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "sd": sd, "values": values}


def mode_figures(results: list[dict], startups: list[float]) -> dict:
    """Mean, sd and values of every figure over the repeats of one mode at one workload@rate;
    None where no run has the figure."""
    fig = {"runs": len(results)}
    for key in FIGURES:
        fig[key] = _stats([float(r[key]) for r in results if r.get(key) is not None])
    fig["itl_p99_over_median"] = _stats(
        [
            r["p99_itl_ms"] / r["median_itl_ms"]
            for r in results
            if r.get("median_itl_ms") and r.get("p99_itl_ms") is not None
        ]
    )
    steps = [r["server_step_stats"] for r in results if "server_step_stats" in r]
    for key in STEP_KEYS:
        fig[key] = _stats([float(s[key]) for s in steps if s.get(key) is not None])
    fig["startup_s"] = _stats(startups)
    return fig


def summary(folder: Path, modes: list[str] | None = None) -> dict:
    """Every figure per workload@rate and mode, the ratios against the baseline and what is
    missing. ``modes`` (default: the subfolders) fixes the order; a listed mode without a
    folder is missing."""
    found = sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
    if modes is None:
        modes = [m for m in ORDER if m in found] + [m for m in found if m not in ORDER]
    missing: list[str] = []
    table: dict[str, dict[str, dict]] = {}
    for mode in modes:
        if mode not in found:
            missing.append(f"{mode}: no folder {folder / mode}")
            continue
        startups, results = read_mode(folder / mode, missing)
        for wr, runs in results.items():
            table.setdefault(wr, {})[mode] = mode_figures(runs, startups)
    ratios: dict[str, dict[str, dict]] = {}
    for wr, per_mode in table.items():
        base = per_mode.get(BASELINE)
        for mode, fig in per_mode.items():
            if mode == BASELINE or base is None:
                continue
            ratios.setdefault(wr, {})[f"{mode}/{BASELINE}"] = {
                key: fig[key]["mean"] / base[key]["mean"]
                if fig[key] and base[key] and base[key]["mean"]
                else None
                for key in RATIO_KEYS
            }
    return {
        "folder": str(folder),
        "modes": modes,
        "workloads": table,
        "ratios": ratios,
        "missing": missing,
    }


def _cell(stats: dict | None, spec: str = ".1f") -> str:
    if stats is None:
        return "-"
    text = format(stats["mean"], spec)
    return text + (f" ± {format(stats['sd'], spec)}" if len(stats["values"]) > 1 else "")


def _count(stats: dict | None) -> str:
    if stats is None:
        return "absent"
    mean = stats["mean"]
    text = f"{mean:.0f}" if float(mean).is_integer() else f"{mean:.1f}"
    return text + (f" ± {stats['sd']:.1f}" if stats["sd"] else "")  # counts: often all alike


HEAD = (
    "| mode | runs | output tok/s | TTFT median / p99 ms | ITL median / p99 ms | "
    "ITL p99 / median | steps with prefill graph / eager | decode-only graph / eager | "
    "server start-up s |"
)


def row(mode: str, f: dict) -> str:
    cells = [
        mode,
        str(f["runs"]),
        _cell(f["output_throughput"]),
        f"{_cell(f['median_ttft_ms'])} / {_cell(f['p99_ttft_ms'])}",
        f"{_cell(f['median_itl_ms'], '.2f')} / {_cell(f['p99_itl_ms'], '.2f')}",
        _cell(f["itl_p99_over_median"], ".2f"),
        *(
            f"{_count(f[f'num_steps_{kind}_graph'])} / {_count(f[f'num_steps_{kind}_eager'])}"
            for kind in ("with_prefill", "decode_only")
        ),
        _cell(f["startup_s"]),
    ]
    return "| " + " | ".join(cells) + " |"


def markdown(s: dict) -> str:
    lines = [f"# CUDA graph modes ({s['folder']})", ""]
    for wr, per_mode in s["workloads"].items():
        lines += [f"## {wr}", "", HEAD, "| --- |" + " ---: |" * 8]
        lines += [row(mode, per_mode[mode]) for mode in s["modes"] if mode in per_mode]
        for pair, r in s["ratios"].get(wr, {}).items():
            cells = [
                f"{name} {r[key]:.3f}" if r[key] is not None else f"{name} -"
                for name, key in (
                    ("TTFT median", "median_ttft_ms"),
                    ("output tok/s", "output_throughput"),
                )
            ]
            lines += ["", f"{pair} (ratio of the means): " + ", ".join(cells)]
        lines.append("")
    if not s["workloads"]:
        lines += ["No run with a result.", ""]
    elif any(
        f["num_steps_with_prefill_graph"] is None
        for per_mode in s["workloads"].values()
        for f in per_mode.values()
    ):
        lines += [
            "absent: the result's server_step_stats has no graph / eager split of the steps "
            "(none at all, or a server without the execution label on /metrics)",
            "",
        ]
    if s["missing"]:
        lines += ["Missing:", ""] + [f"- {m}" for m in s["missing"]] + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--modes", nargs="*", default=None, help="the modes, in order (default: all)")
    args = p.parse_args(argv)
    s = summary(args.folder, args.modes or None)
    text = markdown(s)
    print(text, end="")
    if args.folder.is_dir():
        (args.folder / "graph_modes.md").write_text(text)
        (args.folder / "graph_modes.json").write_text(json.dumps(s, indent=2))
    return 1 if s["missing"] or not s["workloads"] else 0


if __name__ == "__main__":
    sys.exit(main())
