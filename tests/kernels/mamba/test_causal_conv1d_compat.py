"""Upstream callers' conventions: conv states of any strides, padded index arrays, null_block_id.

Upstream vLLM's conv ops accept a state pool of any layout (its CUDA layout is
(lines, dim, width - 1) contiguous), per-sequence arrays longer than the batch (the
engine's padded buffers) and, in later versions, ``null_block_id`` as the padded-row
marker. Each case here runs the op on such inputs and demands:

- outputs equal to the fp32 reference (the tolerance table) and bit-identical to the
  same call on a feature-contiguous pool or on unpadded arrays (the layout or the
  padding never changes the arithmetic);
- the state pool equal to the reference's, and every byte of the pool's storage that
  the call should not write (other lines, columns past the window, memory around a
  sliced view) bit-identical to before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
    NULL_BLOCK_ID,
    PAD_SLOT_ID,
    causal_conv1d_fn,
    causal_conv1d_ref,
    causal_conv1d_update,
    causal_conv1d_update_ref,
    compute_causal_conv1d_metadata,
)

from .conv_utils import (
    DTYPE_NAMES,
    assert_close,
    assert_no_nan,
    gen_for,
    make_bias,
    make_weight,
    make_x,
    qsl_from_lens,
    randn,
)

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
gpu = pytest.mark.gpu
WIDTHS = range(2, 9)
DIM = 40  # not a multiple of any feature block: every block has a masked tail


# --- pool layouts -----------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """A pool (lines, dim, state_len) as a view of a base tensor allocated in another shape."""

    name: str
    base_shape: Callable[[int, int, int], tuple[int, ...]]  # (lines, dim, sl) -> base shape
    view: Callable[[torch.Tensor, int, int, int], torch.Tensor]  # (base, lines, dim, sl) -> pool


LAYOUTS = {
    # the fast path: (lines, state_len, dim) allocated, transposed
    "feat": Layout("feat", lambda n, d, s: (n, s, d), lambda b, n, d, s: b.transpose(1, 2)),
    # upstream's CUDA layout: (lines, dim, state_len) contiguous, width-contiguous
    "wcontig": Layout("wcontig", lambda n, d, s: (n, d, s), lambda b, n, d, s: b),
    # width-contiguous columns sliced out of wider lines (storage offset, gaps)
    "wslice": Layout(
        "wslice", lambda n, d, s: (n, d, s + 3), lambda b, n, d, s: b[:, :, 2 : 2 + s]
    ),
    # features outermost: the feature stride is lines * state_len
    "dmajor": Layout("dmajor", lambda n, d, s: (d, n, s), lambda b, n, d, s: b.permute(1, 0, 2)),
    # lines innermost (line stride 1), features in the middle
    "lmajor": Layout("lmajor", lambda n, d, s: (s, d, n), lambda b, n, d, s: b.permute(2, 1, 0)),
    # feature-contiguous, but every other line of a pool with an odd feature offset
    "featgaps": Layout(
        "featgaps",
        lambda n, d, s: (2 * n, s, d + 5),
        lambda b, n, d, s: b[::2, :, 3 : 3 + d].transpose(1, 2),
    ),
}
OTHER_LAYOUTS = ["wslice", "dmajor", "lmajor", "featgaps"]


def make_layout_pool(layout: str, lines, dim, state_len, dtype, device, gen):
    """(pool view, base tensor): random values everywhere in the base."""
    lay = LAYOUTS[layout]
    base = randn(lay.base_shape(lines, dim, state_len), gen, dtype, device)
    pool = lay.view(base, lines, dim, state_len)
    assert pool.shape == (lines, dim, state_len)
    if layout == "wcontig":
        assert pool.is_contiguous() and pool.stride(2) == 1
    elif layout != "feat" and layout != "featgaps":
        assert pool.stride(1) != 1
    return pool, base


def expected_base(layout: str, base_before, ref_pool) -> torch.Tensor:
    """The base as it must be after the call: the reference's pool values in the view,
    every other element as before."""
    exp = base_before.clone()
    lines, dim, state_len = ref_pool.shape
    LAYOUTS[layout].view(exp, lines, dim, state_len).copy_(ref_pool)
    return exp


def feat_copy(pool: torch.Tensor) -> torch.Tensor:
    """The same values in the fast layout."""
    lines, dim, state_len = pool.shape
    fast = torch.empty((lines, state_len, dim), dtype=pool.dtype, device=pool.device)
    return fast.transpose(1, 2).copy_(pool)


def _i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def _flags(values, device):
    return torch.tensor(values, dtype=torch.bool, device=device)


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

FN_SEQLENS = (6, 1, 2, 1, 0, 3)  # short sequences, decodes, an empty one
FN_INIT = (True, True, False, True, True, False)
FN_PAD = 2  # this row is padding


def _fn_inputs(key, width, dtype, device, layout, extra_lines=3):
    g = gen_for("compat-fn", key)
    batch = len(FN_SEQLENS)
    num_lines = batch + extra_lines
    x = make_x(DIM, sum(FN_SEQLENS), dtype, device, g)
    weight = make_weight(DIM, width, dtype, device, g)
    bias = make_bias(DIM, dtype, device, g)
    pool, base = make_layout_pool(layout, num_lines, DIM, width - 1, dtype, device, g)
    lines = torch.randperm(num_lines, generator=g)[:batch].tolist()
    lines[FN_PAD] = PAD_SLOT_ID
    return x, weight, bias, pool, base, lines


@pytest.mark.parametrize("layout,width,dtype", _layout_params())
@pytest.mark.parametrize("with_meta", [False, True], ids=["nometa", "meta"])
def test_fn_any_state_layout(layout, width, dtype, with_meta, device, nan_poison):
    x, weight, bias, pool, base, lines = _fn_inputs(
        (layout, width, dtype), width, dtype, device, layout
    )
    qsl = qsl_from_lens(FN_SEQLENS, device)
    idx, init = _i32(lines, device), _flags(FN_INIT, device)
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

UPD_MODES = ["tok", "spec", "varlen"]


def _update_inputs(mode, key, width, dtype, device, layout):
    """(x, weight, bias, pool, base, lines, accepted, qsl) for one update mode.

    tok: one token per row (the decode kernel); spec: (batch, dim, 3) with accepted
    counts (the general kernel, shifted history); varlen: rows of 2, 0, 3 and 1 tokens.
    """
    g = gen_for("compat-update", mode, key)
    accepted = qsl = None
    state_len = width - 1
    if mode == "tok":
        batch = 5
        x = randn((batch, DIM), g, dtype, device)
    elif mode == "spec":
        batch = 3
        x = randn((batch, 3, DIM), g, dtype, device).transpose(1, 2)
        accepted = _i32([2, 1, 3], device)
        state_len = width - 1 + 2
    else:
        lens = (2, 0, 3, 1)
        batch = len(lens)
        x = randn((sum(lens), DIM), g, dtype, device)
        qsl = qsl_from_lens(lens, device)
    num_lines = batch + 3
    weight = make_weight(DIM, width, dtype, device, g)
    bias = make_bias(DIM, dtype, device, g)
    pool, base = make_layout_pool(layout, num_lines, DIM, state_len, dtype, device, g)
    lines = torch.randperm(num_lines, generator=g)[:batch].tolist()
    lines[1] = PAD_SLOT_ID
    return x, weight, bias, pool, base, lines, accepted, qsl


@pytest.mark.parametrize("layout,width,dtype", _layout_params())
@pytest.mark.parametrize("mode", UPD_MODES)
def test_update_any_state_layout(layout, width, dtype, mode, device, nan_poison):
    x, weight, bias, pool, base, lines, accepted, qsl = _update_inputs(
        mode, (layout, width, dtype), width, dtype, device, layout
    )
    idx = _i32(lines, device)
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


# --- padded per-sequence arrays ----------------------------------------------------------


def _padded(values, extra, device, dtype=torch.int32):
    return torch.tensor(list(values) + list(extra), dtype=dtype, device=device)


def _wd(width, dtype):
    """A (width, dtype) case; bf16 only on the GPU (its arithmetic is wrong in the
    interpreter)."""
    marks = (gpu,) if dtype == BF16 else ()
    return pytest.param(width, dtype, marks=marks, id=f"W{width}_{DTYPE_NAMES[dtype]}")


@pytest.mark.parametrize("width,dtype", [_wd(4, FP32), _wd(5, FP16), _wd(8, FP32), _wd(4, BF16)])
@pytest.mark.parametrize("with_meta", [False, True], ids=["nometa", "meta"])
def test_fn_padded_index_arrays(width, dtype, with_meta, device, nan_poison):
    """Entries past the batch are ignored: they name real, unused lines (and one far out of
    range), so a kernel that read them would change a line or fault."""
    x, weight, bias, pool, _, lines = _fn_inputs(("pad", width, dtype), width, dtype, device,
                                                 "feat", extra_lines=4)  # fmt: skip
    qsl = qsl_from_lens(FN_SEQLENS, device)
    unused = [n for n in range(pool.shape[0]) if n not in lines]
    extra_idx = [*unused, 10**6, lines[0]]
    idx, init = _i32(lines, device), _flags(FN_INIT, device)
    idx_pad = _padded(lines, extra_idx, device)
    init_pad = _padded(FN_INIT, [True] * len(extra_idx), device, torch.bool)
    meta = compute_causal_conv1d_metadata(qsl.cpu(), device) if with_meta else None
    pool_before, plain_pool = pool.clone(), pool.clone()
    plain = causal_conv1d_fn(x, weight, bias, plain_pool, qsl, idx, init, metadata=meta)

    out = causal_conv1d_fn(x, weight, bias, pool, qsl, idx_pad, init_pad, metadata=meta)

    assert torch.equal(out, plain)
    assert torch.equal(pool, plain_pool)
    for line in unused:
        assert torch.equal(pool[line], pool_before[line]), f"line {line} (a padded entry) changed"
    # validate_data reads only the first batch entries too (the extras hold a duplicate
    # and an out-of-range line)
    causal_conv1d_fn(x, weight, bias, pool.clone(), qsl, idx_pad, init_pad, validate_data=True)


# bf16 cannot run in the interpreter: its cases carry the gpu mark
PADDED_UPDATE_PARAMS = [
    pytest.param(
        mode, dtype, marks=(gpu,) if dtype == BF16 else (), id=f"{mode}_{DTYPE_NAMES[dtype]}"
    )  # fmt: skip
    for mode in UPD_MODES
    for dtype in (FP32, FP16, BF16)
]


@pytest.mark.parametrize("mode,dtype", PADDED_UPDATE_PARAMS)
def test_update_padded_index_arrays(mode, dtype, device, nan_poison):
    width = 4
    x, weight, bias, pool, _, lines, accepted, qsl = _update_inputs(
        mode, ("pad", dtype), width, dtype, device, "feat"
    )
    unused = [n for n in range(pool.shape[0]) if n not in lines]
    extra_idx = [*unused, 10**6, lines[0]]
    idx, idx_pad = _i32(lines, device), _padded(lines, extra_idx, device)
    acc_pad = None
    if accepted is not None:
        # an accepted count past the line would read out of bounds if it were used
        acc_pad = _padded(accepted.tolist(), [10**6] * len(extra_idx), device)
    kw = dict(query_start_loc=qsl, max_query_len=3)
    pool_before, plain_pool = pool.clone(), pool.clone()
    plain = causal_conv1d_update(
        x, plain_pool, weight, bias, "silu", idx, num_accepted_tokens=accepted, **kw
    )

    out = causal_conv1d_update(
        x, pool, weight, bias, "silu", idx_pad, num_accepted_tokens=acc_pad, **kw
    )

    assert torch.equal(out, plain)
    assert torch.equal(pool, plain_pool)
    for line in unused:
        assert torch.equal(pool[line], pool_before[line]), f"line {line} (a padded entry) changed"
    causal_conv1d_update(
        x, pool.clone(), weight, bias, "silu", idx_pad, num_accepted_tokens=acc_pad,
        validate_data=True, **kw,
    )  # fmt: skip


# --- null_block_id -----------------------------------------------------------------------

NULL = 0  # as upstream's block pools: line 0 is the null block, never a sequence's line


def _null_lines(lines, num_lines):
    """``lines`` with PAD_SLOT_ID replaced by NULL and no real row on line NULL."""
    free = [n for n in range(1, num_lines) if n not in lines]
    out = []
    for line in lines:
        if line == PAD_SLOT_ID:
            out.append(NULL)
        elif line == NULL:
            out.append(free.pop())
        else:
            out.append(line)
    return out


@pytest.mark.parametrize("width,dtype", [_wd(4, FP32), _wd(3, FP16), _wd(4, BF16)])
def test_fn_null_block_id(width, dtype, device, nan_poison):
    x, weight, bias, pool, _, lines = _fn_inputs(("null", width, dtype), width, dtype, device,
                                                 "wcontig")  # fmt: skip
    lines = _null_lines(lines, pool.shape[0])
    qsl, idx, init = qsl_from_lens(FN_SEQLENS, device), _i32(lines, device), _flags(FN_INIT, device)
    pool_before, ref_pool, same_pool = pool.clone(), pool.clone(), pool.clone()
    ref = causal_conv1d_ref(x, weight, bias, ref_pool, qsl, idx, init, pad_slot_id=NULL)
    same = causal_conv1d_fn(
        x, weight, bias, same_pool, qsl, idx, init, pad_slot_id=NULL, null_block_id=NULL
    )

    out = causal_conv1d_fn(x, weight, bias, pool, qsl, idx, init, null_block_id=NULL)

    assert_close(out, ref)
    assert torch.equal(pool, ref_pool)
    assert torch.equal(out, same) and torch.equal(same_pool, pool)
    assert torch.equal(pool[NULL], pool_before[NULL]), "the null block was written"
    start = sum(FN_SEQLENS[:FN_PAD])
    assert not out[:, start : start + FN_SEQLENS[FN_PAD]].any(), "padded row not zero"
    # validate_data: the null block is the marker, not an out-of-range line, and may repeat
    idx2 = _i32([NULL if b in (FN_PAD, 3) else n for b, n in enumerate(lines)], device)
    causal_conv1d_fn(x, weight, bias, pool.clone(), qsl, idx2, init, null_block_id=NULL,
                     validate_data=True)  # fmt: skip


@pytest.mark.parametrize("mode,dtype", PADDED_UPDATE_PARAMS)
def test_update_null_block_id(mode, dtype, device, nan_poison):
    width = 4
    x, weight, bias, pool, _, lines, accepted, qsl = _update_inputs(
        mode, ("null", dtype), width, dtype, device, "wcontig"
    )
    lines = _null_lines(lines, pool.shape[0])
    idx = _i32(lines, device)
    kw = dict(num_accepted_tokens=accepted, query_start_loc=qsl, max_query_len=3)
    pool_before, ref_pool = pool.clone(), pool.clone()
    ref = causal_conv1d_update_ref(
        x, ref_pool, weight, bias, "silu", idx, accepted, qsl, pad_slot_id=NULL
    )

    out = causal_conv1d_update(x, pool, weight, bias, "silu", idx, null_block_id=NULL, **kw)

    assert_close(out, ref)
    assert torch.equal(pool, ref_pool)
    assert torch.equal(pool[NULL], pool_before[NULL]), "the null block was written"
    causal_conv1d_update(x, pool.clone(), weight, bias, "silu", idx, null_block_id=NULL,
                         pad_slot_id=NULL, validate_data=True, **kw)  # fmt: skip


def test_pad_slot_id_default_is_recognisable():
    """The default is NULL_BLOCK_ID (== 0, shown as NULL_BLOCK_ID), and passing it
    explicitly counts as giving it: with a different null_block_id that is an error."""
    import inspect

    for op in (causal_conv1d_fn, causal_conv1d_update):
        default = inspect.signature(op).parameters["pad_slot_id"].default
        assert default == NULL_BLOCK_ID == 0 and repr(default) == "NULL_BLOCK_ID"
        assert inspect.signature(op).parameters["null_block_id"].kind == (
            inspect.Parameter.KEYWORD_ONLY
        )


# --- torch.library.opcheck with a width-contiguous pool ----------------------------------

DEVICES = ["cpu", pytest.param("cuda", marks=gpu)]


@pytest.mark.parametrize("device_name", DEVICES)
def test_opcheck_fwd_width_contiguous_state(device_name):
    device = torch.device(device_name)
    x, weight, bias, pool, _, lines = _fn_inputs(("opcheck",), 4, FP32, device, "wcontig")
    qsl = qsl_from_lens(FN_SEQLENS, device)
    meta = compute_causal_conv1d_metadata(qsl.cpu(), device)
    idx = _padded(lines, [0, 1], device)  # padded index buffer
    init = _flags(FN_INIT, device)
    args = (x, weight, bias, pool, qsl, idx, init, True, PAD_SLOT_ID, meta.tile_seq, meta.block_t)
    torch.library.opcheck(torch.ops.vllm.causal_conv1d_fwd.default, args)


@pytest.mark.parametrize("device_name", DEVICES)
@pytest.mark.parametrize("mode", UPD_MODES)
def test_opcheck_update_width_contiguous_state(device_name, mode):
    device = torch.device(device_name)
    x, weight, bias, pool, _, lines, accepted, qsl = _update_inputs(
        mode, ("opcheck",), 4, FP32, device, "wcontig"
    )
    idx = _padded(lines, [0], device)
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
