"""The Mamba2 selective scan (SSD) in PyTorch: chunked over varlen sequences, recurrent for decodes.

Per head h of a sequence, with state S (head_dim x state_size), group g = h // (H // G)::

    dt_t = clamp(softplus(dt_raw_t + dt_bias[h]), *dt_limit)       (softplus when asked)
    S_t  = exp(dt_t * A[h]) * S_{t-1} + dt_t * x_t B_t^T               (B_t, C_t of group g)
    y_t  = S_t C_t + D[h] * x_t

``A`` is negative (``-exp(A_log)``). All state math is fp32; outputs are cast once.

Tensors (logical shapes, token-major; views with any strides are fine):

- ``x``: (num_tokens, nheads, headdim); ``dt``: (num_tokens, nheads) before the bias;
  ``B``, ``C``: (num_tokens, ngroups, dstate); ``A``, ``D``, ``dt_bias``: (nheads,).
- ``state``: (num_lines, nheads, headdim, dstate), the SSM state pool; line 0 is the null
  line (``NULL_BLOCK_ID``) that padded rows name.

``chunk_scan_varlen`` runs the prefill sequences of a step, each from its own initial state,
and returns their final states; the caller moves states between the pool and the sequences.
It is the CPU path of the prefills and the reference of the Triton SSD (``ssd_combined``),
which takes the pool and the step-wide tensors directly on CUDA. Its layout, built on the host
once per step by ``plan_chunked_scan``, cuts every sequence into chunks of ``chunk_size``
tokens (the last one partial), so no chunk mixes sequences: within a chunk the scan is a
masked matrix product (the SSD "diagonal block"), and one loop over chunk positions carries
the states from chunk to chunk for all sequences at once. Chunks are ordered by position in
their sequence, then by sequence (longest first), so the sequences active at position j are
a prefix of the sorted order and every step of that loop works on slices.

``selective_state_update`` is the one-token recurrence for decodes, updating pool lines in
place: on CUDA the fused Triton kernel of ``mamba_ssm_triton``, on CPU
``selective_state_update_torch`` (also the kernel's reference). Neither function reads
device data on the host: no sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from vllm.model_executor.layers.mamba.ops.causal_conv1d_ref import NULL_BLOCK_ID
from vllm.model_executor.layers.mamba.ops.mamba_ssm_triton import (
    selective_state_update_triton,
    use_ssm_kernel,
)
from vllm.tensor_checks import check_scan_shapes, check_state_update_shapes

__all__ = [
    "ChunkedScanLayout",
    "chunk_scan_varlen",
    "plan_chunked_scan",
    "selective_state_update",
    "selective_state_update_torch",
]

_NO_LIMIT = (0.0, math.inf)


@dataclass
class ChunkedScanLayout:
    """Where each token of a step's prefill sequences sits in the chunk grid.

    The grid has ``num_chunks`` rows of ``chunk_size`` cells. ``steps[j] = (first, count)``:
    the chunks at position j of their sequence are rows ``first .. first + count - 1``, and
    they belong to the sequences of rank ``0 .. count - 1`` (``seq_order[rank]`` is the
    sequence). Tensor fields:

    - ``seq_order`` (num_seqs,) int64: sequence of each rank (longest first, stable).
    - ``grid_token`` (num_chunks * chunk_size,) int64: the token in each cell (0 if empty).
    - ``grid_valid`` (num_chunks * chunk_size,) bool: whether the cell holds a token.
    - ``token_grid`` (num_tokens,) int64: the cell of each token.
    """

    chunk_size: int
    num_seqs: int
    num_tokens: int
    num_chunks: int
    steps: tuple[tuple[int, int], ...]
    seq_order: torch.Tensor
    grid_token: torch.Tensor
    grid_valid: torch.Tensor
    token_grid: torch.Tensor

    TENSOR_FIELDS = ("seq_order", "grid_token", "grid_valid", "token_grid")

    def to(self, device: torch.device | str) -> ChunkedScanLayout:
        moved = {
            name: getattr(self, name).to(device, non_blocking=True) for name in self.TENSOR_FIELDS
        }
        return replace(self, **moved)


def plan_chunked_scan(seq_lens: torch.Tensor, chunk_size: int) -> ChunkedScanLayout:
    """Host-side layout for ``chunk_scan_varlen`` from the sequences' token counts.

    ``seq_lens`` is a CPU integer tensor; the sequences' tokens are consecutive, in order.
    Returns CPU tensors (``.to(device)`` moves them).
    """
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.device.type != "cpu":
        raise ValueError("seq_lens must be a CPU tensor")
    if seq_lens.dim() != 1 or seq_lens.is_floating_point() or bool((seq_lens < 0).any()):
        raise ValueError(f"seq_lens must be 1-D non-negative integers, got {seq_lens}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    lens = seq_lens.long()
    num_seqs = lens.numel()
    num_tokens = int(lens.sum())
    n_chunks = (lens + chunk_size - 1) // chunk_size
    seq_order = torch.sort(n_chunks, descending=True, stable=True).indices
    rank = torch.empty_like(seq_order)
    rank[seq_order] = torch.arange(num_seqs)
    max_chunks = int(n_chunks.max()) if num_seqs else 0
    per_count = torch.bincount(n_chunks, minlength=max_chunks + 1)
    # Sequences with more than j chunks: they have a chunk at position j.
    active = num_seqs - torch.cumsum(per_count, 0)[:max_chunks]
    first = torch.cumsum(active, 0) - active
    num_chunks = int(active.sum())

    starts = torch.cumsum(lens, 0) - lens
    tok_seq = torch.repeat_interleave(torch.arange(num_seqs), lens)
    pos = torch.arange(num_tokens) - starts[tok_seq]
    chunk = first[pos // chunk_size] + rank[tok_seq]
    token_grid = chunk * chunk_size + pos % chunk_size
    grid_token = torch.zeros(num_chunks * chunk_size, dtype=torch.int64)
    grid_token[token_grid] = torch.arange(num_tokens)
    grid_valid = torch.zeros(num_chunks * chunk_size, dtype=torch.bool)
    grid_valid[token_grid] = True
    return ChunkedScanLayout(
        chunk_size=chunk_size,
        num_seqs=num_seqs,
        num_tokens=num_tokens,
        num_chunks=num_chunks,
        steps=tuple(zip(first.tolist(), active.tolist(), strict=True)),
        seq_order=seq_order,
        grid_token=grid_token,
        grid_valid=grid_valid,
        token_grid=token_grid,
    )


def _discretize_dt(dt, dt_bias, dt_softplus, dt_limit) -> torch.Tensor:
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    lo, hi = dt_limit
    if (lo, hi) != _NO_LIMIT:
        dt = dt.clamp(min=lo, max=hi)
    return dt


def chunk_scan_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    layout: ChunkedScanLayout,
    initial_states: torch.Tensor | None = None,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = _NO_LIMIT,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scan every sequence of ``layout`` over its tokens; returns ``(out, final_states)``.

    ``initial_states`` (num_seqs, nheads, headdim, dstate) or None (zeros).
    ``final_states`` is fp32 (num_seqs, nheads, headdim, dstate). ``out``
    (num_tokens, nheads, headdim), when given, is written in full and returned;
    otherwise it is allocated in x's dtype.
    """
    check_scan_shapes(x, dt, A, B, C, D, dt_bias)
    if x.shape[0] != layout.num_tokens:
        raise ValueError(f"x has {x.shape[0]} tokens, the layout {layout.num_tokens}")
    _, nheads, headdim = x.shape
    ngroups, dstate = B.shape[1:]
    hpg = nheads // ngroups
    nseq, nchunk, L = layout.num_seqs, layout.num_chunks, layout.chunk_size
    state_shape = (nheads, headdim, dstate)
    if initial_states is not None and tuple(initial_states.shape) != (nseq, *state_shape):
        raise ValueError(
            f"initial_states must be (num_seqs={nseq}, {nheads}, {headdim}, {dstate}), "
            f"got {tuple(initial_states.shape)}"
        )
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    f32 = dict(dtype=torch.float32, device=x.device)

    # Gather tokens into the chunk grid; empty cells get dt = 0, so they neither decay the
    # state nor add to it.
    cells = layout.grid_token
    xg = x.index_select(0, cells).float().view(nchunk, L, ngroups, hpg, headdim)
    dtg = _discretize_dt(dt.index_select(0, cells), dt_bias, dt_softplus, dt_limit)
    dtg = torch.where(layout.grid_valid[:, None], dtg, 0.0).view(nchunk, L, nheads)
    Bg = B.index_select(0, cells).float().view(nchunk, L, ngroups, dstate)
    Cg = C.index_select(0, cells).float().view(nchunk, L, ngroups, dstate)

    a = dtg * A.float()  # (chunk, L, head), <= 0
    cum = a.cumsum(1)
    # seg[k, h, l, s] = sum of a over (s, l] for s <= l, summed term by term (not as a
    # difference of cumulative sums, which loses precision late in a long chunk).
    lower = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    seg = torch.where(lower.tril(-1), a.transpose(1, 2)[..., None], 0.0).cumsum(-2)
    seg = seg.masked_fill(~lower, -math.inf)
    weights = torch.einsum("klgn,ksgn->kgls", Cg, Bg)[:, :, None]
    weights = weights * seg.exp().view(nchunk, ngroups, hpg, L, L)
    weights = weights * dtg.transpose(1, 2).reshape(nchunk, ngroups, hpg, 1, L)
    y = torch.einsum("kghls,ksghp->klghp", weights, xg)

    # Each chunk's contribution to the state at its end, and its decay of the state it
    # starts from; then carry the states across chunks.
    to_end = (cum[:, -1:] - cum).exp() * dtg
    chunk_states = torch.einsum(
        "klgn,klgh,klghp->kghpn", Bg, to_end.view(nchunk, L, ngroups, hpg), xg
    ).reshape(nchunk, *state_shape)
    chunk_decay = cum[:, -1].exp()[:, :, None, None]
    if initial_states is None:
        run = torch.zeros(nseq, *state_shape, **f32)
    else:
        run = initial_states.index_select(0, layout.seq_order).float()
    starts = torch.empty(nchunk, *state_shape, **f32)
    for first, count in layout.steps:
        rows = slice(first, first + count)
        starts[rows] = run[:count]
        run[:count] = run[:count] * chunk_decay[rows] + chunk_states[rows]

    y_from_start = torch.einsum(
        "klgn,kghpn->klghp", Cg, starts.view(nchunk, ngroups, hpg, headdim, dstate)
    )
    y = y + y_from_start * cum.exp().view(nchunk, L, ngroups, hpg, 1)
    if D is not None:
        y = y + D.float().view(ngroups, hpg, 1) * xg
    out.copy_(y.reshape(nchunk * L, nheads, headdim).index_select(0, layout.token_grid))

    final_states = torch.empty_like(run)
    final_states.index_copy_(0, layout.seq_order, run)
    return out, final_states


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = _NO_LIMIT,
    state_batch_indices: torch.Tensor | None = None,
    pad_slot_id: int = NULL_BLOCK_ID,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One recurrence step for each of ``batch`` sequences; updates ``state`` in place.

    x (batch, nheads, headdim), dt (batch, nheads), B and C (batch, ngroups, dstate).
    ``state_batch_indices`` (batch,) names each sequence's line (None: line b);
    ``pad_slot_id`` marks a padded row: its output is zero and no slot is written.
    Returns ``out`` (allocated in x's dtype when None), written in full.

    CUDA tensors run the fused Triton kernel (``mamba_ssm_triton``), which reads and writes
    each state line once; CPU tensors run ``selective_state_update_torch``, or the kernel
    under ``TRITON_INTERPRET=1``.
    """
    fn = selective_state_update_triton if use_ssm_kernel(x) else selective_state_update_torch
    return fn(
        state, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit, state_batch_indices,
        pad_slot_id, out,
    )  # fmt: skip


def selective_state_update_torch(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = _NO_LIMIT,
    state_batch_indices: torch.Tensor | None = None,
    pad_slot_id: int = NULL_BLOCK_ID,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``selective_state_update`` in PyTorch: the CPU path, and the GPU kernel's reference.

    A padded row writes no line. When the marker is a line of ``state`` (the null line 0,
    ``NULL_BLOCK_ID``), padded rows gather that line and store it back unchanged, so the
    work stays fixed by shapes with no host sync; any other marker (``PAD_SLOT_ID``) names
    no line, and only the real rows are stored (a data-dependent selection: a host sync,
    which the CPU path does not mind).
    """
    check_state_update_shapes(state, x, dt, A, B, C, D, dt_bias, state_batch_indices, out)
    batch, nheads, headdim = x.shape
    ngroups, dstate = B.shape[1:]
    hpg = nheads // ngroups
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if state_batch_indices is None:
        lines = torch.arange(batch, device=x.device)
        is_pad = None
    else:
        idx = state_batch_indices.long()
        is_pad = (idx == pad_slot_id) | (idx < 0)
        marker_is_line = 0 <= pad_slot_id < state.shape[0]
        lines = torch.where(is_pad, pad_slot_id if marker_is_line else 0, idx)

    s = state.index_select(0, lines).float().view(batch, ngroups, hpg, headdim, dstate)
    dtp = _discretize_dt(dt, dt_bias, dt_softplus, dt_limit).view(batch, ngroups, hpg)
    decay = (dtp * A.float().view(ngroups, hpg)).exp()
    xf = x.float().view(batch, ngroups, hpg, headdim)
    s = s * decay[..., None, None] + (dtp[..., None] * xf)[..., None] * B.float()[:, :, None, None]
    y = torch.einsum("bghpn,bgn->bghp", s, C.float())
    if D is not None:
        y = y + D.float().view(ngroups, hpg, 1) * xf
    if is_pad is not None:
        y = torch.where(is_pad[:, None, None, None], 0.0, y)
    new = s.view(batch, nheads, headdim, dstate).to(state.dtype)
    if is_pad is None:
        state.index_copy_(0, lines, new)
    elif marker_is_line:
        state.index_copy_(0, lines, torch.where(is_pad[:, None, None, None], state[lines], new))
    else:
        real = (~is_pad).nonzero().squeeze(1)
        state.index_copy_(0, lines[real], new[real])
    out.copy_(y.view(batch, nheads, headdim))
    return out
