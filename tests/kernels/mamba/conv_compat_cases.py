"""Inputs in upstream callers' conventions, shared by test_causal_conv1d_compat.py (state
pools of any strides) and test_causal_conv1d_compat_padding.py (padded index arrays,
null_block_id): the pool layouts, the fn and update inputs built over them, padded arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm.model_executor.layers.mamba.ops.causal_conv1d import PAD_SLOT_ID

from .conv_utils import gen_for, i32, make_bias, make_weight, make_x, qsl_from_lens, randn

DIM = 40  # not a multiple of any feature block: every block has a masked tail


# --- pool layouts -----------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """A pool (lines, dim, state_len) as a view of a base tensor allocated in another shape."""

    name: str
    base_shape: Callable[[int, int, int], tuple[int, ...]]  # (lines, dim, sl) -> base shape
    view: Callable[[torch.Tensor, int, int, int], torch.Tensor]  # (base, lines, dim, sl) -> pool


LAYOUTS = {
    # the fast path: (lines, state_len, dim) allocated, transposed
    "feat": Layout("feat", lambda n, d, s: (n, s, d), lambda b, n, d, s: b.transpose(1, 2)),
    # upstream's CUDA layout: (lines, dim, state_len) contiguous, width-contiguous
    "wcontig": Layout("wcontig", lambda n, d, s: (n, d, s), lambda b, n, d, s: b),
    # width-contiguous columns sliced out of wider lines (storage offset, gaps)
    "wslice": Layout(
        "wslice", lambda n, d, s: (n, d, s + 3), lambda b, n, d, s: b[:, :, 2 : 2 + s]
    ),
    # features outermost: the feature stride is lines * state_len
    "dmajor": Layout("dmajor", lambda n, d, s: (d, n, s), lambda b, n, d, s: b.permute(1, 0, 2)),
    # lines innermost (line stride 1), features in the middle
    "lmajor": Layout("lmajor", lambda n, d, s: (s, d, n), lambda b, n, d, s: b.permute(2, 1, 0)),
    # feature-contiguous, but every other line of a pool with an odd feature offset
    "featgaps": Layout(
        "featgaps",
        lambda n, d, s: (2 * n, s, d + 5),
        lambda b, n, d, s: b[::2, :, 3 : 3 + d].transpose(1, 2),
    ),
}
OTHER_LAYOUTS = ["wslice", "dmajor", "lmajor", "featgaps"]


def make_layout_pool(layout: str, lines, dim, state_len, dtype, device, gen):
    """(pool view, base tensor): random values everywhere in the base."""
    lay = LAYOUTS[layout]
    base = randn(lay.base_shape(lines, dim, state_len), gen, dtype, device)
    pool = lay.view(base, lines, dim, state_len)
    assert pool.shape == (lines, dim, state_len)
    if layout == "wcontig":
        assert pool.is_contiguous() and pool.stride(2) == 1
    elif layout != "feat" and layout != "featgaps":
        assert pool.stride(1) != 1
    return pool, base


def expected_base(layout: str, base_before, ref_pool) -> torch.Tensor:
    """The base as it must be after the call: the reference's pool values in the view,
    every other element as before."""
    exp = base_before.clone()
    lines, dim, state_len = ref_pool.shape
    LAYOUTS[layout].view(exp, lines, dim, state_len).copy_(ref_pool)
    return exp


def feat_copy(pool: torch.Tensor) -> torch.Tensor:
    """The same values in the fast layout."""
    lines, dim, state_len = pool.shape
    fast = torch.empty((lines, state_len, dim), dtype=pool.dtype, device=pool.device)
    return fast.transpose(1, 2).copy_(pool)


# --- causal_conv1d_fn inputs -------------------------------------------------------------

FN_SEQLENS = (6, 1, 2, 1, 0, 3)  # short sequences, decodes, an empty one
FN_INIT = (True, True, False, True, True, False)
FN_PAD = 2  # this row is padding


def fn_inputs(key, width, dtype, device, layout, extra_lines=3):
    g = gen_for("compat-fn", key)
    batch = len(FN_SEQLENS)
    num_lines = batch + extra_lines
    x = make_x(DIM, sum(FN_SEQLENS), dtype, device, g)
    weight = make_weight(DIM, width, dtype, device, g)
    bias = make_bias(DIM, dtype, device, g)
    pool, base = make_layout_pool(layout, num_lines, DIM, width - 1, dtype, device, g)
    lines = torch.randperm(num_lines, generator=g)[:batch].tolist()
    lines[FN_PAD] = PAD_SLOT_ID
    return x, weight, bias, pool, base, lines


# --- causal_conv1d_update inputs ---------------------------------------------------------

UPD_MODES = ["tok", "spec", "varlen"]


def update_inputs(mode, key, width, dtype, device, layout):
    """(x, weight, bias, pool, base, lines, accepted, qsl) for one update mode.

    tok: one token per row (the decode kernel); spec: (batch, dim, 3) with accepted
    counts (the general kernel, shifted history); varlen: rows of 2, 0, 3 and 1 tokens.
    """
    g = gen_for("compat-update", mode, key)
    accepted = qsl = None
    state_len = width - 1
    if mode == "tok":
        batch = 5
        x = randn((batch, DIM), g, dtype, device)
    elif mode == "spec":
        batch = 3
        x = randn((batch, 3, DIM), g, dtype, device).transpose(1, 2)
        accepted = i32([2, 1, 3], device)
        state_len = width - 1 + 2
    else:
        lens = (2, 0, 3, 1)
        batch = len(lens)
        x = randn((sum(lens), DIM), g, dtype, device)
        qsl = qsl_from_lens(lens, device)
    num_lines = batch + 3
    weight = make_weight(DIM, width, dtype, device, g)
    bias = make_bias(DIM, dtype, device, g)
    pool, base = make_layout_pool(layout, num_lines, DIM, state_len, dtype, device, g)
    lines = torch.randperm(num_lines, generator=g)[:batch].tolist()
    lines[1] = PAD_SLOT_ID
    return x, weight, bias, pool, base, lines, accepted, qsl


def padded(values, extra, device, dtype=torch.int32):
    return torch.tensor(list(values) + list(extra), dtype=dtype, device=device)


NULL = 0  # as upstream's block pools: line 0 is the null block, never a sequence's line
