"""Granite-4.0-H (GraniteMoeHybridForCausalLM) against transformers' own model, on tiny
random checkpoints saved with save_pretrained; fp32 on CPU (kernels, the fused MoE
included, under the Triton interpreter), the GPU cases marked.

The main checkpoint has routed experts beside the shared MLP, RoPE and every multiplier
away from 1; a second one is the dense H-Micro form (no experts) without positional
encoding and with tied embeddings. Tests that compare routed models watch the routers
(``RoutingMargins``): no token's top-k choice is within rounding of a tie.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.granitemoehybrid_utils import (
    RoutingMargins,
    assert_granite_loaded_as_hf,
    make_granite_hf,
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
from vllm.model_executor.layers.fused_moe import FusedMoE
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.granitemoehybrid import GraniteMoeHybridForCausalLM
from vllm.model_executor.models.granitemoehybrid_config import (
    GRANITE_4_0_H_TINY,
    GraniteMoeHybridModelConfig,
)


@pytest.fixture(scope="module")
def hf_and_dir(tmp_path_factory):
    hf = make_granite_hf()
    return hf, save_checkpoint(hf, tmp_path_factory.mktemp("granite"))


def test_mixed_step_logits_match_hf(hf_and_dir, device):
    """Fresh prompts, a chunked prefill continued beside decodes, decodes: vs HF."""
    hf, path = hf_and_dir
    margins = RoutingMargins().watch_hf(hf)
    check_mixed_steps_match_hf(get_model(path, device=device), hf)
    margins.check()


def test_generate_matches_hf_greedy(hf_and_dir, device):
    hf, path = hf_and_dir
    margins = RoutingMargins().watch_hf(hf)
    check_generate_matches_hf(path, hf, device)
    margins.check()


def test_varlen_batch_equals_each_alone_and_chunks_equal_one_prefill(hf_and_dir):
    """Three prompts in one step (then a decode each) give each one's logits alone; a
    prompt fed in chunks of 3, 1 and 5 tokens gives its one-prefill logits."""
    _, path = hf_and_dir
    model = get_model(path)
    margins = RoutingMargins().watch_ours(model)
    check_varlen_batch_and_chunks(model)
    margins.check()


def test_loads_every_hf_weight_by_name(hf_and_dir):
    """Granite's file names (``input_linear``, ``output_linear``, ``router.layer``) from
    the checkpoint, and transformers 5's in-memory names (``experts.gate_up_proj``,
    ``experts.down_proj``, ``router.weight``) from the HF model itself."""
    hf, path = hf_and_dir
    model = get_model(path)
    assert isinstance(model, GraniteMoeHybridForCausalLM)
    assert_granite_loaded_as_hf(model, hf)
    cfg = model.config
    assert cfg.layer_types == ("mamba", "attention", "mamba", "attention")
    assert cfg.use_rope and cfg.rope_positions == 128 and cfg.attention_multiplier == 0.3
    moe = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(moe) == 4 and moe[0].top_k == 2 and moe[0].w13_weight.shape == (4, 48, 32)
    in_memory = get_model(path, load_format="dummy")
    in_memory.load_weights((n, p.detach()) for n, p in hf.named_parameters())
    assert any(".experts.gate_up_proj" in n for n, _ in hf.named_parameters())
    assert_granite_loaded_as_hf(in_memory, hf)


def test_a_missing_expert_tensor_is_named(hf_and_dir):
    hf, _ = hf_and_dir
    model = get_model(hf_and_dir[1], load_format="dummy")
    dropped = "model.layers.2.block_sparse_moe.experts.down_proj"
    weights = [(n, p.detach()) for n, p in hf.named_parameters() if n != dropped]
    with pytest.raises(ValueError, match=r"model\.layers\.2\.block_sparse_moe\.experts\.w2"):
        model.load_weights(weights)


def test_dense_micro_form_without_positions_and_tied(tmp_path):
    """No experts (the shared MLP alone), no positional encoding ("nope"), tied head, and
    a ``head_dim`` key (transformers reads it when present: heads of 16, not 32 / 4)."""
    hf = make_granite_hf(
        seed=2,
        num_local_experts=0,
        position_embedding_type="nope",
        tie_word_embeddings=True,
        head_dim=16,
    )
    model = get_model(save_checkpoint(hf, tmp_path / "micro"))
    cfg = model.config
    assert not cfg.has_experts and cfg.position_embedding_type is None
    assert cfg.attention_shape().head_dim == 16
    assert cfg.rope_positions is None  # no table: max_model_len is not bound by it
    assert not any(isinstance(m, FusedMoE) for m in model.modules())
    assert all(layer.self_attn.rotary_emb is None for layer in model.model.layers[1::2])
    assert model.lm_head.weight is model.model.embed_tokens.weight
    check_mixed_steps_match_hf(model, hf)


def test_config_forms_and_refusals():
    base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8)  # fmt: skip
    new = GraniteMoeHybridModelConfig.from_dict(
        {**base, "layer_types": ["linear_attention", "full_attention", "mamba"]}
    )
    assert new.layer_types == ("mamba", "attention", "mamba") and new.num_key_value_heads == 4
    old = GraniteMoeHybridModelConfig.from_dict(
        {**base, "layers_block_type": ["mamba", "attention", "attention"]}
    )
    assert old.layer_types == ("mamba", "attention", "attention")
    assert GraniteMoeHybridModelConfig.from_dict(base).layer_types == ("mamba",) * 3  # as HF
    rope = GraniteMoeHybridModelConfig.from_dict(
        {**base, "position_embedding_type": "rope", "rope_parameters": {"rope_theta": 5e4}}
    )
    assert rope.rope_theta == 5e4 and rope.rope_positions == 2048
    tiny = GraniteMoeHybridModelConfig(**GRANITE_4_0_H_TINY)
    assert tiny.layer_types.count("attention") == 4 and not tiny.use_rope
    refusals = [
        ({"layer_types": ["mamba", "moe", "mamba"]}, "layer_types must list"),
        ({"layer_types": ["mamba"]}, "lists 1 layers, but num_hidden_layers=3"),
        ({"layer_types": ["attention"] * 3}, "at least one Mamba layer"),
        ({"position_embedding_type": "alibi"}, "position_embedding_type='alibi'"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds num_local_experts=8"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"position_embedding_type": "rope", "rope_parameters": {"rope_type": "yarn"}}, "yarn"),
        ({"logits_scaling": 0}, "logits_scaling must not be 0"),
    ]
    for edit, match in refusals:
        with pytest.raises(ValueError, match=match):
            GraniteMoeHybridModelConfig.from_dict({**base, **edit})


def test_tp_check_names_the_fields():
    cfg = GraniteMoeHybridModelConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, layer_types=("mamba", "attention"),
        num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=2, mamba_d_head=32,
        intermediate_size=6, shared_intermediate_size=9, num_local_experts=4,
    )  # fmt: skip
    cfg.check_tp(1)
    with pytest.raises(ValueError) as err:
        cfg.check_tp(4)
    for field in ("shared_intermediate_size=9", "intermediate_size=6", "mamba_n_heads=2"):
        assert field in str(err.value)


def test_dummy_weights_from_a_config_run_through_the_engine():
    cfg = GraniteMoeHybridModelConfig(
        vocab_size=128, hidden_size=32, intermediate_size=16, shared_intermediate_size=24,
        num_hidden_layers=2, layer_types=("mamba", "attention"), num_attention_heads=4,
        num_key_value_heads=4, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
        mamba_chunk_size=8, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, position_embedding_type="rope",
    )  # fmt: skip
    llm = LLM(cfg, load_format="dummy", device="cpu", max_num_seqs=2, max_model_len=64)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert llm.engine.config.served_model_name == "granitemoehybrid"
    assert llm.engine.runner.startup["num_kv_blocks"] > 0


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            dict(layer_types=["mamba", "sliding_attention", "mamba", "mamba"]),
            "layer_types must list",
        ),
        (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
        (dict(mamba_d_conv=9), "conv kernel 9 is not supported"),
        (dict(architectures=["GraniteMoeForCausalLM"], model_type="granitemoe"), "unsupported"),
    ],
    ids=["kind", "gqa", "conv", "arch"],
)
def test_bad_checkpoint_configs(hf_and_dir, tmp_path, edit, match):
    check_bad_config_refused(hf_and_dir[1], tmp_path, edit, match)


def test_max_model_len_beyond_the_rope_table(hf_and_dir):
    _, path = hf_and_dir
    with pytest.raises(ValueError, match="max_model_len=129 exceeds the 128 positions"):
        LLM(str(path), device="cpu", max_model_len=129)


@pytest.mark.gpu
def test_bf16_tracks_hf_gpu(tmp_path):
    """A mid-size shape (hidden 256, 6 layers, 2 attention) in bf16. Every token takes all
    4 experts (top-4 of 4): bf16 rounding moves router logits by about their tie gaps here
    (a top-2 choice could then differ from fp32's for no bug); the choice itself is
    tested in fp32 above, the weighting and the kernels' bf16 path here."""
    shape = dict(
        hidden_size=256,
        intermediate_size=128,
        shared_intermediate_size=256,
        num_hidden_layers=6,
        layer_types=["mamba", "mamba", "attention", "mamba", "mamba", "attention"],
        num_attention_heads=8,
        num_key_value_heads=2,
        mamba_n_heads=8,
        mamba_d_head=64,
        mamba_d_state=64,
        mamba_chunk_size=16,
        num_local_experts=4,
        num_experts_per_tok=4,
    )
    hf32 = make_granite_hf(seed=11, **shape)
    path = save_checkpoint(hf32, tmp_path / "mid")
    hf16 = make_granite_hf(seed=11, **shape).to(torch.bfloat16)
    check_bf16_tracks_hf(hf32, hf16, path, "cuda")


@pytest.mark.gpu
def test_cuda_graph_decode_matches_eager(hf_and_dir):
    _, path = hf_and_dir
    check_graphs_match_eager(path, "cuda")
