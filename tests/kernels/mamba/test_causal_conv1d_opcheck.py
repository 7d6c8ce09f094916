"""torch.library.opcheck of the registered ops (schema, mutation, fake impl, dynamic shapes)."""

from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
    PAD_SLOT_ID,
    compute_causal_conv1d_metadata,
)

from .conv_utils import gen_for, make_bias, make_pool, make_weight, make_x, qsl_from_lens, randn

FP32, FP16 = torch.float32, torch.float16
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def fwd_args(device, dtype, with_bias, with_meta, state_dtype=None):
    g = gen_for("opcheck-fwd", dtype, with_bias, with_meta)
    dim, width, seqlens = 32, 4, (5, 1, 2, 3)
    qsl = qsl_from_lens(seqlens, device)
    meta = compute_causal_conv1d_metadata(qsl.cpu(), device) if with_meta else None
    return (
        make_x(dim, sum(seqlens), dtype, device, g, noncontig=True),
        make_weight(dim, width, dtype, device, g),
        make_bias(dim, dtype, device, g) if with_bias else None,
        make_pool(6, dim, width - 1, state_dtype or dtype, device, g),
        qsl,
        _i32([4, 0, PAD_SLOT_ID, 2], device),
        torch.tensor([True, False, True, False], device=device),
        True,
        PAD_SLOT_ID,
        meta.tile_seq if meta else None,
        meta.block_t if meta else 0,
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype,with_bias,with_meta,state_dtype",
    [
        pytest.param(FP32, True, True, None, id="fp32_bias_meta"),
        pytest.param(FP16, False, False, FP32, id="fp16_statefp32_nobias_nometa"),
    ],
)
def test_opcheck_causal_conv1d_fwd(device, dtype, with_bias, with_meta, state_dtype):
    args = fwd_args(device, dtype, with_bias, with_meta, state_dtype)
    torch.library.opcheck(torch.ops.vllm.causal_conv1d_fwd.default, args)


def update_args(device, mode):
    g = gen_for("opcheck-update", mode)
    dim, width = 32, 4
    weight, bias = make_weight(dim, width, FP32, device, g), make_bias(dim, FP32, device, g)
    idx = _i32([3, PAD_SLOT_ID, 1], device)
    acc, qsl, max_len, state_len = None, None, -1, width - 1
    if mode == "tok":
        x = randn((3, dim), g, FP32, device)
    elif mode == "spec":
        x = randn((3, 3, dim), g, FP32, device).transpose(1, 2)  # (batch, dim, seqlen)
        acc, state_len = _i32([2, 1, 3], device), width - 1 + 2
    else:  # varlen, with a zero-length padded row
        lens = (2, 0, 3)
        x = randn((sum(lens), dim), g, FP32, device)
        qsl, max_len = qsl_from_lens(lens, device), max(lens)
    pool = make_pool(5, dim, state_len, FP32, device, g)
    return (x, pool, weight, bias, True, idx, acc, qsl, max_len, PAD_SLOT_ID)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["tok", "spec", "varlen"])
def test_opcheck_causal_conv1d_update(device, mode):
    torch.library.opcheck(torch.ops.vllm.causal_conv1d_update.default, update_args(device, mode))
