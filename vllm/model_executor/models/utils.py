"""What every model of the registry does the same way: cache specs and step checks.

- ``cache_specs``: one spec per layer that keeps state, found by walking the modules: a
  Mamba mixer (``get_state_spec``) gives a ``MambaStateSpec``, an attention layer
  (``get_kv_cache_spec``) an ``AttentionSpec``; keys are the modules' names, in the
  model's layer order, so the engine can hand each layer its tensors.
- ``bind_kv_cache``: hands each stateful layer what the engine allocated for it (vLLM's
  name); ``bind_state_pool`` binds a Mamba state pool's layers, ``allocate_state_pool``
  makes and binds one for callers without the engine.
- ``check_step_inputs``: a forward step's input checks, with the errors every model gives.

Weights load through ``model_loader.weight_utils.load_model_weights``; logits through the
model's ``ParallelLMHead``.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from vllm.cache_spec import MambaStateSpec
from vllm.model_executor.layers.mamba.mamba_utils import MambaStatePool


def cache_specs(model: nn.Module, block_size: int, mamba_ssm_dtype: torch.dtype) -> dict:
    specs = {}
    for name, module in model.named_modules():
        if hasattr(module, "get_state_spec"):
            specs[name] = module.get_state_spec(model.dtype, mamba_ssm_dtype)
        elif hasattr(module, "get_kv_cache_spec"):
            specs[name] = module.get_kv_cache_spec(block_size, model.dtype)
    return specs


def bind_kv_cache(model: nn.Module, caches: dict[str, object]) -> None:
    """Hand each stateful layer its views (vLLM's ``bind_kv_cache``): ``caches`` maps a
    module name of ``get_cache_specs`` to what the engine allocated for it (an attention
    layer's KV tensor, a Mamba layer's (conv_state, ssm_state) views of the state pool), set
    as the layer's ``kv_cache``. None unbinds."""
    for name, cache in caches.items():
        module = model.get_submodule(name)
        if not hasattr(module, "kv_cache"):
            raise ValueError(f"module {name!r} ({type(module).__name__}) keeps no state to bind")
        module.kv_cache = cache


def mamba_layer_names(model: nn.Module) -> list[str]:
    """The names of the layers that declare a Mamba state, in layer order (the pool's)."""
    return [name for name, m in model.named_modules() if hasattr(m, "get_state_spec")]


def bind_state_pool(model: nn.Module, pool, names: list[str] | None = None) -> None:
    """Bind layer i of the ``MambaStatePool`` to the Mamba layer ``names[i]`` (by default
    the model's Mamba layers in order)."""
    names = mamba_layer_names(model) if names is None else names
    if len(names) != pool.num_layers:
        raise ValueError(f"{len(names)} Mamba layers but a pool of {pool.num_layers} layers")
    bind_kv_cache(model, {name: pool.layer(i) for i, name in enumerate(names)})


def check_step_inputs(
    name: str, input_ids: torch.Tensor, positions: torch.Tensor | None, metadata
) -> None:
    """ValueError unless ``input_ids`` (and ``positions``, when given) are
    (metadata.num_tokens,); RuntimeError when the forward context has no Mamba2 metadata
    (``name``: the model, for the message)."""
    if metadata is None:
        raise RuntimeError(
            f"{name}: the forward context carries no Mamba2 metadata; run the model inside "
            "set_forward_context(ForwardContext(mamba2_metadata=...)), as the runner does"
        )
    if input_ids.dim() != 1 or input_ids.shape[0] != metadata.num_tokens:
        raise ValueError(
            f"input_ids must be (num_tokens={metadata.num_tokens},), got {tuple(input_ids.shape)}"
        )
    if positions is not None and tuple(positions.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"positions must be (num_tokens={metadata.num_tokens},), got {tuple(positions.shape)}"
        )


def allocate_state_pool(
    model: nn.Module,
    num_slots: int,
    device: torch.device | str,
    ssm_dtype: torch.dtype = torch.float32,
    replayssm_buffer_len: int = 0,
) -> MambaStatePool:
    """A ``MambaStatePool`` for ``num_slots`` sequences from ``model``'s cache specs, in its
    conv backend's layout, bound to its Mamba layers; for callers that drive a model
    without the engine (tests, benchmarks). ``replayssm_buffer_len`` L > 0 adds the replay
    rings (replayed decode)."""
    specs = {
        n: replace(s, replay_len=replayssm_buffer_len)
        for n, s in cache_specs(model, 1, ssm_dtype).items()
        if isinstance(s, MambaStateSpec)
    }
    pool = MambaStatePool.from_specs(list(specs.values()), num_slots, model.conv_backend, device)
    bind_state_pool(model, pool, list(specs))
    return pool
