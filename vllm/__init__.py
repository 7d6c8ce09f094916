"""Mamba2 inference in vLLM's layout, served through this project's Triton causal-conv1d kernels.

Kept light on purpose: importing `vllm` loads neither torch nor triton. ``vllm.LLM`` and
``vllm.SamplingParams`` are resolved on first access (module ``__getattr__``).
"""

__version__ = "0.1.0"

_LAZY = {
    "LLM": "vllm.entrypoints.llm",
    "SamplingParams": "vllm.sampling_params",
    "RequestOutput": "vllm.outputs",
    "CompletionOutput": "vllm.outputs",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vllm' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
