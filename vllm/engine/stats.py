"""What the engine reports after each step, for stat loggers (Prometheus: ``metrics.py``),
and the start-up log line that ``LLMEngine`` and ``AsyncLLM`` write."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class FinishedRequestStats:
    e2e_latency_s: float
    num_prompt_tokens: int
    num_generation_tokens: int
    finish_reason: str | None  # "stop", "length", "abort" or "error"


@dataclass
class StepStats:
    """One engine step call, timed on the host (``time.perf_counter``; no device sync is
    added). Its pieces: ``schedule_s`` (the scheduler's batch), ``dispatch_s`` (inputs
    prepared, the forward and the sampler queued on the device: host time, plus any wait
    the forward itself makes), ``read_s`` (the host reads a dispatched step's sampled
    tokens, which waits for that step's device work, and applies them), ``output_s`` (the
    output processor: detokenizing, stop strings, ``RequestOutput``s); ``total_s`` is the
    whole call. Tokens are those of the batch the call dispatched: prompt tokens
    (``num_prefill_tokens``) and the one-token continuations of requests past their
    prompt (``num_decode_tokens``).

    ``waited_on_prefill``: under async scheduling a call dispatches batch N, then waits for
    batch N-1's tokens, so its time is mostly batch N-1's device time; it is True when the
    batch whose tokens the call read held prompt tokens (the batch it dispatched, when it
    read none). Without async scheduling the two are the same batch.

    ``device_s``: the device span of the batch the call read (CUDA events recorded when the
    batch was queued and behind its sampler): from the GPU reaching the batch (the work
    queued before it done) to the batch's end, gaps the host left inside it included; None
    when the call read no batch or the device has no events (CPU).
    ``kernel_compiles``: Triton kernel variants the batch the call read compiled (launches
    that missed the launchers' caches: ``vllm.triton_utils.launch``, counted by the
    worker); the start-up warm-up compiles every variant a step can pick, so anything but
    0 is a variant it missed. ``prefix_cache_queries`` / ``prefix_cache_hits``: with prefix
    caching, the prompt tokens the batch's newly admitted requests looked up and those
    restored from checkpoints. ``graph``: the batch the call read replayed a CUDA graph
    (``StepOutput.graph``: decode-only, or mixed under cudagraph_mode FULL); False when it
    ran eagerly or the call read no batch. ``prefill_capped``: ``--max-mixed-step-ratio``
    held prompt tokens of the batch the call dispatched back (``engine/step_budget.py``)."""

    schedule_s: float = 0.0
    dispatch_s: float = 0.0
    read_s: float = 0.0
    output_s: float = 0.0
    total_s: float = 0.0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    waited_on_prefill: bool = False
    device_s: float | None = None
    kernel_compiles: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    graph: bool = False
    prefill_capped: bool = False


@dataclass
class StepTotals:
    """Sums over engine step calls (``LLMEngine.step_totals``, from its start): ``steps``
    and ``step_s`` split into those ``waited_on_prefill`` (``prefill_steps``,
    ``prefill_step_s``) and the rest; the pieces' seconds and the tokens; the device spans
    of the calls that have one, split the same way (``device_steps``, ``device_s``,
    ``prefill_device_steps``, ``prefill_device_s``); the kernel compiles; the calls whose
    batch replayed a CUDA graph (``graph_steps``), of them ``prefill_graph_steps``; the calls
    whose batch ``--max-mixed-step-ratio`` cut (``capped_steps``)."""

    steps: int = 0
    step_s: float = 0.0
    prefill_steps: int = 0
    prefill_step_s: float = 0.0
    schedule_s: float = 0.0
    dispatch_s: float = 0.0
    read_s: float = 0.0
    output_s: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    device_steps: int = 0
    device_s: float = 0.0
    prefill_device_steps: int = 0
    prefill_device_s: float = 0.0
    kernel_compiles: int = 0
    graph_steps: int = 0
    prefill_graph_steps: int = 0
    capped_steps: int = 0

    def add(self, step: StepStats) -> None:
        self.steps += 1
        self.step_s += step.total_s
        if step.waited_on_prefill:
            self.prefill_steps += 1
            self.prefill_step_s += step.total_s
        self.schedule_s += step.schedule_s
        self.dispatch_s += step.dispatch_s
        self.read_s += step.read_s
        self.output_s += step.output_s
        self.prefill_tokens += step.num_prefill_tokens
        self.decode_tokens += step.num_decode_tokens
        self.kernel_compiles += step.kernel_compiles
        self.capped_steps += int(step.prefill_capped)
        if step.graph:
            self.graph_steps += 1
            self.prefill_graph_steps += int(step.waited_on_prefill)
        if step.device_s is not None:
            self.device_steps += 1
            self.device_s += step.device_s
            if step.waited_on_prefill:
                self.prefill_device_steps += 1
                self.prefill_device_s += step.device_s

    def as_dict(self) -> dict:
        """A copy, as plain numbers (what benchmarks subtract and summarize)."""
        return asdict(self)


@dataclass
class IterationStats:
    """One engine step. ``num_prompt_tokens`` counts the prompts whose prefill ended in the
    step (their first token came out); latencies are in seconds."""

    num_running: int = 0
    num_waiting: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens_s: list[float] = field(default_factory=list)
    inter_token_latencies_s: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    # The step call's timing (None: the loop ran no step), and the engine loop's time
    # since its previous record outside the step: blocked waiting for work (or for the
    # lock the event loop takes to queue requests), and the rest (taking queued requests
    # and aborts, recording stats, handing outputs to the event loop).
    step: StepStats | None = None
    loop_wait_s: float = 0.0
    loop_other_s: float = 0.0
    # --late-dispatch: the loop's wait for requests beside a running step, and the
    # requests that arrived in it (core_client.EngineCoreOutputs).
    late_wait_s: float = 0.0
    late_arrivals: int = 0


class StatLoggerBase:
    """Called in the engine's loop thread after each step."""

    def record(self, stats: IterationStats) -> None:
        raise NotImplementedError


def _longest_compile(finished: dict[str, float] | None) -> str:
    if not finished:
        return ""
    name = max(finished, key=finished.get)
    return f"; the last done: {name} at {finished[name]:.1f} s"


def startup_line(s: dict) -> str:
    """The start-up log line: the total and its parts."""
    return (
        f"engine start-up {s['total_s']:.1f} s: weights {s['weights_s']:.1f} s, state pool "
        f"{s['state_pool_s']:.1f} s ({s['state_pool_gib']:.2f} GiB"
        + (
            f", of which the replay rings (replayssm_buffer_len "
            f"{s['replayssm_buffer_len']}) {s['replay_ring_gib']:.2f} GiB"
            if s.get("replayssm_buffer_len")
            else ""
        )
        + (
            f", of which {s['num_checkpoint_lines']} prefix-cache checkpoint lines "
            f"{s['checkpoint_gib']:.2f} GiB"
            if s.get("num_checkpoint_lines")
            else ""
        )
        + "), kernel compile "
        f"{s['compile_s']:.1f} s ({s['num_kernels']} variants, {s['num_kernels_compiled']} new"
        + _longest_compile(s.get("kernel_finished_s"))
        + ") in a warm-up of "
        f"{s['warmup_s']:.1f} s, graph capture {s['graph_capture_s']:.1f} s "
        f"({s['num_graphs']} graphs"
        + (
            f", cudagraph_mode {s['cudagraph_mode']}"
            + (
                f": {s['num_mixed_graphs']} mixed-step graphs in "
                f"{s['mixed_graph_capture_s']:.1f} s taking {s['mixed_graph_pool_gib']:.2f} GiB"
                + (
                    f" of a {s['graph_budget_gib']:.2f} GiB budget"
                    if s.get("graph_budget_gib") is not None
                    else ""
                )
                + f"; graph pool {s['graph_pool_gib']:.2f} GiB in all"
                if s.get("num_mixed_graphs")
                else ""
            )
            if "cudagraph_mode" in s
            else ""
        )
        + ")"
        + (
            f", KV cache {s['num_kv_blocks']} blocks ({s['kv_cache_gib']:.2f} GiB)"
            if s.get("num_kv_blocks")
            else ""
        )
    )
