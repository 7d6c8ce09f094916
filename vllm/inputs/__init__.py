"""The prompt shapes ``LLM.generate`` takes, as vLLM names them (``vllm.inputs``)."""

from vllm.inputs.data import PromptType, TextPrompt, TokensPrompt

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]
