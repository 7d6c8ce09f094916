"""NemotronH (NemotronHForCausalLM) against transformers' own model, on tiny random
checkpoints saved with save_pretrained; fp32 on CPU (kernels under the Triton
interpreter), the GPU cases marked.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.models.hf_builders import make_nemotron_h_hf as make_hf
from tests.models.hybrid_utils import (
    VOCAB,
    check_bf16_tracks_hf,
    check_generate_matches_hf,
    check_graphs_match_eager,
    check_loads_every_hf_weight,
    check_mixed_steps_match_hf,
    engine,
    hf_logits,
    save_checkpoint,
)
from vllm import SamplingParams
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.nemotron_h import NemotronHForCausalLM
from vllm.model_executor.models.nemotron_h_config import NemotronHModelConfig


@pytest.fixture(scope="module")
def hf_and_dir(tmp_path_factory):
    hf = make_hf()
    return hf, save_checkpoint(hf, tmp_path_factory.mktemp("nemotron_h"))


def test_mixed_step_logits_match_hf(hf_and_dir, device):
    hf, path = hf_and_dir
    check_mixed_steps_match_hf(get_model(path, device=device), hf)


def test_generate_matches_hf_greedy(hf_and_dir, device):
    hf, path = hf_and_dir
    check_generate_matches_hf(path, hf, device)


def test_loads_every_hf_weight_by_name(hf_and_dir):
    hf, path = hf_and_dir
    model = check_loads_every_hf_weight(path, hf, NemotronHForCausalLM)
    kinds = ("mamba", "attention", "mlp", "mamba", "mlp", "attention")
    assert model.config.layer_types == kinds


def test_checkpoint_name_forms(hf_and_dir, tmp_path):
    """``model.`` and NVIDIA's ``backbone.`` prefixes both load; ``mtp.*`` is skipped."""
    hf, path = hf_and_dir
    weights = load_file(str(path / "model.safetensors"))
    renamed = {
        ("model." + k.removeprefix("backbone.") if k.startswith("backbone.") else k): v
        for k, v in weights.items()
    }
    renamed["mtp.layers.0.norm.weight"] = torch.ones(32)
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(renamed, str(tmp_path / "model.safetensors"))
    model = get_model(tmp_path)
    torch.testing.assert_close(model.lm_head.weight, hf.lm_head.weight, rtol=0, atol=0)


def test_config_forms_and_refusals():
    base = dict(hidden_size=32, vocab_size=VOCAB, mamba_num_heads=4, mamba_head_dim=16,
                n_groups=2, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    legacy = NemotronHModelConfig.from_dict(
        {**base, "layers_block_type": ["mamba", "attention", "mlp"], "mamba_d_conv": 3}
    )
    assert legacy.layer_types == ("mamba", "attention", "mlp") and legacy.conv_kernel == 3
    pattern = NemotronHModelConfig.from_dict({**base, "hybrid_override_pattern": "M-*M"})
    assert pattern.layer_types == ("mamba", "mlp", "attention", "mamba")
    assert pattern.num_hidden_layers == 4 and pattern.time_step_limit == (0.001, float("inf"))
    moe = NemotronHModelConfig.from_dict({**base, "hybrid_override_pattern": "M*E"})
    assert moe.layer_types[-1] == "moe"  # served: tests/models/test_nemotron_h_moe.py
    with pytest.raises(ValueError, match="string of M, \\*, - and E"):
        NemotronHModelConfig.from_dict({**base, "hybrid_override_pattern": "M*X"})
    with pytest.raises(ValueError, match="mlp_hidden_act='gelu'"):
        NemotronHModelConfig.from_dict(
            {**base, "hybrid_override_pattern": "M-", "mlp_hidden_act": "gelu"}
        )
    with pytest.raises(ValueError, match="at least one Mamba"):
        NemotronHModelConfig.from_dict({**base, "hybrid_override_pattern": "*-"})


def test_without_attention_layers_there_is_no_kv_cache(tmp_path):
    """A pattern with Mamba2 and MLP blocks only: the engine sizes no KV cache and the
    model still matches HF (greedy over HF's full forward: transformers' generate cannot
    run this pattern, its cache asks attention layers for the sequence length)."""
    hf = make_hf(seed=5, pattern="M-M")
    path = save_checkpoint(hf, tmp_path / "no_attn")
    llm = engine(path, max_num_batched_tokens=8)
    assert llm.engine.scheduler.kv is None and llm.engine.runner.startup["num_kv_blocks"] == 0
    out = llm.generate([[7, 8, 9, 10]], SamplingParams(temperature=0.0, max_tokens=3))
    seq = [7, 8, 9, 10]
    for _ in range(3):
        seq.append(int(hf_logits(hf, seq)[-1].argmax()))
    assert out[0].outputs[0].token_ids == seq[4:]


def test_bad_checkpoint_config(hf_and_dir, tmp_path):
    _, path = hf_and_dir
    raw = json.loads((path / "config.json").read_text())
    raw["layers_block_type"] = ["linear_attention", "moe"]
    raw["n_group"] = 3  # does not divide the 8 routed experts
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="n_group=3 must divide n_routed_experts=8"):
        get_model(tmp_path, load_format="dummy")


@pytest.mark.gpu
def test_bf16_tracks_hf_gpu(tmp_path):
    """A mid-size shape (hidden 256, pattern M*-M*-M-) in bf16 on the GPU."""
    shape = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                 intermediate_size=512, mamba_num_heads=8, mamba_head_dim=64, ssm_state_size=64,
                 n_groups=2, chunk_size=16)  # fmt: skip
    hf32 = make_hf(seed=11, pattern="M*-M*-M-", **shape)
    path = save_checkpoint(hf32, tmp_path / "mid")
    hf16 = make_hf(seed=11, pattern="M*-M*-M-", **shape).to(torch.bfloat16)
    check_bf16_tracks_hf(hf32, hf16, path, "cuda")


@pytest.mark.gpu
def test_cuda_graph_decode_matches_eager(hf_and_dir):
    _, path = hf_and_dir
    check_graphs_match_eager(path, "cuda")
