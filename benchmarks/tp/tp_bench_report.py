"""benchmark_tp.py's figures from its runs (tp_bench_run.py's results), and the markdown.

- ``compare_logits``: TP=N against TP=1 per logits step, and both against the fp32 TP=1
  reference when there is one (the bf16 yardstick).
- ``step_table``: per timed step, TP=1 and TP=N latency and, at TP=N, the all-reduces the
  step made (per layer and per step) and their cost, timed alone.
- ``throughput_table``: ``LLM.generate`` at TP=1 and TP=N.
"""

from __future__ import annotations

from collections import Counter

# TP=N's bf16 error against fp32 may be at most this times TP=1's (the hybrid tests' bound
# against HF's own bf16 run, tests/models/mamba2_utils.py).
BF16_ERROR_FACTOR = 2.0
# Without a reference (an fp32 run): TP=N within this fraction of the logits' scale.
FP32_REL_TOL = 1e-4


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def compare_logits(tp1: list, tpn: list, ref: list | None, steps: list[dict]) -> dict:
    """Max |difference| per step and overall: TP=N - TP=1, and, with ``ref``, TP=1 - ref and
    TP=N - ref; the share of rows whose argmax (the greedy token) agrees."""
    rows = []
    for i, (a, b) in enumerate(zip(tp1, tpn, strict=True)):
        row = dict(steps[i])
        row["max_abs_diff"] = float((b - a).abs().max())
        row["scale"] = float(a.abs().max())
        row["argmax_agree"] = float((a.argmax(-1) == b.argmax(-1)).float().mean())
        if ref is not None:
            row["tp1_vs_ref"] = float((a - ref[i]).abs().max())
            row["tpn_vs_ref"] = float((b - ref[i]).abs().max())
        rows.append(row)
    out = {
        "steps": rows,
        "max_abs_diff": max(r["max_abs_diff"] for r in rows),
        "scale": max(r["scale"] for r in rows),
        "argmax_agree": sum(r["argmax_agree"] * r["rows"] for r in rows)
        / sum(r["rows"] for r in rows),
        "reference": ref is not None,
    }
    if ref is not None:
        out["tp1_vs_ref"] = max(r["tp1_vs_ref"] for r in rows)
        out["tpn_vs_ref"] = max(r["tpn_vs_ref"] for r in rows)
        out["error_ratio"] = _ratio(out["tpn_vs_ref"], out["tp1_vs_ref"])
        out["diff_in_bf16_errors"] = _ratio(out["max_abs_diff"], out["tp1_vs_ref"])
        out["criterion"] = f"max |TP=N - fp32| <= {BF16_ERROR_FACTOR} x max |TP=1 - fp32|"
        out["within_tolerance"] = out["tpn_vs_ref"] <= BF16_ERROR_FACTOR * out["tp1_vs_ref"]
    else:
        out["criterion"] = f"max |TP=N - TP=1| <= {FP32_REL_TOL} x max |logits|"
        out["within_tolerance"] = out["max_abs_diff"] <= FP32_REL_TOL * max(out["scale"], 1.0)
    return out


def collective_summary(calls: list[dict], num_layers: int) -> dict:
    """A step's collectives: those of each layer (all layers alike, or not) and those
    outside the layers."""
    per_layer = [[c for c in calls if c["layer"] == i] for i in range(num_layers)]
    sig = [[(c["op"], tuple(c["shape"]), c["dtype"]) for c in layer] for layer in per_layer]
    outside = [c for c in calls if c["layer"] is None]
    return {
        "total": len(calls),
        "by_op": dict(Counter(c["op"] for c in calls)),
        "per_layer": [{k: c[k] for k in ("op", "shape", "dtype")} for c in per_layer[0]],
        "layers_alike": all(s == sig[0] for s in sig),
        "outside_layers": [{k: c[k] for k in ("op", "shape", "dtype")} for c in outside],
    }


def all_reduce_us(timed: list[dict], shape, dtype) -> float | None:
    for t in timed:
        if t["shape"] == list(shape) and t["dtype"] == dtype:
            return t["us"]["median"]
    return None


def step_table(tp1: dict, tpn: dict, num_layers: int) -> list[dict]:
    """Per timed step: latencies, speed-up, and TP=N's all-reduces (count per layer and per
    step, their time alone per layer and per step, and the step-time share)."""
    one = {r["step"]: r for r in tp1.get("latency", [])}
    timed = tpn.get("all_reduce", [])
    out = []
    for r in tpn.get("latency", []):
        calls = r.get("collectives", [])
        reduces = [c for c in calls if c["op"] == "all_reduce"]
        costs = [all_reduce_us(timed, c["shape"], c["dtype"]) for c in reduces]
        layer0 = [cost for c, cost in zip(reduces, costs, strict=True) if c["layer"] == 0]
        known = None not in costs
        row = {
            "step": r["step"],
            "tokens": r["tokens"],
            "tpn_ms": r["ms"]["median"],
            "tp1_ms": one[r["step"]]["ms"]["median"] if r["step"] in one else None,
            "cuda_graph": r["cuda_graph"],
            "collectives": collective_summary(calls, num_layers),
            "all_reduces_per_step": len(reduces),
            "all_reduces_per_layer": len(layer0),
            "all_reduce_ms_per_layer": sum(layer0) / 1e3 if known else None,
            "all_reduce_ms_per_step": sum(costs) / 1e3 if known else None,
        }
        row["speedup"] = _ratio(row["tp1_ms"], row["tpn_ms"])
        row["all_reduce_share"] = _ratio(row["all_reduce_ms_per_step"], row["tpn_ms"])
        out.append(row)
    return out


def throughput_table(tp1: dict, tpn: dict) -> dict:
    a, b = tp1.get("throughput"), tpn.get("throughput")
    out = {"tp1": a, "tpn": b}
    if a and b:
        out["speedup"] = b["output_tokens_per_s"] / a["output_tokens_per_s"]
    return out


def _f(x, fmt: str = ".2f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def markdown(res: dict) -> str:
    s, n = res["setup"], res["setup"]["tp"]
    env = s.get("environment", {})
    lines = [
        f"# Tensor parallelism: {s['model']} TP={n} against TP=1 ({s['dtype']})",
        "",
        f"- **When, what:** {s['date']}, commit {s['commit']}; `{' '.join(s['argv'])}`",
        f"- **Devices:** {', '.join(env.get('gpus') or [s['device']])}; torch {env.get('torch')}"
        f" (CUDA {env.get('cuda')}), triton {env.get('triton')}, NCCL {env.get('nccl')}, "
        f"python {env.get('python')}; backend {s['backend']}",
        f"- **Environment of the ranks:** {env.get('env')}",
        f"- **Model:** {s['shape']}, dummy weights (seed {s['seed']}: the same at every TP "
        f"size), SSM state {s['mamba_ssm_cache_dtype']}",
    ]
    for why in res.get("skipped", []):
        lines.append(f"- **Not run:** {why}")
    lg = res.get("logits")
    if lg:
        lines += ["", "## Logits, TP=N against TP=1", ""]
        lines.append(
            f"Max |TP={n} - TP=1| = {lg['max_abs_diff']:.3g} on logits of scale "
            f"{lg['scale']:.3g}; greedy tokens agree on {100 * lg['argmax_agree']:.1f}% of rows."
        )
        if lg["reference"]:
            lines.append(
                f"Against fp32 TP=1: TP=1 {lg['tp1_vs_ref']:.3g}, TP={n} {lg['tpn_vs_ref']:.3g} "
                f"(ratio {_f(lg['error_ratio'])}; the TP difference is "
                f"{_f(lg['diff_in_bf16_errors'])} bf16 errors)."
            )
        verdict = "within" if lg["within_tolerance"] else "NOT within"
        lines += [f"**{verdict} tolerance** ({lg['criterion']}).", ""]
        head = "| step | rows | tokens | graph | max abs diff | scale | argmax agree |"
        lines += [head + (" TP=1 vs fp32 | TP=N vs fp32 |" if lg["reference"] else "")]
        lines.append("|" + " --- |" * (9 if lg["reference"] else 7))
        for r in lg["steps"]:
            line = (
                f"| {r['kind']} | {r['rows']} | {r['tokens']} | {r.get('cuda_graph')} | "
                f"{r['max_abs_diff']:.3g} | {r['scale']:.3g} | {100 * r['argmax_agree']:.0f}% |"
            )
            if lg["reference"]:
                line += f" {r['tp1_vs_ref']:.3g} | {r['tpn_vs_ref']:.3g} |"
            lines.append(line)
    tput = res.get("throughput")
    if tput and tput.get("tp1") and tput.get("tpn"):
        a, b = tput["tp1"], tput["tpn"]
        lines += ["", "## Throughput (`LLM.generate`, fixed lengths, ignore_eos, greedy)", ""]
        lines.append(
            f"{a['num_prompts']} prompts x {a['input_len']} tokens, {a['output_len']} output "
            f"tokens each; TP={n} / TP=1 output tok/s: {_f(tput.get('speedup'))}x"
        )
        lines += [
            "",
            "| TP | output tok/s | total tok/s | req/s | elapsed s | steps | start-up s | eager |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for tp, t in ((1, a), (n, b)):
            run = res["runs"]["tp1" if tp == 1 else f"tp{n}"]
            lines.append(
                f"| {tp} | {t['output_tokens_per_s']:.1f} | {t['total_tokens_per_s']:.1f} | "
                f"{t['requests_per_s']:.2f} | {t['elapsed_s']:.2f} | {t['engine_steps']} | "
                f"{run['startup_s']:.1f} | {run['spec']['enforce_eager']} |"
            )
    steps = res.get("steps")
    if steps:
        lines += ["", "## Step latency and the all-reduce cost", ""]
        lines.append(
            f"Wall time of one step through the engine's runner (TP=1) or executor (TP={n}), "
            "median ms. All-reduces: those the step made at TP=N (recorded), each timed alone "
            "on the model's group (tensor_model_parallel_all_reduce, back to back)."
        )
        lines += [
            "",
            f"| step | tokens | graph | TP=1 ms | TP={n} ms | speed-up | all-reduces per layer"
            " / step | all-reduce ms per layer | per step | share of step |",
            "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in steps:
            lines.append(
                f"| {r['step']} | {r['tokens']} | {r['cuda_graph']} | {_f(r['tp1_ms'])} | "
                f"{_f(r['tpn_ms'])} | {_f(r['speedup'])} | {r['all_reduces_per_layer']} / "
                f"{r['all_reduces_per_step']} | {_f(r['all_reduce_ms_per_layer'], '.4f')} | "
                f"{_f(r['all_reduce_ms_per_step'], '.3f')} | "
                f"{_pct(r['all_reduce_share'])} |"
            )
        first = steps[0]["collectives"]
        lines += [
            "",
            f"Collectives of `{steps[0]['step']}` at TP={n}: {first['by_op']}; per layer "
            f"{first['per_layer']} (every layer alike: {first['layers_alike']}); outside the "
            f"layers {first['outside_layers']}.",
        ]
    timed = res.get("all_reduce")
    if timed:
        lines += ["", "| all-reduce | bytes | us (median) | p20-p80 | alg GB/s | bus GB/s |"]
        lines.append("| --- | ---: | ---: | --- | ---: | ---: |")
        for t in timed:
            us = t["us"]
            alg = t["bytes"] / us["median"] / 1e3
            lines.append(
                f"| {'x'.join(map(str, t['shape']))} {t['dtype']} | {t['bytes']} | "
                f"{us['median']:.1f} | {us['p20']:.1f}-{us['p80']:.1f} | {alg:.3g} | "
                f"{alg * 2 * (n - 1) / n:.3g} |"
            )
    return "\n".join(lines) + "\n"
