"""The CUDA causal-conv1d pathway (csrc/mamba/causal_conv1d/, vllm/_custom_ops.py): the
forward op, and what happens when the ops are not built.

Checked against the fp32 reference with the state pool width-contiguous: outputs within
the dtype's tolerance, states equal. Everything needs the built ops and a GPU (mark gpu)
except the tests of what happens when the ops are not built. The update op, graphs and
bad input are in the other test_causal_conv1d_cuda_*.py modules.
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
    causal_conv1d_ref,
)

from .conv_cases import FnCase, build_fn_inputs, check_fn_against_ref
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
        silu_flag(case.activation),
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
