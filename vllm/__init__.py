"""Mamba2 inference in vLLM's layout, served through this project's Triton causal-conv1d kernels.

Kept light on purpose: importing `vllm` loads neither torch nor triton. ``vllm.LLM`` and
``vllm.SamplingParams`` are resolved on first access (module ``__getattr__``).

``__version__`` (also the installed distribution's version: setup.py reads it from here) is
the vLLM release whose Python API this package follows where clients look for it:
``vllm.inputs.TokensPrompt``, ``vllm.lora.request.LoRARequest``,
``vllm.transformers_utils.tokenizer.get_tokenizer`` and
``vllm.entrypoints.chat_utils.resolve_hf_chat_template`` sit where vLLM 0.10 has them, and
clients branch on the version (lm-eval's vllm backend does at 0.8.3 and 0.9.0). It is also
what ``/version`` answers.
"""

__version__ = "0.10.0"

_LAZY = {
    "LLM": "vllm.entrypoints.llm",
    "SamplingParams": "vllm.sampling_params",
    "RequestOutput": "vllm.outputs",
    "CompletionOutput": "vllm.outputs",
    "TextPrompt": "vllm.inputs",
    "TokensPrompt": "vllm.inputs",
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
