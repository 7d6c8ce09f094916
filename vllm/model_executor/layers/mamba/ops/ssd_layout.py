"""The chunk layout of a step's prefill sequences for the Triton SSD (``ssd_combined``):
built on the host once per step from ``query_start_loc``, shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

__all__ = ["SSDChunkLayout", "plan_ssd_chunks"]


@dataclass
class SSDChunkLayout:
    """The chunks of one step's sequences, rows absolute in the step's token axis.

    Sequence i covers rows ``[q[i], q[i+1])`` of ``query_start_loc``; it is cut into chunks
    of ``chunk_size`` rows, the last one partial, so no chunk mixes sequences. Host ints:
    ``num_seqs``, ``num_chunks``, ``num_tokens`` (rows covered), ``first_row`` and
    ``end_row`` (``q[0]``, ``q[-1]``). int32 tensors: ``chunk_starts`` (num_chunks+1,) the
    first row of each chunk (then ``end_row``: chunks tile the rows), ``chunk_seqs``
    (num_chunks,) each chunk's sequence, ``seq_chunk_starts`` (num_seqs+1,) each sequence's
    first chunk (a sequence without tokens has none).
    """

    chunk_size: int
    num_seqs: int
    num_chunks: int
    num_tokens: int
    first_row: int
    end_row: int
    chunk_starts: torch.Tensor
    chunk_seqs: torch.Tensor
    seq_chunk_starts: torch.Tensor

    TENSOR_FIELDS = ("chunk_starts", "chunk_seqs", "seq_chunk_starts")

    def to(self, device: torch.device | str) -> SSDChunkLayout:
        moved = {n: getattr(self, n).to(device, non_blocking=True) for n in self.TENSOR_FIELDS}
        return replace(self, **moved)


def plan_ssd_chunks(query_start_loc_cpu: torch.Tensor, chunk_size: int) -> SSDChunkLayout:
    """The chunk layout of sequences at rows ``query_start_loc_cpu`` (CPU, (num_seqs+1,),
    non-decreasing, starting anywhere); CPU tensors, ``.to(device)`` moves them.

    Built with numpy on the tensor's memory: a handful of vector operations of a
    microsecond each, where as many torch calls would cost tens of microseconds per step.
    """
    q = query_start_loc_cpu
    if not isinstance(q, torch.Tensor) or q.device.type != "cpu":
        raise ValueError("query_start_loc_cpu must be a CPU tensor")
    if q.dim() != 1 or q.numel() < 1 or q.is_floating_point() or q.dtype == torch.bool:
        raise ValueError(
            f"query_start_loc_cpu must be 1-D integers (num_seqs+1,), got {q.dtype} "
            f"{tuple(q.shape)}"
        )
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    rows = q.numpy().astype(np.int64)
    lens = np.diff(rows)
    if (lens < 0).any() or rows[0] < 0 or rows[-1] >= 2**31:
        raise ValueError("query_start_loc_cpu must be non-decreasing rows in [0, 2**31)")
    num_seqs = lens.size
    seq_chunk_starts = np.zeros(num_seqs + 1, dtype=np.int32)
    np.cumsum(-(-lens // chunk_size), out=seq_chunk_starts[1:])
    num_chunks = int(seq_chunk_starts[-1])
    chunk_seqs = np.repeat(np.arange(num_seqs, dtype=np.int32), np.diff(seq_chunk_starts))
    chunk_starts = np.empty(num_chunks + 1, dtype=np.int32)
    pos = np.arange(num_chunks) - seq_chunk_starts[chunk_seqs]
    chunk_starts[:num_chunks] = rows[chunk_seqs] + pos * chunk_size
    chunk_starts[num_chunks] = rows[-1]
    return SSDChunkLayout(
        chunk_size=chunk_size,
        num_seqs=num_seqs,
        num_chunks=num_chunks,
        num_tokens=int(rows[-1] - rows[0]),
        first_row=int(rows[0]),
        end_row=int(rows[-1]),
        chunk_starts=torch.from_numpy(chunk_starts),
        chunk_seqs=torch.from_numpy(chunk_seqs),
        seq_chunk_starts=torch.from_numpy(seq_chunk_starts),
    )
