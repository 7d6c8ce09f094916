"""Bad input raises ValueError naming the argument, and leaves the state pool untouched.

Each case starts from a valid call (checked by the baseline tests) and breaks one thing.
"""

from __future__ import annotations

import os
import re
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

from .conv_utils import gen_for, make_bias, make_pool, make_weight, make_x, qsl_from_lens, randn

REPO_ROOT = Path(__file__).resolve().parents[3]
FP32 = torch.float32
DIM, WIDTH, STATE_LEN, LINES = 64, 4, 8, 5  # STATE_LEN fits widths up to 9
gpu = pytest.mark.gpu


def _i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def _token_major(t: torch.Tensor) -> torch.Tensor:
    """The same values with the token axis contiguous (stride(0) != 1)."""
    return t.contiguous()


def fn_kwargs(device) -> dict:
    g = gen_for("errors-fn")
    seqlens = (3, 1, 2)
    return dict(
        x=make_x(DIM, sum(seqlens), FP32, device, g),
        weight=make_weight(DIM, WIDTH, FP32, device, g),
        bias=make_bias(DIM, FP32, device, g),
        conv_states=make_pool(LINES, DIM, STATE_LEN, FP32, device, g),
        query_start_loc=qsl_from_lens(seqlens, device),
        cache_indices=_i32([3, 2, 1], device),
        has_initial_state=torch.tensor([True, False, True], device=device),
        activation="silu",
    )


def update_kwargs(device) -> dict:
    g = gen_for("errors-update")
    return dict(
        x=randn((3, DIM), g, FP32, device),
        conv_state=make_pool(LINES, DIM, STATE_LEN, FP32, device, g),
        weight=make_weight(DIM, WIDTH, FP32, device, g),
        bias=make_bias(DIM, FP32, device, g),
        activation="silu",
        conv_state_indices=_i32([3, 2, 1], device),
    )


def _set(**changes):
    """A mutation replacing arguments; values are callables (kwargs, device) -> new value."""

    def mutate(kw, device):
        for name, make in changes.items():
            kw[name] = make(kw, device)
        return kw

    return mutate


def _pool(lines=LINES, dim=DIM, state_len=STATE_LEN, dtype=FP32):
    return lambda kw, d: make_pool(lines, dim, state_len, dtype, d, gen_for("pool", state_len))


def _other_meta(seqlens):
    return lambda kw, d: compute_causal_conv1d_metadata(qsl_from_lens(seqlens, "cpu"), d)


def _expanded_pool(kw, d):
    """One line seen as LINES lines (stride 0): writing one would write them all."""
    return make_pool(1, DIM, STATE_LEN, FP32, d, gen_for("expanded")).expand(LINES, -1, -1)


def _strided(t):
    """The same values as a view with stride 2 (every other element of a longer tensor)."""
    wide = torch.zeros(2 * t.shape[0], dtype=t.dtype, device=t.device)
    wide[::2] = t
    return wide[::2]


# The padded-row marker: pad_slot_id and null_block_id name it, once or alike.
MARKER_ERRORS = [
    (
        "null_block_id_differs_from_pad_slot_id",
        _set(pad_slot_id=lambda kw, d: PAD_SLOT_ID, null_block_id=lambda kw, d: 0),
        r"null_block_id",
        False,
    ),
    (
        "null_block_id_differs_from_given_pad",
        _set(pad_slot_id=lambda kw, d: 7, null_block_id=lambda kw, d: 0),
        r"null_block_id",
        False,
    ),
    ("null_block_id_str", _set(null_block_id=lambda kw, d: "0"), r"null_block_id", False),
    ("null_block_id_bool", _set(null_block_id=lambda kw, d: False), r"null_block_id", False),
    ("pad_slot_id_float", _set(pad_slot_id=lambda kw, d: -1.0), r"pad_slot_id", False),
]


# (id, mutation, argument name pattern, validate_data)
FN_ERRORS = [
    ("x_3d", _set(x=lambda kw, d: kw["x"][None]), r"\bx\b", False),
    ("x_1d", _set(x=lambda kw, d: kw["x"][:, 0]), r"\bx\b", False),
    ("x_token_contiguous", _set(x=lambda kw, d: _token_major(kw["x"])), r"\bx\b", False),
    ("x_fp64", _set(x=lambda kw, d: kw["x"].double()), r"\bx\b", False),
    ("x_int32", _set(x=lambda kw, d: (8 * kw["x"]).int()), r"\bx\b", False),
    ("weight_1d", _set(weight=lambda kw, d: kw["weight"][:, 0]), r"\bweight\b", False),
    ("weight_dim", _set(weight=lambda kw, d: kw["weight"][:-8]), r"\bweight\b", False),
    ("weight_W1", _set(weight=lambda kw, d: kw["weight"][:, :1]), r"\bweight\b", False),
    (
        "weight_W9",
        _set(weight=lambda kw, d: make_weight(DIM, 9, FP32, d, gen_for("w9"))),
        r"\bweight\b",
        False,
    ),
    (
        "weight_stride",
        _set(weight=lambda kw, d: kw["weight"].t().contiguous().t()),
        r"\bweight\b",
        False,
    ),
    ("bias_dim", _set(bias=lambda kw, d: kw["bias"][:-8]), r"\bbias\b", False),
    ("bias_2d", _set(bias=lambda kw, d: kw["bias"][None]), r"\bbias\b", False),
    ("conv_states_2d", _set(conv_states=lambda kw, d: kw["conv_states"][0]), r"conv_states", False),
    # any strides are served (test_causal_conv1d_compat.py), aliasing ones are not
    ("conv_states_expanded", _set(conv_states=_expanded_pool), r"conv_states", False),
    ("conv_states_dim", _set(conv_states=_pool(dim=DIM - 8)), r"conv_states", False),
    ("conv_states_short", _set(conv_states=_pool(state_len=WIDTH - 2)), r"conv_states", False),
    (
        "conv_states_int32",
        _set(conv_states=lambda kw, d: (8 * kw["conv_states"]).int()),
        r"conv_states",
        False,
    ),
    (
        "query_start_loc_int64",
        _set(query_start_loc=lambda kw, d: kw["query_start_loc"].long()),
        r"query_start_loc",
        False,
    ),
    (
        "query_start_loc_2d",
        _set(query_start_loc=lambda kw, d: kw["query_start_loc"][None]),
        r"query_start_loc",
        False,
    ),
    (
        "cache_indices_int64",
        _set(cache_indices=lambda kw, d: kw["cache_indices"].long()),
        r"cache_indices",
        False,
    ),
    (
        "cache_indices_len",
        _set(cache_indices=lambda kw, d: kw["cache_indices"][:2]),
        r"cache_indices",
        False,
    ),
    (
        "has_initial_state_len",
        _set(has_initial_state=lambda kw, d: kw["has_initial_state"][:2]),
        r"has_initial_state",
        False,
    ),
    ("activation_relu", _set(activation=lambda kw, d: "relu"), r"activation", False),
    ("bias_strided", _set(bias=lambda kw, d: _strided(kw["bias"])), r"\bbias\b", False),
    (
        "query_start_loc_strided",
        _set(query_start_loc=lambda kw, d: _strided(kw["query_start_loc"])),
        r"query_start_loc",
        False,
    ),
    (
        "cache_indices_strided",
        _set(cache_indices=lambda kw, d: _strided(kw["cache_indices"])),
        r"cache_indices",
        False,
    ),
    (
        "has_initial_state_strided",
        _set(has_initial_state=lambda kw, d: _strided(kw["has_initial_state"])),
        r"has_initial_state",
        False,
    ),
    *MARKER_ERRORS,
    ("metadata_other_num_tokens", _set(metadata=_other_meta((3, 1, 3))), r"metadata", False),
    ("metadata_other_batch", _set(metadata=_other_meta((4, 2))), r"metadata", False),
    # validate_data=True: checks that read the index tensors
    (
        "query_start_loc_not_from_0",
        _set(query_start_loc=lambda kw, d: _i32([1, 3, 4, 6], d)),
        r"query_start_loc",
        True,
    ),
    (
        "query_start_loc_decreasing",
        _set(query_start_loc=lambda kw, d: _i32([0, 4, 3, 6], d)),
        r"query_start_loc",
        True,
    ),
    (
        "query_start_loc_last_not_num_tokens",
        _set(query_start_loc=lambda kw, d: _i32([0, 3, 4, 5], d)),
        r"query_start_loc",
        True,
    ),
    (
        "cache_indices_out_of_range",
        _set(cache_indices=lambda kw, d: _i32([3, 0, LINES], d)),
        r"cache_indices",
        True,
    ),
    (
        "cache_indices_duplicate",
        _set(cache_indices=lambda kw, d: _i32([3, 1, 3], d)),
        r"cache_indices",
        True,
    ),
]


def _upd_x3d(seqlen):
    # (batch, dim, seqlen) with stride(1) == 1
    return lambda kw, d: randn((3, seqlen, DIM), gen_for("x3d", seqlen), FP32, d).transpose(1, 2)


def _varlen(seqlens):
    def mutate(kw, d):
        kw["x"] = randn((sum(seqlens), DIM), gen_for("xvar", seqlens), FP32, d)
        kw["query_start_loc"] = qsl_from_lens(seqlens, d)
        kw["max_query_len"] = max(seqlens)
        return kw

    return mutate


def _then(*mutations):
    def mutate(kw, d):
        for m in mutations:
            kw = m(kw, d)
        return kw

    return mutate


UPDATE_ERRORS = [
    ("x_1d", _set(x=lambda kw, d: kw["x"][0]), r"\bx\b", False),
    ("x_4d", _set(x=lambda kw, d: kw["x"][:, :, None, None]), r"\bx\b", False),
    ("x_feature_stride", _set(x=lambda kw, d: kw["x"].t().contiguous().t()), r"\bx\b", False),
    (
        "x_3d_token_contiguous",
        _set(x=lambda kw, d: _upd_x3d(2)(kw, d).contiguous()),
        r"\bx\b",
        False,
    ),
    ("x_fp64", _set(x=lambda kw, d: kw["x"].double()), r"\bx\b", False),
    ("x_int32", _set(x=lambda kw, d: (8 * kw["x"]).int()), r"\bx\b", False),
    ("x_dim", _set(x=lambda kw, d: kw["x"][:, :-8]), r"\bx\b|\bweight\b|conv_state", False),
    ("conv_state_expanded", _set(conv_state=_expanded_pool), r"conv_states?", False),
    ("conv_state_2d", _set(conv_state=lambda kw, d: kw["conv_state"][0]), r"conv_states?", False),
    ("conv_state_dim", _set(conv_state=_pool(dim=DIM - 8)), r"conv_states?", False),
    ("conv_state_short", _set(conv_state=_pool(state_len=WIDTH - 2)), r"conv_states?", False),
    ("weight_W1", _set(weight=lambda kw, d: kw["weight"][:, :1]), r"\bweight\b", False),
    (
        "weight_W9",
        _set(weight=lambda kw, d: make_weight(DIM, 9, FP32, d, gen_for("w9"))),
        r"\bweight\b",
        False,
    ),
    ("weight_dim", _set(weight=lambda kw, d: kw["weight"][:-8]), r"\bweight\b", False),
    ("bias_dim", _set(bias=lambda kw, d: kw["bias"][:-8]), r"\bbias\b", False),
    (
        "conv_state_indices_int64",
        _set(conv_state_indices=lambda kw, d: kw["conv_state_indices"].long()),
        r"conv_state_indices",
        False,
    ),
    (
        "conv_state_indices_len",
        _set(conv_state_indices=lambda kw, d: kw["conv_state_indices"][:2]),
        r"conv_state_indices",
        False,
    ),
    (
        "num_accepted_tokens_int64",
        _set(num_accepted_tokens=lambda kw, d: _i32([1, 2, 1], d).long()),
        r"num_accepted_tokens",
        False,
    ),
    (
        "num_accepted_tokens_len",
        _set(num_accepted_tokens=lambda kw, d: _i32([1, 2], d)),
        r"num_accepted_tokens",
        False,
    ),
    (
        # speculative decoding needs W-1 + seqlen-1 columns: 3 + 3 > 5
        "spec_conv_state_too_short",
        _set(
            x=_upd_x3d(4),
            conv_state=_pool(state_len=5),
            num_accepted_tokens=lambda kw, d: _i32([1, 1, 1], d),
        ),
        r"conv_states?|num_accepted_tokens",
        False,
    ),
    (
        "query_start_loc_int64",
        _then(_varlen((2, 1, 3)), _set(query_start_loc=lambda kw, d: kw["query_start_loc"].long())),
        r"query_start_loc",
        False,
    ),
    (
        "query_start_loc_batch_mismatch",
        _varlen((2, 1, 3, 1)),
        r"query_start_loc|conv_state_indices",
        False,
    ),
    (
        "query_start_loc_with_3d_x",
        _set(x=_upd_x3d(2), query_start_loc=lambda kw, d: qsl_from_lens((2, 2, 2), d)),
        r"\bx\b|query_start_loc",
        False,
    ),
    ("activation_relu", _set(activation=lambda kw, d: "relu"), r"activation", False),
    (
        "conv_state_indices_strided",
        _set(conv_state_indices=lambda kw, d: _strided(kw["conv_state_indices"])),
        r"conv_state_indices",
        False,
    ),
    (
        "num_accepted_tokens_strided",
        _set(num_accepted_tokens=lambda kw, d: _strided(_i32([1, 2, 1], d))),
        r"num_accepted_tokens",
        False,
    ),
    (
        "query_start_loc_strided",
        _then(
            _varlen((2, 1, 3)),
            _set(query_start_loc=lambda kw, d: _strided(kw["query_start_loc"])),
        ),
        r"query_start_loc",
        False,
    ),
    *MARKER_ERRORS,
    # validate_data=True
    (
        "num_accepted_tokens_zero",
        _set(num_accepted_tokens=lambda kw, d: _i32([1, 0, 1], d)),
        r"num_accepted_tokens",
        True,
    ),
    (
        # history window [a-1, a-1+W-1) past state_len 8: a = 7 -> columns 6..8
        "num_accepted_tokens_past_state",
        _set(num_accepted_tokens=lambda kw, d: _i32([1, 7, 1], d)),
        r"num_accepted_tokens",
        True,
    ),
    (
        "conv_state_indices_out_of_range",
        _set(conv_state_indices=lambda kw, d: _i32([3, LINES, 1], d)),
        r"conv_state_indices",
        True,
    ),
    (
        "conv_state_indices_duplicate",
        _set(conv_state_indices=lambda kw, d: _i32([1, 2, 1], d)),
        r"conv_state_indices",
        True,
    ),
    (
        "query_start_loc_decreasing",
        _then(_varlen((2, 1, 3)), _set(query_start_loc=lambda kw, d: _i32([0, 3, 2, 6], d))),
        r"query_start_loc",
        True,
    ),
    (
        "query_start_loc_not_from_0",
        _then(_varlen((2, 1, 3)), _set(query_start_loc=lambda kw, d: _i32([1, 3, 4, 6], d))),
        r"query_start_loc",
        True,
    ),
    (
        "query_start_loc_last_not_num_tokens",
        _then(_varlen((2, 1, 3)), _set(query_start_loc=lambda kw, d: _i32([0, 2, 3, 5], d))),
        r"query_start_loc",
        True,
    ),
]


def _expect_value_error(op, kw, pattern, validate_data, pool_name):
    pool = kw[pool_name]
    pool_before = pool.clone()
    with pytest.raises(ValueError) as err:
        op(**kw, validate_data=validate_data)
    msg = str(err.value)
    assert re.search(pattern, msg), f"message does not name the argument ({pattern}): {msg}"
    assert torch.equal(pool, pool_before), "the state pool changed on a rejected call"


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
