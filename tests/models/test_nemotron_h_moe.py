"""Nemotron-H with MoE layers (Nemotron-3 Nano's "E" blocks) against transformers' own
``NemotronHForCausalLM``: tiny random checkpoints saved with save_pretrained (per-expert
``backbone.*`` tensors), fp32 on CPU with the fused-MoE and Mamba2 kernels under the
Triton interpreter; every routing a comparison depends on is checked free of near-ties
first (``nemotron_h_moe_utils``). GPU cases are marked."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.utils import run_ranks
from tests.models.hybrid_utils import (
    HybridDriver,
    check_bf16_tracks_hf,
    check_graphs_match_eager,
    check_mixed_steps_match_hf,
    check_steps_match,
    hf_logits,
    hf_params_as_ours,
    mixed_steps,
    run_steps,
    save_checkpoint,
    tokens,
)
from tests.models.mamba2_utils import assert_close
from tests.models.nemotron_h_moe_utils import (
    check_generate_matches_hf_tie_free,
    check_routing_margins,
    make_nemotron_h_moe_hf,
)
from vllm.model_executor.layers.fused_moe import FusedMoE
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.nemotron_h import NemotronHForCausalLM, NemotronHMoE
from vllm.model_executor.models.nemotron_h_config import NemotronHModelConfig

# Latent projections with biases, one expert group, no renormalisation; and top-1 routing
# over 2 groups (the op's single-expert path, no top-k sum).
VARIANTS = {
    "latent": dict(moe_latent_size=16, mlp_bias=True, n_group=1, topk_group=1,
                   num_experts_per_tok=2, norm_topk_prob=False, routed_scaling_factor=1.0),
    "top1": dict(n_group=2, topk_group=1, num_experts_per_tok=1, n_routed_experts=4),
}  # fmt: skip


@pytest.fixture(scope="module")
def hf_and_dir(tmp_path_factory):
    hf = make_nemotron_h_moe_hf()
    return hf, save_checkpoint(hf, tmp_path_factory.mktemp("nemotron_h_moe"))


def _full_sequences(steps) -> list[list[int]]:
    full: dict[str, list[int]] = {}
    for rows in steps:
        for sid, toks in rows:
            full[sid] = full.get(sid, []) + toks
    return list(full.values())


def test_mixed_step_logits_match_hf(hf_and_dir, device):
    """Fresh prompts, a chunked prefill continued, decodes beside them: each sequence's
    logits equal HF's full forward of it."""
    hf, path = hf_and_dir
    check_routing_margins(hf, _full_sequences(mixed_steps()))
    model = get_model(path, device=device)
    assert sum(isinstance(m, NemotronHMoE) for m in model.modules()) == 2
    check_mixed_steps_match_hf(model, hf)


def test_generate_matches_hf_greedy(hf_and_dir, device):
    hf, path = hf_and_dir
    check_generate_matches_hf_tie_free(path, hf, device)


def test_batch_equals_each_alone_and_chunks_equal_one_prefill(hf_and_dir):
    """Three prompts in one step == each alone (the experts see other tokens beside
    them); a prompt in three chunks == the same prompt in one step."""
    hf, path = hf_and_dir
    prompts = [tokens(n, "moe-batch", n) for n in (9, 3, 5)]
    check_routing_margins(hf, prompts)
    model = get_model(path)
    batch = HybridDriver(model).step([(str(i), p) for i, p in enumerate(prompts)])
    alone = [HybridDriver(model).step([("x", p)])[0] for p in prompts]
    for i, (b, a) in enumerate(zip(batch, alone, strict=True)):
        assert_close(b, a, "batching", msg=f"prompt {i}")
    driver = HybridDriver(model)
    chunks = [driver.step([("x", prompts[0][a:b])])[0] for a, b in ((0, 4), (4, 9))]
    assert_close(torch.cat(chunks), alone[0], "batching")


def test_loads_every_hf_weight_by_name(hf_and_dir):
    """The files' per-expert ``backbone.*`` tensors and transformers' in-memory stacked
    ones (``experts.up_proj`` (E, I, H), ``experts.down_proj``) load the same weights,
    exactly HF's, the router's bias included."""
    hf, path = hf_and_dir
    model = get_model(path)
    assert isinstance(model, NemotronHForCausalLM)
    theirs = hf_params_as_ours(model, hf)
    for i, layer in enumerate(hf.model.layers):
        if layer.block_type == "moe":
            bias = layer.mixer.gate.e_score_correction_bias
            theirs[f"model.layers.{i}.mixer.experts.e_score_correction_bias"] = bias
    ours = dict(model.named_parameters())
    assert set(ours) == set(theirs), set(ours) ^ set(theirs)
    for name, expected in theirs.items():
        assert torch.equal(ours[name], expected), name
    moe = model.model.layers[1].mixer
    assert moe.gate.weight.dtype == torch.float32 and moe.experts.w13_weight.shape == (8, 24, 32)
    in_memory = get_model(path, load_format="dummy")
    in_memory.load_weights(hf.state_dict().items())
    for name, p in in_memory.named_parameters():
        assert torch.equal(p, ours[name]), name


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_match_hf(variant, tmp_path):
    """A prompt and two decode steps against HF for the other router and expert options."""
    hf = make_nemotron_h_moe_hf(seed=3, **VARIANTS[variant])
    path = save_checkpoint(hf, tmp_path / variant)
    prompt, nexts = tokens(10, "moe-variant"), tokens(2, "moe-variant-next")
    check_routing_margins(hf, [prompt + nexts])
    model = get_model(path)
    if variant == "latent":
        assert model.model.layers[1].mixer.fc1_latent_proj.weight.shape == (16, 32)
    driver = HybridDriver(model)
    got = [driver.step([("s", prompt)])[0]] + [driver.step([("s", [t])])[0] for t in nexts]
    assert_close(torch.cat(got), hf_logits(hf, prompt + nexts), "vs_hf")


def test_config_moe_fields_and_refusals():
    base = dict(hidden_size=32, vocab_size=320, mamba_num_heads=4, mamba_head_dim=16,
                n_groups=2, num_attention_heads=4, num_key_value_heads=2,
                hybrid_override_pattern="ME*", n_routed_experts=8, num_experts_per_tok=3,
                moe_intermediate_size=24, moe_shared_expert_intermediate_size=40, n_group=4,
                topk_group=2, routed_scaling_factor=2.5)  # fmt: skip
    config = NemotronHModelConfig.from_dict(base)
    moe = config.moe_shape()
    assert config.layer_types == ("mamba", "moe", "attention") and config.mlp_size() is None
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (8, 3, 24)
    assert (moe.num_expert_group, moe.topk_group, moe.routed_scaling_factor) == (4, 2, 2.5)
    one_group = NemotronHModelConfig.from_dict({**base, "n_group": 1, "topk_group": 1})
    assert one_group.moe_shape().num_expert_group is None
    # a dense pattern ignores the MoE fields, however odd
    dense = NemotronHModelConfig.from_dict({**base, "hybrid_override_pattern": "M-", "n_group": 3})
    assert dense.moe_shape() is None and dense.mlp_size() == dense.intermediate_size
    refusals = {
        "n_group=3 must divide n_routed_experts=8": {"n_group": 3},
        "topk_group=5 must be at most n_group=4": {"topk_group": 5},
        "num_experts_per_tok=5 exceeds the 4 experts": {"num_experts_per_tok": 5},
        "n_shared_experts=2 is not supported": {"n_shared_experts": 2},
        "moe_latent_size must be a positive integer": {"moe_latent_size": 0},
        "routed_scaling_factor must be a positive number": {"routed_scaling_factor": -1.0},
        "mlp_hidden_act='silu'": {"mlp_hidden_act": "silu"},
    }
    for message, change in refusals.items():
        with pytest.raises(ValueError, match=message):
            NemotronHModelConfig.from_dict({**base, **change})
    config.check_tp(2)
    heads = dict(num_attention_heads=5, num_key_value_heads=5, mamba_num_heads=5, n_groups=5)
    fives = NemotronHModelConfig.from_dict({**base, **heads})  # only the experts' 24 fails
    with pytest.raises(ValueError, match=r"\): moe_intermediate_size=24 is not divisible by"):
        fives.check_tp(5)


def test_dummy_weights_run(hf_and_dir):
    """Finite logits; the correction bias small beside the scores' spread, so that the
    random router uses every expert (a benchmark's load is not piled on a few)."""
    _, path = hf_and_dir
    model = get_model(path, load_format="dummy")
    assert torch.isfinite(HybridDriver(model).step([("x", tokens(6, "dummy"))])[0]).all()
    bias = model.model.layers[1].mixer.experts.e_score_correction_bias
    assert 0 < bias.abs().max() <= 0.01


def _ranks_equal_one_rank(cases):
    for path, expected in cases:
        model = get_model(path)
        for moe in (m for m in model.modules() if isinstance(m, FusedMoE)):
            assert moe.w13_weight.shape[:2] == (8, 12)  # this rank's half of each expert
        check_steps_match(model, expected, atol=1e-5)


def test_two_ranks_equal_one_rank_gloo(hf_and_dir, tmp_path):
    """Experts and shared expert sharded by intermediate features over two gloo ranks
    (one all-reduce per MoE layer; with latent projections, the experts' sum reduced
    before fc2_latent_proj): rank 0's logits of the mixed steps equal one rank's."""
    _, path = hf_and_dir
    latent = save_checkpoint(
        make_nemotron_h_moe_hf(seed=3, **VARIANTS["latent"]), tmp_path / "latent"
    )
    cases = [(str(p), run_steps(get_model(p))) for p in (path, latent)]
    run_ranks(_ranks_equal_one_rank, cases)


@pytest.mark.gpu
def test_bf16_tracks_hf_gpu(tmp_path):
    """A mid-size shape (hidden 256, 32 experts of 128 in 4 groups, top-4) in bf16."""
    shape = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                 intermediate_size=512, mamba_num_heads=8, mamba_head_dim=64, ssm_state_size=64,
                 n_groups=2, chunk_size=16, n_routed_experts=32, num_experts_per_tok=4,
                 moe_intermediate_size=128, moe_shared_expert_intermediate_size=256,
                 n_group=4, topk_group=2)  # fmt: skip
    hf32 = make_nemotron_h_moe_hf(seed=11, pattern="ME*ME-ME", **shape)
    path = save_checkpoint(hf32, tmp_path / "mid")
    hf16 = make_nemotron_h_moe_hf(seed=11, pattern="ME*ME-ME", **shape).to(torch.bfloat16)
    check_bf16_tracks_hf(hf32, hf16, path, "cuda")


@pytest.mark.gpu
def test_cuda_graph_decode_matches_eager(hf_and_dir):
    _, path = hf_and_dir
    check_graphs_match_eager(path, "cuda")


def test_nemotron_3_nano_config_reads():
    """The published Nemotron-3-Nano-30B-A3B config's fields (the pattern, 128 experts of
    1856, top-6, one group, shared expert 3712, scaling 2.5): 23 MoE, 23 Mamba2 and 6
    attention layers, no MLP block, and it shards over 2, 4 and 8 ranks."""
    nano = dict(
        architectures=["NemotronHForCausalLM"],
        vocab_size=131072,
        hidden_size=2688,
        hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        num_attention_heads=32,
        num_key_value_heads=2,
        head_dim=128,
        intermediate_size=1856,
        mamba_num_heads=64,
        mamba_head_dim=64,
        n_groups=8,
        ssm_state_size=128,
        conv_kernel=4,
        chunk_size=128,
        n_routed_experts=128,
        num_experts_per_tok=6,
        moe_intermediate_size=1856,
        moe_shared_expert_intermediate_size=3712,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        num_nextn_predict_layers=0,
        torch_dtype="bfloat16",
    )
    config = NemotronHModelConfig.from_dict(nano)
    kinds = config.layer_types
    assert (kinds.count("moe"), kinds.count("mamba"), kinds.count("attention")) == (23, 23, 6)
    assert config.mlp_size() is None and config.moe_shape().num_expert_group is None
    assert config.moe_shape().top_k == 6 and config.moe_shape().routed_scaling_factor == 2.5
    for tp in (2, 4, 8):
        config.check_tp(tp)
