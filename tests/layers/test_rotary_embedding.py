"""RotaryEmbedding against transformers' own rotary code (bit-identical, every dtype).

Bamba's rotary embedding (partial: its config fixes partial_rotary_factor = 0.5) and
apply_rotary_pos_emb, Llama's (full rotary, the rotate_half convention Zamba2 shares), and
GPT-J's interleaved style for ``is_neox_style=False``.
"""

from __future__ import annotations

import pytest
import torch
from transformers import BambaConfig, GPTJConfig, LlamaConfig
from transformers.models.bamba import modeling_bamba
from transformers.models.gptj import modeling_gptj
from transformers.models.llama import modeling_llama

from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding, get_rope

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in (FP32, FP16, BF16)]


def _inputs(num_tokens, heads, kv_heads, head_size, dtype, max_pos, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Positions as a mixed step has them: a chunk, decodes far along, a fresh prompt.
    positions = torch.cat(
        [torch.arange(37, 37 + num_tokens - 4), torch.tensor([max_pos - 1, 5, 0, 0])]
    )
    q = torch.randn(num_tokens, heads * head_size, generator=g).to(dtype)
    k = torch.randn(num_tokens, kv_heads * head_size, generator=g).to(dtype)
    return positions, q, k


def _hf_neox(rotary_cls, apply_fn, config, positions, q, k, heads, kv_heads, head_size):
    """HF's layout: (batch=1, heads, T, head_size), cos/sin from the model's rotary class."""
    cos, sin = rotary_cls(config)(q, positions[None])
    q4 = q.view(1, -1, heads, head_size).transpose(1, 2)
    k4 = k.view(1, -1, kv_heads, head_size).transpose(1, 2)
    q_hf, k_hf = apply_fn(q4, k4, cos, sin)
    return (
        q_hf.transpose(1, 2).reshape(q.shape),
        k_hf.transpose(1, 2).reshape(k.shape),
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_bamba_partial_rotary_matches_transformers(dtype):
    heads, kv_heads, head_size, max_pos = 4, 2, 64, 512
    config = BambaConfig(
        hidden_size=heads * head_size,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    )
    factor = config.rope_parameters["partial_rotary_factor"]
    assert factor == 0.5
    rope = get_rope(head_size, head_size, max_pos, 5000.0, partial_rotary_factor=factor)
    assert rope.rotary_dim == 32
    positions, q, k = _inputs(11, heads, kv_heads, head_size, dtype, max_pos)
    q0, k0 = q.clone(), k.clone()
    q_ours, k_ours = rope(positions, q, k)
    q_hf, k_hf = _hf_neox(
        modeling_bamba.BambaRotaryEmbedding,
        modeling_bamba.apply_rotary_pos_emb,
        config,
        positions,
        q,
        k,
        heads,
        kv_heads,
        head_size,
    )
    assert torch.equal(q_ours, q_hf) and torch.equal(k_ours, k_hf)
    assert torch.equal(q_ours[:, 32:64], q[:, 32:64])  # the pass-through dims of head 0
    assert torch.equal(q, q0) and torch.equal(k, k0)  # inputs untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 80, 128])
def test_full_rotary_matches_transformers(dtype, head_size):
    heads, kv_heads, max_pos = 2, 1, 256
    config = LlamaConfig(
        hidden_size=heads * head_size,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    rope = RotaryEmbedding(head_size, head_size, max_pos, 10000.0, is_neox_style=True)
    positions, q, k = _inputs(9, heads, kv_heads, head_size, dtype, max_pos, seed=head_size)
    q_ours, k_ours = rope(positions, q, k)
    q_hf, k_hf = _hf_neox(
        modeling_llama.LlamaRotaryEmbedding,
        modeling_llama.apply_rotary_pos_emb,
        config,
        positions,
        q,
        k,
        heads,
        kv_heads,
        head_size,
    )
    assert torch.equal(q_ours, q_hf) and torch.equal(k_ours, k_hf)


@pytest.mark.parametrize("rotary_dim", [64, 16])
def test_gptj_style_matches_transformers(rotary_dim):
    heads, head_size, max_pos = 3, 64, 128
    config = GPTJConfig(
        n_embd=heads * head_size, n_head=heads, rotary_dim=rotary_dim, n_positions=max_pos
    )
    rope = RotaryEmbedding(head_size, rotary_dim, max_pos, 10000.0, is_neox_style=False)
    positions, q, k = _inputs(7, heads, heads, head_size, FP32, max_pos, seed=rotary_dim)
    q_ours, _ = rope(positions, q)
    # GPT-J's attention: sin|cos table rows at the positions, rotate the first rotary_dim dims.
    table = modeling_gptj.create_sinusoidal_positions(config.n_positions, rotary_dim)
    sin, cos = torch.split(table[positions][None], rotary_dim // 2, dim=-1)
    q4 = q.view(1, -1, heads, head_size)
    q_rot = modeling_gptj.apply_rotary_pos_emb(q4[..., :rotary_dim], sin, cos)
    q_hf = torch.cat([q_rot, q4[..., rotary_dim:]], dim=-1).reshape(q.shape)
    torch.testing.assert_close(q_ours, q_hf, atol=1e-6, rtol=1e-6)


def test_three_dim_inputs_and_no_key():
    rope = RotaryEmbedding(32, 32, 64, 10000.0)
    positions, q, k = _inputs(6, 2, 1, 32, FP32, 64)
    q_flat, k_flat = rope(positions, q, k)
    q3, k3 = rope(positions, q.view(6, 2, 32), k.view(6, 1, 32))
    assert q3.shape == (6, 2, 32) and torch.equal(q3.reshape(6, 64), q_flat)
    assert torch.equal(k3.reshape(6, 32), k_flat)
    q_only, none = rope(positions, q)
    assert none is None and torch.equal(q_only, q_flat)


def test_position_zero_is_identity_and_rotation_is_relative():
    """At position 0 nothing turns; q(p) . k(p') depends on p - p' only."""
    rope = RotaryEmbedding(16, 16, 100, 10000.0)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 16, generator=g), torch.randn(1, 16, generator=g)
    assert torch.equal(rope(torch.tensor([0]), q)[0], q)
    dots = []
    for p in (3, 40, 90):
        qp, kp = rope(torch.tensor([p]), q, k)
        _, kp0 = rope(torch.tensor([p - 3]), q, k)
        dots.append(float((qp * kp0).sum()))
    assert max(dots) - min(dots) < 1e-4


def test_dtype_cast_keeps_fp32_table():
    rope = RotaryEmbedding(32, 16, 64, 10000.0)
    table = rope.cos_sin_cache.clone()
    rope.to(torch.bfloat16)
    assert rope.cos_sin_cache.dtype == FP32 and torch.equal(rope.cos_sin_cache, table)


def test_math_dtype():
    """dtype=fp32 does the products in fp32 (then casts once), unlike HF's default."""
    rope32 = RotaryEmbedding(32, 32, 64, 10000.0, dtype=FP32)
    positions, q, _ = _inputs(6, 2, 1, 32, FP16, 64)
    out, _ = rope32(positions, q)
    exact, _ = RotaryEmbedding(32, 32, 64, 10000.0)(positions, q.float())
    assert out.dtype == FP16 and torch.equal(out, exact.half())


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        ((64, 65, 128, 1e4), {}, "rotary_dim must be even and <= head_size=64"),
        ((64, 31, 128, 1e4), {}, "rotary_dim must be even"),
        ((64, 64, 0, 1e4), {}, "max_position_embeddings must be an int >= 1"),
        ((64, 64, 128, -1.0), {}, "base must be > 0"),
    ],
)
def test_bad_construction(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        RotaryEmbedding(*args, **kwargs)


def test_get_rope_errors():
    with pytest.raises(ValueError, match="rope_scaling type 'yarn' is not supported"):
        get_rope(64, 64, 128, 1e4, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="partial_rotary_factor must be in"):
        get_rope(64, 64, 128, 1e4, partial_rotary_factor=0.0)
    assert get_rope(64, 64, 128, 1e4, rope_scaling={"rope_type": "default"}).rotary_dim == 64


def test_bad_forward_inputs():
    rope = RotaryEmbedding(32, 32, 64, 10000.0)
    positions, q, k = _inputs(6, 2, 1, 32, FP32, 64)
    with pytest.raises(ValueError, match="positions must be an integer tensor"):
        rope(positions.float(), q, k)
    with pytest.raises(ValueError, match=r"query must be \(num_tokens=6, heads \* 32\)"):
        rope(positions, q[:, :40], k)
    with pytest.raises(ValueError, match="key must be"):
        rope(positions, q, k[:5])
