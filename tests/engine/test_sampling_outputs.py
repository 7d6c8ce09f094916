"""What a request can ask for beyond tokens: logprobs, prompt logprobs, n samples, stop
strings while streaming, and the max_model_len bound."""

from __future__ import annotations

import math

import pytest
import torch

from tests.models.mamba2_utils import TINY
from vllm import LLM, SamplingParams
from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig
from vllm.sampling_params import RequestOutputKind

pytestmark = pytest.mark.timeout(600)

CONFIG = Mamba2ModelConfig(**{**TINY, "vocab_size": 128})
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Same model read two ways (decode steps vs one prefill): fp32, only reassociation differs.
LOGPROB_ATOL = 1e-4


def make_llm(**kwargs) -> LLM:
    opts = dict(
        load_format="dummy",
        dtype="float32",
        device=DEVICE,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=64,
    )
    return LLM(CONFIG, **{**opts, **kwargs})


@pytest.fixture(scope="module")
def llm():
    return make_llm()


def test_logprobs_of_sampled_tokens_equal_prompt_logprobs_of_the_same_text(llm):
    prompt = [5, 17, 33, 2, 90]
    out = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=6, logprobs=3), use_tqdm=False
    )[0].outputs[0]
    assert len(out.logprobs) == 6
    for tok, lps in zip(out.token_ids, out.logprobs, strict=True):
        assert lps[tok].rank == 1  # greedy: the sampled token is the most likely
        assert 3 <= len(lps) <= 4
        ranked = sorted((lp.rank, lp.logprob) for lp in lps.values())
        assert [r for r, _ in ranked] == list(range(1, len(ranked) + 1))
        values = [v for _, v in ranked]
        assert values == sorted(values, reverse=True) and values[0] <= 0.0
        assert lps[tok].decoded_token == llm.get_tokenizer().decode([tok])
    total = sum(lps[t].logprob for t, lps in zip(out.token_ids, out.logprobs, strict=True))
    assert math.isclose(out.cumulative_logprob, total, abs_tol=1e-5)

    # The same text as a prompt: its prompt logprobs are the sampled tokens' logprobs.
    text = prompt + out.token_ids
    res = llm.generate([text], SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
    assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == len(text)
    for pos, tok in enumerate(text[1:], 1):
        assert tok in res.prompt_logprobs[pos]
    for i, (tok, lps) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        got = res.prompt_logprobs[len(prompt) + i]
        assert got[tok].rank == lps[tok].rank
        assert abs(got[tok].logprob - lps[tok].logprob) < LOGPROB_ATOL
        assert set(got) == set(lps)


def test_prompt_logprobs_of_a_chunked_prefill_equal_one_prefill(llm):
    prompt = [(7 * i + 3) % 128 for i in range(40)]
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2)
    whole = llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    chunked_llm = make_llm(max_num_batched_tokens=8)
    chunked = chunked_llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    assert len(whole) == len(chunked) == len(prompt)
    for a, b in zip(whole[1:], chunked[1:], strict=True):
        assert set(a) == set(b)
        for t in a:
            assert abs(a[t].logprob - b[t].logprob) < LOGPROB_ATOL


def test_n_samples_equal_single_requests_with_their_seeds(llm):
    prompt = [3, 4, 5, 6]
    params = SamplingParams(n=3, temperature=1.0, seed=41, max_tokens=5, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for i, c in enumerate(out.outputs):
        one = SamplingParams(temperature=1.0, seed=41 + i, max_tokens=5, ignore_eos=True)
        assert c.token_ids == llm.generate([prompt], one, use_tqdm=False)[0].outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_n_samples_stream_as_deltas_per_index(llm):
    engine = llm.engine
    params = SamplingParams(
        n=2, temperature=1.0, seed=5, max_tokens=6, output_kind=RequestOutputKind.DELTA
    )
    engine.add_request("par", [9, 8, 7], params)
    got: dict[int, list[int]] = {0: [], 1: []}
    finished = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                got[c.index] += c.token_ids
            finished.append(out.finished)
    assert finished[-1] and not any(finished[:-1])
    final = llm.generate([[9, 8, 7]], SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=6))
    assert [got[0], got[1]] == [c.token_ids for c in final[0].outputs]


def test_streamed_text_never_shows_a_stop_string(llm):
    prompt = [40, 41, 42]
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)
    text = free[0].outputs[0].text
    stop = text[6:9]
    assert len(stop) == 3 and text.find(stop) == 6, text
    engine = llm.engine
    params = SamplingParams(
        temperature=0.0, max_tokens=20, stop=stop, output_kind=RequestOutputKind.DELTA
    )
    engine.add_request("stream-stop", prompt, params)
    pieces, reason = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append(out.outputs[0].text)
            reason = out.outputs[0].finish_reason, out.outputs[0].stop_reason
            assert stop not in "".join(pieces)
    assert "".join(pieces) == text[:6]
    assert reason == ("stop", stop)


def test_stop_strings_wait_for_min_tokens(llm):
    """A stop string in the first token's text ends the output at once; with min_tokens 4
    it is not looked for until more than 4 tokens are out (vLLM's rule)."""
    prompt = [40, 41, 42]
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    stop = free[0].outputs[0].text[:1]
    early = SamplingParams(temperature=0.0, max_tokens=12, stop=stop)
    out = llm.generate([prompt], early, use_tqdm=False)[0].outputs[0]
    assert (len(out.token_ids), out.text, out.finish_reason) == (1, "", "stop")
    held = SamplingParams(temperature=0.0, max_tokens=12, stop=stop, min_tokens=4)
    out = llm.generate([prompt], held, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) > 4 and out.token_ids[:5] == free[0].outputs[0].token_ids[:5]


def test_generation_ends_at_max_model_len(llm):
    prompt = [1] * 60
    out = llm.generate([prompt], SamplingParams(max_tokens=None, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4  # 64 - 60
    assert out[0].outputs[0].finish_reason == "length"
    capped = llm.generate([prompt], SamplingParams(max_tokens=50), use_tqdm=False)
    assert len(capped[0].outputs[0].token_ids) == 4
