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
layers are the parallel ones, so the model is one rank's part at every world size. The
classes are ``mamba2.py``'s with the Mamba1 mixer and an unchunked metadata builder.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.model_executor.layers.mamba.mamba2_metadata import Mamba2MetadataBuilder
from vllm.model_executor.layers.mamba.mamba_mixer import MambaMixer
from vllm.model_executor.models.mamba2 import (
    Mamba2DecoderLayer,
    Mamba2ForCausalLM,
    Mamba2Model,
)
from vllm.model_executor.models.mamba_config import FalconMambaModelConfig, MambaModelConfig


class MambaDecoderLayer(Mamba2DecoderLayer):
    @staticmethod
    def make_mixer(config: MambaModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        return MambaMixer(config.mamba1_shape(), dtype=dtype, layer_idx=layer_idx)


class MambaModel(Mamba2Model):
    layer_cls = MambaDecoderLayer


class MambaForCausalLM(Mamba2ForCausalLM):
    # d_inner shards over the group (MambaMixer); embeddings and head by vocabulary.
    supports_tensor_parallel = True
    model_cls = MambaModel

    def __init__(self, config: MambaModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__(config, dtype)

    def metadata_builder(self, device: torch.device | str | None = None) -> Mamba2MetadataBuilder:
        """The step metadata's builder, without chunk layout (Mamba1 scans unchunked)."""
        if device is None:
            device = self.backbone.embeddings.weight.device
        return Mamba2MetadataBuilder(None, device)


class FalconMambaForCausalLM(MambaForCausalLM):
    """Mamba1 with FalconMamba's norms on dt, B and C (``FalconMambaModelConfig``)."""

    def __init__(self, config: FalconMambaModelConfig, dtype: torch.dtype = torch.float32):
        if not isinstance(config, FalconMambaModelConfig):
            raise TypeError(
                f"FalconMambaForCausalLM needs a FalconMambaModelConfig (its mixer_rms_eps), "
                f"got {type(config).__name__}"
            )
        super().__init__(config, dtype)
