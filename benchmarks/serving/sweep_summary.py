"""sweep.md of a serving_sweep.py run: what its result files say, in four parts.

1. Every serving run, one row each (plot_serving.markdown), and each offline run's line.
2. With repeats: per run item, the mean, sample standard deviation and range of output
   tok/s, median TTFT, median and p99 ITL over its repeats.
3. Engine steps (vllm/benchmarks/step_stats.py): each server run's ``server_step_stats`` beside each
   offline run's ``step_stats``.
4. The server-vs-offline gap of each rate-inf item that has an offline run of the same
   conv backend and workload, split into three factors whose product is offline wall /
   server wall (= server / offline output tok/s, the requests being the same): the step
   count (offline steps / server steps: fewer tokens per step in the server means more
   steps), the step time (offline mean step / server mean step: slower steps) and the time
   outside steps (server share of wall in steps / offline share). Each factor is the ratio
   of the repeats' means; a factor under 1 is a loss of the server.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.serving.plot_serving import markdown
from vllm.benchmarks.step_stats import comparison_table


def _load(out: Path, records: list[dict]) -> tuple[list, list]:
    serving, offline = [], []
    for r in records:
        path = out / r.get("result", "-")
        if r.get("rc") != 0 or not path.is_file():
            continue
        res = json.loads(path.read_text())
        (offline if r["name"].startswith("offline") else serving).append((r, res))
    return serving, offline


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.1f} ± {sd:.1f} ({min(values):.1f}-{max(values):.1f})"


def _items(runs: list) -> dict[str, list[dict]]:
    items: dict[str, list[dict]] = {}
    for r, res in runs:
        items.setdefault(r.get("item", r["name"]), []).append(res)
    return items


def repeats_table(serving: list, offline: list) -> str:
    head = (
        "| run item | runs | output tok/s mean ± sd (range) | TTFT median ms | ITL median ms "
        "| ITL p99 ms |"
    )
    lines = [head, "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for item, results in _items(serving).items():
        cells = [_spread([r["output_throughput"] for r in results])]
        for key in ("median_ttft_ms", "median_itl_ms", "p99_itl_ms"):
            cells.append(_spread([r[key] for r in results if key in r]))
        lines.append(f"| {item} | {len(results)} | " + " | ".join(cells) + " |")
    for item, results in _items(offline).items():
        tok_s = _spread([r["output_tokens_per_s"] for r in results])
        lines.append(f"| {item} | {len(results)} | {tok_s} | - | - | - |")
    return "\n".join(lines) + "\n"


def _mean(results: list[dict], key: str, stats_key: str) -> float:
    return statistics.fmean(r[stats_key][key] for r in results)


def gap_lines(serving: list, offline: list) -> list[str]:
    off_items = {
        item: [r for r in results if "step_stats" in r] for item, results in _items(offline).items()
    }
    lines = []
    for item, results in _items(serving).items():
        tag, _, rest = item.partition("-")
        conv = tag.split("_")[0]  # conv1_proc / conv1_thread: both against offline-conv1
        workload, _, rate = rest.rpartition("-rate")
        off = off_items.get(f"offline-{conv}-{workload}")
        results = [r for r in results if "server_step_stats" in r]
        if rate != "inf" or not off or not results:
            continue
        srv_tok = statistics.fmean(r["output_throughput"] for r in results)
        off_tok = statistics.fmean(r["output_tokens_per_s"] for r in off)
        key_s, key_o = "server_step_stats", "step_stats"
        steps = _mean(off, "num_steps", key_o) / _mean(results, "num_steps", key_s)
        step_t = _mean(off, "mean_step_ms", key_o) / _mean(results, "mean_step_ms", key_s)
        share = _mean(results, "share_of_wall_in_steps", key_s) / _mean(
            off, "share_of_wall_in_steps", key_o
        )
        lines.append(
            f"- {item} vs offline-{conv}-{workload}: server / offline output tok/s = "
            f"{srv_tok:.1f} / {off_tok:.1f} = {100 * srv_tok / off_tok:.1f}%; factors: "
            f"step count {steps:.3f}, step time {step_t:.3f}, time outside steps "
            f"{share:.3f} (product {steps * step_t * share:.3f})"
        )
    return lines


def summarize(out: Path, records: list[dict]) -> str:
    serving, offline = _load(out, records)
    lines = [markdown([res for _, res in serving], "conv_backend")] if serving else []
    for r, res in offline:
        lines.append(
            f"- {r['name']}: {res['output_tokens_per_s']:.1f} output tok/s, "
            f"{res['total_tokens_per_s']:.1f} total tok/s, {res['num_requests']} requests"
        )
    if any(len(v) > 1 for v in [*_items(serving).values(), *_items(offline).values()]):
        lines += ["", "Repeats:", "", repeats_table(serving, offline)]
    rows = [
        (r["name"], res["output_throughput"], res["server_step_stats"])
        for r, res in serving
        if "server_step_stats" in res
    ]
    rows += [
        (r["name"], res["output_tokens_per_s"], res["step_stats"])
        for r, res in offline
        if "step_stats" in res
    ]
    if rows:
        lines += ["", "Engine steps (server runs: the server's /metrics over the run):", ""]
        lines.append(comparison_table(rows))
    gaps = gap_lines(serving, offline)
    if gaps:
        lines += ["Server vs offline (factors: offline / server; under 1 is the server's loss):"]
        lines += ["", *gaps]
    return "\n".join(lines) + "\n"
