"""Prompt block-boundary checkpoints (``--mamba-cache-mode``, pure Mamba2): chunks end on the
grid where a checkpoint is due, the checkpoints restore, and every output equals the engine
without caching (greedy tokens and logprobs, fp32 state). Each test asserts the hits it
expects (``index.hits`` and ``RequestOutput.num_cached_tokens``)."""

from __future__ import annotations

import argparse
import functools
import random

import pytest
import torch

from tests.engine.utils import PREFIX_BLOCK as B
from tests.engine.utils import STREAMS_CONFIG as CONFIG
from tests.engine.utils import greedy_logprobs, prefix_llm, run_greedy
from tests.models.mamba1_utils import dummy_config as mamba1_config
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.prefix_cache import hash_blocks

pytestmark = pytest.mark.timeout(900)
OTHER = [90, 2, 2, 61, 33, 7]  # an unrelated prompt: it overwrites a freed slot
LENGTHS = (1, B - 1, B, B + 1, 2 * B + 1)
# Token budgets (one sequence at a time): chunk ends fall just before, on and after the
# boundaries (upstream's block_align sweep, scaled to B = 4; 2B + 1 tokens with a budget of
# B - 1 end chunks at 3, 6, 9, with B + 1 at 4 (rounded from 5) and 9).
BUDGETS = (B - 1, B, B + 1)
# Restored tokens of a prompt's second run: the first run's align checkpoints, at every
# chunk end on the grid short of the prompt's end (a budget-cut chunk rounded down to it).
SECOND_RUN_HITS = {(B + 1, B): B, (2 * B + 1, B): 2 * B, (2 * B + 1, B + 1): B}


def prompt_of(length: int, salt: int = 0) -> list[int]:
    rng = random.Random(length * 101 + salt)
    return [10 + length] + [rng.randrange(96) for _ in range(length - 1)]


def same(out, ref) -> None:
    assert out[0] == ref[0]
    assert out[1] == pytest.approx(ref[1], rel=1e-4, abs=1e-5)


@functools.cache
def reference(device_type: str, prompt: tuple[int, ...], n: int):
    """Greedy tokens and logprobs of the engine without caching (one engine per device)."""
    return run_greedy(_off(device_type), list(prompt), n)


@functools.cache
def _off(device_type: str):
    return prefix_llm(torch.device(device_type), False, max_num_batched_tokens=16)


@pytest.mark.parametrize("budget", BUDGETS)
def test_outputs_equal_caching_off_across_chunk_ends(device, budget):
    # Align's cuts on every first run too (cold prompts), as upstream's align places them.
    on = prefix_llm(device, True, max_num_batched_tokens=budget,
                    enable_mamba_align_cold_checkpoint=True)  # fmt: skip
    index = on.llm_engine.engine_core.prefix.index
    expected_hits = 0
    for length in LENGTHS:
        prompt = prompt_of(length)
        ref = reference(device.type, tuple(prompt), 2)
        # Third run: the junction checkpoint the second run wrote covers every full block
        # short of the prompt's end (its end-of-request checkpoints are longer than it). A
        # prompt of at most B tokens can restore nothing: it runs once.
        hits = [0, SECOND_RUN_HITS.get((length, budget), 0), (length - 1) // B * B]
        for want in hits if length > B else [0]:
            out = run_greedy(on, prompt, 2)
            assert out[2] == want, f"length {length}: restored {out[2]}, expected {want}"
            same(out, ref)
        expected_hits += sum(hits)
    assert index.hits == expected_hits > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_shared_prefix_junction_is_cut_written_and_hit(device, async_scheduling):
    system = prompt_of(10, salt=1)  # the junction falls at 8, two tokens short of its end
    r1, r2, r3 = (system + q for q in ([3, 1, 4], [1, 5, 9], [2, 6, 5]))
    on = prefix_llm(device, True, max_num_batched_tokens=16, async_scheduling=async_scheduling)
    core = on.llm_engine.engine_core
    index, policy = core.prefix.index, core.prompt_checkpoints
    junction = hash_blocks(system, B)[8 // B - 1]
    out1 = run_greedy(on, r1, 2)
    assert out1[2] == 0 and policy.num_cuts == 0 and policy.num_written == 0
    assert junction not in index  # r1 wrote only its end-of-request checkpoint
    out2 = run_greedy(on, r2, 2)
    # r2 saw r1's blocks: one chunk cut at the junction (13 tokens fit the budget), written.
    assert out2[2] == 0 and policy.num_cuts == 1 and policy.num_written == 1
    assert junction in index
    run_greedy(on, OTHER, 2)
    out3 = run_greedy(on, r3, 2)
    assert out3[2] == 8 and index.hits == 8
    assert policy.num_cuts == 1  # r3 starts at the junction: nothing more to cut
    for out, prompt in ((out1, r1), (out2, r2), (out3, r3)):
        same(out, reference(device.type, tuple(prompt), 2))


def test_mamba1_restores_junction_and_end_of_request_checkpoints(device):
    """FalconMamba (Mamba1 mixers: a (d_inner, d_state) SSM state, an unchunked scan): the
    junction checkpoint of a shared prefix and a finished turn's checkpoint restore, and
    every output equals caching off."""
    model = mamba1_config("falcon_mamba", vocab_size=128)
    on = prefix_llm(device, True, model=model, max_num_batched_tokens=16)
    off = prefix_llm(device, False, model=model, max_num_batched_tokens=16)
    system = prompt_of(10, salt=3)
    r1, r2, r3 = (system + q for q in ([3, 1, 4], [1, 5, 9], [2, 6, 5]))
    outs = [run_greedy(on, r1, 2), run_greedy(on, r2, 2)]
    run_greedy(on, OTHER, 2)
    outs.append(run_greedy(on, r3, 2))
    assert outs[2][2] == 8, "the junction checkpoint did not restore"
    turn2 = r3 + outs[2][0] + [7, 7]
    outs.append(run_greedy(on, turn2, 2))
    assert outs[3][2] == len(r3) + 1, "the finished turn's checkpoint did not restore"
    for out, prompt in zip(outs, (r1, r2, r3, turn2), strict=True):
        ref = run_greedy(off, prompt, 2)
        same(out, ref)


def test_all_mode_checkpoints_every_boundary(device):
    prompt = prompt_of(13, salt=2)
    on = prefix_llm(device, True, max_num_batched_tokens=16, mamba_cache_mode="all")
    core = on.llm_engine.engine_core
    index, policy = core.prefix.index, core.prompt_checkpoints
    out1 = run_greedy(on, prompt, 2)
    # Boundaries 4, 8, 12 short of 13 tokens: three chunks cut, three checkpoints.
    assert policy.num_cuts == 3 and policy.num_written == 3
    assert all(h in index for h in hash_blocks(prompt, B))
    assert len(index) == 4  # and the end-of-request one
    run_greedy(on, OTHER, 2)
    later = prompt[: 2 * B] + [77, 78, 79]  # shares k = 2 blocks
    out2 = run_greedy(on, later, 2)
    assert out2[2] == 2 * B and index.hits == 2 * B
    same(out1, reference(device.type, tuple(prompt), 2))
    same(out2, reference(device.type, tuple(later), 2))


def test_abort_mid_prefill_writes_only_what_it_reached(device):
    prompt = prompt_of(20, salt=3)
    on = prefix_llm(device, True, max_num_batched_tokens=6, enable_mamba_align_cold_checkpoint=True)
    engine = on.llm_engine
    core = engine.engine_core
    index = core.prefix.index
    engine.add_request("a", {"prompt_token_ids": prompt}, greedy_logprobs(3))
    engine.step()  # the first chunk: 6 tokens cut by the budget, rounded to 4, written
    assert core.requests["a"].num_computed_tokens == B
    engine.abort_request("a")
    hashes = hash_blocks(prompt, B)
    assert hashes[0] in index and len(index) == 1  # nothing for blocks it never reached
    assert not engine.has_unfinished_requests()
    run_greedy(on, OTHER, 2)  # the engine keeps serving
    out = run_greedy(on, prompt, 2)
    assert out[2] == B and index.hits == B
    same(out, reference(device.type, tuple(prompt), 2))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_align_cuts_wait_for_a_warm_prompt(device, async_scheduling):
    """By default align's budget cuts checkpoint only a prompt whose first block an earlier
    prompt had: a unique prompt's first run writes nothing at its chunk ends (no line
    copy), its second run (warm) does, and the third restores from them."""
    prompt = prompt_of(2 * B + 1, salt=5)
    on = prefix_llm(device, True, max_num_batched_tokens=B, async_scheduling=async_scheduling)
    core = on.llm_engine.engine_core
    policy, index = core.prompt_checkpoints, core.prefix.index
    ref = reference(device.type, tuple(prompt), 2)
    out = run_greedy(on, prompt, 2)  # cold: chunks end at B and 2B, nothing written
    same(out, ref)
    assert out[2] == 0 and policy.num_cold == 1 and policy.num_written == 0
    assert hash_blocks(prompt, B)[0] not in index
    out = run_greedy(on, prompt, 2)  # warm: the chunk ends at B and 2B are written
    same(out, ref)
    assert out[2] == 0 and policy.num_cold == 1 and policy.num_written == 2
    out = run_greedy(on, prompt, 2)
    same(out, ref)
    assert out[2] == 2 * B and index.hits == 2 * B
    other = prompt_of(2 * B + 1, salt=6)  # another cold prompt: again nothing
    same(run_greedy(on, other, 2), reference(device.type, tuple(other), 2))
    assert policy.num_cold == 2 and policy.num_written == 2


def test_mode_flags_parse_validate_and_none_caches_nothing(device):
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(
        ["--enable-prefix-caching", "--mamba-cache-mode", "all"]
        + ["--no-enable-mamba-shared-prefix-checkpoint"]
    )
    ns.model = CONFIG
    config = EngineArgs.from_cli_args(ns).create_engine_config()
    assert config.mamba_cache_mode == "all"
    assert config.enable_mamba_shared_prefix_checkpoint is False
    default = EngineArgs(CONFIG, device="cpu", enable_prefix_caching=True)
    config = default.create_engine_config()
    assert config.mamba_cache_mode == "align" and config.enable_mamba_shared_prefix_checkpoint
    for bad in ("bogus", "ALL", None, 1):
        with pytest.raises(ValueError, match="mamba_cache_mode"):
            EngineArgs(
                CONFIG, device="cpu", enable_prefix_caching=True, mamba_cache_mode=bad
            ).create_engine_config()
    ns = parser.parse_args(["--enable-mamba-align-cold-checkpoint"])
    ns.model = CONFIG
    assert EngineArgs.from_cli_args(ns).create_engine_config().enable_mamba_align_cold_checkpoint
    assert not config.enable_mamba_align_cold_checkpoint  # the default
    with pytest.raises(ValueError, match="enable_mamba_align_cold_checkpoint"):
        args = EngineArgs(CONFIG, device="cpu", enable_mamba_align_cold_checkpoint=1)
        args.create_engine_config()
    with pytest.raises(ValueError, match="enable_mamba_shared_prefix_checkpoint"):
        EngineArgs(
            CONFIG, device="cpu", enable_mamba_shared_prefix_checkpoint="yes"
        ).create_engine_config()
    with pytest.raises(ValueError, match="mamba_cache_mode"):
        prefix_llm(device, True, mamba_cache_mode="sometimes")
    none = prefix_llm(device, True, mamba_cache_mode="none")
    assert none.llm_engine.engine_core.prefix is None
    assert none.llm_engine.startup["num_checkpoint_lines"] == 0
    prompt = prompt_of(9, salt=4)
    for _ in range(2):
        out = run_greedy(none, prompt, 2)
        assert out[2] == 0  # nothing written, nothing restored
    same(out, reference(device.type, tuple(prompt), 2))
