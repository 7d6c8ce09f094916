"""What the bad-input cases of the causal-conv1d ops are built from: a valid call of each
op (``fn_kwargs``, ``update_kwargs``), mutations that break one argument, and the check
that a rejected call names the argument and leaves the state pool untouched."""

from __future__ import annotations

import re

import pytest
import torch

from vllm.model_executor.layers.mamba.ops.causal_conv1d import compute_causal_conv1d_metadata

from .conv_utils import gen_for, make_bias, make_pool, make_weight, make_x, qsl_from_lens, randn

FP32 = torch.float32
DIM, WIDTH, STATE_LEN, LINES = 64, 4, 8, 5  # STATE_LEN fits widths up to 9


def _i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def _token_major(t: torch.Tensor) -> torch.Tensor:
    """The same values with the token axis contiguous (stride(0) != 1)."""
    return t.contiguous()


def fn_kwargs(device) -> dict:
    g = gen_for("errors-fn")
    seqlens = (3, 1, 2)
    return dict(
        x=make_x(DIM, sum(seqlens), FP32, device, g),
        weight=make_weight(DIM, WIDTH, FP32, device, g),
        bias=make_bias(DIM, FP32, device, g),
        conv_states=make_pool(LINES, DIM, STATE_LEN, FP32, device, g),
        query_start_loc=qsl_from_lens(seqlens, device),
        cache_indices=_i32([3, 2, 1], device),
        has_initial_state=torch.tensor([True, False, True], device=device),
        activation="silu",
    )


def update_kwargs(device) -> dict:
    g = gen_for("errors-update")
    return dict(
        x=randn((3, DIM), g, FP32, device),
        conv_state=make_pool(LINES, DIM, STATE_LEN, FP32, device, g),
        weight=make_weight(DIM, WIDTH, FP32, device, g),
        bias=make_bias(DIM, FP32, device, g),
        activation="silu",
        conv_state_indices=_i32([3, 2, 1], device),
    )


def _set(**changes):
    """A mutation replacing arguments; values are callables (kwargs, device) -> new value."""

    def mutate(kw, device):
        for name, make in changes.items():
            kw[name] = make(kw, device)
        return kw

    return mutate


def _pool(lines=LINES, dim=DIM, state_len=STATE_LEN, dtype=FP32):
    return lambda kw, d: make_pool(lines, dim, state_len, dtype, d, gen_for("pool", state_len))


def _other_meta(seqlens):
    return lambda kw, d: compute_causal_conv1d_metadata(qsl_from_lens(seqlens, "cpu"), d)


def _expanded_pool(kw, d):
    """One line seen as LINES lines (stride 0): writing one would write them all."""
    return make_pool(1, DIM, STATE_LEN, FP32, d, gen_for("expanded")).expand(LINES, -1, -1)


def _strided(t):
    """The same values as a view with stride 2 (every other element of a longer tensor)."""
    wide = torch.zeros(2 * t.shape[0], dtype=t.dtype, device=t.device)
    wide[::2] = t
    return wide[::2]


def _upd_x3d(seqlen):
    # (batch, dim, seqlen) with stride(1) == 1
    return lambda kw, d: randn((3, seqlen, DIM), gen_for("x3d", seqlen), FP32, d).transpose(1, 2)


def _varlen(seqlens):
    def mutate(kw, d):
        kw["x"] = randn((sum(seqlens), DIM), gen_for("xvar", seqlens), FP32, d)
        kw["query_start_loc"] = qsl_from_lens(seqlens, d)
        kw["max_query_len"] = max(seqlens)
        return kw

    return mutate


def _then(*mutations):
    def mutate(kw, d):
        for m in mutations:
            kw = m(kw, d)
        return kw

    return mutate


def _expect_value_error(op, kw, pattern, validate_data, pool_name):
    pool = kw[pool_name]
    pool_before = pool.clone()
    with pytest.raises(ValueError) as err:
        op(**kw, validate_data=validate_data)
    msg = str(err.value)
    assert re.search(pattern, msg), f"message does not name the argument ({pattern}): {msg}"
    assert torch.equal(pool, pool_before), "the state pool changed on a rejected call"
