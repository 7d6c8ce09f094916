"""GPU-only: int64 addressing: tokens and state lines more than 2^31 elements apart in
one storage, for causal_conv1d_fn and causal_conv1d_update.

Skipped without a CUDA GPU (see tests/conftest.py); they run on the GPU box.
"""

from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
    causal_conv1d_fn,
    causal_conv1d_ref,
    causal_conv1d_update,
    causal_conv1d_update_ref,
)

from .conv_utils import assert_close, gen_for, make_bias, make_pool, make_weight

pytestmark = pytest.mark.gpu

FP16 = torch.float16


# --- int64 addressing -------------------------------------------------------------------

BIG = (1 << 30) + 4160  # elements; twice this is past 2^31


def _spread_x(num_tokens, dim, dtype, gen):
    """x (dim, num_tokens) whose tokens lie BIG elements apart in one multi-GB storage."""
    storage = torch.empty((num_tokens - 1) * BIG + dim, dtype=dtype, device="cuda")
    x = storage.as_strided((dim, num_tokens), (1, BIG))
    for t in range(num_tokens):
        x[:, t] = torch.randn(dim, generator=gen).to(dtype)
    return x


def _spread_pool(num_lines, dim, state_len, dtype, gen):
    """A pool (num_lines, dim, state_len) whose lines lie BIG elements apart."""
    storage = torch.empty((num_lines - 1) * BIG + dim * state_len, dtype=dtype, device="cuda")
    pool = storage.as_strided((num_lines, dim, state_len), (BIG, 1, dim))
    for line in range(num_lines):
        pool[line] = torch.randn(dim, state_len, generator=gen).to(dtype)
    return pool


@pytest.mark.gpu_big_memory
def test_fn_x_tokens_past_2_31(nan_poison):
    g = gen_for("int64-fn-x")
    dim, width, dtype = 128, 4, FP16
    x = _spread_x(3, dim, dtype, g)
    weight, bias = make_weight(dim, width, dtype, "cuda", g), make_bias(dim, dtype, "cuda", g)
    pool = make_pool(3, dim, width - 1, dtype, "cuda", g)
    qsl = torch.tensor([0, 1, 3], dtype=torch.int32, device="cuda")
    idx = torch.tensor([2, 0], dtype=torch.int32, device="cuda")
    init = torch.tensor([True, True], device="cuda")
    ref_pool = pool.clone()
    ref = causal_conv1d_ref(x, weight, bias, ref_pool, qsl, idx, init)
    out = causal_conv1d_fn(x, weight, bias, pool, qsl, idx, init)
    assert_close(out, ref)
    assert torch.equal(pool, ref_pool)


@pytest.mark.gpu_big_memory
@pytest.mark.parametrize("mode", ["tok", "varlen"])
def test_update_x_tokens_past_2_31(mode, nan_poison):
    g = gen_for("int64-update-x", mode)
    dim, width, dtype = 128, 4, FP16
    x = _spread_x(3, dim, dtype, g).t()  # (3, dim): rows BIG apart
    weight, bias = make_weight(dim, width, dtype, "cuda", g), make_bias(dim, dtype, "cuda", g)
    pool = make_pool(4, dim, width - 1, dtype, "cuda", g)
    if mode == "tok":
        idx, qsl, max_len = [3, 0, 1], None, -1
    else:
        idx, max_len = [3, 0], 2
        qsl = torch.tensor([0, 1, 3], dtype=torch.int32, device="cuda")
    idx = torch.tensor(idx, dtype=torch.int32, device="cuda")
    ref_pool = pool.clone()
    ref = causal_conv1d_update_ref(x, ref_pool, weight, bias, "silu", idx, None, qsl)
    out = causal_conv1d_update(
        x, pool, weight, bias, "silu", idx, query_start_loc=qsl, max_query_len=max_len
    )
    assert_close(out, ref)
    assert torch.equal(pool, ref_pool)


@pytest.mark.gpu_big_memory
def test_fn_state_line_past_2_31(nan_poison):
    g = gen_for("int64-fn-pool")
    dim, width, dtype = 256, 4, FP16
    pool = _spread_pool(3, dim, width - 1, dtype, g)
    x = torch.randn(9, dim, generator=g).to(dtype=dtype, device="cuda").t()
    weight, bias = make_weight(dim, width, dtype, "cuda", g), make_bias(dim, dtype, "cuda", g)
    qsl = torch.tensor([0, 5, 6, 9], dtype=torch.int32, device="cuda")
    idx = torch.tensor([2, 0, 1], dtype=torch.int32, device="cuda")
    init = torch.tensor([True, True, False], device="cuda")
    ref_pool = pool.clone()  # compact copy
    ref = causal_conv1d_ref(x, weight, bias, ref_pool, qsl, idx, init)
    out = causal_conv1d_fn(x, weight, bias, pool, qsl, idx, init)
    assert_close(out, ref)
    assert torch.equal(pool, ref_pool)


@pytest.mark.gpu_big_memory
@pytest.mark.parametrize("spec", [False, True], ids=["plain", "spec"])
def test_update_state_line_past_2_31(spec, nan_poison):
    g = gen_for("int64-update-pool", spec)
    dim, width, dtype, seqlen = 256, 4, FP16, 3
    pool = _spread_pool(3, dim, width - 1 + (seqlen - 1 if spec else 0), dtype, g)
    x = torch.randn(2, seqlen, dim, generator=g).to(dtype=dtype, device="cuda").transpose(1, 2)
    weight, bias = make_weight(dim, width, dtype, "cuda", g), make_bias(dim, dtype, "cuda", g)
    idx = torch.tensor([2, 0], dtype=torch.int32, device="cuda")
    acc = torch.tensor([3, 2], dtype=torch.int32, device="cuda") if spec else None
    ref_pool = pool.clone()
    ref = causal_conv1d_update_ref(x, ref_pool, weight, bias, "silu", idx, acc)
    out = causal_conv1d_update(x, pool, weight, bias, "silu", idx, acc)
    assert_close(out, ref)
    assert torch.equal(pool, ref_pool)
