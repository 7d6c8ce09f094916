"""benchmarks/step_stats.py: engine step totals read back from the Prometheus text the
server's logger writes (a real registry), their summary, and a server with no such series
(a real HTTP server whose /metrics is missing: benchmark_serving skips the stats)."""

from __future__ import annotations

import asyncio
import http.server
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import step_stats  # noqa: E402

from vllm.engine.stats import IterationStats, StepStats, StepTotals  # noqa: E402

STEPS = [
    StepStats(0.001, 0.010, 0.080, 0.002, 0.095, 40, 3, True),
    StepStats(0.001, 0.004, 0.020, 0.001, 0.028, 0, 4, False),
    StepStats(0.002, 0.005, 0.021, 0.002, 0.030, 8, 4, False),
]


def test_prometheus_text_gives_the_engines_totals():
    from prometheus_client import generate_latest

    from vllm.engine.metrics import PrometheusStatLogger

    logger = PrometheusStatLogger("m")
    totals = StepTotals()
    for i, step in enumerate(STEPS):
        logger.record(IterationStats(step=step, loop_wait_s=0.5 * i, loop_other_s=0.001))
        totals.add(step)
    logger.record(IterationStats(loop_wait_s=1.0))  # a loop pass without a step
    text = generate_latest(logger.registry).decode()
    parsed = step_stats.parse_prometheus(text)
    expected = {**totals.as_dict(), "loop_wait_s": 2.5, "loop_other_s": 0.003}
    assert parsed == pytest.approx(expected)
    assert "vllm:iteration_tokens_total_sum" in text

    s = step_stats.summarize(step_stats.diff(parsed, dict.fromkeys(parsed, 0.0)), 1.0)
    assert (s["num_steps"], s["num_steps_with_prefill"], s["num_steps_decode_only"]) == (3, 1, 2)
    assert s["prefill_tokens"] == 48 and s["decode_tokens"] == 11
    assert s["mean_tokens_per_step"] == pytest.approx(59 / 3)
    assert s["mean_step_ms_with_prefill"] == pytest.approx(95.0)
    assert s["mean_step_ms_decode_only"] == pytest.approx(29.0)
    assert s["phase_ms_per_step"]["read"] == pytest.approx(121 / 3)
    assert s["share_of_wall_in_steps"] == pytest.approx(0.153)
    assert s["share_of_wall_loop_wait"] == pytest.approx(2.5)
    block = step_stats.format_block(s)
    assert "3 (1 with prefill)" in block and "waiting 2.50 s" in block
    table = step_stats.comparison_table([("server", 10.0, s), ("offline", 12.0, s)])
    assert table.count("\n") == 4 and "| offline | 12.0 | 3 | 19.7 (16.0 + 3.7) | 1 |" in table


def test_no_step_series_is_none():
    assert step_stats.parse_prometheus("") is None
    assert step_stats.parse_prometheus('vllm:num_requests_running{model_name="m"} 0.0') is None


class _NoMetrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_error(404)

    def log_message(self, *args):
        pass


def test_a_server_without_metrics_is_skipped():
    from benchmark_serving import scrape_step_totals

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoMetrics)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()

    async def scrape(url):
        import aiohttp

        async with aiohttp.ClientSession() as session:
            return await scrape_step_totals(session, url, {})

    try:
        assert asyncio.run(scrape(f"http://127.0.0.1:{httpd.server_port}")) is None
    finally:
        httpd.shutdown()
    assert asyncio.run(scrape("http://127.0.0.1:9")) is None  # nobody listening
