"""Zamba2 sharded over two gloo ranks equals the unsharded model: each shared block's
attention by heads (QKVParallelLinear over the 2 x hidden input, KV heads split or
replicated; o_proj row-parallel), its MLP by intermediate features (gate_up merged
column-parallel, down row-parallel), each use's adapters with the down-projection
replicated and the up-projection sharded like the output it adds to, the Mamba2 mixers by
heads, the embeddings and LM head by vocabulary. Tiny random checkpoints made with
transformers' own Zamba2 and saved with save_pretrained; fp32 logits of three mixed steps
close to one rank's (below); LLM.generate's greedy tokens at TP=2 equal TP=1's; unequal
copies of a shared weight and configs that do not divide are refused. Every two-rank check
runs in the ranks of the one TP=2 engine the generate check starts (one spawn).

The logits' bound is 4e-5 of their scale (rtol 1e-5), not the other hybrids' 1e-5: these
tiny Zamba2s amplify fp32 rounding about four times more than the Bamba of
test_hybrid_tp.py. Measured: transformers' own fp32 logits are 9.0e-5 (adapters_rope) and
4.9e-5 (gqa_bias) off its fp64 ones, Bamba's 2.5e-5 and 2.1e-5; TP=2 differs from TP=1 by
up to 8.0e-5 and 5.5e-5 on logits of scale 5.0 and 4.4 (1.6e-5 and 1.2e-5 of it), while
TP=1 and TP=2 are equally far from the fp64 logits of the same weights (1.21e-4 and
1.22e-4; 8.5e-5 and 5.4e-5): the difference is rounding (partial sums added in another
order over a dozen all-reduces), not the sharding. A wrong slice moves logits by O(0.1)."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.distributed.utils import check_generate_two_ranks_equals_one_rank
from tests.models.hf_builders import make_zamba2_hf as make_hf
from tests.models.hybrid_utils import check_steps_match, run_steps, save_checkpoint
from vllm import LLM
from vllm.cache_spec import AttentionSpec
from vllm.distributed import get_tp_group
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
)
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.model_loader.weight_utils import iterate_checkpoint_slices
from vllm.model_executor.models.zamba2_config import Zamba2ModelConfig

VARIANTS = {
    # adapters on q/k/v and gate_up, RoPE, two shared blocks used three times, 4 KV heads
    "adapters_rope": dict(seed=1),
    # one block used three times, one KV head (replicated on both ranks), biases on the
    # MLP and the mixers' in/out projections (add_bias_linear)
    "gqa_bias": dict(
        seed=2,
        use_shared_attention_adapter=False,
        num_key_value_heads=1,
        use_mem_rope=False,
        num_mem_blocks=1,
        add_bias_linear=True,
    ),
}


def _ranks_equal_one_rank(path, expected, load_format="auto"):
    scale = max(float(r.abs().max()) for step in expected for r in step)
    tp = get_tp_group()
    model = get_model(path, load_format=load_format)
    cfg = model.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    local = (heads // tp.world_size, max(1, kv // tp.world_size))
    qkvs = [m for m in model.modules() if isinstance(m, QKVParallelLinear)]
    assert len(qkvs) == cfg.num_mem_blocks  # one shard per shared block, not per use
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    assert [(a.num_heads, a.num_kv_heads) for a in attns] == [local] * len(cfg.hybrid_layer_ids)
    specs = model.get_cache_specs(4, torch.float32).values()
    assert [s.num_kv_heads for s in specs if isinstance(s, AttentionSpec)] == [local[1]] * 3
    for i in cfg.hybrid_layer_ids:
        layer = model.model.layers[i]
        adapters = [layer.gate_up_adapter]
        if cfg.use_shared_attention_adapter:
            adapters += [layer.q_adapter, layer.k_adapter, layer.v_adapter]
        for down, up in adapters:  # down replicated, up sharded with what it adds to
            assert type(down) is ReplicatedLinear and isinstance(up, ColumnParallelLinear)
        up = layer.gate_up_adapter[1]
        assert isinstance(up, MergedColumnParallelLinear)
        assert up.weight.shape[0] == 2 * cfg.intermediate_size // tp.world_size
    check_steps_match(model, expected, 4e-5 * scale)


def _replicated(name: str) -> bool:
    """Checkpoint tensors every rank reads whole: the norms, each use's ``linear`` and the
    adapters' down-projections (``..._adapter_list.{j}.0``)."""
    return "layernorm" in name or name.endswith((".linear.weight", ".0.weight"))


def _reads_its_rows_of_every_copy(good: str, bad: str) -> None:
    slices = []

    def recorded():
        for name, s in iterate_checkpoint_slices(good):
            slices.append(s)
            yield name, s

    model = get_model(good, load_format="dummy")
    model.load_weights(recorded())
    for s in slices:  # 2 ranks, every sharded size even: half of each sharded tensor
        full = 4 * torch.Size(s.shape).numel()
        assert s.bytes_read == (full if _replicated(s.name) else full // 2), s.name
    with pytest.raises(ValueError, match="copies of the shared parameter .* but differ"):
        get_model(bad)


def _bad_copy_checkpoints(tmp_path):
    """A checkpoint storing every copy of a shared weight (block 0's q_proj, a fused qkv
    part under parallelism), the copies equal ("good") and different ("bad")."""
    path = save_checkpoint(make_hf(seed=5), tmp_path / "hf")
    weights = load_file(str(path / "model.safetensors"))
    src = "model.layers.1.shared_transformer.self_attn.q_proj.weight"  # block 0, use 0
    copy = "model.layers.4.shared_transformer.self_attn.q_proj.weight"  # block 0, use 2
    for name, value in (("good", weights[src].clone()), ("bad", weights[src] + 1)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text((path / "config.json").read_text())
        save_file({**weights, copy: value}, str(tmp_path / name / "model.safetensors"))
    return str(tmp_path / "good"), str(tmp_path / "bad")


def test_two_ranks_equal_one_rank_gloo(tmp_path):
    """In the ranks of one TP=2 engine, after its greedy tokens are checked against TP=1's:
    each variant's mixed steps; dummy weights (q/k/v drawn under the one-rank names of
    each block, the fused gate_up and the adapters at full shape: two ranks compute what
    one rank does); each rank reading only its rows of the shared blocks' tensors, the
    sharded adapters and the mixers, whole the replicated ones, and a checkpoint storing
    every copy of a shared weight loading when the copies are equal, refused when a rank's
    rows of a copy differ."""
    checks = []
    for variant, kwargs in VARIANTS.items():
        path = save_checkpoint(make_hf(**kwargs), tmp_path / variant)
        checks.append((_ranks_equal_one_rank, str(path), run_steps(get_model(path))))
    path = save_checkpoint(make_hf(seed=3), tmp_path / "dummy")
    expected = run_steps(get_model(path, load_format="dummy"))
    checks.append((_ranks_equal_one_rank, str(path), expected, "dummy"))
    checks.append((_reads_its_rows_of_every_copy, *_bad_copy_checkpoints(tmp_path)))
    gen = save_checkpoint(make_hf(seed=4), tmp_path / "gen")
    check_generate_two_ranks_equals_one_rank(gen, *checks)


def test_configs_that_do_not_shard_are_refused_before_any_process():
    before = set(multiprocessing.active_children())
    opts = dict(load_format="dummy", device="cpu", max_model_len=64, tensor_parallel_size=2)
    odd = Zamba2ModelConfig(
        vocab_size=128,
        hidden_size=24,
        layer_types=("mamba", "hybrid"),
        num_attention_heads=3,
        n_mamba_heads=3,
        mamba_d_state=8,
        adapter_rank=4,
        intermediate_size=45,
        chunk_size=8,
    )
    with pytest.raises(
        ValueError,
        match=r"Zamba2ModelConfig\): n_mamba_heads=3 .*num_attention_heads=3 "
        r".*num_key_value_heads=3 .*intermediate_size=45",
    ):
        LLM(odd, **opts)
    assert set(multiprocessing.active_children()) == before
