"""Model definitions."""

from vllm.model_executor.models.mamba2 import Mamba2ForCausalLM
from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig

__all__ = ["Mamba2ForCausalLM", "Mamba2ModelConfig"]
