"""get_model: config, then the model on its device, then its weights."""

from __future__ import annotations

from pathlib import Path

import torch

from vllm.distributed.parallel_state import get_tp_group
from vllm.model_executor.model_loader.weight_utils import (
    initialize_dummy_weights,
    iterate_checkpoint_slices,
)
from vllm.model_executor.models.registry import is_model_config, load_model_config, model_class

LOAD_FORMATS = ("auto", "safetensors", "dummy")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_dtype(dtype: torch.dtype | str | None, config) -> torch.dtype:
    """None or "auto": the config's dtype (fp32 when it names none)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(
                f"dtype {dtype} is not supported; use one of float32, float16, bfloat16"
            )
        return dtype
    if dtype is None or dtype == "auto":
        dtype = config.dtype or "float32"
    key = str(dtype).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {', '.join(_DTYPES)}")
    return _DTYPES[key]


def check_tensor_parallel_support(cls, tp_size: int) -> None:
    """Refuse a model class that does not shard its layers (no ``supports_tensor_parallel``;
    every registered model has it) for ``tp_size`` > 1 ranks."""
    if tp_size > 1 and not getattr(cls, "supports_tensor_parallel", False):
        raise ValueError(
            f"tensor_parallel_size={tp_size}: {cls.__name__} does not support tensor "
            "parallelism yet (Mamba2ForCausalLM, BambaForCausalLM, NemotronHForCausalLM and "
            "Zamba2ForCausalLM are sharded); use tensor_parallel_size=1"
        )


def get_model(
    model,
    *,
    load_format: str = "auto",
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
):
    """The registered model (``registry.py``: Mamba2, Bamba, NemotronH, Zamba2) in eval
    mode on ``device``.

    ``model`` is an HF model directory (``config.json`` naming a registered architecture,
    plus ``*.safetensors`` unless ``load_format="dummy"``), or a registered config such as
    ``Mamba2ModelConfig`` (dummy weights only). ``seed`` seeds the dummy weights. The conv
    backend is the one ``VLLM_USE_TRITON_CONV1D`` selects now. In a tensor-parallel
    group (``vllm.distributed``) the model is this rank's part: checkpoint tensors are
    read as lazy slices (each rank reads its rows only; at world size 1 all of them), dummy
    weights drawn at full shape and loaded the same way (the same weights at every size).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    if is_model_config(model):
        model_dir = None
        if load_format != "dummy":
            raise ValueError(
                "a config without a model directory has no weights to load: pass "
                "load_format='dummy' for random weights"
            )
    else:
        model_dir = Path(model)
    config = load_model_config(model)
    torch_dtype = resolve_dtype(dtype, config)
    cls = model_class(config)
    check_tensor_parallel_support(cls, get_tp_group().world_size)
    with torch.device(device):
        net = cls(config, dtype=torch_dtype)
    if load_format == "dummy":
        initialize_dummy_weights(net, seed)
    else:
        net.load_weights(iterate_checkpoint_slices(model_dir))
    # An inference engine: no forward may record an autograd graph (a 7B step that
    # did would keep every layer's activations alive).
    net.requires_grad_(False)
    return net.eval()
