"""Upstream vLLM's SSD test cases (tests/kernels/mamba/test_mamba_ssm_ssd.py, 0.33.0), run
against our op through an adapter with upstream's calling convention.

Upstream's op takes dense per-sequence initial states and returns the final states, or the
states at every chunk's end (``return_intermediate_states``); ours reads and writes lines
of a state pool. ``upstream_call`` maps one onto the other: sequence i starts from (and
ends in) line i, and chunk c's end state goes to line ``batch + c``. The case lists below
reproduce upstream's parameters (shapes, chunk sizes, the continuous-batching schedules,
dtypes); the inputs are drawn as upstream draws them (dt = softplus(randn - 4), A =
-exp(rand), B and C per head: ngroups = nheads, dstate = headdim). Nothing of upstream's
is imported. The reference is the fp32 per-token recurrence (``recurrence``), and the
bounds are this project's tolerance table, tighter than upstream's, but for the bf16
outputs of the single-example cases, which take upstream's (see there).

Added in the same style: ``z`` gating, ``D`` per (head, headdim) and the chunk-end states,
the three arguments upstream has and our op gained (issue 29).

On the CPU (interpreter) the fp32 cases run; the bf16 ones need the GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.models.mamba2_utils import BF16, FP32, assert_close
from vllm.model_executor.layers.mamba.ops.ssd_combined import (
    mamba_chunk_scan_combined_varlen,
    plan_ssd_chunks,
)

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# bf16 tl.dot is wrong under Triton 3.6's interpreter: bf16 cases on the GPU only; so are
# the largest fp32 ones, which take minutes each under the interpreter.
NEEDS_GPU = pytest.mark.skipif(not ON_GPU, reason="bf16 runs on the GPU box")
LARGE = pytest.mark.skipif(not ON_GPU, reason="too slow for the interpreter: GPU box")


def upstream_call(x, dt, A, B, C, chunk_size, cu_seqlens, initial_states=None, D=None, z=None,
                  return_intermediate_states=False):  # fmt: skip
    """Upstream's ``mamba_chunk_scan_combined_varlen(..., initial_states, D, z,
    return_intermediate_states)`` on our op: returns (y, final states (batch, H, P, N)) or
    (y, chunk-end states (nchunks, H, P, N)), fp32."""
    _, nheads, headdim = x.shape
    dstate = B.shape[-1]
    batch = cu_seqlens.numel() - 1
    layout = plan_ssd_chunks(cu_seqlens.cpu().to(torch.int32), chunk_size)
    # Line 0 is the null line; the sequences' lines follow, then the chunks'.
    pool = torch.zeros(1 + batch + layout.num_chunks, nheads, headdim, dstate, device=x.device)
    has_init = None
    if initial_states is not None:
        pool[1 : batch + 1] = initial_states.float()
        has_init = torch.ones(batch, dtype=torch.bool, device=x.device)
    lines = torch.arange(1, batch + 1, dtype=torch.int32, device=x.device)
    chunk_lines = None
    if return_intermediate_states:
        chunk_lines = torch.arange(layout.num_chunks, dtype=torch.int32, device=x.device)
        chunk_lines += 1 + batch
    y = mamba_chunk_scan_combined_varlen(
        x, dt, A, B, C, layout.to(x.device), pool, lines, has_init, D=D, z=z,
        chunk_state_indices=chunk_lines,
    )  # fmt: skip
    return y, (pool[1 + batch :] if return_intermediate_states else pool[1 : batch + 1])


def recurrence(x, dt, A, B, C, cu_seqlens, chunk_size, initial_states=None, D=None, z=None):
    """fp32 per-token reference: y (tokens, H, P), final states (batch, H, P, N) and the
    state at the end of every chunk of every sequence (nchunks, H, P, N)."""
    x, dt, B, C = (t.float() for t in (x, dt, B, C))
    nheads, hpg = x.shape[1], x.shape[1] // B.shape[1]
    B, C = B.repeat_interleave(hpg, dim=1), C.repeat_interleave(hpg, dim=1)
    y = torch.zeros_like(x)
    finals, chunk_states = [], []
    cu = cu_seqlens.tolist()
    for i in range(len(cu) - 1):
        S = torch.zeros(nheads, x.shape[2], B.shape[2], device=x.device)
        if initial_states is not None:
            S = initial_states[i].float().clone()
        for t in range(cu[i], cu[i + 1]):
            S = torch.exp(dt[t] * A)[:, None, None] * S + dt[t][:, None, None] * (
                x[t][:, :, None] * B[t][:, None, :]
            )
            y[t] = (S * C[t][:, None, :]).sum(-1)
            if (t + 1 - cu[i]) % chunk_size == 0 or t + 1 == cu[i + 1]:
                chunk_states.append(S.clone())
        finals.append(S)
    if D is not None:
        y = y + (D.float()[None] if D.dim() == 2 else D.float()[None, :, None]) * x
    if z is not None:
        y = y * F.silu(z.float())
    return y, torch.stack(finals), torch.stack(chunk_states)


def random_inputs(batch_seqlen: int, n_heads: int, d_head: int, dtype, seed: int = 0):
    """As upstream draws them: A = -exp(rand), dt = softplus(randn - 4), x, B, C ~ randn
    with B and C per head (ngroups = nheads, dstate = headdim)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)

    A = -torch.exp(torch.rand(n_heads, generator=g)).to(dtype).to(DEVICE)
    dt = F.softplus(torch.randn(batch_seqlen, n_heads, generator=g) - 4).to(dtype).to(DEVICE)
    return A, dt, randn(batch_seqlen, n_heads, d_head), randn(batch_seqlen, n_heads, d_head), \
        randn(batch_seqlen, n_heads, d_head)  # fmt: skip


# test_mamba_chunk_scan_single_example: 2 dtypes x 3 head counts x 4 head sizes x 2 lengths.
SINGLE = [
    pytest.param(itype, n_heads, d_head, sc,
                 marks=[NEEDS_GPU] if itype == BF16 else [LARGE] if d_head == 128 else [],
                 id=f"{'bf16' if itype == BF16 else 'fp32'}-H{n_heads}-P{d_head}-T{sc[0]}-L{sc[1]}")
    for itype in (FP32, BF16)
    for n_heads in (4, 16, 32)
    for d_head in (5, 8, 32, 128)
    for sc in ((112, 16), (128, 32))
]  # fmt: skip


@pytest.mark.parametrize("itype,n_heads,d_head,seq_len_chunk_size", SINGLE)
def test_single_example(itype, n_heads, d_head, seq_len_chunk_size):
    seqlen, chunk = seq_len_chunk_size
    A, dt, x, B, C = random_inputs(seqlen, n_heads, d_head, itype)
    cu = torch.tensor([0, seqlen], device=DEVICE)
    y, final = upstream_call(x, dt, A.float(), B, C, chunk, cu)
    y_ref, final_ref, _ = recurrence(x, dt, A.float(), B, C, cu, chunk)
    if itype == BF16:
        # Upstream's own bound for its bf16 outputs: a bf16 y from single-cast local weights
        # (its and ours) parts from fp32 by ~4e-2 where large local terms cancel.
        torch.testing.assert_close(y.float(), y_ref, atol=5e-2, rtol=5e-2)
    else:
        assert_close(y, y_ref, "scan", itype)
    assert_close(final, final_ref, "scan", FP32 if itype == FP32 else BF16)


# test_mamba_chunk_scan_cont_batch: (full length, chunk, examples, the tokens each example
# gives to each continuous batch); an example that reaches its full length restarts from
# zero in the next batch, with a cleared state.
CONT_BATCH_CASES = [
    (64, 8, 2, [(64, 32), (64, 32)]),
    (64, 8, 2, [(8, 8), (8, 8), (8, 8)]),
    (64, 8, 2, [(4, 4), (4, 4), (4, 4), (4, 4)]),
    (64, 8, 5, [(64, 32, 16, 8, 8)]),
    (64, 256, 1, [(5,), (1,), (1,), (1,)]),
    (64, 256, 2, [(5, 30), (1, 2), (1, 2), (1, 2)]),
    (768, 128, 2, [(138, 225), (138, 225)]),
]


@pytest.mark.parametrize("n_heads", [4, 8])
@pytest.mark.parametrize("d_head", [5, 16, 32])
@pytest.mark.parametrize(
    "case", CONT_BATCH_CASES, ids=lambda c: f"T{c[0]}-L{c[1]}-E{c[2]}-{len(c[3])}batches"
)
def test_cont_batch(d_head, n_heads, case):  # fmt: skip
    full_length, chunk, examples, schedule = case
    A, dt, x, B, C = random_inputs(examples * full_length, n_heads, d_head, FP32)
    A, dt, x, B, C = A, *(t.view(examples, full_length, *t.shape[1:]) for t in (dt, x, B, C))
    # The reference: every example scanned whole, once.
    whole = torch.arange(0, examples * full_length + 1, full_length, device=DEVICE)
    y_ref, _, _ = recurrence(*(t.flatten(0, 1) for t in (x,)), dt.flatten(0, 1), A,
                             B.flatten(0, 1), C.flatten(0, 1), whole, chunk)  # fmt: skip
    y_ref = y_ref.view(examples, full_length, *y_ref.shape[1:])
    taken = [0] * examples
    states = None
    for spec in schedule:
        spans = []
        for i, n in enumerate(spec):
            start = taken[i] % full_length
            spans.append((start, start + n))
            taken[i] = start + n
        cu = torch.tensor([0, *spec], device=DEVICE).cumsum(0)
        pick = [slice(s, e) for s, e in spans]
        y, final = upstream_call(
            torch.cat([x[i, p] for i, p in enumerate(pick)]),
            torch.cat([dt[i, p] for i, p in enumerate(pick)]),
            A,
            torch.cat([B[i, p] for i, p in enumerate(pick)]),
            torch.cat([C[i, p] for i, p in enumerate(pick)]),
            chunk,
            cu,
            initial_states=states,
        )
        for i, p in enumerate(pick):
            assert_close(y[int(cu[i]) : int(cu[i + 1])], y_ref[i, p], "scan", FP32)
        states = final.clone()
        for i in range(examples):
            if taken[i] == full_length:  # exhausted: starts over with a cleared state
                states[i].zero_()


@pytest.mark.parametrize("chunk", [8, 256])
@pytest.mark.parametrize(
    "seqlens", [(16, 20), pytest.param((270, 88, 212, 203), marks=LARGE)], ids=["S2", "S4"]
)
def test_prefill_chunking(chunk, seqlens):
    """test_mamba_chunk_scan_cont_batch_prefill_chunking: each sequence's first half, then
    its rest from the first half's states, equals the whole sequence in one call."""
    n_heads, d_head = 16, 64
    total = sum(seqlens)
    A, dt, x, B, C = random_inputs(total, n_heads, d_head, FP32)
    cu = torch.tensor([0, *seqlens], device=DEVICE).cumsum(0)
    y_whole, final_whole = upstream_call(x, dt, A, B, C, chunk, cu)
    first = [n // 2 for n in seqlens]
    rows1 = torch.cat(
        [torch.arange(int(cu[i]), int(cu[i]) + first[i]) for i in range(len(seqlens))]
    )
    rows2 = torch.cat(
        [torch.arange(int(cu[i]) + first[i], int(cu[i + 1])) for i in range(len(seqlens))]
    )
    cu1 = torch.tensor([0, *first], device=DEVICE).cumsum(0)
    cu2 = torch.tensor(
        [0, *(n - f for n, f in zip(seqlens, first, strict=True))], device=DEVICE
    ).cumsum(0)
    part = [t[rows1.to(DEVICE)] for t in (x, dt, B, C)]
    y1, states1 = upstream_call(part[0], part[1], A, part[2], part[3], chunk, cu1)
    part = [t[rows2.to(DEVICE)] for t in (x, dt, B, C)]
    y2, states2 = upstream_call(part[0], part[1], A, part[2], part[3], chunk, cu2,
                                initial_states=states1)  # fmt: skip
    assert_close(y1, y_whole[rows1.to(DEVICE)], "batching", FP32)
    assert_close(y2, y_whole[rows2.to(DEVICE)], "batching", FP32)
    assert_close(states2, final_whole, "batching", FP32)  # fmt: skip


# Upstream's interface beyond what the cases above use: z, D per (head, headdim), the states
# at every chunk's end; with initial states, several sequences, partial last chunks.
FEATURES = [
    pytest.param(itype, z, d2, marks=[NEEDS_GPU] if itype == BF16 else [],
                 id=("bf16" if itype == BF16 else "fp32") + ("-z" if z else "")
                 + ("-Dhp" if d2 else "-Dh"))
    for itype in (FP32, BF16)
    for z in (False, True)
    for d2 in (False, True)
]  # fmt: skip


@pytest.mark.parametrize("itype,z,d2", FEATURES)
def test_z_D_and_chunk_states(itype, z, d2):
    n_heads, d_head, chunk = 4, 16, 16
    seqlens = (37, 16, 5)
    A, dt, x, B, C = random_inputs(sum(seqlens), n_heads, d_head, itype, seed=1)
    g = torch.Generator().manual_seed(2)
    gate = torch.randn(x.shape, generator=g).to(itype).to(DEVICE) if z else None
    D = torch.randn((n_heads, d_head) if d2 else (n_heads,), generator=g).to(DEVICE)
    init = torch.randn(len(seqlens), n_heads, d_head, d_head, generator=g).to(DEVICE)
    cu = torch.tensor([0, *seqlens], device=DEVICE).cumsum(0)
    y, chunk_states = upstream_call(x, dt, A.float(), B, C, chunk, cu, initial_states=init,
                                    D=D, z=gate, return_intermediate_states=True)  # fmt: skip
    y_ref, _, chunk_ref = recurrence(x, dt, A.float(), B, C, cu, chunk, init, D, gate)
    assert chunk_states.shape[0] == 3 + 1 + 1
    if itype == BF16:  # upstream's bound for bf16 outputs, as in test_single_example
        torch.testing.assert_close(y.float(), y_ref, atol=5e-2, rtol=5e-2)
    else:
        assert_close(y, y_ref, "scan", itype)
    assert_close(chunk_states, chunk_ref, "scan", FP32 if itype == FP32 else BF16)
