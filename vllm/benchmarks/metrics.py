"""The metrics of a serving run, under vLLM's benchmark_serving key names, and its table.

Per successful request: TTFT, the inter-token latencies (ITL, one per chunk after the
first), the end-to-end latency (E2EL) and TPOT = (E2EL - TTFT) / (output tokens - 1),
counted only for requests with more than one output token. Token totals count successful
requests: input tokens are the client's prompt counts, output tokens the server's usage
counts. Throughputs divide by the run's wall time. Each selected metric gets
``mean_<m>_ms``, ``median_<m>_ms``, ``std_<m>_ms`` and ``p<q>_<m>_ms`` (q in
``--metric-percentiles``, written as vLLM writes it: 99, 99.9); a metric with no sample is
0, as vLLM reports it. Failed requests are counted (``failed``), their distinct error
texts counted in ``failure_reasons``.

Prefix caching: when the server reports ``prompt_tokens_details.cached_tokens`` (vLLM's
--enable-prompt-tokens-details), ``total_cached_tokens`` sums them over the successful
requests and ``prefix_cache_hit_rate`` divides that by their prompt tokens as the server
counts them (``usage.prompt_tokens``: a chat prompt's rendered template included); both
are None when no request reported them.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

METRICS = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}
# The per-request lists that only --save-detailed keeps.
DETAILED_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors")


def percentile_label(q: float) -> str:
    return str(int(q)) if float(q).is_integer() else str(q)


def output_token_count(out, tokenizer) -> int:
    """The server's usage count; without a usage chunk, the generated text re-tokenized."""
    if out.output_tokens is not None:
        return out.output_tokens
    return len(tokenizer(out.generated_text, add_special_tokens=False).input_ids)


def calculate_metrics(
    outputs: list,
    duration: float,
    tokenizer,
    metrics: list[str],
    percentiles: list[float],
) -> dict:
    samples: dict[str, list[float]] = {m: [] for m in METRICS}
    output_lens: list[int] = []
    total_input = completed = recounted = 0
    reasons: Counter = Counter()
    for out in outputs:
        if not out.success:
            output_lens.append(0)
            reasons[out.error] += 1
            continue
        recounted += out.output_tokens is None
        n = output_token_count(out, tokenizer)
        output_lens.append(n)
        total_input += out.prompt_len
        completed += 1
        if n > 1:
            samples["tpot"].append((out.latency - out.ttft) / (n - 1))
        samples["ttft"].append(out.ttft)
        samples["itl"].extend(out.itl)
        samples["e2el"].append(out.latency)
    total_output = sum(output_lens)
    result = {
        "duration": duration,
        "completed": completed,
        "failed": len(outputs) - completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "failure_reasons": dict(reasons.most_common()),
        "output_tokens_without_usage": recounted,
    }
    for m in metrics:
        values = np.asarray(samples[m] or [0.0]) * 1000.0
        result[f"mean_{m}_ms"] = float(np.mean(values))
        result[f"median_{m}_ms"] = float(np.median(values))
        result[f"std_{m}_ms"] = float(np.std(values))
        for q in percentiles:
            result[f"p{percentile_label(q)}_{m}_ms"] = float(np.percentile(values, q))
    result.update(cache_hits(outputs))
    result.update(
        input_lens=[o.prompt_len for o in outputs],
        output_lens=output_lens,
        ttfts=[o.ttft for o in outputs],
        itls=[o.itl for o in outputs],
        generated_texts=[o.generated_text for o in outputs],
        errors=[o.error for o in outputs],
    )
    return result


def cache_hits(outputs: list) -> dict:
    """``total_cached_tokens`` and ``prefix_cache_hit_rate`` of the successful requests
    that report cached tokens (None without any)."""
    done = [o for o in outputs if o.success and o.cached_tokens is not None]
    if not done:
        return {"total_cached_tokens": None, "prefix_cache_hit_rate": None}
    cached = sum(o.cached_tokens for o in done)
    prompt = sum(o.server_prompt_tokens or o.prompt_len for o in done)
    return {"total_cached_tokens": cached, "prefix_cache_hit_rate": cached / max(prompt, 1)}


def _row(label: str, value) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label:<40} {value:>10}"


def format_table(result: dict, metrics: list[str], percentiles: list[float]) -> str:
    lines = [
        "{s:=^51}".format(s=" Serving Benchmark Result "),
        _row("Successful requests:", result["completed"]),
        _row("Failed requests:", result["failed"]),
    ]
    if result.get("max_concurrency") is not None:
        lines.append(_row("Maximum request concurrency:", result["max_concurrency"]))
    lines += [
        _row("Benchmark duration (s):", result["duration"]),
        _row("Total input tokens:", result["total_input_tokens"]),
        _row("Total generated tokens:", result["total_output_tokens"]),
        _row("Request throughput (req/s):", result["request_throughput"]),
        _row("Output token throughput (tok/s):", result["output_throughput"]),
        _row("Total token throughput (tok/s):", result["total_token_throughput"]),
    ]
    if result.get("prefix_cache_hit_rate") is not None:
        lines.append(_row("Cached prompt tokens:", result["total_cached_tokens"]))
        lines.append(_row("Prefix cache hit rate:", result["prefix_cache_hit_rate"]))
    for m in metrics:
        name = m.upper()
        lines.append("{s:-^51}".format(s=f" {METRICS[m]} "))
        lines.append(_row(f"Mean {name} (ms):", result[f"mean_{m}_ms"]))
        lines.append(_row(f"Median {name} (ms):", result[f"median_{m}_ms"]))
        for q in percentiles:
            label = percentile_label(q)
            lines.append(_row(f"P{label} {name} (ms):", result[f"p{label}_{m}_ms"]))
    if result["failure_reasons"]:
        lines.append("{s:-^51}".format(s=" Failed requests by error "))
        for reason, count in result["failure_reasons"].items():
            lines.append(f"{count:>6} x {reason[:200]}")
    lines.append("=" * 51)
    return "\n".join(lines)
