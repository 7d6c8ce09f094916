"""Sharded loading from a real safetensors checkpoint: on two ranks each rank reads only
its slice of every sharded tensor (counted in bytes), and the lazy slices load the same
parameters as the full tensors; errors name the checkpoint tensor."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tests.distributed.utils import run_ranks
from vllm.distributed import get_tp_group
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.mamba.mamba_tp import (
    Mamba2InProj,
    mamba2_shard,
    mamba2_weight_loaders,
)
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.model_loader.tp_weight_utils import (
    CheckpointSlice,
    iterate_checkpoint_slices,
    load_tp_weights,
)

HIDDEN, VOCAB = 8, 50
MAMBA = dict(num_heads=4, head_dim=2, state_size=3, n_groups=1, conv_kernel=4)


class TinyTP(nn.Module):
    """One of each sharded layer kind, with HF-style checkpoint names mapped onto it."""

    def __init__(self):
        super().__init__()
        self.embed = VocabParallelEmbedding(VOCAB, HIDDEN, padding_size=4)
        self.qkv = QKVParallelLinear(HIDDEN, 2, 4, 2)
        self.gate_up = MergedColumnParallelLinear(HIDDEN, [12, 12], bias=False)
        self.down = RowParallelLinear(12, HIDDEN)
        self.norm = nn.Parameter(torch.empty(HIDDEN))  # no loader: replicated
        shard = mamba2_shard(**MAMBA)
        self.in_proj = Mamba2InProj(shard, HIDDEN, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(shard.local_conv_dim, MAMBA["conv_kernel"]))
        self.conv_weight.weight_loader = mamba2_weight_loaders(shard)["conv1d.weight"]
        self.lm_head = ParallelLMHead(VOCAB, HIDDEN, padding_size=4)

    @staticmethod
    def to_param(name: str):
        stacked = {"q_proj": ("qkv", "q"), "k_proj": ("qkv", "k"), "v_proj": ("qkv", "v")}
        stacked.update(gate_proj=("gate_up", 0), up_proj=("gate_up", 1))
        module, leaf = name.rsplit(".", 1)
        if module in stacked:
            target, shard_id = stacked[module]
            return f"{target}.{leaf}", shard_id
        return {"conv1d.weight": "conv_weight", "norm.weight": "norm"}.get(name, name)


def checkpoint() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {
        "embed.weight": (VOCAB, HIDDEN),
        "q_proj.weight": (8, HIDDEN),
        "q_proj.bias": (8,),
        "k_proj.weight": (4, HIDDEN),
        "k_proj.bias": (4,),
        "v_proj.weight": (4, HIDDEN),
        "v_proj.bias": (4,),
        "gate_proj.weight": (12, HIDDEN),
        "up_proj.weight": (12, HIDDEN),
        "down.weight": (HIDDEN, 12),
        "down.bias": (HIDDEN,),
        "norm.weight": (HIDDEN,),
        "in_proj.weight": (2 * 8 + 2 * 3 + 4, HIDDEN),  # z, x (4 heads x 2), B, C (1 x 3), dt
        "conv1d.weight": (8 + 2 * 3, 1, 4),  # nn.Conv1d's layout
        "lm_head.weight": (VOCAB, HIDDEN),
    }
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def expected_rows_read(rank: int) -> dict[str, int]:
    """Elements each rank must read of each tensor (2 ranks)."""
    vocab_rows = 26 if rank == 0 else 24  # padded 52: [0, 26) and [26, 52), 50 real
    return {
        "embed.weight": vocab_rows * HIDDEN,
        "lm_head.weight": vocab_rows * HIDDEN,
        "q_proj.weight": 4 * HIDDEN,  # 2 of 4 heads
        "q_proj.bias": 4,
        "k_proj.weight": 2 * HIDDEN,  # 1 of 2 KV heads
        "k_proj.bias": 2,
        "v_proj.weight": 2 * HIDDEN,
        "v_proj.bias": 2,
        "gate_proj.weight": 6 * HIDDEN,
        "up_proj.weight": 6 * HIDDEN,
        "down.weight": HIDDEN * 6,  # half the columns
        "down.bias": HIDDEN,  # replicated
        "norm.weight": HIDDEN,
        # z 4 + x 4 + B 3 + C 3 (the one group, replicated) + dt 2 rows
        "in_proj.weight": (4 + 4 + 3 + 3 + 2) * HIDDEN,
        "conv1d.weight": (4 + 3 + 3) * 4,
    }


def _load_on_each_rank(model_dir: str) -> None:
    rank = get_tp_group().rank
    lazy, full = TinyTP(), TinyTP()
    slices = []

    def recorded():
        for name, s in iterate_checkpoint_slices(model_dir):
            assert isinstance(s, CheckpointSlice) and s.bytes_read == 0
            slices.append(s)
            yield name, s

    load_tp_weights(lazy, recorded(), TinyTP.to_param)
    tensors = load_file(f"{model_dir}/model.safetensors")
    load_tp_weights(full, tensors.items(), TinyTP.to_param)

    for (name, p_lazy), (_, p_full) in zip(
        lazy.named_parameters(), full.named_parameters(), strict=True
    ):
        assert torch.equal(p_lazy, p_full), name
    want = expected_rows_read(rank)
    assert sorted(s.name for s in slices) == sorted(want)
    for s in slices:
        assert s.bytes_read == 4 * want[s.name], (s.name, s.bytes_read, 4 * want[s.name])
    total = sum(t.numel() * 4 for t in tensors.values())
    assert sum(s.bytes_read for s in slices) < 0.7 * total
    # spot checks of the slices themselves
    assert torch.equal(full.down.weight, tensors["down.weight"][:, rank * 6 : rank * 6 + 6])
    k_rows = tensors["k_proj.weight"][rank * 2 : rank * 2 + 2]
    assert torch.equal(full.qkv.weight[4:6], k_rows)
    conv = tensors["conv1d.weight"].squeeze(1)
    assert torch.equal(full.conv_weight[4:], conv[8:])  # B, C of the replicated group
    assert torch.equal(full.conv_weight[:4], conv[rank * 4 : rank * 4 + 4])


@pytest.mark.timeout(120)
def test_each_rank_reads_only_its_slice(tmp_path):
    save_file(checkpoint(), str(tmp_path / "model.safetensors"))
    run_ranks(_load_on_each_rank, str(tmp_path), world_size=2, backend="gloo")


def test_one_rank_reads_everything_once(tmp_path):
    tensors = checkpoint()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = TinyTP()
    counted = []

    def recorded():
        for name, s in iterate_checkpoint_slices(tmp_path):
            counted.append(s)
            yield name, s

    load_tp_weights(model, recorded(), TinyTP.to_param)
    for s in counted:
        assert s.bytes_read == tensors[s.name].numel() * 4, s.name
    assert torch.equal(model.down.weight, tensors["down.weight"])
    assert torch.equal(model.embed.weight[:VOCAB], tensors["embed.weight"])
    assert torch.equal(model.embed.weight[VOCAB:], torch.zeros(52 - VOCAB, HIDDEN))


def test_load_errors_name_the_checkpoint_tensor():
    tensors = checkpoint()
    bad = dict(tensors, **{"down.weight": torch.zeros(HIDDEN, 11)})
    with pytest.raises(ValueError, match=r"'down.weight' -> 'down.weight'.*\(8, 11\).*\(8, 12\)"):
        load_tp_weights(TinyTP(), bad.items(), TinyTP.to_param)
    extra = dict(tensors, **{"mystery.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"does not know: \['mystery.weight'\]"):
        load_tp_weights(TinyTP(), extra.items(), TinyTP.to_param)
    partial = {k: v for k, v in tensors.items() if k != "norm.weight"}
    with pytest.raises(ValueError, match=r"lacks weights the model needs: \['norm'\]"):
        load_tp_weights(TinyTP(), partial.items(), TinyTP.to_param)
