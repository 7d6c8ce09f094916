"""causal_conv1d_fn (prefill, chunked prefill and decode in one launch) vs the fp32 reference,
the kernels under the interpreter, and the step metadata (compute_causal_conv1d_metadata).

On a CPU box the kernels run under the Triton interpreter (see tests/conftest.py);
keep cases small there. bf16 cases carry the gpu mark (bf16 arithmetic is wrong in
the interpreter). The batch invariants are in test_causal_conv1d_invariants.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from vllm.model_executor.layers.mamba.ops import causal_conv1d as ops
from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
    causal_conv1d_fn,
    causal_conv1d_ref,
    compute_causal_conv1d_metadata,
)

from .conv_cases import FnCase, build_fn_inputs, check_fn_against_ref
from .conv_utils import (
    assert_close,
    gen_for,
    make_bias,
    make_pool,
    make_weight,
    make_x,
    qsl_from_lens,
)

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
gpu = pytest.mark.gpu


def _case(*args, marks=(), **kwargs):
    c = FnCase(*args, **kwargs)
    return pytest.param(c, id=c.id, marks=marks)


FN_CASES = [
    # every width, fp32, with short sequences and a padded row
    *[
        _case((5, 1, 12, max(w - 2, 1)), 64, w, FP32, pads=(1,) if w % 2 else ())
        for w in range(2, 9)
    ],
    # fp16, a long sequence crossing token tiles, padding
    _case((100, 3, 145, 1), 64, 4, FP16, pads=(1,)),
    _case((9, 2, 30), 64, 5, FP16),
    # tile tails in the feature dimension (few tokens: the interpreter is slow)
    _case((2, 3, 1), 2064, 4, FP16, pads=(2,)),
    _case((3, 1), 4128, 3, FP32),
    _case((4, 2), 2064, 5, FP32, noncontig=True),
    # state dtype differs from x
    _case((7, 2, 1), 64, 4, FP16, state_dtype=FP32),
    _case((3, 9, 1), 64, 6, FP32, state_dtype=FP16),
    # sequences shorter than the state, with and without history
    _case((1, 2, 3, 6), 64, 8, FP32, init="all"),
    _case((1, 4, 2, 1), 64, 6, FP16, init=(True, False, True, False)),
    # zero-length sequences: with history the line is kept, without it is zeroed
    _case((4, 0, 3, 0, 2), 64, 4, FP32, init=(True, True, False, False, True)),
    # state_len > W-1: the columns past W-1 stay as they are
    _case((5, 2, 1), 64, 4, FP32, state_len=7),
    _case((1, 6), 64, 3, FP16, state_len=5, pads=(0,)),
    # non-contiguous x, no bias, other activations, default indices / flags
    _case((6, 11), 64, 4, FP16, noncontig=True, pads=(1,)),
    _case((5, 3), 64, 3, FP32, bias=False, activation=None),
    _case((2, 7), 64, 7, FP16, activation="swish"),
    _case((3, 5), 64, 4, FP32, default_indices=True, init="default"),
    _case((3, 5), 64, 4, FP32, default_indices=True, init="all"),
    # many short sequences: sequence starts at every offset around the token-tile edges
    _case(tuple(i % 9 + 1 for i in range(40)), 64, 8, FP32, pads=(5, 17)),
    _case(tuple(i % 9 + 1 for i in range(40)), 64, 4, FP16, state_dtype=FP32, pads=(30,)),
    _case(tuple(i % 7 + 1 for i in range(24)), 2064, 5, FP32, init="all"),
    # a decode-only batch wider than a tile's sequence block
    _case((1,) * 40, 64, 4, FP32, pads=(0, 21, 39)),
    # decodes grouped with empty, short and long sequences (the head programs take
    # several sequences, one-token ones together), pads among them
    _case((1, 1, 0, 1, 70, 1, 1, 1, 1, 2, 1), 64, 4, FP32, pads=(1, 6)),
    _case((1, 3, 1, 1, 1, 0, 1), 64, 3, FP16, state_dtype=FP32, pads=(3,), init="all"),
    # empty sequences first and last, and a step with no tokens at all
    _case((0, 5, 0, 3, 0), 64, 4, FP32, init=(False, True, True, False, True)),
    _case((0, 0), 64, 3, FP32, init=(True, False)),
    # bf16 and larger cases: GPU only
    _case((100, 3, 145, 1), 64, 4, BF16, pads=(1,), marks=gpu),
    _case((33, 1, 1, 517), 2064, 5, BF16, state_dtype=FP32, marks=gpu),
    _case((257, 64, 1, 2), 4128, 8, BF16, noncontig=True, pads=(2,), marks=gpu),
    _case((300, 1, 2), 4128, 2, FP16, state_len=9, marks=gpu),
]


@pytest.mark.parametrize("case", FN_CASES)
def test_fn_vs_ref(case: FnCase, device, nan_poison):
    inp = build_fn_inputs(case, device)
    x_before, pool_before = inp.x.clone(), inp.pool.clone()
    ref_pool = inp.pool.clone()
    ref_out = causal_conv1d_ref(
        inp.x, inp.weight, inp.bias, ref_pool, inp.qsl, inp.indices, inp.init, case.activation
    )
    out = causal_conv1d_fn(
        inp.x,
        inp.weight,
        inp.bias,
        inp.pool,
        inp.qsl,
        cache_indices=inp.indices,
        has_initial_state=inp.init,
        activation=case.activation,
    )
    assert torch.equal(inp.x, x_before), "x was modified"
    check_fn_against_ref(case, inp, out, pool_before, ref_out, ref_pool)


@pytest.mark.parametrize("activation", [True, False])
def test_fn_bool_activation(activation, device, nan_poison):
    case = FnCase((4, 1, 6), 64, 4, FP32)
    inp = build_fn_inputs(case, device)
    ref_pool = inp.pool.clone()
    ref_out = causal_conv1d_ref(
        inp.x, inp.weight, inp.bias, ref_pool, inp.qsl, inp.indices, inp.init, activation
    )
    out = causal_conv1d_fn(
        inp.x, inp.weight, inp.bias, inp.pool, inp.qsl, inp.indices, inp.init, activation
    )
    assert_close(out, ref_out)
    assert torch.equal(inp.pool, ref_pool)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is only used without a GPU")
def test_cpu_runs_kernels_under_interpreter():
    """CPU CI must exercise the Triton kernels, not only the torch reference."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for name in ("_causal_conv1d_fwd_kernel", "_causal_conv1d_update_kernel"):
        kernel = getattr(ops, name)
        # unwrap autotuner / heuristics wrappers down to the jitted function
        while type(kernel).__name__ not in ("InterpretedFunction", "JITFunction") and hasattr(
            kernel, "fn"
        ):
            kernel = kernel.fn
        assert type(kernel).__name__ == "InterpretedFunction", (name, type(kernel))


def test_cpu_tensors_take_the_reference_when_kernels_are_compiled(monkeypatch):
    """TRITON_INTERPRET=1 set after the kernels were compiled for a GPU (a CPU run inside
    a process that imported them for CUDA, as the GPU box's test run does): CPU tensors
    must go to the reference, not to a compiled kernel, which cannot read them."""
    from vllm.model_executor.layers.mamba.ops import mamba_ssm_triton

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(ops._LAUNCH_FWD, "direct", True)  # as if compiled for a GPU
    monkeypatch.setattr(mamba_ssm_triton._LAUNCH, "direct", True)
    x = torch.zeros(8, 3)
    assert not ops._use_kernel(x)
    assert not mamba_ssm_triton.use_ssm_kernel(x)
    g = gen_for("compiled-kernels", 0)
    seqlens = (3, 2)
    qsl = qsl_from_lens(seqlens, "cpu")
    x = make_x(8, 5, FP32, "cpu", g)
    weight, bias = make_weight(8, 4, FP32, "cpu", g), make_bias(8, FP32, "cpu", g)
    pool = make_pool(3, 8, 3, FP32, "cpu", g)
    ref_pool = pool.clone()
    ref = causal_conv1d_ref(x, weight, bias, ref_pool, qsl, None, None)
    out = causal_conv1d_fn(x, weight, bias, pool, qsl, None, None)
    assert torch.equal(out, ref)
    assert torch.equal(pool, ref_pool)


# --- metadata ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "seqlens", [(3, 0, 7, 1), (1,), (0, 5), (4, 4, 0)], ids=lambda s: "lens" + "-".join(map(str, s))
)
def test_metadata_fields(seqlens, device):
    qsl_cpu = qsl_from_lens(seqlens, "cpu")
    meta = compute_causal_conv1d_metadata(qsl_cpu, device)
    num_tokens, batch = sum(seqlens), len(seqlens)
    assert meta.num_tokens == num_tokens
    assert meta.batch_size == batch
    assert meta.max_query_len == max(seqlens)
    assert torch.equal(meta.query_start_loc.cpu(), qsl_cpu)
    assert meta.query_start_loc.dtype == torch.int32
    assert meta.query_start_loc.device.type == torch.device(device).type
    # tile_seq[p]: the sequence holding token p * block_t (the last start at or before it)
    starts = qsl_cpu[:-1].tolist()
    n_tiles = -(-num_tokens // meta.block_t)
    expected = [
        max(b for b, s in enumerate(starts) if s <= p * meta.block_t) for p in range(n_tiles)
    ]
    assert meta.block_t >= 4
    assert meta.tile_seq.dtype == torch.int32
    assert meta.tile_seq.cpu().tolist() == expected
    for p, b in enumerate(expected):
        assert starts[b] <= p * meta.block_t < starts[b] + seqlens[b]


def test_metadata_passed_equals_none(device, nan_poison):
    case = FnCase((5, 1, 0, 9, 2), 64, 5, FP32, pads=(3,))
    inp = build_fn_inputs(case, device)
    pool_none = inp.pool.clone()
    out_none = causal_conv1d_fn(
        inp.x, inp.weight, inp.bias, pool_none, inp.qsl, inp.indices, inp.init
    )
    meta = compute_causal_conv1d_metadata(inp.qsl.cpu(), device)
    out_meta = causal_conv1d_fn(
        inp.x, inp.weight, inp.bias, inp.pool, inp.qsl, inp.indices, inp.init, metadata=meta
    )
    assert torch.equal(out_meta, out_none)
    assert torch.equal(inp.pool, pool_none)


def test_metadata_reused_by_layers(device, nan_poison):
    """The layers build the metadata once per step and pass it to every layer."""
    seqlens = (6, 1, 3)
    qsl = qsl_from_lens(seqlens, device)
    meta = compute_causal_conv1d_metadata(qsl.cpu(), device)
    for layer, (w, dtype) in enumerate([(4, FP32), (4, FP16), (3, FP32)]):
        g = gen_for("layer", layer)
        x = make_x(64, sum(seqlens), dtype, device, g)
        weight, bias = make_weight(64, w, dtype, device, g), make_bias(64, dtype, device, g)
        pool = make_pool(5, 64, w - 1, dtype, device, g)
        indices = torch.tensor([4, 0, 2], dtype=torch.int32, device=device)
        init = torch.tensor([False, True, True], device=device)
        ref_pool = pool.clone()
        ref = causal_conv1d_ref(x, weight, bias, ref_pool, qsl, indices, init)
        out = causal_conv1d_fn(x, weight, bias, pool, qsl, indices, init, metadata=meta)
        assert_close(out, ref)
        assert torch.equal(pool, ref_pool)


def test_corrupted_tile_seq_changes_result(device, nan_poison):
    """Proves the kernel reads the metadata: a wrong tile->sequence map gives a wrong result.

    Every tile is mapped to the last sequence, which is in range, so the corrupted run
    reads no memory out of bounds, but the long first sequence's tiles are computed as
    if they belonged to another sequence.
    """
    case = FnCase((150, 5, 7), 64, 4, FP32, init="all")
    inp = build_fn_inputs(case, device)
    pool_good = inp.pool.clone()
    meta = compute_causal_conv1d_metadata(inp.qsl.cpu(), device)
    good = causal_conv1d_fn(
        inp.x, inp.weight, inp.bias, pool_good, inp.qsl, inp.indices, inp.init, metadata=meta
    )
    assert meta.tile_seq.numel() >= 2
    meta.tile_seq[:] = len(case.seqlens) - 1
    bad = causal_conv1d_fn(
        inp.x, inp.weight, inp.bias, inp.pool, inp.qsl, inp.indices, inp.init, metadata=meta
    )
    same_out = torch.allclose(bad, good, equal_nan=False)
    same_pool = torch.equal(inp.pool, pool_good)
    assert not (same_out and same_pool), "corrupting metadata.tile_seq changed nothing"
