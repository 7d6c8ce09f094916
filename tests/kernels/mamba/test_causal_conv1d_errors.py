"""Bad input raises ValueError naming the argument, and leaves the state pool untouched.

Each case starts from a valid call (checked by the baseline tests) and breaks one thing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
    PAD_SLOT_ID,
    causal_conv1d_fn,
    causal_conv1d_update,
    compute_causal_conv1d_metadata,
)

from .conv_error_base import _expect_value_error, _i32, _varlen, fn_kwargs, update_kwargs
from .conv_error_cases import FN_ERRORS, UPDATE_ERRORS

REPO_ROOT = Path(__file__).resolve().parents[3]
gpu = pytest.mark.gpu


def test_fn_valid_baseline(device):
    """The unmutated inputs are valid, also with data validation and pad/duplicate pads."""
    kw = fn_kwargs(device)
    causal_conv1d_fn(**kw, validate_data=True)
    kw["cache_indices"] = _i32([PAD_SLOT_ID, 2, PAD_SLOT_ID], device)
    meta = compute_causal_conv1d_metadata(kw["query_start_loc"].cpu(), device)
    causal_conv1d_fn(**kw, metadata=meta, validate_data=True)


@pytest.mark.parametrize(
    "mutate,pattern,validate", [e[1:] for e in FN_ERRORS], ids=[e[0] for e in FN_ERRORS]
)
def test_fn_bad_input(mutate, pattern, validate, device):
    kw = mutate(fn_kwargs(device), device)
    _expect_value_error(causal_conv1d_fn, kw, pattern, validate, "conv_states")


def test_update_valid_baseline(device):
    kw = update_kwargs(device)
    causal_conv1d_update(**kw, validate_data=True)
    kw["num_accepted_tokens"] = _i32([1, 6, 3], device)  # history up to column 8 = state_len
    causal_conv1d_update(**kw, validate_data=True)
    kw = _varlen((2, 0, 3))(update_kwargs(device), device)
    kw["conv_state_indices"] = _i32([2, PAD_SLOT_ID, PAD_SLOT_ID], device)
    causal_conv1d_update(**kw, validate_data=True)


@pytest.mark.parametrize(
    "mutate,pattern,validate", [e[1:] for e in UPDATE_ERRORS], ids=[e[0] for e in UPDATE_ERRORS]
)
def test_update_bad_input(mutate, pattern, validate, device):
    kw = mutate(update_kwargs(device), device)
    _expect_value_error(causal_conv1d_update, kw, pattern, validate, "conv_state")


def test_update_cache_seqlens_rejected(device):
    kw = update_kwargs(device)
    kw["cache_seqlens"] = _i32([4, 4, 4], device)
    pool_before = kw["conv_state"].clone()
    with pytest.raises(ValueError, match="cache_seqlens"):
        causal_conv1d_update(**kw)
    assert torch.equal(kw["conv_state"], pool_before)


# --- device mismatch (needs a GPU) ------------------------------------------------------

FN_DEVICE_ARGS = [
    "weight",
    "bias",
    "conv_states",
    "query_start_loc",
    "cache_indices",
    "has_initial_state",
]
UPDATE_DEVICE_ARGS = ["weight", "bias", "conv_state", "conv_state_indices", "num_accepted_tokens"]


@gpu
@pytest.mark.parametrize("name", FN_DEVICE_ARGS)
def test_fn_device_mismatch(name):
    kw = fn_kwargs("cuda")
    kw[name] = kw[name].cpu()
    pool = kw["conv_states"]
    pool_before = pool.clone()
    with pytest.raises(ValueError, match=name):
        causal_conv1d_fn(**kw)
    assert torch.equal(pool, pool_before)


@gpu
@pytest.mark.parametrize("name", UPDATE_DEVICE_ARGS)
def test_update_device_mismatch(name):
    kw = update_kwargs("cuda")
    kw["num_accepted_tokens"] = _i32([1, 2, 1], "cuda")
    kw[name] = kw[name].cpu()
    pool = kw["conv_state"]
    pool_before = pool.clone()
    with pytest.raises(ValueError, match=name):
        causal_conv1d_update(**kw)
    assert torch.equal(pool, pool_before)


# --- import without Triton --------------------------------------------------------------

NO_TRITON_SCRIPT = r"""
import sys
sys.modules["triton"] = None  # `import triton` now raises ImportError
import torch
from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
    causal_conv1d_fn, causal_conv1d_ref, causal_conv1d_update, causal_conv1d_update_ref,
)
g = torch.Generator().manual_seed(0)
dim, w = 32, 4
x = torch.randn(7, dim, generator=g).t()
weight = 0.5 * torch.randn(dim, w, generator=g)
bias = 0.2 * torch.randn(dim, generator=g)
pool = torch.randn(4, w - 1, dim, generator=g).transpose(1, 2)
qsl = torch.tensor([0, 5, 7], dtype=torch.int32)
idx = torch.tensor([2, 0], dtype=torch.int32)
init = torch.tensor([True, False])
ref_pool = pool.clone()
out = causal_conv1d_fn(x, weight, bias, pool, qsl, idx, init)
ref = causal_conv1d_ref(x, weight, bias, ref_pool, qsl, idx, init)
assert torch.equal(out, ref) and torch.equal(pool, ref_pool), "fn on CPU != reference"
xt = torch.randn(2, dim, generator=g)
out = causal_conv1d_update(xt, pool, weight, bias, "silu", idx)
ref = causal_conv1d_update_ref(xt, ref_pool, weight, bias, "silu", idx)
assert torch.equal(out, ref) and torch.equal(pool, ref_pool), "update on CPU != reference"
if len(sys.argv) > 1 and sys.argv[1] == "cuda":
    for name, call in [
        ("fn", lambda: causal_conv1d_fn(x.cuda(), weight.cuda(), bias.cuda(), pool.cuda(),
                                        qsl.cuda(), idx.cuda(), init.cuda())),
        ("update", lambda: causal_conv1d_update(xt.cuda(), pool.cuda(), weight.cuda(),
                                                bias.cuda(), "silu", idx.cuda())),
    ]:
        try:
            call()
        except Exception as e:  # the error must say that Triton is missing
            assert "triton" in str(e).lower(), f"{name}: unclear error {type(e).__name__}: {e}"
        else:
            raise AssertionError(f"{name} on CUDA tensors ran without Triton")
print("NO_TRITON_OK")
"""


def _run_without_triton(*args):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", NO_TRITON_SCRIPT, *args],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "NO_TRITON_OK" in proc.stdout, proc.stdout + proc.stderr


def test_import_and_cpu_path_without_triton():
    _run_without_triton()


@gpu
def test_cuda_call_without_triton_is_a_clear_error():
    _run_without_triton("cuda")
