"""fp32 PyTorch references for the causal-conv1d ops.

They define the semantics the Triton kernels in ``causal_conv1d.py`` must
reproduce, and they are the path taken by CPU tensors when the Triton
interpreter is not enabled. Products and sums are plain fp32 elementwise
arithmetic (no conv1d, which may run in TF32 on a GPU); results are cast once
to the output dtype. States are only moved, never recomputed, so a state
written by the reference is bit-identical to the kernel's.

Cache-line convention (shared with the kernels):
    the W-1 columns of history a sequence starts from are
    ``line[:, off : off + W - 1]`` with ``off = num_accepted_tokens - 1`` in
    speculative decoding and ``off = 0`` otherwise. After a step over L tokens,
    with ``xx = cat(history, tokens)``, the line's first ``W - 1 + L - shift``
    columns hold ``xx[:, shift:]`` where ``shift = L`` normally (the last W-1
    inputs) and ``shift = min(L, 1)`` in speculative decoding (so the next step
    can start from any accepted prefix). Columns past those are left as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The padded-row markers of the state ops (upstream's names). Line 0 of every state pool is
# the null line (upstream's null block): padded rows point there, and the ops' default
# marker is NULL_BLOCK_ID, so a padded row reads and writes no line. PAD_SLOT_ID, the older
# marker, names no line: with ``pad_slot_id=PAD_SLOT_ID`` line 0 is a sequence's like any
# other. A negative index names no line, so every op treats it as a padded row too.
NULL_BLOCK_ID = 0
PAD_SLOT_ID = -1


def marker_for(pad_slot_id: int, indices) -> int:
    """The marker the ops compare indices with: ``pad_slot_id``, or, with ``indices`` None
    (sequence b on line b), -1, which no line has, so line 0 is a sequence's there."""
    return int(pad_slot_id) if indices is not None else PAD_SLOT_ID


def _is_silu(activation) -> bool:
    if activation in (None, False):
        return False
    if activation is True or activation in ("silu", "swish"):
        return True
    raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")


def _conv_window(xx: torch.Tensor, weight: torch.Tensor, bias, silu: bool) -> torch.Tensor:
    """y[:, i] = act(bias + sum_k w[:, k] * xx[:, i + k]) for i < xx.shape[1] - W + 1."""
    width = weight.shape[1]
    n = xx.shape[1] - (width - 1)
    w = weight.float()
    y = torch.zeros(xx.shape[0], n, dtype=torch.float32, device=xx.device)
    if bias is not None:
        y += bias.float()[:, None]
    for k in range(width):
        y += w[:, k : k + 1] * xx[:, k : k + n]
    return F.silu(y) if silu else y


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
    pad_slot_id: int = NULL_BLOCK_ID,
) -> torch.Tensor:
    """Reference of ``causal_conv1d_fn``: x (dim, num_tokens) -> out (dim, num_tokens).

    Mutates ``conv_states`` (num_cache_lines, dim, state_len) in place.
    """
    silu = _is_silu(activation)
    dim, num_tokens = x.shape
    width = weight.shape[1]
    out = torch.empty(num_tokens, dim, dtype=x.dtype, device=x.device).t()
    qsl = query_start_loc.tolist()
    lines = cache_indices.tolist() if cache_indices is not None else list(range(len(qsl) - 1))
    pad_slot_id = marker_for(pad_slot_id, cache_indices)
    init = has_initial_state.tolist() if has_initial_state is not None else [False] * len(lines)
    for b in range(len(qsl) - 1):
        start, end = qsl[b], qsl[b + 1]
        line = lines[b]
        if line == pad_slot_id or line < 0:
            out[:, start:end] = 0
            continue
        if init[b]:
            hist = conv_states[line, :, : width - 1].float()
        else:
            hist = torch.zeros(dim, width - 1, dtype=torch.float32, device=x.device)
        xx = torch.cat([hist, x[:, start:end].float()], dim=1)
        out[:, start:end] = _conv_window(xx, weight, bias, silu).to(x.dtype)
        conv_states[line, :, : width - 1] = xx[:, xx.shape[1] - (width - 1) :].to(conv_states.dtype)
    return out


def causal_conv1d_update_ref(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | bool | None = None,
    conv_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    pad_slot_id: int = NULL_BLOCK_ID,
) -> torch.Tensor:
    """Reference of ``causal_conv1d_update``.

    x: (batch, dim), (batch, dim, seqlen), or with ``query_start_loc``
    (num_tokens, dim). Returns out shaped like x. Mutates ``conv_state``.
    """
    silu = _is_silu(activation)
    width = weight.shape[1]
    if query_start_loc is not None:
        qsl = query_start_loc.tolist()
        seqs = [x[qsl[b] : qsl[b + 1]].t() for b in range(len(qsl) - 1)]
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        outs = [out[qsl[b] : qsl[b + 1]].t() for b in range(len(qsl) - 1)]
    elif x.dim() == 2:
        seqs = [x[b, :, None] for b in range(x.shape[0])]
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        outs = [out[b, :, None] for b in range(x.shape[0])]
    else:
        seqs = [x[b] for b in range(x.shape[0])]
        out = torch.empty(x.shape[0], x.shape[2], x.shape[1], dtype=x.dtype, device=x.device)
        out = out.transpose(1, 2)
        outs = [out[b] for b in range(x.shape[0])]
    batch = len(seqs)
    lines = conv_state_indices.tolist() if conv_state_indices is not None else list(range(batch))
    pad_slot_id = marker_for(pad_slot_id, conv_state_indices)
    accepted = num_accepted_tokens.tolist() if num_accepted_tokens is not None else None
    for b in range(batch):
        xb, ob, line = seqs[b], outs[b], lines[b]
        if line == pad_slot_id or line < 0:
            ob.zero_()
            continue
        seqlen = xb.shape[1]
        off = accepted[b] - 1 if accepted is not None else 0
        hist = conv_state[line, :, off : off + width - 1].float()
        xx = torch.cat([hist, xb.float()], dim=1)
        ob.copy_(_conv_window(xx, weight, bias, silu))
        shift = min(seqlen, 1) if accepted is not None else seqlen
        n_write = width - 1 + seqlen - shift
        conv_state[line, :, :n_write] = xx[:, shift:].to(conv_state.dtype)
    return out
