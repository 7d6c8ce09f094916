"""The CUDA causal-conv1d pathway's update op (one-token decodes) vs the fp32 reference, a
prefill then updates vs one prefill, and the CUDA ops vs the Triton ops on one mixed batch.

Each state pool in its own layout (width-contiguous for CUDA, feature-contiguous for
Triton): outputs within the dtype's tolerance, states equal. Everything needs the built
ops and a GPU (mark gpu).
"""

from __future__ import annotations

import pytest
import torch

from vllm._custom_ops import causal_conv1d_fwd_cuda, causal_conv1d_update_cuda
from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
    PAD_SLOT_ID,
    causal_conv1d_fn,
    causal_conv1d_ref,
    causal_conv1d_update,
    causal_conv1d_update_ref,
    compute_causal_conv1d_metadata,
)

from .conv_cases import UpdCase, build_update_inputs
from .conv_cuda_utils import silu_flag, width_major
from .conv_utils import (
    DTYPE_NAMES,
    assert_close,
    assert_no_nan,
    gen_for,
    make_bias,
    make_pool,
    make_weight,
    qsl_from_lens,
    randn,
)

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPES = (FP32, FP16, BF16)
gpu = pytest.mark.gpu


# --- update vs the reference -------------------------------------------------------------


def run_update_case(case: UpdCase, device) -> None:
    inp = build_update_inputs(case, device)
    pool = width_major(inp.pool)
    pool_before, ref_pool = pool.clone(), inp.pool.clone()
    ref = causal_conv1d_update_ref(
        inp.x, ref_pool, inp.weight, inp.bias, case.activation, inp.indices, pad_slot_id=PAD_SLOT_ID
    )
    x_before = inp.x.clone()
    out = causal_conv1d_update_cuda(
        inp.x, pool, inp.weight, inp.bias, silu_flag(case.activation), inp.indices, PAD_SLOT_ID
    )
    assert torch.equal(inp.x, x_before), "x was modified"
    assert out.shape == inp.x.shape and out.dtype == inp.x.dtype and out.stride(1) == 1
    assert_no_nan(out)
    assert_close(out, ref)
    for b in case.pads:
        assert not out[b].any(), f"pad row {b} not zero"
    assert torch.equal(pool, ref_pool), "states differ from the reference"
    used = {line for line in inp.lines if line != PAD_SLOT_ID}
    for line in range(pool.shape[0]):
        if line not in used:
            assert torch.equal(pool[line], pool_before[line]), f"untouched line {line} changed"


def _update_widths_dtypes():
    dims = (64, 2064, 4128)
    return [
        UpdCase("tok", (1,) * 5, dims[i % 3], w, d, pads=(1,) if i % 2 else (3,))
        for i, (w, d) in enumerate((w, d) for w in range(2, 9) for d in DTYPES)
    ]


UPDATE_CASES = [
    *_update_widths_dtypes(),
    UpdCase("tok", (1,) * 6, 100, 4, BF16, pads=(2,)),  # element-wise path
    UpdCase("tok", (1,) * 6, 102, 3, FP32),
    UpdCase("tok", (1,) * 4, 2064, 4, BF16, noncontig=True, pads=(0,)),  # misaligned rows
    UpdCase("tok", (1,) * 4, 64, 4, FP16, state_len=6),  # lines not packed
    UpdCase("tok", (1,) * 3, 64, 5, FP32, default_indices=True),
    UpdCase("tok", (1,) * 3, 2064, 4, BF16, bias=False, activation=None),
    UpdCase("tok", (1,) * 300, 8448, 4, BF16, pads=(7, 100, 299), extra_lines=724),
]


@gpu
@pytest.mark.parametrize("case", UPDATE_CASES, ids=lambda c: c.id)
def test_update_vs_ref(case, device, nan_poison):
    run_update_case(case, device)


@gpu
@pytest.mark.parametrize("width,dtype", [(4, BF16), (2, FP32), (8, FP16)], ids=str)
def test_prefill_then_updates_equal_one_prefill(width, dtype, device, nan_poison):
    """A prefill of k tokens then one-token updates gives the outputs and the state of
    one prefill over all the tokens."""
    g = gen_for("cuda-chain", width, dtype)
    dim, k, n_upd = 2064, 19, 6
    x = randn((k + n_upd, dim), g, dtype, device).t()
    weight, bias = make_weight(dim, width, dtype, device, g), make_bias(dim, dtype, device, g)
    pool = width_major(make_pool(3, dim, width - 1, dtype, device, g))
    one_pool = pool.clone()
    idx = torch.tensor([2], dtype=torch.int32, device=device)
    init = torch.tensor([True], device=device)
    whole = causal_conv1d_fwd_cuda(
        x, weight, bias, one_pool, qsl_from_lens([k + n_upd], device), idx, init, True, PAD_SLOT_ID
    )
    first = causal_conv1d_fwd_cuda(
        x[:, :k], weight, bias, pool, qsl_from_lens([k], device), idx, init, True, PAD_SLOT_ID
    )
    torch.testing.assert_close(first, whole[:, :k], rtol=0, atol=0)
    for t in range(k, k + n_upd):
        step = causal_conv1d_update_cuda(
            x[:, t : t + 1].t(), pool, weight, bias, True, idx, PAD_SLOT_ID
        )
        assert_close(step[0], whole[:, t], msg=f"token {t}")
    assert torch.equal(pool, one_pool)


# --- CUDA vs Triton on the same mixed batch ----------------------------------------------


def _mixed_batch(dim, width, dtype, device, key):
    """Prefills (with and without history, one shorter than the state), then one-token
    decodes with history, padded rows among both; a pool with spare lines."""
    g = gen_for("mixed", key)
    prefill_lens = [300, 45, max(width - 2, 1), 17]
    prefill_init = [True, False, True, False]
    n_dec = 20
    lens = prefill_lens + [1] * n_dec
    batch, num_lines = len(lens), len(lens) + 9
    x = randn((sum(lens), dim), g, dtype, device).t()
    weight, bias = make_weight(dim, width, dtype, device, g), make_bias(dim, dtype, device, g)
    pool = make_pool(num_lines, dim, width - 1, dtype, device, g)  # Triton's layout
    lines = torch.randperm(num_lines, generator=g)[:batch]
    lines[[1, len(prefill_lens) + 3, batch - 1]] = PAD_SLOT_ID
    idx = lines.to(dtype=torch.int32, device=device)
    init = torch.tensor(prefill_init + [True] * n_dec, device=device)
    return x, weight, bias, pool, lens, idx, init, len(prefill_lens)


@gpu
@pytest.mark.parametrize(
    "dim,width,dtype",
    [(8448, 4, BF16), (2064, 2, FP16), (4128, 8, BF16), (64, 5, FP32), (100, 4, FP16)],
    ids=lambda v: DTYPE_NAMES.get(v, str(v)),
)
def test_cuda_split_agrees_with_triton_one_call(dim, width, dtype, device, nan_poison):
    x, weight, bias, pool, lens, idx, init, n_pre = _mixed_batch(
        dim, width, dtype, device, (dim, width, dtype)
    )
    qsl = qsl_from_lens(lens, device)
    n_pre_tok = sum(lens[:n_pre])

    # Triton: the whole step in one call, pool feature-contiguous.
    tri_pool = pool.clone()
    meta = compute_causal_conv1d_metadata(qsl.cpu(), device)
    tri_out = causal_conv1d_fn(
        x, weight, bias, tri_pool, qsl, idx, init, "silu", metadata=meta, pad_slot_id=PAD_SLOT_ID
    )

    # CUDA: prefills through the forward op, decodes through the update op, one output.
    cuda_pool = width_major(pool)
    out = torch.empty(x.shape[1], dim, dtype=dtype, device=device).t()
    causal_conv1d_fwd_cuda(
        x[:, :n_pre_tok],
        weight,
        bias,
        cuda_pool,
        qsl[: n_pre + 1],
        idx[:n_pre],
        init[:n_pre],
        True,
        PAD_SLOT_ID,
        out=out[:, :n_pre_tok],
    )
    causal_conv1d_update_cuda(
        x[:, n_pre_tok:].t(),
        cuda_pool,
        weight,
        bias,
        True,
        idx[n_pre:],
        PAD_SLOT_ID,
        out=out[:, n_pre_tok:].t(),
    )

    # CUDA forward alone over the whole step (decodes are one-token sequences to it).
    one_pool = width_major(pool)
    one_out = causal_conv1d_fwd_cuda(x, weight, bias, one_pool, qsl, idx, init, True, PAD_SLOT_ID)

    ref_pool = pool.clone()
    ref = causal_conv1d_ref(x, weight, bias, ref_pool, qsl, idx, init, pad_slot_id=PAD_SLOT_ID)
    for name, got in (("triton", tri_out), ("cuda split", out), ("cuda fwd", one_out)):
        assert_no_nan(got)
        assert_close(got, ref, msg=name)
    assert_close(out, tri_out, msg="cuda split vs triton")
    # The same states, each pool in its own layout (compared as logical tensors).
    assert tri_pool.stride(1) == 1 and cuda_pool.stride(2) == 1
    assert torch.equal(cuda_pool, tri_pool)
    assert torch.equal(one_pool, tri_pool)
    assert torch.equal(tri_pool, ref_pool)
    # Decodes through the Triton update op agree as well.
    dec_pool = pool.clone()
    causal_conv1d_fn(
        x[:, :n_pre_tok],
        weight,
        bias,
        dec_pool,
        qsl[: n_pre + 1],
        idx[:n_pre],
        init[:n_pre],
        "silu",
        pad_slot_id=PAD_SLOT_ID,
    )
    tri_dec = causal_conv1d_update(
        x[:, n_pre_tok:].t(), dec_pool, weight, bias, "silu", idx[n_pre:], pad_slot_id=PAD_SLOT_ID
    )
    assert_close(out[:, n_pre_tok:].t(), tri_dec, msg="cuda update vs triton update")
    assert torch.equal(dec_pool, cuda_pool)
