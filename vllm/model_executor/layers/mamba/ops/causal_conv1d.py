"""Triton causal-conv1d kernels for Mamba-family layers.

The operation, per feature ``d`` of a sequence with kernel width ``W``::

    y[t, d] = act(bias[d] + sum_{k<W} w[d, k] * xx[t - (W-1) + k, d])

where ``xx`` is the sequence's tokens preceded by W-1 columns of left context:
the sequence's cache line when it has an initial state, zeros otherwise.
``act`` is SiLU or identity. Products and sums are fp32; one cast at the store.

Tensors (logical shapes; the stride that must be 1 in brackets):

- ``x``: (dim, num_tokens) [dim] for ``causal_conv1d_fn``; the token stride may
  exceed dim (a view into a wider projection). Never copied.
- ``weight``: (dim, W) [W], 2 <= W <= 8.  ``bias``: (dim,) or None.
- ``conv_states``: (num_cache_lines, dim, state_len), state_len >= W-1, any of
  fp32/fp16/bf16 whatever x's dtype, any strides (the kernels take all three;
  only aliasing strides, a 0 over a dimension of size > 1, are refused).
  Feature-contiguous (stride(1) == 1: allocate (lines, state_len, dim) and
  transpose) is the fast layout; others, such as upstream's CUDA layout
  (lines, dim, state_len) contiguous, are served in place, with strided loads.
  Mutated in place.
- ``query_start_loc``: (batch+1,) int32; ``cache_indices``: (>= batch,) int32;
  ``has_initial_state``: (>= batch,) bool. Per-sequence arrays may be padded
  buffers longer than the batch: entries past ``batch`` are never read. All
  1-D arrays are contiguous.

Cache lines: the W-1 columns of history a sequence starts from are
``line[:, off : off + W - 1]``, ``off = num_accepted_tokens - 1`` in speculative
decoding and 0 otherwise. After a step over L tokens, with
``xx = cat(history, tokens)``, the first ``W - 1 + L - shift`` columns hold
``xx[:, shift:]``: ``shift = L`` normally (the last W-1 inputs) and
``shift = min(L, 1)`` in speculative decoding, so the next step can start from
any accepted prefix. Later columns are left as they are.

Padded rows (cache index == ``pad_slot_id``, or ``null_block_id``: upstream's
later name for the same marker, a keyword of both ops; both given with different
values is a ValueError) get zero outputs; their cache lines, and every line no
sequence names, are not touched. The default marker is ``NULL_BLOCK_ID`` = 0:
line 0 of a pool is the null line, which padded rows point at; with
``pad_slot_id=PAD_SLOT_ID`` (-1) line 0 is a line like the others. A negative index
names no line, so it marks a padded row whatever the marker (upstream's 2025
callers pad with -1). Without an index array (sequence b on line b) no row is
padded.

``causal_conv1d_fn`` handles a whole continuous-batching step (fresh prefills,
chunked-prefill continuations and one-token decodes) in one launch, parallel
over features, sequences and tiles of tokens. The grid is sized from shapes
alone (tiles of the token stream plus one head piece per sequence), so it
needs no host data: a tile finds its sequence by binary search over
``query_start_loc`` or, faster, in the tile map of the step's metadata
(``compute_causal_conv1d_metadata``). Only a sequence's head piece reads and
writes its cache line, so states are read and written without a race.

``causal_conv1d_update`` serves decode and speculative decode with a grid of
(batch, feature blocks) fixed by shapes, and no host sync, so it can be
captured in a CUDA graph, padded rows included.

Host path: a call whose arguments have the layout of an earlier one (shapes, strides,
dtypes, devices, options) skips the checks through a cached launch plan and launches the
compiled kernel directly (``causal_conv1d_host.py``, over ``vllm.triton_utils.host``); the
metadata builder is host work on numpy with one copy to the device. The kernels are in
``causal_conv1d_kernels.py``, their launch configurations in ``configs/causal_conv1d/``.

On CPU tensors both ops run the fp32 references in ``causal_conv1d_ref``,
unless ``TRITON_INTERPRET=1``, in which case the Triton kernels run through
the interpreter. Without Triton the module still imports; CUDA calls then
raise a RuntimeError.
"""

import torch

from vllm.model_executor.layers.mamba.ops.causal_conv1d_host import (
    _FWD_PLANS,
    _KEY_ERRORS,
    _UPDATE_PLANS,
    PAD_DEFAULT,
    CausalConv1dMetadata,
    _decode_config,
    _decode_configs,
    _DecodePlan,
    _fwd_block_t,
    _fwd_config,
    _fwd_config_name,  # noqa: F401 (the bounds benchmark reads the choice here)
    _fwd_key,
    _fwd_variants,
    _FwdPlan,
    _update_config,
    _update_key,
    _UpdatePlan,
    check_cache_indices_data,
    check_common,
    check_index,
    check_qsl,
    check_qsl_data,
    clear_host_caches,
    compute_causal_conv1d_metadata,
    feature_contiguous,
    host_path_pieces,
    one_d_contiguous,
    pad_marker,
)

# The kernels stay reachable here (the cold-start test and the bounds benchmark use them).
from vllm.model_executor.layers.mamba.ops.causal_conv1d_kernels import (  # noqa: F401
    _LAUNCH_DECODE,
    _LAUNCH_FWD,
    _LAUNCH_UPDATE,
    _causal_conv1d_decode_kernel,
    _causal_conv1d_fwd_kernel,
    _causal_conv1d_update_kernel,
    _fwd_piece,
)
from vllm.model_executor.layers.mamba.ops.causal_conv1d_ref import (
    NULL_BLOCK_ID,
    PAD_SLOT_ID,
    _is_silu,
    causal_conv1d_ref,
    causal_conv1d_update_ref,
)
from vllm.tensor_checks import FLOAT_DTYPES, check_default_lines, check_tensor
from vllm.triton_utils import HAS_TRITON
from vllm.triton_utils.host import cdiv, next_power_of_2

__all__ = [
    "NULL_BLOCK_ID",
    "PAD_SLOT_ID",
    "clear_host_caches",
    "host_path_pieces",
    "CausalConv1dMetadata",
    "causal_conv1d_fn",
    "causal_conv1d_ref",
    "causal_conv1d_update",
    "causal_conv1d_update_ref",
    "compute_causal_conv1d_metadata",
]


# --------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------


def _use_kernel(x: torch.Tensor) -> bool:
    """CUDA tensors run the kernels; CPU tensors run them only under the interpreter
    (``CachedLauncher.runs_cpu_tensors``), else the reference."""
    if x.is_cuda:
        if not HAS_TRITON:
            raise RuntimeError("causal-conv1d on CUDA tensors needs Triton, which is not installed")
        return True
    return _LAUNCH_FWD.runs_cpu_tensors()


# --------------------------------------------------------------------------
# causal_conv1d_fn
# --------------------------------------------------------------------------


def _fwd_impl(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    silu: bool,
    pad_slot_id: int,
    tile_seq: torch.Tensor | None,
    block_t: int,
) -> torch.Tensor:
    if not _use_kernel(x):
        return causal_conv1d_ref(
            x,
            weight,
            bias,
            conv_states,
            query_start_loc,
            cache_indices,
            has_initial_state,
            "silu" if silu else None,
            pad_slot_id,
        )
    dim, num_tokens = x.shape
    batch = query_start_loc.shape[0] - 1
    width = weight.shape[1]
    out = torch.empty(num_tokens, dim, dtype=x.dtype, device=x.device).t()
    if block_t <= 0:
        block_t = _fwd_block_t(num_tokens)
    cfg = _fwd_config(num_tokens, dim, width, x.element_size(), batch)
    n_tiles = cdiv(num_tokens, block_t)
    n_heads = cdiv(batch, cfg["HEAD_S"])
    grid = ((n_tiles + n_heads) * cdiv(dim, cfg["BLOCK_D"]),)
    if grid[0] == 0:
        return out
    args = (
        x,
        weight,
        bias,
        conv_states,
        query_start_loc,
        cache_indices,
        has_initial_state,
        tile_seq,
        out,
        num_tokens,
        n_tiles,
        dim,
        batch,
        batch.bit_length(),
        pad_slot_id,
        x.stride(1),
        weight.stride(0),
        conv_states.stride(0),
        conv_states.stride(1),
        conv_states.stride(2),
        out.stride(1),
    )
    constexprs = dict(
        KERNEL_WIDTH=width,
        HAS_BIAS=bias is not None,
        SILU=silu,
        HAS_CACHE_INDICES=cache_indices is not None,
        HAS_INITIAL_STATE=has_initial_state is not None,
        HAS_TILE_SEQ=tile_seq is not None,
        STATE_D_CONTIG=feature_contiguous(conv_states),
        BLOCK_T=block_t,
        **cfg,
    )
    _LAUNCH_FWD(
        grid, args, constexprs, variants=lambda: _fwd_variants(constexprs, x.element_size())
    )
    return out


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
    pad_slot_id: int = PAD_DEFAULT,
    metadata: CausalConv1dMetadata | None = None,
    validate_data: bool = False,
    *,
    null_block_id: int | None = None,
) -> torch.Tensor:
    """Causal conv1d over a whole continuous-batching step, in one launch.

    Returns ``out`` (dim, num_tokens) in x's dtype with ``out.stride(0) == 1``,
    and updates the cache line of every non-padded sequence (see the module
    docstring). ``cache_indices=None`` means sequence b uses line b;
    ``has_initial_state=None`` means no sequence has one. ``cache_indices`` and
    ``has_initial_state`` may be longer than the batch (padded buffers): only
    their first ``batch = len(query_start_loc) - 1`` entries are read.

    ``conv_states`` may have any strides; feature-contiguous (``stride(1) == 1``)
    is the fast layout. A sequence whose cache index equals ``pad_slot_id`` (or
    ``null_block_id``, upstream's later name for the same marker; giving both
    with different values is an error; by default ``NULL_BLOCK_ID``, line 0) is a
    padded row.

    ``metadata`` from ``compute_causal_conv1d_metadata`` (built once per step)
    lets the kernel map tokens to sequences with one load. Without it the
    kernel binary-searches ``query_start_loc`` on the device; neither path
    syncs with the host. ``validate_data=True`` adds checks that read device
    data (and so sync).

    A call whose arguments have the layout of an earlier call skips the checks and
    launch decisions that depend on the layout only (see ``causal_conv1d_host.py``).
    """
    key = None
    if not validate_data and not torch.compiler.is_compiling():
        try:
            key = _fwd_key(x, weight, bias, conv_states, query_start_loc, cache_indices,
                           has_initial_state, activation, pad_slot_id, metadata,
                           null_block_id)  # fmt: skip
            plan = _FWD_PLANS.get(key)
        except _KEY_ERRORS:
            key = plan = None
        if plan is not None and (plan.on_cuda or _use_kernel(x)):
            out = plan.run(x, weight, bias, conv_states, query_start_loc, cache_indices,
                           has_initial_state, metadata, x.shape[1])  # fmt: skip
            if out is not None:
                return out
    check_tensor("x", x, x.device if isinstance(x, torch.Tensor) else None, 2, FLOAT_DTYPES)
    dim, num_tokens = x.shape
    if x.stride(0) != 1 and dim > 1:
        raise ValueError(
            f"x must be feature-contiguous (x.stride(0) == 1, shape (dim, num_tokens)), "
            f"got strides {x.stride()}"
        )
    check_common(x, weight, bias, conv_states, dim, "conv_states")
    pad_slot_id = pad_marker(pad_slot_id, null_block_id, cache_indices)
    batch = check_qsl(query_start_loc, x.device)
    check_index("cache_indices", cache_indices, x.device, batch)
    check_index("has_initial_state", has_initial_state, x.device, batch, torch.bool)
    silu = _is_silu(activation)
    tile_seq, block_t = None, 0
    if metadata is not None:
        if not isinstance(metadata, CausalConv1dMetadata):
            raise ValueError(
                "metadata must come from compute_causal_conv1d_metadata, got "
                f"{type(metadata).__name__}"
            )
        if metadata.num_tokens != num_tokens or metadata.batch_size != batch:
            raise ValueError(
                f"metadata was built for {metadata.num_tokens} tokens in "
                f"{metadata.batch_size} sequences, but x has {num_tokens} tokens and "
                f"query_start_loc {batch} sequences"
            )
        if metadata.tile_seq.device != x.device:
            raise ValueError(f"metadata is on {metadata.tile_seq.device}, x on {x.device}")
        tile_seq, block_t = metadata.tile_seq, metadata.block_t
    check_default_lines("cache_indices", cache_indices, batch, conv_states.shape[0])
    if validate_data:
        check_qsl_data("query_start_loc", query_start_loc, num_tokens)
        check_cache_indices_data(
            "cache_indices", cache_indices, conv_states.shape[0], batch, pad_slot_id
        )
    args = (
        x,
        weight,
        bias,
        conv_states,
        query_start_loc,
        cache_indices,
        has_initial_state,
        silu,
        pad_slot_id,
        tile_seq,
        block_t,
    )
    if torch.compiler.is_compiling():
        return torch.ops.vllm.causal_conv1d_fwd(*args)
    if (
        key is not None
        and _use_kernel(x)
        and one_d_contiguous(query_start_loc, cache_indices, has_initial_state)
    ):
        plan = _FwdPlan(x, weight, bias, conv_states, query_start_loc, cache_indices,
                        has_initial_state, silu, pad_slot_id, metadata is not None)  # fmt: skip
        out = plan.run(x, weight, bias, conv_states, query_start_loc, cache_indices,
                       has_initial_state, metadata, num_tokens)  # fmt: skip
        if out is None:
            raise AssertionError("a launch plan refused the step its checks accepted")
        _FWD_PLANS.put(key, plan)
        return out
    return _fwd_impl(*args)


# --------------------------------------------------------------------------
# causal_conv1d_update
# --------------------------------------------------------------------------


def _decode(x, conv_state, weight, bias, silu, conv_state_indices, pad_slot_id):
    batch, dim = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if batch == 0:
        return out
    cfg = _decode_config(batch, dim, x.element_size())
    grid = (batch, cdiv(dim, cfg["BLOCK_D"]))
    args = (
        x,
        weight,
        bias,
        conv_state,
        conv_state_indices,
        out,
        dim,
        pad_slot_id,
        x.stride(0),
        weight.stride(0),
        conv_state.stride(0),
        conv_state.stride(1),
        conv_state.stride(2),
        out.stride(0),
    )
    constexprs = dict(
        KERNEL_WIDTH=weight.shape[1],
        HAS_BIAS=bias is not None,
        SILU=silu,
        HAS_INDICES=conv_state_indices is not None,
        STATE_D_CONTIG=feature_contiguous(conv_state),
        **cfg,
    )
    variants = _decode_configs(x.element_size()).values()
    _LAUNCH_DECODE(grid, args, constexprs, variants=lambda: [{**constexprs, **c} for c in variants])
    return out


def _update_impl(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu: bool,
    conv_state_indices: torch.Tensor | None,
    num_accepted_tokens: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
    max_query_len: int,
    pad_slot_id: int,
) -> torch.Tensor:
    if not _use_kernel(x):
        return causal_conv1d_update_ref(
            x,
            conv_state,
            weight,
            bias,
            silu,
            conv_state_indices,
            num_accepted_tokens,
            query_start_loc,
            pad_slot_id,
        )
    width = weight.shape[1]
    if x.dim() == 2 and query_start_loc is None and num_accepted_tokens is None:
        return _decode(x, conv_state, weight, bias, silu, conv_state_indices, pad_slot_id)
    if query_start_loc is not None:
        batch = query_start_loc.shape[0] - 1
        dim = x.shape[1]
        seqlen = 0
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        strides_x = (0, x.stride(0))
        strides_out = (0, out.stride(0))
        hint = max_query_len if max_query_len > 0 else 4
    elif x.dim() == 2:
        batch, dim = x.shape
        seqlen = 1
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        strides_x = (x.stride(0), 0)
        strides_out = (out.stride(0), 0)
        hint = 1
    else:
        batch, dim, seqlen = x.shape
        out = torch.empty(batch, seqlen, dim, dtype=x.dtype, device=x.device).transpose(1, 2)
        strides_x = (x.stride(0), x.stride(2))
        strides_out = (out.stride(0), out.stride(2))
        hint = seqlen
    cfg = _update_config(batch, dim, min(next_power_of_2(max(hint, 1)), 8), width)
    grid = (batch, cdiv(dim, cfg["BLOCK_D"]))
    args = (
        x,
        weight,
        bias,
        conv_state,
        conv_state_indices,
        num_accepted_tokens,
        query_start_loc,
        out,
        dim,
        seqlen,
        pad_slot_id,
        strides_x[0],
        strides_x[1],
        weight.stride(0),
        conv_state.stride(0),
        conv_state.stride(1),
        conv_state.stride(2),
        strides_out[0],
        strides_out[1],
    )
    constexprs = dict(
        KERNEL_WIDTH=width,
        HAS_BIAS=bias is not None,
        SILU=silu,
        HAS_INDICES=conv_state_indices is not None,
        IS_SPEC=num_accepted_tokens is not None,
        IS_VARLEN=query_start_loc is not None,
        **cfg,
    )
    _LAUNCH_UPDATE(grid, args, constexprs)
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | bool | None = None,
    conv_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    max_query_len: int = -1,
    pad_slot_id: int = PAD_DEFAULT,
    metadata: CausalConv1dMetadata | None = None,
    validate_data: bool = False,
    *,
    null_block_id: int | None = None,
    cache_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode / speculative-decode step; returns ``out`` shaped like x.

    x is (batch, dim), (batch, dim, seqlen) with ``stride(1) == 1``, or with
    ``query_start_loc`` (num_tokens, dim). ``num_accepted_tokens`` turns on
    speculative decoding (see the module docstring for the cache-line window).
    ``max_query_len`` (or ``metadata.max_query_len``) only sizes the token
    tile of the varlen form; any length is computed correctly. The grid
    depends on shapes only and nothing syncs with the host, so the call can
    be captured in a CUDA graph.

    ``conv_state`` may have any strides (feature-contiguous is the fast layout).
    ``conv_state_indices`` and ``num_accepted_tokens`` may be longer than the
    batch (padded buffers): only their first ``batch`` entries are read. A row
    whose index equals ``pad_slot_id`` (or ``null_block_id``, upstream's later
    name; both with different values is an error; by default ``NULL_BLOCK_ID``,
    line 0) is padding.

    A call whose arguments have the layout of an earlier call skips the checks and launch
    decisions (see ``causal_conv1d_host.py``).
    """
    key = None
    if not validate_data and cache_seqlens is None and not torch.compiler.is_compiling():
        try:
            key = _update_key(x, conv_state, weight, bias, activation, conv_state_indices,
                              num_accepted_tokens, query_start_loc, max_query_len, pad_slot_id,
                              metadata, null_block_id)  # fmt: skip
            plan = _UPDATE_PLANS.get(key)
        except _KEY_ERRORS:
            key = plan = None
        if plan is not None and (plan.on_cuda or _use_kernel(x)):
            return plan.run(x, conv_state, weight, bias, conv_state_indices,
                            num_accepted_tokens, query_start_loc)  # fmt: skip
    if cache_seqlens is not None:
        raise ValueError(
            "cache_seqlens (circular-buffer conv state) is not supported; cache lines "
            "are kept in order, see num_accepted_tokens for speculative decoding"
        )
    check_tensor("x", x, x.device if isinstance(x, torch.Tensor) else None, None, FLOAT_DTYPES)
    if query_start_loc is not None:
        if x.dim() != 2:
            raise ValueError(
                f"with query_start_loc, x must be (num_tokens, dim), got shape {tuple(x.shape)}"
            )
        batch, dim, seqlen = check_qsl(query_start_loc, x.device), x.shape[1], None
    elif x.dim() == 2:
        batch, dim, seqlen = x.shape[0], x.shape[1], 1
    elif x.dim() == 3:
        batch, dim, seqlen = x.shape
    else:
        raise ValueError(
            f"x must be (batch, dim), (batch, dim, seqlen) or, with query_start_loc, "
            f"(num_tokens, dim); got shape {tuple(x.shape)}"
        )
    feat_stride = x.stride(1)
    if feat_stride != 1 and dim > 1:
        raise ValueError(f"x must be feature-contiguous (stride 1 along dim), got {x.stride()}")
    width = check_common(x, weight, bias, conv_state, dim, "conv_state")
    silu = _is_silu(activation)
    pad_slot_id = pad_marker(pad_slot_id, null_block_id, conv_state_indices)
    check_index("conv_state_indices", conv_state_indices, x.device, batch)
    if metadata is not None:
        if not isinstance(metadata, CausalConv1dMetadata):
            raise ValueError(
                "metadata must come from compute_causal_conv1d_metadata, got "
                f"{type(metadata).__name__}"
            )
        if metadata.batch_size != batch:
            raise ValueError(f"metadata was built for batch {metadata.batch_size}, got {batch}")
        if max_query_len <= 0:
            max_query_len = metadata.max_query_len
    state_len = conv_state.shape[2]
    if num_accepted_tokens is not None:
        check_index("num_accepted_tokens", num_accepted_tokens, x.device, batch)
        longest = seqlen if seqlen is not None else max_query_len
        if longest is not None and longest > 0 and state_len < width - 2 + longest:
            raise ValueError(
                f"conv_state state_len={state_len} is too short for speculative decoding of "
                f"{longest} tokens with width {width}: needs >= width-1+seqlen-1 = "
                f"{width - 2 + longest}"
            )
    check_default_lines("conv_state_indices", conv_state_indices, batch, conv_state.shape[0])
    if validate_data:
        check_cache_indices_data(
            "conv_state_indices", conv_state_indices, conv_state.shape[0], batch, pad_slot_id
        )
        lens = None
        if query_start_loc is not None:
            check_qsl_data("query_start_loc", query_start_loc, x.shape[0])
            q = query_start_loc.cpu()
            lens = q[1:] - q[:-1]
        if num_accepted_tokens is not None:
            acc = num_accepted_tokens[:batch].cpu()
            if lens is None:
                lens = torch.full((batch,), seqlen)
            idx = None if conv_state_indices is None else conv_state_indices[:batch].cpu()
            live = (
                (idx != pad_slot_id) & (idx >= 0)
                if idx is not None
                else torch.ones(batch, dtype=torch.bool)
            )
            # History [acc-1, acc-1+W-1) and the written window must fit in the line.
            bad = live & (
                (acc < 1)
                | (acc - 1 + width - 1 > state_len)
                | (width - 1 + lens - lens.clamp(max=1) > state_len)
            )
            if bool(bad.any()):
                raise ValueError(
                    f"num_accepted_tokens out of range for state_len={state_len}, width={width}: "
                    f"needs 1 <= n and n-1+width-1 <= state_len"
                )
    args = (
        x,
        conv_state,
        weight,
        bias,
        silu,
        conv_state_indices,
        num_accepted_tokens,
        query_start_loc,
        max_query_len,
        pad_slot_id,
    )
    if torch.compiler.is_compiling():
        return torch.ops.vllm.causal_conv1d_update(*args)
    if (
        key is not None
        and _use_kernel(x)
        and one_d_contiguous(conv_state_indices, num_accepted_tokens, query_start_loc)
    ):
        if x.dim() == 2 and query_start_loc is None and num_accepted_tokens is None:
            plan = _DecodePlan(x, conv_state, weight, bias, silu, conv_state_indices, pad_slot_id)
        else:
            plan = _UpdatePlan(x, conv_state, weight, bias, silu, conv_state_indices,
                               num_accepted_tokens, query_start_loc, max_query_len,
                               pad_slot_id)  # fmt: skip
        _UPDATE_PLANS.put(key, plan)
        return plan.run(x, conv_state, weight, bias, conv_state_indices, num_accepted_tokens,
                        query_start_loc)  # fmt: skip
    return _update_impl(*args)


# --------------------------------------------------------------------------
# torch.library registration (for torch.compile and opcheck)
# --------------------------------------------------------------------------


# The ops are the implementations themselves (their annotations give the schemas); the
# eager path calls the same functions directly.
_causal_conv1d_fwd_op = torch.library.custom_op(
    "vllm::causal_conv1d_fwd", _fwd_impl, mutates_args=("conv_states",)
)


@_causal_conv1d_fwd_op.register_fake
def _(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, silu,
      pad_slot_id, tile_seq, block_t):  # fmt: skip
    return x.new_empty(x.shape[1], x.shape[0]).t()


_causal_conv1d_update_op = torch.library.custom_op(
    "vllm::causal_conv1d_update", _update_impl, mutates_args=("conv_state",)
)


@_causal_conv1d_update_op.register_fake
def _(x, conv_state, weight, bias, silu, conv_state_indices, num_accepted_tokens,
      query_start_loc, max_query_len, pad_slot_id):  # fmt: skip
    if x.dim() == 3 and query_start_loc is None:
        return x.new_empty(x.shape[0], x.shape[2], x.shape[1]).transpose(1, 2)
    return x.new_empty(x.shape)
