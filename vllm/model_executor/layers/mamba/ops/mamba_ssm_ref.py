"""fp32 per-token reference of the Mamba2 selective scan.

It walks every sequence token by token with the recurrence written out plainly (see
``mamba_ssm_torch`` for the formula), and defines what the chunked scan and the decode
update must compute. Slow by design: for tests only.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from vllm.model_executor.layers.mamba.ops.causal_conv1d_ref import NULL_BLOCK_ID, marker_for


def ssm_scan_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    query_start_loc: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    pad_slot_id: int = NULL_BLOCK_ID,
) -> torch.Tensor:
    """Scan each sequence of a varlen batch; returns y (num_tokens, nheads, headdim) in fp32.

    ``ssm_states`` (num_lines, nheads, headdim, dstate): sequence b starts from line
    ``state_indices[b]`` when ``has_initial_state[b]`` (zeros otherwise) and leaves its final
    state there. Padded rows get zero outputs and touch no line.
    """
    nheads = x.shape[1]
    ngroups = B.shape[1]
    qsl = query_start_loc.tolist()
    batch = len(qsl) - 1
    lines = state_indices.tolist() if state_indices is not None else list(range(batch))
    pad_slot_id = marker_for(pad_slot_id, state_indices)
    init = has_initial_state.tolist() if has_initial_state is not None else [False] * batch
    head_group = [h * ngroups // nheads for h in range(nheads)]
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for b in range(batch):
        if lines[b] == pad_slot_id or lines[b] < 0:
            continue
        if init[b]:
            s = ssm_states[lines[b]].float().clone()
        else:
            s = torch.zeros(ssm_states.shape[1:], dtype=torch.float32, device=x.device)
        for t in range(qsl[b], qsl[b + 1]):
            for h in range(nheads):
                g = head_group[h]
                step = dt[t, h].float()
                if dt_bias is not None:
                    step = step + dt_bias[h].float()
                if dt_softplus:
                    step = F.softplus(step)
                step = step.clamp(min=dt_limit[0], max=dt_limit[1])
                xt = x[t, h].float()
                s[h] = torch.exp(step * A[h].float()) * s[h] + step * torch.outer(
                    xt, B[t, g].float()
                )
                y[t, h] = s[h] @ C[t, g].float()
                if D is not None:
                    y[t, h] += D[h].float() * xt
        ssm_states[lines[b]] = s.to(ssm_states.dtype)
    return y
