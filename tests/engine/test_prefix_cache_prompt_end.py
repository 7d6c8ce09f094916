"""Prompt-end checkpoints (``enable_mamba_prompt_end_checkpoint``): the state after a whole
prompt, keyed by exactly its tokens, so that a chat's next turn whose history does not hold
the ids the model generated (a template that drops reasoning text, an answer that tokenizes
differently) still restores the whole previous prompt. Outputs equal the engine without
caching (greedy tokens and logprobs, fp32 state); every test asserts the hits it expects."""

from __future__ import annotations

import argparse

import pytest

from tests.engine.hybrid_prefix_utils import make_llm, reference_engines
from tests.engine.hybrid_prefix_utils import run as run_hybrid
from tests.engine.hybrid_prefix_utils import same as same_hybrid
from tests.engine.utils import STREAMS_CONFIG, prefix_llm, run_greedy
from vllm.engine.arg_utils import EngineArgs

pytestmark = pytest.mark.timeout(900)
OTHER = [90, 2, 2, 61, 33, 7]  # an unrelated prompt: it overwrites the freed slot
FIRST = [11, 4, 27, 9, 63, 5, 18, 40, 2, 71]  # 10 tokens: two blocks of 4 and a tail of 2
ON = dict(enable_mamba_prompt_end_checkpoint=True)
REFERENCE = reference_engines()  # the hybrids without caching, made on first use


def test_the_flag_parses_and_is_off_by_default():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--enable-prefix-caching", "--enable-mamba-prompt-end-checkpoint"])
    ns.model = STREAMS_CONFIG
    assert EngineArgs.from_cli_args(ns).create_engine_config().enable_mamba_prompt_end_checkpoint
    ns = parser.parse_args(["--enable-prefix-caching"])
    ns.model = STREAMS_CONFIG
    assert (
        not EngineArgs.from_cli_args(ns).create_engine_config().enable_mamba_prompt_end_checkpoint
    )
    with pytest.raises(ValueError, match="enable_mamba_prompt_end_checkpoint"):
        EngineArgs(STREAMS_CONFIG, enable_mamba_prompt_end_checkpoint=1).create_engine_config()


def second_turn(first: list[int], answer: list[int]) -> list[int]:
    """The next turn's prompt with an answer other than the one generated (what a chat's
    history holds when its text tokenizes differently), then a new message."""
    other = [(t + 1) % 96 for t in answer]
    return first + other + [7, 7]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_next_turn_with_another_answer_restores_the_whole_prompt(device, async_scheduling):
    on = prefix_llm(device, True, async_scheduling=async_scheduling, **ON)
    off = prefix_llm(device, False)
    core = on.llm_engine.engine_core
    index, policy = core.prefix.index, core.prompt_checkpoints
    out1 = run_greedy(on, FIRST, 3)
    assert out1[2] == 0 and policy.num_prompt_ends == 1
    run_greedy(on, OTHER, 2)
    turn2 = second_turn(FIRST, out1[0])
    out2 = run_greedy(on, turn2, 3)
    # The end-of-request checkpoint (FIRST + the generated ids) cannot match; the prompt-end
    # one (FIRST, off the grid: a tail key) does.
    assert out2[2] == len(FIRST) and index.hits == len(FIRST)
    for out, prompt in ((out1, FIRST), (out2, turn2)):
        ref = run_greedy(off, prompt, 3)
        assert out[0] == ref[0]
        assert out[1] == pytest.approx(ref[1], rel=1e-4, abs=1e-5)


def test_without_the_flag_the_other_answer_restores_only_the_grid_checkpoint(device):
    # FIRST is new to the engine: its align cut is checkpointed only with the cold flag.
    on = prefix_llm(device, True, enable_mamba_align_cold_checkpoint=True)
    core = on.llm_engine.engine_core
    out1 = run_greedy(on, FIRST, 3)
    out2 = run_greedy(on, second_turn(FIRST, out1[0]), 3)
    # FIRST's first chunk (the budget's 6 tokens) was rounded down to 4 and checkpointed.
    assert core.prompt_checkpoints.num_prompt_ends == 0 and out2[2] == 4


def test_two_lines_keep_the_end_of_request_checkpoint_over_prompt_ends(device):
    """Two checkpoint lines, two requests: each request's prompt-end entry is demoted when
    its end-of-request checkpoint is written, so the other request's writes evict prompt
    ends, never the first turn's longer checkpoint (the plain LRU would evict it)."""
    on = prefix_llm(device, True, num_checkpoint_lines=2,
                    enable_mamba_align_cold_checkpoint=True, **ON)  # fmt: skip
    index = on.llm_engine.engine_core.prefix.index
    out1 = run_greedy(on, FIRST, 3)
    run_greedy(on, OTHER, 2)
    # FIRST wrote its grid checkpoint at 4, its prompt end and its end (which took the
    # demoted prompt end's line); OTHER's prompt end took the grid one's, its end its own
    # demoted prompt end's.
    assert index.evictions == 3
    turn2 = FIRST + out1[0] + [7, 7]
    out2 = run_greedy(on, turn2, 2)
    assert out2[2] == len(FIRST) + 3 - 1  # the end-of-request checkpoint, not the prompt's


@pytest.mark.parametrize("model,async_scheduling", [("bamba", False), ("nemotron_h", True)])
def test_hybrid_restores_the_prompt_and_its_kv(device, model, async_scheduling):
    on = make_llm(
        device, model, True, async_scheduling=async_scheduling, num_checkpoint_lines=8, **ON
    )
    core = on.llm_engine.engine_core
    out1 = run_hybrid(on, FIRST, 3)
    run_hybrid(on, OTHER, 2)
    turn2 = second_turn(FIRST, out1[0])
    # FIRST is 10 tokens: one full attention block of 8 shared, the tail of 2 copied.
    out2 = run_hybrid(on, turn2, 3, cached=len(FIRST))
    assert core.prefix.index.hits == len(FIRST) and core.prompt_checkpoints.num_prompt_ends >= 2
    for out, prompt in ((out1, FIRST), (out2, turn2)):
        same_hybrid(out, run_hybrid(REFERENCE(model), prompt, 3))
