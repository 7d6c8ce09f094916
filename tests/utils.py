"""What test modules share (a test module never imports another: what two of them need
lives here, in a folder's own utils.py, or in a conftest.py fixture).

- ``REPO``: the repository root; ``run_module`` runs ``python -m <module>`` there, as the
  README and scripts/gpu_check.sh run the benchmarks.
- ``INTERPRETER_BLOCKER``: why Triton's interpreter cannot run in this environment (None
  when it can), for tests whose fresh processes interpret the kernels.
- ``serve_random_workload``: waves of random requests through an ``LLM``.
- ``require_cuda_tools``: skip a compile-report test module (sm_90 without a GPU) where
  Triton's NVIDIA backend or its ptxas/nvdisasm is missing, saying which.
"""

from __future__ import annotations

import random
import subprocess
from pathlib import Path

from benchmarks.common.launch import module_argv, tree_env

REPO = Path(__file__).resolve().parents[1]


def run_module(
    module: str, *args, env: dict | None = None, **kwargs
) -> subprocess.CompletedProcess:
    """``python -m module args...`` in a fresh process, from the repository root and with
    it first on PYTHONPATH (``env`` defaults to this process's environment)."""
    argv = module_argv(module, *map(str, args))
    return subprocess.run(argv, cwd=REPO, env=tree_env(env), **kwargs)


def _interpreter_blocker() -> str | None:
    """Why the runs' Triton interpreter cannot work here, or None.

    Each CPU run is a fresh process with TRITON_INTERPRET=1. Triton 3.6's interpreter
    turns 1-element arrays into ints with int(), which numpy >= 2.4 rejects ("only
    0-dimensional arrays can be converted to Python scalars"): seen on the GPU box,
    whose numpy is newer than the numpy<2.4 the CPU CI pins.
    """
    import numpy

    if tuple(int(p) for p in numpy.__version__.split(".")[:2]) >= (2, 4):
        return f"Triton's interpreter fails with numpy {numpy.__version__} (>= 2.4)"
    return None


INTERPRETER_BLOCKER = _interpreter_blocker()


def require_cuda_tools(*tools: str) -> None:
    """Skip the calling test module unless Triton's NVIDIA backend and ``tools`` (in its
    bin folder: ptxas, nvdisasm, cuobjdump) are here; the reason names what is missing."""
    import pytest

    triton = pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia", reason="needs Triton's NVIDIA backend (ptxas)")
    folder = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    missing = [t for t in tools if not (folder / t).is_file()]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} in {folder} (Triton's wheel ships them)",
                    allow_module_level=True)  # fmt: skip


def serve_random_workload(llm, seed: int, waves: int, max_len: int, vocab: int) -> int:
    """Waves of requests with random prompt and output lengths; each wave's requests
    finish at different steps, so the decode batch shrinks one by one. Returns the
    number of output tokens."""
    from vllm import SamplingParams

    rng = random.Random(seed)
    total = 0
    for _ in range(waves):
        n = rng.randint(1, 2 * llm.engine.config.max_num_seqs)
        prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, max_len))] for _ in range(n)]
        params = [
            SamplingParams(temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randint(1, 9))
            for _ in range(n)
        ]
        for p in params:
            p.ignore_eos = True
        outs = llm.generate(prompts, params, use_tqdm=False)
        total += sum(len(o.outputs[0].token_ids) for o in outs)
    return total
