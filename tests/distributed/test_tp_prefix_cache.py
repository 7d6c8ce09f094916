"""Prefix caching over two tensor-parallel ranks (CPU, gloo): each rank copies its own
heads' state lines, so a second turn restored from the first's checkpoint gives the greedy
tokens of one rank without caching, and the cache was hit."""

from __future__ import annotations

from tests.tiny_model import make_tiny_model_dir
from vllm import LLM, SamplingParams

ENGINE = dict(device="cpu", max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _turn(llm: LLM, prompt: list[int]):
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def test_two_ranks_restore_the_first_turn(tmp_path):
    model_dir = str(make_tiny_model_dir(tmp_path / "tiny", n_groups=2))
    first, other = [5, 9, 13, 17, 21, 25, 29], [40, 2, 2, 7]
    llm = LLM(
        model_dir,
        tensor_parallel_size=2,
        enable_prefix_caching=True,
        mamba_block_size=4,
        **ENGINE,
    )
    try:
        assert llm.engine.engine_core.executor.world_size == 2
        out1, cached1 = _turn(llm, first)
        _turn(llm, other)  # takes the freed slot, so only the checkpoint holds turn one
        second = first + out1 + [3, 3]
        out2, cached2 = _turn(llm, second)
        assert (cached1, cached2) == (0, len(first) + len(out1) - 1)
    finally:
        llm.engine.core.shutdown()
    ref = LLM(model_dir, **ENGINE)
    assert _turn(ref, first)[0] == out1
    assert _turn(ref, second)[0] == out2
