"""What every model of the registry does the same way: cache specs, weights, logits.

- ``cache_specs``: one spec per layer that keeps state, found by walking the modules: a
  Mamba mixer (``get_state_spec``) gives a ``MambaStateSpec``, an attention layer
  (``get_kv_cache_spec``) an ``AttentionSpec``; keys are the modules' names, in the
  model's layer order, so the engine can hand each layer its tensors.
- ``load_named_weights``: an HF checkpoint's (name, tensor) pairs into the parameters,
  through the model's name map, with the errors a user can act on.
- ``check_step_inputs``: a forward step's input checks (shapes, the state pool's shape
  and conv layout), with the errors every model gives.
- ``lm_logits``: fp32 logits of final hidden states against the head (or the tied
  embeddings).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn


def cache_specs(model: nn.Module, block_size: int, mamba_ssm_dtype: torch.dtype) -> dict:
    specs = {}
    for name, module in model.named_modules():
        if hasattr(module, "get_state_spec"):
            specs[name] = module.get_state_spec(model.dtype, mamba_ssm_dtype)
        elif hasattr(module, "get_kv_cache_spec"):
            specs[name] = module.get_kv_cache_spec(block_size, model.dtype)
    return specs


@torch.no_grad()
def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    to_param_name: Callable[[str], str | None],
) -> None:
    """Copy (name, tensor) pairs of an HF checkpoint into ``model``'s parameters.

    ``to_param_name`` maps a checkpoint name to ours (None: a tensor to skip). Conv
    weights in nn.Conv1d's (dim, 1, width) layout are squeezed to ours (dim, width). A
    parameter several checkpoint names map to (a tied copy) must get equal tensors.
    Raises ValueError for a shape mismatch, an unknown name, unequal tied copies, or a
    missing parameter.
    """
    params = dict(model.named_parameters())
    loaded: dict[str, str] = {}
    unknown: list[str] = []
    for ckpt_name, tensor in weights:
        name = to_param_name(ckpt_name)
        if name is None:
            continue
        param = params.get(name)
        if param is None:
            unknown.append(ckpt_name)
            continue
        if name.endswith("conv1d.weight") and tensor.dim() == 3 and tensor.shape[1] == 1:
            tensor = tensor.squeeze(1)
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"weight {ckpt_name!r} has shape {tuple(tensor.shape)} in the checkpoint, "
                f"but the config makes {name!r} {tuple(param.shape)}: the weights do not "
                "belong to this config.json"
            )
        if name in loaded:
            if not torch.equal(param.cpu(), tensor.to(param.dtype)):
                raise ValueError(
                    f"checkpoint weights {loaded[name]!r} and {ckpt_name!r} are copies of the "
                    f"shared parameter {name!r} but differ"
                )
            continue
        param.copy_(tensor)
        loaded[name] = ckpt_name
    if unknown:
        raise ValueError(f"checkpoint has weights this model does not know: {sorted(unknown)}")
    missing = sorted(set(params) - set(loaded))
    if missing:
        raise ValueError(f"checkpoint lacks weights the model needs: {missing}")


def lm_logits(hidden_states: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
    """fp32 logits (rows, vocab) of final hidden states."""
    return F.linear(hidden_states.to(head_weight.dtype), head_weight).float()


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
