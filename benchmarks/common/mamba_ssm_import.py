"""mamba_ssm's Triton kernels without its CUDA extensions: ``import_mamba_ssm_triton()``.

The GPU box has no CUDA build of mamba_ssm; it gets the pure-Python wheel built on the
development machine (``MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE pip wheel
--no-deps --no-build-isolation mamba-ssm==2.3.2.post1 -w .whl``, plus an einops wheel),
installed with ``pip install --no-index --no-deps --target /tmp/site .whl/*.whl`` and
``PYTHONPATH=/tmp/site``. Its package ``__init__`` imports ``selective_scan_cuda`` (a CUDA
extension) and the Mamba3 modules (tilelang, cute), which that box lacks, so a plain
``import mamba_ssm`` fails. The Triton modules themselves need only torch, triton and einops.

``import_mamba_ssm_triton`` therefore puts a stub package module ``mamba_ssm`` into
``sys.modules`` whose ``__path__`` is the installed folder (so ``mamba_ssm.ops.triton.*``
import from it, their own ``__init__`` files being empty) without running the package
``__init__``, registers an empty ``selective_scan_cuda`` module for any code that imports
it only to probe, then imports ``mamba_ssm.ops.triton.ssd_combined`` and
``mamba_ssm.ops.triton.selective_state_update``. transformers (5.17) decides at import of
``modeling_mamba2`` whether to use mamba_ssm by ``importlib.import_module("mamba_ssm")``
and then looks up ``ops.triton.ssd_combined.mamba_chunk_scan_combined`` and
``ops.triton.selective_state_update.selective_state_update`` on it; with the stub in place
both resolve, so call this before transformers imports its Mamba2 model.
``causal_conv1d`` (Dao's CUDA conv) stays absent, so HF takes its PyTorch conv.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_STUB_MARK = "_vllm_bench_stub"


@dataclass
class MambaSSMTriton:
    """The two mamba_ssm entry points the benchmarks call, and where they came from."""

    mamba_chunk_scan_combined: Callable
    selective_state_update: Callable
    version: str
    path: str


def _package_dir() -> Path:
    spec = importlib.util.find_spec("mamba_ssm")  # finds without executing __init__
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "mamba_ssm is not installed (on the GPU box: pip install --no-index --no-deps "
            "--target /tmp/site .whl/*.whl and PYTHONPATH=/tmp/site)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _version(folder: Path) -> str:
    try:
        return importlib.metadata.version("mamba_ssm")
    except importlib.metadata.PackageNotFoundError:
        pass
    for line in (folder / "__init__.py").read_text().splitlines():
        if line.startswith("__version__"):
            return line.split("=", 1)[1].strip().strip("\"'")
    return "unknown"


def _install_stub(folder: Path, version: str) -> None:
    spec = importlib.machinery.ModuleSpec("mamba_ssm", None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    stub = importlib.util.module_from_spec(spec)
    stub.__path__ = [str(folder)]
    stub.__version__ = version
    setattr(stub, _STUB_MARK, True)
    sys.modules["mamba_ssm"] = stub
    if importlib.util.find_spec("selective_scan_cuda") is None:
        sys.modules.setdefault("selective_scan_cuda", types.ModuleType("selective_scan_cuda"))


def import_mamba_ssm_triton() -> MambaSSMTriton:
    """Import mamba_ssm's Triton SSD and state-update ops (see the module docstring).

    Raises ImportError, saying why, when mamba_ssm (or einops, which its Triton modules
    import) is missing or a real ``mamba_ssm`` package was already imported.
    """
    loaded = sys.modules.get("mamba_ssm")
    if loaded is not None and not getattr(loaded, _STUB_MARK, False):
        folder = Path(loaded.__path__[0])
    else:
        folder = _package_dir()
        if loaded is None:
            _install_stub(folder, _version(folder))
    try:
        ssd = importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
        ssu = importlib.import_module("mamba_ssm.ops.triton.selective_state_update")
    except ImportError as err:
        raise ImportError(f"mamba_ssm's Triton modules do not import: {err}") from err
    return MambaSSMTriton(
        mamba_chunk_scan_combined=ssd.mamba_chunk_scan_combined,
        selective_state_update=ssu.selective_state_update,
        version=getattr(sys.modules["mamba_ssm"], "__version__", "unknown"),
        path=str(folder),
    )


def interpreter_shims() -> None:
    """Let mamba_ssm's Triton ops run on CPU tensors under ``TRITON_INTERPRET=1`` (a CPU
    smoke test of the call signatures, nothing more): they enter
    ``torch.cuda.device(t.device.index)``, which fails for a CPU tensor (index None), and
    their autotuners benchmark every config through a GPU driver there is none of, so
    each autotuner is cut to its first config. Process-wide; for CPU-only processes."""
    import contextlib

    import torch
    from triton.runtime.autotuner import Autotuner

    cuda_device = torch.cuda.device

    def device_or_nothing(index):
        return contextlib.nullcontext() if index is None else cuda_device(index)

    torch.cuda.device = device_or_nothing
    for name, module in list(sys.modules.items()):
        if name.startswith("mamba_ssm.ops.triton"):
            for value in vars(module).values():
                if isinstance(value, Autotuner):
                    value.configs = value.configs[:1]


if __name__ == "__main__":
    ops = import_mamba_ssm_triton()
    print(f"mamba_ssm {ops.version} from {ops.path}: Triton ssd_combined and state update OK")
