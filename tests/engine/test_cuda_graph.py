"""Decode-only steps through CUDA graphs give the eager engine's logits and tokens (GPU)."""

from __future__ import annotations

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig
from vllm.worker.cuda_graph import buckets_covering, graph_buckets
from vllm.worker.sampler import Sampler

CONFIG = Mamba2ModelConfig(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_heads=8,
    head_dim=16,
    state_size=16,
    n_groups=2,
    chunk_size=16,
)


def test_graph_buckets():
    assert graph_buckets(1) == [1]
    assert graph_buckets(6) == [1, 2, 4, 6]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]


def test_buckets_covering():
    buckets = graph_buckets(20)
    assert buckets_covering(buckets, 1) == [1]
    assert buckets_covering(buckets, 5) == [1, 2, 4, 8]
    assert buckets_covering(buckets, 16) == [1, 2, 4, 8, 16]
    assert buckets_covering(buckets, 17) == buckets
    assert buckets_covering(buckets, 99) == buckets


# These tests are about the decode graphs: the default (FULL) adds mixed-step graphs.
DECODE_ONLY = {"cudagraph_mode": "FULL_DECODE_ONLY"}


@pytest.mark.gpu
def test_capture_ahead_of_time():
    """Start-up captures the graph of every bucket; capturing again captures nothing new."""
    llm = LLM(CONFIG, load_format="dummy", dtype="float32", device="cuda", max_num_seqs=20,
              compilation_config=DECODE_ONLY)  # fmt: skip
    graphs = llm.engine.runner.graphs
    assert sorted(graphs._graphs) == graphs.buckets == [1, 2, 4, 8, 16, 20]
    assert llm.engine.startup["num_graphs"] == 6
    captured = dict(graphs._graphs)
    assert graphs.capture(5) == [1, 2, 4, 8]
    assert graphs.capture() == graphs.buckets
    assert all(graphs._graphs[b] is captured[b] for b in graphs.buckets)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outs = llm.generate([[1, 2, 3], [4, 5]], params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]


@pytest.mark.gpu
def test_graph_decode_equals_eager(monkeypatch):
    """fp32: a graph pads the batch to its bucket, so matmuls may differ in the last bits;
    greedy tokens must still agree on this model, and logits within fp32 noise."""
    rows: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    original = Sampler.sample
    mode = {"eager": True}

    def spy(self, logits, md):
        rows[mode["eager"]].append(logits.clone())
        return original(self, logits, md)

    monkeypatch.setattr(Sampler, "sample", spy)
    prompts = [[(7 * i + j) % 256 for j in range(3 + 5 * i)] for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        mode["eager"] = eager
        llm = LLM(
            CONFIG,
            load_format="dummy",
            dtype="float32",
            device="cuda",
            max_num_seqs=8,
            enforce_eager=eager,
            compilation_config=DECODE_ONLY,
        )
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if not eager:
            assert llm.engine.runner.graphs._graphs, "no decode step ran through a graph"
    assert outs[True] == outs[False]
    assert len(rows[True]) == len(rows[False])
    for a, b in zip(rows[True], rows[False], strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
