"""``max_mixed_step_ratio`` (``vllm/engine/step_budget.py``): each prompt's chunk beside D
decodes is cut from the fitted step times so that a step with one chunk takes about R
times a decode-only step; the fits (``StepTimes``), the scheduler's use of the cap, the
option's checks, and greedy outputs equal to the uncapped engine's with the cap seen
cutting."""

from __future__ import annotations

import argparse
import random

import pytest

from tests.engine.utils import check_batch, fake_step, make_seq
from tests.models.mamba2_utils import TINY
from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.scheduler import Scheduler
from vllm.engine.step_budget import MIN_DECODE_STEPS, MixedStepBudget, StepTimes
from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig

pytestmark = pytest.mark.timeout(600)

CONFIG = Mamba2ModelConfig(**{**TINY, "vocab_size": 128, "num_hidden_layers": 1})

# A step-time law for the fits: decode-only a + b D; a mixed step adds m + c P.
A, B, M, C = 6e-3, 2e-5, 1.5e-3, 2e-5


def _decode_time(d: int) -> float:
    return A + B * d


def _mixed_time(d: int, p: int) -> float:
    return _decode_time(d) + M + C * p


def _budget(ratio: float, max_tokens: int) -> MixedStepBudget:
    return MixedStepBudget(ratio, max_tokens, StepTimes())


# -- the fits --------------------------------------------------------------------------


def test_no_cap_before_both_fits_have_steps_or_without_decodes():
    budget = _budget(2.0, 2048)
    assert budget.prefill_cap(10) is None
    for _ in range(MIN_DECODE_STEPS + 1):
        budget.times.observe(10, 0, _decode_time(10))
    assert budget.prefill_cap(10) is None  # no mixed step measured yet
    budget.times.observe(10, 500, _mixed_time(10, 500))
    budget.times.observe(10, 700, _mixed_time(10, 700))
    assert budget.prefill_cap(10) is not None
    assert budget.prefill_cap(0) is None  # no stream waits on a step without decodes
    budget.times.observe(10, 500, None)  # unmeasured steps and steps without decodes are skipped
    budget.times.observe(0, 500, 1.0)
    assert budget.times.mixed.n == 2


def test_prompt_tokens_that_cost_nothing_are_not_capped():
    budget = _budget(2.0, 2048)
    for _ in range(8):
        budget.times.observe(10, 0, 0.01)
    for p in (300, 900):
        budget.times.observe(10, p, 0.009)  # measured faster than the decode step: noise
    assert budget.prefill_cap(10) is None


@pytest.mark.parametrize("ratio", [1.5, 2.0, 2.5])
def test_cap_settles_where_capped_steps_take_ratio_times_the_decode_step(ratio):
    """Closed loop: a load of 8-12 decodes and prompts of 50-3,000 tokens, each mixed step
    given min(prompt, cap); the through-origin fit of c must bring the cap to where a step
    at the cap takes ``ratio`` x t_dec(D), whatever the fixed cost M it cannot see."""
    rng = random.Random(int(ratio * 10))
    budget = _budget(ratio, 1024)
    capped = 0
    for step in range(3000):
        d = rng.randint(8, 12)
        if step % 4:
            budget.times.observe(d, 0, _decode_time(d))
            continue
        want = rng.randint(50, 3000)
        cap = budget.prefill_cap(d)
        p = want if cap is None else min(want, cap)
        capped += cap is not None and p < want
        budget.times.observe(d, p, _mixed_time(d, p))
    assert capped > 300
    for d in (8, 10, 12):
        exact = ((ratio - 1) * _decode_time(d) - M) / C
        assert budget.prefill_cap(d) == pytest.approx(exact, rel=0.08), d


def test_cap_follows_the_decode_count():
    """A saturated server (long decode steps) gets a looser cap than a quiet one."""
    budget = _budget(2.0, 1024)
    for d in (4, 64, 256) * 10:
        budget.times.observe(d, 0, _decode_time(d))
    for d, p in ((4, 800), (64, 900), (256, 700)):
        budget.times.observe(d, p, _mixed_time(d, p))
    assert budget.prefill_cap(4) < budget.prefill_cap(64) < budget.prefill_cap(256)


def test_cap_is_never_under_a_sixteenth_of_the_step_budget():
    budget = _budget(1.0, 2048)  # R = 1: no room at all, so always the floor
    for _ in range(8):
        budget.times.observe(10, 0, _decode_time(10))
    for p in (100, 2000):
        budget.times.observe(10, p, _mixed_time(10, p))
    assert budget.prefill_cap(10) == 128 == budget.min_tokens


def test_step_times_take_device_spans_else_host_times():
    from vllm.engine.core import _Dispatched
    from vllm.step_io import StepOutput

    times = StepTimes()
    step = _Dispatched([], [], [], handle=None, num_decode_tokens=3, host_s=5.0)
    times.observe_step(step, StepOutput([], device_s=0.01))
    assert times.on_device is True and times.decode.y == pytest.approx(0.01)
    times.observe_step(step, StepOutput([], device_s=0.02, kernel_compiles=1))
    assert times.decode.n == 1  # a step that compiled a kernel is not fitted
    times.observe_step(step, StepOutput([]))  # no CUDA events: the dispatch's host time
    assert times.on_device is False and times.decode.n == 2
    assert times.decode.y == pytest.approx(0.99 * 0.01 + 5.0)


def test_step_time_uses_the_mixed_line_where_p_varied():
    times = StepTimes()
    for d in (8, 12) * 4:
        times.observe(d, 0, _decode_time(d))
    assert times.step_time(10, 0) == pytest.approx(_decode_time(10))
    assert times.step_time(0, 0) is None and times.step_time(10, 50) is None
    for p in (200, 900):
        times.observe(10, p, _mixed_time(10, p))
    assert times.step_time(10, 500) == pytest.approx(_mixed_time(10, 500))  # the line
    same = StepTimes()
    for d in (8, 12) * 4:
        same.observe(d, 0, _decode_time(d))
    for _ in range(3):
        same.observe(10, 400, _mixed_time(10, 400))
    # P never varied: c through the origin, exact at the P fitted.
    assert same.step_time(10, 400) == pytest.approx(_mixed_time(10, 400))
    assert same.step_time(10, 800) > _mixed_time(10, 800)  # the fixed cost counted twice


def test_prompt_tokens_that_cost_nothing_add_nothing():
    """A small model's mixed steps measured no slower than its decode steps (c <= 0): a
    step with prompt tokens is then expected to take a decode step's time (late dispatch
    still waits beside it), and the cap stays off."""
    times = StepTimes()
    for d in (8, 12) * 4:
        times.observe(d, 0, _decode_time(d))
    times.observe(10, 300, _decode_time(10) - 1e-4)
    assert times.step_time(10, 300) is None  # one mixed step fitted: too few
    times.observe(10, 600, _decode_time(10) - 2e-4)
    assert times.mixed.through_origin() < 0 and times.per_token() is None
    assert times.step_time(10, 300) == pytest.approx(_decode_time(10))
    budget = MixedStepBudget(2.0, 2048, times)
    assert budget.prefill_cap(10) is None


# -- the scheduler ---------------------------------------------------------------------


def _floor_budget(max_tokens: int) -> MixedStepBudget:
    """A budget whose cap is its floor from now on (R = 1, fits filled)."""
    budget = _budget(1.0, max_tokens)
    for _ in range(8):
        budget.times.observe(2, 0, _decode_time(2))
    for p in (5, 9):
        budget.times.observe(2, p, _mixed_time(2, p))
    return budget


def test_scheduler_cuts_each_prompts_chunk_beside_decodes_only():
    budget = _floor_budget(128)  # floor 8
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=128, step_budget=budget)
    a, b = make_seq(0, 30, 20), make_seq(1, 20, 20)
    sched.add(a)
    sched.add(b)
    first = fake_step(sched)
    assert first.num_tokens == [30, 20] and not first.prefill_capped  # no decodes: no cap
    long, short = make_seq(2, 19, 3), make_seq(3, 2, 3)
    sched.add(long)
    sched.add(short)
    batch = fake_step(sched)
    # Each prompt cut at 8 (FCFS); the budget the long one leaves goes to the short one,
    # which does not wait behind it.
    assert batch.seqs == [a, b, long, short] and batch.num_tokens == [1, 1, 8, 2]
    assert batch.prefill_capped
    chunks, flags = [8], [True]
    while long.num_computed_tokens < long.num_prompt_tokens:
        batch = fake_step(sched)
        assert batch.seqs[:2] == [a, b] and batch.num_decodes >= 3  # the short one decodes
        flags.append(batch.prefill_capped)
        chunks.append(batch.num_tokens[batch.seqs.index(long)])
    assert chunks == [8, 8, 3]
    assert flags == [True, True, False]  # the last chunk: nothing cut


def test_random_workload_rules_hold_with_the_cap():
    rng = random.Random(5)
    budget = _floor_budget(80)
    sched = Scheduler(6, 80, max_model_len=64, step_budget=budget)
    seqs = [make_seq(i, rng.randint(1, 40), rng.randint(1, 8)) for i in range(200)]
    for s in seqs:
        sched.add(s)
    capped = 0
    while sched.has_unfinished():
        running_before = list(sched.running)
        batch = fake_step(sched)
        check_batch(sched, batch, running_before)
        if batch.num_decodes:
            assert all(n <= budget.min_tokens for n in batch.num_tokens)
        capped += batch.prefill_capped
    assert capped > 20
    assert all(len(s.output_token_ids) == s.params.max_tokens for s in seqs)


# -- the option ------------------------------------------------------------------------


def _config(**kwargs):
    opts = dict(load_format="dummy", device="cpu", max_num_seqs=4, max_num_batched_tokens=16)
    return EngineArgs(model=CONFIG, **{**opts, **kwargs}).create_engine_config()


def test_option_is_checked():
    assert _config().max_mixed_step_ratio == 0.0  # off by default
    assert _config(max_mixed_step_ratio=2).max_mixed_step_ratio == 2.0
    for bad in (-1, 0.5, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="max_mixed_step_ratio must be"):
            _config(max_mixed_step_ratio=bad)
    for bad in (True, "2"):
        with pytest.raises(ValueError, match="max_mixed_step_ratio must be a number"):
            _config(max_mixed_step_ratio=bad)


def test_cli_option():
    from vllm.entrypoints.openai.api_server import make_arg_parser

    parser = make_arg_parser(argparse.ArgumentParser(), positional_model=True)
    ns = parser.parse_args(["dir", "--max-mixed-step-ratio", "2.5"])
    assert EngineArgs.from_cli_args(ns).max_mixed_step_ratio == 2.5
    assert EngineArgs.from_cli_args(parser.parse_args(["dir"])).max_mixed_step_ratio == 0.0


# -- the engine ------------------------------------------------------------------------


def _generate(ratio: float, prompts, params):
    """Greedy tokens through ``LLM.generate``, the engine's budget (None when off), the
    steps the cap cut, and the largest prompt chunk of a step with decodes once the cap was
    on."""
    opts = dict(load_format="dummy", dtype="float32", device="cpu", max_model_len=96)
    opts.update(max_num_seqs=3, max_num_batched_tokens=64, enforce_eager=True)
    llm = LLM(CONFIG, max_mixed_step_ratio=ratio, **opts)
    core = llm.engine.engine_core
    budget = core.step_budget
    assert (budget is None) == (ratio == 0) and core.scheduler.step_budget is budget
    executor = core.executor
    execute, biggest = executor.execute_model, [0]

    def noting(inputs):
        if budget is not None and budget.prefill_cap(inputs.num_decodes) is not None:
            biggest[0] = max(biggest[0], *inputs.lens[inputs.num_decodes :], 0)
        return execute(inputs)

    executor.execute_model = noting
    outs = llm.generate(prompts, params, use_tqdm=False)
    capped = llm.engine.step_totals.capped_steps  # the steps whose batch the cap cut
    return [o.outputs[0].token_ids for o in outs], budget, capped, biggest[0]


def test_greedy_outputs_equal_the_uncapped_engine():
    """Three slots, staggered max_tokens: the first requests decode alone for a while
    (the decode fit), then the later prompts (40-60 tokens) are prefilled beside them;
    with R = 1 every cap is the floor (4 tokens a step), so the prompts go on in small
    chunks whose states carry over: the tokens must not change."""
    prompts = [[(13 * i + 7 * n + 1) % 128 for i in range(n)] for n in (6, 9, 5, 60, 41, 52)]
    lens = (12, 16, 20, 6, 6, 6)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
    ref, _, uncut, _ = _generate(0.0, prompts, params)
    got, budget, capped, biggest = _generate(1.0, prompts, params)
    assert uncut == 0
    assert got == ref
    assert capped > 0, "the cap never cut a step (StepTotals.capped_steps)"
    assert 0 < biggest <= budget.min_tokens == 4
