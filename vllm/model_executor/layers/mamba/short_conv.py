"""ShortConv: LFM2's gated short convolution over a continuous-batching step.

    in_proj -> B | C | x (each hidden wide) -> Bx = B * x
            -> causal depthwise conv1d of width L over Bx, no activation (state per sequence)
            -> y = C * conv(Bx) -> out_proj

Tokens of all sequences come concatenated, (num_tokens, hidden), in the canonical order of
``Mamba2Metadata`` (decode stream, prefills, other padding), read from the forward
context: the layer reuses the Mamba2 step metadata for its conv (query_start_loc, each
row's pool line, has_initial_state, the conv kernels' metadata). The whole step is ONE
``causal_conv1d_fn`` launch over the (dim, tokens) transpose of Bx (a view); a
decode-only step goes through ``causal_conv1d_update``.

State: a conv state only, (dim, L-1) per line, declared as a ``MambaStateSpec`` whose SSM
part has no elements (``NO_SSM_STATE``), so the engine's state pool allocates, zeroes and
binds it like a Mamba2 layer's; ``kv_cache`` = (conv_state, empty ssm view). Line 0 is
the null line: padded rows read and write no line, and rows after the decode stream and
the prefills get y = 0. A mixed step padded to a CUDA-graph bucket (``mamba2_padded``) runs
the same conv launch over the bucket's rows and keeps every row's y.

The conv always runs on the Triton ops (``VLLM_USE_TRITON_CONV1D`` picks MambaMixer2's
backend only), so the pool is in the Triton layout (feature-contiguous lines).

Tensor parallelism: every tensor is cut by channels. in_proj is a
``MergedColumnParallelLinear`` of B | C | x (this rank's channels of each), the conv
weights and bias this rank's channels, out_proj row-parallel (the layer's one
all-reduce); the state lines hold this rank's channels. ``hidden_size`` must divide by
the world size (``short_conv_tp_problems``).
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.cache_spec import MambaStateSpec
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    RowShards,
)
from vllm.model_executor.layers.mamba.mamba2_metadata import check_layer_inputs
from vllm.model_executor.layers.mamba.mamba_tp import DepthwiseConvWeights
from vllm.model_executor.layers.mamba.mamba_utils import ConvBackend, check_conv_state_layout
from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
    NULL_BLOCK_ID,
    causal_conv1d_fn,
    causal_conv1d_update,
)

# The SSM part of a conv-only state: no elements (the pool allocates it empty).
NO_SSM_STATE = (0, 0, 0)


def short_conv_tp_problems(hidden_size: int, tp_size: int, name: str = "hidden_size") -> list[str]:
    """Why a short-conv layer of ``hidden_size`` channels cannot shard over ``tp_size``
    ranks (empty: it can)."""
    if hidden_size % tp_size:
        return [
            f"{name}={hidden_size} is not divisible by tp_size={tp_size} (the short-conv "
            "layers split their channels)"
        ]
    return []


class ShortConv(nn.Module):
    """One LFM2 short-conv layer (this rank's channels of it). Parameter names follow HF
    transformers' ``Lfm2ShortConv`` but for the conv, ``conv1d`` (HF: ``conv``), stored as
    (dim, width); ``bias`` covers in_proj, out_proj and the conv, as HF's ``conv_bias``."""

    def __init__(
        self,
        hidden_size: int,
        conv_kernel: int,
        bias: bool,
        dtype: torch.dtype | None = None,
        layer_idx: int = 0,
    ):
        super().__init__()
        if not 2 <= conv_kernel <= 8:
            raise ValueError(f"conv_kernel={conv_kernel}: the conv kernels take widths 2..8")
        self.layer_idx = layer_idx
        self.hidden_size = hidden_size
        self.conv_kernel = conv_kernel
        self.in_proj = MergedColumnParallelLinear(
            hidden_size, [hidden_size] * 3, bias=bias, dtype=dtype
        )
        channels = RowShards([hidden_size])
        self.dim = channels.local_size
        self.conv1d = DepthwiseConvWeights(channels, conv_kernel, bias, dtype)
        self.out_proj = RowParallelLinear(hidden_size, hidden_size, bias=bias, dtype=dtype)
        self.backend = ConvBackend.TRITON
        # (conv_state, empty ssm view): this layer's views of the state pool.
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.dim, self.conv_kernel - 1)

    def get_state_spec(self, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> MambaStateSpec:
        """One state line: the conv state (dim, L-1) in ``conv_dtype``; no SSM state."""
        return MambaStateSpec(self.conv_shape, conv_dtype, NO_SSM_STATE, ssm_dtype)

    def set_conv_backend(self, backend: ConvBackend) -> None:
        if backend is not ConvBackend.TRITON:
            raise ValueError(
                f"ShortConv (layer {self.layer_idx}) runs on the Triton conv ops only, got "
                f"conv backend {backend.value!r}"
            )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states (num_tokens, hidden) -> (num_tokens, hidden); updates the bound
        conv state's lines of the step's sequences."""
        conv_state = self._bound_state()
        md = get_forward_context().mamba2_metadata
        self._check_inputs(hidden_states, conv_state, md)
        b, c, x = self.in_proj(hidden_states).split(self.dim, dim=-1)
        bx = b * x  # (num_tokens, dim), row-major: its transpose is feature-contiguous
        w, bias = self.conv1d.weight, self.conv1d.bias
        if md.decode_only:
            conv = causal_conv1d_update(
                bx,
                conv_state,
                w,
                bias,
                activation=None,
                conv_state_indices=md.state_indices,
                pad_slot_id=NULL_BLOCK_ID,
            )
        else:
            conv = causal_conv1d_fn(
                bx.t(),
                w,
                bias,
                conv_state,
                md.query_start_loc,
                cache_indices=md.state_indices,
                has_initial_state=md.has_initial_state,
                activation=None,
                pad_slot_id=NULL_BLOCK_ID,
                metadata=md.conv,
            ).t()
        y = c * conv
        real = md.num_decode_tokens + md.num_prefill_tokens
        if real < y.shape[0] and not md.padded_to_bucket:
            # Padding after the real rows. A step padded to a graph bucket counts its
            # prefill rows in none of these (mamba2_padded): the conv computed every row
            # there, its padded tokens from a zero state on the null line.
            y[real:] = 0
        return self.out_proj(y)

    def _bound_state(self) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError(
                f"ShortConv (layer {self.layer_idx}): no state is bound; the engine binds "
                "the layer's views of the state pool to kv_cache (bind_kv_cache; "
                "model.allocate_state_pool does it for callers without one)"
            )
        return self.kv_cache[0]

    def _check_inputs(self, hidden_states, conv_state, md) -> None:
        where = f"ShortConv (layer {self.layer_idx})"
        check_layer_inputs(where, hidden_states, self.hidden_size, md)
        if conv_state.dim() != 3 or tuple(conv_state.shape[1:]) != self.conv_shape:
            raise ValueError(
                f"{where}: conv_state must be (lines, {self.dim}, {self.conv_kernel - 1}), "
                f"got {tuple(conv_state.shape)}"
            )
        check_conv_state_layout(conv_state, self.backend)
