"""Plot `vllm bench serve` results: TTFT and TPOT against request rate, one line per backend.

    python -m benchmarks.serving.plot_serving results/*.json --out serving.png --md serving.md

One column per workload (dataset and output length), rows TTFT and TPOT: the median as a
solid line, p99 (when the results have it) dashed in the same colour. Rate ``inf`` (every
request at once) is drawn at twice the highest finite rate of its workload and labelled
inf. The line label is the result's ``--label-key`` (default ``conv_backend``, which
``serving_sweep.py`` puts in each result's metadata), else its ``backend``. ``--md`` also
writes every result as one markdown table row.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

PANELS = (("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"))


def load(paths: list[str]) -> list[dict]:
    files = []
    for p in map(Path, paths):
        files += sorted(p.glob("*.json")) if p.is_dir() else [p]
    results = []
    for f in files:
        record = json.loads(f.read_text())
        if "request_throughput" in record:  # a serving result, not some other JSON
            record["_file"] = f.name
            results.append(record)
    if not results:
        raise SystemExit(f"no `vllm bench serve` results in {paths}")
    return results


def workload(r: dict) -> str:
    if r.get("dataset_name") == "random":
        return f"random {r.get('random_input_len')} in / {r.get('random_output_len')} out"
    fixed = r.get("sharegpt_output_len")
    return f"ShareGPT, {fixed} output tokens" if fixed else "ShareGPT, its output lengths"


def rate(r: dict) -> float:
    return float("inf") if r["request_rate"] == "inf" else float(r["request_rate"])


def label(r: dict, key: str) -> str:
    return str(r.get(key) or r.get("backend"))


def plot(results: list[dict], out: str, key: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_workload: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        by_workload[workload(r)].append(r)
    names = sorted(by_workload)
    fig, axes = plt.subplots(len(PANELS), len(names), figsize=(4.5 * len(names), 7), squeeze=False)
    labels = sorted({label(r, key) for r in results})
    colours = {name: f"C{i}" for i, name in enumerate(labels)}
    for col, name in enumerate(names):
        group = by_workload[name]
        finite = [rate(r) for r in group if rate(r) != float("inf")]
        inf_x = 2 * max(finite) if finite else 1.0
        ticks = sorted(set(finite)) + ([inf_x] if len(finite) < len(group) else [])
        for row, (metric, title) in enumerate(PANELS):
            ax = axes[row][col]
            for name_l in labels:
                runs = sorted(
                    (r for r in group if label(r, key) == name_l),
                    key=lambda r: (rate(r) == float("inf"), rate(r)),
                )
                if not runs:
                    continue
                xs = [inf_x if rate(r) == float("inf") else rate(r) for r in runs]
                ax.plot(
                    xs,
                    [r[f"median_{metric}_ms"] for r in runs],
                    "o-",
                    color=colours[name_l],
                    label=f"{name_l} median",
                )
                if all(f"p99_{metric}_ms" in r for r in runs):
                    ax.plot(
                        xs,
                        [r[f"p99_{metric}_ms"] for r in runs],
                        "s--",
                        color=colours[name_l],
                        alpha=0.6,
                        label=f"{name_l} p99",
                    )
            ax.set_xticks(ticks)
            ax.set_xticklabels(["inf" if x == inf_x else f"{x:g}" for x in ticks])
            ax.set_ylim(bottom=0)
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(title)
            ax.set_title(name, fontsize=10)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def markdown(results: list[dict], key: str) -> str:
    head = (
        "| workload | backend | rate | prompts | done | failed | req/s | output tok/s | "
        "total tok/s | TTFT median / p99 ms | TPOT median / p99 ms | ITL median / p99 ms |"
    )
    rows = [head, "|" + " --- |" * 3 + " ---: |" * 9]

    def pair(r, m):
        med, p99 = r.get(f"median_{m}_ms"), r.get(f"p99_{m}_ms")
        if med is None:
            return "-"
        return f"{med:.1f} / {p99:.1f}" if p99 is not None else f"{med:.1f}"

    order = sorted(results, key=lambda r: (workload(r), label(r, key), rate(r)))
    for r in order:
        rows.append(
            f"| {workload(r)} | {label(r, key)} | {r['request_rate']} | {r['num_prompts']} | "
            f"{r['completed']} | {r['failed']} | {r['request_throughput']:.2f} | "
            f"{r['output_throughput']:.1f} | {r['total_token_throughput']:.1f} | "
            f"{pair(r, 'ttft')} | {pair(r, 'tpot')} | {pair(r, 'itl')} |"
        )
    return "\n".join(rows) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", help="result JSON files or folders of them")
    p.add_argument("--out", default="serving.png")
    p.add_argument("--md", default=None, help="also write a markdown table here")
    p.add_argument("--label-key", default="conv_backend")
    args = p.parse_args(argv)
    results = load(args.results)
    plot(results, args.out, args.label_key)
    print(f"plotted {len(results)} results to {args.out}")
    if args.md:
        Path(args.md).write_text(markdown(results, args.label_key))
        print(f"table written to {args.md}")


if __name__ == "__main__":
    main()
