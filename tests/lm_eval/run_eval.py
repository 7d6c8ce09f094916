"""Run ``lm_eval.simple_evaluate`` in this process and write what the tests compare as JSON.

    python -m tests.lm_eval.run_eval CONFIG.json OUT.json

CONFIG: ``{"model": "vllm" | "local-completions", "model_args": {...}, "tasks": [...],
"include_path": DIR, "limit": N, "num_fewshot": K, "batch_size": B}``. OUT: ``{"results":
{task: {metric: value}}, "samples": {task: [{"doc_id", "arguments", "resps",
"filtered_resps", "target", "filter"}]}}``, sorted by (filter, doc id): a task with two
filters (gsm8k's strict-match and flexible-extract) logs each document once per filter.

The tests run it as a subprocess, so that lm-eval sees the environment they give it (HF's
offline switches are read when ``huggingface_hub`` and ``datasets`` are imported, and the
test process has imported them long before) and its global seeding and logging stay there.
"""

from __future__ import annotations

import json
import sys

SAMPLE_KEYS = ("doc_id", "filter", "arguments", "resps", "filtered_resps", "target")


def main(config_path: str, out_path: str) -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager

    with open(config_path) as f:
        config = json.load(f)
    out = lm_eval.simple_evaluate(
        model=config["model"],
        model_args=config["model_args"],
        tasks=config["tasks"],
        task_manager=TaskManager(include_path=config["include_path"]),
        limit=config.get("limit"),
        num_fewshot=config.get("num_fewshot"),
        batch_size=config.get("batch_size"),
        log_samples=True,
    )
    samples = {
        task: sorted(
            ({k: s[k] for k in SAMPLE_KEYS} for s in task_samples),
            key=lambda s: (s["filter"], s["doc_id"]),
        )
        for task, task_samples in out["samples"].items()
    }
    with open(out_path, "w") as f:
        json.dump({"results": out["results"], "samples": samples}, f, default=repr)


if __name__ == "__main__":
    main(*sys.argv[1:])
