"""The ops under torch.compile: traced without a graph break, results equal to eager.

``fullgraph=True`` turns any graph break in the ops' host code (validation, the
padded-row marker, caches) into an error. ``aot_eager`` runs AOTAutograd's
functionalization of the in-place state update, so the registered ops' schemas, fake
implementations and ``mutates_args`` are all on the path; the kernels themselves run
as in eager mode (under the interpreter on a CPU box).
"""

from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
    PAD_SLOT_ID,
    causal_conv1d_fn,
    causal_conv1d_update,
    compute_causal_conv1d_metadata,
)

from .conv_utils import gen_for, make_bias, make_pool, make_weight, make_x, qsl_from_lens, randn

FP32 = torch.float32
DIM, WIDTH = 32, 4


def _i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def _pool(layout, lines, state_len, device, g):
    if layout == "feat":
        return make_pool(lines, DIM, state_len, FP32, device, g)
    return randn((lines, DIM, state_len), g, FP32, device)  # upstream's CUDA layout


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("layout", ["feat", "wcontig"])
@pytest.mark.parametrize("with_meta", [False, True], ids=["nometa", "meta"])
def test_fn_compiles_fullgraph(layout, with_meta, device):
    g = gen_for("compile-fn", layout, with_meta)
    seqlens = (5, 1, 3)
    x = make_x(DIM, sum(seqlens), FP32, device, g, noncontig=True)
    weight, bias = make_weight(DIM, WIDTH, FP32, device, g), make_bias(DIM, FP32, device, g)
    pool = _pool(layout, 6, WIDTH - 1, device, g)
    qsl = qsl_from_lens(seqlens, device)
    idx = _i32([4, PAD_SLOT_ID, 2, 5, 0], device)  # padded past the batch
    init = torch.tensor([True, False, True], device=device)
    meta = compute_causal_conv1d_metadata(qsl.cpu(), device) if with_meta else None

    def step(x, pool, qsl, idx, init):
        out = causal_conv1d_fn(x, weight, bias, pool, qsl, idx, init, metadata=meta)
        return out * 2.0

    eager_pool = pool.clone()
    eager = step(x, eager_pool, qsl, idx, init)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    out = compiled(x, pool, qsl, idx, init)
    assert torch.equal(out, eager)
    assert torch.equal(pool, eager_pool), "the compiled call did not update the pool in place"


@pytest.mark.parametrize("layout", ["feat", "wcontig"])
@pytest.mark.parametrize("marker", ["pad_slot_id", "null_block_id"])
def test_update_compiles_fullgraph(layout, marker, device):
    g = gen_for("compile-update", layout, marker)
    pad = PAD_SLOT_ID if marker == "pad_slot_id" else 0
    x = randn((4, DIM), g, FP32, device)
    weight, bias = make_weight(DIM, WIDTH, FP32, device, g), make_bias(DIM, FP32, device, g)
    pool = _pool(layout, 7, WIDTH - 1, device, g)
    idx = _i32([3, pad, 1, 6, 2, 2], device)  # padded past the batch

    def step(x, pool, idx):
        return causal_conv1d_update(x, pool, weight, bias, "silu", idx, **{marker: pad}) + 1.0

    eager_pool = pool.clone()
    eager = step(x, eager_pool, idx)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    out = compiled(x, pool, idx)
    assert torch.equal(out, eager)
    assert torch.equal(pool, eager_pool), "the compiled call did not update the pool in place"
    # a second call with new data reuses the compiled graph and still updates in place
    x2 = randn((4, DIM), g, FP32, device)
    eager2 = step(x2, eager_pool, idx)
    assert torch.equal(compiled(x2, pool, idx), eager2)
    assert torch.equal(pool, eager_pool)


def test_compiled_validation_still_raises(device):
    """A bad argument is still a ValueError under torch.compile (dynamo re-raises it)."""
    g = gen_for("compile-bad")
    x = randn((3, DIM), g, FP32, device)
    weight, bias = make_weight(DIM, WIDTH, FP32, device, g), make_bias(DIM, FP32, device, g)
    pool = make_pool(5, DIM, WIDTH - 1, FP32, device, g)
    idx = _i32([3, 0], device)  # shorter than the batch

    def step(x, pool, idx):
        return causal_conv1d_update(x, pool, weight, bias, "silu", idx)

    with pytest.raises(ValueError, match="conv_state_indices"):
        torch.compile(step, backend="aot_eager")(x, pool, idx)
