"""``long_prefill_token_threshold`` (vLLM's ``--long-prefill-token-threshold``): a prompt
longer than N is prefilled N tokens a step beside the running decodes, the scheduler's
rules (every decode every step, FCFS, KV reservations) hold for any N, greedy outputs
equal N = 0's, and the option is checked and reaches the scheduler from every entry."""

from __future__ import annotations

import logging
import random

import pytest

from tests.engine.utils import BAMBA, check_batch, check_kv_invariants, fake_step, make_seq
from tests.models.mamba2_utils import TINY
from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.kv_cache_manager import KVCacheManager
from vllm.engine.scheduler import Scheduler
from vllm.engine.sequence import SequenceStatus
from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig

pytestmark = pytest.mark.timeout(600)

# One layer: each layer carries its own conv and SSM state from chunk to chunk, so one
# shows a chunk boundary's error as two would, at half the interpreted work per step
# (tests/models/test_mamba2_batching.py compares chunked prefills at two layers).
CONFIG = Mamba2ModelConfig(**{**TINY, "vocab_size": 128, "num_hidden_layers": 1})


# -- the scheduler ---------------------------------------------------------------------


def test_long_prompt_beside_decodes_is_chunked_at_n_per_step():
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, long_prefill_token_threshold=5)
    a, b = make_seq(0, 3, 20), make_seq(1, 4, 20)
    sched.add(a)
    sched.add(b)
    assert fake_step(sched).num_tokens == [3, 4]  # short prompts: under N, not cut
    long = make_seq(2, 23, 3)
    sched.add(long)
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        batch = fake_step(sched)
        # Both decodes run in every step, first; the long prompt gets at most N.
        assert batch.seqs[:2] == [a, b] and batch.num_tokens[:2] == [1, 1]
        assert batch.num_decodes == 2 and batch.seqs[2] is long
        chunks.append(batch.num_tokens[2])
    assert chunks == [5, 5, 5, 5, 3]  # the budget (64) would have taken all 23 at once
    assert len(long.output_token_ids) == 1  # the last chunk samples its first token
    batch = fake_step(sched)
    assert batch.seqs == [a, b, long] and batch.num_tokens == [1, 1, 1]


def test_threshold_caps_each_prompt_not_the_steps_total():
    """As in vLLM: the budget a capped prompt leaves goes to the next ones in the queue,
    first come first served."""
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=12, long_prefill_token_threshold=5)
    seqs = [make_seq(i, 9, 2) for i in range(3)]
    for s in seqs:
        sched.add(s)
    batch = fake_step(sched)
    assert batch.seqs == seqs and batch.num_tokens == [5, 5, 2]
    batch = fake_step(sched)
    assert batch.seqs == seqs and batch.num_tokens == [4, 4, 4]


def test_threshold_one_moves_a_prompt_one_token_a_step_in_the_front_rows():
    sched = Scheduler(max_num_seqs=2, max_num_batched_tokens=8, long_prefill_token_threshold=1)
    a, b = make_seq(0, 1, 9), make_seq(1, 4, 1)
    sched.add(a)
    fake_step(sched)
    sched.add(b)
    batch = fake_step(sched)
    assert batch.seqs == [a, b] and batch.num_tokens == [1, 1] and batch.num_decodes == 1
    for _ in range(3):  # b's later chunks continue its state: one-token rows at the front
        batch = fake_step(sched)
        assert batch.seqs == [a, b] and batch.num_decodes == 2
    assert b.is_finished and b.output_token_ids == [7]


@pytest.mark.parametrize("threshold", [1, 3, 16])
@pytest.mark.parametrize("with_kv", [False, True], ids=["mamba", "kv"])
def test_random_workload_rules_hold_with_a_threshold(threshold, with_kv):
    rng = random.Random(threshold * 10 + with_kv)
    kv = KVCacheManager(num_blocks=48, block_size=4) if with_kv else None
    sched = Scheduler(6, 20, kv, max_model_len=64, long_prefill_token_threshold=threshold)
    admitted, all_seqs, cut = [], [], False
    for i in range(300):
        seq = make_seq(i, rng.randint(1, 40), rng.randint(1, 8))
        sched.add(seq)
        all_seqs.append(seq)
    while sched.has_unfinished():
        waiting_before, running_before = list(sched.waiting), list(sched.running)
        batch = fake_step(sched)
        check_batch(sched, batch, running_before)
        assert all(n <= threshold for n in batch.num_tokens)
        rows = zip(batch.seqs, batch.num_tokens, strict=True)
        cut |= any(n == threshold < s.num_prompt_tokens for s, n in rows)
        newly = [s for s in waiting_before if s.status is not SequenceStatus.WAITING]
        assert newly == waiting_before[: len(newly)], "admission skipped the queue's head"
        admitted.extend(int(s.request_id) for s in newly)
        if kv is not None:
            check_kv_invariants(sched)
    assert cut and admitted == list(range(300))
    assert all(len(s.output_token_ids) == s.params.max_tokens for s in all_seqs)
    assert sched.slots.num_used == 0
    if kv is not None:
        assert kv.num_free_blocks == 48 and kv.num_reserved == 0


# -- the option ------------------------------------------------------------------------


def _config(**kwargs):
    opts = dict(load_format="dummy", device="cpu", max_num_seqs=4, max_num_batched_tokens=16)
    return EngineArgs(model=CONFIG, **{**opts, **kwargs}).create_engine_config()


def test_option_is_checked():
    assert _config().long_prefill_token_threshold == 0  # off by default, as in vLLM
    assert _config(long_prefill_token_threshold=1).long_prefill_token_threshold == 1
    with pytest.raises(ValueError, match=r"long_prefill_token_threshold must be >= 0.*-1"):
        _config(long_prefill_token_threshold=-1)
    for bad in (2.5, True, "8"):
        with pytest.raises(ValueError, match="long_prefill_token_threshold must be an integer"):
            _config(long_prefill_token_threshold=bad)
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        Scheduler(4, 16, long_prefill_token_threshold=-3)


def test_threshold_at_or_over_the_budget_is_accepted_with_a_warning(caplog):
    root = logging.getLogger("vllm")  # the project's loggers do not propagate
    root.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm"):
            assert _config(long_prefill_token_threshold=15).long_prefill_token_threshold == 15
            assert not caplog.records
            _config(long_prefill_token_threshold=16)
    finally:
        root.removeHandler(caplog.handler)
    [record] = caplog.records
    assert "long_prefill_token_threshold (16) >= max_num_batched_tokens (16)" in record.message


def test_cli_option_reads_back_as_vllm_names_it():
    import argparse

    from vllm.entrypoints.openai.api_server import make_arg_parser

    parser = make_arg_parser(argparse.ArgumentParser(), positional_model=True)
    ns = parser.parse_args(["dir", "--long-prefill-token-threshold", "256"])
    assert EngineArgs.from_cli_args(ns).long_prefill_token_threshold == 256
    assert EngineArgs.from_cli_args(parser.parse_args(["dir"])).long_prefill_token_threshold == 0


# -- the engine: greedy outputs equal N = 0's ------------------------------------------


def _generate(model, threshold: int, prompts, max_tokens: int, **opts):
    """Greedy tokens through ``LLM.generate``, and the largest prefill row of any step."""
    llm = LLM(model, long_prefill_token_threshold=threshold, **opts)
    assert llm.engine.scheduler.long_prefill_token_threshold == threshold
    executor = llm.engine.engine_core.executor
    execute, biggest = executor.execute_model, [0]

    def noting(inputs):
        biggest[0] = max(biggest[0], *inputs.lens[inputs.num_decodes :], 0)
        return execute(inputs)

    executor.execute_model = noting
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], biggest[0]


def _prompts(vocab: int, lengths) -> list[list[int]]:
    return [[(13 * i + 7 * n + 1) % vocab for i in range(n)] for n in lengths]


def test_greedy_outputs_equal_threshold_zero_mamba2():
    # 6 prompts, 3 slots: the late ones are prefilled in chunks beside running decodes.
    prompts = _prompts(128, (30, 4, 45, 9, 27, 2))
    opts = dict(load_format="dummy", dtype="float32", device="cpu", max_model_len=64)
    opts.update(max_num_seqs=3, max_num_batched_tokens=32, enforce_eager=True)
    ref, ref_biggest = _generate(CONFIG, 0, prompts, 6, **opts)
    assert ref_biggest > 7
    for threshold in (7, 1):
        got, biggest = _generate(CONFIG, threshold, prompts, 6, **opts)
        assert got == ref, f"threshold {threshold}"
        assert biggest <= threshold


def test_greedy_outputs_equal_threshold_zero_with_a_kv_cache():
    """Bamba (attention layers): the KV blocks of earlier chunks are read by later ones."""
    prompts = _prompts(128, (20, 3, 33, 11))
    opts = dict(load_format="dummy", dtype="float32", device="cpu", max_model_len=48)
    opts.update(max_num_seqs=2, max_num_batched_tokens=16, block_size=4)
    ref, _ = _generate(BAMBA, 0, prompts, 5, **opts)
    got, biggest = _generate(BAMBA, 5, prompts, 5, **opts)
    assert got == ref and biggest <= 5
