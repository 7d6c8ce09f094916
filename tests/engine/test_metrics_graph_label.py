"""The ``execution`` label ("graph" / "eager") of ``vllm:engine_step_seconds`` and
``vllm:engine_step_device_seconds``: written by the real Prometheus logger from
``StepStats.graph``, summed by ``StepTotals``, read back by ``vllm.benchmarks.step_stats``
(the four graph / eager step counts), and filled by the engine from each step's output."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine.utils import STREAMS_CONFIG as CONFIG
from vllm import LLM, SamplingParams
from vllm.benchmarks import step_stats
from vllm.engine.metrics import PrometheusStatLogger
from vllm.engine.stats import IterationStats, StepStats, StepTotals

# (prefill?, graph?) per call: mixed steps as graph and eager (outside the buckets),
# decode-only steps as both, and a call that read no batch (eager, no device span).
STEPS = [
    StepStats(total_s=0.050, num_prefill_tokens=8, num_decode_tokens=2,
              waited_on_prefill=True, device_s=0.040, graph=True),
    StepStats(total_s=0.060, num_prefill_tokens=8, num_decode_tokens=2,
              waited_on_prefill=True, device_s=0.050, graph=False),
    StepStats(total_s=0.010, num_decode_tokens=4, device_s=0.008, graph=True),
    StepStats(total_s=0.012, num_decode_tokens=4, device_s=0.009, graph=True),
    StepStats(total_s=0.020, num_decode_tokens=4, device_s=0.015, graph=False),
    StepStats(total_s=0.003),
]  # fmt: skip


def _recorded() -> tuple[str, StepTotals]:
    logger = PrometheusStatLogger("m")
    totals = StepTotals()
    for i, step in enumerate(STEPS):
        # One call after a late-dispatch wait (--late-dispatch) in which 2 requests arrived.
        late = dict(late_wait_s=0.004, late_arrivals=2) if i == 2 else {}
        logger.record(IterationStats(step=step, **late))
        totals.add(step)
    return generate_latest(logger.registry).decode(), totals


def _samples(text: str, name: str) -> dict[tuple[str, str], float]:
    """{(step_kind, execution): value} of one sample name, read by prometheus' parser."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                assert sample.labels["model_name"] == "m"
                out[sample.labels["step_kind"], sample.labels["execution"]] = sample.value
    return out


def test_step_series_carry_the_execution_label():
    text, _ = _recorded()
    counts = _samples(text, "vllm:engine_step_seconds_count")
    assert counts == {
        ("prefill", "graph"): 1, ("prefill", "eager"): 1,
        ("decode", "graph"): 2, ("decode", "eager"): 2,
    }  # fmt: skip
    sums = _samples(text, "vllm:engine_step_seconds_sum")
    assert sums[("prefill", "graph")] == pytest.approx(0.050)
    assert sums[("decode", "graph")] == pytest.approx(0.022)
    assert sums[("decode", "eager")] == pytest.approx(0.023)
    device = _samples(text, "vllm:engine_step_device_seconds_count")
    assert device == {
        ("prefill", "graph"): 1, ("prefill", "eager"): 1,
        ("decode", "graph"): 2, ("decode", "eager"): 1,
    }  # fmt: skip
    assert _samples(text, "vllm:engine_step_device_seconds_sum")[("decode", "graph")] == (
        pytest.approx(0.017)
    )


def test_every_label_pair_is_exported_before_any_step():
    text = generate_latest(PrometheusStatLogger("m").registry).decode()
    for name in ("vllm:engine_step_seconds_count", "vllm:engine_step_device_seconds_count"):
        assert _samples(text, name) == {
            (k, e): 0.0 for k in ("prefill", "decode") for e in ("graph", "eager")
        }


def test_step_stats_reads_the_label_back():
    text, totals = _recorded()
    assert (totals.graph_steps, totals.prefill_graph_steps) == (3, 1)
    parsed = step_stats.parse_prometheus(text)
    # The old figures sum over the label; the graph counts come from execution="graph".
    loop = {"loop_wait_s": 0.0, "loop_other_s": 0.0, "late_wait_s": 0.004, "late_arrivals": 2}
    assert parsed == pytest.approx({**totals.as_dict(), **loop})
    s = step_stats.summarize(parsed, 1.0)
    assert (s["late_wait_s"], s["late_arrivals"]) == (pytest.approx(0.004), 2)
    assert "late dispatch: waited 0.00 s beside running steps, 2 requests" in (
        step_stats.format_block(s)
    )
    assert (s["num_steps"], s["num_steps_with_prefill"], s["num_steps_decode_only"]) == (6, 2, 4)
    assert (s["num_steps_with_prefill_graph"], s["num_steps_with_prefill_eager"]) == (1, 1)
    assert (s["num_steps_decode_only_graph"], s["num_steps_decode_only_eager"]) == (2, 2)
    assert s["mean_step_ms_with_prefill"] == pytest.approx(55.0)
    assert s["mean_device_ms_decode_only"] == pytest.approx(32 / 3)
    assert s == step_stats.summarize(totals.as_dict() | loop, 1)
    block = step_stats.format_block(s)
    assert "CUDA graph / eager steps: with prefill 1 / 1, decode-only 2 / 2" in block
    # Two scrapes: the difference counts only the steps between them.
    before = step_stats.parse_prometheus(_recorded()[0])
    assert step_stats.diff(parsed, before)["graph_steps"] == 0


def test_totals_without_the_split_give_none():
    """An older server (no execution label) or totals without the graph keys."""
    totals = StepTotals()
    for step in STEPS:
        totals.add(step)
    old = {k: v for k, v in totals.as_dict().items() if k not in step_stats.GRAPH_KEYS}
    s = step_stats.summarize(old, 1.0)
    assert s["num_steps"] == 6
    kinds = ("with_prefill", "decode_only")
    names = [f"num_steps_{k}_{e}" for k in kinds for e in ("graph", "eager")]
    assert all(s[name] is None for name in names)
    assert "CUDA graph" not in step_stats.format_block(s)


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_the_engine_counts_graph_steps(device, enforce_eager):
    """Every step on the CPU runs eagerly; on CUDA decode-only and mixed steps replay graphs
    by default (FULL), and none does under ``enforce_eager``."""
    llm = LLM(CONFIG, load_format="dummy", dtype="float32", device=device.type,
              max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
              enforce_eager=enforce_eager)  # fmt: skip
    mode = "NONE" if enforce_eager else "FULL"
    assert llm.llm_engine.config.cudagraph_mode == mode
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    llm.generate([[1, 2, 3], [4, 5], [6, 7, 8, 9]], params, use_tqdm=False)
    totals = llm.llm_engine.step_totals
    assert totals.steps > 0
    if device.type == "cuda" and not enforce_eager:
        assert totals.graph_steps > 0 and totals.prefill_graph_steps > 0
    else:
        assert totals.graph_steps == 0
