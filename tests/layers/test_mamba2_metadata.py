"""Mamba2MetadataBuilder: row groups, canonical order, device buffers reused across steps."""

from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.mamba.mamba2_metadata import Mamba2MetadataBuilder
from vllm.model_executor.layers.mamba.ops.causal_conv1d import NULL_BLOCK_ID, PAD_SLOT_ID

PAD = NULL_BLOCK_ID  # slots are lines >= 1: line 0 is the null line


def build(builder, lens, slots, init):
    qsl = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    return builder.build(
        qsl, torch.tensor(slots, dtype=torch.int32), torch.tensor(init, dtype=torch.bool)
    )


def test_canonical_batch_needs_no_permutation():
    # decodes, a one-token pad (CUDA-graph padding), prefills, then a longer pad row
    b = Mamba2MetadataBuilder(chunk_size=4, device="cpu")
    md = build(
        b, [1, 1, 1, 5, 1, 3], [2, 5, PAD, 1, 3, PAD], [True, True, False, True, False, False]
    )
    assert md.token_perm is None
    assert (md.num_decode_tokens, md.num_prefills, md.num_prefill_tokens) == (3, 2, 6)
    assert md.num_tokens == 12 and md.batch_size == 6 and not md.decode_only
    assert md.decode_state_indices.tolist() == [2, 5, PAD]
    assert md.prefill_state_indices.tolist() == [1, 3]
    assert md.prefill_has_initial_state.tolist() == [True, False]
    assert md.prefill_query_start_loc.tolist() == [0, 5, 6]
    assert md.query_start_loc.tolist() == [0, 1, 2, 3, 8, 9, 12]
    assert md.conv.num_tokens == 12 and md.conv.batch_size == 6
    assert md.scan.num_seqs == 2 and md.scan.num_tokens == 6


def test_mixed_order_is_permuted_to_canonical():
    # prefill(3) | decode | pad(2) | fresh one-token prompt | decode
    lens = [3, 1, 2, 1, 1]
    slots = [4, 1, PAD, 5, 2]
    init = [True, True, False, False, True]
    b = Mamba2MetadataBuilder(chunk_size=2, device="cpu")
    md = build(b, lens, slots, init)
    # canonical rows: decodes (slots 1, 2), prefills (4 then the fresh prompt 5), pad
    assert md.state_indices.tolist() == [1, 2, 4, 5, PAD]
    assert md.has_initial_state.tolist() == [True, True, True, False, False]
    assert md.query_start_loc_cpu.tolist() == [0, 1, 2, 5, 6, 8]
    # input tokens: row0 0..2, row1 3, row2 4..5, row3 6, row4 7
    assert md.token_perm.tolist() == [3, 7, 0, 1, 2, 6, 4, 5]
    assert (md.num_decode_tokens, md.num_prefills, md.num_prefill_tokens) == (2, 2, 4)


def test_decode_only_step():
    b = Mamba2MetadataBuilder(chunk_size=8, device="cpu")
    md = build(b, [1, 1, 1, 1], [5, 3, PAD, PAD], [True, True, False, False])
    assert md.decode_only and md.token_perm is None
    assert md.num_prefills == 0 and md.scan.num_chunks == 0


def test_fresh_one_token_prompt_is_a_prefill():
    b = Mamba2MetadataBuilder(chunk_size=8, device="cpu")
    md = build(b, [1], [1], [False])
    assert md.num_decode_tokens == 0 and md.num_prefills == 1 and not md.decode_only


def test_device_buffer_is_reused_and_grown():
    b = Mamba2MetadataBuilder(chunk_size=4, device="cpu")
    build(b, [9, 1], [1, 2], [False, True])
    buf = b.staging.device_buffer
    ptr, grows = buf.data_ptr(), b.staging.num_grows
    for lens in ([3, 1], [1, 1], [20, 1, 1]):
        md = build(b, lens, list(range(1, len(lens) + 1)), [False] + [True] * (len(lens) - 1))
        assert b.staging.device_buffer.data_ptr() == ptr, "reallocated without need"
        assert md.state_indices.untyped_storage().data_ptr() == ptr
    assert b.staging.num_grows == grows
    big = 3000
    build(b, [big], [1], [False])
    assert b.staging.num_grows == grows + 1 and b.staging.capacity >= 8 * big
    assert b.num_builds == 5


def test_builder_rejects_bad_host_data():
    b = Mamba2MetadataBuilder(chunk_size=4, device="cpu")
    qsl = torch.tensor([0, 2, 3], dtype=torch.int32)
    init = torch.tensor([False, False])
    with pytest.raises(ValueError, match="distinct"):
        b.build(qsl, torch.tensor([1, 1], dtype=torch.int32), init)
    with pytest.raises(ValueError, match="int32"):
        b.build(qsl.long(), torch.tensor([0, 1], dtype=torch.int32), init)
    with pytest.raises(ValueError, match="2 entries"):
        b.build(qsl, torch.tensor([0], dtype=torch.int32), init)
    with pytest.raises(ValueError, match="non-decreasing"):
        b.build(
            torch.tensor([0, 3, 2], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32),
            init,
        )
    with pytest.raises(ValueError, match="CPU tensor"):
        b.build(qsl.tolist(), torch.tensor([0, 1], dtype=torch.int32), init)


def test_ssd_layout_has_absolute_rows_in_the_staged_upload():
    # Rows 0-2: two decodes and a padded decode row; prefills of 5, 1 and 9 tokens at rows
    # 3-7, 8 and 9-17; a padded row of 3 tokens last.
    b = Mamba2MetadataBuilder(chunk_size=4, device="cpu", triton_ssd=True)
    init = [True, True, False, False, False, False, False]
    md = build(b, [1, 1, 1, 5, 1, 9, 3], [2, 5, PAD, 1, 3, 4, PAD], init)
    assert md.scan is None and md.ssd is not None
    assert (md.num_decode_tokens, md.num_prefills) == (3, 3)
    lay = md.ssd
    assert (lay.num_seqs, lay.num_chunks, lay.first_row, lay.end_row) == (3, 6, 3, 18)
    assert lay.chunk_starts.tolist() == [3, 7, 8, 9, 13, 17, 18]
    assert lay.chunk_seqs.tolist() == [0, 0, 1, 2, 2, 2]
    assert lay.seq_chunk_starts.tolist() == [0, 2, 3, 6]
    ptr = b.staging.device_buffer.untyped_storage().data_ptr()
    for name in lay.TENSOR_FIELDS:
        t = getattr(lay, name)
        assert t.untyped_storage().data_ptr() == ptr, f"{name} is not in the staged upload"
        assert t.data_ptr() % 16 == 0
    # A decode-only step carries an empty layout.
    md = build(b, [1, 1], [1, 2], [True, True])
    assert md.ssd.num_seqs == 0 and md.ssd.num_chunks == 0


def test_pad_slot_id_rows_go_to_the_null_line():
    """A row padded with PAD_SLOT_ID (-1, upstream's 2025 marker) is a padded row like one
    on NULL_BLOCK_ID: the metadata sends both to the null line, so every op sees one
    marker, and no real slot may be the null line's."""
    b = Mamba2MetadataBuilder(chunk_size=4, device="cpu")
    md = build(b, [1, 1, 1, 2], [3, PAD_SLOT_ID, NULL_BLOCK_ID, 1], [True, False, False, True])
    assert md.state_indices.tolist() == [3, NULL_BLOCK_ID, NULL_BLOCK_ID, 1]
    assert (md.num_decode_tokens, md.num_prefills) == (3, 1)
