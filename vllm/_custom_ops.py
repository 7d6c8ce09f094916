"""Python face of the CUDA ops built from csrc/ (the CUDA causal-conv1d pathway).

The library ``vllm/_C_conv*.so`` is built by ``CMakeLists.txt`` through ``setup.py`` on a
machine with a CUDA build of torch, nvcc and cmake >= 3.25, and registers its ops in
the ``torch.ops._C_conv`` namespace. It is loaded on first use; this module imports
anywhere, and calling an op when the library is not there raises a RuntimeError that
says how to build it.

The ops compute what ``causal_conv1d_fn`` / ``causal_conv1d_update`` compute (see
``vllm/model_executor/layers/mamba/ops/causal_conv1d.py`` for the formula and the cache
line convention), with two differences that are the classic CUDA design:

- The conv-state pool is WIDTH-contiguous: ``(num_cache_lines, dim, state_len)`` with
  ``stride(2) == 1``; allocate it as a contiguous ``(num_cache_lines, dim, width - 1)``.
  The Triton ops take the same logical shape, feature-contiguous.
- A step is split: prefill (and chunked-prefill) sequences go through
  ``causal_conv1d_fwd_cuda``, one-token decodes through ``causal_conv1d_update_cuda``.
  Both accept ``out=`` so that the two halves can write into one output tensor.

x, weight, bias and the pool share one dtype (fp32, fp16 or bf16; a state pool in
another dtype is not supported by this baseline). Products and sums are fp32.
Padded rows (index == ``pad_slot_id``, -1 in vLLM) get zero outputs, and their cache
lines, like every line no sequence names, are left untouched. Neither op syncs with the
host or allocates when ``out`` is given, so both can be captured in a CUDA graph.
Arguments are checked on the host (ValueError naming the argument); the contents of
index tensors are not (reading them would sync), so a line index out of range is the
caller's bug.
"""

from __future__ import annotations

from pathlib import Path

import torch

from vllm.tensor_checks import (
    FLOAT_DTYPES,
    check_conv_weight_bias,
    check_default_lines,
    check_tensor,
)

__all__ = [
    "causal_conv1d_fwd_cuda",
    "causal_conv1d_update_cuda",
    "cuda_ops_available",
]

_LIBRARY_STEM = "_C_conv"

_BUILD_HINT = (
    "build them on a machine with a CUDA build of torch, nvcc and cmake >= 3.25: "
    "`VLLM_BUILD_CUDA_OPS=1 pip install --no-deps --no-build-isolation -e .` "
    "(or, to rebuild only the library, `cmake -S . -B build/cmake "
    "-DPython_EXECUTABLE=$(which python) && cmake --build build/cmake`). "
    "The Triton ops (VLLM_USE_TRITON_CONV1D=1) need no build"
)


def _find_library() -> Path | None:
    """The newest vllm/_C_conv*.so (setup.py names it with Python's extension suffix, a
    hand-run CMake build plain _C_conv.so)."""
    found = [p for p in Path(__file__).resolve().parent.glob(f"{_LIBRARY_STEM}*.so") if p.is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


class _Library:
    """The CUDA ops library at ``path`` (None: not built), loaded on first use."""

    def __init__(self, path: Path | None):
        self.path = path
        self._loaded: bool | None = None
        self._error = ""

    def available(self) -> bool:
        if self._loaded is None:
            self._loaded = self._load()
        return self._loaded

    def _load(self) -> bool:
        if self.path is None:
            self._error = f"no {_LIBRARY_STEM}*.so next to {__file__}"
            return False
        try:
            torch.ops.load_library(str(self.path))
        except (OSError, RuntimeError) as e:  # unloadable file, or its ops fail to register
            self._error = f"{self.path} failed to load: {e}"
            return False
        _register_fakes()
        return True

    def ops(self):
        if not self.available():
            raise RuntimeError(
                "the CUDA causal-conv1d ops are not built or do not load "
                f"({self._error}); {_BUILD_HINT}"
            )
        return getattr(torch.ops, _LIBRARY_STEM)


_LIBRARY = _Library(_find_library())
_fakes_registered = False


def _writes_only_fake(*args) -> None:
    """The fake of both ops: they write into tensors they are given and return nothing."""
    return None


def _register_fakes() -> None:
    """Fake implementations, so that torch.compile can trace the ops: both write into
    tensors they are given and return nothing."""
    global _fakes_registered
    if _fakes_registered:
        return
    for op in ("causal_conv1d_fwd", "causal_conv1d_update"):
        torch.library.register_fake(f"{_LIBRARY_STEM}::{op}")(_writes_only_fake)
    _fakes_registered = True


def cuda_ops_available() -> bool:
    """Whether the CUDA ops are built and load (never raises)."""
    return _LIBRARY.available()


# --------------------------------------------------------------------------
# Validation (host-side, no device reads)
# --------------------------------------------------------------------------


def _check_x(x: torch.Tensor, feature_axis: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.device.type != "cuda":
        raise ValueError(f"x must be a CUDA tensor, got device {x.device}")
    check_tensor("x", x, x.device, 2, FLOAT_DTYPES)
    if x.shape[feature_axis] > 1 and x.stride(feature_axis) != 1:
        raise ValueError(
            f"x must be feature-contiguous (x.stride({feature_axis}) == 1), got strides "
            f"{x.stride()}"
        )


def _check_weights_and_states(x, dim, weight, bias, states, states_name) -> int:
    width = check_conv_weight_bias(weight, bias, dim, x.device, (x.dtype,))
    if bias is not None:
        if dim > 1 and bias.stride(0) != 1:
            raise ValueError(f"bias must be contiguous, got stride {bias.stride(0)}")
    check_tensor(states_name, states, x.device, 3, (x.dtype,))
    if states.shape[1] != dim or states.shape[2] < width - 1:
        raise ValueError(
            f"{states_name} must be (num_cache_lines, dim={dim}, state_len >= width-1 = "
            f"{width - 1}), got {tuple(states.shape)}"
        )
    if states.shape[2] > 1 and states.stride(2) != 1:
        raise ValueError(
            f"{states_name} must be width-contiguous (stride(2) == 1; allocate "
            f"(num_cache_lines, dim, width-1) contiguous), got strides {states.stride()}"
        )
    return width


def _check_index(name, t, device, n, dtype) -> None:
    if t is None:
        return
    check_tensor(name, t, device, 1, (dtype,))
    if t.shape[0] != n:
        raise ValueError(f"{name} must have {n} entries, got {t.shape[0]}")
    if n > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}")


def _check_out(out, x, shape, feature_axis) -> None:
    check_tensor("out", out, x.device, 2, (x.dtype,))
    if tuple(out.shape) != shape:
        raise ValueError(f"out must have shape {shape}, got {tuple(out.shape)}")
    if shape[feature_axis] > 1 and out.stride(feature_axis) != 1:
        raise ValueError(
            f"out must be feature-contiguous (stride({feature_axis}) == 1), got {out.stride()}"
        )


def _check_flag(name, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {type(value).__name__}")


# --------------------------------------------------------------------------
# The ops
# --------------------------------------------------------------------------


def causal_conv1d_fwd_cuda(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    silu: bool,
    pad_slot_id: int,
    *,
    out: torch.Tensor | None = None,
    row_bytes: int = 0,
) -> torch.Tensor:
    """Causal conv1d over the sequences of a step (prefill / chunked prefill), CUDA.

    x: (dim, num_tokens) with ``x.stride(0) == 1`` (the token stride may exceed dim).
    weight: (dim, W), 2 <= W <= 8, ``stride(1) == 1``. bias: (dim,) or None.
    conv_states: (num_cache_lines, dim, state_len >= W-1), width-contiguous; mutated.
    query_start_loc: (batch+1,) int32. cache_indices: (batch,) int32 or None (sequence b
    uses line b). has_initial_state: (batch,) bool or None (no sequence has one).

    Returns ``out`` (dim, num_tokens) with ``out.stride(0) == 1``; given, it is written in
    place. One thread block per (sequence, block of features) walks the sequence's
    tokens in order, so a step with few long sequences leaves most of the GPU idle.
    Each thread moves ``row_bytes`` of a token per access: 16, 8 or 4 (narrower rows,
    more and smaller blocks); 0 lets the launcher choose the widest whose grid spreads
    evenly over the SMs (see csrc/mamba/causal_conv1d/causal_conv1d_kernels.cuh). Rows
    too wide for the alignment of x or out fall back to narrower ones.
    """
    ops = _LIBRARY.ops()
    _check_x(x, feature_axis=0)
    dim, num_tokens = x.shape
    _check_weights_and_states(x, dim, weight, bias, conv_states, "conv_states")
    check_tensor("query_start_loc", query_start_loc, x.device, 1, (torch.int32,))
    if query_start_loc.shape[0] < 1:
        raise ValueError("query_start_loc must have batch+1 >= 1 entries")
    batch = query_start_loc.shape[0] - 1
    _check_index("query_start_loc", query_start_loc, x.device, batch + 1, torch.int32)
    _check_index("cache_indices", cache_indices, x.device, batch, torch.int32)
    _check_index("has_initial_state", has_initial_state, x.device, batch, torch.bool)
    check_default_lines("cache_indices", cache_indices, batch, conv_states.shape[0])
    _check_flag("silu", silu)
    if row_bytes not in (0, 4, 8, 16):
        raise ValueError(f"row_bytes must be 0 (choose), 4, 8 or 16, got {row_bytes!r}")
    if out is None:
        out = torch.empty(num_tokens, dim, dtype=x.dtype, device=x.device).t()
    else:
        _check_out(out, x, (dim, num_tokens), feature_axis=0)
    ops.causal_conv1d_fwd(
        x,
        weight,
        bias,
        conv_states,
        query_start_loc,
        cache_indices,
        has_initial_state,
        silu,
        pad_slot_id,
        row_bytes,
        out,
    )
    return out


def causal_conv1d_update_cuda(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu: bool,
    conv_state_indices: torch.Tensor | None,
    pad_slot_id: int,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode token per sequence, CUDA.

    x: (batch, dim) with ``x.stride(1) == 1``. conv_state: (num_cache_lines, dim,
    state_len >= W-1), width-contiguous; mutated. conv_state_indices: (batch,) int32 or
    None (sequence b uses line b). Returns ``out`` (batch, dim), ``stride(1) == 1``.
    """
    ops = _LIBRARY.ops()
    _check_x(x, feature_axis=1)
    batch, dim = x.shape
    _check_weights_and_states(x, dim, weight, bias, conv_state, "conv_state")
    _check_index("conv_state_indices", conv_state_indices, x.device, batch, torch.int32)
    check_default_lines("conv_state_indices", conv_state_indices, batch, conv_state.shape[0])
    _check_flag("silu", silu)
    if out is None:
        out = torch.empty(batch, dim, dtype=x.dtype, device=x.device)
    else:
        _check_out(out, x, (batch, dim), feature_axis=1)
    ops.causal_conv1d_update(
        x, conv_state, weight, bias, silu, conv_state_indices, pad_slot_id, out
    )
    return out
