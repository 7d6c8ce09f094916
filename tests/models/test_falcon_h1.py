"""Falcon-H1 (FalconH1ForCausalLM) against transformers' own model, on tiny random
checkpoints saved with save_pretrained; fp32 on CPU (kernels under the Triton
interpreter), the GPU cases marked.

The main checkpoint has every muP multiplier away from 1 (the five in_proj slice
multipliers all different), two Mamba groups with the RMS norm before the gate, an inner
width from ``mamba_d_ssm`` (not expand * hidden), and biases on in_proj, q/k/v/o and the
MLP; the variants cover the gate without a norm, the norm after the gate, an out_proj bias
(``projectors_bias``) without an in_proj one, tied embeddings and a ``head_dim`` key.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.falcon_h1_utils import (
    assert_falcon_h1_loaded_as_hf,
    make_falcon_h1_hf,
)
from tests.models.hybrid_utils import (
    check_bad_config_refused,
    check_bf16_tracks_hf,
    check_generate_matches_hf,
    check_graphs_match_eager,
    check_mixed_steps_match_hf,
    check_varlen_batch_and_chunks,
    save_checkpoint,
)
from vllm import LLM, SamplingParams
from vllm.cache_spec import AttentionSpec, MambaStateSpec
from vllm.model_executor.layers.mamba.mamba_tp import Mixer2RMSNormGated
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.falcon_h1 import (
    FalconH1ForCausalLM,
    GateOnly,
    NormThenGate,
)
from vllm.model_executor.models.falcon_h1_config import FalconH1ModelConfig


@pytest.fixture(scope="module")
def hf_and_dir(tmp_path_factory):
    hf = make_falcon_h1_hf()
    return hf, save_checkpoint(hf, tmp_path_factory.mktemp("falcon_h1"))


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


def test_loads_every_hf_weight_with_the_multipliers_folded(hf_and_dir):
    """Each parameter is HF's, the scaled layers' times their multipliers; loading again
    (dummy weights, then HF's tensors in memory) folds them once, not twice."""
    hf, path = hf_and_dir
    model = get_model(path)
    assert isinstance(model, FalconH1ForCausalLM)
    assert_falcon_h1_loaded_as_hf(model, hf)
    cfg = model.config
    assert cfg.mamba_inner_size == 48 and cfg.mamba_d_head == 12
    assert cfg.ssm_multipliers == (0.5, 1.5, 0.75, 1.25, 2.0) and cfg.rope_theta == 5000.0
    assert isinstance(model.model.layers[0].mamba.norm, NormThenGate)
    assert model.model.layers[0].mamba.out_proj.bias is None  # projectors_bias false
    again = get_model(path, load_format="dummy")
    again.load_weights((n, p.detach()) for n, p in hf.named_parameters())
    assert_falcon_h1_loaded_as_hf(again, hf)


def test_each_layer_declares_a_state_and_a_kv_cache(hf_and_dir):
    model = get_model(hf_and_dir[1])
    specs = model.get_cache_specs(block_size=4, mamba_ssm_dtype=torch.float32)
    for i in range(2):
        assert isinstance(specs[f"model.layers.{i}.mamba"], MambaStateSpec)
        assert isinstance(specs[f"model.layers.{i}.self_attn.attn"], AttentionSpec)
    assert len(specs) == 4


@pytest.mark.parametrize(
    "overrides, norm_type",
    [
        (dict(mamba_rms_norm=False), GateOnly),
        (dict(mamba_norm_before_gate=False, mamba_n_groups=1), Mixer2RMSNormGated),
    ],
    ids=["gate-only", "norm-after-gate"],
)
def test_gate_forms_biases_tied_and_head_dim(tmp_path, overrides, norm_type):
    """The other two gates; an out_proj bias without an in_proj one; tied embeddings; a
    ``head_dim`` key (heads of 16, not 32 / 4); the inner width expand * hidden."""
    hf = make_falcon_h1_hf(
        seed=3,
        mamba_proj_bias=False,
        projectors_bias=True,
        tie_word_embeddings=True,
        head_dim=16,
        mamba_d_ssm=None,
        mamba_expand=2,
        mamba_d_head=16,
        **overrides,
    )
    model = get_model(save_checkpoint(hf, tmp_path / "variant"))
    mixer = model.model.layers[1].mamba
    assert type(mixer.norm) is norm_type
    assert mixer.in_proj.bias is None and mixer.out_proj.bias is not None
    assert model.config.attention_shape().head_dim == 16 and model.config.mamba_inner_size == 64
    assert model.lm_head.weight is model.model.embed_tokens.weight
    check_mixed_steps_match_hf(model, hf)


def test_config_forms_and_refusals():
    base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, mamba_n_heads=4, mamba_d_ssm=64,
                mamba_d_state=8)  # fmt: skip
    cfg = FalconH1ModelConfig.from_dict({**base, "num_key_value_heads": None})
    assert cfg.num_key_value_heads == 4 and cfg.mamba_d_head == 16
    assert cfg.layer_types == ("hybrid", "hybrid") and cfg.mlp_multipliers == (1.0, 1.0)
    wide = FalconH1ModelConfig.from_dict({**base, "mamba_d_ssm": None, "mamba_expand": 3})
    assert wide.mamba_inner_size == 96 and wide.mamba_d_head == 24
    theta = FalconH1ModelConfig.from_dict({**base, "rope_theta": 1e11})
    assert theta.rope_theta == 1e11
    refusals = [
        ({"ssm_multipliers": [1.0, 1.0]}, "ssm_multipliers must list 5 numbers"),
        ({"mlp_multipliers": 2.0}, "mlp_multipliers must list 2 numbers"),
        ({"key_multiplier": "x"}, "key_multiplier: expected a number"),
        ({"mamba_d_head": 8}, "inner size 64 must equal"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"rope_parameters": {"rope_type": "yarn"}}, "yarn"),
        ({"mamba_rms_norm": "yes"}, "mamba_rms_norm"),
        ({"num_attention_heads": 3}, "multiple of num_key_value_heads"),
    ]
    for edit, match in refusals:
        with pytest.raises(ValueError, match=match):
            FalconH1ModelConfig.from_dict({**base, **edit})


def test_tp_check_names_the_fields():
    cfg = FalconH1ModelConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, mamba_n_heads=2, mamba_d_ssm=64, intermediate_size=6,
    )  # fmt: skip
    cfg.check_tp(2)
    with pytest.raises(ValueError) as err:
        cfg.check_tp(4)
    for field in ("intermediate_size=6", "mamba_n_heads=2"):
        assert field in str(err.value)


def test_dummy_weights_from_a_config_run_through_the_engine():
    cfg = FalconH1ModelConfig(
        vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4, mamba_d_ssm=64,
        mamba_d_state=8, mamba_chunk_size=8, max_position_embeddings=64,
        ssm_multipliers=(0.5, 1.0, 1.0, 1.0, 2.0), mamba_rms_norm=True,
    )  # fmt: skip
    llm = LLM(cfg, load_format="dummy", device="cpu", max_num_seqs=2, max_model_len=64)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert llm.engine.config.served_model_name == "falcon_h1"
    assert llm.engine.runner.startup["num_kv_blocks"] > 0


@pytest.mark.parametrize(
    "edit, match",
    [
        (dict(ssm_multipliers=[1.0, 2.0, 3.0]), "ssm_multipliers must list 5"),
        (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
        (dict(mamba_d_conv=9), "conv kernel 9 is not supported"),
        (dict(architectures=["FalconH2ForCausalLM"], model_type="falcon_h2"), "unsupported"),
    ],
    ids=["ssm-multipliers", "gqa", "conv", "arch"],
)
def test_bad_checkpoint_configs(hf_and_dir, tmp_path, edit, match):
    check_bad_config_refused(hf_and_dir[1], tmp_path, edit, match)


def test_max_model_len_beyond_the_rope_table(hf_and_dir):
    _, path = hf_and_dir
    with pytest.raises(ValueError, match="max_model_len=129 exceeds the 128 positions"):
        LLM(str(path), device="cpu", max_model_len=129)


@pytest.mark.gpu
def test_bf16_tracks_hf_gpu(tmp_path):
    """A mid-size shape (hidden 256, 4 layers) in bf16, the multipliers as in fp32."""
    shape = dict(
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        mamba_d_ssm=512,
        mamba_n_heads=8,
        mamba_n_groups=1,
        mamba_d_state=64,
        mamba_chunk_size=16,
    )
    hf32 = make_falcon_h1_hf(seed=11, **shape)
    path = save_checkpoint(hf32, tmp_path / "mid")
    hf16 = make_falcon_h1_hf(seed=11, **shape).to(torch.bfloat16)
    check_bf16_tracks_hf(hf32, hf16, path, "cuda")


@pytest.mark.gpu
def test_cuda_graph_decode_matches_eager(hf_and_dir):
    _, path = hf_and_dir
    check_graphs_match_eager(path, "cuda")
