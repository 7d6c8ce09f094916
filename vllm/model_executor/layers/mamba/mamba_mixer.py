"""MambaMixer: the Mamba1 token mixer (MambaForCausalLM, FalconMambaForCausalLM, the Mamba
layers of JambaForCausalLM) over a continuous-batching step.

    in_proj -> x | z;  x -> causal conv1d + SiLU -> x_proj -> dt_low | B | C
            (FalconMamba: dt_low, B and C each RMS-normalised, no weight, eps mixer_rms_eps;
             Jamba: the same norms with weights, dt_layernorm, b_layernorm, c_layernorm)
            -> dt = dt_proj.weight @ dt_low;  softplus(dt + dt_proj.bias) inside the scan
            -> selective scan (state (d_inner, d_state) per sequence) + D x, times silu(z)
            -> out_proj

The scan is per channel: d_inner channels, each with its own step size and a state row of
d_state values; B and C are shared by all channels (``ops/selective_scan_ref.py`` says it
in full). Tokens come as Mamba2's layers see them: concatenated in the canonical order of
the step's ``Mamba2Metadata`` (decode stream, prefills, other padding), which the layer
reads from the forward context (a builder without chunk size: Mamba1 has no chunked scan).
The layer owns its state: ``get_state_spec`` declares a conv state (d_inner, W-1) and an
SSM state (d_inner, d_state) per line, the engine binds the layer's views of the pool to
``kv_cache`` = (conv_state, ssm_state), and the layer updates its lines in place; padded
rows (the null line, ``NULL_BLOCK_ID``) read and write no line and get y = 0. A mixed step
padded to a CUDA-graph bucket (``mamba2_padded``) scans all its rows in one selective scan
instead, the decodes as one-token sequences (``_scan_padded``).

The conv runs as in ``MambaMixer2``, by the backend ``VLLM_USE_TRITON_CONV1D`` selects:
Triton, the whole step in one ``causal_conv1d_fn`` launch (a decode-only step through
``causal_conv1d_update``); CUDA, the decode stream through the update op and the prefills
through the forward op, both writing into one step-wide buffer. Then x_proj and dt_proj
run once over the step's rows, the decode stream goes through the decode update and the
prefill rows through the varlen selective scan (initial states read from and final states
written to the pool by line).

Tensor parallelism cuts d_inner (vLLM's scheme): in_proj column-parallel over x and over z,
the conv channels, dt_proj's rows (and its bias), A and D per shard; x_proj is row-parallel
with an all-reduce (every rank needs the whole dt_low, B and C), out_proj row-parallel
(the second all-reduce). The forward splits by the local sizes, so it is the same code at
every world size. ``mamba1_tp_problems`` names the field when d_inner does not divide.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vllm.cache_spec import MambaStateSpec
from vllm.distributed.parallel_state import get_tp_group
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    RowShards,
)
from vllm.model_executor.layers.mamba.mamba2_metadata import Mamba2Metadata, check_layer_inputs
from vllm.model_executor.layers.mamba.mamba_tp import DepthwiseConvWeights, row_parameter
from vllm.model_executor.layers.mamba.mamba_utils import (
    ConvBackend,
    check_conv_state_layout,
    conv_backend_from_env,
    load_cuda_conv_ops,
)
from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
    NULL_BLOCK_ID,
    causal_conv1d_fn,
    causal_conv1d_update,
)
from vllm.model_executor.layers.mamba.ops.selective_scan import (
    chunk_plan,
    selective_scan_fn,
    selective_state_update_mamba1,
)


@dataclass(frozen=True)
class Mamba1Shape:
    """A Mamba1 mixer's sizes and settings (the whole layer's, all ranks): each Mamba1
    config's ``mamba1_shape()`` reads its fields into it. ``bcdt_rms_eps`` is FalconMamba's
    ``mixer_rms_eps`` (None: plain Mamba1, no norms on dt, B and C); ``bcdt_norm_weights``
    gives those norms weights (Jamba's, epsilon ``rms_norm_eps``)."""

    hidden_size: int
    intermediate_size: int
    state_size: int
    conv_kernel: int
    time_step_rank: int
    use_bias: bool
    use_conv_bias: bool
    bcdt_rms_eps: float | None = None
    bcdt_norm_weights: bool = False


def mamba1_tp_problems(
    intermediate_size: int, tp_size: int, name: str = "intermediate_size"
) -> list[str]:
    """Why a Mamba1 layer of ``intermediate_size`` channels cannot shard over ``tp_size``
    ranks (empty: it can); ``name`` is what the config calls the size."""
    if intermediate_size % tp_size:
        return [f"{name}={intermediate_size} is not divisible by tp_size={tp_size}"]
    return []


def _profiled(name: str):
    """A profiler range while the profiler records; nothing otherwise."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def weightless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dimension, in fp32, cast back to x's dtype
    (FalconMamba's norm of dt, B and C)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class MambaMixer(nn.Module):
    """One Mamba1 mixer (this rank's channels of it). Parameter names follow HF
    transformers' MambaMixer; ``A_log`` and ``D`` stay fp32 whatever ``dtype`` the other
    weights use."""

    def __init__(self, shape: Mamba1Shape, dtype: torch.dtype | None = None, layer_idx: int = 0):
        super().__init__()
        problems = mamba1_tp_problems(shape.intermediate_size, get_tp_group().world_size)
        if problems:
            raise ValueError("Mamba1 layer cannot be sharded: " + "; ".join(problems))
        self.layer_idx = layer_idx
        self.hidden_size = shape.hidden_size
        self.state_size = shape.state_size
        self.time_step_rank = shape.time_step_rank
        self.bcdt_rms_eps = shape.bcdt_rms_eps
        self.bcdt_norm_weights = shape.bcdt_norm_weights
        d, n = shape.intermediate_size, shape.state_size
        self.in_proj = MergedColumnParallelLinear(
            shape.hidden_size, [d, d], bias=shape.use_bias, dtype=dtype
        )
        channels = RowShards([d])
        self.intermediate_size = local = channels.local_size
        self.conv1d = DepthwiseConvWeights(channels, shape.conv_kernel, shape.use_conv_bias, dtype)
        self.x_proj = RowParallelLinear(d, shape.time_step_rank + 2 * n, bias=False, dtype=dtype)
        self.dt_proj = ColumnParallelLinear(shape.time_step_rank, d, bias=True, dtype=dtype)
        a = torch.arange(1, n + 1, dtype=torch.float32).expand(local, n)
        self.A_log = row_parameter(channels, torch.log(a).contiguous(), "A_log")
        self.D = row_parameter(channels, torch.ones(local, dtype=torch.float32), "D")
        self.out_proj = RowParallelLinear(d, shape.hidden_size, bias=shape.use_bias, dtype=dtype)
        self.conv_shape = (local, shape.conv_kernel - 1)
        self.ssm_shape = (local, n)
        if shape.bcdt_norm_weights:
            # Jamba: weighted norms, replicated (x_proj's all-reduce gives every rank the
            # whole dt_low, B and C).
            if shape.bcdt_rms_eps is None:
                raise ValueError("Mamba1Shape: bcdt_norm_weights needs bcdt_rms_eps")
            eps, rank = shape.bcdt_rms_eps, shape.time_step_rank
            self.dt_layernorm = RMSNorm(rank, eps=eps, dtype=dtype)
            self.b_layernorm = RMSNorm(n, eps=eps, dtype=dtype)
            self.c_layernorm = RMSNorm(n, eps=eps, dtype=dtype)
        self.set_conv_backend(conv_backend_from_env())
        # (conv_state, ssm_state): this layer's views of the state pool, bound by the engine.
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def get_state_spec(self, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> MambaStateSpec:
        """One state line of this layer: the conv state (d_inner, W-1) in ``conv_dtype``
        (the model's) and the SSM state (d_inner, d_state) in ``ssm_dtype``
        (``mamba_ssm_cache_dtype``)."""
        return MambaStateSpec(self.conv_shape, conv_dtype, self.ssm_shape, ssm_dtype)

    def set_conv_backend(self, backend: ConvBackend) -> None:
        """Use ``backend`` for the conv from now on (pools keep the layout they were
        allocated in, which ``check_conv_state_layout`` then rejects)."""
        self._cuda_ops = load_cuda_conv_ops() if backend is ConvBackend.CUDA else None
        self.backend = backend

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states (num_tokens, hidden) -> (num_tokens, hidden); updates the bound
        states of the step's sequences."""
        conv_state, ssm_state = self._bound_state()
        md = get_forward_context().mamba2_metadata
        self._check_inputs(hidden_states, conv_state, ssm_state, md)
        x, z = self.in_proj(hidden_states).split([self.intermediate_size] * 2, dim=-1)
        with _profiled("mamba1::conv"):
            if self.backend is ConvBackend.TRITON:
                x = self._conv_triton(x, conv_state, md)
            else:
                x = self._conv_cuda(x, conv_state, md)
        n = self.state_size
        dt, B, C = self.x_proj(x).split([self.time_step_rank, n, n], dim=-1)
        if self.bcdt_norm_weights:
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        elif self.bcdt_rms_eps is not None:
            dt, B, C = (weightless_rms_norm(t, self.bcdt_rms_eps) for t in (dt, B, C))
        dt = F.linear(dt, self.dt_proj.weight)  # the bias goes to the scan (delta_bias)
        args = dict(D=self.D, delta_bias=self.dt_proj.bias, delta_softplus=True)
        A = -torch.exp(self.A_log.float())
        if md.padded_to_bucket:
            with _profiled("mamba1::ssm_scan"):
                y = self._scan_padded(x, dt, A, B, C, z, ssm_state, md, args)
            return self.out_proj(y)
        num_dec, num_pre = md.num_decode_tokens, md.num_prefill_tokens
        # Rows past the decode stream and the prefills are padding: y = 0 there.
        alloc = torch.zeros if num_dec + num_pre < md.num_tokens else torch.empty
        y = alloc(x.shape, dtype=hidden_states.dtype, device=x.device)
        with _profiled("mamba1::ssm_scan"):
            if num_dec:
                dec = slice(0, num_dec)
                selective_state_update_mamba1(
                    ssm_state, x[dec], dt[dec], A, B[dec], C[dec], z=z[dec],
                    state_batch_indices=md.decode_state_indices, pad_slot_id=NULL_BLOCK_ID,
                    out=y[dec], **args,
                )  # fmt: skip
            if md.num_prefills:
                pre = slice(num_dec, num_dec + num_pre)
                selective_scan_fn(
                    x[pre], dt[pre], A, B[pre], C[pre], md.prefill_query_start_loc, ssm_state,
                    cache_indices=md.prefill_state_indices,
                    has_initial_state=md.prefill_has_initial_state, z=z[pre],
                    pad_slot_id=NULL_BLOCK_ID, out=y[pre], **args,
                )  # fmt: skip
        return self.out_proj(y)

    def _scan_padded(self, x, dt, A, B, C, z, ssm_state, md, args) -> torch.Tensor:
        """A step padded to a CUDA-graph bucket (``mamba2_padded``): its counts are the
        bucket's, and its prefill rows lie among the first S rows, after the decodes. One
        scan takes every row: the S + 1 rows are its sequences (the decodes one-token ones
        continuing their lines, padded rows on the null line: y = 0, no line touched),
        chunked over time for the worst step the graph replays: one prefill of nearly all
        T tokens. (The bucket's P + 1 prefill rows, mostly empty, would reach the table's
        target programs at large T and leave such a prefill one serial chunk.)"""
        chunk_len, _ = self._padded_chunks(md.num_tokens, x.dtype)
        return selective_scan_fn(
            x, dt, A, B, C, md.query_start_loc, ssm_state, cache_indices=md.state_indices,
            has_initial_state=md.has_initial_state, z=z, pad_slot_id=NULL_BLOCK_ID,
            chunk_len=chunk_len, **args,
        )  # fmt: skip

    def _padded_chunks(self, num_tokens: int, dtype: torch.dtype) -> tuple[int, int]:
        """(chunk length, chunks) of a padded bucket's scan: one sequence of all T tokens."""
        return chunk_plan(num_tokens, 1, self.intermediate_size, self.state_size, dtype)

    def _bound_state(self):
        if self.kv_cache is None:
            raise RuntimeError(
                f"MambaMixer (layer {self.layer_idx}): no state is bound; the engine binds "
                "(conv_state, ssm_state), the layer's views of the state pool, to kv_cache "
                "(bind_kv_cache; model.allocate_state_pool does it for callers without one)"
            )
        return self.kv_cache

    def _conv_triton(self, x, conv_state, md: Mamba2Metadata) -> torch.Tensor:
        """The whole step in one launch; x (num_tokens, d_inner) -> the same shape."""
        w, b = self.conv1d.weight, self.conv1d.bias
        if md.decode_only:
            return causal_conv1d_update(
                x, conv_state, w, b, activation="silu", conv_state_indices=md.state_indices,
                pad_slot_id=NULL_BLOCK_ID,
            )  # fmt: skip
        return causal_conv1d_fn(
            x.t(), w, b, conv_state, md.query_start_loc, cache_indices=md.state_indices,
            has_initial_state=md.has_initial_state, activation="silu",
            pad_slot_id=NULL_BLOCK_ID, metadata=md.conv,
        ).t()  # fmt: skip

    def _conv_cuda(self, x, conv_state, md: Mamba2Metadata) -> torch.Tensor:
        """The decode stream through the CUDA update op, the prefills through the forward
        op, both into one buffer of the step's rows (padding rows zero)."""
        ops = self._cuda_ops
        w, b = self.conv1d.weight, self.conv1d.bias
        num_dec, num_pre = md.num_decode_tokens, md.num_prefill_tokens
        alloc = torch.zeros if num_dec + num_pre < md.num_tokens else torch.empty
        out = alloc(x.shape, dtype=x.dtype, device=x.device)
        if num_dec:
            ops.causal_conv1d_update_cuda(
                x[:num_dec], conv_state, w, b, True, md.decode_state_indices, NULL_BLOCK_ID,
                out=out[:num_dec],
            )  # fmt: skip
        if md.num_prefills:
            pre = slice(num_dec, num_dec + num_pre)
            ops.causal_conv1d_fwd_cuda(
                x[pre].t(), w, b, conv_state, md.prefill_query_start_loc,
                md.prefill_state_indices, md.prefill_has_initial_state, True, NULL_BLOCK_ID,
                out=out[pre].t(),
            )  # fmt: skip
        return out

    def _check_inputs(self, hidden_states, conv_state, ssm_state, md) -> None:
        where = f"MambaMixer (layer {self.layer_idx})"
        check_layer_inputs(where, hidden_states, self.hidden_size, md)
        lines = conv_state.shape[0]
        for name, state, shape in (
            ("conv_state", conv_state, self.conv_shape),
            ("ssm_state", ssm_state, self.ssm_shape),
        ):
            if not isinstance(state, torch.Tensor) or tuple(state.shape) != (lines, *shape):
                got = tuple(state.shape) if isinstance(state, torch.Tensor) else type(state)
                raise ValueError(
                    f"{where}: {name} must be ({lines}, {shape[0]}, {shape[1]}), got {got}"
                )
        check_conv_state_layout(conv_state, self.backend)
