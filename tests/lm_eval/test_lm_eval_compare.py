"""benchmarks/accuracy/lm_eval_compare.py, the GPU run's script, on the CPU: ``run`` executes the
seed's ``lm_eval --model vllm ...`` command line (the CLI, offline) on the tiny model;
``compare`` counts what agrees between two runs' per-sample outputs and finds what does not;
the wheel packing round-trips every wheel file."""

from __future__ import annotations

import json
import shutil
import subprocess
import zipfile

import pytest

from tests.lm_eval.harness import MAX_MODEL_LEN, NEEDS_LM_EVAL, offline_env
from tests.utils import run_module

pytest.importorskip("lm_eval", reason=NEEDS_LM_EVAL)
pytestmark = pytest.mark.timeout(900)


def script(*args, env=None, check=True) -> subprocess.CompletedProcess:
    proc = run_module(
        "benchmarks.accuracy.lm_eval_compare",
        *args,
        env=env,
        capture_output=True,
        text=True,
        timeout=800,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{args[0]} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture(scope="module")
def triton_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    args = ["run", "--model-dir", tiny_model_dir, "--out", out / "run", "--backends", "triton"]
    args += ["--num-test", 4, "--limit", 3, "--num-fewshot", 1, "--max-gen-toks", 8]
    args += ["--model-args", f"max_model_len={MAX_MODEL_LEN}"]
    proc = script(*args, env=offline_env(out))
    # The command it ran is the seed's, with the tiny model's context on top.
    assert (
        "--model vllm --model_args pretrained="
        f"{tiny_model_dir},tensor_parallel_size=1,dtype=auto,gpu_memory_utilization=0.9,"
        f"max_model_len={MAX_MODEL_LEN} --batch_size auto --tasks gsm8k_local,mc_local"
    ) in proc.stdout
    return out / "run" / "triton"


def compare(a, b, tmp_path) -> dict:
    script("compare", a, b, "--json", tmp_path / "c.json", "--md", tmp_path / "c.md")
    return json.loads((tmp_path / "c.json").read_text())["tasks"]


def test_a_run_agrees_with_itself(triton_run, tmp_path):
    tasks = compare(triton_run, triton_run, tmp_path)
    assert tasks["gsm8k_local"]["documents"] == tasks["mc_local"]["documents"] == 3
    for row in tasks.values():
        assert row["identical"] == 3 and row["first_differences"] == []
        assert all(pct == 100.0 for pct in row["same_prediction_pct"].values())
    assert tasks["mc_local"]["max_abs_loglikelihood_diff"] == 0.0
    assert "| gsm8k_local | 3 | 3 (100.0%) |" in (tmp_path / "c.md").read_text()


def _edit(run_dir, task: str, doc_id: int, change) -> None:
    [path] = list(run_dir.rglob(f"samples_{task}_*.jsonl"))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        if row["doc_id"] == doc_id:
            change(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_differences_are_counted_and_shown(triton_run, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(triton_run, other)

    def new_text(row):  # another generation, and (strict-match only) another answer
        row["resps"] = [["#### 12345"]]
        if row["filter"] == "strict-match":
            row["filtered_resps"] = ["12345"]

    def new_best_choice(row):  # choice 2 now the most likely one, by far
        row["resps"][2][0][0] = "0.0"

    _edit(other, "gsm8k_local", 1, new_text)
    _edit(other, "mc_local", 0, new_best_choice)
    tasks = compare(triton_run, other, tmp_path)
    gsm, mc = tasks["gsm8k_local"], tasks["mc_local"]
    assert gsm["identical"] == 2 and [d["doc_id"] for d in gsm["first_differences"]] == [1]
    assert gsm["same_prediction"] == {"flexible-extract": 3, "strict-match": 2}
    assert mc["identical"] == 2 and mc["first_differences"][0]["doc_id"] == 0
    lls = [float(r[0][0]) for r in mc["first_differences"][0]["a"]]
    assert mc["max_abs_loglikelihood_diff"] == pytest.approx(abs(lls[2]))
    assert mc["same_prediction"]["none"] == (3 if lls.index(max(lls)) == 2 else 2)


def test_the_cuda_backend_is_refused_where_its_ops_are_missing(tiny_model_dir, tmp_path):
    import torch

    from vllm import _custom_ops

    if torch.cuda.is_available() and _custom_ops.cuda_ops_available():
        pytest.skip("the CUDA conv ops are built here: the cuda backend runs")
    proc = script("run", "--model-dir", tiny_model_dir, "--out", tmp_path / "run", check=False)
    assert proc.returncode != 0 and "cannot run the cuda backend" in proc.stderr


def test_packed_wheels_unpack_to_the_same_files(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    files = {"pkg/__init__.py": b"x = 1\n", "pkg-1.0.dist-info/RECORD": b"pkg/__init__.py,,\n"}
    with zipfile.ZipFile(wheels / "pkg-1.0-py3-none-any.whl", "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    script("pack-wheels", wheels, tmp_path / "w.tar.xz")
    script("unpack-wheels", tmp_path / "w.tar.xz", tmp_path / "back")
    with zipfile.ZipFile(tmp_path / "back" / "pkg-1.0-py3-none-any.whl") as zf:
        assert {name: zf.read(name) for name in zf.namelist()} == files
