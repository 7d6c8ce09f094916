"""Engine step statistics of a run, offline or in a server, in one form so that they compare.

The engine sums each step call's host timing and tokens (``vllm.engine.stats.StepTotals``;
``LLMEngine.step_totals`` offline) and the server exports the same sums on /metrics
(``vllm/engine/metrics.py``), plus its engine loop's time outside steps. A run's totals
are the difference of two readings (``diff``); ``summarize`` turns them into:

- ``num_steps``, ``num_steps_with_prefill`` (steps whose waited-for batch held prompt
  tokens), ``num_steps_decode_only``, ``share_of_steps_with_prefill``;
- ``num_steps_with_prefill_graph`` / ``_eager`` and ``num_steps_decode_only_graph`` /
  ``_eager``: the same steps split by whether the batch replayed a CUDA graph (the
  ``execution`` label on /metrics; None for a server without it);
- ``total_step_s``, ``mean_step_ms``, ``mean_step_ms_with_prefill``,
  ``mean_step_ms_decode_only``;
- ``prefill_tokens``, ``decode_tokens``, ``mean_tokens_per_step``,
  ``mean_prefill_tokens_per_step``, ``mean_decode_tokens_per_step``;
- ``phase_ms_per_step``: the mean schedule, dispatch, read and output ms of a step;
- ``wall_s`` (the run's wall time: offline the timed generate, in a server the benchmark's
  duration) and ``share_of_wall_in_steps`` = total step seconds / wall;
- ``mean_device_ms_with_prefill``, ``mean_device_ms_decode_only``: the device span (CUDA
  events) of the batches the step calls read, by the same split; ``share_of_wall_device``
  = their sum / wall, the share of the run the GPU was inside a step (None without
  spans: a CPU engine, or a server without the series);
- ``kernel_compiles``: Triton kernel variants compiled inside steps (0 when the start-up
  warm-up covered every step);
- server only: ``loop_wait_s`` and ``loop_other_s`` (the engine loop blocked waiting for
  work; its other time outside steps) and their shares of the wall time.

No import of torch or of the engine: the serving benchmark (serve.py) uses it as a plain
HTTP client.
"""

from __future__ import annotations

import re

TOTAL_KEYS = (
    "steps",
    "step_s",
    "prefill_steps",
    "prefill_step_s",
    "schedule_s",
    "dispatch_s",
    "read_s",
    "output_s",
    "prefill_tokens",
    "decode_tokens",
    "device_steps",
    "device_s",
    "prefill_device_steps",
    "prefill_device_s",
    "kernel_compiles",
    "capped_steps",
)
# Present when the source splits steps by CUDA graph replay (StepTotals; the label
# execution="graph" on /metrics); absent from an older server's totals.
GRAPH_KEYS = ("graph_steps", "prefill_graph_steps")
LOOP_KEYS = ("loop_wait_s", "loop_other_s", "late_wait_s")
PHASES = ("schedule", "dispatch", "read", "output")
# /metrics series (less the model_name and execution labels: summed over both) -> total key.
PROMETHEUS_SERIES = {
    'vllm:engine_step_seconds_count{step_kind="prefill"}': ("steps", "prefill_steps"),
    'vllm:engine_step_seconds_count{step_kind="decode"}': ("steps",),
    'vllm:engine_step_seconds_sum{step_kind="prefill"}': ("step_s", "prefill_step_s"),
    'vllm:engine_step_seconds_sum{step_kind="decode"}': ("step_s",),
    **{f'vllm:engine_step_phase_seconds_total{{phase="{p}"}}': (f"{p}_s",) for p in PHASES},
    'vllm:engine_step_tokens_total{token_kind="prefill"}': ("prefill_tokens",),
    'vllm:engine_step_tokens_total{token_kind="decode"}': ("decode_tokens",),
    'vllm:engine_step_device_seconds_count{step_kind="prefill"}': (
        "device_steps",
        "prefill_device_steps",
    ),
    'vllm:engine_step_device_seconds_count{step_kind="decode"}': ("device_steps",),
    'vllm:engine_step_device_seconds_sum{step_kind="prefill"}': ("device_s", "prefill_device_s"),
    'vllm:engine_step_device_seconds_sum{step_kind="decode"}': ("device_s",),
    "vllm:engine_kernel_compiles_total": ("kernel_compiles",),
    'vllm:engine_loop_seconds_total{phase="wait"}': ("loop_wait_s",),
    'vllm:engine_loop_seconds_total{phase="other"}': ("loop_other_s",),
    'vllm:engine_loop_seconds_total{phase="late"}': ("late_wait_s",),
    "vllm:late_dispatch_arrivals_total": ("late_arrivals",),
    "vllm:engine_prefill_capped_steps_total": ("capped_steps",),
}
# The same, for the samples labelled execution="graph" only.
GRAPH_SERIES = {
    'vllm:engine_step_seconds_count{step_kind="prefill"}': ("graph_steps", "prefill_graph_steps"),
    'vllm:engine_step_seconds_count{step_kind="decode"}': ("graph_steps",),
}
_SAMPLE = re.compile(r"^(vllm:[a-z0-9_]+)(?:\{(.*)\})? (\S+)$")


def parse_prometheus(text: str) -> dict | None:
    """The step totals in a /metrics text (summed over models); None when it has no engine
    step series (a server without them)."""
    totals = dict.fromkeys(TOTAL_KEYS + LOOP_KEYS + ("late_arrivals",), 0.0)
    found = False
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        labels = [p for p in (m.group(2) or "").split(",") if p and not p.startswith("model_name=")]
        execution = [p for p in labels if p.startswith("execution=")]
        labels = [p for p in labels if not p.startswith("execution=")]
        series = m.group(1) + (f"{{{','.join(labels)}}}" if labels else "")
        value = float(m.group(3))
        for key in PROMETHEUS_SERIES.get(series, ()):
            totals[key] += value
            found = True
        if execution and series in GRAPH_SERIES:
            for key in GRAPH_KEYS:
                totals.setdefault(key, 0.0)
            if execution == ['execution="graph"']:
                for key in GRAPH_SERIES[series]:
                    totals[key] += value
    return totals if found else None


def diff(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after}


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _graph_split(totals: dict, prefill_steps: int, decode_steps: int) -> dict:
    """Steps with prefill and decode-only steps, each split into graph / eager (None when
    the totals do not say)."""
    kinds = ("with_prefill", "decode_only")
    names = [f"num_steps_{k}_{e}" for k in kinds for e in ("graph", "eager")]
    if not all(key in totals for key in GRAPH_KEYS):
        return dict.fromkeys(names, None)
    pre = int(totals["prefill_graph_steps"])
    dec = int(totals["graph_steps"]) - pre
    counts = (pre, prefill_steps - pre, dec, decode_steps - dec)
    return dict(zip(names, counts, strict=True))


def summarize(totals: dict, wall_s: float) -> dict:
    steps, prefill_steps = int(totals["steps"]), int(totals["prefill_steps"])
    decode_steps = steps - prefill_steps
    tokens = totals["prefill_tokens"] + totals["decode_tokens"]
    out = {
        "num_steps": steps,
        "num_steps_with_prefill": prefill_steps,
        "num_steps_decode_only": decode_steps,
        **_graph_split(totals, prefill_steps, decode_steps),
        "share_of_steps_with_prefill": _ratio(prefill_steps, steps),
        "total_step_s": totals["step_s"],
        "mean_step_ms": _ms(_ratio(totals["step_s"], steps)),
        "mean_step_ms_with_prefill": _ms(_ratio(totals["prefill_step_s"], prefill_steps)),
        "mean_step_ms_decode_only": _ms(
            _ratio(totals["step_s"] - totals["prefill_step_s"], decode_steps)
        ),
        "prefill_tokens": int(totals["prefill_tokens"]),
        "decode_tokens": int(totals["decode_tokens"]),
        "mean_tokens_per_step": _ratio(tokens, steps),
        "mean_prefill_tokens_per_step": _ratio(totals["prefill_tokens"], steps),
        "mean_decode_tokens_per_step": _ratio(totals["decode_tokens"], steps),
        "phase_ms_per_step": {p: _ms(_ratio(totals[f"{p}_s"], steps)) for p in PHASES},
        "wall_s": wall_s,
        "share_of_wall_in_steps": _ratio(totals["step_s"], wall_s),
    }
    dev_steps, dev_pre = int(totals["device_steps"]), int(totals["prefill_device_steps"])
    dev_s, dev_pre_s = totals["device_s"], totals["prefill_device_s"]
    out["mean_device_ms_with_prefill"] = _ms(_ratio(dev_pre_s, dev_pre))
    out["mean_device_ms_decode_only"] = _ms(_ratio(dev_s - dev_pre_s, dev_steps - dev_pre))
    out["share_of_wall_device"] = _ratio(dev_s, wall_s) if dev_steps else None
    out["kernel_compiles"] = int(totals["kernel_compiles"])
    for key in LOOP_KEYS:
        if key in totals:
            out[key] = totals[key]
            out[f"share_of_wall_{key[:-2]}"] = _ratio(totals[key], wall_s)
    if "late_arrivals" in totals:
        out["late_arrivals"] = int(totals["late_arrivals"])
    if "capped_steps" in totals:
        out["num_steps_prefill_capped"] = int(totals["capped_steps"])
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _f(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def format_block(s: dict, title: str = "Engine steps") -> str:
    phases = ", ".join(f"{p} {_f(v, '.2f')}" for p, v in s["phase_ms_per_step"].items())
    lines = [
        "{t:-^51}".format(t=f" {title} "),
        f"steps: {s['num_steps']} ({s['num_steps_with_prefill']} with prefill), "
        f"{_f(s['mean_tokens_per_step'])} tokens/step "
        f"({_f(s['mean_prefill_tokens_per_step'])} prefill, "
        f"{_f(s['mean_decode_tokens_per_step'])} decode)",
        f"step ms: mean {_f(s['mean_step_ms'], '.2f')}, with prefill "
        f"{_f(s['mean_step_ms_with_prefill'], '.2f')}, decode-only "
        f"{_f(s['mean_step_ms_decode_only'], '.2f')}",
        f"per step ms: {phases}",
    ]
    if s.get("num_steps_with_prefill_graph") is not None:
        lines.append(
            f"CUDA graph / eager steps: with prefill {s['num_steps_with_prefill_graph']} / "
            f"{s['num_steps_with_prefill_eager']}, decode-only "
            f"{s['num_steps_decode_only_graph']} / {s['num_steps_decode_only_eager']}"
        )
    lines += [
        f"in steps: {s['total_step_s']:.2f} s of {s['wall_s']:.2f} s wall "
        f"({_f(_pct(s['share_of_wall_in_steps']))}%)",
    ]
    if s.get("share_of_wall_device") is not None:
        lines.append(
            f"device ms per step read: with prefill "
            f"{_f(s['mean_device_ms_with_prefill'], '.2f')}, decode-only "
            f"{_f(s['mean_device_ms_decode_only'], '.2f')}; GPU inside steps "
            f"{_f(_pct(s['share_of_wall_device']))}% of wall"
        )
    if "kernel_compiles" in s:
        lines.append(f"kernel compiles inside steps: {s['kernel_compiles']}")
    if "loop_wait_s" in s:
        lines.append(
            f"engine loop outside steps: waiting {s['loop_wait_s']:.2f} s "
            f"({_f(_pct(s['share_of_wall_loop_wait']))}%), other {s['loop_other_s']:.2f} s "
            f"({_f(_pct(s['share_of_wall_loop_other']))}%)"
        )
    if s.get("late_wait_s"):
        lines.append(
            f"late dispatch: waited {s['late_wait_s']:.2f} s beside running steps, "
            f"{s.get('late_arrivals', 0)} requests joined the next step in a wait"
        )
    if s.get("num_steps_prefill_capped"):
        lines.append(
            f"steps whose prompt tokens --max-mixed-step-ratio cut: {s['num_steps_prefill_capped']}"
        )
    return "\n".join(lines)


def _pct(share: float | None) -> float | None:
    return None if share is None else 100.0 * share


COMPARISON_HEAD = (
    "| run | output tok/s | steps | tokens/step (prefill + decode) | steps with prefill | "
    "step ms mean / with prefill / decode-only | schedule / dispatch / read / output ms "
    "per step | device ms with prefill / decode-only | % wall GPU in steps | compiles | "
    "% wall in steps | % wall loop wait / other |"
)


def comparison_row(name: str, output_tok_s: float, s: dict) -> str:
    ph = s["phase_ms_per_step"]
    loop = (
        f"{_f(_pct(s['share_of_wall_loop_wait']))} / {_f(_pct(s['share_of_wall_loop_other']))}"
        if "loop_wait_s" in s
        else "-"
    )
    return (
        f"| {name} | {output_tok_s:.1f} | {s['num_steps']} | {_f(s['mean_tokens_per_step'])} "
        f"({_f(s['mean_prefill_tokens_per_step'])} + {_f(s['mean_decode_tokens_per_step'])}) "
        f"| {s['num_steps_with_prefill']} | {_f(s['mean_step_ms'], '.2f')} / "
        f"{_f(s['mean_step_ms_with_prefill'], '.2f')} / "
        f"{_f(s['mean_step_ms_decode_only'], '.2f')} | "
        + " / ".join(_f(ph[p], ".2f") for p in PHASES)
        + f" | {_f(s.get('mean_device_ms_with_prefill'), '.2f')} / "
        f"{_f(s.get('mean_device_ms_decode_only'), '.2f')} | "
        f"{_f(_pct(s.get('share_of_wall_device')))} | {_f(s.get('kernel_compiles'), 'd')} | "
        f"{_f(_pct(s['share_of_wall_in_steps']))} | {loop} |"
    )


def comparison_table(rows: list[tuple[str, float, dict]]) -> str:
    """Markdown: one row per (run name, output tok/s, step summary)."""
    lines = [COMPARISON_HEAD, "| --- |" + " ---: |" * 11]
    lines += [comparison_row(*row) for row in rows]
    return "\n".join(lines) + "\n"
