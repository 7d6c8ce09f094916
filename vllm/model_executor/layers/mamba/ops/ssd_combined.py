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
  and leaves its final state there. A sequence on the padded-row marker ``pad_slot_id``
  (by default ``NULL_BLOCK_ID`` = 0, the pool's null line; ``PAD_SLOT_ID`` = -1 when passed)
  reads and writes no line, and its rows get y = 0; lines no sequence names stay
  bit-identical.
- ``out`` (num_tokens, nheads, headdim), any float dtype: only the chunks' rows are written.

``plan_ssd_chunks`` builds the layout on the host (once per step, shared by every layer).
Nothing here reads device data on the host, and the launch configurations depend only on
the model's shapes and dtypes (``ssd_configs``), never on the step's counts, which the
kernels take as non-specialised arguments: a new step shape compiles nothing. A call whose
arguments have the layout of an earlier one (every layer of every step) runs through that
layout's launch plan (``ssd_launch.SSDPlan``): light checks and three direct launches,
tens of microseconds of host time less than the full path. Registered as
``torch.ops.vllm.mamba_chunk_scan_combined_varlen``. CUDA tensors run the kernels; CPU
tensors only under ``TRITON_INTERPRET=1`` (``use_ssd_kernel``), where ``mamba_ssm_torch``'s
``chunk_scan_varlen`` is the CPU path.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch

from vllm.model_executor.layers.mamba.ops.causal_conv1d_ref import NULL_BLOCK_ID
from vllm.model_executor.layers.mamba.ops.ssd_chunk_scan import _LAUNCH as _SCAN_LAUNCH
from vllm.model_executor.layers.mamba.ops.ssd_launch import (
    KEY_ERRORS,
    PLANS,
    Chunks,
    SSDPlan,
    WorkspaceLayout,
    launch_all,
    plan_key,
)
from vllm.model_executor.layers.mamba.ops.ssd_layout import SSDChunkLayout, plan_ssd_chunks
from vllm.tensor_checks import FLOAT_DTYPES, check_scan_shapes, check_tensor
from vllm.triton_utils import HAS_TRITON, configs, triton
from vllm.triton_utils.host import recording

__all__ = [
    "CONFIG_FOLDER",
    "SSDChunkLayout",
    "mamba_chunk_scan_combined_varlen",
    "plan_ssd_chunks",
    "ssd_config_key",
    "ssd_configs",
    "use_ssd_kernel",
]

_NO_LIMIT = (0.0, math.inf)
_INDEX_DTYPES = (torch.int32, torch.int64)
_I32_MAX = 2**31 - 1
CONFIG_FOLDER = Path(__file__).resolve().parent / "configs" / "ssd"
"""The SSD's launch tables (``vllm.triton_utils.configs``): ``default.json`` and one file
per tuned device, written by ``benchmarks/kernels/tune_ssd.py``."""


# --------------------------------------------------------------------------------------
# Launch configurations and the workspace
# --------------------------------------------------------------------------------------


def ssd_config_key(nheads, headdim, dstate, ngroups, chunk_size, dtype, out_dtype) -> str:
    """The table key of a model shape and its dtypes (``tune_ssd.py`` writes these)."""
    return configs.table_key(nheads=nheads, headdim=headdim, dstate=dstate, ngroups=ngroups,
                             chunk=chunk_size, dtype=dtype, out_dtype=out_dtype)  # fmt: skip


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
    """The three launches' constexprs by kernel (plus ``cb_dtype``, the workspace's CB
    dtype), from the model's shapes and dtypes only (``dtype`` of x, B, C; ``out_dtype``
    of y), never from a step's counts: a new step shape compiles nothing. Shared: never
    mutate.

    The tables (``CONFIG_FOLDER``) give block sizes, warps and stages: the entry of this
    exact shape (a tuned device's file), else the dtype's entry, else ``"*"``. Block sizes
    are caps, cut here to the shape (powers of two, at least 16 for ``tl.dot``). The split
    dots are precision, not tuning, and follow the dtypes: fp32 activations take tf32x3
    dots; with 16-bit activations the chunk state's and the carried state's dots are split
    (fp32-exact states; a chunked prefill equals one prefill), the local dot only for an
    fp32 y (a 16-bit y's rounding dwarfs its single cast)."""
    f32 = dtype == torch.float32
    key = ssd_config_key(nheads, headdim, dstate, ngroups, chunk_size, dtype, out_dtype)
    entry = configs.lookup_first(CONFIG_FOLDER, [key, configs.table_key(dtype=dtype)])

    def block(n: int, cap: int) -> int:  # tl.dot takes blocks of 16 and more
        return max(16, min(cap, triton.next_power_of_2(n)))

    def chunk_state(state: dict) -> dict:
        state.setdefault("RELOAD_CS", False)  # tables from before the key
        state.setdefault("FUSED_PASS", False)  # launch 1 chains the states (ssd_chunk_state)
        state.setdefault("FOLD_CB", False)  # ... and launch 2's CB too (FUSED_PASS only)
        if state["FOLD_CB"] and not state["FUSED_PASS"]:
            raise ValueError(f"SSD launch table entry {key}: chunk_state FOLD_CB needs FUSED_PASS")
        state.update(
            SPLIT=not f32,
            BLOCK_T=block(chunk_size, state["BLOCK_T"]),
            BLOCK_P=block(headdim, state["BLOCK_P"]),
            BLOCK_N=block(dstate, state["BLOCK_N"]),
        )
        return state

    state, passing, scan = (entry[k] for k in ("chunk_state", "state_passing", "chunk_scan"))
    chunk_state(state)
    passing.update(
        BLOCK_SN=min(passing["BLOCK_SN"], triton.next_power_of_2(dstate)),
        BLOCK_SP=min(triton.next_power_of_2(headdim), max(1, passing["BLOCK_SP"])),
        BLOCK_T=block(chunk_size, passing["BLOCK_T"]),
        BLOCK_N=block(dstate, passing["BLOCK_N"]),
    )
    scan.setdefault("PREFETCH", False)  # the source loop's loads a block ahead (chunk scan)
    # Heads per chunk-scan program: 1 or 2, and only where it divides a group's heads (a
    # program's heads share their CB and C blocks); PREFETCH takes one.
    heads = scan.setdefault("HEADS", 1)
    if heads not in (1, 2) or isinstance(heads, bool):
        raise ValueError(f"SSD launch table entry {key}: chunk_scan HEADS must be 1 or 2, "
                         f"got {heads!r}")  # fmt: skip
    if heads == 2 and scan["PREFETCH"]:
        raise ValueError(f"SSD launch table entry {key}: chunk_scan PREFETCH takes HEADS 1")
    if (nheads // ngroups) % heads:
        scan["HEADS"] = 1
    block_m = block(chunk_size, scan["BLOCK_M"])
    scan.update(
        SPLIT=out_dtype == torch.float32,
        SPLIT_STATE=not f32,
        BLOCK_M=block_m,
        BLOCK_K=min(block_m, block(chunk_size, scan["BLOCK_K"])),
        BLOCK_P=block(headdim, scan["BLOCK_P"]),
        BLOCK_N=block(dstate, scan["BLOCK_N"]),
    )
    # A 16-bit CB only where the local dot takes one cast anyway (16-bit y).
    cb_16 = entry.get("cb_16bit", False) and not f32 and out_dtype != torch.float32
    cfg = {
        "chunk_state": state,
        "state_passing": passing,
        "chunk_scan": scan,
        "cb_dtype": dtype if cb_16 else torch.float32,
        "many": None,
    }
    # A call of many chunks may take another chunk state (e.g. FUSED_PASS, whose look-back
    # waits are exposed on a short chain): ``many_chunks`` chunks or more.
    many, threshold = entry.get("chunk_state_many"), entry.get("many_chunks")
    if (many is None) != (threshold is None):
        raise ValueError(f"SSD launch table entry {key}: chunk_state_many and many_chunks go "
                         f"together, got only one")  # fmt: skip
    if many is not None:
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
            raise ValueError(f"SSD launch table entry {key}: many_chunks must be an integer "
                             f">= 1, got {threshold!r}")  # fmt: skip
        cfg["many"] = {**cfg, "chunk_state": chunk_state(many), "many_chunks": threshold}
    return cfg


def config_for(cfg: dict, num_chunks: int) -> dict:
    """The launch configs of a call of ``num_chunks`` chunks (``ssd_configs``' own, or its
    ``many`` variant from its ``many_chunks`` on)."""
    many = cfg["many"]
    return many if many is not None and num_chunks >= many["many_chunks"] else cfg


# --------------------------------------------------------------------------------------
# Checks, launch, op
# --------------------------------------------------------------------------------------


def use_ssd_kernel(x: torch.Tensor) -> bool:
    """CUDA tensors run the kernels; CPU tensors only under the interpreter
    (``CachedLauncher.runs_cpu_tensors``)."""
    return x.is_cuda or (x.device.type == "cpu" and _SCAN_LAUNCH.runs_cpu_tensors())


def _span(t: torch.Tensor, dims) -> int:
    """The largest element offset within ``t``'s dimensions ``dims``."""
    return sum((t.shape[d] - 1) * abs(t.stride(d)) for d in dims if t.shape[d] > 0)


def _check_args(x, z, dt, A, B, C, layout, ssm_states, state_indices, has_initial_state,
                chunk_state_indices, D, dt_bias, out) -> None:  # fmt: skip
    device = x.device
    check_tensor("x", x, device, 3, FLOAT_DTYPES)
    for name, t in (("z", z), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D),
                    ("dt_bias", dt_bias)):  # fmt: skip
        if t is not None:
            check_tensor(name, t, device, None, FLOAT_DTYPES)
    check_scan_shapes(x, dt, A, B, C, None, dt_bias)
    if B.dtype != x.dtype or C.dtype != x.dtype:
        raise ValueError(f"B and C must have x's dtype {x.dtype}, got {B.dtype} and {C.dtype}")
    num_tokens, nheads, headdim = x.shape
    if D is not None and tuple(D.shape) not in ((nheads,), (nheads, headdim)):
        raise ValueError(
            f"D must be (nheads={nheads},) or (nheads, headdim)=({nheads}, {headdim}), got "
            f"{tuple(D.shape)}"
        )
    if z is not None and z.shape != x.shape:
        raise ValueError(f"z must be shaped like x {tuple(x.shape)}, got {tuple(z.shape)}")
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
    if chunk_state_indices is not None:
        check_tensor("chunk_state_indices", chunk_state_indices, device, 1, _INDEX_DTYPES)
        if chunk_state_indices.shape[0] != layout.num_chunks:
            raise ValueError(
                f"chunk_state_indices must be (num_chunks={layout.num_chunks},), got "
                f"{tuple(chunk_state_indices.shape)}"
            )
    # The kernels address a chunk's rows and a state's elements with 32-bit offsets from a
    # 64-bit base (the row, the pool line): any real layout fits by far.
    L = layout.chunk_size
    spans = [("x", x, L * abs(x.stride(0)) + _span(x, (1, 2))),
             ("B", B, L * abs(B.stride(0)) + _span(B, (1, 2))),
             ("C", C, L * abs(C.stride(0)) + _span(C, (1, 2))),
             ("ssm_states", ssm_states, _span(ssm_states, (1, 2, 3)))]  # fmt: skip
    for name, t in (("z", z), ("out", out)):
        if t is not None:
            spans.append((name, t, L * abs(t.stride(0)) + _span(t, (1, 2))))
    for name, _, span in spans:
        if span > _I32_MAX:
            raise ValueError(
                f"{name}'s strides put one chunk's (or one pool line's) elements more than "
                "2**31 apart; make it contiguous"
            )
    if not HAS_TRITON:
        raise RuntimeError("the SSD kernels need Triton, which is not installed")
    if not use_ssd_kernel(x):
        raise RuntimeError(
            f"the SSD kernels run on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 "
            f"(set before the kernels are imported); x is on {device} "
            "(mamba_ssm_torch.chunk_scan_varlen is the CPU path)"
        )


def _cfg(x, B, chunk_size, out_dtype) -> dict:
    _, nheads, headdim = x.shape
    ngroups, dstate = B.shape[1:]
    return ssd_configs(nheads, headdim, dstate, ngroups, chunk_size, x.dtype, out_dtype)


def _launch(
    x: torch.Tensor,
    z: torch.Tensor | None,
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
    chunk_state_indices: torch.Tensor | None,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_lo: float,
    dt_hi: float,
    out: torch.Tensor,
    pad_slot_id: int,
) -> None:
    chunks = Chunks(chunk_size, chunk_starts, chunk_seqs, seq_chunk_starts)
    if chunks.num_seqs == 0:
        return
    _, nheads, headdim = x.shape
    ngroups, dstate = B.shape[1:]
    cfg = _cfg(x, B, chunk_size, out.dtype)
    ws = WorkspaceLayout(nheads, headdim, dstate, ngroups, chunk_size, cfg["cb_dtype"]).allocate(
        chunks.num_chunks, x.device
    )
    # Triton takes a bool tensor as i1 pointers; bytes are plainer.
    init = None if has_initial_state is None else has_initial_state.view(torch.uint8)
    # Recording (the start-up warm-up): both variants, so that no later count compiles.
    both = recording() and cfg["many"] is not None
    for c in (cfg, cfg["many"]) if both else (config_for(cfg, chunks.num_chunks),):
        launch_all(x, z, dt, A, B, C, chunks, ssm_states, state_indices, init,
                   chunk_state_indices, D, dt_bias, dt_softplus, dt_lo, dt_hi, out, c, ws,
                   pad_slot_id)  # fmt: skip


def _plan_for(x, z, dt, A, B, C, layout, ssm_states, state_indices, has_initial_state,
              chunk_state_indices, D, dt_bias, dt_softplus, dt_limit, out,
              pad_slot_id) -> SSDPlan | None:  # fmt: skip
    """The plan of these arguments' layout (made, after the full checks, on its first
    call), or None when the call must take the full checks (which then name what is
    wrong): arguments that are not tensors, or counts that do not fit."""
    args = (x, z, dt, A, B, C, layout, ssm_states, state_indices, has_initial_state,
            chunk_state_indices, D, dt_bias)  # fmt: skip
    try:
        key = plan_key(*args, dt_softplus, dt_limit, out, pad_slot_id)
        plan = PLANS.get(key)
        if plan is None:
            _check_args(*args, out)
            cfg = _cfg(x, B, layout.chunk_size, x.dtype if out is None else out.dtype)
            plan = SSDPlan(x, B, layout.chunk_size, cfg, dt_limit, use_ssd_kernel, pad_slot_id)
            PLANS.put(key, plan)
        if plan.fits(x, z, dt, B, C, layout, state_indices, has_initial_state,
                     chunk_state_indices, out):  # fmt: skip
            return plan
    except KEY_ERRORS:
        pass
    return None


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
    z: torch.Tensor | None = None,
    chunk_state_indices: torch.Tensor | None = None,
    pad_slot_id: int = NULL_BLOCK_ID,
) -> torch.Tensor:
    """Scan every sequence of ``layout`` (see the module docstring); returns ``out``
    (allocated in x's dtype when None), updates the sequences' lines of ``ssm_states``
    (and, with ``chunk_state_indices``, the lines of the chunks' end states)."""
    if isinstance(pad_slot_id, bool) or not isinstance(pad_slot_id, int):
        raise ValueError(f"pad_slot_id must be an int, got {pad_slot_id!r}")
    if not torch.compiler.is_compiling():
        plan = _plan_for(x, z, dt, A, B, C, layout, ssm_states, state_indices,
                         has_initial_state, chunk_state_indices, D, dt_bias, dt_softplus,
                         dt_limit, out, pad_slot_id)  # fmt: skip
        if plan is not None:
            if out is None:
                out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            plan.run(x, z, dt, A, B, C, layout, ssm_states, state_indices, has_initial_state,
                     chunk_state_indices, D, dt_bias, dt_softplus, out)  # fmt: skip
            return out
    _check_args(x, z, dt, A, B, C, layout, ssm_states, state_indices, has_initial_state,
                chunk_state_indices, D, dt_bias, out)  # fmt: skip
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dt_lo, dt_hi = (float(v) for v in dt_limit)
    args = (x, z, dt, A, B, C, layout.chunk_starts, layout.chunk_seqs, layout.seq_chunk_starts,
            layout.chunk_size, ssm_states, state_indices, has_initial_state,
            chunk_state_indices, D, dt_bias, bool(dt_softplus), dt_lo, dt_hi, out,
            int(pad_slot_id))  # fmt: skip
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
def _(x, z, dt, A, B, C, chunk_starts, chunk_seqs, seq_chunk_starts, chunk_size, ssm_states,
      state_indices, has_initial_state, chunk_state_indices, D, dt_bias, dt_softplus, dt_lo,
      dt_hi, out, pad_slot_id):  # fmt: skip
    return None
