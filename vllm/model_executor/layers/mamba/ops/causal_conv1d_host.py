"""Host-side work of the causal-conv1d ops (``causal_conv1d.py``): argument checks, the step
metadata, the launch configurations, and the launch plans that let a repeated eager call
cost little more than its launch.

Checks. Every check reads shapes, strides, dtypes, devices and Python values only (never
device data, so no sync) and raises a ValueError that names the argument. The ``*_data``
checks, used with ``validate_data=True``, read the index tensors (and sync).

Metadata. ``compute_causal_conv1d_metadata`` builds a step's tile map on the host (numpy)
with one copy to the device; the metadata builder calls it once per step.

Launch configurations. The tables in ``configs/causal_conv1d/`` (``vllm.triton_utils
.configs``): a device's own file, else ``default.json``; the rules here pick an entry by
the step's token and sequence counts.

Launch plans. Each op keeps a cache of launch plans keyed by everything its checks read
(``vllm.triton_utils.host.PlanCache``): a call whose arguments have the layout of an
earlier one finds its plan with one dict lookup and skips the checks and the launch
decisions. A plan launches its compiled kernel directly
(``vllm.triton_utils.host.direct_kernel``, which says when it must not).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from vllm.model_executor.layers.mamba.ops.causal_conv1d_kernels import (
    _LAUNCH_DECODE,
    _LAUNCH_FWD,
    _LAUNCH_UPDATE,
)
from vllm.model_executor.layers.mamba.ops.causal_conv1d_ref import NULL_BLOCK_ID, marker_for
from vllm.tensor_checks import FLOAT_DTYPES, check_conv_weight_bias, check_tensor
from vllm.triton_utils import configs
from vllm.triton_utils.host import (
    PlanCache,
    cdiv,
    direct_kernel,
    direct_stream,
    next_power_of_2,
    recording,
)
from vllm.triton_utils.launch import CachedLauncher

# --------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------


def check_common(x, weight, bias, conv_states, dim, states_name) -> int:
    """weight (dim, W), bias (dim,) contiguous or None, and the state pool (num_lines, dim,
    state_len >= W-1) of any non-aliasing strides, all on x's device; returns W."""
    width = check_conv_weight_bias(weight, bias, dim, x.device, FLOAT_DTYPES)
    check_tensor(states_name, conv_states, x.device, 3, FLOAT_DTYPES)
    if conv_states.shape[1] != dim:
        raise ValueError(
            f"{states_name} must be (num_cache_lines, dim={dim}, state_len), "
            f"got {tuple(conv_states.shape)}"
        )
    if conv_states.shape[2] < width - 1:
        raise ValueError(
            f"{states_name} state_len must be >= width-1 = {width - 1}, got {conv_states.shape[2]}"
        )
    # Any strides are served in place (the kernels take all three), except a pool whose
    # elements alias: a stride of 0 over a dimension of size > 1 (e.g. from expand) would
    # make two cache positions one, and torch refuses in-place writes to those as well.
    for size, stride in zip(conv_states.shape, conv_states.stride(), strict=True):
        if stride == 0 and size > 1:
            raise ValueError(
                f"{states_name} has overlapping elements (a stride of 0, as from expand; "
                f"strides {conv_states.stride()}): it is updated in place"
            )
    if bias is not None and bias.stride(0) != 1 and dim > 1:
        raise ValueError(f"bias must be contiguous (stride(0) == 1), got strides {bias.stride()}")
    return width


def feature_contiguous(conv_states: torch.Tensor) -> bool:
    """The pool's fast layout: features adjacent in memory (stride(1) == 1)."""
    return conv_states.stride(1) == 1


def check_index(name, t, device, batch, dtype=torch.int32) -> None:
    """A per-sequence array: 1-D, contiguous, at least ``batch`` entries (callers pass
    padded buffers; the entries past ``batch`` are never read)."""
    if t is None:
        return
    check_tensor(name, t, device, 1, (dtype,))
    if t.shape[0] < batch:
        raise ValueError(
            f"{name} must have at least batch={batch} entries (entries past batch are "
            f"ignored), got {t.shape[0]}"
        )
    if t.stride(0) != 1 and t.shape[0] > 1:
        raise ValueError(f"{name} must be contiguous (stride(0) == 1), got strides {t.stride()}")


def check_qsl(qsl, device) -> int:
    """``query_start_loc``: 1-D int32, contiguous, batch+1 >= 1 offsets; returns batch."""
    check_tensor("query_start_loc", qsl, device, 1, (torch.int32,))
    if qsl.shape[0] < 1:
        raise ValueError("query_start_loc must have batch+1 >= 1 entries")
    if qsl.stride(0) != 1 and qsl.shape[0] > 1:
        raise ValueError(
            f"query_start_loc must be contiguous (stride(0) == 1), got strides {qsl.stride()}"
        )
    return qsl.shape[0] - 1


class DefaultPadSlotId(int):
    """``NULL_BLOCK_ID`` as the default of ``pad_slot_id``: equal to it, and recognisable,
    so that a ``null_block_id`` next to an explicit, different ``pad_slot_id`` is an
    error rather than a silent choice of one of them."""

    def __repr__(self) -> str:
        return "NULL_BLOCK_ID"


PAD_DEFAULT = DefaultPadSlotId(NULL_BLOCK_ID)


def pad_marker(pad_slot_id, null_block_id, indices) -> int:
    """The index that marks a padded row: ``null_block_id`` (upstream's 2026 name) or
    ``pad_slot_id`` (by default ``NULL_BLOCK_ID``, line 0; ``PAD_SLOT_ID`` when a caller
    pads with -1); both given with different values is a ValueError. Without ``indices``
    (sequence b on line b) no row is padded, whatever the marker."""
    if isinstance(pad_slot_id, bool) or not isinstance(pad_slot_id, int):
        raise ValueError(f"pad_slot_id must be an int, got {pad_slot_id!r}")
    if null_block_id is None:
        return marker_for(pad_slot_id, indices)
    if isinstance(null_block_id, bool) or not isinstance(null_block_id, int):
        raise ValueError(f"null_block_id must be an int or None, got {null_block_id!r}")
    if type(pad_slot_id) is not DefaultPadSlotId and pad_slot_id != null_block_id:
        raise ValueError(
            f"pad_slot_id={pad_slot_id} and null_block_id={null_block_id} both name the "
            "padded-row index, with different values; give one of them"
        )
    return marker_for(null_block_id, indices)


def check_cache_indices_data(name, indices, num_lines, batch, pad_slot_id) -> None:
    """Reads the first ``batch`` indices: real lines in range, none twice (a negative index
    names no line: a padded row, as ``pad_slot_id``'s are)."""
    if indices is None:
        return
    idx = indices[:batch].cpu()
    real = idx[(idx != pad_slot_id) & (idx >= 0)]
    if bool((real >= num_lines).any()):
        raise ValueError(f"{name} has entries past the {num_lines} cache lines")
    if real.unique().numel() != real.numel():
        raise ValueError(f"{name} has duplicate cache lines among non-padded sequences")


def check_qsl_data(name, qsl, num_tokens) -> None:
    q = qsl.cpu()
    if int(q[0]) != 0 or bool((q[1:] < q[:-1]).any()) or int(q[-1]) != num_tokens:
        raise ValueError(
            f"{name} must start at 0, be non-decreasing and end at num_tokens={num_tokens}"
        )


def one_d_contiguous(*tensors) -> bool:
    """Each tensor is None or has stride (1,): only then is a plan keyed by strides exact for
    every length (a strided view of one entry passes the checks, of two it does not)."""
    return all(t is None or t.stride() == (1,) for t in tensors)


# --------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------


@dataclass
class CausalConv1dMetadata:
    """Per-step data for ``causal_conv1d_fn``, built once and shared by every layer.

    ``tile_seq[p]`` is the sequence holding token ``p * block_t`` (p < number of
    tiles of ``block_t`` tokens); the kernel reads it instead of binary-searching
    ``query_start_loc`` in every program.
    """

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    tile_seq: torch.Tensor
    block_t: int
    num_tokens: int
    batch_size: int
    max_query_len: int


def conv1d_metadata_host(query_start_loc_cpu: torch.Tensor) -> tuple[dict, dict]:
    """The host half of the step's metadata: (host tensors to upload: ``query_start_loc``
    and ``tile_seq``, int32; host fields). ``conv1d_metadata_from`` joins the two once the
    tensors are on the device (the model runner uploads them with the step's others).

    Host work only (numpy on the offsets, no device read), done once per step.
    """
    qsl = query_start_loc_cpu
    if not isinstance(qsl, torch.Tensor) or qsl.device.type != "cpu":
        raise ValueError("query_start_loc_cpu must be a CPU tensor")
    if qsl.dim() != 1 or qsl.shape[0] < 1 or qsl.dtype != torch.int32:
        raise ValueError(
            f"query_start_loc_cpu must be a 1-D int32 tensor of batch+1 offsets, got "
            f"shape {tuple(qsl.shape)} dtype {qsl.dtype}"
        )
    # numpy calls on arrays this small cost about a microsecond each: few of them, and the
    # ufunc and ndarray methods (a third of np.searchsorted's or ndarray.min's cost)
    q = qsl.numpy()
    batch = q.shape[0] - 1
    ends = q[1:]
    if batch:
        lens = ends - q[:-1]
        if q[0] != 0 or np.minimum.reduce(lens) < 0:
            raise ValueError("query_start_loc_cpu must start at 0 and be non-decreasing")
        max_query_len = int(np.maximum.reduce(lens))
    elif q[0] != 0:
        raise ValueError("query_start_loc_cpu must start at 0 and be non-decreasing")
    else:
        max_query_len = 0
    num_tokens = int(q[-1])
    block_t = _fwd_block_t(num_tokens)
    n_tiles = -(-num_tokens // block_t)
    # tile_seq[p], the last sequence starting at or before token t = p * block_t, is the
    # number of sequence ends at or before t (query_start_loc[0] = 0 <= t always).
    starts = _tile_starts(block_t, n_tiles)
    tiles = ends.searchsorted(starts, "right").astype(np.int32)
    host = {"query_start_loc": qsl, "tile_seq": torch.from_numpy(tiles)}
    fields = dict(
        query_start_loc_cpu=qsl,
        block_t=block_t,
        num_tokens=num_tokens,
        batch_size=batch,
        max_query_len=max_query_len,
    )
    return host, fields


def conv1d_metadata_from(fields: dict, device_tensors: dict) -> CausalConv1dMetadata:
    """The metadata from ``conv1d_metadata_host``'s fields and its tensors on the device."""
    return CausalConv1dMetadata(
        query_start_loc=device_tensors["query_start_loc"],
        tile_seq=device_tensors["tile_seq"],
        **fields,
    )


def compute_causal_conv1d_metadata(
    query_start_loc_cpu: torch.Tensor, device: torch.device | str
) -> CausalConv1dMetadata:
    """Build the step's metadata from host offsets; the copy to ``device`` is non-blocking.

    On CUDA the offsets and the tile map travel in one pinned buffer and one copy;
    ``query_start_loc`` and ``tile_seq`` are views of the device copy, each starting
    16-byte aligned (the kernels' compiled variants assume aligned pointers). The model
    runner does not call this: it uploads the host half with the rest of its step.
    """
    host, fields = conv1d_metadata_host(query_start_loc_cpu)
    device = device if isinstance(device, torch.device) else torch.device(device)
    if device.type == "cuda":
        batch, n_tiles = fields["batch_size"], host["tile_seq"].numel()
        off = (batch + 4) // 4 * 4  # batch + 1 offsets, rounded up to 16 bytes
        both = torch.empty(off + n_tiles, dtype=torch.int32, pin_memory=True)
        both[: batch + 1] = host["query_start_loc"]
        both[off:] = host["tile_seq"]
        both = both.to(device, non_blocking=True)
        dev = {"query_start_loc": both[: batch + 1], "tile_seq": both[off:]}
    else:
        dev = {name: t.to(device) for name, t in host.items()}
    return conv1d_metadata_from(fields, dev)


_TILE_STARTS: dict[int, np.ndarray] = {}


def _tile_starts(block_t: int, n_tiles: int) -> np.ndarray:
    """``arange(n_tiles) * block_t``, a view of a cached array grown as steps need."""
    starts = _TILE_STARTS.get(block_t)
    if starts is None or starts.shape[0] < n_tiles:
        size = max(n_tiles, 2 * (0 if starts is None else starts.shape[0]), 1024)
        starts = _TILE_STARTS[block_t] = np.arange(size, dtype=np.int32) * block_t
    return starts[:n_tiles]


# --------------------------------------------------------------------------
# Launch configurations (the tables in configs/causal_conv1d/)
# --------------------------------------------------------------------------


CONFIG_FOLDER = Path(__file__).resolve().parent / "configs" / "causal_conv1d"
"""The conv's launch tables (``vllm.triton_utils.configs``): ``default.json`` and one file
per tuned device."""


@functools.cache
def _tiles() -> tuple[int, int, int]:
    t = configs.lookup(CONFIG_FOLDER, "tiles")
    return t["block_t_small"], t["block_t_large"], t["small_step_tokens"]


def _fwd_block_t(num_tokens: int) -> int:
    """Tokens per tile: long tiles amortise the W-1 rows of context each one re-reads, short
    ones spread a small step over every SM (the table's ``tiles``)."""
    small, large, small_step_tokens = _tiles()
    return large if num_tokens > small_step_tokens else small


@functools.cache
def _fwd_configs(elem_size: int) -> dict[str, dict]:
    """The forward's launch configurations, by name: ``_fwd_config`` picks one, and the
    engine's start-up compiles them all (``_fwd_variants``). Shared: never mutate."""
    return configs.lookup(CONFIG_FOLDER, configs.table_key(elem_size=elem_size))["fwd"]


def _fwd_config(num_tokens: int, dim: int, width: int, elem_size: int, batch: int) -> dict:
    return _fwd_configs(elem_size)[_fwd_config_name(num_tokens, batch)]


def _fwd_config_name(num_tokens: int, batch: int) -> str:
    """Head programs take 4 sequences (``many_heads``) when there are more sequences than
    tiles (a step of mostly decodes): fewer, fuller programs. Otherwise one each
    (``tiles``): fewer registers, and the heads of longer sequences are not walked one after
    another. Small steps of prefills (sequences of 4 tiles on average, so no crowd of
    one-token heads) take ``small_step``: 16 rows in flight per program, registers capped
    so that more warps fit on an SM."""
    n_tiles = -(-num_tokens // _fwd_block_t(num_tokens))
    if num_tokens <= _tiles()[2] and 4 * batch <= n_tiles:
        return "small_step"
    return "many_heads" if batch >= max(32, n_tiles) else "tiles"


def _fwd_variants(base: dict, elem_size: int) -> list[dict]:
    """Every constexpr set a forward launch like ``base`` can take: each configuration
    with each tile length ``_fwd_block_t`` gives (the small-step one only with the tile
    length of small steps). Each dict is built in the launch's own key order (the flags,
    ``BLOCK_T``, then the configuration's entries): Triton keys its compiled kernels on the
    launch options' order too, so a ``maxnreg`` merged after ``num_warps`` here, where the
    launch has it before, would be compiled again at the first such launch."""
    configs = _fwd_configs(elem_size)
    chosen = {"BLOCK_T"}.union(*configs.values())
    flags = {k: v for k, v in base.items() if k not in chosen}
    small_step_tokens = _tiles()[2]
    block_ts = sorted({_fwd_block_t(1), _fwd_block_t(small_step_tokens + 1)})
    out = []
    for name, cfg in configs.items():
        for block_t in block_ts:
            if name == "small_step" and block_t != _fwd_block_t(small_step_tokens):
                continue
            out.append({**flags, "BLOCK_T": block_t, **cfg})
    return out


def _update_config(batch: int, dim: int, block_l: int, width: int) -> dict:
    # Enough programs to cover the GPU several times over, at least 32 features each.
    target = cdiv(batch * dim, 132 * 4)
    block_d = min(256, max(32, next_power_of_2(target)))
    block_c = next_power_of_2(width - 1 + block_l - 1)
    num_warps = 4 if block_d >= 128 else 1
    return dict(BLOCK_L=block_l, BLOCK_C=block_c, BLOCK_D=block_d, num_warps=num_warps)


@functools.cache
def _decode_configs(elem_size: int) -> dict[str, dict]:
    """The decode kernel's launch configurations, by name (``_decode_config`` picks one;
    the engine's start-up compiles them all). Shared: never mutate."""
    return configs.lookup(CONFIG_FOLDER, configs.table_key(elem_size=elem_size))["decode"]


def _decode_config(batch: int, dim: int, elem_size: int) -> dict:
    # A lone sequence (or two) is spread thinner than a batch.
    return _decode_configs(elem_size)["lone" if batch <= 2 else "batch"]


# --------------------------------------------------------------------------
# Launch plans (see causal_conv1d_host.py): repeated eager calls skip the checks
# --------------------------------------------------------------------------


def _update_key(x, conv_state, weight, bias, activation, conv_state_indices, num_accepted_tokens,
                query_start_loc, max_query_len, pad_slot_id, metadata, null_block_id):  # fmt: skip
    """Everything ``causal_conv1d_update``'s checks and launch decisions read. Python values
    come with their types (True == 1, -1.0 == -1 and the pad default == -1 must not share
    a plan: some of them are errors)."""
    return (
        x.shape, x.stride(), x.dtype, x.device,
        conv_state.shape, conv_state.stride(), conv_state.dtype, conv_state.device,
        weight.shape, weight.stride(), weight.dtype, weight.device,
        None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device),
        None if conv_state_indices is None else (
            conv_state_indices.shape, conv_state_indices.stride(), conv_state_indices.dtype,
            conv_state_indices.device),
        None if num_accepted_tokens is None else (
            num_accepted_tokens.shape, num_accepted_tokens.stride(), num_accepted_tokens.dtype,
            num_accepted_tokens.device),
        None if query_start_loc is None else (
            query_start_loc.shape, query_start_loc.stride(), query_start_loc.dtype,
            query_start_loc.device),
        activation, type(activation), max_query_len, type(max_query_len),
        pad_slot_id, type(pad_slot_id), null_block_id, type(null_block_id),
        None if metadata is None else (type(metadata), metadata.batch_size,
                                       metadata.max_query_len),
    )  # fmt: skip


def _fwd_key(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
             activation, pad_slot_id, metadata, null_block_id):  # fmt: skip
    """What ``causal_conv1d_fn``'s checks read, less what changes from step to step (the
    token count, the batch, the index arrays' lengths, the metadata: the plan checks those
    on every call)."""
    return (
        x.shape[0], x.stride(), x.dtype, x.device,
        weight.shape, weight.stride(), weight.dtype, weight.device,
        None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device),
        conv_states.shape, conv_states.stride(), conv_states.dtype, conv_states.device,
        query_start_loc.stride(), query_start_loc.dtype, query_start_loc.device,
        None if cache_indices is None else (cache_indices.stride(), cache_indices.dtype,
                                            cache_indices.device),
        None if has_initial_state is None else (has_initial_state.stride(),
                                                has_initial_state.dtype,
                                                has_initial_state.device),
        activation, type(activation), pad_slot_id, type(pad_slot_id),
        null_block_id, type(null_block_id), metadata is None,
    )  # fmt: skip


_KEY_ERRORS = (AttributeError, TypeError, IndexError)  # not tensors: the checks will say so
_I32_MAX = 2**31 - 1


class _Plan:
    """What every plan shares: its launcher, and the compiled kernels it launches directly.

    ``direct[key]`` is ``(launch, head, tail, device, get_device, get_stream)`` once the
    variant ``key`` is compiled (see ``FastKernel``); ``launched`` holds the variants the
    ``CachedLauncher`` has seen (under the interpreter, later launches skip its key).
    """

    launcher: CachedLauncher

    def __init__(self, x):
        self.on_cuda = x.is_cuda
        self.direct: dict = {}
        self.launched: set = set()

    def launch_general(self, grid, args, constexprs, variants, key=None) -> None:
        """Through the ``CachedLauncher``: a variant's first launch, and every launch the
        direct path declines (unaligned pointers, a precompile block, another current device,
        the interpreter). Afterwards the compiled kernel is kept for direct launches."""
        launcher = self.launcher
        if not launcher.direct and key in self.launched and not recording():
            launcher.kernel[grid](*args, **constexprs)
            return
        launcher(grid, args, constexprs, variants=variants)
        self.launched.add(key)
        if key not in self.direct:
            fast = direct_kernel(launcher, args, constexprs)
            if fast is not None:
                self.direct[key] = (fast.fn, fast.head, fast.tail, fast.device,
                                    torch._C._cuda_getDevice,
                                    torch._C._cuda_getCurrentRawStream)  # fmt: skip


class _DecodePlan(_Plan):
    """``causal_conv1d_update`` on one-token rows (the decode kernel), for one layout: every
    launch argument but the pointers is fixed."""

    launcher = _LAUNCH_DECODE

    def __init__(self, x, conv_state, weight, bias, silu, idx, pad_slot_id):
        super().__init__(x)
        batch, dim = x.shape
        self.batch = batch
        self.has_bias, self.has_idx = bias is not None, idx is not None
        cfg = _decode_config(batch, dim, x.element_size())
        self.grid = (batch, cdiv(dim, cfg["BLOCK_D"]))
        self.constexprs = dict(
            KERNEL_WIDTH=weight.shape[1],
            HAS_BIAS=bias is not None,
            SILU=silu,
            HAS_INDICES=idx is not None,
            STATE_D_CONTIG=feature_contiguous(conv_state),
            **cfg,
        )
        configs = _decode_configs(x.element_size()).values()
        self.variants = lambda: [{**self.constexprs, **c} for c in configs]
        # empty_like keeps a dense x's strides: used when that is the contiguous layout
        self.like = torch.empty_like(x).stride() == (dim, 1)
        self.shape, self.dtype, self.device = x.shape, x.dtype, x.device
        self.ints = (dim, pad_slot_id, x.stride(0), weight.stride(0), *conv_state.stride(), dim)

    def alloc(self, x):
        if self.like:
            return torch.empty_like(x)
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def run(self, x, conv_state, weight, bias, idx, *_):
        out = torch.empty_like(x) if self.like else self.alloc(x)
        if self.batch:
            self.launch(out, x, conv_state, weight, bias, idx)
        return out

    def launch(self, out, x, conv_state, weight, bias, idx):
        d = self.direct.get(None)
        if d is not None and not recording() and d[4]() == d[3]:
            px, ps, pw, po = x.data_ptr(), conv_state.data_ptr(), weight.data_ptr(), out.data_ptr()
            pb = bias.data_ptr() if self.has_bias else 0
            pi = idx.data_ptr() if self.has_idx else 0
            if not (px | ps | pw | po | pb | pi) & 15:
                d[0](*self.grid, 1, d[5](d[3]), *d[1], px, pw, pb or None, ps, pi or None, po,
                     *self.ints, *d[2])  # fmt: skip
                return
        args = (x, weight, bias, conv_state, idx, out, *self.ints)
        self.launch_general(self.grid, args, self.constexprs, self.variants)


class _UpdatePlan(_Plan):
    """``causal_conv1d_update`` through the general kernel (several tokens per row, varlen,
    speculative decoding), for one layout: every launch argument but the pointers is fixed."""

    launcher = _LAUNCH_UPDATE

    def __init__(self, x, conv_state, weight, bias, silu, idx, accepted, qsl, max_query_len,
                 pad_slot_id):  # fmt: skip
        super().__init__(x)
        self.shape, self.dtype, self.device = x.shape, x.dtype, x.device
        width = weight.shape[1]
        if qsl is not None:
            batch, dim, seqlen = qsl.shape[0] - 1, x.shape[1], 0
            self.out_strides = (dim, 1)
            strides_x, strides_out = (0, x.stride(0)), (0, dim)
            hint = max_query_len if max_query_len > 0 else 4
        elif x.dim() == 2:
            batch, dim = x.shape
            seqlen = 1
            self.out_strides = (dim, 1)
            strides_x, strides_out = (x.stride(0), 0), (dim, 0)
            hint = 1
        else:
            batch, dim, seqlen = x.shape
            self.out_strides = (seqlen * dim, 1, dim)
            strides_x, strides_out = (x.stride(0), x.stride(2)), (seqlen * dim, dim)
            hint = seqlen
        cfg = _update_config(batch, dim, min(next_power_of_2(max(hint, 1)), 8), width)
        self.grid = (batch, cdiv(dim, cfg["BLOCK_D"]))
        self.ints = (dim, seqlen, pad_slot_id, *strides_x, weight.stride(0), *conv_state.stride(),
                     *strides_out)  # fmt: skip
        self.constexprs = dict(
            KERNEL_WIDTH=width,
            HAS_BIAS=bias is not None,
            SILU=silu,
            HAS_INDICES=idx is not None,
            IS_SPEC=accepted is not None,
            IS_VARLEN=qsl is not None,
            **cfg,
        )

    def alloc(self, x):
        return torch.empty_strided(self.shape, self.out_strides, dtype=self.dtype,
                                   device=self.device)  # fmt: skip

    def run(self, x, conv_state, weight, bias, idx, accepted, qsl):
        out = self.alloc(x)
        if self.grid[0]:
            self.launch(out, x, conv_state, weight, bias, idx, accepted, qsl)
        return out

    def launch(self, out, x, conv_state, weight, bias, idx, accepted, qsl):
        d = self.direct.get(None)
        if d is not None and not recording() and d[4]() == d[3]:
            tensors = (x, weight, bias, conv_state, idx, accepted, qsl, out)
            ptrs = [t if t is None else t.data_ptr() for t in tensors]
            acc = 0
            for p in ptrs:
                acc |= p or 0
            if not acc & 15:
                d[0](*self.grid, 1, d[5](d[3]), *d[1], *ptrs, *self.ints, *d[2])
                return
        args = (x, weight, bias, conv_state, idx, accepted, qsl, out, *self.ints)
        self.launch_general(self.grid, args, self.constexprs, None)


class _FwdPlan(_Plan):
    """``causal_conv1d_fn`` for one layout. Per call it checks what changes from step to
    step, picks the configuration (from the token count and the batch, as ``_fwd_impl``)
    and launches that configuration's compiled kernel."""

    launcher = _LAUNCH_FWD

    def __init__(self, x, weight, bias, conv_states, qsl, idx, init, silu, pad_slot_id,
                 with_meta):  # fmt: skip
        super().__init__(x)
        dim = x.shape[0]
        self.dim, self.num_lines = dim, conv_states.shape[0]
        self.dtype, self.device = x.dtype, x.device
        self.es = x.element_size()
        self.has = (bias is not None, idx is not None, init is not None, with_meta)
        self.base = dict(
            KERNEL_WIDTH=weight.shape[1],
            HAS_BIAS=bias is not None,
            SILU=silu,
            HAS_CACHE_INDICES=idx is not None,
            HAS_INITIAL_STATE=init is not None,
            HAS_TILE_SEQ=with_meta,
            STATE_D_CONTIG=feature_contiguous(conv_states),
        )
        self.static_ints = (pad_slot_id, x.stride(1), weight.stride(0), *conv_states.stride(), dim)
        self.configs = {}  # (config name, BLOCK_T, wide) -> (constexprs, blocks, HEAD_S)

    def step(self, num_tokens, qsl, idx, init, metadata):
        """(variant, grid size, the step's int arguments), or None when the step does not fit
        the plan (the full checks then run and raise the right error)."""
        batch = qsl.shape[0] - 1
        if batch < 0:
            return None
        _, has_idx, has_init, with_meta = self.has
        if has_idx:
            if idx.shape[0] < batch:
                return None
        elif batch > self.num_lines:
            return None
        if has_init and init.shape[0] < batch:
            return None
        if with_meta:
            if (
                not isinstance(metadata, CausalConv1dMetadata)
                or metadata.num_tokens != num_tokens
                or metadata.batch_size != batch
                or metadata.tile_seq.device != self.device
            ):
                return None
            block_t = metadata.block_t
        else:
            block_t = _fwd_block_t(num_tokens)
        # a token count past int32 is a kernel variant of its own (Triton keys it so)
        key = (_fwd_config_name(num_tokens, batch), block_t, num_tokens > _I32_MAX)
        cfg = self.configs.get(key)
        if cfg is None:
            c = _fwd_configs(self.es)[key[0]]
            cfg = ({**self.base, "BLOCK_T": block_t, **c}, cdiv(self.dim, c["BLOCK_D"]),
                   c["HEAD_S"])  # fmt: skip
            self.configs[key] = cfg
        _, n_blocks_d, head_s = cfg
        n_tiles = -(-num_tokens // block_t)
        grid0 = (n_tiles - (-batch // head_s)) * n_blocks_d
        return key, grid0, (num_tokens, n_tiles, self.dim, batch, batch.bit_length())

    def alloc(self, num_tokens):
        return torch.empty_strided((self.dim, num_tokens), (1, self.dim), dtype=self.dtype,
                                   device=self.device)  # fmt: skip

    def run(self, x, weight, bias, conv_states, qsl, idx, init, metadata, num_tokens):
        step = self.step(num_tokens, qsl, idx, init, metadata)
        if step is None:
            return None
        out = self.alloc(num_tokens)
        if step[1]:
            self.launch(step, out, x, weight, bias, conv_states, qsl, idx, init, metadata)
        return out

    def launch(self, step, out, x, weight, bias, conv_states, qsl, idx, init, metadata):
        key, grid0, ints = step
        tile_seq = metadata.tile_seq if metadata is not None else None
        d = self.direct.get(key)
        if d is not None and not recording() and d[4]() == d[3]:
            has_bias, has_idx, has_init, with_meta = self.has
            px, pw, ps, pq, po = (x.data_ptr(), weight.data_ptr(), conv_states.data_ptr(),
                                  qsl.data_ptr(), out.data_ptr())  # fmt: skip
            pb = bias.data_ptr() if has_bias else 0
            pi = idx.data_ptr() if has_idx else 0
            ph = init.data_ptr() if has_init else 0
            pt = tile_seq.data_ptr() if with_meta else 0
            if not (px | pw | ps | pq | po | pb | pi | ph | pt) & 15:
                d[0](grid0, 1, 1, d[5](d[3]), *d[1], px, pw, pb or None, ps, pq, pi or None,
                     ph or None, pt or None, po, *ints, *self.static_ints, *d[2])  # fmt: skip
                return
        args = (x, weight, bias, conv_states, qsl, idx, init, tile_seq, out, *ints,
                *self.static_ints)  # fmt: skip
        constexprs = self.configs[key][0]
        variants = lambda: _fwd_variants(constexprs, self.es)  # noqa: E731
        self.launch_general((grid0,), args, constexprs, variants, key)


_UPDATE_PLANS = PlanCache()
_FWD_PLANS = PlanCache()


def clear_host_caches() -> None:
    """Forget every launch plan (the benchmark swaps kernels for stubs; tests start clean)."""
    _UPDATE_PLANS.clear()
    _FWD_PLANS.clear()


def host_path_pieces(op, *args, **kwargs) -> dict:
    """The pieces of an eager call's host path, each a callable that repeats just that piece
    with these arguments (for benchmarks/kernels/benchmark_conv_host_cost.py): the plan
    lookup (every check a repeated call makes), the output allocation, the stream lookup
    (GPU), the launch, and the whole call. Calls ``op`` once first, which builds the plan."""
    import inspect

    from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
        causal_conv1d_fn,
        causal_conv1d_update,
    )

    op(*args, **kwargs)
    bound = inspect.signature(op).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    if a.get("validate_data"):
        raise ValueError("validate_data=True calls take the full checks every time")
    if op is causal_conv1d_update:
        names = ("x", "conv_state", "weight", "bias", "activation", "conv_state_indices",
                 "num_accepted_tokens", "query_start_loc", "max_query_len", "pad_slot_id",
                 "metadata", "null_block_id")  # fmt: skip
        key_args = [a[n] for n in names]
        plan = _UPDATE_PLANS[_update_key(*key_args)]
        run_args = (a["x"], a["conv_state"], a["weight"], a["bias"], a["conv_state_indices"])
        if not isinstance(plan, _DecodePlan):
            run_args += (a["num_accepted_tokens"], a["query_start_loc"])
        out = plan.alloc(a["x"])
        pieces = {
            "plan lookup (checks)": lambda: _UPDATE_PLANS.get(_update_key(*key_args)),
            "output allocation": lambda: plan.alloc(a["x"]),
            "launch": lambda: plan.launch(out, *run_args),
        }
    elif op is causal_conv1d_fn:
        names = ("x", "weight", "bias", "conv_states", "query_start_loc", "cache_indices",
                 "has_initial_state", "activation", "pad_slot_id", "metadata",
                 "null_block_id")  # fmt: skip
        key_args = [a[n] for n in names]
        plan = _FWD_PLANS[_fwd_key(*key_args)]
        x, meta = a["x"], a["metadata"]
        step_args = (x.shape[1], a["query_start_loc"], a["cache_indices"],
                     a["has_initial_state"], meta)  # fmt: skip
        step = plan.step(*step_args)
        out = plan.alloc(x.shape[1])
        launch_args = (x, a["weight"], a["bias"], a["conv_states"], a["query_start_loc"],
                       a["cache_indices"], a["has_initial_state"], meta)  # fmt: skip
        pieces = {
            "plan lookup (checks)": lambda: _FWD_PLANS.get(_fwd_key(*key_args)),
            "step checks and config": lambda: plan.step(*step_args),
            "output allocation": lambda: plan.alloc(x.shape[1]),
            "launch": lambda: plan.launch(step, out, *launch_args),
        }
    else:
        raise ValueError(f"no host-path pieces for {op!r}")
    if plan.on_cuda:
        device = a["x"].device.index
        pieces["stream lookup"] = lambda: direct_stream(device)
    pieces["whole call"] = lambda: op(*args, **kwargs)
    return pieces
