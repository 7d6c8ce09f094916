"""Run `vllm bench serve` over workloads and request rates against one `vllm serve` per conv
backend, one command per device call:

    python -m benchmarks.serving.serving_sweep --model MODEL_DIR --dataset-path sharegpt.json \
        --out OUT --conv-backends 1,0 --runs sharegpt@inf:500,256@inf:500,1024@inf:500 \
        --offline sharegpt:500 --budget-s 520
    python -m benchmarks.serving.serving_sweep --model MODEL_DIR --dataset-path sharegpt.json \
        --out OUT --runs sharegpt@inf:300 --repeats 3 --offline sharegpt:300 \
        --offline-repeats 2   # the server-vs-offline gap, with its spread

For each ``VLLM_USE_TRITON_CONV1D`` value in ``--conv-backends`` (1: the Triton conv, 0:
the CUDA split) it starts ``vllm serve MODEL_DIR`` with ``--server-args`` (on its own
empty Triton cache, as a first start meets it), waits for
/health, runs every ``--runs`` item ``WORKLOAD@RATE:PROMPTS`` (WORKLOAD ``sharegpt`` for the
ShareGPT output lengths or a number of output tokens, always with ``--ignore-eos``) with
``vllm bench serve``, and stops the server with SIGTERM. Each run writes
``OUT/conv<b>-<workload>-rate<rate>.json`` with the metadata ``conv_backend`` (triton or
cuda) that plot_serving.py labels lines by. ``--repeats N`` (N > 1) runs the whole list N
times in turn against the same server, the files suffixed ``-r0`` ... ``-r<N-1>`` (and
``repeat`` in their metadata). Then each ``--offline WORKLOAD:PROMPTS`` runs
benchmark_throughput.py (``--offline-repeats`` times, suffixed the same way) on the same
requests (the same ShareGPT file and seed; ``--max-output-len 2048`` so ShareGPT's long
replies are not cut, greedy as the server is) with the server's engine sizes, for the
server-overhead comparison. The server, the client and the offline runs all use this
source tree's vllm (``PYTHONPATH``). A run that would start after ``--budget-s`` is
skipped and recorded as such. ``OUT/sweep.json`` lists every run and ``OUT/sweep.md``
tabulates them (sweep_summary.py: every run, the repeats' mean and spread, and the engine
step stats of the server runs beside the offline ones).

``--interleave`` (with ``--repeats N``) starts a fresh server for each repeat instead,
the backends in the given order on even repeats and reversed on odd ones (ABBA...): one
backend then never runs all its repeats before the other, nor on an older server, which a
comparison at finite rates (one run per point moves by more than the backends differ)
needs. Server logs are then ``server-<tag>-r<i>.log``.

``--engine-process 1,0`` starts each backend's server twice, with the engine core in a
process of its own (``VLLM_ENABLE_V1_MULTIPROCESSING=1``, the default) and on a thread of
the server's process (``=0``), so the two compare in one sweep; the server tags are then
``conv<b>_proc`` and ``conv<b>_thread`` (the offline runs stay ``offline-conv<b>``) and
the label ``<backend>/<mode>``. One value keeps the tags ``conv<b>``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks.common import launch
from benchmarks.common.launch import module_argv

CLI = ["-m", "vllm.entrypoints.cli.main"]
BACKEND_NAMES = {"1": "triton", "0": "cuda"}
ENGINE_MODES = {"1": "proc", "0": "thread"}
PERCENTILES = "50,90,99"


def parse_runs(spec: str) -> list[tuple[str, str, int]]:
    runs = []
    for item in filter(None, spec.split(",")):
        try:
            workload, rest = item.split("@")
            rate, prompts = rest.split(":")
            float(rate)
            runs.append((check_workload(workload), rate, int(prompts)))
        except ValueError:
            raise SystemExit(f"--runs item {item!r}: want WORKLOAD@RATE:PROMPTS") from None
    return runs


def check_workload(workload: str) -> str:
    if workload != "sharegpt" and not workload.isdigit():
        raise ValueError(workload)
    return workload


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, env: dict, port: int, log: Path) -> tuple[subprocess.Popen, float]:
    cmd = [sys.executable, *CLI, "serve", args.model, *shlex.split(args.server_args)]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    print("sweep:", " ".join(cmd), flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} at start-up ({log})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, time.monotonic() - t0
        except OSError:
            pass
        if time.monotonic() - t0 > args.startup_timeout_s:
            proc.kill()
            raise SystemExit(f"no /health in {args.startup_timeout_s} s ({log})")
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def bench_command(
    args, port: int, conv: str, workload: str, rate: str, n: int, out: Path, repeat=None, mode=None
):
    """``vllm bench serve`` (the CLI, so that its record names the CLI's command); ``mode``
    (proc or thread) labels a sweep over both engine modes."""
    name = BACKEND_NAMES.get(conv, conv) + (f"/{mode}" if mode else "")
    cmd = [sys.executable, *CLI, "bench", "serve", "--model", args.model]
    cmd += ["--port", str(port), "--dataset-name", "sharegpt", "--ignore-eos"]
    if args.dataset_path:
        cmd += ["--dataset-path", args.dataset_path]
    if workload != "sharegpt":
        cmd += ["--sharegpt-output-len", workload]
    cmd += ["--num-prompts", str(n), "--request-rate", rate, "--seed", str(args.seed)]
    cmd += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", PERCENTILES]
    cmd += ["--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    cmd += ["--disable-tqdm", "--metadata", f"conv_backend={name}"]
    cmd += [f"VLLM_USE_TRITON_CONV1D={conv}", f"workload={workload}"]
    cmd += [f"repeat={repeat}"] if repeat is not None else []
    cmd += [f"engine_process={mode}"] if mode else []
    return cmd + shlex.split(args.bench_args)


def offline_command(args, workload: str, n: int, out: Path) -> list[str]:
    server = argparse.ArgumentParser(add_help=False)
    engine_sizes = ("--max-num-seqs", "--max-num-batched-tokens", "--long-prefill-token-threshold")
    for opt in ("--load-format", "--dtype", "--replayssm-buffer-len", *engine_sizes):
        server.add_argument(opt)
    server.add_argument("--use-replayssm", action=argparse.BooleanOptionalAction)
    known, _ = server.parse_known_args(shlex.split(args.server_args))
    cmd = module_argv("benchmarks.engine.benchmark_throughput", "--model", args.model)
    for opt, value in vars(known).items():
        if isinstance(value, bool):
            cmd += [f"--{'' if value else 'no-'}{opt.replace('_', '-')}"]
        elif value is not None:
            cmd += [f"--{opt.replace('_', '-')}", value]
    if args.dataset_path:
        cmd += ["--dataset", args.dataset_path]
    if workload != "sharegpt":
        cmd += ["--output-len", workload]
    cmd += ["--num-prompts", str(n), "--max-output-len", "2048", "--temperature", "0"]
    return cmd + ["--seed", str(args.seed), "--no-first-token", "--out", str(out)]


def tree_env(conv: str) -> dict:
    """The environment of every process of the sweep: this tree's vllm, the conv backend."""
    return launch.tree_env(VLLM_USE_TRITON_CONV1D=conv)


def suffixes(n: int) -> list[str]:
    return [f"-r{i}" for i in range(n)] if n > 1 else [""]


def server_sessions(servers: list, repeats: int, interleave: bool) -> list[tuple[object, list]]:
    """(server, the repeats it runs) in start order. Plain: one server each, every repeat.
    Interleaved: a fresh server per repeat, in the given order on even repeats and reversed
    on odd ones (A B, B A, A B, ...), so that drift over the sweep and the servers' age
    fall on every backend alike."""
    if not interleave:
        return [(server, list(range(repeats))) for server in servers]
    return [
        (server, [i])
        for i in range(repeats)
        for server in (servers if i % 2 == 0 else servers[::-1])
    ]


def run_one(cmd: list[str], env: dict, log: Path, record: dict) -> None:
    t0 = time.monotonic()
    with log.open("w") as f:
        rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    record.update(rc=rc, wall_s=round(time.monotonic() - t0, 1), log=log.name)
    tail = log.read_text(errors="replace").splitlines()[-3:]
    print(f"sweep: {record['name']}: rc {rc}, {record['wall_s']} s: {' | '.join(tail)}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dataset-path", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--conv-backends", default="1,0")
    p.add_argument(
        "--engine-process",
        default="1",
        help="VLLM_ENABLE_V1_MULTIPROCESSING values to run each backend's server with (1,0)",
    )
    p.add_argument("--runs", default="sharegpt@inf:500")
    p.add_argument("--repeats", type=int, default=1, help="run the --runs list N times")
    p.add_argument(
        "--interleave",
        action="store_true",
        help="a fresh server per repeat, the backends' order reversed every other repeat",
    )
    p.add_argument("--offline", default="", help="WORKLOAD:PROMPTS,... after the servers")
    p.add_argument("--offline-repeats", type=int, default=1)
    p.add_argument(
        "--server-args",
        default="--load-format dummy --dtype bfloat16 --max-num-seqs 256 "
        "--max-num-batched-tokens 4096",
    )
    p.add_argument("--bench-args", default="", help="more `vllm bench serve` options")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=float("inf"))
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    args = p.parse_args(argv)
    if args.repeats < 1 or args.offline_repeats < 1:
        p.error("--repeats and --offline-repeats must be >= 1")
    runs = parse_runs(args.runs)
    modes = args.engine_process.split(",")
    if not modes or any(m not in ENGINE_MODES for m in modes):
        p.error(f"--engine-process: a list of 1 and 0, got {args.engine_process!r}")
    servers = [(conv, m) for conv in args.conv_backends.split(",") for m in modes]
    offline = [
        (check_workload(w), int(n)) for w, n in (x.split(":") for x in args.offline.split(",") if x)
    ]
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t_start, records = time.monotonic(), []

    def over_budget(record: dict) -> bool:
        if time.monotonic() - t_start <= args.budget_s:
            return False
        record["skipped"] = f"over the {args.budget_s} s budget"
        print(f"sweep: {record['name']}: skipped ({record['skipped']})")
        return True

    def new_run(item: str, i: int, suffix: str, n: int) -> dict | None:
        """Record repeat ``i`` of ``item``; the record to run, None when over budget."""
        name = item + suffix
        record = {"name": name, "item": item, "repeat": i, "prompts": n}
        record["result"] = f"{name}.json"
        records.append(record)
        return None if over_budget(record) else record

    for (conv, engine_process), repeats in server_sessions(servers, args.repeats, args.interleave):
        env = tree_env(conv)
        mode = ENGINE_MODES[engine_process] if len(modes) > 1 else None
        tag = f"conv{conv}" + (f"_{mode}" if mode else "")
        port = free_port()
        started = tag + (f"-r{repeats[0]}" if args.interleave else "")
        server_log = out / f"server-{started}.log"
        server = {"name": f"server {started}", "log": server_log.name}
        server["engine_process"] = engine_process
        records.append(server)
        if over_budget(server):
            continue
        # Each server starts from its own empty Triton cache, as a user's first start does,
        # so the backends' start-up times compare (the second would find the first's).
        cache = tempfile.mkdtemp(prefix=f"triton_cold_{tag}_")
        server_env = {**env, "TRITON_CACHE_DIR": cache}
        server_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = engine_process
        server["triton_cache"] = "fresh, empty"
        proc, server["startup_s"] = start_server(args, server_env, port, server_log)
        for i in repeats:
            suffix = suffixes(args.repeats)[i]
            for workload, rate, n in runs:
                if (record := new_run(f"{tag}-{workload}-rate{rate}", i, suffix, n)) is not None:
                    path, repeat = out / record["result"], i if suffix else None
                    cmd = bench_command(args, port, conv, workload, rate, n, path, repeat, mode)
                    run_one(cmd, env, out / f"{record['name']}.log", record)
        server["exit_status"] = stop_server(proc)
        shutil.rmtree(cache, ignore_errors=True)
    for conv in args.conv_backends.split(","):
        env = tree_env(conv)
        for workload, n in offline:
            for i, suffix in enumerate(suffixes(args.offline_repeats)):
                if (record := new_run(f"offline-conv{conv}-{workload}", i, suffix, n)) is not None:
                    cmd = offline_command(args, workload, n, out / record["result"])
                    run_one(cmd, env, out / f"{record['name']}.log", record)
    from benchmarks.common.run_info import git_sha
    from benchmarks.serving.sweep_summary import summarize

    argv = sys.argv[1:] if argv is None else list(argv)
    (out / "sweep.json").write_text(
        json.dumps({"argv": argv, "commit": git_sha(), "runs": records}, indent=2)
    )

    (out / "sweep.md").write_text(summarize(out, records))
    print((out / "sweep.md").read_text())


if __name__ == "__main__":
    main()
