"""Loading from a real safetensors checkpoint through the one loader
(``load_model_weights``: name map, stacked-parameter mapping, per-parameter loaders): on two
ranks each rank reads only its slice of every sharded tensor (counted in bytes), and the
lazy slices load the same parameters as the full tensors; errors name the checkpoint
tensor."""

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
    RowShards,
)
from vllm.model_executor.layers.mamba.mamba_tp import mamba2_layout, row_parameter
from vllm.model_executor.layers.mamba.mamba_utils import Mamba2Shape
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.model_loader.weight_utils import (
    CheckpointSlice,
    iterate_checkpoint_slices,
    load_model_weights,
)

HIDDEN, VOCAB = 8, 50
MAMBA = Mamba2Shape(
    hidden_size=HIDDEN,
    num_heads=4,
    head_dim=2,
    n_groups=1,
    state_size=3,
    conv_kernel=4,
    chunk_size=4,
    use_bias=False,
    use_conv_bias=False,
    norm_eps=1e-5,
    time_step_limit=(0.0, float("inf")),
)


class TinyTP(nn.Module):
    """One of each sharded layer kind, with HF-style checkpoint names mapped onto it."""

    def __init__(self):
        super().__init__()
        self.embed = VocabParallelEmbedding(VOCAB, HIDDEN, padding_size=4)
        self.qkv = QKVParallelLinear(HIDDEN, 2, 4, 2)
        self.gate_up = MergedColumnParallelLinear(HIDDEN, [12, 12], bias=False)
        self.down = RowParallelLinear(12, HIDDEN)
        self.norm = nn.Parameter(torch.empty(HIDDEN))  # no loader: replicated
        layout = mamba2_layout(MAMBA)
        sizes, units = layout["in_proj"]
        self.in_proj = MergedColumnParallelLinear(HIDDEN, sizes, bias=False, units=units)
        conv = RowShards(*layout["conv1d"])
        self.conv_weight = row_parameter(conv, torch.empty(conv.local_size, 4), "conv1d")
        self.lm_head = ParallelLMHead(VOCAB, HIDDEN, padding_size=4)

    stacked_params_mapping = (
        ("qkv", "q_proj", "q"),
        ("qkv", "k_proj", "k"),
        ("qkv", "v_proj", "v"),
        ("gate_up", "gate_proj", 0),
        ("gate_up", "up_proj", 1),
    )

    @staticmethod
    def to_param(name: str) -> str:
        return {"conv1d.weight": "conv_weight", "norm.weight": "norm"}.get(name, name)

    def load(self, weights) -> None:
        load_model_weights(self, weights, self.to_param, self.stacked_params_mapping)


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

    lazy.load(recorded())
    tensors = load_file(f"{model_dir}/model.safetensors")
    full.load(tensors.items())

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

    model.load(recorded())
    for s in counted:
        assert s.bytes_read == tensors[s.name].numel() * 4, s.name
    assert torch.equal(model.down.weight, tensors["down.weight"])
    assert torch.equal(model.embed.weight[:VOCAB], tensors["embed.weight"])
    assert torch.equal(model.embed.weight[VOCAB:], torch.zeros(52 - VOCAB, HIDDEN))


def test_load_errors_name_the_checkpoint_tensor():
    tensors = checkpoint()
    bad = dict(tensors, **{"down.weight": torch.zeros(HIDDEN, 11)})
    with pytest.raises(
        ValueError, match=r"'down.weight' has shape \(8, 11\) .* 'down.weight' expect \(8, 12\)"
    ):
        TinyTP().load(bad.items())
    bad_part = dict(tensors, **{"k_proj.weight": torch.zeros(5, HIDDEN)})
    with pytest.raises(ValueError, match=r"'k_proj.weight' has shape \(5, 8\) .*'qkv.weight'"):
        TinyTP().load(bad_part.items())
    extra = dict(tensors, **{"mystery.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"does not know: \['mystery.weight'\]"):
        TinyTP().load(extra.items())
    partial = {k: v for k, v in tensors.items() if k != "norm.weight"}
    with pytest.raises(ValueError, match=r"lacks weights the model needs: \['norm'\]"):
        TinyTP().load(partial.items())
    # a fused layer missing one part: the part is named
    no_v = {k: v for k, v in tensors.items() if not k.startswith("v_proj")}
    with pytest.raises(ValueError, match=r"needs: \[\"qkv.bias\['v'\]\", \"qkv.weight\['v'\]\"\]"):
        TinyTP().load(no_v.items())
