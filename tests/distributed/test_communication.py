"""The tensor-parallel group and its collectives: one rank without any process group, and
two real gloo ranks (NCCL on two GPUs, marked gpu)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed.utils import GPU2_SKIP_REASON, run_ranks
from tests.worker.state_specs import GIB, codestral_model, codestral_specs, sizing_config
from vllm.distributed import (
    broadcast,
    broadcast_object,
    broadcast_tensor_dict,
    destroy,
    divide,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    init_distributed,
    is_initialized,
    min_over_ranks,
    split_tensor_along_last_dim,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
    tensor_model_parallel_gather,
)
from vllm.worker.cache_engine import auto_checkpoint_lines, checkpoint_lines_for


@pytest.fixture
def single_rank():
    yield
    destroy()


def test_single_rank_needs_no_process_group(single_rank):
    assert (get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()) == (0, 1)
    assert not is_initialized()
    init_distributed(1, 0)
    assert is_initialized() and not dist.is_initialized()
    x = torch.randn(3, 4)
    # Identity: the very same tensor, no copy, no call into torch.distributed.
    assert tensor_model_parallel_all_reduce(x) is x
    assert tensor_model_parallel_all_gather(x, dim=0) is x
    assert tensor_model_parallel_gather(x) is x
    assert broadcast(x) is x
    assert broadcast_object({"a": 1}) == {"a": 1}
    assert min_over_ranks(7) == 7
    d = {"t": x, "n": 3}
    assert broadcast_tensor_dict(d) is d
    with pytest.raises(RuntimeError, match="already initialised"):
        init_distributed(1, 0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(world_size=0, rank=0), "world_size must be an integer >= 1"),
        (dict(world_size=2, rank=2), "rank 2 is out of range for world_size 2"),
        (dict(world_size=2, rank=0, backend="mpi"), "backend must be one of nccl, gloo"),
        (dict(world_size=2, rank=0, timeout_s=0), "timeout_s must be > 0"),
    ],
    ids=["world0", "rank_out_of_range", "unknown_backend", "zero_timeout"],
)
def test_init_rejects_bad_arguments(single_rank, kwargs, match):
    with pytest.raises(ValueError, match=match):
        init_distributed(**kwargs)
    assert not is_initialized()


def test_divide_and_split():
    assert divide(12, 4) == 3
    with pytest.raises(ValueError, match="num_heads=10 is not divisible by 4"):
        divide(10, 4, "num_heads")
    t = torch.arange(12).view(2, 6)
    a, b = split_tensor_along_last_dim(t, 2)
    assert torch.equal(a, t[:, :3]) and torch.equal(b, t[:, 3:])
    assert all(c.is_contiguous() for c in split_tensor_along_last_dim(t, 3, True))
    with pytest.raises(ValueError, match="last dimension=6 is not divisible by 4"):
        split_tensor_along_last_dim(t, 4)


def _collectives() -> None:
    tp = get_tp_group()
    rank, world, dev = tp.rank, tp.world_size, tp.device
    assert (get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()) == (
        rank,
        world,
    )
    full = torch.arange(world * 6, dtype=torch.float32, device=dev).view(world * 2, 3)
    mine = full[rank * 2 : (rank + 1) * 2]

    x = (rank + 1.0) * torch.ones(2, 3, device=dev)
    out = tensor_model_parallel_all_reduce(x)
    assert out is x and torch.equal(x, sum(range(1, world + 1)) * torch.ones(2, 3, device=dev))
    strided = ((rank + 1.0) * torch.ones(3, 4, device=dev)).t()  # not contiguous
    assert torch.equal(
        tensor_model_parallel_all_reduce(strided), torch.full((4, 3), 3.0, device=dev)
    )

    assert torch.equal(tensor_model_parallel_all_gather(mine, dim=0), full)
    cols = full.t().contiguous()  # (3, world * 2): rank r owns columns 2r, 2r + 1
    assert torch.equal(tensor_model_parallel_all_gather(cols[:, rank * 2 : rank * 2 + 2]), cols)
    cube = torch.arange(2 * world * 4, device=dev).view(2, world * 2, 2)
    part = cube[:, rank * 2 : rank * 2 + 2]
    assert torch.equal(tensor_model_parallel_all_gather(part, dim=1), cube)

    gathered = tensor_model_parallel_gather(mine, dst=0, dim=0)
    assert torch.equal(gathered, full) if rank == 0 else gathered is None

    b = torch.full((4,), float(rank), device=dev)
    assert torch.equal(broadcast(b, src=1), torch.ones(4, device=dev))
    host = torch.full((2,), float(rank))  # a host tensor goes over gloo under NCCL too
    assert torch.equal(tensor_model_parallel_all_reduce(host), torch.full((2,), 1.0))

    assert min_over_ranks(10 - rank) == 10 - (world - 1)  # every rank gets the least

    obj = broadcast_object({"step": 7, "ids": [1, 2]} if rank == 0 else None)
    assert obj == {"step": 7, "ids": [1, 2]}
    src = None
    if rank == 0:
        src = {
            "ids": torch.tensor([5, 6, 7], dtype=torch.int32, device=dev),
            "scale": torch.tensor([[0.5, 1.5]], dtype=torch.float16, device=dev),
            "host": torch.tensor([True, False]),
            "name": "step",
            "n": 3,
        }
    d = broadcast_tensor_dict(src)
    assert d["name"] == "step" and d["n"] == 3
    assert d["ids"].dtype == torch.int32 and d["ids"].tolist() == [5, 6, 7]
    assert d["ids"].device == dev and d["host"].device.type == "cpu"
    assert d["scale"].dtype == torch.float16 and d["scale"].tolist() == [[0.5, 1.5]]
    assert d["host"].tolist() == [True, False]
    with pytest.raises(RuntimeError, match="already initialised"):
        init_distributed(world, rank)


@pytest.mark.timeout(120)
def test_collectives_two_ranks_gloo():
    run_ranks(_collectives, world_size=2, backend="gloo")


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=GPU2_SKIP_REASON)
def test_collectives_two_ranks_nccl():
    run_ranks(_collectives, world_size=2, backend="nccl")


def _checkpoint_lines_agree() -> None:
    """Each rank sizes prefix-cache checkpoint lines from its own (here faked) free GPU
    memory; the worker's count is the least over the ranks, or the engine core would index
    lines a rank does not have."""
    rank = get_tp_group().rank
    free, total = (66 if rank == 0 else 50) * GIB, 80 * GIB
    torch.cuda.empty_cache = lambda: None  # this spawned rank's process only
    torch.cuda.mem_get_info = lambda device: (free, total)
    per_line = sum(s.bytes_per_slot for s in codestral_specs())
    config, model = sizing_config(64, None), codestral_model()
    mine = auto_checkpoint_lines(per_line, 64, free, total, 0.9)
    least = auto_checkpoint_lines(per_line, 64, 50 * GIB, total, 0.9)
    assert (mine == 64) if rank == 0 else (mine == least < 64)
    assert checkpoint_lines_for(model, config, torch.device("cuda:0")) == least


@pytest.mark.timeout(120)
def test_sizes_measured_from_memory_agree_over_two_gloo_ranks():
    run_ranks(_checkpoint_lines_agree, world_size=2, backend="gloo")
