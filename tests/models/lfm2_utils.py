"""Tiny random LFM2 checkpoints from transformers' own ``Lfm2ForCausalLM`` (seeded and
perturbed: no weight at its initial value), the oracle of the LFM2 tests."""

from __future__ import annotations

import torch

from tests.models.hybrid_utils import VOCAB, perturb

# Short conv, attention, short conv, attention: both kinds see a prefix of both.
LFM2_LAYERS = ["conv", "full_attention", "conv", "full_attention"]


def lfm2_hf_config(**overrides):
    from transformers import Lfm2Config

    shape = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=96,  # adjusted: int(2 * 96 / 3) = 64, x 1.5, up to 16s: 96
        num_hidden_layers=len(LFM2_LAYERS),
        layer_types=LFM2_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        max_position_embeddings=128,
        block_multiple_of=16,
        block_ffn_dim_multiplier=1.5,
        tie_word_embeddings=True,
    )
    return Lfm2Config(**{**shape, **overrides})


def make_lfm2_hf(seed: int = 0, **overrides):
    from transformers import Lfm2ForCausalLM as HFLfm2

    torch.manual_seed(seed)
    return perturb(HFLfm2(lfm2_hf_config(**overrides)), seed)
