"""The face the hybrid models (Bamba, NemotronH, Zamba2) share with ``Mamba2ForCausalLM``.

A subclass builds its layers (``_set_model``, or its own ``self.model`` and ``lm_head``)
and may override ``_run(input_ids, positions, state, metadata)`` (final hidden states)
and ``head_weight()``; this base checks a step's inputs, reads the Mamba2 metadata from
the forward context, and gives the engine the rest of the registry's interface:
``get_cache_specs``, ``metadata_builder``, ``set_conv_backend``, ``compute_logits`` and
``load_weights`` (through the subclass's ``hf_to_param_name``).

A step's tokens come in the canonical order of ``Mamba2Metadata`` (decode rows first, as
the scheduler batches them), because the attention metadata is built in the same order:
a batch the Mamba2 metadata would have to permute is refused.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vllm.distributed.parallel_state import get_tp_group
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.mamba.mamba2_metadata import (
    Mamba2Metadata,
    Mamba2MetadataBuilder,
)
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from vllm.model_executor.layers.mamba.mamba_utils import ConvBackend, MambaStatePool
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.model_loader.tp_weight_utils import load_tp_weights
from vllm.model_executor.models.utils import (
    cache_specs,
    check_step_inputs,
    lm_logits,
    load_named_weights,
)


def tp_world_size() -> int:
    return get_tp_group().world_size


def make_embedding(config, dtype: torch.dtype) -> nn.Module:
    """The token embeddings: vocabulary-parallel under tensor parallelism, else the plain
    table of the checkpoint's shape (no padding rows)."""
    if tp_world_size() > 1:
        return VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype=dtype)
    return nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)


def make_lm_head(config, dtype: torch.dtype, tie_to: nn.Module | None) -> nn.Module | None:
    """The LM head: a ``ParallelLMHead`` under tensor parallelism (sharing ``tie_to``'s
    table when given), else None when tied or a plain linear."""
    if tp_world_size() > 1:
        head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype=dtype)
        return head if tie_to is None else head.tie_weights(tie_to)
    if tie_to is not None:
        return None
    return nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)


def set_dummy_parts(layer: nn.Module, prefix: str, parts) -> None:
    """Mark a fused sharded projection's weight (and bias) with the world-size-1 layers it
    stands for, ``parts`` of (their module name, shard id, output rows): dummy weights then
    draw each part under its own name, the same weights at every tensor-parallel size."""
    layer.weight.dummy_parts = [
        (f"{prefix}.{m}.weight", sid, (rows, layer.input_size)) for m, sid, rows in parts
    ]
    if layer.bias is not None:
        layer.bias.dummy_parts = [(f"{prefix}.{m}.bias", sid, (rows,)) for m, sid, rows in parts]


def qkv_dummy_parts(heads: int, kv_heads: int, head_dim: int):
    kv = kv_heads * head_dim
    return [("q_proj", "q", heads * head_dim), ("k_proj", "k", kv), ("v_proj", "v", kv)]


class AttentionProjections(nn.Module):
    """q, k, v and o projections of a hybrid's attention block, under the checkpoint's
    names (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``) at world size 1, or this rank's
    fused ``qkv_proj`` (q heads split, KV heads split or replicated when fewer than ranks)
    and a row-parallel ``o_proj`` under tensor parallelism."""

    def _init_projections(
        self,
        hidden: int,
        head_dim: int,
        heads: int,
        kv_heads: int,
        bias: bool,
        dtype,
        prefix,
        out_size: int | None = None,
    ) -> tuple[int, int]:
        """Make the projections (q/k/v read ``hidden`` features, o_proj writes ``out_size``,
        by default ``hidden`` too); returns this rank's (q heads, KV heads)."""
        out_size = hidden if out_size is None else out_size
        self.sharded = tp_world_size() > 1
        if self.sharded:
            self.qkv_proj = QKVParallelLinear(
                hidden, head_dim, heads, kv_heads, bias=bias, dtype=dtype
            )
            set_dummy_parts(self.qkv_proj, prefix, qkv_dummy_parts(heads, kv_heads, head_dim))
            self.o_proj = RowParallelLinear(heads * head_dim, out_size, bias=bias, dtype=dtype)
            qkv = self.qkv_proj
            self.sizes = [qkv.q_size, qkv.kv_size, qkv.kv_size]
            return qkv.num_heads, qkv.num_kv_heads
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias, dtype=dtype)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias, dtype=dtype)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(heads * head_dim, out_size, bias=bias, dtype=dtype)
        return heads, kv_heads

    def _qkv(self, x: torch.Tensor):
        if self.sharded:
            return self.qkv_proj(x).split(self.sizes, dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


class MambaHybridForCausalLM(nn.Module):
    # Attention, MLPs, mixers, embeddings and head shard over the group.
    supports_tensor_parallel = True
    # Checkpoint projection names fused into one sharded layer at world size > 1:
    # (checkpoint module, our module, shard id).
    tp_fused_projections: tuple[tuple[str, str, str | int], ...] = (
        ("q_proj", "qkv_proj", "q"),
        ("k_proj", "qkv_proj", "k"),
        ("v_proj", "qkv_proj", "v"),
    )

    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.tp_size = tp_world_size()

    # -- what a subclass defines (the defaults serve a model set by ``_set_model``) -------

    def _set_model(self, model: nn.Module) -> None:
        """``self.model`` (its ``embed_tokens`` are the embeddings) and the head: those
        embeddings when ``config.tie_word_embeddings``, else a linear of its own."""
        self.model = model
        tie_to = model.embed_tokens if self.config.tie_word_embeddings else None
        self.lm_head = make_lm_head(self.config, self.dtype, tie_to)

    def _run(self, input_ids, positions, state: MambaStatePool, metadata: Mamba2Metadata):
        return self.model(input_ids, positions, state, metadata)

    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def hf_to_param_name(self, name: str) -> str | None:
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None  # tied: the embeddings serve as the head
        return name

    # -- the registry's interface --------------------------------------------------------

    def mixers(self) -> list[MambaMixer2]:
        """The Mamba mixers in layer order (pool layer i is ``mixers()[i]``'s)."""
        if "_mixers" not in self.__dict__:  # a plain list: not registered as submodules
            self.__dict__["_mixers"] = [m for m in self.modules() if isinstance(m, MambaMixer2)]
        return self.__dict__["_mixers"]

    @property
    def conv_backend(self) -> ConvBackend:
        return self.mixers()[0].backend

    def forward(
        self,
        input_ids: torch.Tensor,
        metadata: Mamba2Metadata | None = None,
        state: MambaStatePool | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states (num_tokens, hidden) in the model dtype.

        ``metadata`` None: the forward context's ``mamba2_metadata``; attention layers read
        the context's ``attn_metadata``. ``positions`` (num_tokens,) int64: each token's
        position in its sequence, for models whose attention uses RoPE (the runner passes
        them whenever the model has attention layers). ``state``: the engine's pool of the
        Mamba layers.
        """
        if metadata is None:
            metadata = get_forward_context().mamba2_metadata
        name = type(self).__name__
        mixers = self.mixers()
        check_step_inputs(
            name,
            input_ids,
            positions,
            metadata,
            state,
            num_layers=len(mixers),
            spec=mixers[0].spec,
            backend=self.conv_backend,
        )
        if metadata.token_perm is not None:
            raise ValueError(
                f"{name}: the step's rows are not in canonical order (decode rows first); "
                "the attention metadata could not follow a reordering"
            )
        if metadata.num_tokens == 0:
            return torch.empty(
                0, self.config.hidden_size, dtype=self.dtype, device=input_ids.device
            )
        return self._run(input_ids, positions, state, metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits (rows, vocab) of final hidden states; under tensor parallelism the
        ranks' vocabulary shards are gathered on rank 0 (None on the others)."""
        if self.tp_size > 1:
            return self.lm_head.compute_logits(hidden_states, to_all_ranks=False)
        return lm_logits(hidden_states, self.head_weight())

    def get_cache_specs(self, block_size: int, mamba_ssm_dtype: torch.dtype) -> dict:
        """Per-layer specs (module name -> ``MambaStateSpec`` | ``AttentionSpec``), layer order."""
        return cache_specs(self, block_size, mamba_ssm_dtype)

    def metadata_builder(self, device: torch.device | str | None = None) -> Mamba2MetadataBuilder:
        if device is None:
            device = self.head_weight().device
        return Mamba2MetadataBuilder(self.config.chunk_size, device)

    def set_conv_backend(self, backend: ConvBackend) -> None:
        """Switch every mixer's conv backend; pools allocated before are then rejected."""
        for mixer in self.mixers():
            mixer.set_conv_backend(backend)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy an HF checkpoint's (name, tensor) pairs into the parameters (ValueError for
        a shape mismatch, an unknown name, or a missing parameter). Under tensor
        parallelism each tensor goes through its parameter's ``weight_loader`` (this rank's
        rows only), q/k/v (and fused MLP inputs) into their merged layer by shard id."""
        if self.tp_size > 1:
            load_tp_weights(self, weights, self.tp_param_name)
        else:
            load_named_weights(self, weights, self.hf_to_param_name)

    def tp_param_name(self, name: str) -> str | tuple[str, str | int] | None:
        """``hf_to_param_name`` at world size > 1: a fused projection's checkpoint name
        becomes (our merged parameter, its shard id)."""
        name = self.hf_to_param_name(name)
        if name is None:
            return None
        parts = name.split(".")
        for ckpt, ours, shard_id in self.tp_fused_projections:
            if len(parts) >= 2 and parts[-2] == ckpt:
                return ".".join([*parts[:-2], ours, parts[-1]]), shard_id
        return name


def residual_norm(norm, hidden: torch.Tensor, residual: torch.Tensor | None):
    """(norm(hidden + residual), hidden + residual), the sum written into ``residual`` in
    place (the fused add-norm); the first layer (``residual`` None) starts the stream."""
    if residual is None:
        return norm(hidden), hidden
    return norm(hidden, residual)


def with_layer_states(layers, state: MambaStatePool):
    """Each of ``layers`` with its pool states: ``state.layer(k)`` for the k-th layer whose
    ``layer_type`` is "mamba" (the pool's layer order, ``mixers()``'), None for the others."""
    k = 0
    for layer in layers:
        layer_state = None
        if layer.layer_type == "mamba":
            layer_state, k = state.layer(k), k + 1
        yield layer, layer_state
