"""causal_conv1d_update (decode and speculative decode) vs the fp32 reference.

Speculative decoding follows the cache-line convention of causal_conv1d_ref.py: the
history a step starts from is ``line[:, a-1 : a-1 + W-1]`` with ``a`` the number of
tokens of the previous step that were accepted. The invariant tests replay only the
accepted tokens as a plain (non-speculative) sequence and demand the same outputs and
the same history.
"""

from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
    PAD_SLOT_ID,
    causal_conv1d_update,
    causal_conv1d_update_ref,
)

from .conv_cases import UpdCase, build_update_inputs, make_update_x
from .conv_utils import (
    assert_close,
    assert_no_nan,
    gen_for,
    make_bias,
    make_pool,
    make_weight,
    qsl_from_lens,
)

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
gpu = pytest.mark.gpu


def _case(*args, marks=(), **kwargs):
    c = UpdCase(*args, **kwargs)
    return pytest.param(c, id=c.id, marks=marks)


UPD_CASES = [
    *[_case("tok", (1,) * 5, 64, w, FP32, pads=(1,) if w % 2 else ()) for w in range(2, 9)],
    _case("tok", (1,) * 3, 2064, 4, FP16, pads=(2,)),
    _case("tok", (1,) * 2, 4128, 3, FP32),
    _case("tok", (1,) * 4, 64, 4, FP16, state_dtype=FP32),
    _case("tok", (1,) * 4, 64, 5, FP32, state_dtype=FP16, pads=(0,)),
    _case("tok", (1,) * 3, 64, 4, FP32, default_indices=True),
    _case("tok", (1,) * 3, 64, 4, FP16, noncontig=True, pads=(1,)),
    _case("tok", (1,) * 3, 64, 4, FP32, state_len=6),
    _case("tok", (1,) * 3, 64, 3, FP32, bias=False, activation=None),
    _case("multi", (4,) * 3, 64, 4, FP32, pads=(1,)),
    _case("multi", (2,) * 2, 64, 6, FP16),
    _case("multi", (3,) * 3, 64, 2, FP32, state_dtype=FP16, activation="swish"),
    _case("multi", (5,) * 2, 2064, 5, FP32, noncontig=True),
    # CUDA-graph padding: zero-length rows at the end with PAD_SLOT_ID
    _case("varlen", (3, 1, 4, 1, 0, 0), 64, 4, FP32, pads=(1, 4, 5)),
    _case("varlen", (2, 5, 1), 64, 5, FP16, pads=(0,)),
    _case("varlen", (3, 0, 2), 64, 3, FP32),  # a real zero-length row keeps its line
    _case("varlen", (1, 6, 2), 64, 8, FP32, state_dtype=FP16, noncontig=True),
    # more tokens than one token tile of the kernel
    _case("multi", (10,) * 2, 64, 4, FP32),
    _case("varlen", (11, 1, 3), 64, 3, FP16, pads=(1,)),
    # speculative decoding: history read at column num_accepted - 1
    _case("multi", (3,) * 3, 64, 4, FP32, accepted=(1, 3, 2)),
    _case("tok", (1,) * 4, 64, 5, FP32, accepted=(1, 2, 3, 1), pads=(2,)),  # zero drafts
    _case("varlen", (3, 1, 4, 0), 64, 4, FP16, accepted=(2, 1, 4, 1), pads=(3,)),
    _case("varlen", (2, 2, 1), 64, 6, FP32, accepted=(2, 1, 1), state_len=9),
    _case("multi", (3,) * 2, 64, 5, FP16, state_dtype=FP32, accepted=(3, 1)),
    _case("varlen", (11, 1, 3), 64, 3, FP32, accepted=(1, 9, 2)),
    # GPU only
    _case("tok", (1,) * 8, 4128, 4, BF16, pads=(3,), marks=gpu),
    _case("multi", (4,) * 4, 2064, 5, BF16, state_dtype=FP32, accepted=(1, 4, 2, 3), marks=gpu),
    _case("varlen", (7, 1, 0, 3, 0), 4128, 8, BF16, pads=(2, 4), marks=gpu),
]


def _rows(case: UpdCase, out: torch.Tensor, b: int) -> torch.Tensor:
    """Sequence b's outputs, as (dim, tokens)."""
    if case.mode == "tok":
        return out[b, :, None]
    if case.mode == "multi":
        return out[b]
    start = sum(case.seqlens[:b])
    return out[start : start + case.seqlens[b]].t()


@pytest.mark.parametrize("case", UPD_CASES)
def test_update_vs_ref(case: UpdCase, device, nan_poison):
    inp = build_update_inputs(case, device)
    x_before, pool_before, ref_pool = inp.x.clone(), inp.pool.clone(), inp.pool.clone()
    ref = causal_conv1d_update_ref(
        inp.x, ref_pool, inp.weight, inp.bias, case.activation, inp.indices, inp.accepted, inp.qsl
    )
    out = causal_conv1d_update(
        inp.x,
        inp.pool,
        inp.weight,
        inp.bias,
        activation=case.activation,
        conv_state_indices=inp.indices,
        num_accepted_tokens=inp.accepted,
        query_start_loc=inp.qsl,
        max_query_len=max(case.seqlens) if inp.qsl is not None else -1,
    )
    assert torch.equal(inp.x, x_before), "x was modified"
    assert out.shape == inp.x.shape and out.dtype == inp.x.dtype
    assert out.stride(1) == 1, "out must be feature-contiguous"
    assert_no_nan(out)
    assert_close(out, ref)
    for b in case.pads:
        rows = _rows(case, out, b)
        assert torch.equal(rows, torch.zeros_like(rows)), f"pad row {b} not zero"
    assert torch.equal(inp.pool, ref_pool), "states differ from the reference"
    used = {line for line in inp.lines if line != PAD_SLOT_ID}
    for line in range(inp.pool.shape[0]):
        if line not in used:
            assert torch.equal(inp.pool[line], pool_before[line]), f"untouched line {line} changed"


def test_update_bool_activation(device, nan_poison):
    case = UpdCase("tok", (1,) * 3, 64, 4, FP32)
    inp = build_update_inputs(case, device)
    for activation in (True, False):
        ref_pool = inp.pool.clone()
        ref = causal_conv1d_update_ref(
            inp.x, ref_pool, inp.weight, inp.bias, activation, inp.indices
        )
        out = causal_conv1d_update(inp.x, inp.pool, inp.weight, inp.bias, activation, inp.indices)
        assert_close(out, ref)
        assert torch.equal(inp.pool, ref_pool)


# --- speculative decoding invariants ----------------------------------------------------


def run_spec_steps(steps, init_accepted, width, dtype, state_dtype, device, key, mode="auto"):
    """Drive causal_conv1d_update over speculative steps and check the replay invariant.

    ``steps``: list of (lens, accepted_after), one entry per sequence: the tokens the step
    feeds (1 + drafts) and how many of them the verifier accepts (1..lens). Each step is
    checked three ways: (1) outputs and states equal the speculative reference; (2) every
    token's output equals the plain reference run over the accepted history plus the
    step's tokens; (3) after the last step, for every possible number of accepted tokens
    ``a``, the window the next step would read, ``line[:, a-1 : a-1+W-1]``, holds the last
    W-1 inputs of the accepted history extended by a tokens, bit for bit.
    A padded row (PAD_SLOT_ID) rides along in every call.
    """
    g = gen_for(key)
    dim, w1 = 64, width - 1
    batch = len(init_accepted)
    max_len = max(max(lens) for lens, _ in steps)
    state_len = w1 + max(max_len, max(init_accepted)) - 1 + 1  # one spare column
    weight = make_weight(dim, width, dtype, device, g)
    bias = make_bias(dim, dtype, device, g)
    num_lines = batch + 2
    pool = make_pool(num_lines, dim, state_len, state_dtype, device, g)
    perm = torch.randperm(num_lines, generator=g)
    lines = perm[perm != 0][:batch].tolist()  # line 0 is the null line
    spare_lines = [i for i in range(num_lines) if i not in lines]
    pool_before = pool.clone()
    ref_pool = pool.clone()
    hist = [
        pool[lines[b], :, init_accepted[b] - 1 : init_accepted[b] - 1 + w1].clone()
        for b in range(batch)
    ]
    num_accepted = list(init_accepted)
    for step, (lens, accepted_after) in enumerate(steps):
        # the call's rows: the sequences, then a padded row
        call_lens = list(lens) + [lens[0]]
        call_lines = lines + [PAD_SLOT_ID]
        call_acc = num_accepted + [1]
        uniform = len(set(call_lens)) == 1
        step_mode = mode if mode != "auto" else ("tok" if call_lens[0] == 1 else "multi")
        if not uniform:
            step_mode = "varlen"
        x = make_update_x(step_mode, call_lens, dim, dtype, device, g)
        case = UpdCase(step_mode, tuple(call_lens), dim, width, dtype)
        qsl = qsl_from_lens(call_lens, device) if step_mode == "varlen" else None
        idx = torch.tensor(call_lines, dtype=torch.int32, device=device)
        acc = torch.tensor(call_acc, dtype=torch.int32, device=device)
        ref_out = causal_conv1d_update_ref(x, ref_pool, weight, bias, "silu", idx, acc, qsl)
        out = causal_conv1d_update(
            x,
            pool,
            weight,
            bias,
            "silu",
            idx,
            acc,
            qsl,
            max_query_len=max(call_lens) if qsl is not None else -1,
        )
        tag = f"step {step}"
        assert_no_nan(out)
        assert_close(out, ref_out, msg=tag)
        assert torch.equal(pool, ref_pool), f"{tag}: states differ from the reference"
        assert not _rows(case, out, batch).any(), f"{tag}: pad row not zero"
        for b in range(batch):
            xb = _rows(case, x, b)
            # plain replay: history = the accepted inputs so far, no speculation
            scratch = hist[b][None].clone()
            plain = causal_conv1d_update_ref(xb[None], scratch, weight, bias, "silu")
            assert_close(_rows(case, out, b), plain[0], msg=f"{tag}, sequence {b}")
            if step == len(steps) - 1:
                for a in range(1, lens[b] + 1):
                    ext = torch.cat([hist[b], xb[:, :a].to(state_dtype)], dim=1)[:, -w1:]
                    window = pool[lines[b], :, a - 1 : a - 1 + w1]
                    assert torch.equal(window, ext), f"{tag}, seq {b}: window for {a} accepted"
            hist[b] = torch.cat([hist[b], xb[:, : accepted_after[b]].to(state_dtype)], dim=1)
            hist[b] = hist[b][:, -w1:]
        num_accepted = list(accepted_after)
    for line in spare_lines:
        assert torch.equal(pool[line], pool_before[line]), f"untouched line {line} changed"


SPEC_PARAMS = [
    pytest.param(4, 3, FP32, FP32, id="W4_k3_fp32"),
    pytest.param(5, 2, FP16, FP16, id="W5_k2_fp16"),
    pytest.param(2, 1, FP32, FP32, id="W2_k1_fp32"),
    pytest.param(8, 2, FP16, FP32, id="W8_k2_fp16_statefp32"),
    pytest.param(4, 3, BF16, BF16, id="W4_k3_bf16", marks=gpu),
]


@pytest.mark.parametrize("width,k,dtype,state_dtype", SPEC_PARAMS)
def test_spec_every_accepted_count(width, k, dtype, state_dtype, device, nan_poison):
    """k drafts; sequence b accepts b of them (num_accepted = 1..k+1 on the next step).

    Then a step with zero drafts (one token, num_accepted from the previous step), and a
    step after it, which must read its history from column 0.
    """
    batch, n = k + 1, k + 1
    steps = [
        ([n] * batch, [b + 1 for b in range(batch)]),  # b drafts accepted
        ([n] * batch, [batch - b for b in range(batch)]),  # reads column b
        ([1] * batch, [1] * batch),  # zero drafts
        ([n] * batch, [(2 * b) % n + 1 for b in range(batch)]),  # reads column 0
    ]
    init = [(b % n) + 1 for b in range(batch)]
    run_spec_steps(steps, init, width, dtype, state_dtype, device, ("spec", width, k, dtype))


@pytest.mark.parametrize("width,k,dtype,state_dtype", SPEC_PARAMS)
def test_spec_zero_draft_step_leaves_consistent_state(
    width, k, dtype, state_dtype, device, nan_poison
):
    """After a zero-draft step the line holds the last W-1 inputs at column 0."""
    batch, n = k + 1, k + 1
    steps = [
        ([n] * batch, [b + 1 for b in range(batch)]),
        ([1] * batch, [1] * batch),  # zero drafts; final check: window of 1 at column 0
    ]
    run_spec_steps(steps, [1] * batch, width, dtype, state_dtype, device, ("zero", width, k))


@pytest.mark.parametrize(
    "width,dtype", [pytest.param(4, FP32, id="W4_fp32"), pytest.param(5, FP16, id="W5_fp16")]
)
def test_spec_varlen_mixed_draft_counts(width, dtype, device, nan_poison):
    """Varlen steps: different draft counts per sequence, zero-draft rows among them."""
    steps = [
        ([3, 1, 4, 2], [2, 1, 4, 1]),
        ([1, 4, 2, 3], [1, 3, 2, 3]),
        ([4, 2, 1, 1], [4, 1, 1, 1]),
        ([2, 3, 3, 1], [1, 2, 3, 1]),
    ]
    run_spec_steps(steps, [1, 2, 1, 3], width, dtype, dtype, device, ("varlen", width))


@pytest.mark.parametrize(
    "width,dtype", [pytest.param(4, FP32, id="W4_fp32"), pytest.param(3, FP16, id="W3_fp16")]
)
def test_update_steps_equal_plain_sequence(width, dtype, device, nan_poison):
    """Non-speculative multi-token steps (3D and varlen) chain like one long sequence."""
    g = gen_for("chain", width, dtype)
    dim, w1, batch = 64, width - 1, 3
    weight, bias = make_weight(dim, width, dtype, device, g), make_bias(dim, dtype, device, g)
    pool = make_pool(5, dim, w1, dtype, device, g)
    lines = [4, 1, 2]
    idx = torch.tensor(lines, dtype=torch.int32, device=device)
    hist = [pool[line].clone() for line in lines]
    for step, lens in enumerate([[2, 2, 2], [1, 5, 3], [1, 1, 1], [4, 1, 2]]):
        mode = "varlen" if len(set(lens)) > 1 else ("tok" if lens[0] == 1 else "multi")
        x = make_update_x(mode, lens, dim, dtype, device, g)
        qsl = qsl_from_lens(lens, device) if mode == "varlen" else None
        out = causal_conv1d_update(
            x,
            pool,
            weight,
            bias,
            "silu",
            idx,
            query_start_loc=qsl,
            max_query_len=max(lens) if qsl is not None else -1,
        )
        case = UpdCase(mode, tuple(lens), dim, width, dtype)
        for b in range(batch):
            xb = _rows(case, x, b)
            scratch = hist[b][None].clone()
            plain = causal_conv1d_update_ref(xb[None], scratch, weight, bias, "silu")
            assert_close(_rows(case, out, b), plain[0], msg=f"step {step}, seq {b}")
            hist[b] = scratch[0]
            assert torch.equal(pool[lines[b]], hist[b]), f"step {step}, seq {b}: state"
