"""Layers own their state: the cache engine allocates from the layers' specs and binds each
layer its views; every model's forward is ``forward(input_ids, positions)``."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

from tests.models.mamba2_utils import TINY
from vllm.cache_spec import AttentionSpec, MambaStateSpec
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.bamba_config import BambaModelConfig
from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig
from vllm.model_executor.models.registry import _MODELS, supported_architectures
from vllm.worker.cache_engine import CacheEngine

BAMBA = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    attn_layer_indices=(1, 3),
    num_attention_heads=4,
    num_key_value_heads=2,
    mamba_n_heads=4,
    mamba_d_head=16,
    mamba_d_state=8,
    mamba_chunk_size=8,
    max_position_embeddings=128,
)


def _engine(model, num_slots=3, replay=0) -> CacheEngine:
    return CacheEngine(
        model,
        num_slots=num_slots,
        block_size=4,
        ssm_dtype=torch.float32,
        device=torch.device("cpu"),
        replayssm_buffer_len=replay,
    )


@pytest.mark.parametrize("replay", [0, 3], ids=["every_step", "replayed"])
def test_each_mamba_layer_gets_its_slice_of_the_pool(replay):
    model = get_model(BambaModelConfig(**BAMBA), load_format="dummy", device="cpu")
    cache = _engine(model, replay=replay)
    specs = model.get_cache_specs(4, torch.float32)
    mamba = [n for n, s in specs.items() if isinstance(s, MambaStateSpec)]
    assert mamba == [n for n, m in model.named_modules() if isinstance(m, MambaMixer2)]
    assert mamba == list(cache.mamba_specs) and len(mamba) == 2
    pool = cache.mamba_pool
    for k, name in enumerate(mamba):
        layer = model.get_submodule(name)
        conv, ssm = layer.kv_cache
        state = ssm.state if replay else ssm
        # The layer's views are the pool's layer k, the same storage, not copies.
        assert conv.data_ptr() == pool.conv_state[k].data_ptr()
        assert conv.stride() == pool.conv_state[k].stride()
        assert state.data_ptr() == pool.ssm_state[k].data_ptr()
        # ... shaped as the layer declared, with the null line in front of num_slots lines.
        spec = specs[name]
        assert tuple(conv.shape) == (4, *spec.conv_shape) and conv.dtype == spec.conv_dtype
        assert tuple(state.shape) == (4, *spec.ssm_shape) and state.dtype == spec.ssm_dtype
        if replay:
            assert ssm.ring_x.data_ptr() == pool.rings["ring_x"][k].data_ptr()


def test_each_attention_layer_gets_its_kv_cache_and_rebinding_replaces_it():
    model = get_model(BambaModelConfig(**BAMBA), load_format="dummy", device="cpu")
    cache = _engine(model)
    attn = [n for n, m in model.named_modules() if isinstance(m, Attention)]
    assert attn == list(cache.attn_specs) and len(attn) == 2
    for num_blocks in (5, 9):  # the start-up cache, then the sized one
        cache.allocate_kv(num_blocks)
        for name in attn:
            spec: AttentionSpec = cache.attn_specs[name]
            kv = model.get_submodule(name).kv_cache
            assert kv is cache.kv_caches[name]
            assert tuple(kv.shape) == (2, num_blocks, 4, spec.num_kv_heads, spec.head_size)


def test_the_engine_never_hands_out_the_null_line():
    from vllm.engine.state_manager import SlotManager

    slots = SlotManager(3)
    got = {slots.allocate() for _ in range(3)}
    assert got == {1, 2, 3}, "line 0 is the null line; slots are lines 1 .. num_slots"
    model = get_model(Mamba2ModelConfig(**TINY), load_format="dummy", device="cpu")
    pool = _engine(model).mamba_pool
    assert pool.pad_line == 0 and list(pool.slots) == [1, 2, 3]
    assert pool.conv_state.shape[1] == pool.ssm_state.shape[1] == 4


def test_a_layer_without_bound_state_is_a_clear_error():
    from vllm.forward_context import ForwardContext, set_forward_context

    model = get_model(Mamba2ModelConfig(**TINY), load_format="dummy", device="cpu")
    builder = model.metadata_builder()
    md = builder.build(
        torch.tensor([0, 2], dtype=torch.int32),
        torch.tensor([1], dtype=torch.int32),
        torch.tensor([False]),
    )
    with set_forward_context(ForwardContext(mamba2_metadata=md)), torch.no_grad():
        with pytest.raises(RuntimeError, match="no state is bound"):
            model(torch.tensor([1, 2]), None)
        model.allocate_state_pool(2)
        assert model(torch.tensor([1, 2]), None).shape == (2, TINY["hidden_size"])
    with pytest.raises(RuntimeError, match="forward context"):
        model(torch.tensor([1, 2]), None)


@pytest.mark.parametrize("arch", supported_architectures())
def test_every_model_forward_is_input_ids_positions(arch):
    """No state or metadata argument: the layers read their bound states and the forward
    context (no pipeline parallelism here, so no intermediate-tensor argument either)."""
    module = _MODELS[arch][0]
    cls = getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), arch)
    params = list(inspect.signature(cls.forward).parameters)
    assert params == ["self", "input_ids", "positions"], f"{arch}.forward{params}"
