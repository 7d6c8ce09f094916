"""The face the hybrid models (Bamba, NemotronH, Zamba2) share with ``Mamba2ForCausalLM``.

A subclass builds its layers (``_set_model``, or its own ``self.model`` and ``lm_head``)
and may override ``_run(input_ids, positions)`` (final hidden states); this base's
``forward(input_ids, positions)`` checks a step's inputs against the Mamba2 metadata of the
forward context, and it gives the engine the rest of the registry's interface:
``get_cache_specs``, ``metadata_builder``, ``set_conv_backend``, ``compute_logits``,
``allocate_state_pool`` and ``load_weights``
(through the subclass's ``hf_to_param_name`` and ``stacked_params_mapping``). Every layer
is a parallel one, so a model is one rank's part of it at every tensor-parallel size.

A step's tokens come in the canonical order of ``Mamba2Metadata`` (decode rows first, as
the scheduler batches them), because the attention metadata is built in the same order:
a batch the Mamba2 metadata would have to permute is refused.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.activation import get_act_fn
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.mamba.mamba2_metadata import Mamba2MetadataBuilder
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from vllm.model_executor.layers.mamba.mamba_utils import ConvBackend, MambaStatePool
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.model_loader.weight_utils import load_model_weights
from vllm.model_executor.models.config_utils import AttentionShape
from vllm.model_executor.models.utils import (
    allocate_state_pool,
    cache_specs,
    check_step_inputs,
)


class AttentionProjections(nn.Module):
    """q, k, v and o projections of a hybrid's attention block: ``qkv_proj``, this rank's
    q heads and its KV heads (split, or replicated when fewer than ranks) of the
    checkpoint's ``q_proj``, ``k_proj`` and ``v_proj``, and a row-parallel ``o_proj``."""

    def _init_projections(
        self,
        shape: AttentionShape,
        hidden: int,
        bias: bool,
        dtype,
        out_size: int | None = None,
    ) -> tuple[int, int]:
        """Make the projections (q/k/v read ``hidden`` features, o_proj writes ``out_size``,
        by default ``hidden`` too); returns this rank's (q heads, KV heads)."""
        out_size = hidden if out_size is None else out_size
        heads, d = shape.num_heads, shape.head_dim
        self.qkv_proj = QKVParallelLinear(
            hidden, d, heads, shape.num_kv_heads, bias=bias, dtype=dtype
        )
        self.o_proj = RowParallelLinear(heads * d, out_size, bias=bias, dtype=dtype)
        return self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads

    def _qkv(self, x: torch.Tensor):
        return self.qkv_proj.split_qkv(self.qkv_proj(x))


class RotaryAttention(AttentionProjections):
    """Grouped-query attention with neox-style RoPE over ``config.rotary_dim`` of each head:
    Bamba's (a partial rotary) and Falcon-H1's (the whole head). Reads the config's
    ``attention_shape()``, ``attention_bias``, ``rotary_dim``, ``rope_positions`` and
    ``rope_theta``."""

    def __init__(self, config, dtype: torch.dtype, prefix: str):
        super().__init__()
        shape = config.attention_shape()
        d = shape.head_dim
        heads, kv_heads = self._init_projections(
            shape, config.hidden_size, config.attention_bias, dtype
        )
        self.rotary_emb = RotaryEmbedding(
            d, config.rotary_dim, config.rope_positions, config.rope_theta, is_neox_style=True
        )
        self.attn = Attention(heads, d, d**-0.5, num_kv_heads=kv_heads, prefix=f"{prefix}.attn")

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(x)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class GatedMLP(nn.Module):
    """A gated MLP, ``down(act(gate(x)) * up(x))``: gate|up one ``MergedColumnParallelLinear``
    (this rank's intermediate block of each, loaded from the checkpoint's ``gate_proj`` and
    ``up_proj`` or one fused tensor), down a ``RowParallelLinear``: Bamba's, Falcon-H1's,
    Jamba's and LFM2's MLPs (SwiGLU with ``hidden_act`` "silu")."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, hidden_act: str, dtype):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [intermediate, intermediate], bias=bias, dtype=dtype
        )
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias, dtype=dtype)
        self.act_fn = get_act_fn(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


class MambaHybridForCausalLM(nn.Module):
    # Attention, MLPs, mixers, embeddings and head shard over the group.
    supports_tensor_parallel = True
    # (our module, the checkpoint's module, shard id): checkpoint projections that are
    # parts of one of our fused layers.
    stacked_params_mapping: tuple[tuple[str, str, str | int], ...] = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
    )

    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        self.config = config
        self.dtype = dtype

    # -- what a subclass defines (the defaults serve a model set by ``_set_model``) -------

    def _set_model(self, model: nn.Module) -> None:
        """``self.model`` (its ``embed_tokens`` are the embeddings) and the head: those
        embeddings when ``config.tie_word_embeddings``, else a table of its own."""
        self.model = model
        self.lm_head = self._lm_head()
        if self.config.tie_word_embeddings:
            self.lm_head.tie_weights(model.embed_tokens)

    def _lm_head(self) -> ParallelLMHead:
        return ParallelLMHead(self.config.vocab_size, self.config.hidden_size, dtype=self.dtype)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        return self.model(input_ids, positions)

    def head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

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
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Final hidden states (num_tokens, hidden) in the model dtype.

        The Mamba layers read the forward context's ``mamba2_metadata`` and their bound
        states, the attention layers its ``attn_metadata`` and their bound KV caches.
        ``positions`` (num_tokens,) int64: each token's position in its sequence, for
        models whose attention uses RoPE (the runner passes them whenever the model has
        attention layers).
        """
        metadata = get_forward_context().mamba2_metadata
        name = type(self).__name__
        check_step_inputs(name, input_ids, positions, metadata)
        if metadata.token_perm is not None:
            raise ValueError(
                f"{name}: the step's rows are not in canonical order (decode rows first); "
                "the attention metadata could not follow a reordering"
            )
        if metadata.num_tokens == 0:
            return torch.empty(
                0, self.config.hidden_size, dtype=self.dtype, device=input_ids.device
            )
        return self._run(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits (rows, vocab) of final hidden states, the ranks' vocabulary parts
        gathered on rank 0 (None on the others of a tensor-parallel group)."""
        return self.lm_head.compute_logits(hidden_states, to_all_ranks=False)

    def get_cache_specs(self, block_size: int, mamba_ssm_dtype: torch.dtype) -> dict:
        """Per-layer specs (module name -> ``MambaStateSpec`` | ``AttentionSpec``), layer order."""
        return cache_specs(self, block_size, mamba_ssm_dtype)

    def allocate_state_pool(
        self,
        num_slots: int,
        device: torch.device | str | None = None,
        ssm_dtype: torch.dtype = torch.float32,
        replayssm_buffer_len: int = 0,
    ) -> MambaStatePool:
        """A state pool bound to the Mamba layers, for callers without the engine
        (``utils.allocate_state_pool``)."""
        if device is None:
            device = self.head_weight().device
        return allocate_state_pool(self, num_slots, device, ssm_dtype, replayssm_buffer_len)

    def metadata_builder(self, device: torch.device | str | None = None) -> Mamba2MetadataBuilder:
        if device is None:
            device = self.head_weight().device
        return Mamba2MetadataBuilder(self.config.chunk_size, device)

    def set_conv_backend(self, backend: ConvBackend) -> None:
        """Switch every mixer's conv backend; pools allocated before are then rejected."""
        for mixer in self.mixers():
            mixer.set_conv_backend(backend)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load an HF checkpoint's (name, tensor) pairs, each through its parameter's
        ``weight_loader`` (this rank's rows only), q/k/v (and a split MLP's gate and up)
        into their fused layer by shard id. ValueError for a shape mismatch, an unknown
        name, or a missing parameter."""
        load_model_weights(self, weights, self.hf_to_param_name, self.stacked_params_mapping)


def residual_norm(norm, hidden: torch.Tensor, residual: torch.Tensor | None):
    """(norm(hidden + residual), hidden + residual), the sum written into ``residual`` in
    place (the fused add-norm); the first layer (``residual`` None) starts the stream."""
    if residual is None:
        return norm(hidden), hidden
    return norm(hidden, residual)
