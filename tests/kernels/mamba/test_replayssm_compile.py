"""Every launch-table entry of the replayed decode kernel compiles for sm_90 on any machine
(no GPU needed), in a fresh process without the interpreter (``replay_compile``): the
decode step's launches and the materialise launches, which the CPU tests run only under
the interpreter, whose Python semantics let a kernel through that Triton's compiler refuses
(2026-12-06: a launch variant that read a name bound only under another constexpr branch
passed every CPU test and failed on the box)."""

from __future__ import annotations

import json
import os

import pytest

from tests.utils import run_module
from vllm.model_executor.layers.mamba.ops.mamba_ssm_replay import CONFIG_DIR

pytest.importorskip("triton.backends.nvidia", reason="needs Triton's NVIDIA backend (ptxas)")


def test_every_table_entry_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = run_module("tests.kernels.mamba.replay_compile", env=env, capture_output=True,
                      text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    want = set()  # (table, key, state dtype) of every entry, read here from the files
    for path in CONFIG_DIR.glob("*.json"):
        for key in json.loads(path.read_text()).get("entries", {}):
            dtypes = [key.split("state_dtype=")[1].split(",")[0]] if "state_dtype=" in key else [
                "float32", "bfloat16"]  # fmt: skip
            want |= {(path.name, key, d) for d in dtypes}
    assert len(want) >= 20, want  # the H100's and the H200's buckets, the wildcard
    for kind in ("step", "materialise", "materialise_init"):
        got = {(r["table"], r["key"], r["state_dtype"]) for r in rows if r["kind"] == kind}
        assert got == want, (kind, want - got)
    assert all(r["regs"] > 0 and r["stack"] >= 0 for r in rows), rows


def test_the_compile_module_refuses_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = run_module("tests.kernels.mamba.replay_compile", env=env, capture_output=True,
                      text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0 and "TRITON_INTERPRET unset" in proc.stderr
