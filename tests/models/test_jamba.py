"""Jamba (JambaForCausalLM) against transformers' own model, on tiny random checkpoints saved
with save_pretrained (fp32 on CPU: conv, attention and fused-MoE kernels under the Triton
interpreter, the Mamba1 scan through its fp32 reference), and the batch invariants of our
model: a varlen step == each sequence alone, chunked prefill == one prefill. Every HF
comparison runs inside ``routing_margins``: HF's router logits keep each token's k-th and
(k+1)-th experts ROUTING_MARGIN apart, so routing cannot tie. GPU cases are marked.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from tests.models.hybrid_utils import (
    HybridDriver,
    check_bad_config_refused,
    check_bf16_tracks_hf,
    check_generate_matches_hf,
    check_mixed_steps_match_hf,
    hf_logits,
    save_checkpoint,
    tokens,
)
from tests.models.jamba_utils import (
    MOE_ON_MAMBA,
    TINY,
    dummy_config,
    hf_params_as_ours,
    make_jamba_hf,
    routing_margins,
)
from tests.models.mamba2_utils import assert_close
from vllm import LLM, SamplingParams
from vllm.model_executor.layers.fused_moe import FusedMoE
from vllm.model_executor.layers.mamba.mamba_mixer import MambaMixer
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.hybrid_base import GatedMLP
from vllm.model_executor.models.jamba import JambaForCausalLM
from vllm.model_executor.models.jamba_config import JAMBA_V0_1, JambaModelConfig

TOP_K = TINY["num_experts_per_tok"]
# Experts beside attention (transformers' default plan, scaled down), then beside Mamba.
PLANS = {"moe_on_attention": {}, "moe_on_mamba": MOE_ON_MAMBA}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """plan -> (HF model, its saved directory), each made once."""
    made: dict[str, tuple] = {}

    def get(plan: str):
        if plan not in made:
            hf = make_jamba_hf(seed=6, **PLANS[plan])
            made[plan] = hf, save_checkpoint(hf, tmp_path_factory.mktemp(plan))
        return made[plan]

    return get


@pytest.fixture(params=list(PLANS))
def hf_and_dir(request, checkpoints):
    return checkpoints(request.param)


def test_loads_every_hf_weight_by_name(hf_and_dir):
    """Parameters equal HF's (per-expert file tensors stacked into the FusedMoE); the
    layer plan is transformers'."""
    hf, path = hf_and_dir
    model = get_model(path)
    assert isinstance(model, JambaForCausalLM)
    ours, theirs = dict(model.named_parameters()), hf_params_as_ours(model, hf)
    assert set(ours) == set(theirs), set(ours) ^ set(theirs)
    for name, expected in theirs.items():
        assert torch.equal(ours[name], expected), name
    cfg = model.config
    assert list(cfg.layer_types) == hf.config.layers_block_type
    assert list(cfg.moe_layers) == [n > 1 for n in hf.config.layers_num_experts]
    for layer, moe in zip(model.model.layers, cfg.moe_layers, strict=True):
        kind = FusedMoE if moe else GatedMLP
        assert isinstance(getattr(layer.feed_forward, "experts", layer.feed_forward), kind)
    mixer = next(m for m in model.modules() if isinstance(m, MambaMixer))
    assert mixer.time_step_rank == hf.config.mamba_dt_rank  # "auto" resolved as HF does
    assert mixer.dt_layernorm.weight.shape == (hf.config.mamba_dt_rank,)


def test_varlen_prefill_logits_match_hf(hf_and_dir):
    """One step of three fresh prompts (one of a single token) against HF, one by one."""
    hf, path = hf_and_dir
    prompts = {"p0": tokens(17, "p0"), "p1": tokens(6, "p1"), "p2": tokens(1, "p2")}
    rows = [("p2", prompts["p2"]), ("p0", prompts["p0"]), ("p1", prompts["p1"])]
    got = HybridDriver(get_model(path)).step(rows)
    with routing_margins(hf, TOP_K):
        for (sid, toks), logits in zip(rows, got, strict=True):
            assert_close(logits, hf_logits(hf, toks), "vs_hf", msg=f"prompt {sid}")


def test_mixed_steps_match_hf(hf_and_dir):
    """Fresh prompts, a chunked prefill continued and decodes beside them, over three
    steps, against HF's full-sequence logits."""
    hf, path = hf_and_dir
    with routing_margins(hf, TOP_K):
        check_mixed_steps_match_hf(get_model(path), hf)


def test_generate_matches_hf_greedy(checkpoints):
    """``LLM(dir).generate``: prompts of several lengths together under a 16-token budget
    (chunked prefills beside decodes) give HF generate's greedy tokens (transformers'
    plan: experts beside attention; the other plan's steps are covered above)."""
    hf, path = checkpoints("moe_on_attention")
    with routing_margins(hf, TOP_K):
        check_generate_matches_hf(path, hf, max_tokens=5)


def test_stacked_expert_names_load_as_the_files_per_expert_ones(hf_and_dir):
    """transformers' in-memory names (``experts.gate_up_proj`` (E, 2I, H), ...) load to
    the same parameters as the saved files' per-expert tensors."""
    hf, path = hf_and_dir
    model = get_model(path)
    stacked = get_model(JambaModelConfig.from_pretrained(path), load_format="dummy")
    stacked.load_weights((n, p.detach()) for n, p in hf.named_parameters())
    for (name, p), q in zip(model.named_parameters(), stacked.parameters(), strict=True):
        assert torch.equal(p, q), name


def _dummy_model():
    return get_model(dummy_config(**MOE_ON_MAMBA), load_format="dummy", seed=3)


def test_varlen_step_equals_each_sequence_alone():
    """A step of two decodes, a continued prefill and a fresh prompt gives each row the
    logits it gets alone, and leaves each sequence the same Mamba state."""
    model = _dummy_model()
    mixed, alone = HybridDriver(model), HybridDriver(model)
    history = {"dec_a": 5, "dec_b": 9, "cont": 7}
    for drv in (mixed, alone):
        for sid, n in history.items():
            drv.step([(sid, tokens(n, "hist", sid))])
    rows = [
        ("dec_a", tokens(1, "new", "dec_a")),
        ("dec_b", tokens(1, "new", "dec_b")),
        ("cont", tokens(6, "new", "cont")),
        ("fresh", tokens(11, "new", "fresh")),
    ]
    got = mixed.step(rows)
    for row, logits in zip(rows, got, strict=True):
        assert_close(logits, alone.step([row])[0], "batching", msg=row[0])
    for layer in range(mixed.cache.mamba_pool.num_layers):
        for sid in ("dec_a", "dec_b", "cont", "fresh"):
            slot = mixed.seqs[sid]["slot"]
            assert slot == alone.seqs[sid]["slot"]
            for part in (0, 1):  # conv state, SSM state
                assert_close(
                    mixed.cache.mamba_pool.layer(layer)[part][slot],
                    alone.cache.mamba_pool.layer(layer)[part][slot],
                    "batching",
                )


def test_chunked_prefill_equals_one_prefill():
    model = _dummy_model()
    prompt = tokens(19, "chunked")
    whole = HybridDriver(model)
    expected = whole.step([("s", prompt)])[0]
    split = HybridDriver(model)
    got, start = [], 0
    for n in (5, 1, 9, 4):  # a one-token continuation among them (it takes the decode path)
        got.append(split.step([("s", prompt[start : start + n])])[0])
        start += n
    assert_close(torch.cat(got), expected, "batching")
    for layer in range(whole.cache.mamba_pool.num_layers):
        for part in (0, 1):
            assert_close(
                split.cache.mamba_pool.layer(layer)[part][1],
                whole.cache.mamba_pool.layer(layer)[part][1],
                "batching",
            )


def test_dummy_weights_from_a_config_run_through_the_engine():
    llm = LLM(dummy_config(), load_format="dummy", device="cpu", max_num_seqs=2, max_model_len=32)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert llm.engine.config.served_model_name == "jamba"
    assert llm.engine.runner.startup["num_kv_blocks"] > 0


def test_jamba_v0_1_preset_is_transformers_default_plan():
    from transformers import JambaConfig

    cfg, hf = JambaModelConfig(**JAMBA_V0_1), JambaConfig()
    assert cfg == JambaModelConfig()  # transformers' defaults, spelled out
    assert list(cfg.layer_types) == hf.layers_block_type  # attention at 4, 12, 20, 28
    assert [i for i, m in enumerate(cfg.moe_layers) if m] == list(range(1, 32, 2))
    assert cfg.mamba_dt_rank == hf.mamba_dt_rank == 256 and cfg.head_dim == 128


def test_tp_check_names_the_fields():
    cfg = dummy_config()  # d_inner 64, heads 4 / 2 KV, intermediate 48
    cfg.check_tp(2)
    with pytest.raises(ValueError, match=r"mamba_expand \* hidden_size=64 is not divisible"):
        cfg.check_tp(3)
    with pytest.raises(ValueError, match="intermediate_size=50 is not divisible by tp_size=4"):
        dummy_config(intermediate_size=50).check_tp(4)


@pytest.mark.parametrize(
    "edit, match",
    [
        (dict(attn_layer_offset=2), r"attn_layer_offset=2 must be an integer in \[0, "),
        (dict(expert_layer_period=0), "expert_layer_period must be a positive integer"),
        (dict(attn_layer_period=1, attn_layer_offset=0), "no Mamba layer"),
        (dict(num_experts_per_tok=5), "num_experts_per_tok=5 exceeds num_experts=4"),
        (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
        (dict(mamba_d_conv=9), "mamba_d_conv=9 is not supported"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(mamba_inner_layernorms=False), "mamba_inner_layernorms=false is not supported"),
        (dict(architectures=["LlamaForCausalLM"], model_type="llama"), "unsupported model"),
    ],
    ids=[
        "attn_offset",
        "expert_period",
        "no_mamba",
        "top_k",
        "gqa",
        "conv",
        "act",
        "no_inner_norms",
        "arch",
    ],  # fmt: skip
)
def test_bad_configs(checkpoints, tmp_path, edit, match):
    _, path = checkpoints("moe_on_attention")
    check_bad_config_refused(path, tmp_path, edit, match)


def test_remote_code_config_keys(checkpoints):
    """The remote-code configs' ``n_ctx`` and ``mamba_inner_layernorms``, transformers'
    ``num_local_experts``."""
    _, path = checkpoints("moe_on_attention")
    raw = json.loads((path / "config.json").read_text())
    del raw["max_position_embeddings"]
    raw.update(n_ctx=96, mamba_inner_layernorms=True, calc_logits_for_entire_prompt=False)
    raw["num_local_experts"] = raw.pop("num_experts")
    cfg = JambaModelConfig.from_dict(raw)
    assert cfg.max_position_embeddings == 96 and cfg.num_experts == 4


def test_weighted_mixer_norms_need_an_epsilon():
    shape = replace(dummy_config().mamba1_shape(), bcdt_rms_eps=None)
    with pytest.raises(ValueError, match="bcdt_norm_weights needs bcdt_rms_eps"):
        MambaMixer(shape)


def test_one_expert_means_dense_mlps_everywhere():
    """transformers builds the MLP wherever ``num_experts`` is 1, whatever the period."""
    cfg = dummy_config(num_experts=1, num_experts_per_tok=1)
    assert not any(cfg.moe_layers)
    model = get_model(cfg, load_format="dummy")
    assert not any(isinstance(m, FusedMoE) for m in model.modules())


def check_bf16_mid_shape(tmp_path, device: str) -> None:
    """A mid-size shape (hidden 256, 8 experts, 4 layers) in bf16 against HF's fp32 logits,
    within twice HF's own bf16 error. bf16 moves router logits by ~1e-2: seed 12's tokens
    keep a 0.2 margin in fp32, asserted at 0.1."""
    shape = dict(
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_experts=8,
        mamba_d_state=16,
        mamba_dt_rank="auto",
    )
    hf32 = make_jamba_hf(seed=12, **shape)
    path = save_checkpoint(hf32, tmp_path / "mid")
    hf16 = make_jamba_hf(seed=12, **shape).to(torch.bfloat16)
    with routing_margins(hf32, TOP_K, margin=0.1):
        check_bf16_tracks_hf(hf32, hf16, path, device)


def test_bf16_tracks_hf_cpu(monkeypatch, tmp_path):
    """On the CPU the kernels' fp32 references run (the interpreter's bf16 arithmetic is
    wrong): conv, attention, experts, norms."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    check_bf16_mid_shape(tmp_path, "cpu")


@pytest.mark.gpu
def test_bf16_tracks_hf_gpu(tmp_path):
    check_bf16_mid_shape(tmp_path, "cuda")
