"""Reading HF ``config.json`` files into our frozen model configs: the shared checks, and
the shape views every config gives.

Every model config of the registry (``registry.py``) is a frozen dataclass whose field
names are those of the transformers config it mirrors, with transformers' defaults, so a
``config.json`` written by ``save_pretrained`` (any transformers release that names the
fields so) maps field by field; keys that do not change inference are accepted and ignored.
``fields_from_dict`` does that mapping (aliases for renamed keys, the JSON forms of inf);
``check_*`` give the errors a user sees, each naming the field.

Each config also derives from ``ModelShapes``: ``mamba_shape()`` (a ``Mamba2Shape``),
``attention_shape()`` and ``mlp_size()`` put its sizes under one set of names, which the
models build their layers from, and ``check_tp(tp_size)`` checks them against the
tensor-parallel rules of those layers, naming the config's own fields.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Self

from vllm.model_executor.layers.linear import qkv_tp_problems
from vllm.model_executor.layers.mamba.mamba_tp import mamba2_tp_problems
from vllm.model_executor.layers.mamba.mamba_utils import Mamba2Shape


@dataclass(frozen=True)
class AttentionShape:
    """An attention layer's heads under one set of names: what its ``QKVParallelLinear``
    and ``Attention`` are built from (whole-model counts; each rank takes its part)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int


class ModelShapes:
    """The shape views a model config gives beside its fields, and the tensor-parallel
    check that reads them."""

    # The config's names of the Mamba head and group counts, for check_tp's messages.
    mamba_tp_fields: ClassVar[tuple[str, str]] = ("num_heads", "n_groups")

    def mamba_shape(self) -> Mamba2Shape:
        raise NotImplementedError

    def attention_shape(self) -> AttentionShape | None:
        """The attention layers' heads (None: the model has no attention)."""
        return None

    def mlp_size(self) -> int | None:
        """``intermediate_size`` of the MLPs, cut column- then row-parallel (None: none)."""
        return None

    def tp_problems(self, tp_size: int) -> list[str]:
        """Every reason the model cannot shard over ``tp_size`` ranks, naming the field;
        empty when it can."""
        mamba = self.mamba_shape()
        problems = mamba2_tp_problems(
            mamba.num_heads, mamba.n_groups, tp_size, self.mamba_tp_fields
        )
        attention = self.attention_shape()
        if attention is not None:
            problems += qkv_tp_problems(attention.num_heads, attention.num_kv_heads, tp_size)
        mlp = self.mlp_size()
        if mlp is not None and mlp % tp_size:
            problems.append(f"intermediate_size={mlp} is not divisible by tp_size={tp_size}")
        return problems

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> Self:
        """From ``model_dir/config.json`` (each config's ``from_dict`` maps the fields)."""
        return cls.from_dict(read_config_json(model_dir))

    def check_tp(self, tp_size: int) -> None:
        """ValueError listing every field that does not shard over ``tp_size`` ranks; the
        engine calls it before any worker process starts."""
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp_size!r}")
        problems = self.tp_problems(tp_size)
        if problems:
            raise ValueError(
                f"tensor_parallel_size={tp_size} does not fit this model "
                f"({type(self).__name__}): " + "; ".join(problems)
            )


class BambaMambaFields(ModelShapes):
    """A config that spells its Mamba2 mixers with Bamba's field names (``mamba_n_heads``,
    ``mamba_d_head``, ``mamba_n_groups``, ``mamba_d_state``, ``mamba_d_conv``,
    ``mamba_chunk_size``, ``mamba_proj_bias``, ``mamba_conv_bias``), as GraniteMoeHybrid's
    and Falcon-H1's do, with ``rms_norm_eps`` and a ``time_step_limit``."""

    @property
    def chunk_size(self) -> int:
        return self.mamba_chunk_size

    def mamba_shape(self) -> Mamba2Shape:
        return Mamba2Shape(
            hidden_size=self.hidden_size,
            num_heads=self.mamba_n_heads,
            head_dim=self.mamba_d_head,
            n_groups=self.mamba_n_groups,
            state_size=self.mamba_d_state,
            conv_kernel=self.mamba_d_conv,
            chunk_size=self.mamba_chunk_size,
            use_bias=self.mamba_proj_bias,
            use_conv_bias=self.mamba_conv_bias,
            norm_eps=self.rms_norm_eps,
            time_step_limit=self.time_step_limit,
        )


def read_config_json(model_dir: str | os.PathLike) -> dict[str, Any]:
    """``model_dir/config.json`` as a dict; clear errors for a missing or broken file."""
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in model directory {str(path)!r}")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_file} is not valid JSON: {err}") from err
    if not isinstance(raw, dict):
        raise ValueError(f"{config_file} must hold a JSON object")
    return raw


def as_float(name: str, value: Any) -> float:
    """A number; save_pretrained writes inf as {"__float__": "Infinity"}, plain JSON may
    say "Infinity"."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        value = value["__float__"]
    if isinstance(value, bool):
        raise ValueError(f"config field {name}: expected a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"config field {name}: expected a number, got {value!r}") from None


def as_limit(name: str, value: Any) -> tuple[float, float]:
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise ValueError(f"config field {name} must be [min, max], got {value}")
    lo, hi = as_float(name, value[0]), as_float(name, value[1])
    if not 0.0 <= lo <= hi:
        raise ValueError(f"config field {name}={[lo, hi]} is invalid (need 0 <= min <= max)")
    return lo, hi


def fields_from_dict(
    cls,
    raw: dict[str, Any],
    aliases: dict[str, tuple[str, ...]] | None = None,
    floats: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Keyword arguments of dataclass ``cls`` from ``raw``: each field by its name, else by
    its ``aliases`` (older key names, first found wins), skipping absent and null keys.
    ``dtype`` is also read from ``torch_dtype``; fields in ``floats`` go through
    ``as_float`` (so inf written either way reads back)."""
    aliases = {"dtype": ("torch_dtype",), **(aliases or {})}
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        if not f.init:
            continue
        for key in (f.name, *aliases.get(f.name, ())):
            if raw.get(key) is not None:
                value = raw[key]
                kwargs[f.name] = as_float(key, value) if f.name in floats else value
                break
    return kwargs


def check_required(raw: dict[str, Any], names: tuple[str, ...]) -> None:
    """ValueError naming the keys of ``names`` that ``raw`` lacks."""
    missing = [n for n in names if n not in raw]
    if missing:
        raise ValueError(f"config is missing required fields: {', '.join(missing)}")


def block_types(listed: Any, kinds: dict[str, str]) -> tuple[str, ...]:
    """Our layer kinds from a ``layers_block_type`` list (``kinds``: its names -> ours)."""
    if not isinstance(listed, list) or any(t not in kinds for t in listed):
        raise ValueError(
            f"config field layers_block_type must be a list of {sorted(kinds)}, got {listed!r}"
        )
    return tuple(kinds[t] for t in listed)


def check_positive_ints(config, names) -> None:
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"config field {name} must be a positive integer, got {value!r}")


def check_bools(config, names) -> None:
    for name in names:
        if not isinstance(getattr(config, name), bool):
            raise ValueError(
                f"config field {name} must be true or false, got {getattr(config, name)!r}"
            )


def check_mamba_shape(
    *, hidden: int, heads: int, head_dim: int, groups: int, conv: int, inter: int | None
) -> None:
    """The Mamba2 mixer's shape rules; ``inter`` is expand * hidden where the config
    derives the inner width from it (None where it is heads * head_dim by definition)."""
    if inter is not None and inter != heads * head_dim:
        raise ValueError(
            f"config: the mamba inner size {inter} must equal mamba heads * head dim = "
            f"{heads} * {head_dim}"
        )
    if heads % groups:
        raise ValueError(f"config: mamba heads={heads} must be a multiple of n_groups={groups}")
    if not 2 <= conv <= 8:
        raise ValueError(
            f"config: mamba conv kernel {conv} is not supported (the conv kernels take widths 2..8)"
        )


def check_attention_heads(num_heads: int, num_kv_heads: int) -> None:
    if num_heads % num_kv_heads:
        raise ValueError(
            f"config: num_attention_heads={num_heads} must be a multiple of "
            f"num_key_value_heads={num_kv_heads}"
        )


def rope_settings(raw: dict[str, Any], default_factor: float = 1.0) -> dict[str, float]:
    """``rope_theta`` and ``partial_rotary_factor`` from ``rope_parameters`` (transformers
    5) or the top-level keys (older configs); only the default (unscaled) RoPE is served."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"config field rope_parameters must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"config: rope_type {rope_type!r} is not supported (only the default, unscaled RoPE)"
        )
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", default_factor))
    out = {
        "rope_theta": as_float("rope_theta", theta),
        "partial_rotary_factor": as_float("partial_rotary_factor", factor),
    }
    if not out["rope_theta"] > 0 or not 0 < out["partial_rotary_factor"] <= 1:
        raise ValueError(f"config: invalid RoPE settings {out}")
    return out
