"""The forward context: what one step's layers read, set once by the model runner.

The runner builds the step's metadata (Mamba2 metadata for the mixers, attention metadata
for attention layers) and runs the model inside ``set_forward_context``; a layer calls
``get_forward_context()`` and reads the part it needs, so the runner never has to know
which layers a model has. The context is per step and per thread (a CUDA-graph capture
sets it like a step does); reading it outside a step is an error, never a stale value.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass
class ForwardContext:
    """``mamba2_metadata``: a ``Mamba2Metadata`` (None when the step has no Mamba layer);
    ``attn_metadata``: an ``AttentionMetadata`` (None when the model has no attention
    layer); ``extra``: anything else a model family needs for the step, by name."""

    mamba2_metadata: Any = None
    attn_metadata: Any = None
    extra: dict[str, Any] | None = None


_local = threading.local()


@contextmanager
def set_forward_context(context: ForwardContext):
    """Make ``context`` the current step's for the body of the ``with``; nests (the outer
    context comes back on exit)."""
    previous = getattr(_local, "context", None)
    _local.context = context
    try:
        yield context
    finally:
        _local.context = previous


def get_forward_context() -> ForwardContext:
    context = getattr(_local, "context", None)
    if context is None:
        raise RuntimeError(
            "no forward context is set: layers that read the step's metadata run inside "
            "set_forward_context(...) (the model runner sets it for every step)"
        )
    return context
