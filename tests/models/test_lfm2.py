"""LFM2 (Lfm2ForCausalLM) against transformers' own model, on tiny random checkpoints saved
with save_pretrained; fp32 on CPU (conv and attention kernels under the Triton
interpreter), the GPU cases marked."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.models.hybrid_utils import (
    HybridDriver,
    check_bad_config_refused,
    check_bf16_tracks_hf,
    check_generate_matches_hf,
    check_graphs_match_eager,
    check_loads_every_hf_weight,
    check_mixed_steps_match_hf,
    check_varlen_batch_and_chunks,
    hf_logits,
    save_checkpoint,
    tokens,
)
from tests.models.lfm2_utils import lfm2_hf_config, make_lfm2_hf
from tests.models.mamba2_utils import assert_close
from vllm import LLM, SamplingParams
from vllm.cache_spec import MambaStateSpec
from vllm.model_executor.layers.mamba.short_conv import ShortConv
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.lfm2 import Lfm2ForCausalLM
from vllm.model_executor.models.lfm2_config import LFM2_1_2B, Lfm2ModelConfig
from vllm.worker.cache_engine import CacheEngine


@pytest.fixture(scope="module")
def hf_and_dir(tmp_path_factory):
    hf = make_lfm2_hf()
    return hf, save_checkpoint(hf, tmp_path_factory.mktemp("lfm2"))


def test_prefill_logits_match_hf(hf_and_dir, device):
    hf, path = hf_and_dir
    prompt = tokens(11, "prefill")
    got = HybridDriver(get_model(path, device=device)).step([("s", prompt)])[0]
    assert_close(got, hf_logits(hf, prompt), "vs_hf")


def test_mixed_step_logits_match_hf(hf_and_dir, device):
    """Fresh prompts, a chunked prefill continued beside decodes, decodes: vs HF."""
    hf, path = hf_and_dir
    check_mixed_steps_match_hf(get_model(path, device=device), hf)


def test_generate_matches_hf_greedy(hf_and_dir, device):
    hf, path = hf_and_dir
    check_generate_matches_hf(path, hf, device)


def test_varlen_batch_equals_each_alone_and_chunks_equal_one_prefill(hf_and_dir):
    """Three prompts in one step (then a decode each) give each one's logits alone; a
    prompt fed in chunks of 3, 1 and 5 tokens gives its one-prefill logits."""
    _, path = hf_and_dir
    model = get_model(path)
    check_varlen_batch_and_chunks(model)


def test_loads_every_hf_weight_by_name(hf_and_dir):
    hf, path = hf_and_dir
    model = check_loads_every_hf_weight(path, hf, Lfm2ForCausalLM)
    assert model.config.layer_types == ("conv", "full_attention", "conv", "full_attention")
    assert model.lm_head.weight is model.model.embed_tokens.weight  # LFM2 ties by default
    assert model.config.mlp_size() == hf.model.layers[0].feed_forward.w1.out_features == 96


def test_conv_bias_and_untied_head(tmp_path):
    hf = make_lfm2_hf(seed=3, conv_bias=True, tie_word_embeddings=False)
    assert hf.model.layers[0].conv.conv.bias is not None
    model = check_loads_every_hf_weight(save_checkpoint(hf, tmp_path / "bias"), hf, Lfm2ForCausalLM)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    check_mixed_steps_match_hf(model, hf)


@pytest.mark.parametrize(
    "options",
    [
        dict(block_auto_adjust_ff_dim=False),
        dict(block_ffn_dim_multiplier=2),
        dict(intermediate_size=100, block_multiple_of=7, block_ffn_dim_multiplier=1.3),
    ],
    ids=["no_adjust", "int_multiplier", "rounded"],
)
def test_mlp_width_as_hf_computes_it(options):
    from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

    hf_cfg = lfm2_hf_config(**options)
    ours = Lfm2ModelConfig.from_dict(hf_cfg.to_dict())
    assert ours.mlp_size() == Lfm2MLP(hf_cfg).w1.out_features


def test_layer_kinds_and_older_keys():
    base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4)
    base["num_key_value_heads"] = 2
    cfg = Lfm2ModelConfig.from_dict({**base, "full_attn_idxs": [1]})
    assert cfg.layer_types == ("conv", "full_attention", "conv")
    assert Lfm2ModelConfig.from_dict(base).layer_types == ("full_attention",) * 3  # as HF
    old = Lfm2ModelConfig.from_dict(
        {**base, "intermediate_size": 48, "block_ff_dim": 96, "tie_embedding": False, "head_dim": 8}
    )
    assert old.intermediate_size == 96 and not old.tie_word_embeddings
    assert old.rope_theta == 1e6  # LFM2's default when the config names none
    # No multiplier (older transformers allow None): 2/3 of the width, not rounded.
    plain = Lfm2ModelConfig.from_dict({**base, "intermediate_size": 100})
    assert replace(plain, block_ffn_dim_multiplier=None).mlp_size() == 66
    preset = Lfm2ModelConfig(**LFM2_1_2B)
    assert preset.layer_types.count("full_attention") == 6 and preset.mlp_size() == 8192


def test_conv_layers_keep_a_conv_only_state(hf_and_dir):
    """Each short-conv layer declares (hidden, L_cache - 1) and an SSM part of no
    elements; the pool binds it its lines (null line first), with replay too (no ring)."""
    _, path = hf_and_dir
    model = get_model(path)
    for replay in (0, 3):
        cache = CacheEngine(
            model,
            num_slots=3,
            block_size=4,
            ssm_dtype=torch.float32,
            device=torch.device("cpu"),
            replayssm_buffer_len=replay,
        )
        specs = list(cache.mamba_specs.values())
        convs = [m for m in model.modules() if isinstance(m, ShortConv)]
        assert len(specs) == len(convs) == 2 and isinstance(specs[0], MambaStateSpec)
        assert specs[0].conv_shape == (32, 2) and specs[0].bytes_per_slot == 32 * 2 * 4
        pool = cache.mamba_pool
        assert not pool.rings and pool.ssm_state.numel() == 0
        for k, conv in enumerate(convs):
            assert conv.kv_cache[0].data_ptr() == pool.conv_state[k].data_ptr()
            assert tuple(conv.kv_cache[0].shape) == (4, 32, 2)


@pytest.mark.parametrize(
    "attn", [(1,), (), None], ids=["hybrid", "conv_only_no_kv", "attention_only_no_pool"]
)
def test_dummy_weights_from_a_config_run_through_the_engine(attn):
    """Either kind may be absent (no full_attn_idxs: every layer attention, as HF reads
    it): the engine then makes no KV cache, or no state pool."""
    cfg = Lfm2ModelConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        full_attn_idxs=attn,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    llm = LLM(cfg, load_format="dummy", device="cpu", max_num_seqs=2, max_model_len=64)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert llm.engine.config.served_model_name == "lfm2"
    runner = llm.engine.runner
    assert (runner.pool is None) == (attn is None)
    assert (runner.startup["num_kv_blocks"] == 0) == (attn == ())


@pytest.mark.parametrize(
    "edit, match",
    [
        (dict(layer_types=["conv", "mamba", "conv", "conv"]), "layer_types must list"),
        (dict(layer_types=None, full_attn_idxs=[9]), "outside 0..3"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1.0}), "rope_type 'yarn'"),
        (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
        (dict(conv_L_cache=9), "conv_L_cache=9 is not supported"),
        (dict(block_ffn_dim_multiplier=0.001), "MLP width"),
        (dict(head_dim=16), "head_dim=16 differs"),
    ],
    ids=["kind", "attn_index", "rope", "gqa", "conv", "mlp", "head_dim"],
)
def test_bad_configs(hf_and_dir, tmp_path, edit, match):
    check_bad_config_refused(hf_and_dir[1], tmp_path, edit, match)


def test_shapes_that_do_not_shard_name_their_field():
    cfg = Lfm2ModelConfig(
        vocab_size=64,
        hidden_size=30,
        intermediate_size=48,
        num_hidden_layers=2,
        full_attn_idxs=(1,),
        num_attention_heads=3,
        num_key_value_heads=3,
        block_multiple_of=5,
    )
    cfg.check_tp(1)
    with pytest.raises(ValueError) as err:
        cfg.check_tp(4)
    for field in ("hidden_size=30", "num_attention_heads=3", "MLP width 35"):
        assert field in str(err.value)


@pytest.mark.gpu
def test_bf16_tracks_hf_gpu(tmp_path):
    """A mid-size shape (hidden 256, 6 layers, 2 attention) in bf16 on the GPU."""
    shape = dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention"],
        num_attention_heads=8,
        num_key_value_heads=2,
        block_multiple_of=64,
    )
    hf32 = make_lfm2_hf(seed=11, **shape)
    path = save_checkpoint(hf32, tmp_path / "mid")
    check_bf16_tracks_hf(hf32, make_lfm2_hf(seed=11, **shape).to(torch.bfloat16), path, "cuda")


@pytest.mark.gpu
def test_cuda_graph_decode_matches_eager(hf_and_dir):
    _, path = hf_and_dir
    check_graphs_match_eager(path, "cuda")
