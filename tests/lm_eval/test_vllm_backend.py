"""lm-eval's ``vllm`` backend (real lm-eval 0.4.13, ``lm_eval/models/vllm_causallms.py``) on
this package: ``simple_evaluate(model="vllm")`` with the seed's model arguments runs both
local tasks, and what it reports is the model's own: every loglikelihood equals HF
transformers' forward of the same weights, every generation its greedy decoding."""

from __future__ import annotations

import pytest

from tests.lm_eval.harness import (
    LIMIT,
    MAX_GEN_TOKS,
    MAX_MODEL_LEN,
    NEEDS_LM_EVAL,
    config,
    evaluate,
    samples,
)
from tests.lm_eval.reference import same_text

pytest.importorskip("lm_eval", reason=NEEDS_LM_EVAL)
pytestmark = pytest.mark.timeout(1200)

# The seed's --model_args, plus a short context for the tiny model.
SEED_ARGS = dict(tensor_parallel_size=1, dtype="auto", gpu_memory_utilization=0.9)


def run(tiny_model_dir, task_dir, tmp_path, name: str, triton_conv: str) -> dict:
    args = {"pretrained": str(tiny_model_dir), **SEED_ARGS, "max_model_len": MAX_MODEL_LEN}
    cfg = config("vllm", args, task_dir, batch_size="auto")
    return evaluate(tmp_path, name, cfg, VLLM_USE_TRITON_CONV1D=triton_conv)


@pytest.fixture(scope="module")
def triton_run(tiny_model_dir, task_dir, tmp_path_factory):
    return run(tiny_model_dir, task_dir, tmp_path_factory.mktemp("vllm"), "triton", "1")


def test_both_tasks_run_to_completion(triton_run):
    results = triton_run["results"]
    assert 0.0 <= results["gsm8k_local"]["exact_match,strict-match"] <= 1.0
    assert 0.0 <= results["mc_local"]["acc,none"] <= 1.0
    for task, filter_name in (("gsm8k_local", "strict-match"), ("mc_local", "none")):
        assert [s["doc_id"] for s in samples(triton_run, task, filter_name)] == list(range(LIMIT))


def test_loglikelihoods_are_the_models_own(triton_run, reference):
    for sample in samples(triton_run, "mc_local", "none"):
        assert len(sample["arguments"]) == len(sample["resps"]) == 4  # one per choice
        for (context, continuation), [(logprob, greedy)] in zip(
            sample["arguments"], sample["resps"], strict=True
        ):
            # The vllm backend encodes with the tokenizer's special tokens (a BOS first).
            want, want_greedy = reference.loglikelihood(context, continuation, add_bos=True)
            assert logprob == pytest.approx(want, abs=1e-4), (sample["doc_id"], continuation)
            assert greedy == want_greedy


def test_generations_are_greedy_decoding_cut_at_the_stops(triton_run, reference):
    for sample in samples(triton_run, "gsm8k_local", "strict-match"):
        [(context, gen_kwargs)] = sample["arguments"]
        [[text]] = sample["resps"]
        assert gen_kwargs["max_gen_toks"] == MAX_GEN_TOKS
        want, prompt = reference.generate_until(
            context, gen_kwargs["until"], MAX_GEN_TOKS, add_bos=True, skip_special_tokens=False
        )
        assert len(prompt) + MAX_GEN_TOKS <= MAX_MODEL_LEN  # lm-eval truncated nothing
        assert same_text(text, want), (sample["doc_id"], text, want)


@pytest.mark.gpu
def test_conv_backends_give_the_same_samples(triton_run, tiny_model_dir, task_dir, tmp_path):
    """VLLM_USE_TRITON_CONV1D=0 (the CUDA split) against =1: needs the CUDA conv ops, which
    exist on a GPU machine only (on the CPU =0 refuses to build the model)."""
    cuda_run = run(tiny_model_dir, task_dir, tmp_path, "cuda", "0")
    for task, filter_name in (("gsm8k_local", "strict-match"), ("mc_local", "none")):
        ours, theirs = samples(triton_run, task, filter_name), samples(cuda_run, task, filter_name)
        assert [s["arguments"] for s in ours] == [s["arguments"] for s in theirs]
        for a, b in zip(ours, theirs, strict=True):
            if task == "gsm8k_local":
                assert a["resps"] == b["resps"], a["doc_id"]
            else:  # fp32 sums of two conv implementations: equal to rounding
                for [(lp_a, greedy_a)], [(lp_b, greedy_b)] in zip(
                    a["resps"], b["resps"], strict=True
                ):
                    assert lp_a == pytest.approx(lp_b, abs=1e-5) and greedy_a == greedy_b
