"""MambaForCausalLM and FalconMambaForCausalLM: embeddings, N x (RMSNorm + Mamba1 mixer)
with a residual, final norm, lm head.

The two differ only in their mixers: FalconMamba's RMS-normalises dt, B and C (no weight,
``mixer_rms_eps``), which its config's ``mamba1_shape()`` passes to ``MambaMixer``. As
transformers defines them (5.17 and 5.24 compute the same; they differ only in their cache
API)::

    h = embeddings(ids)
    for each layer:  r = h (fp32 when residual_in_fp32); h = r + mixer(norm(h))
    logits = lm_head(norm_f(h))                  # lm_head tied to embeddings by default

A forward runs a whole continuous-batching step, as ``Mamba2ForCausalLM``'s does: the
tokens of every sequence concatenated, the step's ``Mamba2Metadata`` (a builder without
chunk size, ``metadata_builder``) in the forward context, each mixer's state bound to it
by the engine from ``get_cache_specs``. Parameter names are transformers'
(``backbone.layers.{i}.mixer.in_proj.weight``, ...; the original state-spaces
``backbone.embedding.weight`` loads too), the conv weight stored as (dim, width). The
layers are the parallel ones, so the model is one rank's part at every world size.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.mamba.mamba2_metadata import (
    Mamba2Metadata,
    Mamba2MetadataBuilder,
)
from vllm.model_executor.layers.mamba.mamba_mixer import MambaMixer
from vllm.model_executor.layers.mamba.mamba_utils import ConvBackend, MambaStatePool
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.model_loader.weight_utils import load_model_weights
from vllm.model_executor.models.mamba_config import FalconMambaModelConfig, MambaModelConfig
from vllm.model_executor.models.utils import (
    allocate_state_pool,
    cache_specs,
    check_step_inputs,
)


class MambaDecoderLayer(nn.Module):
    def __init__(self, config: MambaModelConfig, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        self.residual_in_fp32 = config.residual_in_fp32
        self.norm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon, dtype=dtype)
        self.mixer = MambaMixer(config.mamba1_shape(), dtype=dtype, layer_idx=layer_idx)

    def forward(self, hidden_states, residual):
        """(mixer output, residual stream): a layer's residual add is fused into the next
        layer's norm (and the final one's), so ``residual`` is None at layer 0 only."""
        if residual is None:
            residual = hidden_states.float() if self.residual_in_fp32 else hidden_states
            normed = self.norm(hidden_states)
        else:
            normed, residual = self.norm(hidden_states, residual)
        return self.mixer(normed), residual


class MambaModel(nn.Module):
    def __init__(self, config: MambaModelConfig, dtype: torch.dtype):
        super().__init__()
        self.embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            MambaDecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers)
        )
        self.norm_f = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, metadata: Mamba2Metadata) -> torch.Tensor:
        perm = metadata.token_perm
        if perm is not None:
            input_ids = input_ids.index_select(0, perm)
        hidden, residual = self.embeddings(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual)
        hidden = self.norm_f(hidden) if residual is None else self.norm_f(hidden, residual)[0]
        if perm is not None:
            hidden = torch.empty_like(hidden).index_copy_(0, perm, hidden)
        return hidden


class MambaForCausalLM(nn.Module):
    # d_inner shards over the group (MambaMixer); embeddings and head by vocabulary.
    supports_tensor_parallel = True
    # Mamba1 checkpoints fuse nothing that we split, nor split what we fuse.
    stacked_params_mapping: tuple[tuple[str, str, str | int], ...] = ()

    def __init__(self, config: MambaModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.backbone = MambaModel(config, dtype)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype=dtype)
        if config.tie_word_embeddings:
            self.lm_head.tie_weights(self.backbone.embeddings)

    @property
    def conv_backend(self) -> ConvBackend:
        return self.backbone.layers[0].mixer.backend

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Final hidden states (num_tokens, hidden) in the model dtype, in input order.
        ``positions`` is not read (Mamba has no position input)."""
        metadata = get_forward_context().mamba2_metadata
        check_step_inputs(type(self).__name__, input_ids, None, metadata)
        if metadata.num_tokens == 0:
            return torch.empty(
                0, self.config.hidden_size, dtype=self.dtype, device=input_ids.device
            )
        return self.backbone(input_ids, metadata)

    def set_conv_backend(self, backend: ConvBackend) -> None:
        """Switch every layer's conv backend; pools allocated before keep the old layout
        and are rejected."""
        for layer in self.backbone.layers:
            layer.mixer.set_conv_backend(backend)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits (rows, vocab), the ranks' vocabulary parts gathered on rank 0 (None
        on the others of a tensor-parallel group)."""
        return self.lm_head.compute_logits(hidden_states, to_all_ranks=False)

    def get_cache_specs(self, block_size: int, mamba_ssm_dtype: torch.dtype) -> dict:
        """One ``MambaStateSpec`` per layer (no attention: ``block_size`` finds nothing)."""
        return cache_specs(self, block_size, mamba_ssm_dtype)

    def allocate_state_pool(
        self,
        num_slots: int,
        device: torch.device | str | None = None,
        ssm_dtype: torch.dtype = torch.float32,
        replayssm_buffer_len: int = 0,
    ) -> MambaStatePool:
        """A pool for ``num_slots`` sequences, bound to the layers, for callers without
        the engine (``utils.allocate_state_pool``)."""
        if device is None:
            device = self.backbone.embeddings.weight.device
        return allocate_state_pool(self, num_slots, device, ssm_dtype, replayssm_buffer_len)

    def metadata_builder(self, device: torch.device | str | None = None) -> Mamba2MetadataBuilder:
        """The step metadata's builder, without chunk layout (Mamba1 scans unchunked)."""
        if device is None:
            device = self.backbone.embeddings.weight.device
        return Mamba2MetadataBuilder(None, device)

    def hf_to_param_name(self, name: str) -> str | None:
        """Our parameter name for a checkpoint name; None for a tensor to skip."""
        if name == "backbone.embedding.weight":  # original state-spaces checkpoints
            return "backbone.embeddings.weight"
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None  # tied: the embeddings serve as the head
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load an HF checkpoint's (name, tensor) pairs, each through its parameter's
        ``weight_loader`` (this rank's rows only). ValueError for a shape mismatch, an
        unknown name, or a missing parameter."""
        load_model_weights(self, weights, self.hf_to_param_name, self.stacked_params_mapping)


class FalconMambaForCausalLM(MambaForCausalLM):
    """Mamba1 with FalconMamba's norms on dt, B and C (``FalconMambaModelConfig``)."""

    def __init__(self, config: FalconMambaModelConfig, dtype: torch.dtype = torch.float32):
        if not isinstance(config, FalconMambaModelConfig):
            raise TypeError(
                f"FalconMambaForCausalLM needs a FalconMambaModelConfig (its mixer_rms_eps), "
                f"got {type(config).__name__}"
            )
        super().__init__(config, dtype)
