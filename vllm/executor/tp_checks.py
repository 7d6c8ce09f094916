"""Whether a model configuration shards over N tensor-parallel ranks, checked before any
process starts.

The rules are the layers' own (``mamba_tp.mamba2_tp_problems`` for Mamba2 heads and
groups, ``linear.qkv_tp_problems`` for attention heads, the MLP's even split); this module
only finds the fields in a config, under the names the served models' configs use:

    Mamba heads   num_heads (Mamba2), mamba_n_heads (Bamba), mamba_num_heads (NemotronH),
                  n_mamba_heads (Zamba2)
    Mamba groups  n_groups (Mamba2, NemotronH), mamba_n_groups (Bamba), mamba_ngroups (Zamba2)
    attention     num_attention_heads, num_key_value_heads (None: as many as heads)
    MLP           intermediate_size, where the config has attention (hybrids)

Zamba2's adapters need no field of their own: their up-projections are as wide as the
q/k/v heads (with adapters there are as many KV heads as heads) and as gate_up.
"""

from __future__ import annotations

from typing import Any

from vllm.model_executor.layers.linear import qkv_tp_problems
from vllm.model_executor.layers.mamba.mamba_tp import mamba2_tp_problems

MAMBA_HEAD_FIELDS = ("num_heads", "mamba_n_heads", "mamba_num_heads", "n_mamba_heads")
MAMBA_GROUP_FIELDS = ("n_groups", "mamba_n_groups", "mamba_ngroups")


def _field(config: Any, names: tuple[str, ...]) -> tuple[str, int] | None:
    for name in names:
        value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
        if value is not None:
            return name, value
    return None


def tp_problems(config: Any, tp_size: int) -> list[str]:
    """Every reason ``config`` (a model config object or a config.json dict) cannot shard
    over ``tp_size`` ranks, naming the config's fields; empty when it can."""
    problems: list[str] = []
    heads = _field(config, MAMBA_HEAD_FIELDS)
    if heads is not None:
        groups = _field(config, MAMBA_GROUP_FIELDS) or ("n_groups", 1)
        names = (heads[0], groups[0])
        problems += mamba2_tp_problems(heads[1], groups[1], tp_size, names)
    attn = _field(config, ("num_attention_heads",))
    if attn is not None:
        kv = _field(config, ("num_key_value_heads",))
        problems += qkv_tp_problems(attn[1], kv[1] if kv else attn[1], tp_size)
        # The hybrids' MLP (a Mamba2 config's intermediate_size is its mixer's, heads x
        # head_dim, which the heads' check covers).
        mlp = _field(config, ("intermediate_size",))
        if mlp is not None and mlp[1] % tp_size:
            problems.append(f"intermediate_size={mlp[1]} is not divisible by tp_size={tp_size}")
    return problems


def check_tp_divisibility(config: Any, tp_size: int) -> None:
    """Raise ValueError, listing every field that does not shard, when ``config`` cannot
    run on ``tp_size`` ranks; call it before starting any worker process."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp_size!r}")
    problems = tp_problems(config, tp_size)
    if problems:
        kind = "config" if isinstance(config, dict) else type(config).__name__
        raise ValueError(
            f"tensor_parallel_size={tp_size} does not fit this model ({kind}): "
            + "; ".join(problems)
        )
