"""reshape_and_cache: keys and values land in their slots; padding and other slots untouched.

The kernel (Triton interpreter on CPU) is compared with ``torch.equal`` against a cache
written slot by slot in plain Python: the op only moves (and possibly casts) data.
"""

from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.attention.ops.reshape_and_cache import (
    reshape_and_cache,
    reshape_and_cache_ref,
)

from .attn_utils import DTYPE_NAMES, gen_for, randn

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
gpu = pytest.mark.gpu


def _case(
    num_tokens,
    kv_heads,
    head_size,
    block_size,
    num_blocks,
    dtype,
    cache_dtype=None,
    pads=0,
    noncontig=False,
    marks=(),
):
    cache_dtype = cache_dtype or dtype
    cid = (
        f"T{num_tokens}_kv{kv_heads}_D{head_size}_bs{block_size}_nb{num_blocks}"
        f"_{DTYPE_NAMES[dtype]}"
    )
    if cache_dtype != dtype:
        cid += f"_cache{DTYPE_NAMES[cache_dtype]}"
    if pads:
        cid += f"_pad{pads}"
    if noncontig:
        cid += "_nc"
    args = (
        num_tokens,
        kv_heads,
        head_size,
        block_size,
        num_blocks,
        dtype,
        cache_dtype,
        pads,
        noncontig,
    )
    return pytest.param(*args, id=cid, marks=marks)


CASES = [
    _case(7, 2, 16, 16, 4, FP32),
    _case(13, 4, 80, 8, 5, FP16, pads=4),
    _case(9, 1, 160, 16, 3, FP32, noncontig=True, pads=2),
    _case(5, 8, 128, 16, 2, FP16, cache_dtype=FP32),  # one token is 1024 elements
    _case(6, 3, 64, 4, 6, FP32, noncontig=True),
    _case(0, 2, 16, 16, 2, FP32),
    _case(300, 8, 128, 16, 40, BF16, pads=20, marks=gpu),
    _case(257, 32, 160, 16, 30, BF16, noncontig=True, marks=gpu),
    _case(64, 8, 64, 32, 5, FP16, cache_dtype=BF16, pads=7, marks=gpu),
]


def _inputs(
    num_tokens,
    kv_heads,
    head_size,
    block_size,
    num_blocks,
    dtype,
    cache_dtype,
    pads,
    noncontig,
    device,
):
    g = gen_for(num_tokens, kv_heads, head_size, block_size, num_blocks, dtype, pads, noncontig)
    if noncontig:  # k and v as slices of a fused projection (num_tokens, q | k | v)
        proj = randn((num_tokens, 3 * kv_heads, head_size), g, dtype, device)
        key, value = proj[:, kv_heads : 2 * kv_heads], proj[:, 2 * kv_heads :]
    else:
        key = randn((num_tokens, kv_heads, head_size), g, dtype, device)
        value = randn((num_tokens, kv_heads, head_size), g, dtype, device)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    pad_rows = torch.randperm(num_tokens, generator=g)[:pads]
    slots[pad_rows] = -1 - torch.arange(pads)  # any negative slot is padding
    cache = randn((2, num_blocks, block_size, kv_heads, head_size), g, cache_dtype, device)
    return key, value, cache, slots.to(device)


def _expected(key, value, cache, slots):
    exp = cache.clone()
    block_size = cache.shape[2]
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            exp[0, s // block_size, s % block_size] = key[t].to(cache.dtype)
            exp[1, s // block_size, s % block_size] = value[t].to(cache.dtype)
    return exp


@pytest.mark.parametrize(
    "num_tokens,kv_heads,head_size,block_size,num_blocks,dtype,cache_dtype,pads,noncontig",
    CASES,
)
@pytest.mark.parametrize("path", ["op", "ref"])
def test_reshape_and_cache(
    num_tokens,
    kv_heads,
    head_size,
    block_size,
    num_blocks,
    dtype,
    cache_dtype,
    pads,
    noncontig,
    path,
    device,
):
    key, value, cache, slots = _inputs(
        num_tokens,
        kv_heads,
        head_size,
        block_size,
        num_blocks,
        dtype,
        cache_dtype,
        pads,
        noncontig,
        device,
    )
    expected = _expected(key, value, cache, slots)
    fn = reshape_and_cache if path == "op" else reshape_and_cache_ref
    assert fn(key, value, cache, slots) is None
    assert torch.equal(cache, expected)


def test_non_contiguous_cache_ref():
    """The torch path on a cache that is a view (a layer's slice of a larger allocation)."""
    key, value, cache, slots = _inputs(6, 2, 16, 4, 5, FP32, FP32, 2, False, "cpu")
    big = torch.zeros(2, 5, 4, 4, 16)
    view = big[:, :, :, 1:3]
    view.copy_(cache)
    expected = _expected(key, value, cache, slots)
    reshape_and_cache_ref(key, value, view, slots)
    assert torch.equal(view, expected)
    assert torch.equal(big[:, :, :, 0], torch.zeros(2, 5, 4, 16))


@pytest.mark.parametrize("device_name", ["cpu", pytest.param("cuda", marks=gpu)])
def test_opcheck(device_name):
    key, value, cache, slots = _inputs(5, 2, 16, 4, 3, FP32, FP32, 1, True, device_name)
    torch.library.opcheck(torch.ops.vllm.reshape_and_cache.default, (key, value, cache, slots))


def _valid():
    key, value, cache, slots = _inputs(4, 2, 16, 4, 3, FP32, FP32, 1, False, "cpu")
    return dict(key=key, value=value, kv_cache=cache, slot_mapping=slots)


def _head_strided(t):
    """Same values, head_size no longer the stride-1 axis."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


BAD = [
    ("key_2d", lambda a: a.update(key=a["key"][:, 0]), "key must have 3 dims"),
    ("value_shape", lambda a: a.update(value=a["value"][1:]), "value must match key"),
    ("value_dtype", lambda a: a.update(value=a["value"].half()), "value must match key"),
    ("cache_heads", lambda a: a.update(kv_cache=a["kv_cache"][:, :, :, :1]), "kv heads"),
    ("cache_head_size", lambda a: a.update(kv_cache=a["kv_cache"][..., :8]), "head_size 8"),
    ("cache_strided", lambda a: a.update(kv_cache=_head_strided(a["kv_cache"])), "stride 1"),
    ("slots_int32", lambda a: a.update(slot_mapping=a["slot_mapping"].int()), "slot_mapping"),
    ("slots_len", lambda a: a.update(slot_mapping=a["slot_mapping"][1:]), "num_tokens=4"),
    ("key_strided", lambda a: a.update(key=_head_strided(a["key"])), "key must have stride 1"),
]


@pytest.mark.parametrize("mutate,match", [pytest.param(f, m, id=n) for n, f, m in BAD])
def test_bad_input(mutate, match):
    args = _valid()
    mutate(args)
    with pytest.raises(ValueError, match=match):
        reshape_and_cache(**args)


def test_ref_rejects_slot_outside_cache():
    args = _valid()
    args["slot_mapping"][0] = 3 * 4  # one past the last slot
    with pytest.raises(ValueError, match="outside the cache"):
        reshape_and_cache_ref(**args)
