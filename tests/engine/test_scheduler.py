"""Scheduler and slot manager, without a model: a fake step advances the sequences."""

from __future__ import annotations

import random

import pytest

from tests.engine.utils import check_batch, fake_step, make_seq
from vllm.engine.scheduler import Scheduler
from vllm.engine.sequence import Sequence, SequenceStatus
from vllm.engine.state_manager import SlotManager


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
