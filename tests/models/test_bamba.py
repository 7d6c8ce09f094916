"""Bamba (BambaForCausalLM) against transformers' own model, on tiny random checkpoints
saved with save_pretrained; fp32 on CPU (kernels under the Triton interpreter), the GPU
cases marked.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.models.hf_builders import make_bamba_hf as make_hf
from tests.models.hybrid_utils import (
    check_bad_config_refused,
    check_bf16_tracks_hf,
    check_generate_matches_hf,
    check_graphs_match_eager,
    check_loads_every_hf_weight,
    check_mixed_steps_match_hf,
    save_checkpoint,
)
from vllm import LLM, SamplingParams
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.bamba import BambaForCausalLM
from vllm.model_executor.models.bamba_config import BAMBA_9B, BambaModelConfig


@pytest.fixture(scope="module")
def hf_and_dir(tmp_path_factory):
    hf = make_hf()
    return hf, save_checkpoint(hf, tmp_path_factory.mktemp("bamba"))


def test_mixed_step_logits_match_hf(hf_and_dir, device):
    hf, path = hf_and_dir
    check_mixed_steps_match_hf(get_model(path, device=device), hf)


def test_generate_matches_hf_greedy(hf_and_dir, device):
    hf, path = hf_and_dir
    check_generate_matches_hf(path, hf, device)


def test_loads_every_hf_weight_by_name(hf_and_dir):
    hf, path = hf_and_dir
    model = check_loads_every_hf_weight(path, hf, BambaForCausalLM)
    assert model.config.layer_types == ("mamba", "attention", "mamba", "attention")
    assert model.config.rotary_dim == 4  # half of head_dim 8: Bamba's partial rotary


def test_tied_embeddings(tmp_path):
    hf = make_hf(seed=3, tie_word_embeddings=True)
    model = get_model(save_checkpoint(hf, tmp_path / "tied"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    h = torch.randn(3, 32)
    torch.testing.assert_close(model.compute_logits(h), h @ model.model.embed_tokens.weight.t())
    check_mixed_steps_match_hf(model, hf)


def test_dummy_weights_from_a_config_run_through_the_engine():
    cfg = BambaModelConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        attn_layer_indices=(0,),
        num_attention_heads=4,
        num_key_value_heads=4,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_chunk_size=8,
        max_position_embeddings=64,
    )
    llm = LLM(cfg, load_format="dummy", device="cpu", max_num_seqs=2, max_model_len=64)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert llm.engine.config.served_model_name == "bamba"
    assert llm.engine.runner.startup["num_kv_blocks"] > 0


def test_bamba_9b_preset_shape():
    cfg = BambaModelConfig(**BAMBA_9B)
    assert cfg.layer_types.count("attention") == 3 and cfg.mamba_d_head == 64
    assert cfg.head_dim == 128 and cfg.rotary_dim == 64


@pytest.mark.parametrize(
    "edit, match",
    [
        (dict(attn_layer_indices=[7]), "outside 0..3"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1.0}), "rope_type 'yarn'"),
        (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
        (dict(mamba_d_conv=9), "conv kernel 9 is not supported"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(architectures=["LlamaForCausalLM"], model_type="llama"), "unsupported model"),
    ],
    ids=["attn_index", "rope", "gqa", "conv", "act", "arch"],
)
def test_bad_configs(hf_and_dir, tmp_path, edit, match):
    _, path = hf_and_dir
    check_bad_config_refused(path, tmp_path, edit, match)


def test_unknown_architecture_lists_the_served_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="Mamba2ForCausalLM, BambaForCausalLM, NemotronH"):
        get_model(tmp_path, load_format="dummy")


def test_max_model_len_beyond_the_rope_table(hf_and_dir):
    _, path = hf_and_dir
    with pytest.raises(ValueError, match="max_model_len=129 exceeds the 128 positions"):
        LLM(str(path), device="cpu", max_model_len=129)


@pytest.mark.gpu
def test_bf16_tracks_hf_gpu(tmp_path):
    """A mid-size shape (hidden 256, 6 layers, 2 attention) in bf16 on the GPU."""
    shape = dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=6,
        attn_layer_indices=[2, 5],
        num_attention_heads=8,
        num_key_value_heads=2,
        mamba_n_heads=8,
        mamba_d_head=64,
        mamba_d_state=64,
        mamba_chunk_size=16,
    )
    hf32 = make_hf(seed=11, **shape)
    path = save_checkpoint(hf32, tmp_path / "mid")
    check_bf16_tracks_hf(hf32, make_hf(seed=11, **shape).to(torch.bfloat16), path, "cuda")


@pytest.mark.gpu
def test_cuda_graph_decode_matches_eager(hf_and_dir):
    _, path = hf_and_dir
    check_graphs_match_eager(path, "cuda")
