"""Parallel linears, the vocab-parallel embedding and the LM head: on two ranks each equals
the unsharded layer (fp32, 1e-5); on one rank each is exactly an nn.Linear / embedding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.distributed.utils import GPU2_SKIP_REASON, run_ranks
from vllm.distributed import get_tp_group, tensor_model_parallel_all_reduce
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    RowShards,
    shard_units,
)
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)

TOL = dict(atol=1e-5, rtol=1e-5)


def _rand(*shape, seed, device):
    """The same full tensor on every rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device)


def _load(layer, **full):
    for name, tensor in full.items():
        param = getattr(layer, name)
        param.weight_loader(param, tensor)
    return layer


def _check_linears() -> None:
    tp = get_tp_group()
    dev, rank = tp.device, tp.rank
    x = _rand(5, 8, seed=0, device=dev)
    w, b = _rand(12, 8, seed=1, device=dev), _rand(12, seed=2, device=dev)
    ref = F.linear(x, w, b)

    with torch.device(dev):
        rep = _load(ReplicatedLinear(8, 12), weight=w, bias=b)
        col = _load(ColumnParallelLinear(8, 12), weight=w, bias=b)
        gathered = _load(ColumnParallelLinear(8, 12, gather_output=True), weight=w, bias=b)
    torch.testing.assert_close(rep(x), ref, **TOL)
    assert col.weight.shape == (6, 8)
    torch.testing.assert_close(col(x), ref[:, rank * 6 : (rank + 1) * 6], **TOL)
    torch.testing.assert_close(gathered(x), ref, **TOL)

    # Row-parallel: partial sums, one all-reduce; the bias counted once.
    w2, b2 = _rand(4, 12, seed=3, device=dev), _rand(4, seed=4, device=dev)
    ref2 = F.linear(ref, w2, b2)
    with torch.device(dev):
        row = _load(RowParallelLinear(12, 4), weight=w2, bias=b2)
        row_full_in = _load(RowParallelLinear(12, 4, input_is_parallel=False), weight=w2, bias=b2)
        row_partial = _load(RowParallelLinear(12, 4, reduce_results=False), weight=w2, bias=b2)
    assert row.weight.shape == (4, 6) and row.bias.shape == (4,)
    torch.testing.assert_close(row(col(x)), ref2, **TOL)  # the MLP pattern: no gather between
    torch.testing.assert_close(row_full_in(ref), ref2, **TOL)
    partial = row_partial(col(x))
    torch.testing.assert_close(tensor_model_parallel_all_reduce(partial.clone()), ref2, **TOL)
    assert not torch.allclose(partial, ref2), "a partial sum is not the result"

    # Merged gate/up: each output sharded on its own, from separate or fused tensors.
    wg, wu = _rand(6, 8, seed=5, device=dev), _rand(10, 8, seed=6, device=dev)
    with torch.device(dev):
        merged = MergedColumnParallelLinear(8, [6, 10], bias=False)
        fused = MergedColumnParallelLinear(8, [6, 10], bias=False, gather_output=True)
    merged.weight.weight_loader(merged.weight, wg, 0)
    merged.weight.weight_loader(merged.weight, wu, 1)
    _load(fused, weight=torch.cat([wg, wu]))
    gate, up = merged(x).split([3, 5], dim=-1)
    torch.testing.assert_close(gate, F.linear(x, wg)[:, rank * 3 : (rank + 1) * 3], **TOL)
    torch.testing.assert_close(up, F.linear(x, wu)[:, rank * 5 : (rank + 1) * 5], **TOL)
    # gathered, a fused layer's output is its ranks' blocks in rank order
    out = fused(x).view(5, 2, 8)
    for r in range(2):
        blk = out[:, r]
        torch.testing.assert_close(blk[:, :3], F.linear(x, wg)[:, r * 3 : (r + 1) * 3], **TOL)
        torch.testing.assert_close(blk[:, 3:], F.linear(x, wu)[:, r * 5 : (r + 1) * 5], **TOL)


def _check_qkv() -> None:
    tp = get_tp_group()
    dev, rank, world = tp.device, tp.rank, tp.world_size
    hs, hidden = 3, 8
    x = _rand(4, hidden, seed=10, device=dev)
    for n_heads, n_kv in ((4, 2), (4, 1), (2, 2)):
        wq = _rand(n_heads * hs, hidden, seed=11, device=dev)
        wk = _rand(n_kv * hs, hidden, seed=12, device=dev)
        wv = _rand(n_kv * hs, hidden, seed=13, device=dev)
        bq, bk, bv = (
            _rand(t.shape[0], seed=14 + i, device=dev) for i, t in enumerate((wq, wk, wv))
        )
        with torch.device(dev):
            split, fused = (
                QKVParallelLinear(hidden, hs, n_heads, n_kv),
                QKVParallelLinear(hidden, hs, n_heads, n_kv),
            )
        for shard, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
            split.weight.weight_loader(split.weight, w, shard)
            split.bias.weight_loader(split.bias, b, shard)
        _load(fused, weight=torch.cat([wq, wk, wv]), bias=torch.cat([bq, bk, bv]))
        q, k, v = split(x).split([split.q_size, split.kv_size, split.kv_size], dim=-1)
        torch.testing.assert_close(fused(x), split(x), **TOL)
        heads = n_heads // world
        kv_heads = max(1, n_kv // world)
        kv0 = (rank // max(1, world // n_kv)) * kv_heads  # fewer KV heads: replicated
        assert (split.num_heads, split.num_kv_heads, split.kv_head_start) == (heads, kv_heads, kv0)
        qs, ks = (
            slice(rank * heads * hs, (rank + 1) * heads * hs),
            slice(kv0 * hs, (kv0 + kv_heads) * hs),
        )
        torch.testing.assert_close(q, F.linear(x, wq, bq)[:, qs], **TOL)
        torch.testing.assert_close(k, F.linear(x, wk, bk)[:, ks], **TOL)
        torch.testing.assert_close(v, F.linear(x, wv, bv)[:, ks], **TOL)


def _check_vocab() -> None:
    tp = get_tp_group()
    dev, rank = tp.device, tp.rank
    vocab, dim = 50, 6
    table = _rand(vocab, dim, seed=20, device=dev)
    ids = torch.tensor([[0, 25, 26, 49], [13, 30, 1, 48]], device=dev)
    with torch.device(dev):
        # padding_size 4: 50 -> 52 rows, rank 1 holds [26, 52) with two padding rows
        emb = _load(VocabParallelEmbedding(vocab, dim, padding_size=4), weight=table)
        head = _load(ParallelLMHead(vocab, dim, bias=True, padding_size=4), weight=table)
        head.bias.weight_loader(head.bias, _rand(vocab, seed=21, device=dev))
        tied_emb = _load(VocabParallelEmbedding(vocab, dim), weight=table)
        tied = ParallelLMHead(vocab, dim).tie_weights(tied_emb)
    assert emb.num_embeddings_padded == 52 and (emb.vocab_start, emb.vocab_end) == (
        26 * rank,
        26 * (rank + 1),
    )
    if rank == 1:
        assert emb.num_real_rows == 24 and torch.equal(
            emb.weight[24:], torch.zeros(2, dim, device=dev)
        )
    torch.testing.assert_close(emb(ids), F.embedding(ids, table), **TOL)

    hidden = _rand(3, dim, seed=22, device=dev)
    ref = F.linear(hidden, table, _rand(vocab, seed=21, device=dev))
    logits = head.compute_logits(hidden)
    assert logits.shape == (3, vocab) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref, **TOL)
    on_rank0 = head.compute_logits(hidden, to_all_ranks=False)
    if rank == 0:
        torch.testing.assert_close(on_rank0, ref, **TOL)
    else:
        assert on_rank0 is None
    assert tied.weight is tied_emb.weight and tied.num_embeddings_padded == 64
    torch.testing.assert_close(tied.compute_logits(hidden), F.linear(hidden, table), **TOL)


def _check_units() -> None:
    """Outputs cut in units: 4 heads of 2 rows split, 1 group of 3 rows replicated (the
    Mamba2 in_proj's x | B rule), from the fused tensor and from each output's own."""
    tp = get_tp_group()
    dev, rank = tp.device, tp.rank
    x = _rand(3, 8, seed=40, device=dev)
    wx, wb = _rand(8, 8, seed=41, device=dev), _rand(3, 8, seed=42, device=dev)
    with torch.device(dev):
        fused = MergedColumnParallelLinear(8, [8, 3], bias=False, units=[4, 1])
        parts = MergedColumnParallelLinear(8, [8, 3], bias=False, units=[4, 1])
    assert fused.weight.shape == (4 + 3, 8) and fused.shards.replicated
    _load(fused, weight=torch.cat([wx, wb]))
    for i, w in enumerate((wx, wb)):
        parts.weight.weight_loader(parts.weight, w, i)
    assert torch.equal(fused.weight, parts.weight)
    xs, b = fused(x).split([4, 3], dim=-1)
    torch.testing.assert_close(xs, F.linear(x, wx)[:, rank * 4 : (rank + 1) * 4], **TOL)
    torch.testing.assert_close(b, F.linear(x, wb), **TOL)  # the shared unit, whole
    with pytest.raises(ValueError, match="gather_output would repeat"):
        MergedColumnParallelLinear(8, [8, 3], gather_output=True, units=[4, 1])


def _all_checks() -> None:
    _check_linears()
    _check_qkv()
    _check_vocab()
    _check_units()


@pytest.mark.timeout(120)
def test_parallel_layers_equal_unsharded_on_two_ranks_gloo():
    run_ranks(_all_checks, world_size=2, backend="gloo")


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=GPU2_SKIP_REASON)
def test_parallel_layers_equal_unsharded_on_two_ranks_nccl():
    run_ranks(_all_checks, world_size=2, backend="nccl")


def test_one_rank_layers_are_nn_linear_and_embedding():
    """No process group: the same parameter shapes as nn.Linear and F.linear's result."""
    x = _rand(3, 8, seed=30, device="cpu")
    w, b = _rand(6, 8, seed=31, device="cpu"), _rand(6, seed=32, device="cpu")
    for layer in (
        ColumnParallelLinear(8, 6),
        ColumnParallelLinear(8, 6, gather_output=True),
        RowParallelLinear(8, 6),
        RowParallelLinear(8, 6, input_is_parallel=False),
        ReplicatedLinear(8, 6),
        MergedColumnParallelLinear(8, [2, 4]),
    ):
        _load(layer, weight=w, bias=b)
        assert layer.weight.shape == (6, 8)
        assert torch.equal(layer(x), F.linear(x, w, b)), type(layer).__name__
    qkv = _load(QKVParallelLinear(8, 2, 1, 1, bias=False), weight=w)
    assert torch.equal(qkv(x), F.linear(x, w))
    emb = _load(VocabParallelEmbedding(6, 8), weight=w)
    ids = torch.tensor([0, 5, 3])
    assert torch.equal(emb(ids), w[ids])


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: ColumnParallelLinear(8, 6), r"expected the full \(6, 8\)"),
        (lambda: RowParallelLinear(8, 6), r"expected the full \(6, 8\)"),
        (lambda: VocabParallelEmbedding(6, 8), r"expected the full \(6, 8\)"),
    ],
    ids=["column", "row", "embedding"],
)
def test_loader_rejects_a_tensor_of_the_wrong_shape(make, match):
    layer = make()
    with pytest.raises(ValueError, match=match):
        layer.weight.weight_loader(layer.weight, torch.zeros(6, 7))


def test_fused_shard_ids_are_checked():
    merged = MergedColumnParallelLinear(8, [2, 4], bias=False)
    with pytest.raises(ValueError, match=r"shard_id must be one of 0, 1 or None, got 2"):
        merged.weight.weight_loader(merged.weight, torch.zeros(2, 8), 2)
    with pytest.raises(ValueError, match=r"expected the full \(4, 8\)"):
        merged.weight.weight_loader(merged.weight, torch.zeros(2, 8), 1)
    qkv = QKVParallelLinear(8, 2, 2, 1, bias=False)
    with pytest.raises(ValueError, match="shard_id must be one of 'q', 'k', 'v' or None"):
        qkv.weight.weight_loader(qkv.weight, torch.zeros(4, 8), "o")
    with pytest.raises(ValueError, match="has no shards"):
        ColumnParallelLinear(8, 6).weight.weight_loader(None, torch.zeros(6, 8), 0)


@pytest.mark.parametrize(
    "units, tp, held",
    [
        (8, 4, [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]),
        (2, 4, [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]),  # replicated
        (1, 2, [range(0, 1), range(0, 1)]),
        (4, 4, [range(r, r + 1) for r in range(4)]),
    ],
    ids=["split", "two_per_unit", "one_unit", "one_each"],
)
def test_shard_units(units, tp, held):
    assert [shard_units(units, tp, r) for r in range(tp)] == held


def test_shard_units_refuses_what_neither_divides():
    with pytest.raises(ValueError, match="groups=3 neither divides nor is divisible by tp_size=2"):
        shard_units(3, 2, 0, "groups")
    with pytest.raises(ValueError, match=r"output_sizes\[0\]=6 is not divisible by 4"):
        RowShards([6], tp_rank=0, tp_size=4)
