"""The causal-conv1d benchmark's providers (benchmark_causal_conv1d.py says what each one
runs): ours in Triton and CUDA (the latter also with its row width forced), the torch
reference and Dao-AILab's ``causal_conv1d`` package, each as a ``Provider`` that runs one
call of a case on a state pool in its own layout.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from benchmarks.kernels.conv1d_bench_cases import DEVICE, DTYPE, MIXED_PREFILL, Case, Inputs
from vllm import _custom_ops as cuda_ops
from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
    PAD_SLOT_ID,
    causal_conv1d_fn,
    causal_conv1d_ref,
    causal_conv1d_update,
    causal_conv1d_update_ref,
)

PROVIDERS = ("triton", "cuda", "torch", "dao", "cuda-r4", "cuda-r8", "cuda-r16")
DEFAULT_PROVIDERS = ("triton", "cuda", "torch", "dao")
# cuda-r4 / cuda-r8 / cuda-r16: the CUDA forward with its row width forced (cuda: the launcher's
# choice), to compare the two; decode has no forward call, so they skip it.
ROW_BYTES = {"cuda": 0, "cuda-r4": 4, "cuda-r8": 8, "cuda-r16": 16}
OUR_PROVIDERS = (
    "triton",
    "cuda",
    "torch",
    "cuda-r4",
    "cuda-r8",
    "cuda-r16",
)  # their failures fail the run


@dataclasses.dataclass
class Provider:
    """One implementation on one case: run(pool) -> result, on a pool in its layout."""

    run: Callable[[torch.Tensor], object]
    pool: torch.Tensor  # the initial pool, in this provider's layout
    collect: Callable[[object], torch.Tensor] = lambda out: out  # result -> ref's shape
    checks_states: bool = True
    graphable: bool = True
    note: str = ""


def triton_provider(case: Case, inp: Inputs) -> Provider:
    if case.kind == "decode":
        x = inp.x_rows

        def run(pool):
            return causal_conv1d_update(x, pool, inp.weight, inp.bias, "silu", inp.idx)
    else:

        def run(pool):
            return causal_conv1d_fn(
                inp.x,
                inp.weight,
                inp.bias,
                pool,
                inp.qsl,
                inp.idx,
                inp.init,
                "silu",
                metadata=inp.meta,
            )

    note = "one call" if case.kind == "mixed" else ""
    return Provider(run, inp.pool_f, note=note)


def cuda_provider(case: Case, inp: Inputs, row_bytes: int) -> Provider:
    upd = cuda_ops.causal_conv1d_update_cuda
    fwd = functools.partial(cuda_ops.causal_conv1d_fwd_cuda, row_bytes=row_bytes)
    if case.kind == "decode":
        x = inp.x_rows

        def run(pool):
            return upd(x, pool, inp.weight, inp.bias, True, inp.idx, PAD_SLOT_ID)

        return Provider(run, inp.pool_w)
    if case.kind == "prefill":

        def run(pool):
            return fwd(
                inp.x, inp.weight, inp.bias, pool, inp.qsl, inp.idx, inp.init, True, PAD_SLOT_ID
            )

        return Provider(run, inp.pool_w)
    # mixed: the prefill (sequence 0) through the forward op, the decodes through update
    n = MIXED_PREFILL
    x_pre, x_dec = inp.x[:, :n], inp.x[:, n:].t()
    qsl_pre, idx_pre, init_pre, idx_dec = inp.qsl[:2], inp.idx[:1], inp.init[:1], inp.idx[1:]
    dim, tokens = inp.x.shape

    def run(pool):
        out = torch.empty(tokens, dim, dtype=DTYPE, device=DEVICE).t()
        fwd(
            x_pre,
            inp.weight,
            inp.bias,
            pool,
            qsl_pre,
            idx_pre,
            init_pre,
            True,
            PAD_SLOT_ID,
            out=out[:, :n],
        )
        upd(x_dec, pool, inp.weight, inp.bias, True, idx_dec, PAD_SLOT_ID, out=out[:, n:].t())
        return out

    return Provider(run, inp.pool_w, note="split: fwd + update")


def torch_provider(case: Case, inp: Inputs) -> Provider:
    if case.kind == "decode":
        x = inp.x_rows

        def run(pool):
            return causal_conv1d_update_ref(x, pool, inp.weight, inp.bias, "silu", inp.idx)
    else:

        def run(pool):
            return causal_conv1d_ref(
                inp.x, inp.weight, inp.bias, pool, inp.qsl, inp.idx, inp.init, "silu"
            )

    return Provider(run, inp.pool_f, graphable=False, note="syncs: cold includes host")


def dao_provider(case: Case, inp: Inputs, dao) -> Provider:
    dao_fn, dao_update = dao
    if case.kind == "decode":
        x = inp.x_rows

        def run(pool):
            return dao_update(
                x, pool, inp.weight, inp.bias, activation="silu", conv_state_indices=inp.idx
            )

        return Provider(run, inp.pool_w, note="native layout")
    if case.kind == "prefill":
        x3 = inp.x.unsqueeze(0)  # (1, dim, tokens), channel-last
        seq_idx = None
        if case.seqs > 1:
            lens = torch.tensor(case.lens, device=DEVICE)
            seq_idx = torch.repeat_interleave(torch.arange(case.seqs, device=DEVICE), lens)
            seq_idx = seq_idx.to(torch.int32).unsqueeze(0)

        def run(pool):
            return dao_fn(x3, inp.weight, inp.bias, seq_idx=seq_idx, activation="silu")

        return Provider(
            run,
            inp.pool_w,
            collect=lambda out: out[0],
            checks_states=False,
            note="no state write" + (", seq_idx" if seq_idx is not None else ""),
        )
    # mixed: update(decodes) + fn(prefill, initial/final states) + copy of the final state
    n, line0 = MIXED_PREFILL, inp.lines[0]
    x_pre, x_dec, idx_dec = inp.x[:, :n].unsqueeze(0), inp.x[:, n:].t(), inp.idx[1:]

    def run(pool):
        out_dec = dao_update(
            x_dec, pool, inp.weight, inp.bias, activation="silu", conv_state_indices=idx_dec
        )
        out_pre, final = dao_fn(
            x_pre,
            inp.weight,
            inp.bias,
            initial_states=pool[line0 : line0 + 1],
            return_final_states=True,
            activation="silu",
        )
        pool[line0].copy_(final[0])
        return out_pre, out_dec

    def collect(result):
        out_pre, out_dec = result
        return torch.cat([out_pre[0], out_dec.t()], dim=1)

    return Provider(run, inp.pool_f, collect=collect, note="split: update + fn + copy")


def load_dao():
    """(causal_conv1d_fn, causal_conv1d_update), version; or None and why not."""
    try:
        import causal_conv1d
        from causal_conv1d import causal_conv1d_fn as dao_fn
        from causal_conv1d import causal_conv1d_update as dao_update
    except Exception as e:  # any import failure just means "not available"
        return None, f"not importable ({type(e).__name__}: {e})"
    return (dao_fn, dao_update), getattr(causal_conv1d, "__version__", "unknown version")
