"""Scheduler and slot manager, without a model: a fake step advances the sequences."""

from __future__ import annotations

import random

import pytest

from tests.engine.utils import check_batch, fake_step, make_seq
from vllm.engine.prefix_cache import StatePrefixCache, hash_blocks
from vllm.engine.prefix_policy import PromptCheckpoints
from vllm.engine.scheduler import Scheduler
from vllm.engine.sequence import Sequence, SequenceStatus
from vllm.engine.state_manager import SlotManager
from vllm.sampling_params import SamplingParams


def test_slot_manager_hands_out_each_slot_once():
    slots = SlotManager(3)
    got = [slots.allocate() for _ in range(3)]
    assert sorted(got) == [1, 2, 3]  # line 0 of the state pool is the null line
    with pytest.raises(RuntimeError):
        slots.allocate()
    slots.free(got[1])
    assert slots.allocate() == got[1]
    with pytest.raises(ValueError):
        slots.free(5)


@pytest.mark.parametrize("max_seqs,budget", [(1, 1), (4, 4), (8, 37), (16, 512)])
def test_random_workload_budgets_fcfs_no_leak(max_seqs, budget):
    rng = random.Random(max_seqs * 1000 + budget)
    sched = Scheduler(max_seqs, budget)
    all_seqs: list[Sequence] = []
    admitted: list[int] = []
    next_id = 0
    steps = 0
    while next_id < 2000 or sched.has_unfinished():
        for _ in range(rng.choice([0, 0, 1, 3])):
            if next_id < 2000 and len(sched.waiting) < 20:
                seq = make_seq(next_id, rng.randint(1, 40), rng.randint(1, 12))
                sched.add(seq)
                all_seqs.append(seq)
                next_id += 1
        waiting_before = list(sched.waiting)
        running_before = list(sched.running)
        batch = fake_step(sched)
        steps += 1
        check_batch(sched, batch, running_before)
        newly = [s for s in waiting_before if s.status is not SequenceStatus.WAITING]
        assert newly == waiting_before[: len(newly)], "admission skipped the queue's head"
        admitted.extend(int(s.request_id) for s in newly)
        if sched.waiting and not newly and sched.slots.num_free == 0:
            assert len(sched.running) == max_seqs  # waits only when every slot is taken
        slots = [s.slot for s in sched.running]
        assert len(set(slots)) == len(slots) and all(1 <= s <= max_seqs for s in slots)
        assert sched.slots.num_used == len(sched.running)
        assert steps < 200_000
    assert admitted == sorted(admitted) == list(range(2000))
    assert sched.slots.num_free == max_seqs and sched.slots.num_used == 0
    assert all(s.is_finished and s.slot is None for s in all_seqs)
    assert all(len(s.output_token_ids) == s.params.max_tokens for s in all_seqs)


def test_long_prompt_is_chunked_and_decodes_come_first():
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=8)
    short = make_seq(0, 3, 5)
    sched.add(short)
    fake_step(sched)  # prefill of 3 tokens, first token sampled
    long = make_seq(1, 20, 2)
    sched.add(long)
    batch = fake_step(sched)
    assert batch.seqs == [short, long] and batch.num_tokens == [1, 7] and batch.num_decodes == 1
    batch = fake_step(sched)
    assert batch.num_tokens == [1, 7]
    batch = fake_step(sched)
    assert batch.num_tokens == [1, 6]  # last chunk ends the prompt: long samples its first token
    assert len(long.output_token_ids) == 1
    batch = fake_step(sched)
    assert batch.seqs == [short, long] and batch.num_tokens == [1, 1] and batch.num_decodes == 2


def test_request_waits_for_a_slot_and_gets_it_when_one_finishes():
    sched = Scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    a, b, c = make_seq(0, 4, 1), make_seq(1, 4, 3), make_seq(2, 4, 2)
    for s in (a, b, c):
        sched.add(s)
    batch = fake_step(sched)
    assert batch.seqs == [a, b] and list(sched.waiting) == [c]
    assert a.is_finished  # max_tokens=1: done after its prefill, slot freed at once
    batch = fake_step(sched)
    assert batch.seqs == [b, c] and batch.num_decodes == 1 and c.slot == 1  # a's slot


def test_admission_hook_restores_and_a_one_token_rest_is_a_decode_row():
    # The prefix cache's hook: a restored prompt with one token left goes to the front.
    restored = {"0": 4, "1": 2}

    def on_admit(seq):
        seq.num_computed_tokens = restored[seq.request_id]

    sched = Scheduler(2, 8, on_admit=on_admit)
    sched.add(make_seq(0, 5, 2))
    sched.add(make_seq(1, 6, 2))
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["0", "1"]
    assert batch.num_tokens == [1, 4] and batch.num_decodes == 1


@pytest.mark.parametrize("mode,budget", [("align", 3), ("align", 6), ("align", 11), ("all", 5)])
def test_prompt_checkpoints_land_on_their_boundaries(mode, budget):
    """The scheduler with the prompt-checkpoint policy, no model: a checkpoint is written
    only when its sequence has computed exactly its block's end; under ``all`` no chunk
    crosses a boundary not cached yet, and every boundary of every prompt ends up cached;
    under ``align`` the system prompt shared by every other request gets its junction."""
    rng = random.Random(budget)
    prefix = StatePrefixCache(range(10, 400), 4)
    policy = PromptCheckpoints(prefix, mode)
    sched = Scheduler(3, budget, on_admit=policy.admit, cut_chunk=policy.cut)
    writes = []
    real_write = prefix.write

    def write(key, slot):
        seq = next(s for s in sched.running if s.slot == slot)
        done = seq.num_computed_tokens
        assert done % 4 == 0 and done < seq.num_prompt_tokens
        assert key == hash_blocks(seq.prompt_token_ids, 4)[done // 4 - 1]
        written = real_write(key, slot)  # False: cached already (another sequence wrote it)
        writes.extend([key] if written else [])
        return written

    prefix.write = write
    system = [rng.randrange(50) for _ in range(10)]
    seqs = []
    for i in range(24):
        tail = [rng.randrange(50) for _ in range(rng.randint(1, 14))]
        seqs.append(
            Sequence(str(i), (system if i % 2 else []) + tail, SamplingParams(max_tokens=2))
        )
    pending = list(seqs)
    while pending or sched.has_unfinished():
        for _ in range(rng.choice([0, 1, 2])):
            if pending:
                sched.add(pending.pop(0))
        batch = sched.schedule()
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            start, prompt = seq.num_computed_tokens, seq.prompt_token_ids
            hashes = hash_blocks(prompt, 4)
            if mode == "all" and start < len(prompt):
                crossed = [b for b in range(start + 1, start + n) if b % 4 == 0]
                assert all(hashes[b // 4 - 1] in prefix.index for b in crossed)
            seq.num_computed_tokens += n
        policy.after_dispatch(batch.seqs)
        for seq in batch.seqs:
            if seq.num_computed_tokens == len(seq.token_ids):
                seq.token_ids.append(7)
                if len(seq.output_token_ids) >= 2:
                    sched.finish(seq, "length")
    assert all(s.is_finished for s in seqs) and writes and policy.num_written == len(writes)
    if mode == "all":
        for seq in seqs:
            hashes = hash_blocks(seq.prompt_token_ids, 4)
            last = (seq.num_prompt_tokens - 1) // 4  # boundaries short of the prompt's end
            assert all(hashes[b - 1] in prefix.index for b in range(1, last + 1))
    else:
        assert hash_blocks(system, 4)[1] in prefix.index  # the junction at 8
