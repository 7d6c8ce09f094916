"""What every model of the registry does the same way: cache specs and step checks.

- ``cache_specs``: one spec per layer that keeps state, found by walking the modules: a
  Mamba mixer (``get_state_spec``) gives a ``MambaStateSpec``, an attention layer
  (``get_kv_cache_spec``) an ``AttentionSpec``; keys are the modules' names, in the
  model's layer order, so the engine can hand each layer its tensors.
- ``check_step_inputs``: a forward step's input checks (shapes, the state pool's shape
  and conv layout), with the errors every model gives.

Weights load through ``model_loader.weight_utils.load_model_weights``; logits through the
model's ``ParallelLMHead``.
"""

from __future__ import annotations

import torch
from torch import nn


def cache_specs(model: nn.Module, block_size: int, mamba_ssm_dtype: torch.dtype) -> dict:
    specs = {}
    for name, module in model.named_modules():
        if hasattr(module, "get_state_spec"):
            specs[name] = module.get_state_spec(model.dtype, mamba_ssm_dtype)
        elif hasattr(module, "get_kv_cache_spec"):
            specs[name] = module.get_kv_cache_spec(block_size, model.dtype)
    return specs


def check_step_inputs(
    name: str,
    input_ids: torch.Tensor,
    positions: torch.Tensor | None,
    metadata,
    state,
    *,
    num_layers: int,
    spec,
    backend,
) -> None:
    """ValueError unless ``state`` is a pool of ``num_layers`` layers of ``spec`` in the
    ``backend`` layout and ``input_ids`` (and ``positions``, when given) are
    (metadata.num_tokens,); ``name``: the model, for the message of a missing pool."""
    if state is None:
        raise ValueError(f"{name} needs the state pool (state=...)")
    if input_ids.dim() != 1 or input_ids.shape[0] != metadata.num_tokens:
        raise ValueError(
            f"input_ids must be (num_tokens={metadata.num_tokens},), got {tuple(input_ids.shape)}"
        )
    if positions is not None and tuple(positions.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"positions must be (num_tokens={metadata.num_tokens},), got {tuple(positions.shape)}"
        )
    if state.num_layers != num_layers or state.spec != spec:
        raise ValueError("the state pool was allocated for another model shape")
    if state.backend is not backend:
        raise ValueError(
            f"the state pool has the {state.backend.value} conv layout but the model "
            f"uses the {backend.value} backend"
        )
