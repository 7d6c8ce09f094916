"""The launch plans behind a repeated eager call (causal_conv1d_host.py): checks and reuse.

A plan skips the checks a call with the same layout has passed before, and launches the
compiled kernel directly. These tests pin down that it changes nothing else: every bad
argument is still refused after a good call warmed the plan, and plans serve other
tensors, steps and batches of their layout with the right results. The launches
themselves are in test_causal_conv1d_host_launch.py.
"""

from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.mamba.ops import causal_conv1d as ops
from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
    PAD_SLOT_ID,
    causal_conv1d_fn,
    causal_conv1d_ref,
    causal_conv1d_update,
    causal_conv1d_update_ref,
    compute_causal_conv1d_metadata,
)
from vllm.triton_utils.host import PlanCache

from . import conv_error_cases as errors
from .conv_utils import (
    assert_close,
    gen_for,
    i32,
    make_bias,
    make_pool,
    make_weight,
    make_x,
    qsl_from_lens,
    randn,
)

FP32 = torch.float32

pytestmark = pytest.mark.usefixtures("fresh_plans")


# --- checks are never skipped wrongly ---------------------------------------------------


def _warm_then_expect_error(op, good, bad, pattern, validate, pool_name):
    op(**good)  # builds the plan for the good layout
    op(**good)  # and serves a call from it
    errors._expect_value_error(op, bad, pattern, validate, pool_name)


@pytest.mark.parametrize(
    "mutate,pattern,validate",
    [e[1:] for e in errors.FN_ERRORS],
    ids=[e[0] for e in errors.FN_ERRORS],
)
@pytest.mark.parametrize("with_meta", [False, True], ids=["nometa", "meta"])
def test_fn_errors_after_a_warm_plan(mutate, pattern, validate, with_meta, device):
    good = errors.fn_kwargs(device)
    if with_meta:
        good["metadata"] = compute_causal_conv1d_metadata(good["query_start_loc"].cpu(), device)
    bad = mutate({**good, "conv_states": good["conv_states"].clone()}, device)
    _warm_then_expect_error(causal_conv1d_fn, good, bad, pattern, validate, "conv_states")


@pytest.mark.parametrize(
    "mutate,pattern,validate",
    [e[1:] for e in errors.UPDATE_ERRORS],
    ids=[e[0] for e in errors.UPDATE_ERRORS],
)
def test_update_errors_after_a_warm_plan(mutate, pattern, validate, device):
    good = errors.update_kwargs(device)
    bad = mutate({**good, "conv_state": good["conv_state"].clone()}, device)
    _warm_then_expect_error(causal_conv1d_update, good, bad, pattern, validate, "conv_state")


def test_fn_per_step_checks_after_a_warm_plan(device):
    """What the fn plan checks on every call: the index arrays' lengths against this step's
    batch, the default lines against the pool, and the metadata against this step."""
    good = errors.fn_kwargs(device)
    meta = compute_causal_conv1d_metadata(good["query_start_loc"].cpu(), device)
    causal_conv1d_fn(**good, metadata=meta)
    four = qsl_from_lens((3, 1, 1, 1), device)  # one more sequence than the index arrays
    with pytest.raises(ValueError, match="cache_indices"):
        causal_conv1d_fn(**{**good, "query_start_loc": four})
    four_lines = i32([3, 0, 1, 2], device)
    with pytest.raises(ValueError, match="has_initial_state"):
        causal_conv1d_fn(**{**good, "query_start_loc": four, "cache_indices": four_lines})
    with pytest.raises(ValueError, match="metadata"):
        causal_conv1d_fn(**good, metadata=compute_causal_conv1d_metadata(four.cpu(), device))
    # default lines: a plan built with cache_indices=None and 3 sequences on 5 lines
    plain = {**good, "cache_indices": None}
    causal_conv1d_fn(**plain)
    many = qsl_from_lens((1,) * 6, device)
    x6 = make_x(errors.DIM, 6, FP32, device, gen_for("x6"))
    with pytest.raises(ValueError, match="cache_indices"):
        causal_conv1d_fn(**{**plain, "x": x6, "query_start_loc": many, "has_initial_state": None})


@pytest.mark.parametrize("op_name", ["fn", "update"])
def test_python_values_are_keyed_by_type(op_name, device):
    """Values equal under == but of different types do not share a plan: True == 1, and the
    pad default == -1 (an explicit PAD_SLOT_ID next to a different null_block_id is an
    error, the default is not)."""
    if op_name == "fn":
        op, kw = causal_conv1d_fn, errors.fn_kwargs(device)
    else:
        op, kw = causal_conv1d_update, errors.update_kwargs(device)
    op(**kw, null_block_id=PAD_SLOT_ID)
    op(**kw, null_block_id=7)  # the default pad gives way to null_block_id
    with pytest.raises(ValueError, match="null_block_id"):
        op(**kw, pad_slot_id=PAD_SLOT_ID, null_block_id=7)
    op(**{**kw, "activation": True})
    with pytest.raises(ValueError, match="activation"):
        op(**{**kw, "activation": 1})
    op(**kw, pad_slot_id=1)
    with pytest.raises(ValueError, match="pad_slot_id"):
        op(**kw, pad_slot_id=True)


# --- plans serve other tensors and steps of their layout ---------------------------------


def test_fn_plan_serves_other_layers_and_steps(device, nan_poison):
    """One layout, several layers (other weights, pools) and steps (other token counts and
    batches, with and without padded rows): every call equals the reference, and the plan
    cache holds one plan per layout (metadata or not)."""
    dim, width, lines = 48, 4, 12
    layers = []
    for n in range(2):
        g = gen_for("layers", n)
        layers.append((make_weight(dim, width, FP32, device, g), make_bias(dim, FP32, device, g),
                       make_pool(lines, dim, width - 1, FP32, device, g)))  # fmt: skip
    for step, lens in enumerate([(5, 1, 1), (1,) * 7, (40, 2), (3, 0, 9, 1, 1)]):
        g = gen_for("steps", step)
        qsl = qsl_from_lens(lens, device)
        meta = compute_causal_conv1d_metadata(qsl.cpu(), device)
        idx = torch.randperm(lines, generator=g)[: len(lens) + 2].to(torch.int32).to(device)
        idx[1] = PAD_SLOT_ID
        init = (torch.rand(len(lens), generator=g) < 0.5).to(device)
        for weight, bias, pool in layers:
            x = make_x(dim, sum(lens), FP32, device, g, noncontig=True)
            for metadata in (meta, None):
                ref_pool = pool.clone()
                ref = causal_conv1d_ref(x, weight, bias, ref_pool, qsl, idx[: len(lens)], init)
                out = causal_conv1d_fn(x, weight, bias, pool, qsl, idx, init, metadata=metadata)
                assert_close(out, ref, msg=f"step {step}")
                assert torch.equal(pool, ref_pool)
    assert len(ops._FWD_PLANS) == 2


@pytest.mark.parametrize("mode", ["tok", "spec", "varlen"])
def test_update_plan_serves_other_layers(mode, device, nan_poison):
    dim, width = 40, 4
    state_len = width - 1 + (2 if mode == "spec" else 0)
    for layer in range(3):
        g = gen_for("upd-layers", mode, layer)
        weight, bias = make_weight(dim, width, FP32, device, g), make_bias(dim, FP32, device, g)
        pool = make_pool(8, dim, state_len, FP32, device, g)
        acc = qsl = None
        if mode == "tok":
            x = randn((3, dim), g, FP32, device)
        elif mode == "spec":
            x = randn((3, 3, dim), g, FP32, device).transpose(1, 2)
            acc = i32([1, 3, 2], device)
        else:
            x = randn((6, dim), g, FP32, device)
            qsl = qsl_from_lens((2, 3, 1), device)
        idx = i32([5, PAD_SLOT_ID, 2], device)
        ref_pool = pool.clone()
        ref = causal_conv1d_update_ref(x, ref_pool, weight, bias, "silu", idx, acc, qsl)
        out = causal_conv1d_update(x, pool, weight, bias, "silu", idx, acc, qsl, 3)
        assert_close(out, ref)
        assert torch.equal(pool, ref_pool)
    assert len(ops._UPDATE_PLANS) == 1


def test_plan_cache_is_bounded():
    cache = PlanCache(max_size=3)
    for n in range(7):
        cache.put(n, object())
        assert len(cache) <= 3
    assert 6 in cache
