"""fp32 references of the Mamba1 selective scan (MambaForCausalLM, FalconMamba, Jamba).

Mamba1's scan is per channel: channel d of a layer with ``dim`` channels keeps a state row
h[d, :] of ``dstate`` values, with its own step size and its own decay per state column:

    dt[t, d]  = softplus(delta[t, d] + delta_bias[d])        (softplus when asked)
    h[d, n]  <- exp(dt[t, d] * A[d, n]) * h[d, n] + dt[t, d] * B[t, n] * u[t, d]
    y[t, d]   = sum_n C[t, n] * h[d, n] + D[d] * u[t, d]
    y[t, d]  *= silu(z[t, d])                                 (when a gate z is given)

B and C are shared by all channels (one group). Layout is token-major, as the engine's
activations are: u, delta, z and y are (num_tokens, dim); B and C (num_tokens, dstate);
A (dim, dstate); D and delta_bias (dim,); the pool ``ssm_states`` (num_lines, dim, dstate).

These walk every token in a Python loop with the recurrence written plainly: they define
what the Triton ops compute, and are the CPU path's oracle. Slow by design.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm.model_executor.layers.mamba.ops.causal_conv1d_ref import NULL_BLOCK_ID, marker_for


def _step_size(delta_t, delta_bias, delta_softplus):
    dt = delta_t.float()
    if delta_bias is not None:
        dt = dt + delta_bias.float()
    return F.softplus(dt) if delta_softplus else dt


def _output(h, u_t, C_t, D, z_t):
    y = h @ C_t.float()
    if D is not None:
        y = y + D.float() * u_t.float()
    if z_t is not None:
        y = y * F.silu(z_t.float())
    return y


def selective_scan_ref(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    query_start_loc: torch.Tensor,
    ssm_states: torch.Tensor,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    pad_slot_id: int = NULL_BLOCK_ID,
) -> torch.Tensor:
    """Scan each sequence of a varlen batch; returns y (num_tokens, dim) in fp32.

    Sequence b is rows ``query_start_loc[b]:query_start_loc[b + 1]``; it starts from line
    ``cache_indices[b]`` of ``ssm_states`` when ``has_initial_state[b]`` (zeros otherwise)
    and leaves its final state there, in the pool's dtype. A row whose line is the pad
    marker (or negative) is padded: zero outputs, no line read or written.
    """
    qsl = query_start_loc.tolist()
    batch = len(qsl) - 1
    lines = cache_indices.tolist() if cache_indices is not None else list(range(batch))
    pad_slot_id = marker_for(pad_slot_id, cache_indices)
    init = has_initial_state.tolist() if has_initial_state is not None else [False] * batch
    A = A.float()
    y = torch.zeros(u.shape, dtype=torch.float32, device=u.device)
    for b in range(batch):
        line = lines[b]
        if line == pad_slot_id or line < 0:
            continue
        if init[b]:
            h = ssm_states[line].float().clone()
        else:
            h = torch.zeros(ssm_states.shape[1:], dtype=torch.float32, device=u.device)
        for t in range(qsl[b], qsl[b + 1]):
            dt = _step_size(delta[t], delta_bias, delta_softplus)
            h = torch.exp(dt[:, None] * A) * h + (dt * u[t].float())[:, None] * B[t].float()
            y[t] = _output(h, u[t], C[t], D, None if z is None else z[t])
        if qsl[b + 1] > qsl[b]:
            ssm_states[line] = h.to(ssm_states.dtype)
    return y


def selective_state_update_ref(
    ssm_states: torch.Tensor,
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    state_batch_indices: torch.Tensor | None = None,
    pad_slot_id: int = NULL_BLOCK_ID,
) -> torch.Tensor:
    """One decode step for each row: u, delta, z (batch, dim); B, C (batch, dstate).

    Row i updates line ``state_batch_indices[i]`` (row i's own line without indices) in
    place and returns y (batch, dim) in fp32; padded rows get zeros and touch no line.
    """
    batch = u.shape[0]
    lines = state_batch_indices.tolist() if state_batch_indices is not None else list(range(batch))
    pad_slot_id = marker_for(pad_slot_id, state_batch_indices)
    A = A.float()
    y = torch.zeros(u.shape, dtype=torch.float32, device=u.device)
    for i in range(batch):
        line = lines[i]
        if line == pad_slot_id or line < 0:
            continue
        dt = _step_size(delta[i], delta_bias, delta_softplus)
        h = ssm_states[line].float()
        h = torch.exp(dt[:, None] * A) * h + (dt * u[i].float())[:, None] * B[i].float()
        y[i] = _output(h, u[i], C[i], D, None if z is None else z[i])
        ssm_states[line] = h.to(ssm_states.dtype)
    return y
