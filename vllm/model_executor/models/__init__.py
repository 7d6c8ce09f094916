"""Model definitions; ``get_model`` (the loader's, re-exported lazily: the loader imports
the models) builds one from a directory or a config."""

from vllm.model_executor.models.mamba2 import Mamba2ForCausalLM
from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig

__all__ = ["Mamba2ForCausalLM", "Mamba2ModelConfig", "get_model"]


def __getattr__(name: str):
    if name == "get_model":
        from vllm.model_executor.model_loader import get_model

        return get_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
