"""Upstream callers' padded-row conventions: per-sequence arrays longer than the batch (the
engine's padded buffers) and, in later upstream versions, ``null_block_id`` as the
padded-row marker; the pad_slot_id default.

Each case demands outputs and states bit-identical to the same call on unpadded arrays
(or equal to the reference with the null block as the pad marker), and no write to a line
a padded entry or the null block names.
"""

from __future__ import annotations

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

from .conv_compat_cases import (
    FN_INIT,
    FN_PAD,
    FN_SEQLENS,
    NULL,
    UPD_MODES,
    fn_inputs,
    padded,
    update_inputs,
)
from .conv_utils import DTYPE_NAMES, assert_close, flags, i32, qsl_from_lens

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
gpu = pytest.mark.gpu


# --- padded per-sequence arrays ----------------------------------------------------------


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
    x, weight, bias, pool, _, lines = fn_inputs(("pad", width, dtype), width, dtype, device,
                                                "feat", extra_lines=4)  # fmt: skip
    qsl = qsl_from_lens(FN_SEQLENS, device)
    unused = [n for n in range(pool.shape[0]) if n not in lines]
    extra_idx = [*unused, 10**6, lines[0]]
    idx, init = i32(lines, device), flags(FN_INIT, device)
    idx_pad = padded(lines, extra_idx, device)
    init_pad = padded(FN_INIT, [True] * len(extra_idx), device, torch.bool)
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
    x, weight, bias, pool, _, lines, accepted, qsl = update_inputs(
        mode, ("pad", dtype), width, dtype, device, "feat"
    )
    unused = [n for n in range(pool.shape[0]) if n not in lines]
    extra_idx = [*unused, 10**6, lines[0]]
    idx, idx_pad = i32(lines, device), padded(lines, extra_idx, device)
    acc_pad = None
    if accepted is not None:
        # an accepted count past the line would read out of bounds if it were used
        acc_pad = padded(accepted.tolist(), [10**6] * len(extra_idx), device)
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
    x, weight, bias, pool, _, lines = fn_inputs(("null", width, dtype), width, dtype, device,
                                                "wcontig")  # fmt: skip
    lines = _null_lines(lines, pool.shape[0])
    qsl, idx, init = qsl_from_lens(FN_SEQLENS, device), i32(lines, device), flags(FN_INIT, device)
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
    idx2 = i32([NULL if b in (FN_PAD, 3) else n for b, n in enumerate(lines)], device)
    causal_conv1d_fn(x, weight, bias, pool.clone(), qsl, idx2, init, null_block_id=NULL,
                     validate_data=True)  # fmt: skip


@pytest.mark.parametrize("mode,dtype", PADDED_UPDATE_PARAMS)
def test_update_null_block_id(mode, dtype, device, nan_poison):
    width = 4
    x, weight, bias, pool, _, lines, accepted, qsl = update_inputs(
        mode, ("null", dtype), width, dtype, device, "wcontig"
    )
    lines = _null_lines(lines, pool.shape[0])
    idx = i32(lines, device)
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
