"""Rotary position embedding (RoPE) for the attention layers of hybrid models.

For a token at position p and the first ``rotary_dim`` dims x of a head (the rest pass
through unchanged), with ``inv_freq[i] = 1 / base ** (2i / rotary_dim)`` and
``theta = p * inv_freq`` (rotary_dim / 2 angles):

- neox style (HF transformers' ``rotate_half``, as Bamba and Zamba2 use it): the halves
  x1 = x[:r/2], x2 = x[r/2:] turn as pairs (x1[i], x2[i]):
  ``out = x * cat(cos, cos) + cat(-x2, x1) * cat(sin, sin)``;
- GPT-J style (``is_neox_style=False``): adjacent dims (x[2i], x[2i+1]) turn together.

Numerics follow transformers exactly: angles and cos/sin in fp32 (the same products
HF's rotary embedding computes), cos/sin then cast to ``dtype`` (None: the query's dtype,
as HF does) and the products done in that dtype; outputs come back in the query's dtype.
So in fp32 the result is bit-identical to HF's ``apply_rotary_pos_emb``.

Positions index a cos/sin table of ``max_position_embeddings`` rows built once; a
position outside it is an indexing error (on CUDA, a device-side assert).
"""

from __future__ import annotations

import torch
from torch import nn


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool = True,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.head_size = _check_int("head_size", head_size, 2)
        self.rotary_dim = _check_int("rotary_dim", rotary_dim, 2)
        if rotary_dim > head_size or rotary_dim % 2:
            raise ValueError(
                f"rotary_dim must be even and <= head_size={head_size}, got {rotary_dim}"
            )
        self.max_position_embeddings = _check_int(
            "max_position_embeddings", max_position_embeddings, 1
        )
        if not float(base) > 0:
            raise ValueError(f"base must be > 0, got {base!r}")
        self.base = float(base)
        self.is_neox_style = bool(is_neox_style)
        self.dtype = dtype
        # Built on the default device (a `with torch.device(...)` block the loader opens).
        self.register_buffer("cos_sin_cache", self._table(None), persistent=False)

    def _table(self, device: torch.device | None) -> torch.Tensor:
        """(max_position_embeddings, rotary_dim) fp32: cos of the angles, then sin."""
        r = self.rotary_dim
        inv_freq = 1.0 / (
            self.base ** (torch.arange(0, r, 2, dtype=torch.float, device=device) / r)
        )
        positions = torch.arange(self.max_position_embeddings, dtype=torch.float, device=device)
        angles = positions[:, None] * inv_freq
        return torch.cat((angles.cos(), angles.sin()), dim=-1)

    def _apply(self, fn, recurse=True):
        # model.to(dtype) would round the table; it stays fp32 (rebuilt where it moved).
        super()._apply(fn, recurse)
        if self.cos_sin_cache.dtype != torch.float32:
            self.cos_sin_cache = self._table(self.cos_sin_cache.device)
        return self

    def extra_repr(self) -> str:
        return (
            f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, "
            f"max_position_embeddings={self.max_position_embeddings}, base={self.base:g}, "
            f"is_neox_style={self.is_neox_style}"
        )

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (T, heads, head_size); cos and sin (T, 1, rotary_dim // 2) in the math dtype."""
        r = self.rotary_dim
        rot = x[..., :r].to(cos.dtype)
        if self.is_neox_style:
            x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
            cos2, sin2 = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
            out = rot * cos2 + torch.cat((-x2, x1), dim=-1) * sin2
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            cos2 = cos.repeat_interleave(2, dim=-1)
            sin2 = sin.repeat_interleave(2, dim=-1)
            out = rot * cos2 + torch.stack((-x2, x1), dim=-1).flatten(-2) * sin2
        out = out.to(x.dtype)
        if r == self.head_size:
            return out
        return torch.cat((out, x[..., r:]), dim=-1)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """positions (T,) integer; query (T, num_heads * head_size) and key (T,
        num_kv_heads * head_size), or already (T, heads, head_size). Returns new tensors
        shaped like the inputs (the inputs are not modified)."""
        if not isinstance(positions, torch.Tensor) or positions.dim() != 1:
            raise ValueError("positions must be a 1-D tensor of token positions")
        if positions.dtype.is_floating_point or positions.dtype == torch.bool:
            raise ValueError(f"positions must be an integer tensor, got {positions.dtype}")
        num_tokens = positions.shape[0]
        if self.cos_sin_cache.device != positions.device:
            # A module built off the positions' device and never moved: once, before any
            # graph capture (start-up's warm-up runs every layer eagerly first).
            self.cos_sin_cache = self._table(positions.device)
        table = self.cos_sin_cache[positions]  # (T, rotary_dim)
        dtype = self.dtype or query.dtype
        half = self.rotary_dim // 2
        cos = table[:, None, :half].to(dtype)
        sin = table[:, None, half:].to(dtype)

        def apply(name: str, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] != num_tokens or x.shape[-1] % self.head_size or x.dim() not in (2, 3):
                raise ValueError(
                    f"{name} must be (num_tokens={num_tokens}, heads * {self.head_size}) or "
                    f"(num_tokens, heads, {self.head_size}), got {tuple(x.shape)}"
                )
            if x.dim() == 3 and x.shape[-1] != self.head_size:
                raise ValueError(f"{name} head size {x.shape[-1]} != {self.head_size}")
            heads = x.view(num_tokens, -1, self.head_size) if x.dim() == 2 else x
            return self._rotate(heads, cos, sin).view(x.shape)

        return apply("query", query), None if key is None else apply("key", key)


def get_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    is_neox_style: bool = True,
    rope_scaling: dict | None = None,
    dtype: torch.dtype | None = None,
    partial_rotary_factor: float = 1.0,
) -> RotaryEmbedding:
    """A RotaryEmbedding for these parameters (a new module per call: a module shared
    between models would move with whichever model moved last).

    ``partial_rotary_factor`` scales ``rotary_dim`` (HF configs: Bamba's is 0.5). Only
    plain RoPE is supported: ``rope_scaling`` None or of type "default"; other types are
    a ValueError naming the type.
    """
    if rope_scaling is not None:
        kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        if kind != "default":
            raise ValueError(f"rope_scaling type {kind!r} is not supported (only 'default')")
    if not 0.0 < partial_rotary_factor <= 1.0:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {partial_rotary_factor}")
    rotary_dim = int(rotary_dim * partial_rotary_factor)
    return RotaryEmbedding(head_size, rotary_dim, max_position, base, is_neox_style, dtype)
