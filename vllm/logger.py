"""The project's loggers: ``init_logger(__name__)`` under one "vllm" logger that prints to
stderr at ``VLLM_LOGGING_LEVEL`` (default INFO), as vLLM's start-up lines do."""

from __future__ import annotations

import logging
import sys

from vllm import envs

_ROOT = "vllm"
_configured = False


def _configure() -> None:
    global _configured
    root = logging.getLogger(_ROOT)
    root.setLevel(envs.VLLM_LOGGING_LEVEL)
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(
            logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%m-%d %H:%M:%S")
        )
        root.addHandler(handler)
    root.propagate = False
    _configured = True


def init_logger(name: str) -> logging.Logger:
    if not _configured:
        _configure()
    return logging.getLogger(name if name.startswith(_ROOT) else f"{_ROOT}.{name}")
