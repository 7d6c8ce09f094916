"""Mamba2 metadata of a mixed step padded to a CUDA-graph bucket (``cudagraph_mode`` FULL).

A captured graph replays its launches with the grids, host integers and tensor addresses of
its capture, so every count the Mamba2 layers read must be the bucket's, never the step's.
``MixedBucket`` (T tokens, S sequences, at most P prefills) fixes them:

- the conv sees S + 1 rows: the step's real rows in canonical order (its D one-token
  decodes first, then its prefills), then zero-token padded rows, then one padded row that
  takes the T - (real tokens) padded tokens; every padded row is on the null line;
- the decode update runs over the first S tokens with ``decode_state_indices`` (S,): the
  decodes' slots, then the null line, so rows past the decodes (prefill tokens, padding)
  read and write no line and get y = 0, which the SSD then overwrites on the prefill rows;
- the SSD runs over a chunk layout of P + 1 sequences and ``padded_chunk_count(T, P)``
  chunks: the prefills' sequences and chunks, then sequences without chunks, then a last
  padded sequence that owns every spare chunk; spare chunks hold no rows (their chunk
  state returns at once, the scan writes nothing, a padded sequence passes no state).

The host work (``prepare_padded``) runs on the step's lists only; every tensor it gives has
the bucket's size, so an upload lands on the same bytes the graph captured. The decode
stream the layers see is the S rows, the prefill count P + 1 and the prefill token count 0
(so the layer's y starts from zeros: padded tokens get y = 0, as in an eager step).

Layers without the SSD read the same rows: LFM2's short conv keeps every row the conv
computed (``padded_to_bucket``), and Mamba1's selective scan takes all S + 1 rows as its
sequences (decodes as one-token sequences continuing their lines); a model without chunk
size (Mamba1, Jamba) gets no SSD layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm.model_executor.layers.mamba.mamba2_metadata import (
    Mamba2Metadata,
    Mamba2Plan,
    finish_common,
)
from vllm.model_executor.layers.mamba.ops.causal_conv1d import NULL_BLOCK_ID
from vllm.model_executor.layers.mamba.ops.causal_conv1d_host import conv1d_metadata_host
from vllm.model_executor.layers.mamba.ops.ssd_layout import SSDChunkLayout, plan_ssd_chunks


@dataclass(frozen=True)
class MixedBucket:
    """A mixed-step graph's shape: ``num_tokens`` (T) padded tokens, ``num_seqs`` (S) rows
    for the step's sequences, at most ``max_prefills`` (P) of them prefills."""

    num_tokens: int
    num_seqs: int
    max_prefills: int

    def __post_init__(self):
        if not 1 <= self.max_prefills <= self.num_seqs <= self.num_tokens:
            raise ValueError(f"a bucket needs 1 <= max_prefills <= num_seqs <= num_tokens: {self}")


def padded_chunk_count(num_tokens: int, max_prefills: int, chunk_size: int) -> int:
    """Chunks enough for any P prefills within T tokens: sum(ceil(len_i / L)) < T / L + P."""
    return num_tokens // chunk_size + max_prefills


@dataclass
class Mamba2PaddedMetadata(Mamba2Metadata):
    """``Mamba2Metadata`` of a mixed step padded to its bucket (module docstring). The
    decode update's slots and the SSD's per-sequence slots and flags are tensors of their
    own (the bucket's sizes), not slices of the rows'."""

    decode_slots: torch.Tensor | None = None
    prefill_slots: torch.Tensor | None = None
    prefill_init: torch.Tensor | None = None

    @property
    def decode_only(self) -> bool:
        return False

    @property
    def padded_to_bucket(self) -> bool:
        return True

    @property
    def decode_state_indices(self) -> torch.Tensor:
        return self.decode_slots

    @property
    def prefill_state_indices(self) -> torch.Tensor:
        return self.prefill_slots

    @property
    def prefill_has_initial_state(self) -> torch.Tensor:
        return self.prefill_init


def decodes_lead(lens, contexts, num_decodes: int) -> bool:
    """The first ``num_decodes`` rows are decodes (one token continuing a sequence), as
    the padded layout needs them; the rows after them are prefills of any kind (a one-token
    chunk continuing its state included: the SSD scans it as a one-token sequence)."""
    return all(n == 1 and c > 0 for n, c in zip(lens[:num_decodes], contexts[:num_decodes],
                                                 strict=True))  # fmt: skip


def _padded_layout(prefill_rows: np.ndarray, bucket: MixedBucket, chunk_size: int):
    """The SSD layout of the prefills at ``prefill_rows`` (their P_real + 1 row offsets),
    padded to P + 1 sequences and the bucket's chunk count; None when the prefills need more
    chunks than the bucket has."""
    real = plan_ssd_chunks(torch.from_numpy(prefill_rows.astype(np.int32)), chunk_size)
    num_chunks = padded_chunk_count(bucket.num_tokens, bucket.max_prefills, chunk_size)
    if real.num_chunks > num_chunks:
        return None
    p, c_real, end = bucket.max_prefills, real.num_chunks, int(prefill_rows[-1])
    starts = np.full(num_chunks + 1, end, dtype=np.int32)
    starts[:c_real] = real.chunk_starts.numpy()[:c_real]
    seqs = np.full(num_chunks, p, dtype=np.int32)
    seqs[:c_real] = real.chunk_seqs.numpy()
    seq_starts = np.full(p + 2, c_real, dtype=np.int32)
    seq_starts[: real.num_seqs + 1] = real.seq_chunk_starts.numpy()
    seq_starts[-1] = num_chunks
    return SSDChunkLayout(
        chunk_size=chunk_size,
        num_seqs=p + 1,
        num_chunks=num_chunks,
        num_tokens=bucket.num_tokens,
        first_row=0,
        end_row=bucket.num_tokens,
        chunk_starts=torch.from_numpy(starts),
        chunk_seqs=torch.from_numpy(seqs),
        seq_chunk_starts=torch.from_numpy(seq_starts),
    )


def prepare_padded(
    bucket: MixedBucket, chunk_size: int | None, lens, slots, contexts, num_decodes: int
) -> Mamba2Plan | None:
    """The host half of a padded step's metadata (``finish_padded`` makes it): ``lens``,
    ``slots`` (>= 1), ``contexts`` per real row, the first ``num_decodes`` of them decodes
    and the rest prefills (``decodes_lead``). None when the step does not fit the
    bucket: more rows, tokens or prefills, or chunks, than it has. ``chunk_size`` None
    (Mamba1 models) plans no SSD layout."""
    t, s, p = bucket.num_tokens, bucket.num_seqs, bucket.max_prefills
    r = len(lens)
    d = num_decodes
    real_tokens = sum(lens)
    if r > s or r - d > p or real_tokens > t:
        return None
    q = np.zeros(s + 2, dtype=np.int32)
    np.cumsum(np.asarray(lens, dtype=np.int32), out=q[1 : r + 1])
    q[r + 1 :] = real_tokens
    q[-1] = t
    layout = None  # no chunked scan (Mamba1: its scan takes every row, mamba_mixer)
    if chunk_size is not None:
        layout = _padded_layout(q[d : r + 1], bucket, chunk_size)
        if layout is None:
            return None
    rows = np.full(s + 1, NULL_BLOCK_ID, dtype=np.int32)
    rows[:r] = slots
    init = np.zeros(s + 1, dtype=np.bool_)
    init[:r] = np.asarray(contexts) > 0
    dec = np.full(s, NULL_BLOCK_ID, dtype=np.int32)
    dec[:d] = rows[:d]
    pre = np.full(p + 1, NULL_BLOCK_ID, dtype=np.int32)
    pre[: r - d] = rows[d:r]
    pre_init = np.zeros(p + 1, dtype=np.bool_)
    pre_init[: r - d] = init[d:r]
    pre_q = np.full(p + 2, q[r] - q[d], dtype=np.int32)
    pre_q[: r - d + 1] = q[d : r + 1] - q[d]
    qsl = torch.from_numpy(q)
    conv_host, conv_fields = conv1d_metadata_host(qsl)
    conv_fields["max_query_len"] = t  # the bucket's, not the step's: a graph replays it
    host = {
        "state_indices": torch.from_numpy(rows),
        "has_initial_state": torch.from_numpy(init),
        "prefill_query_start_loc": torch.from_numpy(pre_q),
        "decode_slots": torch.from_numpy(dec),
        "prefill_slots": torch.from_numpy(pre),
        "prefill_init": torch.from_numpy(pre_init),
    }
    if layout is not None:
        host.update({f"layout.{n}": getattr(layout, n) for n in layout.TENSOR_FIELDS})
    host.update({f"conv.{n}": v for n, v in conv_host.items()})
    counts = dict(
        num_tokens=t, batch_size=s + 1, num_decode_tokens=s, num_prefills=p + 1,
        num_prefill_tokens=0,
    )  # fmt: skip
    return Mamba2Plan(host=host, layout=layout, conv_fields=conv_fields, counts=counts)


def finish_padded(plan: Mamba2Plan, dev: dict[str, torch.Tensor]) -> Mamba2PaddedMetadata:
    """The padded metadata from the device copies of ``plan.host`` (same names)."""
    ssd, common = finish_common(plan, dev)
    return Mamba2PaddedMetadata(
        **common,
        ssd=ssd,
        scan=None,
        token_perm=None,
        decode_slots=dev["decode_slots"],
        prefill_slots=dev["prefill_slots"],
        prefill_init=dev["prefill_init"],
    )
