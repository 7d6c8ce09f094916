"""``EngineConfig`` lives in ``vllm/config.py`` (the worker reads it, and nothing of the
worker's may import the engine). This name stays only for ``async_llm.py`` until its loop
moves onto the engine-core client; nothing else imports it."""

from vllm.config import EngineConfig

__all__ = ["EngineConfig"]
