"""Zamba2 (Zamba2ForCausalLM) against transformers' own model, on tiny random checkpoints
saved with save_pretrained; fp32 on CPU (kernels under the Triton interpreter), the GPU
cases marked.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.models.hf_builders import ZAMBA2_LAYERS as LAYERS
from tests.models.hf_builders import make_zamba2_hf as make_hf
from tests.models.hybrid_utils import (
    VOCAB,
    assert_loaded_as_hf,
    check_bf16_tracks_hf,
    check_generate_matches_hf,
    check_graphs_match_eager,
    check_mixed_steps_match_hf,
    save_checkpoint,
)
from vllm import LLM, SamplingParams
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.zamba2 import Zamba2ForCausalLM
from vllm.model_executor.models.zamba2_config import Zamba2ModelConfig

VARIANTS = {
    # adapters, RoPE, two shared blocks, tied head (transformers' defaults for the rest)
    "adapters_rope": dict(),
    # no adapters: grouped KV heads become possible; no RoPE; one block used three times.
    # The head stays tied: transformers 5 unties the shared blocks along with it (one
    # switch), which makes a model that is not Zamba2 (test_untied_blocks_are_refused).
    # seed 2: with seed 0 this shape is ill-conditioned (HF's own fp32 logits are 1.8e-4
    # off its fp64 ones, beyond the fp32 bounds); seed 2 keeps HF within 4e-5
    "gqa_plain": dict(
        seed=2,
        use_shared_attention_adapter=False,
        num_key_value_heads=2,
        use_mem_rope=False,
        num_mem_blocks=1,
    ),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def hf_and_dir(request, tmp_path_factory):
    hf = make_hf(**VARIANTS[request.param])
    return hf, save_checkpoint(hf, tmp_path_factory.mktemp(f"zamba2_{request.param}"))


def test_mixed_step_logits_match_hf(hf_and_dir, device):
    hf, path = hf_and_dir
    check_mixed_steps_match_hf(get_model(path, device=device), hf)


def test_generate_matches_hf_greedy(tmp_path, device):
    """The richest variant (adapters, RoPE, two blocks) through the engine."""
    hf = make_hf(seed=1)
    check_generate_matches_hf(save_checkpoint(hf, tmp_path / "gen"), hf, device)


def test_shared_weights_load_once_and_adapters_per_use(hf_and_dir):
    hf, path = hf_and_dir
    model = get_model(path)
    assert isinstance(model, Zamba2ForCausalLM)
    cfg = model.config
    hybrid = cfg.hybrid_layer_ids
    assert hybrid == (1, 3, 4)
    assert_loaded_as_hf(model, hf)  # every use's copy of a block maps onto the one block
    blocks = [model.model.layers[i].block_id for i in hybrid]
    assert blocks == [j % cfg.num_mem_blocks for j in range(len(hybrid))]
    # one KV cache per use of a block: every hybrid layer owns its attention
    specs = model.get_cache_specs(4, torch.float32)
    assert [n for n in specs if n.endswith(".attn")] == [f"model.layers.{i}.attn" for i in hybrid]


def test_every_copy_of_a_shared_weight_must_agree(hf_and_dir, tmp_path):
    hf, path = hf_and_dir
    weights = load_file(str(path / "model.safetensors"))
    copy = "model.layers.4.shared_transformer.pre_ff_layernorm.weight"  # block 0's, used again
    src = "model.layers.1.shared_transformer.pre_ff_layernorm.weight"
    if hf.config.num_mem_blocks == 1:
        copy = "model.layers.3.shared_transformer.pre_ff_layernorm.weight"
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file({**weights, copy: weights[src].clone()}, str(tmp_path / "model.safetensors"))
    get_model(tmp_path)  # a checkpoint that stores every copy loads
    save_file({**weights, copy: weights[src] + 1}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="copies of the shared parameter .* but differ"):
        get_model(tmp_path)


def test_untied_blocks_are_refused(tmp_path):
    """transformers with tie_word_embeddings=False ties nothing, the shared blocks
    included: its checkpoint holds a different block per use, which we refuse by name."""
    hf = make_hf(seed=2, tie_word_embeddings=False)
    with pytest.raises(ValueError, match="copies of the shared parameter"):
        get_model(save_checkpoint(hf, tmp_path / "untied"))


def test_dummy_weights_from_a_config_run_through_the_engine():
    cfg = Zamba2ModelConfig(vocab_size=128, hidden_size=32, layer_types=("mamba", "hybrid"),
                            num_attention_heads=4, n_mamba_heads=4, mamba_d_state=8,
                            adapter_rank=4, intermediate_size=48, chunk_size=8,
                            use_shared_attention_adapter=True, use_mem_rope=True,
                            max_position_embeddings=64)  # fmt: skip
    llm = LLM(cfg, load_format="dummy", device="cpu", max_num_seqs=2, max_model_len=64)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize(
    "edit, match",
    [
        (dict(num_key_value_heads=2, use_shared_attention_adapter=True), "needs num_key_value"),
        (dict(layers_block_type=["mamba", "attention"]), "layers_block_type must be a list"),
        (dict(n_mamba_heads=3), "multiple of n_mamba_heads"),
    ],
    ids=["adapter_gqa", "layer_kind", "heads"],
)
def test_bad_configs(tmp_path, edit, match):
    raw = {"architectures": ["Zamba2ForCausalLM"], "hidden_size": 32, "vocab_size": VOCAB,
           "num_attention_heads": 4, "n_mamba_heads": 4, "layers_block_type": LAYERS,
           **edit}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=match):
        get_model(tmp_path, load_format="dummy")


@pytest.mark.gpu
def test_bf16_tracks_hf_gpu(tmp_path):
    """A mid-size shape (hidden 256, 8 layers, 3 uses of 2 blocks) in bf16 on the GPU."""
    shape = dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=8, n_mamba_heads=8,
                 mamba_d_state=64, adapter_rank=16, intermediate_size=512, chunk_size=16,
                 layers_block_type=["mamba", "hybrid", "mamba", "mamba", "hybrid", "mamba",
                                    "hybrid", "mamba"])  # fmt: skip
    hf32 = make_hf(seed=11, **shape)
    path = save_checkpoint(hf32, tmp_path / "mid")
    check_bf16_tracks_hf(hf32, make_hf(seed=11, **shape).to(torch.bfloat16), path, "cuda")


@pytest.mark.gpu
def test_cuda_graph_decode_matches_eager(hf_and_dir):
    _, path = hf_and_dir
    check_graphs_match_eager(path, "cuda")
