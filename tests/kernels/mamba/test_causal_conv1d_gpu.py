"""GPU-only tests: large shapes (bf16, int32-overflowing token offsets) and random sweeps.

CUDA graphs are in test_causal_conv1d_gpu_graphs.py, int64 addressing of strided tensors
in test_causal_conv1d_gpu_int64.py. Skipped without a CUDA GPU (see tests/conftest.py);
they run on the GPU box.
"""

from __future__ import annotations

import random

import pytest
import torch

from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
    PAD_SLOT_ID,
    causal_conv1d_fn,
    causal_conv1d_ref,
    causal_conv1d_update,
    causal_conv1d_update_ref,
    compute_causal_conv1d_metadata,
)

from .conv_cases import (
    FnCase,
    UpdCase,
    build_fn_inputs,
    build_update_inputs,
    check_fn_against_ref,
)
from .conv_utils import assert_close, assert_no_nan, gen_for, make_bias, make_pool, make_weight

pytestmark = pytest.mark.gpu

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPES = (FP32, FP16, BF16)


def run_fn_case(case: FnCase, device="cuda", metadata=False):
    inp = build_fn_inputs(case, device)
    pool_before, ref_pool = inp.pool.clone(), inp.pool.clone()
    ref_out = causal_conv1d_ref(
        inp.x, inp.weight, inp.bias, ref_pool, inp.qsl, inp.indices, inp.init, case.activation
    )
    meta = compute_causal_conv1d_metadata(inp.qsl.cpu(), device) if metadata else None
    out = causal_conv1d_fn(
        inp.x,
        inp.weight,
        inp.bias,
        inp.pool,
        inp.qsl,
        inp.indices,
        inp.init,
        activation=case.activation,
        metadata=meta,
    )
    check_fn_against_ref(case, inp, out, pool_before, ref_out, ref_pool)


def run_update_case(case: UpdCase, device="cuda"):
    inp = build_update_inputs(case, device)
    pool_before, ref_pool = inp.pool.clone(), inp.pool.clone()
    ref = causal_conv1d_update_ref(
        inp.x, ref_pool, inp.weight, inp.bias, case.activation, inp.indices, inp.accepted, inp.qsl
    )
    out = causal_conv1d_update(
        inp.x,
        inp.pool,
        inp.weight,
        inp.bias,
        case.activation,
        inp.indices,
        inp.accepted,
        inp.qsl,
        max_query_len=max(case.seqlens) if inp.qsl is not None else -1,
    )
    assert out.shape == inp.x.shape and out.stride(1) == 1
    assert_no_nan(out)
    assert_close(out, ref)
    assert torch.equal(inp.pool, ref_pool)
    used = {line for line in inp.lines if line != PAD_SLOT_ID}
    for line in range(inp.pool.shape[0]):
        if line not in used:
            assert torch.equal(inp.pool[line], pool_before[line])


# --- large shapes -----------------------------------------------------------------------


def _large_seqlens(total=4096, batch=16, seed=0):
    rng = random.Random(seed)
    lens = [1, 1, 2] + [rng.randint(50, 400) for _ in range(batch - 4)]
    lens.append(total - sum(lens))
    assert lens[-1] > 0
    rng.shuffle(lens)
    return tuple(lens)


LARGE_FN = [
    FnCase(_large_seqlens(), 8448, 4, BF16, pads=(3,)),
    FnCase(_large_seqlens(seed=1), 8448, 4, BF16, state_dtype=FP32, noncontig=True),
    FnCase(_large_seqlens(seed=2), 8448, 8, FP16, pads=(0, 9)),
]


@pytest.mark.parametrize("case", LARGE_FN, ids=lambda c: c.id)
@pytest.mark.parametrize("metadata", [False, True], ids=["nometa", "meta"])
def test_large_fn(case, metadata, nan_poison):
    run_fn_case(case, metadata=metadata)


LARGE_UPDATE = [
    UpdCase("tok", (1,) * 256, 8448, 4, BF16, pads=(5, 100)),
    UpdCase(
        "multi",
        (4,) * 64,
        8448,
        4,
        BF16,
        state_dtype=FP32,
        accepted=tuple(1 + i % 4 for i in range(64)),
    ),
    UpdCase(
        "varlen",
        tuple(1 + i % 5 for i in range(60)) + (0,) * 4,
        8448,
        4,
        BF16,
        pads=(60, 61, 62, 63),
    ),
]


@pytest.mark.parametrize("case", LARGE_UPDATE, ids=lambda c: c.id)
def test_large_update(case, nan_poison):
    run_update_case(case)


@pytest.mark.gpu_big_memory
def test_many_tokens_past_int32_offsets(nan_poison):
    """2.2 M tokens of dim 1024: token * stride passes 2^31 for the last sequences."""
    dim, width = 1024, 4
    lens = (1000, 2_200_000, 1, 3000)
    g = gen_for("many-tokens")
    num_tokens = sum(lens)
    x = torch.randn(num_tokens, dim, device="cuda", dtype=FP16).t()
    weight = make_weight(dim, width, FP16, "cuda", g)
    bias = make_bias(dim, FP16, "cuda", g)
    pool = make_pool(6, dim, width - 1, FP16, "cuda", g)
    qsl = torch.tensor(
        [0, 1000, 2_201_000, 2_201_001, num_tokens], dtype=torch.int32, device="cuda"
    )
    idx = torch.tensor([5, 0, 3, 1], dtype=torch.int32, device="cuda")
    init = torch.tensor([True, False, True, True], device="cuda")
    ref_pool = pool.clone()
    # line 0 is a sequence's here: the pad marker is -1 (PAD_SLOT_ID), not the null line
    out = causal_conv1d_fn(x, weight, bias, pool, qsl, idx, init, pad_slot_id=PAD_SLOT_ID)
    assert_no_nan(out)
    # the reference on the tail only: the last two sequences, and the long one's end
    tail = 5000
    sub_x = x[:, num_tokens - tail :]
    sub_qsl = torch.tensor([0, tail - 3001, tail - 3000, tail], dtype=torch.int32, device="cuda")
    # the long sequence's tail needs W-1 tokens of context: its state after the whole run
    ref_pool[0, :, : width - 1] = x[:, num_tokens - tail - (width - 1) : num_tokens - tail]
    ref_tail = causal_conv1d_ref(
        sub_x,
        weight,
        bias,
        ref_pool,
        sub_qsl,
        idx[1:],
        torch.tensor([True, True, True], device="cuda"),
        pad_slot_id=PAD_SLOT_ID,
    )
    assert_close(out[:, num_tokens - tail :], ref_tail)
    ref_head = causal_conv1d_ref(
        x[:, :1000], weight, bias, ref_pool, qsl[:2], idx[:1], init[:1], pad_slot_id=PAD_SLOT_ID
    )
    assert_close(out[:, :1000], ref_head)
    assert torch.equal(pool, ref_pool)


# --- random sweeps ----------------------------------------------------------------------


def _random_fn_case(seed: int) -> FnCase:
    rng = random.Random(seed)
    width = rng.randint(2, 8)
    batch = rng.randint(1, 12)
    lens = []
    for _ in range(batch):
        kind = rng.random()
        if kind < 0.05:
            lens.append(0)
        elif kind < 0.4:
            lens.append(1)
        elif kind < 0.6:
            lens.append(rng.randint(1, max(width - 2, 1)))
        else:
            lens.append(rng.randint(1, 700))
    pads = tuple(b for b in range(batch) if rng.random() < 0.15)
    dtype = rng.choice(DTYPES)
    return FnCase(
        tuple(lens),
        rng.choice([64, 96, 520, 2064, 4128, 8448]),
        width,
        dtype,
        state_dtype=rng.choice([dtype, dtype, FP32, BF16, FP16]),
        state_len=width - 1 + rng.choice([0, 0, 0, 3]),
        pads=pads,
        init=tuple(rng.random() < 0.6 for _ in range(batch)),
        noncontig=rng.random() < 0.3,
        bias=rng.random() < 0.8,
        activation=rng.choice(["silu", "silu", None]),
        extra_lines=rng.randint(0, 5),
    )


@pytest.mark.parametrize("seed", range(50), ids=lambda s: f"seed{s}")
def test_random_fn(seed, nan_poison):
    case = _random_fn_case(seed)
    run_fn_case(case, metadata=seed % 2 == 0)


def _random_update_case(seed: int) -> UpdCase:
    rng = random.Random(1000 + seed)
    width = rng.randint(2, 8)
    batch = rng.randint(1, 40)
    mode = rng.choice(["tok", "multi", "varlen"])
    if mode == "tok":
        lens = (1,) * batch
    elif mode == "multi":
        lens = (rng.randint(1, 6),) * batch
    else:
        lens = tuple(rng.choice([0, 1, 1, 2, 3, 4, 7]) for _ in range(batch))
    spec = rng.random() < 0.5
    accepted = tuple(rng.randint(1, max(lens) or 1) for _ in range(batch)) if spec else None
    # a zero-length row is only CUDA-graph padding
    pads = tuple(b for b in range(batch) if lens[b] == 0 or rng.random() < 0.15)
    dtype = rng.choice(DTYPES)
    return UpdCase(
        mode,
        lens,
        rng.choice([64, 96, 520, 2064, 4128, 8448]),
        width,
        dtype,
        state_dtype=rng.choice([dtype, dtype, FP32, BF16, FP16]),
        pads=pads,
        accepted=accepted,
        noncontig=rng.random() < 0.3,
        bias=rng.random() < 0.8,
        activation=rng.choice(["silu", "silu", None]),
        extra_lines=rng.randint(0, 5),
    )


@pytest.mark.parametrize("seed", range(50), ids=lambda s: f"seed{s}")
def test_random_update(seed, nan_poison):
    run_update_case(_random_update_case(seed))
