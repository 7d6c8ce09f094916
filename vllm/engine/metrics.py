"""Prometheus metrics of the engine, with vLLM's names, so that vLLM's dashboards and alerts
read this server unchanged.

    logger = PrometheusStatLogger("my-model")          # its own CollectorRegistry
    AsyncLLM(config, stat_loggers=[logger])
    prometheus_client.generate_latest(logger.registry)  # what GET /metrics serves

Every series carries the label ``model_name``. Each logger owns a registry (prometheus'
global one would reject a second server in the same process, as tests start).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from vllm.engine.stats import IterationStats, StatLoggerBase

# vLLM's bucket edges (seconds), so that quantiles compare across the two servers.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class PrometheusStatLogger(StatLoggerBase):
    """Records each step's ``IterationStats`` (called in the engine's loop thread;
    prometheus-client's metrics are thread-safe)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        reg, labels = self.registry, ["model_name"]

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=reg).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=reg).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=reg).labels(model_name)

        self.num_requests_running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.num_requests_waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.prompt_tokens = counter(
            "vllm:prompt_tokens_total", "Number of prefill tokens processed."
        )
        self.generation_tokens = counter(
            "vllm:generation_tokens_total", "Number of generation tokens processed."
        )
        self._request_success = Counter(
            "vllm:request_success_total",
            "Count of finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=reg,
        )
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )  # fmt: skip
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )  # fmt: skip
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            E2E_BUCKETS,
        )

    def set_queue_lengths(self, running: int, waiting: int) -> None:
        """The two gauges; also called by the server right before a scrape, so that a
        request aborted after the engine's last step does not linger as running."""
        self.num_requests_running.set(running)
        self.num_requests_waiting.set(waiting)

    def record(self, stats: IterationStats) -> None:
        self.set_queue_lengths(stats.num_running, stats.num_waiting)
        if stats.num_prompt_tokens:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
        for ttft in stats.time_to_first_tokens_s:
            self.time_to_first_token.observe(ttft)
        for itl in stats.inter_token_latencies_s:
            self.inter_token_latency.observe(itl)
        for finished in stats.finished:
            reason = finished.finish_reason or "unknown"
            self._request_success.labels(self.model_name, reason).inc()
            self.e2e_request_latency.observe(finished.e2e_latency_s)
