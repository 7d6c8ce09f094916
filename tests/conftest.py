"""Shared test setup.

Without a CUDA GPU the Triton kernels run through the Triton interpreter on CPU
tensors, so CPU CI exercises the kernels and not only the torch reference. The
variable must be set before the op module is imported (``triton.jit`` decides
at decoration time whether to build an interpreted function).
"""

from __future__ import annotations

import fcntl
import gc
import os
import tempfile

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

GPU_SKIP_REASON = "needs a CUDA GPU; runs on the GPU box"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; runs on the GPU box")
    config.addinivalue_line(
        "markers",
        "gpu_big_memory: a GPU test that allocates tens of GiB (tensors past 2**31 elements, "
        "7B-shaped layers); runs alone on the GPU while the suite's other workers wait",
    )


# The longest files (minutes each under the interpreter), run first: the suite's xdist
# workers take whole files in the order collected, so one of these collected last (tests/worker
# comes late) would leave the other worker idle at the end. Run first, the run ends on short
# files instead. Order only: every test runs as before (a stable sort keeps each file's order).
LONGEST_FILES = (
    "tests/entrypoints/test_hybrid_serve.py",
    "tests/worker/test_mixed_graph_models_a.py",
    "tests/worker/test_mixed_graph.py",
    "tests/engine/test_replayssm_engine.py",
    "tests/lm_eval/test_local_completions.py",
    "tests/lm_eval/test_vllm_backend.py",
    "tests/worker/test_mixed_graph_models_b.py",
)


def _longest_first(item) -> int:
    path = item.nodeid.split("::", 1)[0]
    return LONGEST_FILES.index(path) if path in LONGEST_FILES else len(LONGEST_FILES)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_longest_first)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


_GPU_LOCK = os.path.join(tempfile.gettempdir(), "vllm-tests-gpu.lock")


@pytest.fixture(autouse=True)
def _share_the_gpu(request):
    """The GPU box runs the suite under pytest-xdist: every worker shares one GPU. A GPU
    test holds a shared lock (a ``gpu_big_memory`` one an exclusive lock) on a file while
    it runs, and afterwards hands the memory its allocator cached back to the GPU, so one
    worker's finished test cannot starve another's."""
    if "gpu" not in request.keywords or not torch.cuda.is_available():
        yield
        return
    exclusive = "gpu_big_memory" in request.keywords
    with open(_GPU_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            gc.collect()
            torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture
def device() -> torch.device:
    """The device the kernels run on: the GPU when there is one, else the CPU (interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


_ALLOCATORS = ("empty", "empty_like", "empty_strided")


def _nan_filled(alloc):
    def wrapper(*args, **kwargs):
        t = alloc(*args, **kwargs)
        if t.is_floating_point() and t.numel() > 0:
            t.fill_(float("nan"))
        return t

    return wrapper


@pytest.fixture
def nan_poison(monkeypatch):
    """Make uninitialised memory NaN for the whole test.

    The ops allocate their outputs themselves, so the allocation itself is
    poisoned: every floating tensor from ``torch.empty``/``empty_like``/
    ``empty_strided``/``Tensor.new_empty`` comes back filled with NaN, and on
    CUDA the caching allocator's free blocks are filled with NaN first (a large
    NaN tensor is allocated and freed, so later allocations reuse its memory).
    An output element a kernel forgets to write then fails the comparison loudly.
    """
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        # 512 KiB blocks fill whole segments of the small-block pool, 256 MiB ones the large pool.
        for numel, count in ((1 << 17, 32), (1 << 26, 4)):
            blocks = [torch.full((numel,), float("nan"), device="cuda") for _ in range(count)]
            del blocks
    for name in _ALLOCATORS:
        monkeypatch.setattr(torch, name, _nan_filled(getattr(torch, name)))
    monkeypatch.setattr(torch.Tensor, "new_empty", _nan_filled(torch.Tensor.new_empty))
    yield
