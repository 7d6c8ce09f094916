"""Fixtures of the lm-eval tests: the tiny model (its own copy: tests/entrypoints' fixtures
are that directory's), the local tasks written for it, and the HF reference model.

The tiny model has one layer: these tests check that lm-eval's requests through our
backends report the model's own numbers (every sample against HF's forward of the same
weights), which a second layer leaves as it is while doubling every interpreted step."""

from __future__ import annotations

import pytest

from tests.lm_eval.harness import MAX_GEN_TOKS, NUM_FEWSHOT
from tests.lm_eval.tasks import write_tasks
from tests.tiny_model import make_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("lm_eval_tiny"), num_hidden_layers=1)


@pytest.fixture(scope="session")
def task_dir(tmp_path_factory):
    return write_tasks(
        tmp_path_factory.mktemp("lm_eval_tasks"),
        num_fewshot=NUM_FEWSHOT,
        max_gen_toks=MAX_GEN_TOKS,
    )


@pytest.fixture(scope="session")
def reference(tiny_model_dir):
    from tests.lm_eval.reference import Reference

    return Reference(tiny_model_dir)
