"""MambaMixer2: the Mamba2 token mixer over a continuous-batching step.

    in_proj -> z | xBC | dt -> causal conv1d + SiLU over xBC -> x | B | C
            -> selective scan (state per sequence) -> RMSNormGated(y, z) per group -> out_proj

Tokens of all sequences come concatenated, (num_tokens, hidden), in the canonical order of
``Mamba2Metadata`` (decode stream, prefills, other padding), which the layer reads from the
forward context. The layer owns its state: it declares it (``get_state_spec``), the engine
allocates it and binds the layer's views of the pool to ``kv_cache`` = (conv_state,
ssm_state) (``bind_kv_cache``), and the layer reads and updates its lines in place; padded
rows (on the null line, ``NULL_BLOCK_ID``, passed to every op) leave every line as it was
and get y = 0 before the norm.

Conv backend, read at construction from ``VLLM_USE_TRITON_CONV1D`` (``set_conv_backend``
switches it; the state pool must then be allocated in the new backend's layout):

- Triton (1): the whole batch in ONE ``causal_conv1d_fn`` call, x passed as the
  feature-contiguous (dim, tokens) transpose of the in_proj output's xBC columns (a view,
  no copy); a decode-only step goes through ``causal_conv1d_update`` instead.
- CUDA (0): split, as the classic design does: the decode stream through the CUDA update
  op, the prefill rows through the CUDA forward op, both writing into one step-wide buffer
  (``out=``) when the Triton SSD reads it; otherwise the scan consumes the two results
  where they lie. Nothing is stitched back.

The SSM scan: the decode stream through ``selective_state_update`` (on CUDA the fused
Triton kernel of ``ops.mamba_ssm_triton``), or, when the pool hands the layer a
``ReplayedSSMState`` (``use_replayssm``), through the replayed update of
``ops.mamba_ssm_replay``, which writes a line's state every L-th step only; then, before
any prefill row reads or replaces its line, ``replay_ssm_materialise`` folds those lines'
buffered steps in (one launch; mixed steps keep their decodes replayed). The prefills go
through the chunked scan the metadata carries a layout for. With ``metadata.ssd`` (CUDA by
default) that is the Triton SSD of ``ops.ssd_combined``: it takes the step-wide x, B, C, dt
and y (the layout's rows are absolute), reads each sequence's initial state from its pool
line and writes the final state back, and writes y of the prefill rows in place. With
``metadata.scan`` (CPU) it is ``mamba_ssm_torch.chunk_scan_varlen`` on the prefill rows,
initial states gathered from the pool and final states scattered back.

Tensor parallelism (``mamba_tp``): the layer is built from a ``Mamba2Shape`` (the whole
layer's sizes) as this rank's part, cut by heads: in_proj a ``MergedColumnParallelLinear``
of its z | x | B | C | dt rows, the conv its x | B | C channels, A, D, dt_bias and the
norm gains its heads', out_proj row-parallel (the layer's one all-reduce); the gated norm
reduces across ranks where a group spans them. The sizes the forward splits by are the
local ones, so the forward is the same code at every world size; at world size 1 every
part is the whole layer and no collective runs.

While the torch profiler records, the conv and the scan run inside the ranges
``mamba2::conv`` and ``mamba2::ssm_scan`` (a profile tells the scan's kernels apart).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
from torch import nn

from vllm.cache_spec import MambaStateSpec
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    RowShards,
)
from vllm.model_executor.layers.mamba.mamba2_metadata import Mamba2Metadata, check_layer_inputs
from vllm.model_executor.layers.mamba.mamba_tp import (
    DepthwiseConvWeights,
    Mixer2RMSNormGated,
    mamba2_layout,
    row_parameter,
)
from vllm.model_executor.layers.mamba.mamba_utils import (
    ConvBackend,
    Mamba2Shape,
    check_conv_state_layout,
    conv_backend_from_env,
    load_cuda_conv_ops,
    mamba2_state_spec,
)
from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
    NULL_BLOCK_ID,
    causal_conv1d_fn,
    causal_conv1d_update,
)
from vllm.model_executor.layers.mamba.ops.mamba_ssm_replay import (
    ReplayedSSMState,
    replay_ssm_materialise,
    replay_ssm_update,
)
from vllm.model_executor.layers.mamba.ops.mamba_ssm_torch import (
    chunk_scan_varlen,
    selective_state_update,
)
from vllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined_varlen


def _profiled(name: str):
    """A profiler range while the profiler records; otherwise nothing (a range costs
    microseconds of host time, and a step opens two per layer)."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


class _ConvOut(NamedTuple):
    """The conv's output rows (num_rows, conv_dim): the decode stream's, the prefills', and
    the whole step's (None where the two halves live apart)."""

    decode: torch.Tensor
    prefill: torch.Tensor
    step: torch.Tensor | None


class MambaMixer2(nn.Module):
    """One Mamba2 mixer (this rank's heads of it). Parameter names follow HF transformers'
    Mamba2Mixer.

    ``A_log``, ``D`` and ``dt_bias`` stay fp32 whatever ``dtype`` the other weights use.
    """

    def __init__(self, shape: Mamba2Shape, dtype: torch.dtype | None = None, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = shape.hidden_size
        self.head_dim = shape.head_dim
        self.state_size = shape.state_size
        self.time_step_limit = tuple(float(t) for t in shape.time_step_limit)
        layout = mamba2_layout(shape)
        sizes, units = layout["in_proj"]
        self.in_proj = MergedColumnParallelLinear(
            shape.hidden_size, sizes, bias=shape.use_bias, dtype=dtype, units=units
        )
        conv = RowShards(*layout["conv1d"])
        self.conv1d = DepthwiseConvWeights(conv, shape.conv_kernel, shape.use_conv_bias, dtype)
        heads = RowShards(*layout["heads"])
        first, self.num_heads = heads.starts[0], heads.local_size
        a = torch.arange(first + 1, first + self.num_heads + 1, dtype=torch.float32)
        self.A_log = row_parameter(heads, torch.log(a), "A_log")
        self.D = row_parameter(heads, torch.ones(self.num_heads, dtype=torch.float32), "D")
        zeros = torch.zeros(self.num_heads, dtype=torch.float32)
        self.dt_bias = row_parameter(heads, zeros, "dt_bias")
        channels = RowShards(*layout["channels"])
        self.norm = Mixer2RMSNormGated(channels, shape.n_groups, shape.norm_eps, dtype)
        self.out_proj = RowParallelLinear(
            shape.intermediate_size, shape.hidden_size, bias=shape.use_bias, dtype=dtype
        )
        # The forward splits by this rank's sizes.
        self.n_groups = conv.local_sizes[1] // shape.state_size
        self.intermediate_size = channels.local_size
        self.spec = mamba2_state_spec(
            num_heads=self.num_heads,
            head_dim=shape.head_dim,
            state_size=shape.state_size,
            n_groups=self.n_groups,
            conv_kernel=shape.conv_kernel,
        )
        self.set_conv_backend(conv_backend_from_env())
        # (conv_state, ssm_state): this layer's views of the state pool, bound by the engine.
        self.kv_cache: tuple[torch.Tensor, torch.Tensor | ReplayedSSMState] | None = None

    def get_state_spec(self, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> MambaStateSpec:
        """What one state slot of this layer holds, for the engine to allocate: the conv
        state (dim, W-1) in ``conv_dtype`` (the model's) and the SSM state (nheads, headdim,
        dstate) in ``ssm_dtype`` (``mamba_ssm_cache_dtype``)."""
        return MambaStateSpec(self.spec.conv_shape, conv_dtype, self.spec.ssm_shape, ssm_dtype)

    def set_conv_backend(self, backend: ConvBackend) -> None:
        """Use ``backend`` for the conv from now on; the weights serve both backends, the
        conv-state layout does not (``check_conv_state_layout`` rejects the old one)."""
        self._cuda_ops = load_cuda_conv_ops() if backend is ConvBackend.CUDA else None
        self.backend = backend

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states (num_tokens, hidden) -> (num_tokens, hidden); updates the states.

        The step's ``Mamba2Metadata`` comes from the forward context; the states are the
        bound ``kv_cache``: ``conv_state`` (lines, conv_dim, W-1) in the backend's layout
        and ``ssm_state`` (lines, nheads, headdim, dstate), or a ``ReplayedSSMState`` in its
        place, which selects the replayed decode.
        """
        conv_state, ssm_state = self._bound_state()
        metadata = get_forward_context().mamba2_metadata
        self._check_inputs(hidden_states, conv_state, ssm_state, metadata)
        num_tokens = hidden_states.shape[0]
        num_dec, num_pre = metadata.num_decode_tokens, metadata.num_prefill_tokens
        proj = self.in_proj(hidden_states)
        gate, xbc, dt = proj.split(
            [self.intermediate_size, self.spec.conv_dim, self.num_heads], dim=-1
        )
        with _profiled("mamba2::conv"):
            if self.backend is ConvBackend.TRITON:
                conv = self._conv_triton(xbc, conv_state, metadata)
            else:
                conv = self._conv_cuda(xbc, conv_state, metadata)

        # Rows past the decode stream and the prefills are padding: y = 0 there.
        alloc = torch.zeros if num_dec + num_pre < num_tokens else torch.empty
        y = alloc(
            num_tokens,
            self.num_heads,
            self.head_dim,
            dtype=hidden_states.dtype,
            device=hidden_states.device,
        )
        with _profiled("mamba2::ssm_scan"):
            self._ssm_scan(y, conv, dt, ssm_state, metadata)

        y = self.norm(y.view(num_tokens, self.intermediate_size), gate)
        return self.out_proj(y)

    def _bound_state(self):
        if self.kv_cache is None:
            raise RuntimeError(
                f"MambaMixer2 (layer {self.layer_idx}): no state is bound; the engine binds "
                "(conv_state, ssm_state), the layer's views of the state pool, to kv_cache "
                "(bind_kv_cache; model.allocate_state_pool does it for callers without one)"
            )
        return self.kv_cache

    def materialise(self, slots: torch.Tensor) -> None:
        """Fold the replayed steps of lines ``slots`` into the bound states (nothing to do
        without replay): for readers of a state other than this layer's forward (prefix
        caching, speculative decoding)."""
        ssm_state = self._bound_state()[1]
        if isinstance(ssm_state, ReplayedSSMState):
            # All continuing, the null line as the marker: the prefills' launch variant,
            # which the warm-up compiled (Triton specializes a 0 apart from a -1).
            init = torch.ones(slots.shape, dtype=torch.bool, device=slots.device)
            replay_ssm_materialise(ssm_state, -torch.exp(self.A_log.float()), slots, init,
                                   pad_slot_id=NULL_BLOCK_ID)  # fmt: skip

    def _ssm_scan(self, y, conv: _ConvOut, dt, ssm_state, md: Mamba2Metadata) -> None:
        """The scan of the decode stream and of the prefills, into ``y``; updates ``ssm_state``."""
        num_dec = md.num_decode_tokens
        prefill_rows = slice(num_dec, num_dec + md.num_prefill_tokens)
        A = -torch.exp(self.A_log.float())
        scan_args = dict(
            D=self.D, dt_bias=self.dt_bias, dt_softplus=True, dt_limit=self.time_step_limit
        )
        replayed = isinstance(ssm_state, ReplayedSSMState)
        if num_dec:
            x, B, C = self._split_xbc(conv.decode)
            update = replay_ssm_update if replayed else selective_state_update
            update(
                ssm_state,
                x,
                dt[:num_dec],
                A,
                B,
                C,
                state_batch_indices=md.decode_state_indices,
                pad_slot_id=NULL_BLOCK_ID,
                out=y[:num_dec],
                **scan_args,
            )
        if replayed:
            if md.num_prefills:
                # A graph's padded prefills sit on the null line: left alone.
                replay_ssm_materialise(
                    ssm_state, A, md.prefill_state_indices, md.prefill_has_initial_state,
                    pad_slot_id=NULL_BLOCK_ID,
                )  # fmt: skip
            ssm_state = ssm_state.state
        if md.num_prefills and md.ssd is not None:
            x, B, C = self._split_xbc(conv.step)
            mamba_chunk_scan_combined_varlen(
                x,
                dt,
                A,
                B,
                C,
                md.ssd,
                ssm_state,
                md.prefill_state_indices,
                md.prefill_has_initial_state,
                out=y,
                **scan_args,
            )
        elif md.num_prefills:
            x, B, C = self._split_xbc(conv.prefill)
            slots = md.prefill_state_indices.long()
            initial = torch.where(
                md.prefill_has_initial_state[:, None, None, None],
                ssm_state.index_select(0, slots),
                0.0,
            )
            _, final = chunk_scan_varlen(
                x,
                dt[prefill_rows],
                A,
                B,
                C,
                md.scan,
                initial,
                out=y[prefill_rows],
                **scan_args,
            )
            ssm_state.index_copy_(0, slots, final.to(ssm_state.dtype))

    def _split_xbc(self, xbc: torch.Tensor):
        gn = self.n_groups * self.state_size
        x, B, C = xbc.split([self.intermediate_size, gn, gn], dim=-1)
        return (
            x.unflatten(-1, (self.num_heads, self.head_dim)),
            B.unflatten(-1, (self.n_groups, self.state_size)),
            C.unflatten(-1, (self.n_groups, self.state_size)),
        )

    def _conv_triton(self, xbc, conv_state, md: Mamba2Metadata) -> _ConvOut:
        """The whole batch in one launch."""
        w, b = self.conv1d.weight, self.conv1d.bias
        if md.decode_only:
            out = causal_conv1d_update(
                xbc,
                conv_state,
                w,
                b,
                activation="silu",
                conv_state_indices=md.state_indices,
                pad_slot_id=NULL_BLOCK_ID,
            )
        else:
            out = causal_conv1d_fn(
                xbc.t(),
                w,
                b,
                conv_state,
                md.query_start_loc,
                cache_indices=md.state_indices,
                has_initial_state=md.has_initial_state,
                activation="silu",
                pad_slot_id=NULL_BLOCK_ID,
                metadata=md.conv,
            ).t()
        num_dec = md.num_decode_tokens
        return _ConvOut(out[:num_dec], out[num_dec : num_dec + md.num_prefill_tokens], out)

    def _conv_cuda(self, xbc, conv_state, md: Mamba2Metadata) -> _ConvOut:
        """Split: decode stream through the CUDA update op, prefill rows through the forward op.

        ``vllm._custom_ops.causal_conv1d_update_cuda`` takes x (batch, dim) rows and
        ``causal_conv1d_fwd_cuda`` x (dim, tokens) with stride(0) == 1: both get views of
        the in_proj output. For the Triton SSD (step-wide rows) both write into one buffer
        of the step's rows; otherwise their results are consumed where they lie.
        """
        ops = self._cuda_ops
        w, b = self.conv1d.weight, self.conv1d.bias
        num_dec, num_pre = md.num_decode_tokens, md.num_prefill_tokens
        step = None
        if md.ssd is not None:
            step = torch.empty(xbc.shape, dtype=xbc.dtype, device=xbc.device)
        dec = xbc[:0]
        if num_dec:
            dec = ops.causal_conv1d_update_cuda(
                xbc[:num_dec], conv_state, w, b, True, md.decode_state_indices, NULL_BLOCK_ID,
                **({} if step is None else {"out": step[:num_dec]}),
            )  # fmt: skip
        pre = xbc[:0]
        if md.num_prefills:
            pre = ops.causal_conv1d_fwd_cuda(
                xbc[num_dec : num_dec + num_pre].t(),
                w,
                b,
                conv_state,
                md.prefill_query_start_loc,
                md.prefill_state_indices,
                md.prefill_has_initial_state,
                True,
                NULL_BLOCK_ID,
                **({} if step is None else {"out": step[num_dec : num_dec + num_pre].t()}),
            ).t()
        return _ConvOut(dec, pre, step)

    def _check_inputs(self, hidden_states, conv_state, ssm_state, md) -> None:
        where = f"MambaMixer2 (layer {self.layer_idx})"
        check_layer_inputs(where, hidden_states, self.hidden_size, md)
        lines = conv_state.shape[0]
        if isinstance(ssm_state, ReplayedSSMState):
            ssm_state = ssm_state.state
        if conv_state.dim() != 3 or tuple(conv_state.shape[1:]) != self.spec.conv_shape:
            raise ValueError(
                f"{where}: conv_state must be (lines, {self.spec.conv_shape[0]}, "
                f"{self.spec.conv_shape[1]}), got {tuple(conv_state.shape)}"
            )
        if ssm_state.dim() != 4 or tuple(ssm_state.shape) != (lines, *self.spec.ssm_shape):
            raise ValueError(
                f"{where}: ssm_state must be ({lines}, {', '.join(map(str, self.spec.ssm_shape))})"
                f", got {tuple(ssm_state.shape)}"
            )
        check_conv_state_layout(conv_state, self.backend)
