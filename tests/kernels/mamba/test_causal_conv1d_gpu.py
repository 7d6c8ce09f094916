"""GPU-only tests: large shapes, bf16, random sweeps, CUDA graphs, int64 addressing.

Skipped without a CUDA GPU (see tests/conftest.py); they run on the GPU box.
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


# --- CUDA graphs ------------------------------------------------------------------------


def _capture(fn):
    """Warm up on a side stream, then capture ``fn``; returns (graph, static output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(warmup=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(warmup=False)
    return graph, out


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_cuda_graph_decode_with_padded_rows(dtype, nan_poison):
    g = gen_for("graph-decode", dtype)
    batch, dim, width, num_lines = 16, 2064, 4, 24
    weight, bias = make_weight(dim, width, dtype, "cuda", g), make_bias(dim, dtype, "cuda", g)
    pool = make_pool(num_lines, dim, width - 1, dtype, "cuda", g)
    static_x = torch.randn(batch, dim, generator=g).to(dtype=dtype, device="cuda")
    static_idx = torch.arange(batch, dtype=torch.int32, device="cuda")

    def step(warmup):
        p = pool.clone() if warmup else pool
        return causal_conv1d_update(static_x, p, weight, bias, "silu", static_idx)

    graph, static_out = _capture(step)
    for replay in range(3):
        n_real = [16, 11, 5][replay]
        lines = torch.randperm(num_lines, generator=g)[:batch]
        lines[n_real:] = PAD_SLOT_ID
        static_idx.copy_(lines)
        static_x.copy_(torch.randn(batch, dim, generator=g).to(dtype))
        pool_before, ref_pool = pool.clone(), pool.clone()
        ref = causal_conv1d_update_ref(static_x, ref_pool, weight, bias, "silu", static_idx)
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_no_nan(static_out)
        assert_close(static_out, ref)
        assert not static_out[n_real:].any(), "padded rows must be zero"
        assert torch.equal(pool, ref_pool)
        used = set(lines[:n_real].tolist())
        for line in range(num_lines):
            if line not in used:
                assert torch.equal(pool[line], pool_before[line]), f"replay {replay}: line {line}"


def test_cuda_graph_varlen_spec_with_padded_rows(nan_poison):
    """Speculative decode under a graph: varlen rows, zero-length padded rows at the end."""
    g = gen_for("graph-spec")
    dtype, dim, width, num_lines, max_len = BF16, 1024, 4, 12, 4
    batch, num_tokens = 8, 16
    weight, bias = make_weight(dim, width, dtype, "cuda", g), make_bias(dim, dtype, "cuda", g)
    pool = make_pool(num_lines, dim, width - 1 + max_len - 1, dtype, "cuda", g)
    static_x = torch.randn(num_tokens, dim, generator=g).to(dtype=dtype, device="cuda")
    static_qsl = torch.tensor([0, 4, 8, 12, 16, 16, 16, 16, 16], dtype=torch.int32, device="cuda")
    static_idx = torch.tensor([0, 1, 2, 3] + [PAD_SLOT_ID] * 4, dtype=torch.int32, device="cuda")
    static_acc = torch.ones(batch, dtype=torch.int32, device="cuda")

    def step(warmup):
        p = pool.clone() if warmup else pool
        return causal_conv1d_update(
            static_x,
            p,
            weight,
            bias,
            "silu",
            static_idx,
            static_acc,
            static_qsl,
            max_query_len=max_len,
        )

    graph, static_out = _capture(step)
    replays = [
        ([4, 4, 4, 4, 0, 0, 0, 0], [5, 0, 7, PAD_SLOT_ID]),
        ([1, 3, 4, 2, 4, 2, 0, 0], [9, 2, 11, 4, 0, PAD_SLOT_ID]),
        ([2, 1, 1, 4, 4, 4, 0, 0], [1, 3, PAD_SLOT_ID, 6, 8, 10]),
    ]
    for replay, (lens, lines) in enumerate(replays):
        lines = lines + [PAD_SLOT_ID] * (batch - len(lines))
        qsl = [0]
        for n in lens:
            qsl.append(qsl[-1] + n)
        static_qsl.copy_(torch.tensor(qsl, dtype=torch.int32))
        static_idx.copy_(torch.tensor(lines, dtype=torch.int32))
        static_acc.copy_(torch.tensor([1 + (b * 7 + replay) % max_len for b in range(batch)]))
        static_x.copy_(torch.randn(num_tokens, dim, generator=g).to(dtype))
        pool_before, ref_pool = pool.clone(), pool.clone()
        ref = causal_conv1d_update_ref(
            static_x, ref_pool, weight, bias, "silu", static_idx, static_acc, static_qsl
        )
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_no_nan(static_out)
        assert_close(static_out, ref)
        assert torch.equal(pool, ref_pool)
        for b, line in enumerate(lines):
            if line == PAD_SLOT_ID:
                assert not static_out[qsl[b] : qsl[b + 1]].any(), f"replay {replay}: pad row {b}"
        used = {line for line in lines if line != PAD_SLOT_ID}
        for line in range(num_lines):
            if line not in used:
                assert torch.equal(pool[line], pool_before[line]), f"replay {replay}: line {line}"


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
