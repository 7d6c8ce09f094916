"""What the engine's test modules share: the AsyncLLM streams' model and helpers, the async
scheduling comparison's model and workload, the hybrid (Bamba) engine and its KV-cache
invariants, and the scheduler's fake step and batch rules."""

from __future__ import annotations

import asyncio
import random

import torch

from tests.models.mamba2_utils import TINY
from vllm import LLM, SamplingParams
from vllm.engine.async_llm import AsyncLLM
from vllm.engine.scheduler import Scheduler
from vllm.engine.sequence import Sequence
from vllm.engine.stats import StatLoggerBase
from vllm.model_executor.models.bamba_config import BambaModelConfig
from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig
from vllm.sampling_params import RequestOutputKind

# AsyncLLM's streams (test_async_llm.py, test_core_proc.py). One layer: the streams, aborts
# and failures are the engine's (each compared with an offline run of the same model); a
# second layer doubles every interpreted step.
STREAMS_CONFIG = Mamba2ModelConfig(**{**TINY, "vocab_size": 128, "num_hidden_layers": 1})
STREAMS_OPTS = dict(
    load_format="dummy",
    dtype="float32",
    device="cuda" if torch.cuda.is_available() else "cpu",
    max_num_seqs=4,
    max_num_batched_tokens=16,
    max_model_len=64,
)
DELTA = RequestOutputKind.DELTA


def delta(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, output_kind=DELTA, **kw)


async def collect(engine: AsyncLLM, rid: str, prompt, params, stop_after=None) -> list[int]:
    toks: list[int] = []
    gen = engine.generate(prompt, params, rid)
    async for out in gen:
        toks += out.outputs[0].token_ids
        if stop_after is not None and len(toks) >= stop_after:
            await gen.aclose()
            break
    return toks


def run_coro(coro):
    return asyncio.run(coro)


class Records(StatLoggerBase):
    def __init__(self):
        self.records = []

    def record(self, stats):
        self.records.append(stats)


# Async scheduling (test_async_scheduling.py, test_replayssm_engine.py, the prefix cache's
# and the mixed graphs' engine tests). The shared tiny shape (four heads of 16) in two
# groups, so that per-group B and C rows differ from the heads' x and dt; one layer, as what
# is compared is the engine's handling of the steps (tokens in flight, stops), which a
# second layer leaves as it is while doubling the cost of every step under the interpreter
# (as would more heads: the kernels run a program per head, each interpreted on the CPU).
ASYNC_SCHED_CONFIG = Mamba2ModelConfig(
    **{**TINY, "vocab_size": 128, "num_hidden_layers": 1, "state_size": 16, "n_groups": 2}
)


def workload(seed: int, max_prompt_len: int = 30):
    rng = random.Random(seed)
    prompts = [[rng.randrange(96) for _ in range(rng.randint(1, max_prompt_len))] for _ in range(9)]
    params = []
    for i in range(9):
        seeded = i % 3 == 0
        params.append(
            SamplingParams(
                temperature=0.9 if seeded else 0.0,
                seed=100 + i if seeded else None,
                max_tokens=rng.randint(1, 12),
            )
        )
    return prompts, params


def generate_outcomes(llm: LLM, prompts, params, eos=None, stops=None):
    """Each request's (token ids, text, finish reason), under ``eos`` and ``stops``."""
    llm.engine.tokenizer.eos_token_id = eos
    params = [
        SamplingParams(temperature=p.temperature, seed=p.seed, max_tokens=p.max_tokens, stop=stops)
        for p in params
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


# The hybrid engine (test_hybrid_engine.py, test_long_prefill.py, test_replayssm_engine.py).
BAMBA = BambaModelConfig(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    attn_layer_indices=(1,),
    num_attention_heads=4,
    num_key_value_heads=2,
    mamba_n_heads=4,
    mamba_d_head=16,
    mamba_d_state=8,
    mamba_chunk_size=8,
    max_position_embeddings=128,
)


def bamba_llm(**kwargs) -> LLM:
    options = dict(load_format="dummy", device="cpu", dtype="float32", max_model_len=48)
    return LLM(BAMBA, **{**options, **kwargs})


def check_kv_invariants(sched: Scheduler) -> None:
    kv = sched.kv
    held = sum(len(kv.block_table(s.request_id)) for s in sched.running)
    assert kv.num_free_blocks + held == kv.num_blocks, "a block is lost or held twice"
    assert 0 <= kv.num_reserved <= kv.num_free_blocks
    for seq in sched.running:
        table = kv.block_table(seq.request_id)
        assert len(table) >= kv.blocks_needed(seq.num_computed_tokens)
        assert len(table) <= kv.blocks_needed(sched.worst_case_tokens(seq))
    for seq in sched.waiting:
        assert seq.request_id not in kv


# The scheduler without a model (test_scheduler.py, test_long_prefill.py).
def make_seq(i: int, prompt_len: int, max_tokens: int) -> Sequence:
    return Sequence(str(i), [1] * prompt_len, SamplingParams(max_tokens=max_tokens), arrival=i)


def fake_step(sched: Scheduler):
    """One step as the engine runs it, with token 7 sampled for every finished chunk."""
    batch = sched.schedule()
    for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == len(seq.token_ids):
            seq.token_ids.append(7)
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                sched.finish(seq, "length")
    return batch


def check_batch(sched: Scheduler, batch, running_before: list[Sequence]) -> None:
    assert batch.total_tokens <= sched.max_num_batched_tokens
    assert len(batch) <= sched.max_num_seqs
    assert len({s.request_id for s in batch.seqs}) == len(batch), "a sequence twice in a step"
    assert all(n >= 1 for n in batch.num_tokens)
    # decodes first, and exactly the first num_decodes rows are one-token decodes
    assert all(n == 1 for n in batch.num_tokens[: batch.num_decodes])
    # preemption-free: every sequence running before the step is in the step
    assert {s.request_id for s in running_before} <= {s.request_id for s in batch.seqs}


# Prefix caching of Mamba states in the engine (test_prefix_cache_prompt.py): the streams'
# one-layer shape (four heads: the cheapest under the interpreter), tiny Mamba blocks,
# greedy tokens with their logprobs.
PREFIX_BLOCK = 4


def prefix_llm(device, cache: bool, model=STREAMS_CONFIG, **kw) -> LLM:
    """The tiny Mamba2 engine (or ``model``) with caching on or off (fp32 state); ``kw``
    overrides."""
    options = dict(
        load_format="dummy",
        dtype="float32",
        device=device.type,
        max_num_seqs=2,
        max_num_batched_tokens=6,
        async_scheduling=False,
        enable_prefix_caching=cache,
        mamba_block_size=PREFIX_BLOCK,
        num_checkpoint_lines=32,  # no eviction in these tests
    )
    return LLM(model, **{**options, **kw})


def greedy_logprobs(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1)


def run_greedy(llm: LLM, prompt: list[int], n: int):
    """(greedy tokens, their logprobs, the prompt tokens the request reports restored)."""
    req = llm.generate([{"prompt_token_ids": prompt}], greedy_logprobs(n), use_tqdm=False)[0]
    out = req.outputs[0]
    lps = [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs, strict=True)]
    return list(out.token_ids), lps, req.num_cached_tokens


def recording(llm) -> list:
    """Every step's StepInputs that ``llm``'s executor runs from now on (the list grows)."""
    executor = llm.llm_engine.engine_core.executor
    execute, seen = executor.execute_model, []

    def record(inputs):
        seen.append(inputs)
        return execute(inputs)

    executor.execute_model = record
    return seen
