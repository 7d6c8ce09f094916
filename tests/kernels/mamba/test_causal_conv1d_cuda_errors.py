"""The CUDA causal-conv1d ops refuse bad input (devices, layouts, dtypes, shapes, flags)
with a ValueError naming the problem.

Everything needs the built ops and a GPU (mark gpu).
"""

from __future__ import annotations

import pytest
import torch

from vllm._custom_ops import causal_conv1d_fwd_cuda, causal_conv1d_update_cuda
from vllm.model_executor.layers.mamba.ops.causal_conv1d import PAD_SLOT_ID

from .conv_cuda_utils import width_major
from .conv_utils import gen_for, make_bias, make_pool, make_weight, qsl_from_lens, randn

FP16 = torch.float16
gpu = pytest.mark.gpu


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
