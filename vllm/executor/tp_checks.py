"""Whether a model configuration shards over N tensor-parallel ranks, checked before any
process starts.

Every model config answers for itself (``check_tp``, ``models/config_utils.ModelShapes``):
it reads its normalised shape views (Mamba heads and groups, attention and KV heads, the
MLP's size) against the layers' own rules and names its own fields in the message.
"""

from __future__ import annotations

from typing import Any


def check_tp_divisibility(config: Any, tp_size: int) -> None:
    """Raise ValueError, listing every field that does not shard, when ``config`` (a
    registered model config) cannot run on ``tp_size`` ranks; call it before starting any
    worker process."""
    if not callable(getattr(config, "check_tp", None)):
        raise TypeError(f"not a registered model config: {type(config).__name__}")
    config.check_tp(tp_size)
