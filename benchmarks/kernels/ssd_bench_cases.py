"""The SSD benchmark's cases, their data, their work counts and the fp32 reference.

Work of one call, summed over the chunks of every sequence (a chunk of ``l <= L`` tokens,
L = chunk size; H heads of P, G groups, state N; a multiply-add counts 2 FLOPs), counting
what a chunked SSD computes, dense within a chunk:

    intra-chunk CB     C_k B_k^T per group            2 l^2 N G
    CB @ x             (CB * decay * dt) @ x per head  2 l^2 P H
    chunk states       x_k^T (B_k * decay * dt)        2 l P N H
    state to output    C_k @ S_start^T per head        2 l N P H
    state passing      S <- decay S + chunk state      2 P N H   (per chunk)

(dt, its cumulative sums and the exponentials are O(l H) and left out.) The Codestral
layer shape (H 128, P 64, N 128, G 8, L 256) gives 2.28 GFLOP per full chunk, 8.9 MFLOP
per token.

Bytes the op must move: x, dt, B, C read and y written in the activation dtype, the
initial states read (sequences with one) and the final states written in the pool's
dtype, A, D and dt_bias read (fp32).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class Shape:
    nheads: int
    headdim: int
    dstate: int
    ngroups: int
    chunk: int


CODESTRAL = Shape(nheads=128, headdim=64, dstate=128, ngroups=8, chunk=256)
# Granite-4.0-H's Mamba2 layer as the issue gives it: state 256, one group (128 heads of 64,
# chunk 256, as its 4096-wide model expands to 8192 channels).
GRANITE = Shape(nheads=128, headdim=64, dstate=256, ngroups=1, chunk=256)
TINY = Shape(nheads=4, headdim=8, dstate=8, ngroups=2, chunk=8)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    lens: tuple[int, ...]
    init: tuple[bool, ...]  # has_initial_state per sequence
    shape: Shape = CODESTRAL

    @property
    def tokens(self) -> int:
        return sum(self.lens)

    @property
    def seqs(self) -> int:
        return len(self.lens)

    def flops(self) -> int:
        s = self.shape
        h, p, n, g, c = s.nheads, s.headdim, s.dstate, s.ngroups, s.chunk
        total = 0
        for length in self.lens:
            full, rest = divmod(length, c)
            for l, count in ((c, full), (rest, 1 if rest else 0)):
                per_chunk = 2 * l * l * n * g + 2 * l * l * p * h + 4 * l * p * n * h
                total += count * (per_chunk + 2 * p * n * h)
        return total

    def bytes_moved(self, act_bytes: int, state_bytes: int) -> int:
        s = self.shape
        per_token = 2 * s.nheads * s.headdim + s.nheads + 2 * s.ngroups * s.dstate  # x y dt B C
        state = s.nheads * s.headdim * s.dstate
        states = (sum(self.init) + self.seqs) * state * state_bytes
        return self.tokens * per_token * act_bytes + states + 3 * s.nheads * 4


def _uniform(n, a, init=False, shape=CODESTRAL, prefix=""):
    return Case(prefix + f"{n}x{a}" + ("_init" if init else ""), (a,) * n, (init,) * n, shape)


CASES = {
    c.name: c
    for c in (
        _uniform(1, 2048),
        _uniform(1, 8192),
        _uniform(1, 4096),  # 16 chunks: the H200 table's many_chunks threshold
        _uniform(4, 512, init=True),  # 8 chunks in chains of 2
        _uniform(16, 512, init=True),
        _uniform(16, 512),
        _uniform(128, 512, init=True),
        _uniform(1, 32768),
        _uniform(1, 8192, shape=GRANITE, prefix="granite_"),
        _uniform(16, 512, init=True, shape=GRANITE, prefix="granite_"),
    )
}
# CPU smoke (interpreter): unequal lengths, a partial chunk, mixed initial-state flags,
# and an equal-length pair for the batched mamba_ssm call.
SMOKE_CASES = {
    "smoke_mixed": Case("smoke_mixed", (19, 5, 8), (True, False, True), TINY),
    "smoke_2x12": Case("smoke_2x12", (12, 12), (False, False), TINY),
}


@dataclasses.dataclass
class Inputs:
    x: torch.Tensor  # (T, H, P) activation dtype
    dt: torch.Tensor  # (T, H) raw, activation dtype
    A: torch.Tensor  # (H,) fp32, negative
    B: torch.Tensor  # (T, G, N)
    C: torch.Tensor  # (T, G, N)
    D: torch.Tensor  # (H,) fp32
    dt_bias: torch.Tensor  # (H,) fp32
    pool: torch.Tensor  # (lines, H, P, N) state dtype: every provider starts from a copy
    idx: torch.Tensor  # (seqs,) int32 distinct lines
    init: torch.Tensor  # (seqs,) bool
    qsl_cpu: torch.Tensor  # (seqs + 1,) int32
    ref_y: torch.Tensor | None = None  # fp32
    ref_states: torch.Tensor | None = None  # (seqs, H, P, N) fp32


def build_inputs(case: Case, dtype, state_dtype, device, seed: int) -> Inputs:
    """Random data in the regime of a trained Mamba2: dt after softplus in about
    [1e-3, 1e-1] (the usual dt_bias initialisation), A in [-16, -1]."""
    s = case.shape
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return scale * torch.randn(*shape, device=device, generator=g)

    T = case.tokens
    dt_target = torch.exp(
        torch.rand(s.nheads, device=device, generator=g) * math.log(100.0) + math.log(1e-3)
    )
    lines = case.seqs + 8
    return Inputs(
        x=randn(T, s.nheads, s.headdim).to(dtype),
        dt=randn(T, s.nheads, scale=0.5).to(dtype),
        A=-torch.exp(torch.rand(s.nheads, device=device, generator=g) * math.log(16.0)),
        B=randn(T, s.ngroups, s.dstate).to(dtype),
        C=randn(T, s.ngroups, s.dstate).to(dtype),
        D=1.0 + randn(s.nheads, scale=0.1),
        dt_bias=dt_target + torch.log(-torch.expm1(-dt_target)),  # softplus^-1
        pool=randn(lines, s.nheads, s.headdim, s.dstate).to(state_dtype),
        idx=(1 + torch.randperm(lines - 1, device=device, generator=g))[: case.seqs].int(),
        init=torch.tensor(case.init, device=device),
        qsl_cpu=torch.tensor([0, *torch.tensor(case.lens).cumsum(0).tolist()], dtype=torch.int32),
    )


@torch.no_grad()
def reference(case: Case, inp: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 token-by-token recurrence, all sequences stepped together (padded with dt = 0,
    which neither decays nor feeds the state): ``S = exp(dt A) S + dt x B^T``,
    ``y = S C + D x``. Returns y (T, H, P) and the final states (seqs, H, P, N)."""
    s = case.shape
    hpg = s.nheads // s.ngroups
    nseq, tmax = case.seqs, max(case.lens)
    dev = inp.x.device
    pos = torch.cat([torch.arange(n) for n in case.lens]).to(dev)
    seq = torch.repeat_interleave(torch.arange(nseq), torch.tensor(case.lens)).to(dev)

    def padded(t):
        out = torch.zeros(nseq, tmax, *t.shape[1:], dtype=torch.float32, device=dev)
        out[seq, pos] = t.float()
        return out

    dt = F.softplus(inp.dt.float() + inp.dt_bias)
    dt = padded(dt)  # pads stay 0
    x = padded(inp.x)
    B = padded(inp.B).view(nseq, tmax, s.ngroups, 1, 1, s.dstate)
    C = padded(inp.C).view(nseq, tmax, s.ngroups, 1, 1, s.dstate)
    decay = torch.exp(dt * inp.A).view(nseq, tmax, s.ngroups, hpg, 1, 1)
    dtx = (dt[..., None] * x).view(nseq, tmax, s.ngroups, hpg, s.headdim, 1)
    S = inp.pool.index_select(0, inp.idx.long()).float()
    S = torch.where(inp.init[:, None, None, None], S, 0.0)
    S = S.view(nseq, s.ngroups, hpg, s.headdim, s.dstate).clone()
    y = torch.empty(nseq, tmax, s.ngroups, hpg, s.headdim, device=dev)
    for t in range(tmax):
        S.mul_(decay[:, t]).add_(dtx[:, t] * B[:, t])
        y[:, t] = (S * C[:, t]).sum(-1)
    y = y.view(nseq, tmax, s.nheads, s.headdim) + inp.D.view(s.nheads, 1) * x
    # Tokens are packed sequence after sequence: (seq, pos) in token order.
    return y[seq, pos], S.view(nseq, s.nheads, s.headdim, s.dstate)


def rel_l2(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
