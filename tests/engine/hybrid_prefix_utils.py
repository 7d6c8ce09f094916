"""What the hybrid prefix-caching tests share (test_prefix_cache_hybrid.py,
test_prefix_cache_prompt_end.py): tiny random hybrids of every architecture we serve, the
engine with caching on or off, greedy runs that assert the restored tokens, and the
engines without caching as references."""

from __future__ import annotations

import pytest
import torch

from tests.engine.utils import BAMBA
from vllm import LLM, SamplingParams
from vllm.model_executor.models.falcon_h1_config import FalconH1ModelConfig
from vllm.model_executor.models.granitemoehybrid_config import GraniteMoeHybridModelConfig
from vllm.model_executor.models.jamba_config import JambaModelConfig
from vllm.model_executor.models.lfm2_config import Lfm2ModelConfig
from vllm.model_executor.models.nemotron_h_config import NemotronHModelConfig
from vllm.model_executor.models.zamba2_config import Zamba2ModelConfig

ATTN_BLOCK = 8  # attention blocks: the first turn's 11 tokens are one full block + a tail
MAMBA_BLOCK = 4
OTHER = [90, 2, 2, 61, 33, 7]  # an unrelated prompt
FIRST = [5, 17, 3, 3, 40, 9, 71]
ZAMBA2 = Zamba2ModelConfig(vocab_size=128, hidden_size=32, layer_types=("mamba", "hybrid"),
                           num_attention_heads=4, n_mamba_heads=4, mamba_d_state=8,
                           adapter_rank=4, intermediate_size=48, chunk_size=8,
                           use_shared_attention_adapter=True, use_mem_rope=True,
                           max_position_embeddings=64)  # fmt: skip
NEMOTRON_H = NemotronHModelConfig(layer_types=("mamba", "attention", "mlp"), vocab_size=128,
                                  hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=8, max_position_embeddings=64, intermediate_size=48,
                                  ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=16,
                                  n_groups=2, chunk_size=8)  # fmt: skip
# Jamba: Mamba1 mixers (a (d_inner, d_state) SSM state) with attention and experts; LFM2:
# short convs (a conv state only) with attention.
JAMBA = JambaModelConfig(vocab_size=128, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
                         expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1,
                         mamba_d_state=8, mamba_dt_rank=4, max_position_embeddings=64)  # fmt: skip
LFM2 = Lfm2ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=96,
                       num_hidden_layers=2, layer_types=("conv", "full_attention"),
                       num_attention_heads=4, num_key_value_heads=2, block_multiple_of=16,
                       max_position_embeddings=64)  # fmt: skip
# GraniteMoeHybrid: a Mamba2 layer and an attention layer (RoPE: the restored rest's
# positions start past the prefix), routed experts beside the shared MLP; FalconH1: attention
# and a Mamba2 mixer side by side in every layer, muP multipliers away from 1.
GRANITE = GraniteMoeHybridModelConfig(vocab_size=128, hidden_size=32, intermediate_size=16,
                                      shared_intermediate_size=24, num_hidden_layers=2,
                                      layer_types=("mamba", "attention"), num_attention_heads=4,
                                      num_key_value_heads=2, mamba_n_heads=4, mamba_d_head=16,
                                      mamba_d_state=8, mamba_chunk_size=8, num_local_experts=4,
                                      num_experts_per_tok=2, embedding_multiplier=3.0,
                                      residual_multiplier=0.6, attention_multiplier=0.3,
                                      logits_scaling=2.5, position_embedding_type="rope",
                                      max_position_embeddings=64)  # fmt: skip
FALCON_H1 = FalconH1ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=16,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                mamba_n_heads=4, mamba_d_ssm=48, mamba_n_groups=2,
                                mamba_d_state=8, mamba_chunk_size=8, mamba_rms_norm=True,
                                max_position_embeddings=64, embedding_multiplier=1.7,
                                key_multiplier=0.8, ssm_multipliers=(0.5, 1.5, 0.75, 1.25, 2.0),
                                mlp_multipliers=(1.1, 0.8))  # fmt: skip
MODELS = {"bamba": BAMBA, "zamba2": ZAMBA2, "nemotron_h": NEMOTRON_H, "jamba": JAMBA, "lfm2": LFM2,
          "granitemoehybrid": GRANITE, "falcon_h1": FALCON_H1}  # fmt: skip


def reference_engines():
    """The engines without caching, one per model (outputs do not depend on the KV budget
    or on async scheduling), made on first use: ``get(model)``."""
    engines = {}

    def get(model: str) -> LLM:
        if model not in engines:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            engines[model] = make_llm(device, model, False, async_scheduling=False)
        return engines[model]

    return get


def make_llm(device, model, cache: bool, **kw) -> LLM:
    options = dict(
        load_format="dummy",
        dtype="float32",
        device=device.type,
        max_model_len=48,
        max_num_seqs=2,
        max_num_batched_tokens=6,  # chunked prompts
        block_size=ATTN_BLOCK,
        enable_prefix_caching=cache,
        mamba_block_size=MAMBA_BLOCK,
    )
    return LLM(MODELS[model], **{**options, **kw})


def run(llm: LLM, prompt: list[int], n: int, cached: int = 0):
    """Greedy tokens and their logprobs; ``cached``: the prompt tokens it must restore."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1)
    req = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert req.num_cached_tokens == cached
    out = req.outputs[0]
    lps = [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs, strict=True)]
    return list(out.token_ids), lps


def same(got, ref) -> None:
    assert got[0] == ref[0]
    assert got[1] == pytest.approx(ref[1], rel=1e-4, abs=1e-5)
