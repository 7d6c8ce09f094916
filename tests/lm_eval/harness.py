"""Running real lm-eval on the local tasks from a test: ``evaluate(...)`` runs
``tests/lm_eval/run_eval.py`` in a subprocess, offline, and returns what it wrote.

The environment proves that no network is needed: HF's offline switches are on
(``HF_HUB_OFFLINE``, ``HF_DATASETS_OFFLINE``: any hub call raises) and ``HF_HOME`` is an
empty directory of the test's, so nothing cached from an earlier download can stand in.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.entrypoints.utils import REPO, server_env
from tests.lm_eval.reference import same_text

# lm-eval is a test dependency (requirements/test.txt), so CI always has it; the GPU box has
# it only once gpu_check.sh's lm_eval step installed the carried wheels.
NEEDS_LM_EVAL = "lm-eval is not installed (requirements/test.txt; on the GPU box: .whl/lmeval/)"
LIMIT = 6  # documents per task (local-completions: a full batch of 4 and a partial one)
NUM_FEWSHOT = 1
MAX_GEN_TOKS = 16
MAX_MODEL_LEN = 256
TIMEOUT_S = 900


def offline_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = server_env()  # TRITON_INTERPRET=1 without a GPU, unbuffered output
    home = tmp_path / "hf_home"
    home.mkdir(exist_ok=True)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(home))
    env.pop("HF_DATASETS_CACHE", None)
    env.pop("HF_HUB_CACHE", None)
    env.update(extra)
    return env


def evaluate(tmp_path: Path, name: str, config: dict, **env: str) -> dict:
    """lm-eval's results and per-sample outputs (``run_eval.py``'s JSON) of one run."""
    config_path, out_path = tmp_path / f"{name}.config.json", tmp_path / f"{name}.out.json"
    config_path.write_text(json.dumps(config))
    cmd = [sys.executable, "-m", "tests.lm_eval.run_eval", str(config_path), str(out_path)]
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        env=offline_env(tmp_path, **env),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"lm-eval run {name!r} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
            f"{proc.stderr[-8000:]}"
        )
    return json.loads(out_path.read_text())


def config(model: str, model_args: dict, task_dir: Path, batch_size) -> dict:
    return {
        "model": model,
        "model_args": model_args,
        "tasks": ["gsm8k_local", "mc_local"],
        "include_path": str(task_dir),
        "limit": LIMIT,
        "batch_size": batch_size,
    }


def samples(out: dict, task: str, filter_name: str) -> list[dict]:
    return [s for s in out["samples"][task] if s["filter"] == filter_name]


TASK_FILTERS = (("gsm8k_local", "strict-match"), ("mc_local", "none"))


def check_both_tasks_ran(out: dict) -> None:
    """Both tasks report their metric and a sample of every document."""
    results = out["results"]
    assert 0.0 <= results["gsm8k_local"]["exact_match,strict-match"] <= 1.0
    assert 0.0 <= results["mc_local"]["acc,none"] <= 1.0
    for task, filter_name in TASK_FILTERS:
        assert [s["doc_id"] for s in samples(out, task, filter_name)] == list(range(LIMIT))


def check_loglikelihoods(out: dict, reference, *, add_bos: bool) -> None:
    """Every choice's loglikelihood and is-greedy equal the reference's (HF's forward)."""
    for sample in samples(out, "mc_local", "none"):
        assert len(sample["arguments"]) == len(sample["resps"]) == 4  # one per choice
        for (context, continuation), [(logprob, greedy)] in zip(
            sample["arguments"], sample["resps"], strict=True
        ):
            want, want_greedy = reference.loglikelihood(context, continuation, add_bos=add_bos)
            assert logprob == pytest.approx(want, abs=1e-4), (sample["doc_id"], continuation)
            assert greedy == want_greedy


def check_generations(
    out: dict, reference, *, add_bos: bool, skip_special_tokens: bool, max_len: int
) -> None:
    """Every generation is the reference's greedy decoding cut at the task's stops; no
    prompt was truncated (its tokens + MAX_GEN_TOKS are at most ``max_len``)."""
    for sample in samples(out, "gsm8k_local", "strict-match"):
        [(context, gen_kwargs)] = sample["arguments"]
        [[text]] = sample["resps"]
        assert gen_kwargs["max_gen_toks"] == MAX_GEN_TOKS
        want, prompt = reference.generate_until(
            context,
            gen_kwargs["until"],
            MAX_GEN_TOKS,
            add_bos=add_bos,
            skip_special_tokens=skip_special_tokens,
        )
        assert len(prompt) + MAX_GEN_TOKS <= max_len  # lm-eval truncated nothing
        assert same_text(text, want), (sample["doc_id"], text, want)
