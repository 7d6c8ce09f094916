"""The engine end to end on CPU with a tiny HF-made model (kernels under the interpreter).

The model directory has no tokenizer files, so the engine uses the byte-level fallback:
prompts are token ids, and each id < 96 decodes to one ASCII character.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.models.mamba2_utils import (
    assert_close,
    gen_for,
    hf_config,
    hf_oracle_groups,
    hf_prefill_then_decode,
    make_hf_model,
)
from vllm import LLM, SamplingParams
from vllm.worker.sampler import Sampler

# A broken engine could loop forever: fail instead.
pytestmark = pytest.mark.timeout(300)

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_and_dir(tmp_path_factory):
    hf = make_hf_model(hf_config(n_groups=hf_oracle_groups()), seed=5)
    path = tmp_path_factory.mktemp("mamba2_engine")
    hf.save_pretrained(path)
    return hf, path


@pytest.fixture(scope="module")
def llm(hf_and_dir):
    # 6 tokens a step: the 9-token prompt below is prefilled in chunks next to decodes.
    return LLM(
        hf_and_dir[1], dtype="float32", device="cpu", max_num_seqs=3, max_num_batched_tokens=6
    )


def prompt(n: int, key) -> list[int]:
    return torch.randint(0, 96, (n,), generator=gen_for("engine", key)).tolist()


def record_logits(monkeypatch) -> dict[str, list[torch.Tensor]]:
    """Every logits row the sampler gets, per request id."""
    seen: dict[str, list[torch.Tensor]] = {}
    original = Sampler.sample

    def spy(self, logits, md):
        for row, rid in zip(logits, md.request_ids, strict=True):
            seen.setdefault(rid, []).append(row.clone())
        return original(self, logits, md)

    monkeypatch.setattr(Sampler, "sample", spy)
    return seen


def test_import_vllm_stays_light():
    code = (
        "import sys, vllm; vllm.SamplingParams(max_tokens=2); assert 'torch' not in sys.modules; "
        "vllm.LLM; assert 'torch' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_step_logits_match_hf(llm, hf_and_dir, monkeypatch):
    hf, _ = hf_and_dir
    seen = record_logits(monkeypatch)
    prompts = [prompt(9, "a"), prompt(4, "b")]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for p, out in zip(prompts, outs, strict=True):
        tokens = out.outputs[0].token_ids
        assert len(tokens) == 3 and out.outputs[0].finish_reason == "length"
        expected, _ = hf_prefill_then_decode(hf, p, tokens[:-1])
        got = torch.stack(seen[out.request_id])
        assert_close(got, expected[len(p) - 1 :], "vs_hf", msg=f"prompt of {len(p)}")


def test_staggered_requests_equal_each_alone(llm):
    engine = llm.engine
    params = [GREEDY, SamplingParams(temperature=1.0, top_k=30, max_tokens=3, seed=9), GREEDY]
    prompts = [prompt(5, "s0"), prompt(9, "s1"), prompt(2, "s2")]
    alone = [
        llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params, strict=True)
    ]
    done = {}
    ids = [f"staggered-{k}" for k in range(3)]
    engine.add_request(ids[0], prompts[0], params[0])
    for k in (1, 2):
        for out in engine.step():
            done[out.request_id] = out
        engine.add_request(ids[k], prompts[k], params[k])
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    for i, ref in zip(ids, alone, strict=True):
        assert done[i].outputs[0].token_ids == ref.outputs[0].token_ids


def test_seed_makes_sampling_reproducible(llm):
    def params(seed):
        return SamplingParams(temperature=1.0, top_p=0.9, max_tokens=4, seed=seed)

    p = prompt(3, "seed")
    first = llm.generate([p, p], [params(1), params(2)], use_tqdm=False)
    again = llm.generate([prompt(4, "other"), p], [params(3), params(1)], use_tqdm=False)
    assert again[1].outputs[0].token_ids == first[0].outputs[0].token_ids
    assert first[0].outputs[0].token_ids != first[1].outputs[0].token_ids


def test_stop_string_and_max_tokens(llm):
    p = prompt(3, "stop")
    full = llm.generate(p, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0]
    text, tokens = full.outputs[0].text, full.outputs[0].token_ids
    assert len(tokens) == 5 and full.outputs[0].finish_reason == "length"
    assert text == "".join(chr(t) for t in tokens)  # byte fallback: one ASCII char a token
    stop = text[2:4]
    cut = text.find(stop)
    out = llm.generate(p, SamplingParams(temperature=0.0, max_tokens=5, stop=stop), use_tqdm=False)[
        0
    ].outputs[0]
    assert out.finish_reason == "stop" and out.text == text[:cut]
    assert out.token_ids == tokens[: cut + 2]
