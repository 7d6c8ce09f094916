"""lm-eval's ``local-completions`` backend (real lm-eval 0.4.13,
``lm_eval/models/openai_completions.py``) against a live ``vllm serve`` (a real process, real
HTTP): loglikelihood tasks through ``/v1/completions`` with ``echo`` + ``logprobs`` over the
prompt tokens, generate-until tasks through ``stop``; the results are the model's own."""

from __future__ import annotations

import pytest

from tests.entrypoints.utils import MODEL_NAME, serve_for_module
from tests.lm_eval.harness import (
    MAX_MODEL_LEN,
    NEEDS_LM_EVAL,
    check_both_tasks_ran,
    check_generations,
    check_loglikelihoods,
    config,
    evaluate,
)

pytest.importorskip("lm_eval", reason=NEEDS_LM_EVAL)
pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    yield from serve_for_module(tiny_model_dir)  # SERVER_ARGS: max_model_len 256, 4 slots


@pytest.fixture(scope="module")
def api_run(server, tiny_model_dir, task_dir, tmp_path_factory):
    args = {
        "model": MODEL_NAME,
        "base_url": server.url_for("v1", "completions"),
        # This server has no /tokenizer_info (lm-eval's "remote" tokenizer): the HF one.
        "tokenizer_backend": "huggingface",
        "tokenizer": str(tiny_model_dir),
        "max_length": MAX_MODEL_LEN,
        "max_retries": 1,
    }
    # 4 prompts per request: each request is a batch of prompts in one HTTP call.
    cfg = config("local-completions", args, task_dir, batch_size=4)
    return evaluate(tmp_path_factory.mktemp("api"), "api", cfg)


def test_both_tasks_run_to_completion(api_run):
    check_both_tasks_ran(api_run)


def test_loglikelihoods_are_the_models_own(api_run, reference):
    # local-completions sends token ids encoded without special tokens (no BOS).
    check_loglikelihoods(api_run, reference, add_bos=False)


def test_generations_are_greedy_decoding_cut_at_the_stops(api_run, reference):
    check_generations(
        api_run, reference, add_bos=False, skip_special_tokens=True, max_len=MAX_MODEL_LEN - 1
    )
