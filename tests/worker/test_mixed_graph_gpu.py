"""cudagraph_mode FULL on the GPU: mixed steps replay CUDA graphs captured at start-up and
give the eager engine's greedy tokens (Mamba2 and the Bamba hybrid's attention; the MoE,
short-conv and Mamba1 models), every step inside a bucket replays a graph, and what cannot
be graphed runs eagerly and is counted."""

from __future__ import annotations

import pytest
import torch

from tests.engine.utils import BAMBA
from tests.worker.mixed_graph_models import MODELS
from vllm import LLM, SamplingParams
from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig
from vllm.worker.mixed_graph import mixed_buckets, mixed_token_sizes

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it without CUDA: graphs need a GPU

# The layer kinds graphed since the Mamba2 ones: mixed_graph_models.MODELS (tiny
# transformers checkpoints or configs), whose padded steps test_mixed_graph.py runs eagerly.
GRAPHED_LAYER_KINDS = ["granite_moe", "nemotron_h_moe", "lfm2", "falcon_mamba", "jamba"]

MAMBA2 = Mamba2ModelConfig(
    vocab_size=256, hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16,
    state_size=16, n_groups=2, chunk_size=16,
)  # fmt: skip
# Four sequences: every step has at most four prefills, so every step fits the bucket.
OPTS = dict(load_format="dummy", dtype="float32", device="cuda", max_num_seqs=4,
            max_num_batched_tokens=32, max_model_len=96)  # fmt: skip


def _llm(model, mode: str, **kw) -> LLM:
    return LLM(model, **{**OPTS, **kw}, compilation_config={"cudagraph_mode": mode})


def _prompts(chunk: int) -> list[list[int]]:
    """Lengths 1 .. chunk + 1, and two longer than a step's budget (chunked prefills that
    continue their states), arriving together: mixed steps beside running decodes."""
    lens = [*range(1, chunk + 2), 45, 70]
    return [[(11 * i + 7 * j) % 120 + 1 for j in range(n)] for i, n in enumerate(lens)]


def _greedy(llm: LLM, prompts, n: int = 6, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs] for o in outs]
    return tokens, logprobs


def test_full_captures_every_bucket_at_start_up():
    llm = _llm(MAMBA2, "FULL")
    runner = llm.engine.runner
    buckets = mixed_buckets(OPTS["max_num_batched_tokens"], OPTS["max_num_seqs"])
    assert runner.cudagraph_mode == "FULL" and runner.mixed_graphs.buckets == buckets
    assert sorted(runner.mixed_graphs._graphs, key=lambda b: b.num_tokens) == buckets
    startup = llm.engine.startup
    assert startup["cudagraph_mode"] == "FULL" and startup["num_mixed_graphs"] == len(buckets)
    assert startup["graph_pool_gib"] > 0
    # No attention layer: nothing is sized from free memory, so no budget is measured.
    assert startup["graph_budget_gib"] is None


def test_the_kv_cache_leaves_the_graphs_what_their_throwaway_capture_took(monkeypatch):
    """With attention layers the KV cache is sized from free memory: FULL first captures
    the mixed graphs into a throwaway pool, and the real capture stays within what that
    took (the budget the KV cache left free), with no over-budget warning."""
    from vllm.worker import model_runner

    measured = []
    original = model_runner.measure_mixed_graphs

    def spy(*args, **kwargs):
        measured.append(original(*args, **kwargs))
        return measured[-1]

    monkeypatch.setattr(model_runner, "measure_mixed_graphs", spy)
    warned = []
    monkeypatch.setattr(model_runner.logger, "warning", lambda *a: warned.append(a))
    llm = _llm(BAMBA, "FULL")
    startup = llm.engine.startup
    assert len(measured) == 1 and measured[0] > 0  # the throwaway capture ran
    assert startup["graph_budget_gib"] == measured[0] / 2**30
    # (a tiny model's real capture may fit in the decode graphs' pool: 0 GiB added)
    assert startup["mixed_graph_pool_gib"] <= startup["graph_budget_gib"] + 1 / 1024
    assert not [w for w in warned if "over their budget" in w[0]]
    assert len(_greedy(llm, _prompts(16))[0]) == len(_prompts(16))


@pytest.mark.parametrize("model", [MAMBA2, BAMBA], ids=["mamba2", "bamba"])
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_full_equals_eager_and_decode_only(model, async_scheduling):
    """Graphs pad the step, so matmuls may differ in the last bits: greedy tokens must
    agree, logprobs within fp32 noise. No mixed step of this workload runs eagerly."""
    chunk = getattr(model, "chunk_size", None) or model.mamba_chunk_size
    prompts = _prompts(chunk)
    got = {}
    for mode in ("NONE", "FULL_DECODE_ONLY", "FULL"):
        # A fixed KV cache: the suite's parallel workers share the GPU's memory.
        llm = _llm(model, mode, async_scheduling=async_scheduling, num_gpu_blocks_override=64)
        got[mode] = _greedy(llm, prompts)
        counts = llm.engine.runner.step_counts
        if mode == "FULL":
            assert counts["eager"] == 0, counts
            assert counts["graph_mixed"] == llm.engine.runner.mixed_graphs.num_replays > 3
        elif mode == "FULL_DECODE_ONLY":
            assert counts["graph_mixed"] == 0 and counts["eager"] > 3
        del llm
        torch.cuda.empty_cache()
    for mode in ("FULL_DECODE_ONLY", "FULL"):
        assert got[mode][0] == got["NONE"][0], mode
        for g, w in zip(got[mode][1], got["NONE"][1], strict=True):
            assert torch.allclose(torch.tensor(g), torch.tensor(w), atol=1e-4, rtol=1e-4)


def test_prompt_logprob_steps_run_eagerly_and_are_counted():
    llm = _llm(MAMBA2, "FULL")
    want = _greedy(_llm(MAMBA2, "NONE"), [[5, 6, 7, 8, 9]], prompt_logprobs=1)
    counts = llm.engine.runner.step_counts
    assert _greedy(llm, [[5, 6, 7, 8, 9]], prompt_logprobs=1)[0] == want[0]
    assert counts["eager"] >= 1 and counts["graph_decode"] >= 1


@pytest.mark.parametrize("model", [MAMBA2, BAMBA], ids=["mamba2", "bamba"])
def test_replayed_decodes_replay_their_mixed_steps(model):
    """use_replayssm under the default mode (FULL): decodes replay (L = 3: rows flush inside
    the graphs), mixed steps replay their graphs, no step runs eagerly, and the greedy
    tokens are the every-step eager engine's (logprobs within fp32 noise)."""
    prompts = _prompts(16)
    # A fixed KV cache (Bamba): sized from free memory it found none while the suite's other
    # workers held the GPU (an H100, 2026-12-06).
    fixed = dict(num_gpu_blocks_override=64)
    want = _greedy(_llm(model, "NONE", **fixed), prompts)
    llm = LLM(model, **OPTS, **fixed, use_replayssm=True, replayssm_buffer_len=3)
    runner = llm.engine.runner
    assert runner.cudagraph_mode == "FULL" and runner.full_graphs_off is None
    got = _greedy(llm, prompts)
    assert got[0] == want[0]
    for g, w in zip(got[1], want[1], strict=True):
        assert torch.allclose(torch.tensor(g), torch.tensor(w), atol=1e-4, rtol=1e-4)
    counts = runner.step_counts
    assert counts["eager"] == 0 and counts["graph_mixed"] > 0 and counts["graph_decode"] > 0


@pytest.mark.parametrize("asked", [True, False], ids=["asked", "default"])
def test_a_model_without_mixed_graphs_falls_back(asked, monkeypatch):
    """A setting without mixed-step graphs (full_graphs_unsupported names it: the CUDA conv
    ops, a Mamba2 scan that is not the Triton SSD) falls back to FULL_DECODE_ONLY, said at
    start-up: a warning where FULL was asked for, else at info level (the default is no
    mistake of the user's); the engine still serves."""
    from vllm.worker import model_runner

    said = []
    for level in ("warning", "info"):
        monkeypatch.setattr(model_runner.logger, level, lambda *a, _l=level: said.append((_l, a)))
    monkeypatch.setattr(model_runner, "full_graphs_unsupported", lambda *a: "a stand-in reason")
    llm = _llm(MAMBA2, "FULL") if asked else LLM(MAMBA2, **OPTS)
    assert llm.engine.runner.cudagraph_mode == "FULL_DECODE_ONLY"
    assert llm.engine.runner.full_graphs_off == "a stand-in reason"
    levels = [lvl for lvl, a in said if "mixed steps run eagerly" in a[0]]
    assert levels == ["warning" if asked else "info"]
    assert len(_greedy(llm, [[1, 2, 3]])[0][0]) == 6


@pytest.mark.parametrize("name", GRAPHED_LAYER_KINDS)
def test_every_layer_kind_replays_its_mixed_steps(name, tmp_path):
    """Routed experts (Granite-4.0-H's, NemotronH's), LFM2's short conv, Mamba1's scan
    (FalconMamba; Jamba beside attention and experts): under FULL every mixed step of the
    workload replays a graph, with the eager engine's greedy tokens and logprobs within
    fp32 noise."""
    model = MODELS[name](tmp_path)
    prompts = _prompts(16)
    want = _greedy(_llm(model, "NONE", num_gpu_blocks_override=64), prompts)
    llm = _llm(model, "FULL", num_gpu_blocks_override=64)
    runner = llm.engine.runner
    assert runner.cudagraph_mode == "FULL", runner.full_graphs_off
    got = _greedy(llm, prompts)
    counts = runner.step_counts
    assert counts["eager"] == 0, (counts, runner.eager_mixed_reasons)
    assert counts["graph_mixed"] == runner.mixed_graphs.num_replays > 3
    assert got[0] == want[0]
    for g, w in zip(got[1], want[1], strict=True):
        assert torch.allclose(torch.tensor(g), torch.tensor(w), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["falcon_mamba", "jamba"])
def test_long_prefills_replay_mamba1s_chunked_scan(name, tmp_path):
    """Buckets up to 256 tokens and prompts of 90-200 tokens: Mamba1's padded scan runs in
    several chunks (its state pass and rescan captured, not only the one-chunk path), with
    the eager engine's tokens."""
    from vllm.model_executor.layers.mamba.mamba_mixer import MambaMixer
    from vllm.model_executor.layers.mamba.ops.selective_scan_host import chunk_plan

    model = MODELS[name](tmp_path)
    kw = dict(max_num_batched_tokens=256, max_model_len=512, num_gpu_blocks_override=64)
    lens = [150, 3, 200, 90]
    prompts = [[(13 * i + 5 * j) % 120 + 1 for j in range(n)] for i, n in enumerate(lens)]
    want = _greedy(_llm(model, "NONE", **kw), prompts)
    llm = _llm(model, "FULL", **kw)
    runner = llm.engine.runner
    mixer = next(m for m in runner.model.modules() if isinstance(m, MambaMixer))
    plan = chunk_plan(256, 1, mixer.intermediate_size, mixer.state_size, torch.float32)
    assert plan[1] > 1, plan  # the 256-token bucket's scan is chunked
    got = _greedy(llm, prompts)
    counts = runner.step_counts
    assert counts["eager"] == 0, (counts, runner.eager_mixed_reasons)
    assert 256 in [b.num_tokens for b in runner.mixed_graphs._graphs]
    assert got[0] == want[0]
    for g, w in zip(got[1], want[1], strict=True):
        assert torch.allclose(torch.tensor(g), torch.tensor(w), atol=1e-4, rtol=1e-4)


def test_steps_above_the_capture_size_run_eagerly():
    """max_cudagraph_capture_size 16: buckets stop at 16 tokens; a longer prompt's step runs
    eagerly, counted, with the eager engine's tokens."""
    cc = {"cudagraph_mode": "FULL", "max_cudagraph_capture_size": 16}
    llm = LLM(MAMBA2, **OPTS, compilation_config=cc)
    runner = llm.engine.runner
    assert [b.num_tokens for b in runner.mixed_graphs.buckets] == mixed_token_sizes(16) == [16]
    prompts = [[3] * 5, [4] * 30]
    want = _greedy(_llm(MAMBA2, "NONE"), prompts)
    assert _greedy(llm, prompts)[0] == want[0]
    assert runner.step_counts["eager"] >= 1 and runner.step_counts["graph_mixed"] >= 1
