"""``moe_align_block_size``: every (token, k) pair exactly once, grouped by expert, each
expert's run padded to the block size with out-of-range ids, sizes fixed by the shapes;
the one-program kernel, the two-launch chunked kernels and the torch ops give the same
buffers."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.moe.moe_utils import distinct_ids, gen_for
from vllm.model_executor.layers.fused_moe import moe_align
from vllm.model_executor.layers.fused_moe.moe_align import max_num_blocks, moe_align_block_size

CASES = [  # tokens, top_k, experts, block size
    (1, 1, 4, 16),
    (3, 2, 8, 16),
    (17, 8, 16, 16),
    (64, 2, 6, 32),
    (64, 8, 16, 4),
    (5, 3, 3, 1),
]


def small_chunks(monkeypatch) -> None:
    """The chunked path with 16-pair tiles, one per chunk, and at most 32 rows per program
    of the place kernel: many chunks, and more programs than chunks, at test sizes."""
    monkeypatch.setattr(moe_align, "TILE_ELEMENTS", 16)
    monkeypatch.setattr(moe_align, "MIN_CHUNK_TILES", 1)
    monkeypatch.setattr(moe_align, "PLACE_ROWS", 32)


@pytest.fixture(params=["kernel", "chunks", "torch"])
def impl(request, monkeypatch, device):
    """Which implementation runs: the others raise if called."""
    if request.param == "torch":
        monkeypatch.setattr(moe_align, "_kernel_runs", lambda *args: False)
        for name in ("_ALIGN", "_COUNT", "_PLACE"):  # any kernel launch would fail
            monkeypatch.setattr(moe_align, name, None)
        return dict(max_kernel_pairs=0)
    if device.type == "cpu" and not moe_align._ALIGN.runs_cpu_tensors():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1 set before the kernels were imported")

    def no_torch(*args):
        raise AssertionError("the torch alignment ran instead of the kernel")

    monkeypatch.setattr(moe_align, "_align_torch", no_torch)
    if request.param == "kernel":
        monkeypatch.setattr(moe_align, "_COUNT", None)
        return dict(max_kernel_pairs=10**6)
    small_chunks(monkeypatch)
    return dict(max_kernel_pairs=0)  # never the one-program kernel


def check_alignment(topk_ids: torch.Tensor, num_experts: int, block: int, impl: dict) -> None:
    sorted_ids, expert_ids, total = moe_align_block_size(topk_ids, block, num_experts, **impl)
    sorted_ids, expert_ids, total, topk_ids = (
        t.cpu() for t in (sorted_ids, expert_ids, total, topk_ids)
    )
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    blocks = max_num_blocks(n, num_experts, block)
    assert sorted_ids.shape == (blocks * block,) and sorted_ids.dtype == torch.int32
    assert expert_ids.shape == (blocks,) and expert_ids.dtype == torch.int32
    assert total.shape == (1,) and total.dtype == torch.int32
    counts = torch.bincount(flat, minlength=num_experts)
    expected_total = int(((counts + block - 1) // block * block).sum())
    assert int(total) == expected_total
    # Every pair exactly once; everything else is the padding id, out of range.
    real = sorted_ids[sorted_ids < n].long()
    assert torch.equal(real.sort().values, torch.arange(n))
    assert bool((sorted_ids[sorted_ids >= n] == n).all())
    assert bool((sorted_ids[expected_total:] == n).all())
    # Each used block holds one expert's pairs, in their original order; later ones -1.
    used = expected_total // block
    assert bool((expert_ids[used:] == -1).all())
    for b in range(used):
        e = int(expert_ids[b])
        assert 0 <= e < num_experts
        rows = sorted_ids[b * block : (b + 1) * block].long()
        rows = rows[rows < n]
        assert rows.numel() > 0  # a block exists only for pairs (padding ends a run)
        assert bool((flat[rows] == e).all())
        assert torch.equal(rows, rows.sort().values)
    assert torch.equal(expert_ids[:used].long(), expert_ids[:used].long().sort().values)


@pytest.mark.parametrize("tokens, top_k, experts, block", CASES)
def test_alignment_invariants(tokens, top_k, experts, block, impl, device):
    ids = distinct_ids(tokens, top_k, experts, gen_for("align", tokens, top_k, experts))
    check_alignment(ids.to(device), experts, block, impl)
    check_alignment(ids.long().to(device), experts, block, impl)


def _torch_alignment(monkeypatch, *args):
    with monkeypatch.context() as m:
        m.setattr(moe_align, "_kernel_runs", lambda *a: False)
        return moe_align_block_size(*args)


@pytest.mark.parametrize(
    "shape, experts, block, chunks",
    [((40, 3), 12, 8, "small"), ((40, 3), 12, 8, "default"), ((300, 6), 128, 64, "default"),
     ((700, 4), 16, 16, "default"), ((90, 2), 5, 32, "small")],
)  # fmt: skip
def test_kernels_and_torch_agree_exactly(shape, experts, block, chunks, device, monkeypatch):
    """Repeated experts in a token too (the contract does not need distinct ones); the
    chunked path at its own sizes (300 x 6 over 128 experts: 8 chunks of 256 pairs) and
    at many small chunks."""
    if device.type == "cpu" and not moe_align._ALIGN.runs_cpu_tensors():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1 set before the kernels were imported")
    ids = torch.randint(0, experts, shape, generator=gen_for("agree", shape)).to(device)
    want = _torch_alignment(monkeypatch, ids, block, experts, 0)
    if chunks == "small":
        small_chunks(monkeypatch)
    for max_kernel_pairs in (10**6, 0):  # one program, then chunks
        got = moe_align_block_size(ids, block, experts, max_kernel_pairs)
        for x, y in zip(got, want, strict=True):
            assert torch.equal(x, y), max_kernel_pairs


def test_one_expert_takes_every_pair(impl):
    ids = torch.full((10, 1), 2, dtype=torch.int32)
    check_alignment(ids, 5, 4, impl)
    sorted_ids, expert_ids, total = moe_align_block_size(ids, 4, 5, **impl)
    assert int(total) == 12
    assert sorted_ids[:12].tolist() == list(range(10)) + [10, 10]
    assert expert_ids.tolist()[:3] == [2, 2, 2] and set(expert_ids.tolist()[3:]) <= {-1}


def test_sizes_depend_on_shapes_only():  # the same buffers for either implementation
    gen = gen_for("align-shapes")
    a = moe_align_block_size(distinct_ids(7, 2, 8, gen), 16, 8)
    b = moe_align_block_size(torch.zeros(7, 2, dtype=torch.int32), 16, 8)
    assert [t.shape for t in a] == [t.shape for t in b]


def test_no_tokens():
    sorted_ids, expert_ids, total = moe_align_block_size(
        torch.empty(0, 2, dtype=torch.int32), 16, 4
    )
    assert sorted_ids.numel() == 0 and expert_ids.numel() == 0 and int(total) == 0


@pytest.mark.parametrize(
    "args, needle",
    [
        ((torch.zeros(4, dtype=torch.int32), 16, 4), "topk_ids"),
        ((torch.zeros(4, 2), 16, 4), "topk_ids"),
        ((torch.zeros(4, 2, dtype=torch.int32), 0, 4), "block_size"),
        ((torch.zeros(4, 2, dtype=torch.int32), 16, 0), "num_experts"),
    ],
)
def test_errors_name_the_argument(args, needle):
    with pytest.raises(ValueError, match=needle):
        moe_align_block_size(*args)
