"""The model registry: a checkpoint's ``architectures`` -> our config class and model class.

    arch = resolve_architecture(raw_config_json)     # "BambaForCausalLM", ...
    config = load_model_config("path/to/model")      # the registered config, checked
    cls = model_class(config)                         # e.g. BambaForCausalLM

``architectures`` (the first entry we serve wins) names the model; a config.json without
it falls back to its ``model_type``. Anything else is refused with the list of what is
served. Model modules are imported on first use, so reading a config imports no model.

Every registered model class has the same face (``Mamba2ForCausalLM`` is the example):
``__init__(config, dtype)``; ``forward(input_ids, metadata=None, state=None,
positions=None)`` inside the step's forward context; ``compute_logits``;
``get_cache_specs(block_size, mamba_ssm_dtype)`` (per-layer specs the engine allocates);
``metadata_builder(device)``; ``set_conv_backend``; ``load_weights``.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from vllm.model_executor.models.config_utils import read_config_json

# architecture -> (model module, config module, config class)
_MODELS: dict[str, tuple[str, str, str]] = {
    "Mamba2ForCausalLM": ("mamba2", "mamba2_config", "Mamba2ModelConfig"),
    "BambaForCausalLM": ("bamba", "bamba_config", "BambaModelConfig"),
    "NemotronHForCausalLM": ("nemotron_h", "nemotron_h_config", "NemotronHModelConfig"),
    "Zamba2ForCausalLM": ("zamba2", "zamba2_config", "Zamba2ModelConfig"),
    "Lfm2ForCausalLM": ("lfm2", "lfm2_config", "Lfm2ModelConfig"),
    "MambaForCausalLM": ("mamba", "mamba_config", "MambaModelConfig"),
    "FalconMambaForCausalLM": ("mamba", "mamba_config", "FalconMambaModelConfig"),
    "GraniteMoeHybridForCausalLM": (
        "granitemoehybrid",
        "granitemoehybrid_config",
        "GraniteMoeHybridModelConfig",
    ),
    "JambaForCausalLM": ("jamba", "jamba_config", "JambaModelConfig"),
    "FalconH1ForCausalLM": ("falcon_h1", "falcon_h1_config", "FalconH1ModelConfig"),
}
_MODEL_TYPES = {
    "mamba2": "Mamba2ForCausalLM",
    "bamba": "BambaForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "zamba2": "Zamba2ForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "mamba": "MambaForCausalLM",
    "falcon_mamba": "FalconMambaForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "jamba": "JambaForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM",
}
_PACKAGE = "vllm.model_executor.models"


def supported_architectures() -> list[str]:
    return list(_MODELS)


def _unsupported(what: str) -> ValueError:
    return ValueError(
        f"unsupported model: {what}; the architectures served are "
        f"{', '.join(supported_architectures())}"
    )


def resolve_architecture(raw: dict[str, Any]) -> str:
    """The registered architecture a config.json describes; ValueError listing the
    supported ones otherwise."""
    architectures = raw.get("architectures") or []
    if not isinstance(architectures, list):
        raise ValueError(f"config field architectures must be a list, got {architectures!r}")
    for arch in architectures:
        if arch in _MODELS:
            return arch
    model_type = raw.get("model_type")
    if not architectures and model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise _unsupported(f"architectures={architectures}, model_type={model_type!r}")


def config_class(architecture: str) -> type:
    if architecture not in _MODELS:
        raise _unsupported(f"architecture {architecture!r}")
    _, module, name = _MODELS[architecture]
    return getattr(importlib.import_module(f"{_PACKAGE}.{module}"), name)


def config_classes() -> list[type]:
    return [config_class(arch) for arch in _MODELS]


def is_model_config(obj: Any) -> bool:
    """Whether ``obj`` is a config instance of a registered model (a dummy-weight model
    can be built from it without a directory)."""
    return any(isinstance(obj, cls) for cls in config_classes())


def load_model_config(model: str | os.PathLike | Any):
    """The registered config of a model directory, or ``model`` itself when it already is
    a registered config."""
    if is_model_config(model):
        return model
    raw = read_config_json(model)
    return config_class(resolve_architecture(raw)).from_dict(raw)


def model_class(config) -> type:
    """The model class for a registered config instance."""
    if not is_model_config(config):
        raise TypeError(f"not a registered model config: {type(config).__name__}")
    module, _, _ = _MODELS[config.architecture]
    return getattr(importlib.import_module(f"{_PACKAGE}.{module}"), config.architecture)
