"""lm-eval's ``vllm`` backend (real lm-eval 0.4.13, ``lm_eval/models/vllm_causallms.py``) on
this package: ``simple_evaluate(model="vllm")`` with the seed's model arguments runs both
local tasks, and what it reports is the model's own: every loglikelihood equals HF
transformers' forward of the same weights, every generation its greedy decoding."""

from __future__ import annotations

import pytest

from tests.lm_eval.harness import (
    MAX_MODEL_LEN,
    NEEDS_LM_EVAL,
    TASK_FILTERS,
    check_both_tasks_ran,
    check_generations,
    check_loglikelihoods,
    config,
    evaluate,
    samples,
)

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
    check_both_tasks_ran(triton_run)


def test_loglikelihoods_are_the_models_own(triton_run, reference):
    # The vllm backend encodes with the tokenizer's special tokens (a BOS first).
    check_loglikelihoods(triton_run, reference, add_bos=True)


def test_generations_are_greedy_decoding_cut_at_the_stops(triton_run, reference):
    check_generations(
        triton_run, reference, add_bos=True, skip_special_tokens=False, max_len=MAX_MODEL_LEN
    )


@pytest.mark.gpu
def test_conv_backends_give_the_same_samples(triton_run, tiny_model_dir, task_dir, tmp_path):
    """VLLM_USE_TRITON_CONV1D=0 (the CUDA split) against =1: needs the CUDA conv ops, which
    exist on a GPU machine only (on the CPU =0 refuses to build the model)."""
    cuda_run = run(tiny_model_dir, task_dir, tmp_path, "cuda", "0")
    for task, filter_name in TASK_FILTERS:
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
