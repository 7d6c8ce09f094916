"""Prototype of the next forward design: per-sequence token chunks, rolling rows only.

Not the op. It is a candidate to replace the forward kernel in
``vllm/model_executor/layers/mamba/ops/causal_conv1d.py``, written while no GPU time was
left, and checked only against the fp32 reference under the Triton interpreter. The
GPU numbers that would justify the swap belong to the benchmark issue.

Design. The host metadata (built from ``query_start_loc`` on the CPU) lists one program
per (sequence, chunk of BLOCK_T tokens); an empty sequence gets one program. A program:

- starts its rolling window from the sequence's cache line (chunk 0, with an initial
  state), from zeros (chunk 0 without one), or from the W-1 token rows before the chunk;
- walks its rows in groups of BLOCK_G, loading each token row once as a 1-D vector and
  computing each output from the tuple window. There are no per-row lookups and no 2-D
  masked path, because every row of a program belongs to one sequence;
- for chunk 0, writes the sequence's final state afterwards: the last W-1 inputs read
  straight from x, or the old history for short sequences.

Only chunk 0 reads or writes a sequence's cache line, so there is no race. A one-token
decode is one chunk-0 program that computes one row.

The contrast with the committed kernel: that kernel tiles the global token stream
without host data. Its tiles that mix sequences or touch a sequence start walk a masked
2-D path, with a dependent chain of lookups, at one warp per program. Those tiles make
the whole launch wait: 65-110 us for a 2048-token prefill. See
docs/benchmarks/causal_conv1d_h200_notes.md.

    TRITON_INTERPRET=1 python benchmarks/kernels/conv1d_seq_chunks_prototype.py   # check
    python3 benchmarks/kernels/conv1d_seq_chunks_prototype.py --bench            # on a GPU
"""

import argparse
import functools
import itertools
import os

import torch
from benchmark_utils import cold_us

from vllm.model_executor.layers.mamba.ops.causal_conv1d_ref import PAD_SLOT_ID, causal_conv1d_ref
from vllm.triton_utils import tl, triton

BLOCK_T = 64


def build_programs(query_start_loc_cpu: torch.Tensor, block_t: int = BLOCK_T):
    """(prog_seq, prog_chunk) int32 host tensors: one entry per program."""
    qsl = query_start_loc_cpu.long()
    lens = qsl[1:] - qsl[:-1]
    n_chunks = torch.clamp((lens + block_t - 1) // block_t, min=1)
    prog_seq = torch.repeat_interleave(torch.arange(lens.numel()), n_chunks)
    first = torch.cumsum(n_chunks, 0) - n_chunks
    prog_chunk = torch.arange(prog_seq.numel()) - first[prog_seq]
    return prog_seq.int(), prog_chunk.int()


@triton.jit
def _fwd_seq_chunks_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    state_ptr,
    qsl_ptr,
    cache_idx_ptr,
    has_init_ptr,
    prog_seq_ptr,
    prog_chunk_ptr,
    out_ptr,
    dim,
    pad_slot_id,
    stride_x_t,
    stride_w_d,
    stride_state_line,
    stride_state_col,
    stride_out_t,
    KERNEL_WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    HAS_CACHE_INDICES: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    n_blocks_d = tl.cdiv(dim, BLOCK_D)
    i_d = pid % n_blocks_d
    i_p = pid // n_blocks_d
    seq = tl.load(prog_seq_ptr + i_p).to(tl.int64)
    chunk = tl.load(prog_chunk_ptr + i_p).to(tl.int64)
    start = tl.load(qsl_ptr + seq).to(tl.int64)
    end = tl.load(qsl_ptr + seq + 1).to(tl.int64)
    if HAS_CACHE_INDICES:
        line = tl.load(cache_idx_ptr + seq).to(tl.int64)
    else:
        line = seq
    live = line != pad_slot_id
    if HAS_INITIAL_STATE:
        use_hist = live & tl.load(has_init_ptr + seq).to(tl.int1)
    else:
        use_hist = live & False
    t0 = start + chunk * BLOCK_T
    t_end = tl.minimum(t0 + BLOCK_T, end)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D).to(tl.int64)
    m_d = o_d < dim
    p_line = state_ptr + line * stride_state_line

    if HAS_BIAS:
        b_bias = tl.load(bias_ptr + o_d, mask=m_d, other=0.0).to(tl.float32)
    else:
        b_bias = tl.zeros([BLOCK_D], dtype=tl.float32)
    b_ws = ()
    for k in tl.static_range(KERNEL_WIDTH):
        b_w = tl.load(w_ptr + o_d * stride_w_d + k, mask=m_d, other=0.0)
        b_ws = b_ws + (b_w.to(tl.float32),)

    # The W-1 inputs before t0: token rows, or (chunk 0) the history or zeros.
    b_win = ()
    for j in tl.static_range(KERNEL_WIDTH - 1):
        p = t0 - (KERNEL_WIDTH - 1) + j
        b_x = tl.load(x_ptr + p * stride_x_t + o_d, mask=m_d & (p >= start), other=0.0)
        p_h = p_line + (p - start + KERNEL_WIDTH - 1) * stride_state_col + o_d
        b_h = tl.load(p_h, mask=m_d & (p < start) & use_hist, other=0.0)
        b_win = b_win + (b_x.to(tl.float32) + b_h.to(tl.float32),)

    for g0 in range(t0, t_end, BLOCK_G):
        b_rows = b_win
        for j in tl.static_range(BLOCK_G):
            p_row = x_ptr + (g0 + j) * stride_x_t + o_d
            b_row = tl.load(p_row, mask=m_d & (g0 + j < t_end) & live, other=0.0)
            b_rows = b_rows + (b_row.to(tl.float32),)
        for r in tl.static_range(BLOCK_G):
            acc = b_bias
            for k in tl.static_range(KERNEL_WIDTH):
                acc += b_rows[r + k] * b_ws[k]
            if SILU:
                acc = acc / (1.0 + tl.exp(-acc))
            acc = tl.where(live, acc, 0.0)
            p_out = out_ptr + (g0 + r) * stride_out_t + o_d
            tl.store(p_out, acc.to(out_ptr.dtype.element_ty), mask=m_d & (g0 + r < t_end))
        b_win = b_rows[BLOCK_G:]

    # Chunk 0 owns the sequence's cache line: read everything, then write.
    if (chunk == 0) & live:
        b_new = ()
        for j in tl.static_range(KERNEL_WIDTH - 1):
            p = end - (KERNEL_WIDTH - 1) + j
            b_x = tl.load(x_ptr + p * stride_x_t + o_d, mask=m_d & (p >= start), other=0.0)
            p_h = p_line + (p - start + KERNEL_WIDTH - 1) * stride_state_col + o_d
            b_h = tl.load(p_h, mask=m_d & (p < start) & use_hist, other=0.0)
            b_v = tl.where(p >= start, b_x.to(state_ptr.dtype.element_ty), b_h)
            b_new = b_new + (b_v,)
        tl.debug_barrier()
        for j in tl.static_range(KERNEL_WIDTH - 1):
            tl.store(p_line + j * stride_state_col + o_d, b_new[j], mask=m_d)


def causal_conv1d_seq_chunks(
    x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
    programs, silu=True, block_g=8, num_warps=1, pad_slot_id=PAD_SLOT_ID,
):  # fmt: skip
    dim, num_tokens = x.shape
    prog_seq, prog_chunk = programs
    out = torch.empty(num_tokens, dim, dtype=x.dtype, device=x.device).t()
    block_d = 16 // x.element_size() * 32 * num_warps
    grid = (prog_seq.numel() * triton.cdiv(dim, block_d),)
    _fwd_seq_chunks_kernel[grid](
        x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
        prog_seq, prog_chunk, out, dim, pad_slot_id, x.stride(1), weight.stride(0),
        conv_states.stride(0), conv_states.stride(2), out.stride(1),
        KERNEL_WIDTH=weight.shape[1], HAS_BIAS=bias is not None, SILU=silu,
        HAS_CACHE_INDICES=cache_indices is not None,
        HAS_INITIAL_STATE=has_initial_state is not None,
        BLOCK_T=BLOCK_T, BLOCK_G=block_g, BLOCK_D=block_d, num_warps=num_warps,
    )  # fmt: skip
    return out


def _case(lens, dim, width, dtype, device, lines=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    batch = len(lens)
    lines = lines or batch + 3
    qsl = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    num_tokens = int(qsl[-1])
    x = torch.randn(num_tokens, dim + 8, generator=g)[:, 4 : 4 + dim].to(dtype).to(device).t()
    w = (0.5 * torch.randn(dim, width, generator=g)).to(dtype).to(device)
    b = (0.2 * torch.randn(dim, generator=g)).to(dtype).to(device)
    st = torch.randn(lines, width - 1, dim, generator=g).to(dtype).to(device).transpose(1, 2)
    idx = torch.randperm(lines, generator=g)[:batch].int()
    idx[torch.rand(batch, generator=g) < 0.15] = PAD_SLOT_ID
    init = torch.rand(batch, generator=g) < 0.6
    return x, w, b, st, qsl, idx.to(device), init.to(device)


def check(device):
    cases = [
        ([5], 40, 4), ([1, 1, 1], 40, 4), ([3, 70, 1, 2, 0, 130], 40, 4), ([0, 0], 40, 3),
        ([200], 72, 2), ([64, 65, 63, 1, 2], 40, 5), ([9, 7, 130, 1], 40, 8),
    ]  # fmt: skip
    worst = 0.0
    for lens, dim, width in cases:
        x, w, b, st, qsl, idx, init = _case(lens, dim, width, torch.float32, device)
        s1, s2 = st.clone(), st.clone()
        progs = tuple(t.to(device) for t in build_programs(qsl))
        o1 = causal_conv1d_seq_chunks(x, w, b, s1, qsl.to(device), idx, init, progs)
        o2 = causal_conv1d_ref(x, w, b, s2, qsl.to(device), idx, init)
        err = (o1 - o2).abs().max().item() if o1.numel() else 0.0
        worst = max(worst, err)
        if not (err < 1e-4 and torch.equal(s1, s2) and not o1.isnan().any()):
            raise SystemExit(f"MISMATCH lens={lens} W={width}: max|diff|={err}")
    print(f"prototype matches the reference on {len(cases)} cases (max|diff| {worst:.2e})")


def bench():
    dim = 8448
    for name, lens in (("T2048x1", [2048]), ("T8192x16", [512] * 16),
                       ("T131072x1", [131072]), ("mix2048+255", [2048] + [1] * 255)):  # fmt: skip
        x, w, b, st, qsl, idx, init = _case(lens, dim, 4, torch.bfloat16, "cuda", lines=1024)
        idx = torch.randperm(1024, device="cuda")[: len(lens)].int()
        qsl_d = qsl.cuda()
        progs = tuple(t.cuda() for t in build_programs(qsl))
        for bg, nw in ((8, 1), (16, 1), (8, 2)):
            call = functools.partial(causal_conv1d_seq_chunks, x, w, b, st, qsl_d, idx, init,
                                     progs, block_g=bg, num_warps=nw)  # fmt: skip
            us = cold_us(call)
            nbytes = 2 * x.numel() * x.element_size()
            print(f"{name:12s} G{bg} w{nw}: {us:8.1f} us  {nbytes / us / 1e3:6.0f} GB/s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", action="store_true")
    args = ap.parse_args()
    if args.bench:
        check("cuda")
        bench()
    elif torch.cuda.is_available():
        check("cuda")
    elif os.environ.get("TRITON_INTERPRET") == "1":
        check("cpu")
    else:
        raise SystemExit("no GPU: run with TRITON_INTERPRET=1 to check under the interpreter")
