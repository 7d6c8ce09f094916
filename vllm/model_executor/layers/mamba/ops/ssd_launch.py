"""The SSD's three launches (``ssd_combined``), and launch plans that make a repeated call cheap.

``launch_all`` makes the three launches of one call over its workspace (``SSDWorkspace``)
through each kernel's ``CachedLauncher``, which keys every call on all of its arguments
(tens of microseconds for 30-40 of them) and launches through Triton's Python binding.

A launch table entry may name a second chunk-state config for calls of many chunks
(``ssd_configs``' ``many``): the plan then holds that variant's plan too and picks by the
call's chunk count; a recording call (the warm-up) runs both, so no count compiles later.

An ``SSDPlan`` serves every call whose arguments have one layout (``plan_key``: the
dtypes, devices, strides and the shapes but the token and sequence counts): the model's
layers in every step. The call's full checks ran when its plan was made; a later call
checks only what the key leaves out (``SSDPlan.fits``: counts and the chunk layout). Its
first calls go through ``launch_all``; once each kernel is compiled, the plan keeps the
compiled kernels with their fixed integer arguments and, for each pointer argument, which
of the call's tensors it was (by identity), and launches them directly through the Triton
launcher's C entry point (``vllm.triton_utils.host.DirectLaunches``): the pointers, the
grids and the one per-step integer, nothing else computed. A data pointer that is not
16-byte aligned (the kept kernels are the ones compiled for aligned data pointers; the
step's index and layout pointers are not specialised on), a ``precompile()`` block,
another current device or the interpreter take ``launch_all`` instead.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from vllm.model_executor.layers.mamba.ops.ssd_chunk_scan import _LAUNCH as _SCAN_LAUNCHER
from vllm.model_executor.layers.mamba.ops.ssd_chunk_scan import (
    chunk_scan_programs,
    launch_chunk_scan,
)
from vllm.model_executor.layers.mamba.ops.ssd_chunk_state import _LAUNCH as _STATE_LAUNCHER
from vllm.model_executor.layers.mamba.ops.ssd_chunk_state import (
    chunk_state_programs,
    launch_chunk_state,
    sync_buffer,
    sync_elements,
)
from vllm.model_executor.layers.mamba.ops.ssd_layout import SSDChunkLayout
from vllm.model_executor.layers.mamba.ops.ssd_state_passing import _LAUNCH as _PASSING_LAUNCHER
from vllm.model_executor.layers.mamba.ops.ssd_state_passing import (
    launch_state_passing,
    state_passing_programs,
)
from vllm.triton_utils.host import DirectLaunches, PlanCache, recording

_NO_LIMIT = (0.0, math.inf)
# Raised while keying arguments that are not tensors: the full checks then name them.
KEY_ERRORS = (AttributeError, TypeError, IndexError)
_ALIGN = 128  # bytes: each part of the workspace starts on a 128-byte boundary


class SSDWorkspace(NamedTuple):
    """One call's intermediates (views of one allocation): ``states`` (chunks, nheads,
    headdim, dstate) fp32 chunk contributions, then start states; ``cb`` (chunks, ngroups,
    L, L) in fp32 or the activations' 16-bit dtype (the launch config's ``cb_dtype``);
    ``dt``, ``cs`` (chunks, nheads, L) fp32, cs in log2 units; ``decay`` (chunks, nheads)."""

    states: torch.Tensor
    cb: torch.Tensor
    dt: torch.Tensor
    cs: torch.Tensor
    decay: torch.Tensor


class WorkspaceLayout:
    """Where the parts of a call's workspace sit: each part holds a fixed number of elements
    per chunk, and starts 128-byte aligned in the one byte allocation."""

    def __init__(self, nheads: int, headdim: int, dstate: int, ngroups: int, chunk_size: int,
                 cb_dtype: torch.dtype = torch.float32):  # fmt: skip
        L = chunk_size
        f32 = torch.float32
        self.parts = (((nheads, headdim, dstate), f32), ((ngroups, L, L), cb_dtype),
                      ((nheads, L), f32), ((nheads, L), f32), ((nheads,), f32))  # fmt: skip
        self.per_chunk = tuple(math.prod(t) * d.itemsize for t, d in self.parts)  # bytes

    def offsets(self, num_chunks: int) -> tuple[list[int], int]:
        """Each part's first byte, and the bytes of the allocation (at least one aligned
        block per part, so that no pointer is null)."""
        offsets, total = [], 0
        for per_chunk in self.per_chunk:
            offsets.append(total)
            total += -(-max(num_chunks * per_chunk, 1) // _ALIGN) * _ALIGN
        return offsets, total

    def views(self, buf: torch.Tensor, num_chunks: int, offsets: list[int]) -> SSDWorkspace:
        parts = []
        for off, per_chunk, (tail, dtype) in zip(offsets, self.per_chunk, self.parts,
                                                 strict=True):  # fmt: skip
            part = buf[off : off + num_chunks * per_chunk].view(dtype)
            parts.append(part.view(num_chunks, *tail))
        return SSDWorkspace(*parts)

    def allocate(self, num_chunks: int, device) -> SSDWorkspace:
        offsets, total = self.offsets(num_chunks)
        buf = torch.empty(total, dtype=torch.uint8, device=device)
        return self.views(buf, num_chunks, offsets)


class Chunks(NamedTuple):
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


def launch_all(x, z, dt, A, B, C, chunks: Chunks, ssm_states, state_indices, init, chunk_lines,
               D, dt_bias, dt_softplus, dt_lo, dt_hi, out, cfg: dict, ws: SSDWorkspace,
               pad_slot_id: int) -> list:  # fmt: skip
    """The call's launches over ``ws`` (``init``: has_initial_state as bytes, or None);
    returns what each launched, (launcher, grid, args, constexprs)."""
    done = []
    if chunks.num_chunks:
        flags = dict(
            HAS_DT_BIAS=dt_bias is not None,
            DT_SOFTPLUS=bool(dt_softplus),
            HAS_DT_LIMIT=(dt_lo, dt_hi) != _NO_LIMIT,
            dt_min=dt_lo,
            dt_max=dt_hi,
        )
        done.append(launch_chunk_state(x, dt, A, dt_bias, B, C, chunks, ssm_states,
                                       state_indices, init, chunk_lines, pad_slot_id, ws, flags,
                                       cfg["chunk_state"], cfg["state_passing"]))  # fmt: skip
    fused = bool(cfg["chunk_state"].get("FUSED_PASS", False))
    if not (chunks.num_chunks and cfg["chunk_state"].get("FOLD_CB", False)):
        passing = launch_state_passing(B, C, chunks, ssm_states, state_indices, init,
                                       chunk_lines, ws, cfg["state_passing"], pad_slot_id,
                                       fused)  # fmt: skip
        if passing is not None:
            done.append(passing)
    if chunks.num_chunks:
        done.append(launch_chunk_scan(x, z, C, D, chunks, state_indices, init, ws, out,
                                      cfg["chunk_scan"], pad_slot_id))  # fmt: skip
    return done


def _layout_of(t, full_shape: bool):
    if t is None:
        return None
    return (t.dtype, t.device, tuple(t.shape) if full_shape else tuple(t.shape[1:]), t.stride())


def plan_key(x, z, dt, A, B, C, layout, ssm_states, state_indices, has_initial_state,
             chunk_state_indices, D, dt_bias, dt_softplus, dt_limit, out,
             pad_slot_id) -> tuple:  # fmt: skip
    """Everything the full checks read but the token, chunk and sequence counts
    (``SSDPlan.fits`` checks those). Raises one of ``KEY_ERRORS`` for arguments that are
    not tensors."""
    return (
        _layout_of(x, False),
        _layout_of(z, False),
        _layout_of(dt, False),
        _layout_of(B, False),
        _layout_of(C, False),
        _layout_of(out, False),
        _layout_of(A, True),
        _layout_of(D, True),
        _layout_of(dt_bias, True),
        _layout_of(ssm_states, True),
        _layout_of(state_indices, False),
        _layout_of(has_initial_state, False),
        _layout_of(chunk_state_indices, False),
        layout.chunk_size,
        bool(dt_softplus),
        tuple(dt_limit),
        int(pad_slot_id),
    )


# The pointer arguments a plan launches with, by name (``SSDPlan._sources``).
_WS_NAMES = ("ws_states", "ws_cb", "ws_dt", "ws_cs", "ws_decay")


class SSDPlan:
    """The launches of every call with one ``plan_key`` (see the module docstring)."""

    def __init__(self, x, B, chunk_size: int, cfg: dict, dt_limit, is_kernel_device,
                 pad_slot_id: int):  # fmt: skip
        _, nheads, headdim = x.shape
        ngroups, dstate = B.shape[1:]
        self.cfg, self.chunk_size = cfg, chunk_size
        self.dt_lo, self.dt_hi = (float(v) for v in dt_limit)
        self.pad_slot_id = pad_slot_id
        self.ws = WorkspaceLayout(nheads, headdim, dstate, ngroups, chunk_size, cfg["cb_dtype"])
        self.device, self.on_cuda = x.device, x.is_cuda
        self.device_index = x.device.index if x.is_cuda else None
        self.is_kernel_device = is_kernel_device  # use_ssd_kernel, re-read off CUDA
        self.per_chunk_scan = chunk_scan_programs(1, nheads, headdim, chunk_size,
                                                  cfg["chunk_scan"])  # fmt: skip
        self.per_chunk_state = chunk_state_programs(1, nheads, headdim, dstate,
                                                    cfg["chunk_state"])  # fmt: skip
        self.fused = bool(cfg["chunk_state"].get("FUSED_PASS", False))
        # FUSED_PASS's sync buffer: the counter, then a flag per chunk program
        self.sync_per_chunk = sync_elements(1, nheads, headdim, dstate, cfg["chunk_state"]) - 1
        if self.fused and self.on_cuda and recording():
            self._sync(1)  # the engine's warm-up makes the plan: not later, in a graph capture
        self.per_seq_pass, self.per_chunk_cb = state_passing_programs(
            1, 1, nheads, headdim, dstate, ngroups, chunk_size, cfg["state_passing"]
        )
        self.fold = bool(cfg["chunk_state"].get("FOLD_CB", False))
        order = [_STATE_LAUNCHER.name, _PASSING_LAUNCHER.name, _SCAN_LAUNCHER.name]
        if self.fold:  # launch 1 runs launch 2's jobs too
            order.remove(_PASSING_LAUNCHER.name)
        self.direct = DirectLaunches(order)
        # The plan of the table's ``many`` variant (``ssd_configs``): calls of its
        # ``many_chunks`` chunks or more run it; a recording call (the warm-up) runs both.
        many = cfg.get("many")
        self.many = None
        if many is not None:
            self.many = SSDPlan(x, B, chunk_size, many, dt_limit, is_kernel_device, pad_slot_id)
            self.many_chunks = many["many_chunks"]

    def fits(self, x, z, dt, B, C, layout, state_indices, has_initial_state,
             chunk_state_indices, out) -> bool:  # fmt: skip
        """The call's counts agree and its chunk layout is on the plan's device; otherwise
        the full checks run (and name what is wrong)."""
        n = x.shape[0]
        if dt.shape[0] != n or B.shape[0] != n or C.shape[0] != n:
            return False
        if (z is not None and z.shape[0] != n) or (out is not None and out.shape[0] != n):
            return False
        if not isinstance(layout, SSDChunkLayout):
            return False
        s = layout.num_seqs
        if layout.end_row > n or state_indices.shape[0] != s:
            return False
        if has_initial_state is not None and has_initial_state.shape[0] != s:
            return False
        if chunk_state_indices is not None and chunk_state_indices.shape[0] != layout.num_chunks:
            return False
        dev = self.device
        if (layout.chunk_starts.device != dev or layout.chunk_seqs.device != dev
                or layout.seq_chunk_starts.device != dev):  # fmt: skip
            return False
        return self.on_cuda or self.is_kernel_device(x)

    def run(self, x, z, dt, A, B, C, layout, ssm_states, state_indices, has_initial_state,
            chunk_state_indices, D, dt_bias, dt_softplus, out) -> None:  # fmt: skip
        num_chunks, num_seqs = layout.num_chunks, layout.num_seqs
        if num_seqs == 0:
            return
        if self.many is not None and (recording() or num_chunks >= self.many_chunks):
            self.many.run(x, z, dt, A, B, C, layout, ssm_states, state_indices,
                          has_initial_state, chunk_state_indices, D, dt_bias, dt_softplus,
                          out)  # fmt: skip
            if not recording():
                return
        offsets, total = self.ws.offsets(num_chunks)
        buf = torch.empty(total, dtype=torch.uint8, device=self.device)
        init = None if has_initial_state is None else has_initial_state.view(torch.uint8)
        if self.direct.ready:
            base = buf.data_ptr()
            ptrs = dict(
                x=x.data_ptr(), dt=dt.data_ptr(), A=A.data_ptr(), B=B.data_ptr(),
                C=C.data_ptr(), ssm_states=ssm_states.data_ptr(), out=out.data_ptr(),
                state_indices=state_indices.data_ptr(),
                chunk_starts=layout.chunk_starts.data_ptr(),
                chunk_seqs=layout.chunk_seqs.data_ptr(),
                seq_chunk_starts=layout.seq_chunk_starts.data_ptr(),
            )  # fmt: skip
            for name, t in (("z", z), ("D", D), ("dt_bias", dt_bias), ("init", init),
                            ("chunk_lines", chunk_state_indices)):  # fmt: skip
                if t is not None:
                    ptrs[name] = t.data_ptr()
            for name, off in zip(_WS_NAMES, offsets, strict=True):
                ptrs[name] = base + off
            if self.fused:
                ptrs["sync"] = self._sync(num_chunks).data_ptr()
            if self._launch_direct(ptrs, num_chunks, num_seqs):
                return
        ws = self.ws.views(buf, num_chunks, offsets)
        chunks = Chunks(self.chunk_size, layout.chunk_starts, layout.chunk_seqs,
                        layout.seq_chunk_starts)  # fmt: skip
        done = launch_all(x, z, dt, A, B, C, chunks, ssm_states, state_indices, init,
                          chunk_state_indices, D, dt_bias, dt_softplus, self.dt_lo, self.dt_hi,
                          out, self.cfg, ws, self.pad_slot_id)  # fmt: skip
        if not self.direct.ready and not self.direct.failed and self.on_cuda:
            sources = dict(x=x, z=z, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias, out=out,
                           ssm_states=ssm_states, state_indices=state_indices, init=init,
                           chunk_lines=chunk_state_indices,
                           chunk_starts=layout.chunk_starts, chunk_seqs=layout.chunk_seqs,
                           seq_chunk_starts=layout.seq_chunk_starts,
                           **dict(zip(_WS_NAMES, ws, strict=True)))  # fmt: skip
            if self.fused:
                sources["sync"] = self._sync(num_chunks)
            # The step's integers: the chunk state's first two (its chunk programs and, with
            # FOLD_CB, its CB programs) and state passing's first (its passing programs);
            # every other integer is fixed by the plan's key.
            per_step = {_STATE_LAUNCHER.name: 2, _PASSING_LAUNCHER.name: 1}
            self.direct.capture(done, sources, per_step)

    def _sync(self, num_chunks: int):
        """``FUSED_PASS``'s sync buffer (without it, launch 1 takes the chunk starts, a
        pointer it has anyway, in its place)."""
        return sync_buffer(self.device, 1 + num_chunks * self.sync_per_chunk)

    def _launch_direct(self, ptrs: dict, num_chunks: int, num_seqs: int) -> bool:
        num_pass = num_seqs * self.per_seq_pass
        num_state, num_cb = num_chunks * self.per_chunk_state, num_chunks * self.per_chunk_cb
        num_scan = num_chunks * self.per_chunk_scan
        if self.fold:
            if not num_chunks:  # only launch 2's passes, which the fold's order lacks
                return False
            grids = (num_state + num_cb + num_pass, num_scan)
            return self.direct.launch(self.device_index, ptrs, grids, ((num_state, num_cb), ()))
        grids = (num_state, num_pass + num_cb, num_scan)
        return self.direct.launch(self.device_index, ptrs, grids,
                                  ((num_state, 0), (num_pass,), ()))  # fmt: skip


PLANS = PlanCache()
