"""Helpers around HF transformers, where vLLM keeps them (``vllm.transformers_utils``)."""
