"""Penalties, min_tokens and logit_bias through the engine (LLM.generate, CPU), against
independent references:

- repetition_penalty and min_tokens against HF transformers' own ``generate``
  (``repetition_penalty``; ``min_new_tokens`` with the stop token as its EOS) on the same
  tiny Bamba checkpoint: greedy tokens equal;
- presence and frequency penalties (no HF equivalent) against the model's own top-20
  log-probabilities, which the engine returns unprocessed: each greedy token is the
  argmax of (logprob - frequency x count - presence) over them, under async scheduling
  (the newest token's count kept on the device) and without it;
- logit_bias: a biased token wins or never shows, and an out-of-vocabulary id is refused
  by name. Prompts go through chunked prefill beside decodes (a 16-token budget)."""

from __future__ import annotations

import pytest
import torch

from tests.models.hf_builders import make_bamba_hf
from tests.models.hybrid_utils import FEW_LAYERS, engine, hf_greedy, save_checkpoint, tokens
from vllm import SamplingParams

PROMPTS = [tokens(n, "pen", n) for n in (3, 21, 9)]


@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    # Two layers (a Mamba2 and an attention one): the penalties are the sampler's, after
    # the model; a deeper checkpoint adds interpreted work to every step and no check.
    hf = make_bamba_hf(seed=3, **FEW_LAYERS["bamba"])
    return hf, save_checkpoint(hf, tmp_path_factory.mktemp("bamba"))


@pytest.fixture(scope="module")
def llm(bamba):
    """One engine (default options: async scheduling) for the tests that generate on it:
    each generate's requests are independent of those before, and the engine's start-up
    (its warm-up) is paid once."""
    return engine(bamba[1])


def test_repetition_penalty_equals_hf(bamba, llm):
    hf, _ = bamba
    for penalty in (1.6, 0.6):
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                repetition_penalty=penalty)  # fmt: skip
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        for prompt, out in zip(PROMPTS, outs, strict=True):
            want = hf_greedy(hf, prompt, 10, repetition_penalty=penalty)
            assert out.outputs[0].token_ids == want, (penalty, len(prompt))
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10,
                         ignore_eos=True), use_tqdm=False)  # fmt: skip
    assert [o.outputs[0].token_ids for o in plain] != [o.outputs[0].token_ids for o in outs]


def test_min_tokens_holds_a_stop_token_back_as_hf_does(bamba, llm):
    """The stop token is the plain run's second token: with min_tokens 4 it cannot come
    before the 5th token; HF's min_new_tokens does the same with it as EOS."""
    hf, _ = bamba
    # Every prompt in one batch (as test_repetition_penalty_equals_hf's, equal to HF's).
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=2,
                         ignore_eos=True), use_tqdm=False)  # fmt: skip
    stops = [out.outputs[0].token_ids[1] for out in plain]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                             stop_token_ids=[stop], min_tokens=4) for stop in stops]  # fmt: skip
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, stop, out in zip(PROMPTS, stops, outs, strict=True):
        got = out.outputs[0].token_ids
        assert stop not in got[:4]
        assert got == hf_greedy(hf, prompt, 12, eos_token_id=stop, min_new_tokens=4)


def _check_presence_and_frequency(llm) -> None:
    pres, freq = 0.7, 0.9
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=20,
                            presence_penalty=pres, frequency_penalty=freq)  # fmt: skip
    plain = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        got = out.outputs[0]
        for i, (token, top) in enumerate(zip(got.token_ids, got.logprobs, strict=True)):
            before = got.token_ids[:i]
            score = {t: lp.logprob - freq * before.count(t) - pres * (t in before)
                     for t, lp in top.items()}  # fmt: skip
            assert token == max(score, key=score.get), (len(prompt), i)
    # The plain runs in one batch (one generate, not one per prompt: the same greedy tokens).
    base = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, plain, use_tqdm=False)]
    assert base != [o.outputs[0].token_ids for o in outs], (
        "the penalties changed no output: the test proves nothing"
    )


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_presence_and_frequency_penalties_follow_the_raw_logprobs(bamba, llm, async_scheduling):
    assert llm.engine.config.async_scheduling  # the shared engine is the async one
    _check_presence_and_frequency(
        llm if async_scheduling else engine(bamba[1], async_scheduling=False)
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; runs on the GPU box")
def test_penalties_on_the_gpu(bamba):
    """The device-side counts on CUDA under async scheduling (pinned uploads, stream
    order): the same checks as on the CPU, and a bias and min_tokens."""
    llm = engine(bamba[1], "cuda", async_scheduling=True)
    _check_presence_and_frequency(llm)
    up = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logit_bias={77: 100})
    assert llm.generate([PROMPTS[0]], up, use_tqdm=False)[0].outputs[0].token_ids == [77] * 5
    stop = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=3,
                        ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids[1]  # fmt: skip
    held = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop],
                          min_tokens=4)  # fmt: skip
    assert stop not in llm.generate([PROMPTS[0]], held, use_tqdm=False)[0].outputs[0].token_ids[:4]


def test_logit_bias_wins_or_forbids_and_names_a_bad_id(llm):
    prompt = PROMPTS[1]
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    base = llm.generate([prompt], plain, use_tqdm=False)[0].outputs[0].token_ids
    up = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={77: 100})
    assert llm.generate([prompt], up, use_tqdm=False)[0].outputs[0].token_ids == [77] * 6
    down = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                          logit_bias={base[0]: -100})  # fmt: skip
    assert base[0] not in llm.generate([prompt], down, use_tqdm=False)[0].outputs[0].token_ids
    vocab = llm.llm_engine.processor.vocab_size
    bad = SamplingParams(max_tokens=2, logit_bias={vocab: 1.0})
    with pytest.raises(ValueError, match=rf"logit_bias token id {vocab} is outside the vocab"):
        llm.generate([prompt], bad, use_tqdm=False)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty must be finite"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
        (dict(min_tokens=-1), "min_tokens must be an integer >= 0"),
        (dict(min_tokens=5, max_tokens=4), r"min_tokens \(5\) must be at most max_tokens \(4\)"),
        (dict(logit_bias={3: 101.0}), r"logit_bias\[3\] must be in \[-100, 100\]"),
        (dict(logit_bias={"3": 1.0}), "logit_bias keys must be token ids"),
        (dict(logit_bias=[3]), "logit_bias must be a dict"),
    ],
)
def test_bad_values_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_a_child_keeps_every_field():
    p = SamplingParams(n=3, seed=7, presence_penalty=0.5, repetition_penalty=1.2,
                       min_tokens=2, logit_bias={4: 2.0}, stop=["x"])  # fmt: skip
    c = p.child(2)
    assert (c.n, c.seed, c.presence_penalty, c.repetition_penalty) == (1, 9, 0.5, 1.2)
    assert (c.min_tokens, c.logit_bias, c.stop_strings) == (2, {4: 2.0}, ["x"])
