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

# The Codestral-7B layer of replay_compile_report (128 heads x 64, state 128, 8 groups, L 16).
from benchmarks.kernels.replay_compile_report import recorded  # noqa: E402
from benchmarks.kernels.sm90_compile import compile_sm90, resources  # noqa: E402
from vllm.model_executor.layers.mamba.ops import mamba_ssm_replay as rp  # noqa: E402

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


def main() -> int:
    done = {}
    for table, key, cfg, dtype in table_entries():
        for kind in KINDS:
            for kernel, args, constexprs in recorded(DTYPES[dtype], cfg, kind, batch=4):
                sig = (kernel.fn.__name__, dtype, kind, tuple(sorted(constexprs.items())))
                if sig not in done:
                    res = resources(compile_sm90(kernel, args, constexprs))
                    done[sig] = dict(regs=res["regs"], stack=res["stack"])
                row = dict(table=table, key=key, state_dtype=dtype, kind=kind,
                           kernel=sig[0], part=constexprs.get("PART"), **done[sig])  # fmt: skip
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
