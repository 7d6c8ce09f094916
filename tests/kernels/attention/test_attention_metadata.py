"""AttentionMetadataBuilder: the step's device tensors, padding, persistent buffers, errors."""

from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.attention import AttentionMetadata, AttentionMetadataBuilder

gpu = pytest.mark.gpu


def _builder(device="cpu", **kw) -> AttentionMetadataBuilder:
    args = dict(block_size=4, max_num_seqs=6, max_num_batched_tokens=32, max_blocks_per_seq=5)
    args.update(kw)
    return AttentionMetadataBuilder(device=device, **args)


# Two decodes (3 and 8 cached tokens), a chunk of 5 after 6 cached, a fresh prompt of 2.
STEP = dict(
    query_lens=[1, 1, 5, 2],
    context_lens=[3, 8, 6, 0],
    block_tables=[[7], [2, 9, 4], [0, 5, 11], [3, 8]],  # the last one longer than it needs
    num_decodes=2,
)


def _expected_slots():
    out = []
    for q, c, table in zip(
        STEP["query_lens"], STEP["context_lens"], STEP["block_tables"], strict=True
    ):
        for pos in range(c, c + q):
            out.append(table[pos // 4] * 4 + pos % 4)
    return out


@pytest.mark.parametrize("device_name", ["cpu", pytest.param("cuda", marks=gpu)])
def test_build(device_name):
    md = _builder(device_name).build(**STEP)
    assert isinstance(md, AttentionMetadata)
    assert md.query_start_loc.tolist() == [0, 1, 2, 7, 9]
    assert md.seq_lens.tolist() == [4, 9, 11, 2]
    assert md.slot_mapping.tolist() == _expected_slots()
    assert md.block_table.shape == (4, 5)
    # The blocks each sequence reads (its seq_len's); entries past them are never read
    # and not copied (the last table's spare block).
    for i, (table, n) in enumerate(zip(STEP["block_tables"], md.seq_lens.tolist(), strict=True)):
        need = -(-n // 4)
        assert md.block_table[i, :need].tolist() == table[:need]
    assert (md.query_start_loc.dtype, md.seq_lens.dtype, md.block_table.dtype) == (
        torch.int32,
        torch.int32,
        torch.int32,
    )
    assert md.slot_mapping.dtype == torch.int64
    assert all(t.device.type == device_name for t in (md.query_start_loc, md.slot_mapping))
    assert (md.num_seqs, md.num_decodes, md.num_prefills) == (4, 2, 2)
    assert (md.num_actual_tokens, md.max_query_len, md.max_seq_len) == (9, 5, 11)
    assert (md.num_padded_seqs, md.num_padded_tokens) == (4, 9)


def test_padding():
    md = _builder().build(**STEP, pad_tokens_to=12, pad_seqs_to=6)
    assert md.query_start_loc.tolist() == [0, 1, 2, 7, 9, 9, 9]  # padded seqs: no tokens
    assert md.seq_lens.tolist() == [4, 9, 11, 2, 0, 0]
    assert md.slot_mapping.tolist() == _expected_slots() + [-1, -1, -1]
    assert md.block_table.shape == (6, 5)
    assert md.block_table[4:].tolist() == [[0] * 5] * 2
    assert (md.num_seqs, md.num_actual_tokens, md.num_padded_tokens) == (4, 9, 12)


def test_persistent_buffers():
    """A later build writes into the same device memory: tensors captured by a graph on
    the first step's metadata see the second step's values."""
    builder = _builder()
    first = builder.build([1, 1], [3, 8], [[7], [2, 9, 4]], 2, pad_tokens_to=4, pad_seqs_to=4)
    ptrs = [
        t.data_ptr()
        for t in (first.query_start_loc, first.seq_lens, first.block_table, first.slot_mapping)
    ]
    second = builder.build(
        [1, 1, 1], [4, 9, 0], [[7, 1], [2, 9, 4], [6]], 3, pad_tokens_to=4, pad_seqs_to=4
    )
    assert ptrs == [
        t.data_ptr()
        for t in (second.query_start_loc, second.seq_lens, second.block_table, second.slot_mapping)
    ]
    assert first.seq_lens.tolist() == [5, 10, 1, 0]
    assert first.slot_mapping.tolist() == [1 * 4 + 0, 4 * 4 + 1, 6 * 4 + 0, -1]
    assert first.query_start_loc.tolist() == [0, 1, 2, 3, 3]
    assert builder.num_builds == 2


@pytest.mark.parametrize("device_name", ["cpu", pytest.param("cuda", marks=gpu)])
def test_wide_tables_over_growing_steps(device_name):
    """max_blocks_per_seq as a long max_model_len makes it (here 512 columns, 4-token
    blocks): steps whose sequences grow, shrink and change places read exactly their
    blocks from the same full-width table, whatever earlier steps left past them."""
    builder = _builder(device_name, max_blocks_per_seq=512, num_blocks=4096)
    gen = torch.Generator().manual_seed(0)
    ptr = None
    for step in range(12):
        n = int(torch.randint(1, 7, (1,), generator=gen))
        q = torch.randint(1, 5, (n,), generator=gen).tolist()
        c = torch.randint(0, 120, (n,), generator=gen).tolist()
        tables = [
            torch.randperm(4096, generator=gen)[: -(-(ci + qi) // 4) + 2].tolist()
            for qi, ci in zip(q, c, strict=True)
        ]
        md = builder.build(q, c, tables, 0, pad_seqs_to=6)
        assert md.block_table.shape == (6, 512)
        ptr = ptr or md.block_table.data_ptr()
        assert md.block_table.data_ptr() == ptr, f"step {step}: the table moved"
        for i in range(n):
            need = -(-(c[i] + q[i]) // 4)
            got = md.block_table[i, :need].tolist()
            assert got == tables[i][:need], f"step {step}, sequence {i}"


def test_empty_step():
    md = _builder().build([], [], [], 0, pad_tokens_to=2, pad_seqs_to=1)
    assert md.query_start_loc.tolist() == [0, 0]
    assert md.seq_lens.tolist() == [0]
    assert md.slot_mapping.tolist() == [-1, -1]
    assert (md.num_seqs, md.max_query_len, md.max_seq_len) == (0, 0, 0)


def test_limits_reached_exactly():
    builder = _builder(max_num_seqs=2, max_num_batched_tokens=8, max_blocks_per_seq=2)
    md = builder.build([7, 1], [1, 0], [[0, 1], [2]], 0, pad_tokens_to=8, pad_seqs_to=2)
    assert md.seq_lens.tolist() == [8, 1]
    assert md.slot_mapping.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]


def _bad(name, change, match, **builder_kw):
    return pytest.param(change, match, builder_kw, id=name)


BAD = [
    _bad("lengths", dict(context_lens=[3, 8, 6]), "one entry per sequence"),
    _bad("tables", dict(block_tables=[[7], [2, 9, 4], [0, 5, 11]]), "one entry per sequence"),
    _bad(
        "table_short",
        dict(block_tables=[[7], [2, 9], [0, 5, 11], [3]]),
        "sequence 1: 9 tokens need 3 blocks of 4, its block table has 2",
    ),
    _bad(
        "too_many_seqs",
        dict(query_lens=[1] * 7, context_lens=[0] * 7, block_tables=[[0]] * 7),
        "7 sequences exceed max_num_seqs=6",
    ),
    _bad("too_many_tokens", dict(query_lens=[1, 1, 29, 2]), "33 tokens exceed"),
    _bad("query_zero", dict(query_lens=[1, 1, 0, 2]), "query_lens must be >= 1"),
    _bad("context_negative", dict(context_lens=[3, -1, 6, 0]), "context_lens must be >= 0"),
    _bad("decode_two_tokens", dict(num_decodes=3), "must have one query token each"),
    _bad("num_decodes_range", dict(num_decodes=5), r"num_decodes=5 must be in \[0, 4\]"),
    _bad("pad_tokens_small", dict(pad_tokens_to=8), r"pad_tokens_to=8 must be in \[9,"),
    _bad("pad_tokens_large", dict(pad_tokens_to=33), "max_num_batched_tokens=32"),
    _bad("pad_seqs_small", dict(pad_seqs_to=3), r"pad_seqs_to=3 must be in \[4,"),
    _bad("pad_seqs_large", dict(pad_seqs_to=7), "max_num_seqs=6"),
    _bad(
        "negative_block",
        dict(block_tables=[[7], [2, -9, 4], [0, 5, 11], [3, 8]]),
        r"block ids in \[-9, 11\]",
    ),
    _bad("block_past_cache", dict(), r"outside \[0, num_blocks=10\)", num_blocks=10),
    _bad("wider_than_table", dict(), "more than max_blocks_per_seq=2", max_blocks_per_seq=2),
]


@pytest.mark.parametrize("change,match,builder_kw", BAD)
def test_bad_input(change, match, builder_kw):
    builder = _builder(**builder_kw)
    with pytest.raises(ValueError, match=match):
        builder.build(**{**STEP, **change})


@pytest.mark.parametrize(
    "kw", [dict(block_size=0), dict(max_num_seqs=-1), dict(max_blocks_per_seq=1.5)]
)
def test_bad_builder(kw):
    with pytest.raises(ValueError, match="must be an int >= 1"):
        _builder(**kw)


def test_refused_build_keeps_device_buffers():
    builder = _builder()
    md = builder.build(**STEP)
    before = [t.clone() for t in (md.query_start_loc, md.seq_lens, md.block_table, md.slot_mapping)]
    with pytest.raises(ValueError):
        builder.build(**{**STEP, "block_tables": [[7], [2, -1, 4], [0, 5, 11], [3, 8]]})
    after = (md.query_start_loc, md.seq_lens, md.block_table, md.slot_mapping)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
