"""fp32 PyTorch reference of the replayed decode update (``mamba_ssm_replay``); also its CPU
path when the Triton interpreter is off.

Same arguments and semantics as the kernel (see that module's docstring for the formula
and the buffers), computed plainly: every row's full state at this step is built in fp32
from the pool line and the ring, y is read from it, and only the rows whose ring is full
(the L-th step) write it back. Padded rows use the pool's last line (the sink, which no
slot owns), so the work is fixed by shapes and nothing syncs with the host; their y is 0.
"""

from __future__ import annotations

import torch

from vllm.model_executor.layers.mamba.ops.mamba_ssm_torch import _discretize_dt
from vllm.tensor_checks import check_state_update_shapes

__all__ = ["ReplayedSSMState", "replay_materialise_ref", "replay_update_ref"]


class ReplayedSSMState:
    """One layer's SSM state pool with its replay buffers (views of the pool's tensors).

    ``state`` (lines, nheads, headdim, dstate); ``ring_x`` (lines, nheads, L-1, headdim) and
    ``ring_B`` (lines, ngroups, L-1, dstate) in the activation dtype; ``ring_dt``
    (lines, nheads, L-1) fp32; ``count`` (lines, nheads, headdim) int8: the steps buffered
    for that line, one copy per state row so that each kernel program owns the counters it
    updates, whatever its block of rows.
    """

    __slots__ = ("state", "ring_x", "ring_B", "ring_dt", "count")

    def __init__(self, state, ring_x, ring_B, ring_dt, count):
        self.state, self.ring_x, self.ring_B, self.ring_dt = state, ring_x, ring_B, ring_dt
        self.count = count

    @property
    def buffer_len(self) -> int:
        """L: a line's state is written every L-th step (L-1 buffered, then the flush)."""
        return self.ring_x.shape[2] + 1

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.state, self.ring_x, self.ring_B, self.ring_dt, self.count)

    def check(self) -> None:
        """ValueError unless the buffers agree with the state's shape."""
        lines, nheads, headdim, dstate = self.state.shape
        ring = self.ring_x.shape[2]
        ngroups = self.ring_B.shape[1]
        want = {
            "ring_x": ((lines, nheads, ring, headdim), None),
            "ring_B": ((lines, ngroups, ring, dstate), None),
            "ring_dt": ((lines, nheads, ring), torch.float32),
            "count": ((lines, nheads, headdim), torch.int8),
        }
        for name, (shape, dtype) in want.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape or (dtype is not None and t.dtype != dtype):
                raise ValueError(
                    f"{name} must be {shape}{'' if dtype is None else f' {dtype}'} for a state "
                    f"of {tuple(self.state.shape)}, got {tuple(t.shape)} {t.dtype}"
                )
        if self.ring_x.dtype != self.ring_B.dtype:
            raise ValueError("ring_x and ring_B must share the activation dtype")
        if ring < 1 or nheads % ngroups:
            raise ValueError(f"need L-1 >= 1 ring entries and nheads % ngroups == 0, got {ring}")


def _replayed(rs: ReplayedSSMState, lines, n, A, dt_now, x_now, B_now) -> torch.Tensor:
    """fp32 states (rows, nheads, headdim, dstate) of ``lines`` after their ``n`` buffered
    steps and, when ``dt_now`` is given, this step."""
    rows, nheads = n.shape
    ring = rs.ring_x.shape[2]
    hpg = nheads // rs.ring_B.shape[1]
    k = torch.arange(ring, device=n.device)
    valid = k < n[..., None]  # (rows, nheads, ring)
    dt_ring = torch.where(valid, rs.ring_dt.index_select(0, lines).float(), 0.0)
    dA = dt_ring * A.float()[:, None]
    now = torch.zeros(rows, nheads, device=n.device) if dt_now is None else dt_now * A.float()
    # Decay from just after entry k to now: the later entries' and this step's, term by term.
    later = (k[None, :] > k[:, None]).float()  # [k, j]: j after k
    weight = torch.exp(torch.matmul(dA, later.t()) + now[..., None]) * dt_ring
    xs = torch.where(valid[..., None], rs.ring_x.index_select(0, lines).float(), 0.0)
    Bs = rs.ring_B.index_select(0, lines).float().repeat_interleave(hpg, dim=1)
    Bs = torch.where(valid[..., None], Bs, 0.0)
    h = rs.state.index_select(0, lines).float() * torch.exp(dA.sum(-1) + now)[..., None, None]
    h = h + torch.matmul((weight[..., None] * xs).transpose(-1, -2), Bs)
    if dt_now is not None:
        Bn = B_now.float().repeat_interleave(hpg, dim=1)
        h = h + (dt_now[..., None] * x_now.float())[..., None] * Bn[:, :, None, :]
    return h


def _write_back(rs: ReplayedSSMState, lines, h, flush) -> None:
    old = rs.state.index_select(0, lines)
    rs.state.index_copy_(0, lines, torch.where(flush[..., None, None], h.to(old.dtype), old))


class _Rows:
    """The pool lines of a step's rows: ``read`` for every row (a padded row reads the
    marker's line, or line 0 when the marker names none), ``store`` writes the real rows'
    new values only."""

    def __init__(self, idx: torch.Tensor, pad_slot_id: int, num_lines: int):
        self.is_pad = (idx == pad_slot_id) | (idx < 0)
        self.marker_is_line = 0 <= pad_slot_id < num_lines
        self.read = torch.where(self.is_pad, pad_slot_id if self.marker_is_line else 0, idx)
        self.real = None if self.marker_is_line else (~self.is_pad).nonzero().squeeze(1)

    def store(self, t: torch.Tensor, new: torch.Tensor) -> None:
        if self.real is None:  # padded rows put their (marker) line back as it was
            pad = self.is_pad.view(-1, *([1] * (new.dim() - 1)))
            t.index_copy_(0, self.read, torch.where(pad, t.index_select(0, self.read), new))
        else:
            t.index_copy_(0, self.read[self.real], new[self.real])


def replay_update_ref(
    rs: ReplayedSSMState,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    state_batch_indices: torch.Tensor,
    pad_slot_id: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """``replay_ssm_update`` in PyTorch (see ``mamba_ssm_replay``)."""
    check_state_update_shapes(rs.state, x, dt, A, B, C, D, dt_bias, state_batch_indices, out)
    ring = rs.ring_x.shape[2]
    hpg = x.shape[1] // B.shape[1]
    rows = _Rows(state_batch_indices.long(), pad_slot_id, rs.state.shape[0])
    lines = rows.read
    n = rs.count.index_select(0, lines)[:, :, 0].long()
    dt_now = _discretize_dt(dt, dt_bias, dt_softplus, dt_limit)
    h = _replayed(rs, lines, n, A, dt_now, x, B)
    y = torch.einsum("rhpn,rhn->rhp", h, C.float().repeat_interleave(hpg, dim=1))
    if D is not None:
        y = y + D.float()[:, None] * x.float()
    out.copy_(torch.where(rows.is_pad[:, None, None], 0.0, y))
    flush = n >= ring
    old = rs.state.index_select(0, lines)
    rows.store(rs.state, torch.where(flush[..., None, None], h.to(old.dtype), old))
    # Append this step at entry n of every row that did not flush.
    put = (torch.arange(ring, device=n.device) == n[..., None]) & ~flush[..., None]
    ring_x = rs.ring_x.index_select(0, lines)
    rows.store(rs.ring_x, torch.where(put[..., None], x[:, :, None, :], ring_x))
    ring_dt = rs.ring_dt.index_select(0, lines)
    rows.store(rs.ring_dt, torch.where(put, dt_now[..., None], ring_dt))
    put_g = put[:, ::hpg]
    ring_B = rs.ring_B.index_select(0, lines)
    rows.store(rs.ring_B, torch.where(put_g[..., None], B[:, :, None, :], ring_B))
    count = torch.where(flush, 0, n + 1).to(torch.int8)
    rows.store(rs.count, count[..., None].expand(-1, -1, rs.count.shape[2]))
    return out


def replay_materialise_ref(
    rs: ReplayedSSMState,
    A: torch.Tensor,
    slots: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    pad_slot_id: int = -1,
) -> None:
    """``replay_ssm_materialise`` in PyTorch: lines ``slots`` (distinct) get their buffered
    steps folded into the state and their counters reset; lines whose
    ``has_initial_state`` is False only get their counters reset (their state is about to
    be overwritten); entries on ``pad_slot_id`` (or negative) are left out."""
    keep = (slots != pad_slot_id) & (slots >= 0)
    slots = slots[keep]
    if has_initial_state is not None:
        has_initial_state = has_initial_state[keep]
    lines = slots.long()
    n = rs.count.index_select(0, lines)[:, :, 0].long()
    flush = n > 0
    if has_initial_state is not None:
        flush = flush & has_initial_state.to(torch.bool)[:, None]
    h = _replayed(rs, lines, n, A, None, None, None)
    _write_back(rs, lines, h, flush)
    rs.count.index_fill_(0, lines, 0)
