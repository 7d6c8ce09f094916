"""``vllm serve`` refusing to start: real processes, each ending with exit status 1 and one
line that names what is wrong, no traceback (one with ``VLLM_LOGGING_LEVEL=DEBUG``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.entrypoints.utils import REPO, server_env

VLLM = str(Path(sys.executable).parent / "vllm")


def serve(model: str, *args: str, env: dict | None = None, module: bool = False):
    """Run the server as a user would; it must exit before it listens."""
    if module:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    else:
        cmd = [VLLM, "serve", model]
    # An unused port: a server that wrongly starts fails the test by timing out, not by
    # clashing with another test's.
    cmd += [*args, "--host", "127.0.0.1", "--port", "9"]
    full_env = {**server_env(), "HF_HUB_OFFLINE": "1"}
    full_env.pop("VLLM_LOGGING_LEVEL", None)
    full_env.update(env or {})
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=180)


def the_error_line(out, prog: str = "vllm serve") -> str:
    """The single error line of a refused start; fails on a traceback or any other error."""
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and 'File "' not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, out.stderr
    assert errors[0].startswith(f"{prog}: error: "), out.stderr
    return errors[0]


def broken_copy(src: Path, dst: Path, config=None, weights=None) -> Path:
    shutil.copytree(src, dst)
    if config is not None:
        (dst / "config.json").write_text(config)
    if weights is not None:
        weights(dst / "model.safetensors")
    return dst


def _edited_config(src: Path, **fields) -> str:
    return json.dumps({**json.loads((src / "config.json").read_text()), **fields})


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-64])


CASES = {
    "missing_dir": (
        lambda src, tmp: str(tmp / "nope"),
        "model directory '{tmp}/nope' does not exist: give an existing directory or a Hugging "
        "Face Hub id (ORG/NAME)",
    ),
    "unsupported_architecture": (
        lambda src, tmp: str(
            broken_copy(
                src,
                tmp / "llama",
                _edited_config(src, architectures=["LlamaForCausalLM"], model_type="llama"),
            )
        ),
        "unsupported model: architectures=['LlamaForCausalLM'], model_type='llama'; the "
        "architectures served are Mamba2ForCausalLM",
    ),
    "bad_config_json": (
        lambda src, tmp: str(broken_copy(src, tmp / "bad", config="{not json")),
        "{tmp}/bad/config.json is not valid JSON: ",
    ),
    "missing_weights": (
        lambda src, tmp: str(broken_copy(src, tmp / "empty", weights=Path.unlink)),
        "no *.safetensors weights in '{tmp}/empty' (use load_format='dummy', --load-format "
        "dummy, for random weights)",
    ),
    "truncated_safetensors": (
        lambda src, tmp: str(broken_copy(src, tmp / "cut", weights=_truncate)),
        "{tmp}/cut/model.safetensors is not a readable safetensors file (",
    ),
    "uncached_hub_id_offline": (
        lambda src, tmp: "org/not-cached",
        "model 'org/not-cached' (revision 'main') is not in the Hugging Face cache {tmp}/hub, "
        "and HF_HUB_OFFLINE is set, so nothing was downloaded: run once with network access, "
        "or `hf download org/not-cached`, or give a local directory",
    ),
    # Found in the engine core's process, which loads the weights: the same one line.
    "weight_shape_mismatch": (
        lambda src, tmp: str(broken_copy(src, tmp / "shape", _edited_config(src, state_size=8))),
        "weight 'backbone.layers.0.mixer.conv1d.bias' has shape (192,) in the checkpoint, but "
        "the config makes",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_vllm_serve_refuses_to_start_in_one_line(case, tiny_model_dir, tmp_path):
    make_model, expected = CASES[case]
    model = make_model(Path(tiny_model_dir), tmp_path)
    out = serve(model, env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    line = the_error_line(out)
    assert expected.format(tmp=tmp_path) in line, line


def test_python_m_api_server_refuses_in_one_line_too(tmp_path):
    out = serve(str(tmp_path / "nope"), module=True)
    line = the_error_line(out, prog="python -m vllm.entrypoints.openai.api_server")
    assert f"model directory '{tmp_path}/nope' does not exist" in line


def test_debug_logging_shows_the_traceback(tmp_path):
    out = serve(str(tmp_path / "nope"), env={"VLLM_LOGGING_LEVEL": "DEBUG"})
    assert out.returncode == 1, out.stderr
    assert "Traceback (most recent call last)" in out.stderr, out.stderr
    assert "FileNotFoundError: model directory" in out.stderr
    assert out.stderr.rstrip().splitlines()[-1].startswith("vllm serve: error: model directory")


def test_a_bug_keeps_its_traceback(tmp_path):
    """Only the user's errors (ValueError, OSError) are shortened: anything else is a bug."""
    code = (
        "import sys; from vllm.entrypoints.cli.startup import run_or_exit; "
        "run_or_exit('prog', lambda: {}['missing'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=dict(os.environ), capture_output=True, text=True
    )
    assert out.returncode == 1 and "Traceback" in out.stderr and "KeyError" in out.stderr
