"""Bamba and NemotronH sharded over two gloo ranks equal the unsharded models: attention by
heads (QKVParallelLinear, KV heads split, or replicated when there are fewer than ranks;
o_proj row-parallel), the MLPs by intermediate features, the Mamba2 mixers by heads, the
embeddings and LM head by vocabulary (logits gathered on rank 0). Tiny random checkpoints
saved with transformers' save_pretrained; fp32 logits of mixed steps (fresh prompts, a
chunked prefill continued, decodes beside them) within 1e-5 of one rank's, each rank's KV
cache spec holding its own heads; LLM.generate's greedy tokens at TP=2 equal TP=1's. Per
model one TP=2 engine: its greedy tokens are checked, then every two-rank step check runs
in its ranks (one spawn of the group per model)."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from tests.distributed.utils import check_generate_two_ranks_equals_one_rank
from tests.models.hf_builders import make_bamba_hf as make_bamba
from tests.models.hf_builders import make_nemotron_h_hf as make_nemotron_h
from tests.models.hybrid_utils import check_steps_match, run_steps, save_checkpoint
from vllm import LLM
from vllm.cache_spec import AttentionSpec
from vllm.distributed import get_tp_group
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import QKVParallelLinear
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.bamba_config import BambaModelConfig
from vllm.model_executor.models.nemotron_h_config import NemotronHModelConfig

MAKERS = {"bamba": make_bamba, "nemotron_h": make_nemotron_h}


def _ranks_equal_one_rank(path, heads, kv_heads, expected, atol, load_format="auto"):
    tp = get_tp_group()
    model = get_model(path, load_format=load_format)
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    qkvs = [m for m in model.modules() if isinstance(m, QKVParallelLinear)]
    assert len(attns) == len(qkvs) == 2
    local_kv = max(1, kv_heads // tp.world_size)
    for attn in attns:  # the engine sizes each rank's KV cache from these specs
        assert (attn.num_heads, attn.num_kv_heads) == (heads // tp.world_size, local_kv)
    specs = [s for s in model.get_cache_specs(4, torch.float32).values()]
    assert [s.num_kv_heads for s in specs if isinstance(s, AttentionSpec)] == [local_kv] * 2
    check_steps_match(model, expected, atol)


def _bound(expected) -> float:
    """1e-5 of the steps' largest logit: fp32 partial sums added in another order."""
    return 1e-5 * max(float(r.abs().max()) for step in expected for r in step)


@pytest.mark.parametrize("arch", ["bamba", "nemotron_h"])
def test_two_ranks_equal_one_rank_gloo(tmp_path, arch):
    """In the ranks of one TP=2 engine (one KV head, replicated), after its greedy tokens
    are checked against TP=1's: the mixed steps with two KV heads (one per rank) and one
    (replicated); dummy weights, which draw each fused part (q, k, v; gate, up; biases)
    under its one-rank name at full shape, so two ranks compute what one rank does; for
    Bamba also the head tied to the vocabulary-parallel embedding's rows. Those logits
    reach 4.4 and the third step's differ from one rank's by up to 1.9e-5 (fp32 partial
    sums added in another order, over 8 all-reduces; 1.05e-5 seen at step 1 on another
    checkpoint): their bound is 1e-5 of the steps' largest logit, for every check."""
    checks = []
    for kv_heads in (2, 1):
        path = save_checkpoint(
            MAKERS[arch](seed=1, num_key_value_heads=kv_heads), tmp_path / f"kv{kv_heads}"
        )
        expected = run_steps(get_model(path))
        checks.append((_ranks_equal_one_rank, str(path), 4, kv_heads, expected, _bound(expected)))
    bias = {"attention_bias": True, "mlp_bias": True} if arch == "bamba" else {}
    path = save_checkpoint(MAKERS[arch](seed=3, **bias), tmp_path / "dummy")
    expected = run_steps(get_model(path, load_format="dummy"))
    checks.append((_ranks_equal_one_rank, str(path), 4, 2, expected, _bound(expected), "dummy"))
    if arch == "bamba":
        path = save_checkpoint(make_bamba(seed=2, tie_word_embeddings=True), tmp_path / "tied")
        expected = run_steps(get_model(path))
        checks.append((_ranks_equal_one_rank, str(path), 4, 2, expected, _bound(expected)))
    gen = save_checkpoint(MAKERS[arch](seed=4, num_key_value_heads=1), tmp_path / "gen")
    check_generate_two_ranks_equals_one_rank(gen, *checks)


def test_one_rank_holds_the_checkpoints_layers_whole(tmp_path):
    """At world size 1: the parallel layers, each holding its whole tensors; q/k/v and
    gate/up fused (their checkpoint parts stacked), every other name the checkpoint's."""
    model = get_model(save_checkpoint(make_bamba(), tmp_path / "bamba"))
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].feed_forward
    assert (attn.qkv_proj.num_heads, attn.qkv_proj.num_kv_heads) == (4, 2)
    assert attn.qkv_proj.weight.shape == ((4 + 2 + 2) * 8, 32)
    assert mlp.gate_up_proj.weight.shape == (2 * 48, 32)
    assert type(model.lm_head) is ParallelLMHead and model.lm_head.weight.shape == (320, 32)
    model = get_model(save_checkpoint(make_nemotron_h(), tmp_path / "nemotron_h"))
    names = {n for n, _ in model.named_parameters()}
    assert {"model.layers.1.mixer.qkv_proj.weight", "model.layers.2.mixer.up_proj.weight"} <= names
    assert not any("q_proj" in n or "k_proj" in n for n in names)


def test_configs_that_do_not_shard_are_refused_before_any_process():
    before = set(multiprocessing.active_children())
    opts = dict(load_format="dummy", device="cpu", max_model_len=64, tensor_parallel_size=2)
    bamba = BambaModelConfig(
        vocab_size=128,
        hidden_size=24,
        num_hidden_layers=2,
        attn_layer_indices=(1,),
        num_attention_heads=3,
        num_key_value_heads=3,
        intermediate_size=45,
        mamba_n_heads=4,
        mamba_d_head=12,
    )
    with pytest.raises(
        ValueError, match=r"num_attention_heads=3 .*num_key_value_heads=3 .*intermediate_size=45"
    ):
        LLM(bamba, **opts)
    nemotron = NemotronHModelConfig(intermediate_size=45)
    with pytest.raises(ValueError, match=r"intermediate_size=45 is not divisible by tp_size=2"):
        LLM(nemotron, **opts)
    assert set(multiprocessing.active_children()) == before
