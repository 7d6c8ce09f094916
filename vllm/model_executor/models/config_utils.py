"""Reading HF ``config.json`` files into our frozen model configs: the shared checks.

Every model config of the registry (``registry.py``) is a frozen dataclass whose field
names are those of the transformers config it mirrors, with transformers' defaults, so a
``config.json`` written by ``save_pretrained`` (any transformers release that names the
fields so) maps field by field; keys that do not change inference are accepted and ignored.
``fields_from_dict`` does that mapping (aliases for renamed keys, the JSON forms of inf);
``check_*`` give the errors a user sees, each naming the field.
"""

from __future__ import annotations

import json
import os
from dataclasses import fields
from pathlib import Path
from typing import Any


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
