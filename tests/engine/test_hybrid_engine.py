"""The engine with a paged KV cache (hybrid models): admission against blocks, blocks taken
as tokens arrive and all given back, the canonical row order, the new options, and no
kernel compiled after start-up.
"""

from __future__ import annotations

import argparse
import random

import pytest

from tests.engine.utils import bamba_llm, check_kv_invariants
from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.kv_cache_manager import KVCacheManager
from vllm.engine.scheduler import Scheduler
from vllm.engine.sequence import Sequence
from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig
from vllm.triton_utils.launch import launch_misses


def test_kv_blocks_never_leak_over_many_requests(monkeypatch):
    """Hundreds of random requests (random lengths, EOS-free and stopped ones, aborts in
    flight) through the engine with fewer blocks than the slots could use: admission waits
    for blocks, no step runs out of them, and every block is free at the end. The engine's
    bookkeeping is what is tested, so the kernels run as their PyTorch references
    (TRITON_INTERPRET=0): the interpreter would take minutes for the same steps."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    # 24 blocks of 4 = 96 tokens: two worst cases of 48 tokens, for 6 slots.
    llm = bamba_llm(max_num_seqs=6, max_num_batched_tokens=12, block_size=4,
                    num_gpu_blocks_override=24)  # fmt: skip
    engine, rng = llm.engine, random.Random(0)
    sched, next_id, most_running = engine.scheduler, 0, 0
    while next_id < 200 or engine.has_unfinished_requests():
        for _ in range(rng.choice([0, 1, 2])):
            if next_id < 200:
                n = rng.randint(1, 30)
                params = SamplingParams(
                    temperature=rng.choice([0.0, 1.0]),
                    max_tokens=rng.choice([None, rng.randint(1, 10)]),
                    stop_token_ids=rng.choice([[], [rng.randrange(128)]]),
                    ignore_eos=True,
                )
                engine.add_request(f"r{next_id}", [rng.randrange(128) for _ in range(n)], params)
                next_id += 1
        if sched.running and rng.random() < 0.05:
            engine.abort_request(rng.choice(sched.running).request_id)
        engine.step()
        most_running = max(most_running, len(sched.running))
        check_kv_invariants(sched)
    assert most_running >= 2, "the workload never ran two sequences at once"
    assert not sched.running and not sched.waiting
    assert sched.kv.num_free_blocks == sched.kv.num_blocks and sched.kv.num_reserved == 0


def test_admission_waits_for_blocks_without_preemption():
    """Blocks for one worst case only: sequences run one at a time, all of them to the end."""
    llm = bamba_llm(max_num_seqs=4, max_num_batched_tokens=8, block_size=4,
                    max_model_len=16, num_gpu_blocks_override=4)  # fmt: skip
    sched = llm.engine.scheduler
    seen = []
    executor = llm.engine.engine_core.executor
    execute = executor.execute_model

    def noting(inputs):
        seen.append(len(sched.running))
        return execute(inputs)

    executor.execute_model = noting
    params = SamplingParams(max_tokens=None, ignore_eos=True)
    outs = llm.generate([[1, 2], [3, 4, 5], [6]], params, use_tqdm=False)
    assert [len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs] == [16] * 3
    assert max(seen) == 1
    assert sched.kv.num_free_blocks == 4


def test_scheduler_rows_in_canonical_order_and_tables_cover_tokens():
    """A one-token prefill chunk the budget cuts joins the decodes at the front; each
    row's block table covers its tokens after the step."""
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(4, 4, kv, max_model_len=40)  # 3 decodes leave one token to a chunk
    rng = random.Random(1)
    for i in range(40):
        sched.add(Sequence(str(i), [1] * rng.randint(1, 15), SamplingParams(max_tokens=5)))
    saw_cut_chunk = False
    while sched.has_unfinished():
        batch = sched.schedule()
        for k, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens, strict=True)):
            front = n == 1 and seq.num_computed_tokens > 0
            assert front == (k < batch.num_decodes)
            saw_cut_chunk |= front and seq.num_uncomputed > 1
            table = batch.block_tables[k]
            assert len(table) == kv.blocks_needed(seq.num_computed_tokens + n)
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == len(seq.token_ids):
                seq.token_ids.append(7)
                if seq.num_output_tokens >= seq.max_tokens:
                    sched.finish(seq, "length")
        check_kv_invariants(sched)
    assert saw_cut_chunk, "no one-token prefill chunk was scheduled: the test saw nothing"
    assert kv.num_free_blocks == 64 and kv.num_reserved == 0


def test_kv_cache_must_hold_one_max_len_sequence():
    with pytest.raises(ValueError, match="fewer than one sequence of max_model_len=48 needs"):
        bamba_llm(block_size=4, num_gpu_blocks_override=11)


def test_options_and_their_checks():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(
        ["--block-size", "8", "--gpu-memory-utilization", "0.5", "--num-gpu-blocks-override", "9"]
    )
    ns.model = "m"
    args = EngineArgs.from_cli_args(ns)
    assert (args.block_size, args.gpu_memory_utilization, args.num_gpu_blocks_override) == (
        8,
        0.5,
        9,
    )
    defaults = EngineArgs(model="m")
    assert (defaults.block_size, defaults.gpu_memory_utilization) == (16, 0.9)
    assert defaults.num_gpu_blocks_override is None
    for bad, match in [
        (dict(block_size=0), "block_size must be >= 1"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization must be in"),
        (dict(num_gpu_blocks_override=0), "num_gpu_blocks_override must be a positive"),
    ]:
        with pytest.raises(ValueError, match=match):
            bamba_llm(**bad)


def test_pure_mamba2_has_no_kv_cache():
    cfg = Mamba2ModelConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=4,
                            head_dim=16, state_size=8, n_groups=1, chunk_size=8)  # fmt: skip
    llm = LLM(cfg, load_format="dummy", device="cpu", max_num_seqs=2, gpu_memory_utilization=0.1)
    assert llm.engine.scheduler.kv is None and llm.engine.runner.attn_builder is None
    assert llm.engine.runner.startup["num_kv_blocks"] == 0
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 2


def test_no_launch_miss_after_startup(device):
    """The hybrid's start-up compiles (registers) every attention, conv, scan and norm
    variant a step can pick: a mixed random workload launches none for the first time."""
    llm = bamba_llm(device=device.type, max_num_seqs=3, max_num_batched_tokens=9, block_size=4)
    before = launch_misses()
    rng = random.Random(2)
    prompts = [[rng.randrange(128) for _ in range(rng.randint(1, 20))] for _ in range(5)]
    params = [SamplingParams(max_tokens=rng.randint(1, 4), ignore_eos=True) for _ in prompts]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    assert launch_misses() == before, "a kernel variant was first launched after start-up"
