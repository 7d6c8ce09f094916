"""causal_conv1d_fn invariants: the same tokens give the same outputs and states however
they are batched: a varlen batch vs per-sequence runs, a prefill then causal_conv1d_update
decodes vs one prefill, a chunked prefill vs one prefill, and prefills, continuations,
decodes and padded rows in one call vs per-sequence runs.

On a CPU box the kernels run under the Triton interpreter (see tests/conftest.py);
bf16 cases carry the gpu mark (bf16 arithmetic is wrong in the interpreter).
"""

from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
    PAD_SLOT_ID,
    causal_conv1d_fn,
    causal_conv1d_ref,
    causal_conv1d_update,
)

from .conv_utils import (
    assert_close,
    assert_no_nan,
    gen_for,
    i32,
    make_bias,
    make_pool,
    make_weight,
    make_x,
    qsl_from_lens,
)
from .conv_utils import flags as has_init

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
gpu = pytest.mark.gpu


# --- invariants -------------------------------------------------------------------------

INVARIANT_PARAMS = [
    pytest.param(4, FP32, id="W4_fp32"),
    pytest.param(5, FP16, id="W5_fp16"),
    pytest.param(8, FP32, id="W8_fp32"),
    pytest.param(4, BF16, id="W4_bf16", marks=gpu),
]


def _setup(key, dim, width, dtype, num_tokens, num_lines, device):
    g = gen_for(*key)
    x = make_x(dim, num_tokens, dtype, device, g)
    weight = make_weight(dim, width, dtype, device, g)
    bias = make_bias(dim, dtype, device, g)
    pool = make_pool(num_lines, dim, width - 1, dtype, device, g)
    return g, x, weight, bias, pool


@pytest.mark.parametrize("width,dtype", INVARIANT_PARAMS)
def test_varlen_batch_equals_per_sequence_runs(width, dtype, device, nan_poison):
    seqlens, lines = (7, 1, 3, 12, 2), [5, 0, 3, 1, 6]
    init = [True, True, False, True, False]
    _, x, weight, bias, pool = _setup(
        ("varlen", width, dtype), 64, width, dtype, sum(seqlens), 8, device
    )
    qsl = qsl_from_lens(seqlens, device)
    pool_seq = pool.clone()
    out = causal_conv1d_fn(x, weight, bias, pool, qsl, i32(lines, device), has_init(init, device))
    starts = qsl.tolist()
    for b, n in enumerate(seqlens):
        xb = x[:, starts[b] : starts[b] + n]
        ob = causal_conv1d_fn(
            xb,
            weight,
            bias,
            pool_seq,
            i32([0, n], device),
            i32([lines[b]], device),
            has_init([init[b]], device),
        )
        assert_close(out[:, starts[b] : starts[b] + n], ob, msg=f"sequence {b}")
    assert torch.equal(pool, pool_seq)


@pytest.mark.parametrize("width,dtype", INVARIANT_PARAMS)
def test_prefill_then_decode_equals_full_prefill(width, dtype, device, nan_poison):
    """A prefill of k tokens then one-token causal_conv1d_update calls == one prefill."""
    total, prefill = 9, [1, 4, 9, 6]  # tokens per sequence, of them prefilled
    lines, init = [2, 0, 5, 3], [False, True, True, False]
    batch = len(lines)
    _, x, weight, bias, pool = _setup(
        ("decode", width, dtype), 64, width, dtype, batch * total, 6, device
    )
    qsl = qsl_from_lens([total] * batch, device)
    pool_full = pool.clone()
    full = causal_conv1d_fn(
        x, weight, bias, pool_full, qsl, i32(lines, device), has_init(init, device)
    )

    xs = [x[:, b * total : (b + 1) * total] for b in range(batch)]
    pre_x = torch.cat([xs[b][:, : prefill[b]].t() for b in range(batch)]).t()
    pre_out = causal_conv1d_fn(
        pre_x,
        weight,
        bias,
        pool,
        qsl_from_lens(prefill, device),
        i32(lines, device),
        has_init(init, device),
    )
    outs = [[pre_out[:, sum(prefill[:b]) : sum(prefill[: b + 1])]] for b in range(batch)]
    for t in range(min(prefill), total):
        active = [b for b in range(batch) if prefill[b] <= t]
        xt = torch.stack([xs[b][:, t] for b in active])  # (n, dim)
        ot = causal_conv1d_update(
            xt,
            pool,
            weight,
            bias,
            activation="silu",
            conv_state_indices=i32([lines[b] for b in active], device),
        )
        assert ot.shape == xt.shape and ot.stride(1) == 1
        for i, b in enumerate(active):
            outs[b].append(ot[i, :, None])
    for b in range(batch):
        assert_close(
            torch.cat(outs[b], dim=1), full[:, b * total : (b + 1) * total], msg=f"seq {b}"
        )
    assert torch.equal(pool, pool_full)


@pytest.mark.parametrize("width,dtype", INVARIANT_PARAMS)
def test_chunked_prefill_equals_full_prefill(width, dtype, device, nan_poison):
    """Chunks over several calls, has_initial_state=True after the first == one prefill."""
    chunks = [[5, 1, 7, 2], [2, 5], [1, 1, 1, 1, 1, 1], [9]]
    lines, init = [1, 4, 0, 2], [False, True, False, True]
    seqlens = [sum(c) for c in chunks]
    _, x, weight, bias, pool = _setup(
        ("chunked", width, dtype), 64, width, dtype, sum(seqlens), 5, device
    )
    qsl = qsl_from_lens(seqlens, device).tolist()
    pool_full = pool.clone()
    full = causal_conv1d_fn(
        x,
        weight,
        bias,
        pool_full,
        qsl_from_lens(seqlens, device),
        i32(lines, device),
        has_init(init, device),
    )
    outs = [[] for _ in chunks]
    done = [0] * len(chunks)
    for step in range(max(len(c) for c in chunks)):
        active = [b for b in range(len(chunks)) if step < len(chunks[b])]
        lens = [chunks[b][step] for b in active]
        xc = torch.cat(
            [
                x[:, qsl[b] + done[b] : qsl[b] + done[b] + n].t()
                for b, n in zip(active, lens, strict=True)
            ]
        ).t()
        flags = [init[b] if step == 0 else True for b in active]
        oc = causal_conv1d_fn(
            xc,
            weight,
            bias,
            pool,
            qsl_from_lens(lens, device),
            i32([lines[b] for b in active], device),
            has_init(flags, device),
        )
        o = 0
        for b, n in zip(active, lens, strict=True):
            outs[b].append(oc[:, o : o + n])
            o += n
            done[b] += n
    for b in range(len(chunks)):
        assert_close(torch.cat(outs[b], dim=1), full[:, qsl[b] : qsl[b + 1]], msg=f"seq {b}")
    assert torch.equal(pool, pool_full)


@pytest.mark.parametrize("width,dtype", INVARIANT_PARAMS)
def test_mixed_batch_one_call_equals_per_sequence(width, dtype, device, nan_poison):
    """Prefills, continuations, decodes and padded rows in ONE call == per-sequence runs."""
    # (tokens, has_initial_state, cache line) ; line PAD_SLOT_ID = padded row
    seqs = [
        (11, False, 3),  # fresh prefill
        (1, True, 0),  # decode
        (5, True, 6),  # chunked-prefill continuation
        (3, False, PAD_SLOT_ID),  # padded row
        (1, True, 2),  # decode
        (2, True, 5),  # continuation shorter than the state (for W > 3)
        (1, False, PAD_SLOT_ID),  # padded decode row
        (1, True, 7),  # decode
    ]
    seqlens = [s[0] for s in seqs]
    _, x, weight, bias, pool = _setup(
        ("mixed", width, dtype), 64, width, dtype, sum(seqlens), 9, device
    )
    pool_before, pool_seq, pool_ref = pool.clone(), pool.clone(), pool.clone()
    qsl = qsl_from_lens(seqlens, device)
    lines = i32([s[2] for s in seqs], device)
    init = has_init([s[1] for s in seqs], device)
    out = causal_conv1d_fn(x, weight, bias, pool, qsl, lines, init)
    ref = causal_conv1d_ref(x, weight, bias, pool_ref, qsl, lines, init)
    assert_no_nan(out)
    assert_close(out, ref)
    assert torch.equal(pool, pool_ref)
    starts = qsl.tolist()
    for b, (n, flag, line) in enumerate(seqs):
        ob = causal_conv1d_fn(
            x[:, starts[b] : starts[b] + n],
            weight,
            bias,
            pool_seq,
            i32([0, n], device),
            i32([line], device),
            has_init([flag], device),
        )
        assert_close(out[:, starts[b] : starts[b] + n], ob, msg=f"sequence {b}")
        if line == PAD_SLOT_ID:
            assert not out[:, starts[b] : starts[b] + n].any()
    assert torch.equal(pool, pool_seq)
    for line in (1, 4, 8):  # lines no sequence uses
        assert torch.equal(pool[line], pool_before[line])
