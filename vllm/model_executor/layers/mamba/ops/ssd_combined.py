"""The Triton SSD: the Mamba2 chunked scan over every prefill sequence of a step, in 3 launches.

Per head h of a sequence (group g = h // (nheads // ngroups)), with state S (headdim x
dstate), the same recurrence as ``mamba_ssm_torch`` (its reference ``ssm_scan_ref``)::

    dt_t = clamp(softplus(dt_raw_t + dt_bias[h]), *dt_limit)       (softplus when asked)
    S_t  = exp(dt_t * A[h]) * S_{t-1} + dt_t * x_t B_t^T
    y_t  = S_t C_t + D[h] * x_t

computed over chunks of ``chunk_size`` tokens (the SSD decomposition, docs/ssd.md):

1. ``ssd_chunk_state``: each chunk's dt, cumulative decay, and contribution to the state;
2. ``ssd_state_passing``: the states carried across each sequence's chunks (initial state
   read from its pool line, final state written back), and, in the same launch, each
   chunk's C B^T (``ssd_bmm``);
3. ``ssd_chunk_scan``: the outputs.

Tensors (logical shapes; views with any strides, every stride honoured; int64 addressing):

- ``x`` (num_tokens, nheads, headdim), ``dt`` (num_tokens, nheads) before the bias, ``B``,
  ``C`` (num_tokens, ngroups, dstate): the whole step's token axis. x, B and C share one
  dtype (fp32, fp16 or bf16); only the rows of the layout's chunks are read.
- ``A`` (nheads,) negative, ``D``, ``dt_bias`` (nheads,) or None.
- ``ssm_states`` (num_lines, nheads, headdim, dstate): the layer's state pool, fp32, fp16 or
  bf16, read and written in its dtype (math in fp32). Sequence i starts from line
  ``state_indices[i]`` when ``has_initial_state[i]`` (zeros otherwise; None: none has one)
  and leaves its final state there. A sequence on ``PAD_SLOT_ID`` reads and writes no line,
  and its rows get y = 0; lines no sequence names stay bit-identical.
- ``out`` (num_tokens, nheads, headdim), any float dtype: only the chunks' rows are written.

``plan_ssd_chunks`` builds the layout on the host (once per step, shared by every layer).
Nothing here reads device data on the host, and the launch configurations depend only on
the model's shapes and dtypes (``ssd_configs``), never on the step's counts, which the
kernels take as non-specialised arguments: a new step shape compiles nothing. Registered as
``torch.ops.vllm.mamba_chunk_scan_combined_varlen``. CUDA tensors run the kernels; CPU
tensors only under ``TRITON_INTERPRET=1`` (``use_ssd_kernel``), where ``mamba_ssm_torch``'s
``chunk_scan_varlen`` is the CPU path.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch

from vllm.model_executor.layers.mamba.ops.ssd_chunk_scan import _LAUNCH as _SCAN_LAUNCH
from vllm.model_executor.layers.mamba.ops.ssd_chunk_scan import launch_chunk_scan
from vllm.model_executor.layers.mamba.ops.ssd_chunk_state import launch_chunk_state
from vllm.model_executor.layers.mamba.ops.ssd_state_passing import launch_state_passing
from vllm.tensor_checks import FLOAT_DTYPES, check_scan_shapes, check_tensor
from vllm.triton_utils import HAS_TRITON, triton

__all__ = [
    "SSDChunkLayout",
    "mamba_chunk_scan_combined_varlen",
    "plan_ssd_chunks",
    "ssd_configs",
    "use_ssd_kernel",
]

_NO_LIMIT = (0.0, math.inf)
_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass
class SSDChunkLayout:
    """The chunks of one step's sequences, rows absolute in the step's token axis.

    Sequence i covers rows ``[q[i], q[i+1])`` of ``query_start_loc``; it is cut into chunks
    of ``chunk_size`` rows, the last one partial, so no chunk mixes sequences. Host ints:
    ``num_seqs``, ``num_chunks``, ``num_tokens`` (rows covered), ``first_row`` and
    ``end_row`` (``q[0]``, ``q[-1]``). int32 tensors: ``chunk_starts`` (num_chunks+1,) the
    first row of each chunk (then ``end_row``: chunks tile the rows), ``chunk_seqs``
    (num_chunks,) each chunk's sequence, ``seq_chunk_starts`` (num_seqs+1,) each sequence's
    first chunk (a sequence without tokens has none).
    """

    chunk_size: int
    num_seqs: int
    num_chunks: int
    num_tokens: int
    first_row: int
    end_row: int
    chunk_starts: torch.Tensor
    chunk_seqs: torch.Tensor
    seq_chunk_starts: torch.Tensor

    TENSOR_FIELDS = ("chunk_starts", "chunk_seqs", "seq_chunk_starts")

    def to(self, device: torch.device | str) -> SSDChunkLayout:
        moved = {n: getattr(self, n).to(device, non_blocking=True) for n in self.TENSOR_FIELDS}
        return replace(self, **moved)


def plan_ssd_chunks(query_start_loc_cpu: torch.Tensor, chunk_size: int) -> SSDChunkLayout:
    """The chunk layout of sequences at rows ``query_start_loc_cpu`` (CPU, (num_seqs+1,),
    non-decreasing, starting anywhere); CPU tensors, ``.to(device)`` moves them.

    Built with numpy on the tensor's memory: a handful of vector operations of a
    microsecond each, where as many torch calls would cost tens of microseconds per step.
    """
    q = query_start_loc_cpu
    if not isinstance(q, torch.Tensor) or q.device.type != "cpu":
        raise ValueError("query_start_loc_cpu must be a CPU tensor")
    if q.dim() != 1 or q.numel() < 1 or q.is_floating_point() or q.dtype == torch.bool:
        raise ValueError(
            f"query_start_loc_cpu must be 1-D integers (num_seqs+1,), got {q.dtype} "
            f"{tuple(q.shape)}"
        )
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    rows = q.numpy().astype(np.int64)
    lens = np.diff(rows)
    if (lens < 0).any() or rows[0] < 0 or rows[-1] >= 2**31:
        raise ValueError("query_start_loc_cpu must be non-decreasing rows in [0, 2**31)")
    num_seqs = lens.size
    seq_chunk_starts = np.zeros(num_seqs + 1, dtype=np.int32)
    np.cumsum(-(-lens // chunk_size), out=seq_chunk_starts[1:])
    num_chunks = int(seq_chunk_starts[-1])
    chunk_seqs = np.repeat(np.arange(num_seqs, dtype=np.int32), np.diff(seq_chunk_starts))
    chunk_starts = np.empty(num_chunks + 1, dtype=np.int32)
    pos = np.arange(num_chunks) - seq_chunk_starts[chunk_seqs]
    chunk_starts[:num_chunks] = rows[chunk_seqs] + pos * chunk_size
    chunk_starts[num_chunks] = rows[-1]
    return SSDChunkLayout(
        chunk_size=chunk_size,
        num_seqs=num_seqs,
        num_chunks=num_chunks,
        num_tokens=int(rows[-1] - rows[0]),
        first_row=int(rows[0]),
        end_row=int(rows[-1]),
        chunk_starts=torch.from_numpy(chunk_starts),
        chunk_seqs=torch.from_numpy(chunk_seqs),
        seq_chunk_starts=torch.from_numpy(seq_chunk_starts),
    )


# --------------------------------------------------------------------------------------
# Launch configurations and the workspace
# --------------------------------------------------------------------------------------


@functools.cache
def ssd_configs(
    nheads: int,
    headdim: int,
    dstate: int,
    ngroups: int,
    chunk_size: int,
    dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> dict[str, dict]:
    """The three launches' constexprs by kernel, from the model's shapes and dtypes only
    (``dtype`` of x, B, C; ``out_dtype`` of y).
    Shared: never mutate. Chosen by sm_90 register counts without spills (docs/ssd.md lists
    them), then by the H200 sweep noted at each entry."""

    def dot_block(n: int, cap: int) -> int:  # tl.dot takes blocks of 16 and more
        return max(16, min(cap, triton.next_power_of_2(n)))

    block_t = dot_block(chunk_size, 64)
    block_p = dot_block(headdim, 64)
    # fp32 operands take tf32x3 dots (three products each): narrower blocks and no
    # pipelining keep them out of local memory (816 bytes of spills at the 16-bit blocks).
    f32 = dtype == torch.float32
    # 2048 state elements per state-passing program (16 fp32 per thread at 4 warps).
    block_sn = min(128, triton.next_power_of_2(dstate))
    block_sp = min(triton.next_power_of_2(headdim), max(1, 2048 // block_sn))
    return {
        # H200 sweep (benchmarks/kernels/tune_ssd.py, docs/benchmarks/ssd_tune_h200.md):
        # 32-token blocks 1.03x over 64; the split dots stay (without them the final
        # states' error rises from 3e-6 to 1.6e-3 for a 1.06x gain).
        "chunk_state": dict(
            SPLIT=not f32,
            BLOCK_T=dot_block(chunk_size, 32),
            BLOCK_P=block_p,
            BLOCK_N=dot_block(dstate, 64 if f32 else 128),
            num_warps=4,
            num_stages=1 if f32 else 2,
        ),
        # One stage: the CB job's pipelining would take 98 KiB of shared memory, which
        # would leave room for 2 programs per SM where the state chains want many.
        "state_passing": dict(
            BLOCK_SP=block_sp,
            BLOCK_SN=block_sn,
            BLOCK_T=block_t,
            BLOCK_N=dot_block(dstate, 32 if f32 else 128),
            num_warps=4,
            num_stages=1,
        ),
        # A 16-bit y's rounding dwarfs a single-cast local dot's error (y rel-L2 2.0e-3
        # either way): that split only for an fp32 y. The carried-state dot keeps its split:
        # without it a chunked prefill and one prefill differ where a large carried term
        # cancels a large local one. One stage. H200 sweeps (ssd_tune_h200.md).
        "chunk_scan": dict(
            SPLIT=out_dtype == torch.float32,
            SPLIT_STATE=not f32,
            BLOCK_T=block_t,
            BLOCK_S=dot_block(chunk_size, 32),
            BLOCK_P=block_p,
            BLOCK_N=dot_block(dstate, 32 if f32 else 64),
            ROW_BLOCKS=1,
            num_warps=4,
            num_stages=1,
        ),
    }


class SSDWorkspace(NamedTuple):
    """One call's fp32 intermediates (views of one allocation): ``states`` (chunks, nheads,
    headdim, dstate) chunk contributions, then start states; ``cb`` (chunks, ngroups, L, L);
    ``dt``, ``cs`` (chunks, nheads, L); ``decay`` (chunks, nheads)."""

    states: torch.Tensor
    cb: torch.Tensor
    dt: torch.Tensor
    cs: torch.Tensor
    decay: torch.Tensor


def _workspace(num_chunks, nheads, headdim, dstate, ngroups, chunk_size, device) -> SSDWorkspace:
    n, L = num_chunks, chunk_size
    shapes = dict(
        states=(n, nheads, headdim, dstate),
        cb=(n, ngroups, L, L),
        dt=(n, nheads, L),
        cs=(n, nheads, L),
        decay=(n, nheads),
    )
    sizes = {k: math.prod(s) for k, s in shapes.items()}
    # Each part starts 128-byte aligned; at least one element, so no pointer is null.
    offsets, total = {}, 0
    for k, size in sizes.items():
        offsets[k] = total
        total += -(-max(size, 1) // 32) * 32
    buf = torch.empty(total, dtype=torch.float32, device=device)
    return SSDWorkspace(
        **{k: buf[offsets[k] : offsets[k] + sizes[k]].view(shapes[k]) for k in shapes}
    )


class _Chunks(NamedTuple):
    """The layout's tensors as the op takes them (a dataclass cannot cross torch.library)."""

    chunk_size: int
    chunk_starts: torch.Tensor
    chunk_seqs: torch.Tensor
    seq_chunk_starts: torch.Tensor

    @property
    def num_chunks(self) -> int:
        return self.chunk_starts.shape[0] - 1

    @property
    def num_seqs(self) -> int:
        return self.seq_chunk_starts.shape[0] - 1


# --------------------------------------------------------------------------------------
# Checks, launch, op
# --------------------------------------------------------------------------------------


def use_ssd_kernel(x: torch.Tensor) -> bool:
    """CUDA tensors run the kernels; CPU tensors only under the interpreter
    (``CachedLauncher.runs_cpu_tensors``)."""
    return x.is_cuda or (x.device.type == "cpu" and _SCAN_LAUNCH.runs_cpu_tensors())


def _check_args(
    x, dt, A, B, C, layout, ssm_states, state_indices, has_initial_state, D, dt_bias, out
) -> None:
    device = x.device
    check_tensor("x", x, device, 3, FLOAT_DTYPES)
    for name, t in (("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("dt_bias", dt_bias)):
        if t is not None:
            check_tensor(name, t, device, None, FLOAT_DTYPES)
    check_scan_shapes(x, dt, A, B, C, D, dt_bias)
    if B.dtype != x.dtype or C.dtype != x.dtype:
        raise ValueError(f"B and C must have x's dtype {x.dtype}, got {B.dtype} and {C.dtype}")
    num_tokens, nheads, headdim = x.shape
    dstate = B.shape[2]
    check_tensor("ssm_states", ssm_states, device, 4, FLOAT_DTYPES)
    if tuple(ssm_states.shape[1:]) != (nheads, headdim, dstate):
        raise ValueError(
            f"ssm_states must be (num_lines, {nheads}, {headdim}, {dstate}), got "
            f"{tuple(ssm_states.shape)}"
        )
    if out is not None:
        check_tensor("out", out, device, 3, FLOAT_DTYPES)
        if out.shape != x.shape:
            raise ValueError(f"out must be shaped like x {tuple(x.shape)}, got {tuple(out.shape)}")
    if not isinstance(layout, SSDChunkLayout):
        raise ValueError(f"layout must be an SSDChunkLayout, got {type(layout).__name__}")
    for name in SSDChunkLayout.TENSOR_FIELDS:
        t = getattr(layout, name)
        if t.device != device:
            raise ValueError(
                f"layout.{name} is on {t.device} but x is on {device} (layout.to(device))"
            )
    if layout.end_row > num_tokens:
        raise ValueError(
            f"layout covers token rows up to {layout.end_row}, but x has {num_tokens} rows"
        )
    n = layout.num_seqs
    check_tensor("state_indices", state_indices, device, 1, _INDEX_DTYPES)
    if state_indices.shape[0] != n:
        raise ValueError(f"state_indices must be (num_seqs={n},), got {tuple(state_indices.shape)}")
    if has_initial_state is not None:
        check_tensor("has_initial_state", has_initial_state, device, 1, (torch.bool,))
        if has_initial_state.shape[0] != n:
            raise ValueError(
                f"has_initial_state must be (num_seqs={n},), got {tuple(has_initial_state.shape)}"
            )
    if not HAS_TRITON:
        raise RuntimeError("the SSD kernels need Triton, which is not installed")
    if not use_ssd_kernel(x):
        raise RuntimeError(
            f"the SSD kernels run on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 "
            f"(set before the kernels are imported); x is on {device} "
            "(mamba_ssm_torch.chunk_scan_varlen is the CPU path)"
        )


def _launch(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_starts: torch.Tensor,
    chunk_seqs: torch.Tensor,
    seq_chunk_starts: torch.Tensor,
    chunk_size: int,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_lo: float,
    dt_hi: float,
    out: torch.Tensor,
) -> None:
    chunks = _Chunks(chunk_size, chunk_starts, chunk_seqs, seq_chunk_starts)
    if chunks.num_seqs == 0:
        return
    _, nheads, headdim = x.shape
    ngroups, dstate = B.shape[1:]
    cfg = ssd_configs(nheads, headdim, dstate, ngroups, chunk_size, x.dtype, out.dtype)
    ws = _workspace(chunks.num_chunks, nheads, headdim, dstate, ngroups, chunk_size, x.device)
    # Triton takes a bool tensor as i1 pointers; bytes are plainer.
    init = None if has_initial_state is None else has_initial_state.view(torch.uint8)
    if chunks.num_chunks:
        flags = dict(
            HAS_DT_BIAS=dt_bias is not None,
            DT_SOFTPLUS=bool(dt_softplus),
            HAS_DT_LIMIT=(dt_lo, dt_hi) != _NO_LIMIT,
            dt_min=dt_lo,
            dt_max=dt_hi,
        )
        launch_chunk_state(x, dt, A, dt_bias, B, chunk_starts, ws, flags, cfg["chunk_state"])
    launch_state_passing(B, C, chunks, ssm_states, state_indices, init, ws, cfg["state_passing"])
    if chunks.num_chunks:
        launch_chunk_scan(x, C, D, chunks, state_indices, init, ws, out, cfg["chunk_scan"])


def mamba_chunk_scan_combined_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    layout: SSDChunkLayout,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = _NO_LIMIT,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scan every sequence of ``layout`` (see the module docstring); returns ``out``
    (allocated in x's dtype when None), updates the sequences' lines of ``ssm_states``."""
    _check_args(
        x, dt, A, B, C, layout, ssm_states, state_indices, has_initial_state, D, dt_bias, out
    )
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dt_lo, dt_hi = (float(v) for v in dt_limit)
    args = (x, dt, A, B, C, layout.chunk_starts, layout.chunk_seqs, layout.seq_chunk_starts,
            layout.chunk_size, ssm_states, state_indices, has_initial_state, D, dt_bias,
            bool(dt_softplus), dt_lo, dt_hi, out)  # fmt: skip
    if torch.compiler.is_compiling():
        torch.ops.vllm.mamba_chunk_scan_combined_varlen(*args)
    else:
        _launch(*args)
    return out


# The op is the launcher itself (its annotations give the schema).
_ssd_op = torch.library.custom_op(
    "vllm::mamba_chunk_scan_combined_varlen", _launch, mutates_args=("ssm_states", "out")
)


@_ssd_op.register_fake
def _(x, dt, A, B, C, chunk_starts, chunk_seqs, seq_chunk_starts, chunk_size, ssm_states,
      state_indices, has_initial_state, D, dt_bias, dt_softplus, dt_lo, dt_hi, out):  # fmt: skip
    return None
