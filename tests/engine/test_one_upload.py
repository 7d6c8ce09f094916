"""A step's host-built tensors reach the device in ONE copy (issue 28, item 2).

The runner gathers the input ids, positions, sampled rows, pending-token rows, prompt
rows, the Mamba metadata (slots, flags, chunk layout, conv tile map) and the attention
metadata, and uploads them through its ``StagedUpload``; the builders' own copies are
for start-up and graph capture only. Counted on the staging objects: the fast path is
asserted to have run, and nothing else to have copied.
"""

from __future__ import annotations

import pytest

from tests.engine.utils import BAMBA, bamba_llm
from vllm import LLM, SamplingParams


def _own_copies(runner) -> tuple[int, int]:
    attn = runner.attn_builder.num_own_copies if runner.attn_builder is not None else 0
    return runner.builder.staging.num_uploads, attn


def _steps_and_uploads(llm: LLM, prompts, params) -> tuple[int, int, tuple[int, int]]:
    runner = llm.engine.runner
    executor = llm.engine.engine_core.executor
    execute, steps = executor.execute_model, []

    def counting(inputs):
        steps.append(inputs)
        return execute(inputs)

    executor.execute_model = counting
    before, own = runner.staging.num_uploads, _own_copies(runner)
    llm.generate(prompts, params, use_tqdm=False)
    executor.execute_model = execute
    own_after = _own_copies(runner)
    return (
        len(steps),
        runner.staging.num_uploads - before,
        (own_after[0] - own[0], own_after[1] - own[1]),
    )


def test_one_upload_per_eager_step_hybrid():
    """Bamba (Mamba2 + attention), chunked prefills, decodes, prompt logprobs and random
    sampling: every step is one staged copy, and neither builder copies on its own."""
    llm = bamba_llm(max_num_seqs=3, max_num_batched_tokens=8, block_size=4)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 6], [7, 8, 9, 10, 11]]
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=4, prompt_logprobs=1,
                            ignore_eos=True)  # fmt: skip
    steps, uploads, own = _steps_and_uploads(llm, prompts, params)
    assert steps >= 5, "the workload should take several steps (chunked prefills, decodes)"
    assert uploads == steps
    assert own == (0, 0), "a builder made a copy of its own during a step"


def test_staged_views_are_aligned_and_in_one_buffer():
    """The fields the kernels read start 16-byte aligned in the one device buffer."""
    llm = bamba_llm(max_num_seqs=2, max_num_batched_tokens=8, block_size=4)
    runner = llm.engine.runner
    seen = {}
    finish = runner.builder.finish

    def spying(plan, dev):
        md = finish(plan, dev)
        seen["md"] = md
        return md

    runner.builder.finish = spying
    llm.generate([[1, 2, 3], [4, 5, 6, 7, 8]], SamplingParams(max_tokens=2), use_tqdm=False)
    md = seen["md"]
    base = runner.staging.device_buffer.untyped_storage().data_ptr()
    for name, t in (
        ("state_indices", md.state_indices),
        ("has_initial_state", md.has_initial_state),
        ("conv.query_start_loc", md.conv.query_start_loc),
        ("conv.tile_seq", md.conv.tile_seq),
    ):
        assert t.untyped_storage().data_ptr() == base, f"{name} is not in the staged upload"
        assert t.data_ptr() % 16 == 0, name


@pytest.mark.gpu
def test_one_upload_per_step_on_cuda_graphs_and_eager():
    """On CUDA under the default mode (FULL): decode-only steps replay the decode graphs and
    steps with prompt tokens replay the mixed-step graphs, each through its graphs' own
    staging, and a step outside both runs eagerly through the runner's: either way one staged
    copy per step."""
    llm = LLM(BAMBA, load_format="dummy", dtype="float32", device="cuda", max_model_len=48,
              max_num_seqs=4, max_num_batched_tokens=16, block_size=16,
              num_gpu_blocks_override=16)  # fmt: skip
    # (a fixed KV cache: sized from free GPU memory it would take what the suite's other
    # workers need on the same GPU)
    runner = llm.engine.runner
    assert runner.mixed_graphs is not None, "FULL (the default) captured no mixed-step graphs"
    decode_before = runner.graphs.staging.num_uploads
    mixed_before = runner.mixed_graphs.staging.num_uploads
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    steps, eager_uploads, own = _steps_and_uploads(llm, [[1, 2, 3], [4, 5, 6, 7]], params)
    decode = runner.graphs.staging.num_uploads - decode_before
    mixed = runner.mixed_graphs.staging.num_uploads - mixed_before
    assert decode > 0, "no decode step replayed a graph"
    assert mixed > 0, "no step with prompt tokens replayed a mixed-step graph"
    assert eager_uploads + decode + mixed == steps
    assert own == (0, 0)
