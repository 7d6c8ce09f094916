"""Where the host time of one eager causal-conv1d call goes (GPU only).

Times, per call, a back-to-back loop of each layer of an eager call on a tiny step (the
GPU work is a few microseconds, so the loop measures the host): our Python checks, the
launch cache's key, the stream lookup, the direct launch, and the whole op; the CUDA
pathway's op for comparison. Exploration for the host-cost targets; the benchmark of
record is benchmark_causal_conv1d.py.

    python3 benchmarks/kernels/host_cost_breakdown.py
"""

import time

import torch

from vllm import _custom_ops as cuda_ops
from vllm.model_executor.layers.mamba.ops import causal_conv1d as cc
from vllm.triton_utils import launch


def per_call_us(fn, n=2000):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return host


def main():
    dim, width, batch = 8448, 4, 8
    dt = torch.bfloat16
    x = torch.randn(batch, dim, device="cuda", dtype=dt)
    w = torch.randn(dim, width, device="cuda", dtype=dt)
    b = torch.randn(dim, device="cuda", dtype=dt)
    pool = torch.randn(64, width - 1, dim, device="cuda", dtype=dt).transpose(1, 2)
    idx = torch.arange(batch, dtype=torch.int32, device="cuda")
    out = torch.empty_like(x)
    cfg = cc._decode_config(batch, dim, 2)
    grid = (batch, triton_cdiv(dim, cfg["BLOCK_D"]))
    args = (x, w, b, pool, idx, out, dim, cc.PAD_SLOT_ID, x.stride(0), w.stride(0),
            pool.stride(0), pool.stride(2), out.stride(0))  # fmt: skip
    constexprs = dict(KERNEL_WIDTH=width, HAS_BIAS=True, SILU=True, HAS_INDICES=True, **cfg)
    cc._decode(x, pool, w, b, True, idx, cc.PAD_SLOT_ID)
    dev = torch.cuda.current_device()
    rows = {
        "torch.cuda.current_device()": lambda: torch.cuda.current_device(),
        "current_stream(dev).cuda_stream": lambda: torch.cuda.current_stream(dev).cuda_stream,
        "launch key (_spec of args)": lambda: tuple(map(launch._spec, args)),
        "torch.empty (batch, dim)": lambda: torch.empty(batch, dim, device="cuda", dtype=dt),
        "cached launch of the decode kernel": lambda: cc._LAUNCH_DECODE(grid, args, constexprs),
        "kernel[grid](...) (Triton's own path)": lambda: cc._causal_conv1d_decode_kernel[grid](
            *args, **constexprs
        ),
        "cc._decode (empty + config + launch)": lambda: cc._decode(
            x, pool, w, b, True, idx, cc.PAD_SLOT_ID
        ),
        "causal_conv1d_update (checks + all)": lambda: cc.causal_conv1d_update(
            x, pool, w, b, "silu", idx
        ),
    }
    if cuda_ops.cuda_ops_available():
        pool_c = torch.randn(64, dim, width - 1, device="cuda", dtype=dt)
        rows["CUDA pathway update (checks + op)"] = lambda: cuda_ops.causal_conv1d_update_cuda(
            x, pool_c, w, b, True, idx, cc.PAD_SLOT_ID
        )
        rows["CUDA pathway raw torch.ops call"] = lambda: torch.ops._C_conv.causal_conv1d_update(
            x, pool_c, w, b, True, idx, cc.PAD_SLOT_ID, out
        )
    # A small mixed forward step with metadata.
    lens = [5, 1, 1, 1]
    qsl_cpu = torch.tensor([0, 5, 6, 7, 8], dtype=torch.int32)
    xf = torch.randn(8, dim, device="cuda", dtype=dt).t()
    qsl = qsl_cpu.cuda()
    init = torch.ones(len(lens), dtype=torch.bool, device="cuda")
    idx4 = idx[:4].contiguous()
    meta = cc.compute_causal_conv1d_metadata(qsl_cpu, "cuda")
    rows["causal_conv1d_fn with metadata"] = lambda: cc.causal_conv1d_fn(
        xf, w, b, pool, qsl, idx4, init, metadata=meta
    )
    rows["cc._fwd_impl (no checks)"] = lambda: cc._fwd_impl(
        xf, w, b, pool, qsl, idx4, init, True, cc.PAD_SLOT_ID, meta.tile_seq, meta.block_t
    )
    rows["compute_causal_conv1d_metadata (once per step)"] = lambda: (
        cc.compute_causal_conv1d_metadata(qsl_cpu, "cuda")
    )
    print(f"host us per call ({torch.cuda.get_device_name()}):")
    for name, fn in rows.items():
        print(f"  {name:50s} {per_call_us(fn):8.2f}")


def triton_cdiv(a, b):
    return -(-a // b)


if __name__ == "__main__":
    main()
