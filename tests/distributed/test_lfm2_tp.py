"""LFM2 sharded over two gloo ranks equals the unsharded model: the short-conv layers by
channels (in_proj's B | C | x each cut, the conv weights and state lines this rank's
channels, out_proj row-parallel), attention by heads (KV heads split, or replicated when
fewer than ranks), the MLP by width, embeddings and head by vocabulary. fp32 logits of
mixed steps (fresh prompts, a chunked prefill continued, decodes beside them) within
1e-5 of the logits' scale of one rank's; LLM.generate's greedy tokens at TP=2 equal
TP=1's (the steps' comparison runs in that TP=2 engine's ranks: one spawn for both); a
shape that does not divide is refused naming its field, before any process."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from tests.distributed.utils import check_generate_two_ranks_equals_one_rank
from tests.models.hybrid_utils import check_steps_match, run_steps, save_checkpoint
from tests.models.lfm2_utils import make_lfm2_hf
from vllm import LLM
from vllm.cache_spec import AttentionSpec, MambaStateSpec
from vllm.distributed import get_tp_group
from vllm.model_executor.layers.mamba.short_conv import ShortConv
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.lfm2_config import Lfm2ModelConfig


def _ranks_equal_one_rank(path, kv_heads, expected, atol):
    tp = get_tp_group()
    model = get_model(path)
    convs = [m for m in model.modules() if isinstance(m, ShortConv)]
    assert [c.dim for c in convs] == [32 // tp.world_size] * 2
    specs = list(model.get_cache_specs(4, torch.float32).values())
    conv_specs = [s for s in specs if isinstance(s, MambaStateSpec)]
    assert [s.conv_shape for s in conv_specs] == [(32 // tp.world_size, 2)] * 2
    local_kv = max(1, kv_heads // tp.world_size)
    assert [s.num_kv_heads for s in specs if isinstance(s, AttentionSpec)] == [local_kv] * 2
    check_steps_match(model, expected, atol)


def test_two_ranks_equal_one_rank_gloo_steps_and_generate(tmp_path):
    """Steps: one KV head (replicated on both ranks) and the conv biases (cut by channel);
    generate: two KV heads, one per rank. The steps run in the generate check's TP=2
    engine's ranks (any checkpoint loads there)."""
    hf = make_lfm2_hf(seed=1, num_key_value_heads=1, conv_bias=True)
    path = save_checkpoint(hf, tmp_path / "lfm2")
    expected = run_steps(get_model(path))
    scale = max(float(r.abs().max()) for step in expected for r in step)
    gen = save_checkpoint(make_lfm2_hf(seed=4, num_key_value_heads=2), tmp_path / "gen")
    check_generate_two_ranks_equals_one_rank(
        gen, (_ranks_equal_one_rank, str(path), 1, expected, 1e-5 * max(scale, 1.0))
    )


def test_shapes_that_do_not_shard_are_refused_before_any_process():
    before = set(multiprocessing.active_children())
    cfg = Lfm2ModelConfig(
        vocab_size=128,
        hidden_size=30,
        intermediate_size=48,
        num_hidden_layers=2,
        full_attn_idxs=(1,),
        num_attention_heads=3,
        num_key_value_heads=3,
        block_multiple_of=5,
        max_position_embeddings=64,
    )
    opts = dict(load_format="dummy", device="cpu", max_model_len=64, tensor_parallel_size=4)
    with pytest.raises(ValueError, match=r"hidden_size=30 is not divisible by tp_size=4"):
        LLM(cfg, **opts)
    assert set(multiprocessing.active_children()) == before
