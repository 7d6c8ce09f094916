"""Mamba2ForCausalLM: embeddings, N x (RMSNorm + MambaMixer2) with a residual, final norm, lm head.

One forward step runs a whole continuous-batching step: the tokens of every sequence,
concatenated, with the step's ``Mamba2Metadata`` (built once by the runner through
``metadata_builder``) in the forward context. Each mixer reads its own state, the views of
the pool the engine allocated from ``get_cache_specs`` and bound to it::

    builder = model.metadata_builder(device)
    pool = model.allocate_state_pool(num_slots)  # allocates from the specs and binds
    md = builder.build(query_start_loc_cpu, state_indices_cpu, has_initial_state_cpu)
    with set_forward_context(ForwardContext(mamba2_metadata=md)):
        hidden = model(input_ids, positions)     # (num_tokens, hidden), input order
    logits = model.compute_logits(hidden[last_token_rows])

as the engine runs every model of the registry (``registry.py``).

The residual stream is fp32 when ``residual_in_fp32`` (as in HF transformers). Parameter
names are HF transformers' (``backbone.layers.{i}.mixer.in_proj.weight``, ...), with the
conv weight stored as (dim, width); ``load_weights`` maps a checkpoint onto them. The layers
are the parallel ones (``VocabParallelEmbedding``, ``MambaMixer2``, ``ParallelLMHead``), so
the same model runs on one rank or as one rank's part of a tensor-parallel group.
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
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from vllm.model_executor.layers.mamba.mamba_utils import (
    ConvBackend,
    Mamba2StateSpec,
    MambaStatePool,
)
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.model_loader.weight_utils import load_model_weights
from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig
from vllm.model_executor.models.utils import (
    allocate_state_pool,
    cache_specs,
    check_step_inputs,
)


class Mamba2DecoderLayer(nn.Module):
    def __init__(self, config: Mamba2ModelConfig, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        self.residual_in_fp32 = config.residual_in_fp32
        self.norm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon, dtype=dtype)
        self.mixer = self.make_mixer(config, layer_idx, dtype)

    @staticmethod
    def make_mixer(config, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        """The layer's mixer (``MambaDecoderLayer`` makes a Mamba1 one)."""
        return MambaMixer2(config.mamba_shape(), dtype=dtype, layer_idx=layer_idx)

    def forward(self, hidden_states, residual):
        """(mixer output, residual stream): the residual add of a layer is fused into the
        next layer's norm (and the final one's), so ``residual`` is None at layer 0 only."""
        if residual is None:
            residual = hidden_states.float() if self.residual_in_fp32 else hidden_states
            normed = self.norm(hidden_states)
        else:
            normed, residual = self.norm(hidden_states, residual)
        return self.mixer(normed), residual


class Mamba2Model(nn.Module):
    layer_cls: type[nn.Module] = Mamba2DecoderLayer

    def __init__(self, config: Mamba2ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            self.layer_cls(config, i, dtype) for i in range(config.num_hidden_layers)
        )
        self.norm_f = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, metadata: Mamba2Metadata) -> torch.Tensor:
        perm = metadata.token_perm
        if perm is not None:
            input_ids = input_ids.index_select(0, perm)
        hidden = self.embeddings(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual)
        hidden = self.norm_f(hidden) if residual is None else self.norm_f(hidden, residual)[0]
        if perm is not None:
            hidden = torch.empty_like(hidden).index_copy_(0, perm, hidden)
        return hidden


class Mamba2ForCausalLM(nn.Module):
    # Runs on a tensor-parallel group of any size its heads and groups shard over.
    supports_tensor_parallel = True
    model_cls: type[nn.Module] = Mamba2Model

    def __init__(self, config: Mamba2ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.backbone = self.model_cls(config, dtype)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype=dtype)
        if config.tie_word_embeddings:
            self.lm_head.tie_weights(self.backbone.embeddings)
        self.conv_backend = self.backbone.layers[0].mixer.backend

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Final hidden states (num_tokens, hidden) in the model dtype, in input order.

        The step's metadata comes from the forward context, each layer's state from its
        bound views. ``positions`` is not read (Mamba2 has no position input); the runner
        passes it to every model alike.
        """
        metadata = get_forward_context().mamba2_metadata
        check_step_inputs(type(self).__name__, input_ids, None, metadata)
        if metadata.num_tokens == 0:
            return torch.empty(
                0, self.config.hidden_size, dtype=self.dtype, device=input_ids.device
            )
        return self.backbone(input_ids, metadata)

    def set_conv_backend(self, backend: ConvBackend) -> None:
        """Switch every layer's conv backend (a benchmark compares both on one set of
        weights); pools allocated before keep the old layout and are rejected."""
        for layer in self.backbone.layers:
            layer.mixer.set_conv_backend(backend)
        self.conv_backend = backend

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits (rows, vocab) of final hidden states, the ranks' vocabulary parts
        gathered on rank 0 (None on the others of a tensor-parallel group)."""
        return self.lm_head.compute_logits(hidden_states, to_all_ranks=False)

    def get_cache_specs(self, block_size: int, mamba_ssm_dtype: torch.dtype) -> dict:
        """One ``MambaStateSpec`` per layer (no attention: ``block_size`` finds nothing)."""
        return cache_specs(self, block_size, mamba_ssm_dtype)

    def state_spec(self) -> Mamba2StateSpec:
        """One layer's per-slot state (this rank's heads)."""
        return self.backbone.layers[0].mixer.spec

    def allocate_state_pool(
        self,
        num_slots: int,
        device: torch.device | str | None = None,
        ssm_dtype: torch.dtype = torch.float32,
        replayssm_buffer_len: int = 0,
    ) -> MambaStatePool:
        """A pool for ``num_slots`` sequences from this model's cache specs, bound to its
        layers (``utils.allocate_state_pool``), for callers that drive the model without
        the engine (tests, benchmarks); the engine allocates and binds itself."""
        if device is None:
            device = self.backbone.embeddings.weight.device
        return allocate_state_pool(self, num_slots, device, ssm_dtype, replayssm_buffer_len)

    def metadata_builder(self, device: torch.device | str | None = None) -> Mamba2MetadataBuilder:
        if device is None:
            device = self.backbone.embeddings.weight.device
        return Mamba2MetadataBuilder(self.config.chunk_size, device)

    # Mamba2 checkpoints fuse nothing that we split, nor split what we fuse.
    stacked_params_mapping: tuple[tuple[str, str, str | int], ...] = ()

    def hf_to_param_name(self, name: str) -> str | None:
        """Our parameter name for a checkpoint name; None for a tensor to skip."""
        if name == "backbone.embedding.weight":  # original state-spaces checkpoints
            return "backbone.embeddings.weight"
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None  # tied: the embeddings serve as the head
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load (name, tensor) pairs of an HF checkpoint, each tensor (a full tensor or a
        lazy ``CheckpointSlice``) through its parameter's ``weight_loader``, which reads
        this rank's rows only. Raises ValueError for a shape mismatch, an unknown name, or
        a missing parameter."""
        load_model_weights(self, weights, self.hf_to_param_name, self.stacked_params_mapping)
