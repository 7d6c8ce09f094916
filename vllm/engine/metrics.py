"""Prometheus metrics of the engine, with vLLM's names, so that vLLM's dashboards and alerts
read this server unchanged.

    logger = PrometheusStatLogger("my-model")          # its own CollectorRegistry
    AsyncLLM(config, stat_loggers=[logger])
    prometheus_client.generate_latest(logger.registry)  # what GET /metrics serves

Every series carries the label ``model_name``. Each logger owns a registry (prometheus'
global one would reject a second server in the same process, as tests start).

Engine step series (this project's, in vLLM's naming; ``stats.StepStats`` defines the
pieces): ``vllm:engine_step_seconds{step_kind,execution}``, the wall time of each step
call, ``step_kind`` "prefill" when the batch the call waited for held prompt tokens, else
"decode", ``execution`` "graph" when that batch replayed a CUDA graph (decode-only steps,
and mixed steps under cudagraph_mode FULL: ``EngineConfig.cudagraph_mode``), else "eager"
(a call that read no batch too); ``vllm:engine_step_phase_seconds_total{phase}``
(schedule, dispatch, read, output); ``vllm:iteration_tokens_total`` (vLLM's: tokens per
step) and ``vllm:engine_step_tokens_total{token_kind}`` (prefill, decode);
``vllm:engine_step_device_seconds{step_kind,execution}``, the device span of the batch
each call read (CUDA only), by the same labels; ``vllm:engine_kernel_compiles_total``,
Triton kernel variants compiled inside steps (0 unless the start-up warm-up missed one); and
``vllm:engine_loop_seconds_total{phase}``, the engine loop thread's wall time: in steps
(step), blocked waiting for work (wait), waiting for requests beside a running step
(late: ``--late-dispatch``) and the rest (other: taking requests, recording stats, handing
outputs to the event loop); ``vllm:late_dispatch_arrivals_total``, the requests that
arrived in a late wait and joined the next step; ``vllm:engine_prefill_capped_steps_total``,
the steps in which ``--max-mixed-step-ratio`` cut a prompt's chunk (``engine/step_budget.py``).
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
STEP_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1,
    0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
STEP_PHASES = ("schedule", "dispatch", "read", "output")
EXECUTIONS = ("graph", "eager")  # the ``execution`` label: StepStats.graph
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
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in terms of number of cached tokens.",
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
        self._init_step_metrics()

    def _init_step_metrics(self) -> None:
        reg, name = self.registry, self.model_name

        def by_step_kind(series: str, doc: str) -> dict:
            hist = Histogram(series, doc, ["model_name", "step_kind", "execution"],
                             buckets=STEP_BUCKETS, registry=reg)  # fmt: skip
            kinds = ("prefill", "decode")
            return {(k, e): hist.labels(name, k, e) for k in kinds for e in EXECUTIONS}

        self.step_seconds = by_step_kind(
            "vllm:engine_step_seconds",
            "Wall time of one engine step call (schedule, forward, sample, outputs), by "
            "whether the batch it waited for held prompt tokens, and whether that batch "
            "replayed a CUDA graph (execution: graph or eager).",
        )
        self.step_device_seconds = by_step_kind(
            "vllm:engine_step_device_seconds",
            "Device span of the batch an engine step call read (CUDA events: from the GPU "
            "reaching the batch to its sampler's end), by whether it held prompt tokens and "
            "whether it replayed a CUDA graph.",
        )
        self.kernel_compiles = Counter(
            "vllm:engine_kernel_compiles_total",
            "Triton kernel variants compiled inside engine steps (the start-up warm-up "
            "compiles every variant a step can pick: anything else is one it missed).",
            ["model_name"],
            registry=reg,
        ).labels(name)
        phases = Counter(
            "vllm:engine_step_phase_seconds_total",
            "Engine step seconds by piece (schedule, dispatch, read, output).",
            ["model_name", "phase"],
            registry=reg,
        )
        self.step_phase_seconds = {p: phases.labels(name, p) for p in STEP_PHASES}
        # (counter, StepStats field) per phase, made once for record()'s per-step loop.
        self._step_phases = [(self.step_phase_seconds[p], f"{p}_s") for p in STEP_PHASES]
        tokens = Counter(
            "vllm:engine_step_tokens_total",
            "Tokens scheduled in engine steps, prompt (prefill) or decode.",
            ["model_name", "token_kind"],
            registry=reg,
        )
        self.step_tokens = {k: tokens.labels(name, k) for k in ("prefill", "decode")}
        self.iteration_tokens = Histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ["model_name"],
            buckets=ITERATION_TOKEN_BUCKETS,
            registry=reg,
        ).labels(name)
        loop = Counter(
            "vllm:engine_loop_seconds_total",
            "Engine loop thread wall time: in steps, waiting for work, and the rest.",
            ["model_name", "phase"],
            registry=reg,
        )
        self.loop_seconds = {p: loop.labels(name, p) for p in ("step", "wait", "other", "late")}
        self.late_arrivals = Counter(
            "vllm:late_dispatch_arrivals_total",
            "Requests that arrived while the engine loop waited beside a running step "
            "(--late-dispatch) and joined the next step.",
            ["model_name"],
            registry=reg,
        ).labels(name)
        self.prefill_capped_steps = Counter(
            "vllm:engine_prefill_capped_steps_total",
            "Engine steps in which --max-mixed-step-ratio cut a prompt's chunk beside decodes.",
            ["model_name"],
            registry=reg,
        ).labels(name)

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
        self.loop_seconds["wait"].inc(stats.loop_wait_s)
        self.loop_seconds["other"].inc(stats.loop_other_s)
        self.loop_seconds["late"].inc(stats.late_wait_s)
        if stats.late_arrivals:
            self.late_arrivals.inc(stats.late_arrivals)
        step = stats.step
        if step is not None:
            self.loop_seconds["step"].inc(step.total_s)
            labels = ("prefill" if step.waited_on_prefill else "decode",
                      "graph" if step.graph else "eager")  # fmt: skip
            self.step_seconds[labels].observe(step.total_s)
            if step.device_s is not None:
                self.step_device_seconds[labels].observe(step.device_s)
            if step.kernel_compiles:
                self.kernel_compiles.inc(step.kernel_compiles)
            if step.prefill_capped:
                self.prefill_capped_steps.inc()
            for counter, attr in self._step_phases:
                counter.inc(getattr(step, attr))
            if step.prefix_cache_queries:
                self.prefix_cache_queries.inc(step.prefix_cache_queries)
                self.prefix_cache_hits.inc(step.prefix_cache_hits)
            self.step_tokens["prefill"].inc(step.num_prefill_tokens)
            self.step_tokens["decode"].inc(step.num_decode_tokens)
            self.iteration_tokens.observe(step.num_prefill_tokens + step.num_decode_tokens)
        for finished in stats.finished:
            reason = finished.finish_reason or "unknown"
            self._request_success.labels(self.model_name, reason).inc()
            self.e2e_request_latency.observe(finished.e2e_latency_s)
