"""Every environment variable this project reads, in one place.

Values are read when the attribute is accessed (``vllm.envs.VLLM_USE_TRITON_CONV1D``), not
at import, so a variable set after import (a test's ``monkeypatch.setenv``, say) takes
effect. Names not listed here raise AttributeError.

VLLM_USE_TRITON_CONV1D (bool, default True)
    Which causal-conv1d backend MambaMixer2 uses. True: the whole mixed batch goes
    through the Triton ``causal_conv1d_fn`` in one launch. False ("0", "false", "no",
    "off"): the CUDA pathway, prefill and decode tokens through separate CUDA ops.

VLLM_BUILD_CUDA_OPS (optional bool, default unset)
    Read by setup.py at install time, never at run time: whether to build the CUDA ops
    of csrc/ (the CUDA causal-conv1d pathway) with CMake. Unset: build them when torch is
    a CUDA build, nvcc is found (CUDA_HOME, then PATH) and cmake >= 3.25 is on PATH;
    otherwise install pure Python. "1": build them, and fail with the reason when that
    is impossible. "0": never build them.

VLLM_LOGGING_LEVEL (str, default "INFO")
    Level of the "vllm" logger, which prints start-up lines (the engine's start-up time
    and its parts) to stderr: DEBUG, INFO, WARNING, ERROR or CRITICAL.

VLLM_API_KEY (str, default unset)
    The key `vllm serve` requires as ``Authorization: Bearer KEY`` on /v1/*, as vLLM
    reads it; ``--api-key`` takes precedence.

VLLM_ENABLE_V1_MULTIPROCESSING (bool, default True)
    vLLM's name: whether the server's engine core (scheduler, model runner, sampler) runs
    in a process of its own (``vllm/engine/core_proc.py``), so that its steps never wait
    for the GIL while the server's event loop streams; "0": it runs on a thread of the
    server's process. ``LLM`` (offline) always runs the core in the calling thread.

VLLM_USE_REPLAYSSM (optional bool, default unset)
    The default of ``use_replayssm`` (``--use-replayssm``) when neither the command line nor
    ``LLM(...)`` gives it: "1" turns replayed decode on for every engine this process and
    its children start, "0" off; unset, the GPU's measured default decides
    (``ops/configs/replayssm/engine_default.json``; off on the CPU). An explicit value wins;
    a model with Mamba1 layers takes no default. For running whole suites with it on or off
    (``scripts/gpu_check.sh``'s gpu_tests step).

HF_HUB_OFFLINE (bool, default False)
    huggingface_hub's own variable (``TRANSFORMERS_OFFLINE`` too), read with its reading
    ("1", "true", "yes", "on", any case): a Hugging Face Hub id (``vllm serve ORG/NAME``)
    is served from the Hugging Face cache only, never downloaded
    (``vllm/transformers_utils/hub.py``). huggingface_hub reads it once, at import; here it
    is read at each resolution, so a value set later still keeps the resolver off the
    network. The cache is huggingface_hub's: ``HF_HUB_CACHE``, else ``HF_HOME``/hub, else
    ~/.cache/huggingface/hub (read by huggingface_hub at import); ``--download-dir``
    replaces it.

TRITON_INTERPRET (bool, default False)
    Triton's own variable: run ``@triton.jit`` kernels in Triton's Python interpreter,
    on CPU tensors. Read here, with Triton's own reading of the value ("1", "true",
    "yes", "on", "y"; anything else is False), so that the ops can decide whether CPU
    tensors go through the Triton kernels. Triton reads it when a kernel is decorated,
    so it must be set before the kernel modules are imported.
"""

import os
from collections.abc import Callable
from typing import Any

_TRUE = ("1", "true", "yes", "on", "y")
_FALSE = ("0", "false", "no", "off", "n")


def _flag(name: str, default: bool) -> bool:
    """A yes/no variable; unset or empty gives the default, a value we cannot read raises."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"environment variable {name}={os.environ[name]!r}: expected one of "
        f"{', '.join(_TRUE + _FALSE)}"
    )


def _optional_flag(name: str) -> bool | None:
    """A yes/no variable whose absence means "decide for me": unset or empty gives None."""
    if not os.environ.get(name, "").strip():
        return None
    return _flag(name, default=False)


_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _level(name: str, default: str) -> str:
    value = os.environ.get(name, "").strip().upper() or default
    if value not in _LEVELS:
        raise ValueError(
            f"environment variable {name}={os.environ[name]!r}: expected one of "
            f"{', '.join(_LEVELS)}"
        )
    return value


def _hf_offline() -> bool:
    # huggingface_hub's parsing, so that both agree on whether the Hub may be reached.
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in ("1", "ON", "YES", "TRUE")


def _triton_flag(name: str) -> bool:
    # Mirrors Triton's own parsing exactly, so that we never disagree with Triton about
    # whether the interpreter is on.
    return os.environ.get(name, "").lower() in _TRUE


environment_variables: dict[str, Callable[[], Any]] = {
    "VLLM_USE_TRITON_CONV1D": lambda: _flag("VLLM_USE_TRITON_CONV1D", default=True),
    "VLLM_BUILD_CUDA_OPS": lambda: _optional_flag("VLLM_BUILD_CUDA_OPS"),
    "VLLM_LOGGING_LEVEL": lambda: _level("VLLM_LOGGING_LEVEL", "INFO"),
    "VLLM_API_KEY": lambda: os.environ.get("VLLM_API_KEY") or None,
    "VLLM_ENABLE_V1_MULTIPROCESSING": lambda: _flag("VLLM_ENABLE_V1_MULTIPROCESSING", True),
    "VLLM_USE_REPLAYSSM": lambda: _optional_flag("VLLM_USE_REPLAYSSM"),
    "HF_HUB_OFFLINE": _hf_offline,
    "TRITON_INTERPRET": lambda: _triton_flag("TRITON_INTERPRET"),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
