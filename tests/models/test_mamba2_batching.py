"""Batch invariants of our Mamba2 model, and the once-per-step metadata.

- a prompt split across steps (chunked prefill) == the prompt in one step;
- a mixed step (fresh prefill, continuation, decodes, padded rows), in any row order and
  with either conv backend, == each sequence run alone; slots no row names stay bit-identical;
- n_groups > 1 == an independent per-token, per-group fp32 reference (prefill + decodes);
- one metadata build per step, handed to every layer; one conv launch per layer.

Tiny fp32 models with dummy weights; the Triton conv runs under the interpreter on CPU.
The CUDA backend runs through a stand-in of ``vllm._custom_ops`` made of the references
(the real ops are compared on the GPU box).
"""

from __future__ import annotations

import pytest
import torch

from tests.models.mamba2_utils import (
    TINY,
    Driver,
    Row,
    assert_close,
    fake_cuda_ops,
    gen_for,
    install_custom_ops,
    reference_logits,
)
from vllm.forward_context import ForwardContext, set_forward_context
from vllm.model_executor.layers.mamba import mamba2_metadata, mamba_mixer2
from vllm.model_executor.layers.mamba.ops.causal_conv1d import NULL_BLOCK_ID
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig

PAD = NULL_BLOCK_ID  # padded rows point at the null line


def config(**overrides) -> Mamba2ModelConfig:
    return Mamba2ModelConfig(**{**TINY, **overrides})


def tokens(n: int, key) -> list[int]:
    return torch.randint(0, TINY["vocab_size"], (n,), generator=gen_for(key)).tolist()


@pytest.fixture(params=["triton", "cuda"], ids=["triton", "cuda_standin"])
def backend(request, monkeypatch):
    calls: list[str] = []
    if request.param == "cuda":
        install_custom_ops(monkeypatch, fake_cuda_ops(calls))
        monkeypatch.setenv("VLLM_USE_TRITON_CONV1D", "0")
    else:
        monkeypatch.setenv("VLLM_USE_TRITON_CONV1D", "1")
    return request.param, calls


def test_chunked_prefill_equals_one_prefill(device):
    model = get_model(config(n_groups=2), load_format="dummy", seed=1, device=device)
    prompt = tokens(23, "chunked")
    whole = Driver(model)
    expected = whole.step([Row(2, prompt)])[0]
    split = Driver(model)
    got, start = [], 0
    # chunk boundaries off the scan's chunk grid, and a one-token continuation (a "decode")
    for n in (5, 1, 10, 7):
        got.append(split.step([Row(2, prompt[start : start + n], start > 0)])[0])
        start += n
    assert_close(torch.cat(got), expected, "batching")
    for layer in range(model.config.num_hidden_layers):
        assert_close(split.pool.layer(layer)[0][2], whole.pool.layer(layer)[0][2], "batching")
        assert_close(split.pool.layer(layer)[1][2], whole.pool.layer(layer)[1][2], "batching")


# The mixed step: history first (each sequence alone), then one step with all rows.
HISTORY = {"cont": (1, 7), "dec_a": (2, 5), "dec_b": (4, 9)}  # name: (slot, prefix length)
MIXED = {  # name: (slot, new tokens, has_initial_state)
    "fresh": (6, 11, False),
    "cont": (1, 6, True),
    "dec_a": (2, 1, True),
    "dec_b": (4, 1, True),
}
ORDERS = {
    "decodes_first": ["dec_a", "dec_b", "pad1", "fresh", "cont", "pad3"],
    "shuffled": ["fresh", "dec_a", "pad3", "cont", "pad1", "dec_b"],
}
PADS = {"pad1": 1, "pad3": 3}  # padded rows: a one-token one and a longer one


@pytest.mark.parametrize("order", list(ORDERS))
def test_mixed_step_equals_each_sequence_alone(order, backend, device):
    name, calls = backend
    model = get_model(config(n_groups=2), load_format="dummy", seed=2, device=device)
    mixed, alone = Driver(model, num_slots=6), Driver(model, num_slots=6)
    for drv in (mixed, alone):
        for seq, (slot, n) in HISTORY.items():
            drv.step([Row(slot, tokens(n, ("hist", seq)))])
    before = mixed.pool.clone()

    rows = []
    for seq in ORDERS[order]:
        if seq in PADS:
            rows.append(Row(PAD, tokens(PADS[seq], seq), False))
        else:
            slot, n, init = MIXED[seq]
            rows.append(Row(slot, tokens(n, ("new", seq)), init))
    calls.clear()
    got = mixed.step(rows)
    if name == "cuda":
        # split: the decode stream (2 decodes + the one-token pad) and the 2 prefill rows
        assert sorted(calls) == ["fwd:17"] * 2 + ["update:3"] * 2

    for row, logits in zip(rows, got, strict=True):
        if row.slot == PAD:
            assert torch.isfinite(logits).all()
            continue
        expected = alone.step([row])[0]
        assert_close(logits, expected, "batching", msg=f"slot {row.slot}")
    for layer in range(model.config.num_hidden_layers):
        (conv, ssm), (conv_alone, ssm_alone) = mixed.pool.layer(layer), alone.pool.layer(layer)
        (conv_before, ssm_before) = before.layer(layer)
        for slot in (6, 1, 2, 4):
            assert_close(conv[slot], conv_alone[slot], "batching")
            assert_close(ssm[slot], ssm_alone[slot], "batching")
        for line in (0, 3, 5):  # the null line padded rows point at, and free slots
            assert torch.equal(conv[line], conv_before[line])
            assert torch.equal(ssm[line], ssm_before[line])


def test_grouped_model_matches_independent_reference(device):
    model = get_model(config(n_groups=2, num_heads=4), load_format="dummy", seed=3, device=device)
    seq = tokens(14, "grouped")
    drv = Driver(model)
    got = [drv.step([Row(1, seq[:11])])[0]]
    for t in seq[11:]:
        got.append(drv.step([Row(1, [t], True)])[0])
    assert_close(torch.cat(got), reference_logits(model, seq), "reference")


def test_metadata_built_once_and_shared_by_every_layer(monkeypatch, device):
    model = get_model(config(num_hidden_layers=3), load_format="dummy", seed=4, device=device)
    drv = Driver(model)
    drv.step([Row(1, tokens(4, "warm"))])

    conv_meta_builds = []
    real_compute = mamba2_metadata.conv1d_metadata_host

    def counting_compute(*args, **kwargs):
        conv_meta_builds.append(1)
        return real_compute(*args, **kwargs)

    fn_calls, update_calls = [], []
    real_fn, real_update = mamba_mixer2.causal_conv1d_fn, mamba_mixer2.causal_conv1d_update

    def spy_fn(x, *args, **kwargs):
        fn_calls.append((x, kwargs["metadata"]))
        return real_fn(x, *args, **kwargs)

    def spy_update(*args, **kwargs):
        update_calls.append(1)
        return real_update(*args, **kwargs)

    proj_outputs = []
    for layer in model.backbone.layers:
        layer.mixer.in_proj.register_forward_hook(lambda m, i, o: proj_outputs.append(o))
    monkeypatch.setattr(mamba2_metadata, "conv1d_metadata_host", counting_compute)
    monkeypatch.setattr(mamba_mixer2, "causal_conv1d_fn", spy_fn)
    monkeypatch.setattr(mamba_mixer2, "causal_conv1d_update", spy_update)

    builds = drv.builder.num_builds
    rows = [Row(1, tokens(1, "d"), True), Row(2, tokens(6, "p")), Row(PAD, [3], False)]
    md = drv.build(rows)
    ids = torch.tensor([t for r in rows for t in r.tokens], device=device)
    with torch.no_grad(), set_forward_context(ForwardContext(mamba2_metadata=md)):
        model(ids, None)
    assert drv.builder.num_builds == builds + 1 and len(conv_meta_builds) == 1
    assert len(fn_calls) == 3 and not update_calls, "one launch per layer for the whole batch"
    for (x, meta), proj in zip(fn_calls, proj_outputs, strict=True):
        assert meta is md.conv
        assert x.shape == (model.state_spec().conv_dim, 8) and x.stride(0) == 1
        assert x.untyped_storage().data_ptr() == proj.untyped_storage().data_ptr(), "x was copied"

    # a decode-only step goes through the update op, once per layer
    fn_calls.clear()
    md = drv.build([Row(1, [5], True), Row(PAD, [0], False)])
    with torch.no_grad(), set_forward_context(ForwardContext(mamba2_metadata=md)):
        model(torch.tensor([5, 0], device=device), None)
    assert not fn_calls and len(update_calls) == 3
