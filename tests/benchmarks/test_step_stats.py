"""vllm/benchmarks/step_stats.py: engine step totals read back from the Prometheus text the
server's logger writes (a real registry), their summary, and a server with no such series
(a real HTTP server whose /metrics is missing: the serving benchmark skips the stats)."""

from __future__ import annotations

import asyncio
import http.server
import threading

import pytest

from vllm.benchmarks import step_stats
from vllm.engine.stats import IterationStats, StepStats, StepTotals

STEPS = [
    StepStats(0.001, 0.010, 0.080, 0.002, 0.095, 40, 3, True, device_s=0.070),
    StepStats(0.001, 0.004, 0.020, 0.001, 0.028, 0, 4, False, device_s=0.018, kernel_compiles=2),
    StepStats(0.002, 0.005, 0.021, 0.002, 0.030, 8, 4, False, device_s=0.022, prefill_capped=True),
    StepStats(0.001, 0.003, 0.000, 0.001, 0.005, 8, 0, True),  # read nothing: no span
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
    expected = {**totals.as_dict(), "loop_wait_s": 4.0, "loop_other_s": 0.004}
    expected |= {"late_wait_s": 0.0, "late_arrivals": 0}  # no --late-dispatch wait
    assert parsed == pytest.approx(expected)
    assert "vllm:iteration_tokens_total_sum" in text

    s = step_stats.summarize(step_stats.diff(parsed, dict.fromkeys(parsed, 0.0)), 1.0)
    assert (s["num_steps"], s["num_steps_with_prefill"], s["num_steps_decode_only"]) == (4, 2, 2)
    assert s["prefill_tokens"] == 56 and s["decode_tokens"] == 11
    assert s["mean_tokens_per_step"] == pytest.approx(67 / 4)
    assert s["mean_step_ms_with_prefill"] == pytest.approx(50.0)
    assert s["mean_step_ms_decode_only"] == pytest.approx(29.0)
    assert s["phase_ms_per_step"]["read"] == pytest.approx(121 / 4)
    assert s["share_of_wall_in_steps"] == pytest.approx(0.158)
    assert s["share_of_wall_loop_wait"] == pytest.approx(4.0)
    # Device spans: the call that read no batch has none and is not in the means.
    assert s["mean_device_ms_with_prefill"] == pytest.approx(70.0)
    assert s["mean_device_ms_decode_only"] == pytest.approx(20.0)
    assert s["share_of_wall_device"] == pytest.approx(0.110)
    assert s["kernel_compiles"] == 2
    block = step_stats.format_block(s)
    assert "4 (2 with prefill)" in block and "waiting 4.00 s" in block
    assert "late dispatch" not in block  # printed only when the loop waited so
    assert "with prefill 70.00, decode-only 20.00; GPU inside steps 11.0% of wall" in block
    assert "kernel compiles inside steps: 2" in block
    assert s["num_steps_prefill_capped"] == 1
    assert "steps whose prompt tokens --max-mixed-step-ratio cut: 1" in block
    table = step_stats.comparison_table([("server", 10.0, s), ("offline", 12.0, s)])
    assert table.count("\n") == 4 and "| offline | 12.0 | 4 | 16.8 (14.0 + 2.8) | 2 |" in table
    assert "| 70.00 / 20.00 | 11.0 | 2 |" in table


def test_a_cpu_engine_has_no_device_spans():
    totals = StepTotals()
    totals.add(StepStats(0.001, 0.004, 0.020, 0.001, 0.028, 0, 4, False))
    s = step_stats.summarize(totals.as_dict(), 1.0)
    assert s["mean_device_ms_decode_only"] is None and s["share_of_wall_device"] is None
    assert "device ms" not in step_stats.format_block(s)
    assert "| - / - | - | 0 |" in step_stats.comparison_table([("offline", 1.0, s)])


def test_no_step_series_is_none():
    assert step_stats.parse_prometheus("") is None
    assert step_stats.parse_prometheus('vllm:num_requests_running{model_name="m"} 0.0') is None


class _NoMetrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_error(404)

    def log_message(self, *args):
        pass


def test_a_server_without_metrics_is_skipped():
    from vllm.benchmarks.serve import scrape_step_totals

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
