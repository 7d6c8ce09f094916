"""Upstream callers' conventions: conv states of any strides (and opcheck, CUDA graphs on them).

Upstream vLLM's conv ops accept a state pool of any layout (its CUDA layout is
(lines, dim, width - 1) contiguous). Each case here runs the op on such a pool and
demands:

- outputs equal to the fp32 reference (the tolerance table) and bit-identical to the
  same call on a feature-contiguous pool (the layout never changes the arithmetic);
- the state pool equal to the reference's, and every byte of the pool's storage that
  the call should not write (other lines, columns past the window, memory around a
  sliced view) bit-identical to before.

Padded index arrays and null_block_id are in test_causal_conv1d_compat_padding.py.
"""

from __future__ import annotations

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

from .conv_compat_cases import (
    FN_INIT,
    FN_PAD,
    FN_SEQLENS,
    NULL,
    OTHER_LAYOUTS,
    UPD_MODES,
    expected_base,
    feat_copy,
    fn_inputs,
    make_layout_pool,
    padded,
    update_inputs,
)
from .conv_utils import (
    DTYPE_NAMES,
    assert_close,
    assert_no_nan,
    flags,
    gen_for,
    i32,
    make_bias,
    make_weight,
    qsl_from_lens,
    randn,
)

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
gpu = pytest.mark.gpu
WIDTHS = range(2, 9)


def _layout_params(dtypes_cpu=(FP32, FP16)):
    """Every width in the CUDA layout, the other layouts at a few widths; bf16 on the GPU."""
    out = []
    for dtype in (*dtypes_cpu, BF16):
        marks = (gpu,) if dtype == BF16 else ()
        for w in WIDTHS:
            out.append(pytest.param("wcontig", w, dtype, marks=marks, id=f"wcontig_W{w}_"
                                    f"{DTYPE_NAMES[dtype]}"))  # fmt: skip
        for layout in OTHER_LAYOUTS:
            for w in (2, 4, 5, 8):
                if dtype == FP16 and w != 4:
                    continue
                out.append(pytest.param(layout, w, dtype, marks=marks,
                                        id=f"{layout}_W{w}_{DTYPE_NAMES[dtype]}"))  # fmt: skip
    return out


# --- causal_conv1d_fn: any layout --------------------------------------------------------


@pytest.mark.parametrize("layout,width,dtype", _layout_params())
@pytest.mark.parametrize("with_meta", [False, True], ids=["nometa", "meta"])
def test_fn_any_state_layout(layout, width, dtype, with_meta, device, nan_poison):
    x, weight, bias, pool, base, lines = fn_inputs(
        (layout, width, dtype), width, dtype, device, layout
    )
    qsl = qsl_from_lens(FN_SEQLENS, device)
    idx, init = i32(lines, device), flags(FN_INIT, device)
    meta = compute_causal_conv1d_metadata(qsl.cpu(), device) if with_meta else None
    base_before = base.clone()
    ref_pool = pool.clone()
    ref = causal_conv1d_ref(x, weight, bias, ref_pool, qsl, idx, init)
    fast_pool = feat_copy(pool)
    fast = causal_conv1d_fn(x, weight, bias, fast_pool, qsl, idx, init, metadata=meta)

    out = causal_conv1d_fn(x, weight, bias, pool, qsl, idx, init, metadata=meta)

    assert_no_nan(out)
    assert_close(out, ref)
    assert torch.equal(out, fast), "the layout changed the arithmetic"
    assert torch.equal(pool, ref_pool), "states differ from the reference"
    assert torch.equal(base, expected_base(layout, base_before, ref_pool)), (
        "memory the call must not write changed (other lines, gaps around the view)"
    )
    start = sum(FN_SEQLENS[:FN_PAD])
    assert not out[:, start : start + FN_SEQLENS[FN_PAD]].any(), "padded row not zero"


# --- causal_conv1d_update: any layout ----------------------------------------------------


@pytest.mark.parametrize("layout,width,dtype", _layout_params())
@pytest.mark.parametrize("mode", UPD_MODES)
def test_update_any_state_layout(layout, width, dtype, mode, device, nan_poison):
    x, weight, bias, pool, base, lines, accepted, qsl = update_inputs(
        mode, (layout, width, dtype), width, dtype, device, layout
    )
    idx = i32(lines, device)
    base_before = base.clone()
    ref_pool = pool.clone()
    ref = causal_conv1d_update_ref(x, ref_pool, weight, bias, "silu", idx, accepted, qsl)
    kw = dict(num_accepted_tokens=accepted, query_start_loc=qsl, max_query_len=3)
    fast_pool = feat_copy(pool)
    fast = causal_conv1d_update(x, fast_pool, weight, bias, "silu", idx, **kw)

    out = causal_conv1d_update(x, pool, weight, bias, "silu", idx, **kw)

    assert_no_nan(out)
    assert_close(out, ref)
    assert torch.equal(out, fast), "the layout changed the arithmetic"
    assert torch.equal(pool, ref_pool), "states differ from the reference"
    assert torch.equal(base, expected_base(layout, base_before, ref_pool)), (
        "memory the call must not write changed (other lines, gaps around the view)"
    )


# --- torch.library.opcheck with a width-contiguous pool ----------------------------------

DEVICES = ["cpu", pytest.param("cuda", marks=gpu)]


@pytest.mark.parametrize("device_name", DEVICES)
def test_opcheck_fwd_width_contiguous_state(device_name):
    device = torch.device(device_name)
    x, weight, bias, pool, _, lines = fn_inputs(("opcheck",), 4, FP32, device, "wcontig")
    qsl = qsl_from_lens(FN_SEQLENS, device)
    meta = compute_causal_conv1d_metadata(qsl.cpu(), device)
    idx = padded(lines, [0, 1], device)  # padded index buffer
    init = flags(FN_INIT, device)
    args = (x, weight, bias, pool, qsl, idx, init, True, PAD_SLOT_ID, meta.tile_seq, meta.block_t)
    torch.library.opcheck(torch.ops.vllm.causal_conv1d_fwd.default, args)


@pytest.mark.parametrize("device_name", DEVICES)
@pytest.mark.parametrize("mode", UPD_MODES)
def test_opcheck_update_width_contiguous_state(device_name, mode):
    device = torch.device(device_name)
    x, weight, bias, pool, _, lines, accepted, qsl = update_inputs(
        mode, ("opcheck",), 4, FP32, device, "wcontig"
    )
    idx = padded(lines, [0], device)
    args = (x, pool, weight, bias, True, idx, accepted, qsl, 3, PAD_SLOT_ID)
    torch.library.opcheck(torch.ops.vllm.causal_conv1d_update.default, args)


# --- CUDA graphs with a width-contiguous pool ---------------------------------------------


def _capture(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(warmup=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(warmup=False)
    return graph, out


@gpu
@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("marker", ["pad_slot_id", "null_block_id"])
def test_cuda_graph_decode_width_contiguous_state(dtype, marker, nan_poison):
    """Capture a decode over upstream's CUDA-layout pool with a padded index buffer, then
    replay with new tokens, lines and padding: each replay equals the reference."""
    g = gen_for("compat-graph", dtype, marker)
    batch, dim, width, num_lines = 16, 2064, 4, 32
    pad = PAD_SLOT_ID if marker == "pad_slot_id" else NULL
    weight, bias = make_weight(dim, width, dtype, "cuda", g), make_bias(dim, dtype, "cuda", g)
    pool, _ = make_layout_pool("wcontig", num_lines, dim, width - 1, dtype, "cuda", g)
    static_x = randn((batch, dim), g, dtype, "cuda")
    static_idx = torch.arange(1, batch + 9, dtype=torch.int32, device="cuda")  # padded buffer
    kw = {marker: pad}

    def step(warmup):
        p = pool.clone() if warmup else pool
        return causal_conv1d_update(static_x, p, weight, bias, "silu", static_idx, **kw)

    graph, static_out = _capture(step)
    for replay, n_real in enumerate([16, 11, 5]):
        lines = torch.randperm(num_lines - 1, generator=g)[: batch + 8] + 1
        lines[n_real:batch] = pad
        static_idx.copy_(lines)
        static_x.copy_(randn((batch, dim), g, dtype, "cpu"))
        pool_before, ref_pool = pool.clone(), pool.clone()
        ref = causal_conv1d_update_ref(
            static_x, ref_pool, weight, bias, "silu", static_idx[:batch], pad_slot_id=pad
        )
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
