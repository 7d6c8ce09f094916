"""Engines whose mixed steps run through the padded path eagerly (FULL's CPU check): the
helpers of test_mixed_graph.py and of the per-model files test_mixed_graph_models_*.py (the
models split in two files, so that the suite's workers, which take whole files, share
them)."""

from __future__ import annotations

import torch

from tests.worker.host_sync_guard import HostSyncError, no_host_sync
from tests.worker.mixed_graph_models import MODELS
from vllm import LLM, SamplingParams
from vllm.model_executor.layers.mamba.mamba2_metadata import Mamba2MetadataBuilder
from vllm.worker.mixed_graph import MixedGraphs


def padded_path(llm: LLM, device) -> MixedGraphs:
    """Every step of ``llm`` through the padded mixed path, run eagerly (enforce_eager: no
    decode graph takes the decode-only steps first either). What a graph would capture
    (``step``: the forward and the sampled rows' gather) runs under ``no_host_sync``; the
    syncs it finds (the engine turns a failed step into failed requests) land in
    ``host_syncs``."""
    runner = llm.engine.runner
    c = llm.engine.config
    builder = Mamba2MetadataBuilder(runner.builder.chunk_size, device, triton_ssd=True)
    graphs = runner.mixed_graphs = MixedGraphs(
        runner.model, builder, c.max_num_batched_tokens, c.max_num_seqs, None,
        runner.attn_builder, capture=False,
    )  # fmt: skip
    graphs.host_syncs = []
    make = graphs._graph

    def guarded(step):
        def run():
            try:
                with no_host_sync():
                    return step()
            except HostSyncError as e:
                graphs.host_syncs.append(str(e))
                raise

        return run

    def graph(bucket):
        g = make(bucket)
        if not getattr(g, "guarded", False):
            g.step, g.guarded = guarded(g.step), True
        return g

    graphs._graph = graph
    return graphs


def greedy(llm: LLM, prompts, n: int):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        (o.outputs[0].token_ids, [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
        for o in outs
    ]


def check_padded_path_equals_eager(name, device, tmp_path) -> None:
    """Prompt lengths 1 .. chunk + 1 and longer beside running decodes, chunked prefills
    continuing their states, async scheduling's pending tokens: the padded steps of model
    ``name`` give the eager engine's greedy tokens, and their logprobs within fp32 noise."""
    model = MODELS[name](tmp_path)
    # A fixed KV cache (4 sequences of 48 tokens): the eager engine may still hold its
    # cache when the second starts, and 0.9 of the GPU would leave the second none.
    opts = dict(load_format="dummy", dtype="float32", device=device.type, max_num_seqs=4,
                max_num_batched_tokens=16, max_model_len=48, enforce_eager=True,
                num_gpu_blocks_override=12)  # fmt: skip
    lens = [1, 9, 3, 20, 8, 2]
    prompts = [[(5 * i + 3 * j) % 90 + 1 for j in range(n)] for i, n in enumerate(lens)]
    want = greedy(LLM(model, **opts), prompts, 3)
    llm = LLM(model, **opts)
    padded = padded_path(llm, device)
    try:
        got = greedy(llm, prompts, 3)
    finally:  # a sync fails the step's requests: say which first
        assert padded.host_syncs == [], padded.host_syncs[0]
    counts = llm.engine.runner.step_counts
    assert counts["eager"] == 0 and counts["graph_mixed"] == padded.num_replays > 5
    assert [g[0] for g in got] == [w[0] for w in want]
    for (_, g), (_, w) in zip(got, want, strict=True):
        assert torch.allclose(torch.tensor(g), torch.tensor(w), atol=1e-4, rtol=1e-4)
    # the buckets used were the step's smallest: 16 tokens is the only one here
    assert [b.num_tokens for b in padded._graphs] == [16]
