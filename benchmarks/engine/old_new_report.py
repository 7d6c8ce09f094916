"""Old tree against new, side by side: the table of gpu_check.sh's ``old_new`` step.

    python -m benchmarks.engine.old_new_report OUT/old_new [--md table.md]

Reads what the step wrote under its folder: ``<tree>-throughput-r<i>.json``
(benchmark_throughput.py, one fresh process each, the trees interleaved) and
``<tree>-sweep/sweep.json`` (serving_sweep.py: one `vllm serve` per tree, its runs'
result files beside it), for the trees ``old`` and ``new``. Prints, per figure, each
tree's runs, their mean and new / old of the means: offline output and prefill tok/s and
start-up s, the server's output tok/s and its start-up (script start to /health) s.
A tree with no usable run gives a row saying so, never a ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

TREES = ("old", "new")


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def throughput_figures(folder: Path, tree: str) -> dict[str, list[float]]:
    """Per figure, the values of the tree's offline runs, in run order."""
    figures: dict[str, list[float]] = {"output tok/s": [], "prefill tok/s": [], "start-up s": []}
    for path in sorted(folder.glob(f"{tree}-throughput-r*.json")):
        res = _load(path)
        if res is None:
            continue
        for name, key in (
            ("output tok/s", "output_tokens_per_s"),
            ("prefill tok/s", "prefill_tokens_per_s"),
            ("start-up s", "startup_s"),
        ):
            if res.get(key) is not None:
                figures[name].append(float(res[key]))
    return figures


def serving_figures(folder: Path, tree: str) -> dict[str, list[float]]:
    """The server's output tok/s per run and its start-up s, from the tree's sweep."""
    sweep_dir = folder / f"{tree}-sweep"
    figures: dict[str, list[float]] = {"server output tok/s": [], "server start-up s": []}
    sweep = _load(sweep_dir / "sweep.json")
    if sweep is None:
        return figures
    for record in sweep.get("runs", []):
        if record.get("startup_s") is not None:
            figures["server start-up s"].append(float(record["startup_s"]))
        elif "result" in record and not record.get("skipped"):
            res = _load(sweep_dir / record["result"])
            if res is not None and res.get("output_throughput") is not None:
                figures["server output tok/s"].append(float(res["output_throughput"]))
    return figures


def rows(folder: Path) -> list[list[str]]:
    per_tree = {t: {**throughput_figures(folder, t), **serving_figures(folder, t)} for t in TREES}
    table = []
    for name in per_tree["old"]:
        old, new = per_tree["old"][name], per_tree["new"][name]
        cells = [name]
        for values in (old, new):
            runs = ", ".join(f"{v:,.1f}" for v in values) or "no run"
            cells.append(f"{statistics.fmean(values):,.1f} ({runs})" if values else runs)
        if old and new:
            cells.append(f"{statistics.fmean(new) / statistics.fmean(old):.3f}")
        else:
            cells.append("-")
        table.append(cells)
    return table


def markdown(folder: Path) -> str:
    lines = ["| figure | old: mean (runs) | new: mean (runs) | new / old |", "|---|---|---|---:|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows(folder)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--md", type=Path, default=None, help="also write the table here")
    args = p.parse_args(argv)
    text = markdown(args.folder)
    print(text, end="")
    if args.md is not None:
        args.md.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
