"""Compile the replayed decode kernel for sm_90 without a GPU, for every entry of every launch
table in ``ops/configs/replayssm/``: the decode step's launches (both of a split step) and
the materialise launches, with and without ``has_initial_state``, at the Codestral-7B
layer shape (bf16 activations and rings, the entry's state dtype; the wildcard entry with
both). Triton's compiler is stricter than the interpreter the CPU tests run in (a name bound
under one constexpr branch and read under another, a condition that stops being a
constexpr), so a table entry whose launch cannot compile shows here instead of on the box.

Run as ``python -m tests.kernels.mamba.replay_compile`` with TRITON_INTERPRET unset; one
JSON line per compiled variant. A helper of test_replayssm_compile.py.
"""

from __future__ import annotations

import json
import os

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("run with TRITON_INTERPRET unset: the kernels must be JIT functions")

import torch  # noqa: E402

from benchmarks.kernels.replay_compile_report import G, H, N, P, zero_pool  # noqa: E402
from benchmarks.kernels.sm90_compile import LaunchRecorder, compile_sm90, resources  # noqa: E402
from vllm.model_executor.layers.mamba.ops import mamba_ssm_replay as rp  # noqa: E402
from vllm.triton_utils import launch  # noqa: E402

BATCH = 4  # the Codestral-7B layer of replay_compile_report: H 128 x P 64, N 128, G 8, L 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
KINDS = ("step", "materialise", "materialise_init")


def table_entries():
    """(table file, key, entry, state dtype name) for every entry of every launch table."""
    for path in sorted(rp.CONFIG_DIR.glob("*.json")):
        with path.open() as f:
            data = json.load(f)
        if "entries" not in data:  # engine_default.json: no launch table
            continue
        for key, cfg in data["entries"].items():
            parts = dict(p.split("=", 1) for p in key.split(",") if "=" in p)
            for dtype in [parts["state_dtype"]] if "state_dtype" in parts else list(DTYPES):
                yield path.name, key, cfg, dtype


def recorded(cfg: dict, state_dtype: torch.dtype, kind: str) -> list:
    """(args, constexprs) of each launch a decode step or a materialisation makes with the
    launch configuration ``cfg`` (recorded, not run)."""
    act = torch.bfloat16
    rs = zero_pool(state_dtype, BATCH + 1)
    A, D, dt_bias = torch.zeros(H), torch.zeros(H), torch.zeros(H)
    idx = torch.arange(1, BATCH + 1, dtype=torch.int32)
    if kind == "step":
        x, dt = torch.zeros(BATCH, H, P, dtype=act), torch.zeros(BATCH, H, dtype=act)
        B = torch.zeros(BATCH, G, N, dtype=act)
        step = (x, dt, A, B, B.clone(), D, dt_bias, True, 0.0, float("inf"), idx, None)
        out = torch.empty_like(x)
    else:
        init = torch.ones(BATCH, dtype=torch.bool) if kind == "materialise_init" else None
        step = (None, None, A, None, None, None, None, False, 0.0, float("inf"), idx, init)
        out = None
    recorder = LaunchRecorder()
    real = rp.launch_config
    rp.launch_config = lambda *a: dict(cfg)
    launch._SESSION = recorder
    try:
        rp._launch(*rs.tensors(), *step, 0, out)
    finally:
        launch._SESSION = None
        rp.launch_config = real
    return [(args, constexprs) for _, args, constexprs in recorder.launches]


def main() -> int:
    done = {}
    for table, key, cfg, dtype in table_entries():
        for kind in KINDS:
            for args, constexprs in recorded(cfg, DTYPES[dtype], kind):
                sig = (dtype, kind, tuple(sorted(constexprs.items())))
                if sig not in done:
                    res = resources(compile_sm90(rp._replay_ssm_kernel, args, constexprs))
                    done[sig] = dict(regs=res["regs"], stack=res["stack"])
                row = dict(table=table, key=key, state_dtype=dtype, kind=kind,
                           part=constexprs["PART"], **done[sig])  # fmt: skip
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
