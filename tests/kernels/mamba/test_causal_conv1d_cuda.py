"""The CUDA causal-conv1d pathway (csrc/mamba/causal_conv1d/, vllm/_custom_ops.py).

Checked against the fp32 references, and against the Triton ops on the same mixed
batch, each with its state pool in its own layout (width-contiguous for CUDA,
feature-contiguous for Triton): outputs within the dtype's tolerance, states equal.
Everything needs the built ops and a GPU (mark gpu) except the tests of what happens
when the ops are not built.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from vllm import _custom_ops as cuda_ops
from vllm._custom_ops import causal_conv1d_fwd_cuda, causal_conv1d_update_cuda
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


def width_major(pool: torch.Tensor) -> torch.Tensor:
    """A copy of a state pool in the CUDA ops' layout: (lines, dim, state_len), stride(2) == 1.

    Always a copy (``contiguous()`` would return the pool itself when state_len == 1).
    """
    return pool.clone(memory_format=torch.contiguous_format)


def _silu(activation) -> bool:
    return activation is not None


# --- not built ---------------------------------------------------------------------------


def test_library_loads_when_present():
    """Without the library the ops say they are unavailable; with it, it must load."""
    assert cuda_ops.cuda_ops_available() == (cuda_ops._find_library() is not None)


@pytest.mark.parametrize("path", [None, Path("/nonexistent/_C_conv.so")], ids=["absent", "bad"])
def test_not_built_raises_clear_error(path, monkeypatch):
    monkeypatch.setattr(cuda_ops, "_LIBRARY", cuda_ops._Library(path))
    assert not cuda_ops.cuda_ops_available()
    x = torch.zeros(8, 3)
    pool = torch.zeros(2, 8, 3)
    weight = torch.zeros(8, 4)
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"(?s)not built.*VLLM_BUILD_CUDA_OPS=1 pip install"):
        causal_conv1d_fwd_cuda(x, weight, None, pool, qsl, None, None, True, PAD_SLOT_ID)
    with pytest.raises(RuntimeError, match=r"(?s)not built.*VLLM_BUILD_CUDA_OPS=1 pip install"):
        causal_conv1d_update_cuda(x.t(), pool, weight, None, True, None, PAD_SLOT_ID)


# --- forward vs the reference ------------------------------------------------------------


def _fn_ref(inp, ref_pool, activation="silu"):
    """The reference forward over ``build_fn_inputs``' tensors; -1 marks padded rows here
    (line 0 is a sequence's), as the CUDA op is told."""
    return causal_conv1d_ref(
        inp.x, inp.weight, inp.bias, ref_pool, inp.qsl, inp.indices, inp.init, activation,
        pad_slot_id=PAD_SLOT_ID,
    )  # fmt: skip


def run_fwd_case(case: FnCase, device, row_bytes: int = 0) -> None:
    inp = build_fn_inputs(case, device)
    pool = width_major(inp.pool)
    pool_before, ref_pool = pool.clone(), inp.pool.clone()
    ref_out = _fn_ref(inp, ref_pool, case.activation)
    x_before = inp.x.clone()
    out = causal_conv1d_fwd_cuda(
        inp.x,
        inp.weight,
        inp.bias,
        pool,
        inp.qsl,
        inp.indices,
        inp.init,
        _silu(case.activation),
        PAD_SLOT_ID,
        row_bytes=row_bytes,
    )
    assert torch.equal(inp.x, x_before), "x was modified"
    check_fn_against_ref(
        case, dataclasses.replace(inp, pool=pool), out, pool_before, ref_out, ref_pool
    )


def _fwd_widths_dtypes():
    # Every width and dtype; sequences longer than a prefetch chunk with a tail, shorter
    # than the state, one token, zero tokens; dims with partial feature blocks.
    dims = (64, 2064, 4128)
    cases = []
    for i, (width, dtype) in enumerate((w, d) for w in range(2, 9) for d in DTYPES):
        short = max(width - 2, 1)
        seqlens = (37, 1, short, 0, 130, 16)
        cases.append(FnCase(seqlens, dims[i % 3], width, dtype, pads=(1,) if i % 2 else (4,)))
    return cases


FWD_CASES = [
    *_fwd_widths_dtypes(),
    # features not a multiple of the 16-byte vector: element-wise path
    FnCase((21, 3, 1), 100, 4, BF16, pads=(1,)),
    FnCase((21, 3, 1), 100, 7, FP16),
    FnCase((21, 3, 1), 102, 5, FP32, init="all"),
    # x a slice of a wider projection (token stride > dim)
    FnCase((40, 9, 1), 2064, 4, BF16, noncontig=True, pads=(2,)),
    # state_len > W-1: lines not packed, element-wise state access; columns past W-1 kept
    FnCase((5, 2, 1, 40), 64, 4, BF16, state_len=7),
    FnCase((1, 6), 1000, 3, FP16, state_len=5, pads=(0,)),
    # sequences shorter than the state, with and without history
    FnCase((1, 2, 3, 6), 64, 8, FP32, init="all"),
    FnCase((1, 4, 2, 1), 64, 6, FP16, init=(True, False, True, False)),
    # zero-length sequences: with history the line is kept, without it is zeroed
    FnCase((4, 0, 3, 0, 2), 64, 4, BF16, init=(True, True, False, False, True)),
    FnCase((0, 0), 64, 3, FP32, init=(True, False)),
    # defaults: cache_indices None (sequence b uses line b), has_initial_state None
    FnCase((3, 50), 2064, 4, BF16, default_indices=True, init="default"),
    # no bias, no activation, "swish"
    FnCase((20, 7), 64, 4, FP32, bias=False, activation=None),
    FnCase((20, 7), 2064, 5, BF16, activation="swish", bias=False),
    # many short sequences and decode-like rows, padded rows among them
    FnCase(tuple(i % 9 + 1 for i in range(40)), 2064, 8, BF16, pads=(5, 17)),
    FnCase((1,) * 40, 4128, 4, BF16, init="all", pads=(0, 21, 39)),
    # a long sequence: many chunks, and a feature-block tail
    FnCase((1000, 3), 8448, 4, BF16, init=(True, False)),
]


@gpu
@pytest.mark.parametrize("row_bytes", [0, 4, 8, 16], ids=["rows_auto", "rows4", "rows8", "rows16"])
@pytest.mark.parametrize("case", FWD_CASES, ids=lambda c: c.id)
def test_fwd_vs_ref(case, row_bytes, device, nan_poison):
    """Every case with the launcher's choice of row width and with each width forced."""
    run_fwd_case(case, device, row_bytes)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: DTYPE_NAMES[d])
def test_fwd_misaligned_x(dtype, device, nan_poison):
    """x starting 3 elements into its storage: no 16-byte vectors, same results."""
    g = gen_for("fwd-misaligned", dtype)
    dim, width, lens = 2064, 4, (30, 1, 5)
    proj = randn((sum(lens), dim + 8), g, dtype, device)
    x = proj[:, 3 : 3 + dim].t()
    weight, bias = make_weight(dim, width, dtype, device, g), make_bias(dim, dtype, device, g)
    pool = width_major(make_pool(5, dim, width - 1, dtype, device, g))
    qsl = qsl_from_lens(lens, device)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32, device=device)
    init = torch.tensor([True, False, True], device=device)
    ref_pool = pool.clone()
    ref = causal_conv1d_ref(x, weight, bias, ref_pool, qsl, idx, init, pad_slot_id=PAD_SLOT_ID)
    out = causal_conv1d_fwd_cuda(x, weight, bias, pool, qsl, idx, init, True, PAD_SLOT_ID)
    assert_no_nan(out)
    assert_close(out, ref)
    assert torch.equal(pool, ref_pool)


@gpu
def test_fwd_writes_into_out(device, nan_poison):
    """``out=`` a view into a wider buffer: written in place, nothing else touched."""
    case = FnCase((9, 1, 4), 64, 4, FP16)
    inp = build_fn_inputs(case, device)
    pool, ref_pool = width_major(inp.pool), inp.pool.clone()
    ref = _fn_ref(inp, ref_pool)
    buf = torch.full((20, 64), 7.0, dtype=FP16, device=device)
    out = buf[3:17].t()
    got = causal_conv1d_fwd_cuda(
        inp.x,
        inp.weight,
        inp.bias,
        pool,
        inp.qsl,
        inp.indices,
        inp.init,
        True,
        PAD_SLOT_ID,
        out=out,
    )
    assert got is out
    assert_close(out, ref)
    assert (buf[:3] == 7).all() and (buf[17:] == 7).all()
    assert torch.equal(pool, ref_pool)


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
        inp.x, pool, inp.weight, inp.bias, _silu(case.activation), inp.indices, PAD_SLOT_ID
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


# --- CUDA graphs, torch.library ----------------------------------------------------------


@gpu
def test_cuda_graph_update_and_fwd_with_padded_rows(nan_poison):
    g = gen_for("cuda-graph")
    dtype, dim, width, batch, num_lines = BF16, 2064, 4, 16, 24
    weight, bias = make_weight(dim, width, dtype, "cuda", g), make_bias(dim, dtype, "cuda", g)
    pool = width_major(make_pool(num_lines, dim, width - 1, dtype, "cuda", g))
    x = torch.randn(batch, dim, generator=g).to(dtype=dtype, device="cuda")
    px = torch.randn(64, dim, generator=g).to(dtype=dtype, device="cuda").t()
    pqsl = torch.tensor([0, 40, 41, 64], dtype=torch.int32, device="cuda")
    pidx = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    pinit = torch.tensor([True, False, True], device="cuda")
    idx = torch.arange(3, 3 + batch, dtype=torch.int32, device="cuda")
    out = torch.empty(batch, dim, dtype=dtype, device="cuda")
    pout = torch.empty(64, dim, dtype=dtype, device="cuda").t()

    def step():
        causal_conv1d_fwd_cuda(
            px, weight, bias, pool, pqsl, pidx, pinit, True, PAD_SLOT_ID, out=pout
        )
        causal_conv1d_update_cuda(x, pool, weight, bias, True, idx, PAD_SLOT_ID, out=out)

    saved = pool.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    pool.copy_(saved)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for replay in range(3):
        n_real = (16, 9, 1)[replay]
        lines = 3 + torch.randperm(num_lines - 3, generator=g)[:batch]
        lines[n_real:] = PAD_SLOT_ID
        idx.copy_(lines)
        x.copy_(torch.randn(batch, dim, generator=g).to(dtype))
        pidx.copy_(torch.tensor([[0, 1, 2], [2, PAD_SLOT_ID, 0], [1, 0, PAD_SLOT_ID]][replay]))
        before, ref_pool = pool.clone(), pool.clone()
        ref_p = causal_conv1d_ref(
            px, weight, bias, ref_pool, pqsl, pidx, pinit, pad_slot_id=PAD_SLOT_ID
        )
        ref = causal_conv1d_update_ref(
            x, ref_pool, weight, bias, "silu", idx, pad_slot_id=PAD_SLOT_ID
        )
        out.fill_(float("nan"))
        pout.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_no_nan(out)
        assert_no_nan(pout)
        assert_close(out, ref)
        assert_close(pout, ref_p)
        assert not out[n_real:].any(), "padded rows must be zero"
        assert torch.equal(pool, ref_pool), f"replay {replay}"
        used = set(lines[:n_real].tolist()) | {i for i in pidx.tolist() if i != PAD_SLOT_ID}
        for line in range(num_lines):
            if line not in used:
                assert torch.equal(pool[line], before[line]), f"replay {replay}: line {line}"


@gpu
def test_opcheck():
    g = gen_for("cuda-opcheck")
    dtype, dim, width = FP16, 64, 4
    weight, bias = make_weight(dim, width, dtype, "cuda", g), make_bias(dim, dtype, "cuda", g)
    pool = width_major(make_pool(4, dim, width - 1, dtype, "cuda", g))
    x = torch.randn(9, dim, generator=g).to(dtype=dtype, device="cuda").t()
    qsl = torch.tensor([0, 5, 9], dtype=torch.int32, device="cuda")
    idx = torch.tensor([3, 1], dtype=torch.int32, device="cuda")
    init = torch.tensor([True, False], device="cuda")
    assert cuda_ops.cuda_ops_available()
    ops = torch.ops._C_conv
    out = torch.empty(9, dim, dtype=dtype, device="cuda").t()
    torch.library.opcheck(
        ops.causal_conv1d_fwd.default,
        (x, weight, bias, pool, qsl, idx, init, True, PAD_SLOT_ID, 0, out),
    )
    xu = x.t()[:2].contiguous()
    outu = torch.empty_like(xu)
    torch.library.opcheck(
        ops.causal_conv1d_update.default, (xu, pool, weight, None, False, idx, PAD_SLOT_ID, outu)
    )


# --- bad input ---------------------------------------------------------------------------


def _valid_fwd(device) -> dict:
    g = gen_for("cuda-errors")
    dim, width = 64, 4
    return dict(
        x=randn((6, dim), g, FP16, device).t(),
        weight=make_weight(dim, width, FP16, device, g),
        bias=make_bias(dim, FP16, device, g),
        conv_states=width_major(make_pool(4, dim, width - 1, FP16, device, g)),
        query_start_loc=qsl_from_lens([4, 2], device),
        cache_indices=torch.tensor([2, 0], dtype=torch.int32, device=device),
        has_initial_state=torch.tensor([True, False], device=device),
        silu=True,
        pad_slot_id=PAD_SLOT_ID,
    )


FWD_ERRORS = {
    "x_on_cpu": (dict(x="cpu"), "x must be a CUDA tensor"),
    "x_token_major": (dict(x="contiguous"), r"x must be feature-contiguous"),
    "weight_dtype": (dict(weight="float"), r"weight must have dtype in \(float16\)"),
    "width_9": (dict(weight=(64, 9)), r"weight width must be in \[2, 8\]"),
    "pool_feature_major": (dict(conv_states="feature-major"), "width-contiguous"),
    "pool_state_len": (dict(conv_states=(4, 64, 2)), r"state_len >= width-1"),
    "indices_len": (dict(cache_indices=[2]), "cache_indices must have 2 entries"),
    "indices_dtype": (dict(cache_indices="int64"), r"cache_indices must have dtype in \(int32\)"),
    "init_dtype": (dict(has_initial_state="int32"), r"has_initial_state must have dtype in"),
    "silu_str": (dict(silu="silu"), "silu must be a bool"),
    "row_bytes_2": (dict(row_bytes=2), "row_bytes must be 0"),
    "bias_len": (dict(bias=(65,)), r"bias must be \(dim=64,\)"),
}


def _break(kwargs, key, how, device):
    t = kwargs.get(key)
    if how == "cpu":
        kwargs[key] = t.cpu()
    elif how == "contiguous":
        kwargs[key] = t.contiguous()
    elif how == "float":
        kwargs[key] = t.float()
    elif how == "int64":
        kwargs[key] = t.long()
    elif how == "int32":
        kwargs[key] = t.int()
    elif how == "feature-major":
        kwargs[key] = t.transpose(1, 2).contiguous().transpose(1, 2)
    elif isinstance(how, tuple):
        kwargs[key] = torch.zeros(how, dtype=t.dtype, device=device)
    elif isinstance(how, list):
        kwargs[key] = torch.tensor(how, dtype=t.dtype, device=device)
    else:
        kwargs[key] = how


@gpu
@pytest.mark.parametrize("name", list(FWD_ERRORS))
def test_fwd_bad_input(name, device):
    change, message = FWD_ERRORS[name]
    kwargs = _valid_fwd(device)
    for key, how in change.items():
        _break(kwargs, key, how, device)
    with pytest.raises(ValueError, match=message):
        causal_conv1d_fwd_cuda(**kwargs)


@gpu
def test_update_bad_input(device):
    kwargs = _valid_fwd(device)
    x = kwargs["x"].t()[:2]
    args = (kwargs["conv_states"], kwargs["weight"], kwargs["bias"], True)
    idx = kwargs["cache_indices"]
    with pytest.raises(ValueError, match="x must be feature-contiguous"):
        causal_conv1d_update_cuda(x.t().contiguous().t(), *args, idx, PAD_SLOT_ID)
    with pytest.raises(ValueError, match="conv_state_indices must have 2 entries"):
        causal_conv1d_update_cuda(x, *args, idx[:1], PAD_SLOT_ID)
    with pytest.raises(ValueError, match="conv_state must be width-contiguous"):
        pool = kwargs["conv_states"].transpose(1, 2).contiguous().transpose(1, 2)
        causal_conv1d_update_cuda(x, pool, *args[1:], idx, PAD_SLOT_ID)
    with pytest.raises(ValueError, match=r"out must have shape \(2, 64\)"):
        causal_conv1d_update_cuda(x, *args, idx, PAD_SLOT_ID, out=torch.empty_like(x)[:1])
    with pytest.raises(
        ValueError, match=r"conv_state_indices is None.*batch=5 > num_cache_lines=4"
    ):
        x5 = torch.zeros(5, 64, dtype=FP16, device=device)
        causal_conv1d_update_cuda(x5, *args, None, PAD_SLOT_ID)
