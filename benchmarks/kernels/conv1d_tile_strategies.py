"""Stand-alone comparison of tiling strategies for a causal conv1d over tokens.

One (T, dim) bf16 sequence, width 4, no sequence logic: a copy with the same 2D tiling
(the bound), W shifted 2D loads, one load plus ``tl.gather`` shifts, and a token loop
with a tuple sliding window. Results and conclusions: docs/benchmarks/
causal_conv1d_h200.md (long prefills). GPU only:

    python3 -m benchmarks.kernels.conv1d_tile_strategies
"""

import functools
import sys

import torch
import triton
import triton.language as tl

from benchmarks.kernels.benchmark_utils import cold_us


@triton.jit
def k_copy(x, o, T, D, BT: tl.constexpr, BD: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    nd = tl.cdiv(D, BD)
    i_d = pid % nd
    i_t = pid // nd
    ot = i_t * BT + tl.arange(0, BT).to(tl.int64)
    od = i_d * BD + tl.arange(0, BD).to(tl.int64)
    m = (ot < T)[:, None] & (od < D)[None, :]
    v = tl.load(x + ot[:, None] * D + od[None, :], mask=m, other=0.0)
    tl.store(o + ot[:, None] * D + od[None, :], v, mask=m)


@triton.jit
def k_shift(x, w, o, T, D, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    nd = tl.cdiv(D, BD)
    i_d = pid % nd
    i_t = pid // nd
    ot = i_t * BT + tl.arange(0, BT).to(tl.int64)
    od = i_d * BD + tl.arange(0, BD).to(tl.int64)
    md = od < D
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for k in tl.static_range(W):
        p = ot - (W - 1) + k
        m = ((p >= 0) & (p < T))[:, None] & md[None, :]
        v = tl.load(x + p[:, None] * D + od[None, :], mask=m, other=0.0).to(tl.float32)
        wk = tl.load(w + od * W + k, mask=md, other=0.0)
        acc += v * wk[None, :]
    acc = acc / (1.0 + tl.exp(-acc))
    tl.store(
        o + ot[:, None] * D + od[None, :],
        acc.to(o.dtype.element_ty),
        mask=(ot < T)[:, None] & md[None, :],
    )


@triton.jit
def k_gather(x, w, o, T, D, W: tl.constexpr, OV: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    nd = tl.cdiv(D, BD)
    i_d = pid % nd
    i_t = pid // nd
    step = BT - OV
    ot = i_t * step - OV + tl.arange(0, BT).to(tl.int64)
    od = i_d * BD + tl.arange(0, BD).to(tl.int64)
    md = od < D
    m = ((ot >= 0) & (ot < T))[:, None] & md[None, :]
    tile = tl.load(x + ot[:, None] * D + od[None, :], mask=m, other=0.0).to(tl.float32)
    o_r = tl.arange(0, BT)
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for k in tl.static_range(W):
        wk = tl.load(w + od * W + k, mask=md, other=0.0)
        if k == W - 1:
            v = tile
        else:
            idx = tl.maximum(o_r - (W - 1) + k, 0)
            idx2 = idx[:, None] + tl.zeros([BT, BD], dtype=tl.int32)
            v = tl.gather(tile, idx2, 0)
        acc += v * wk[None, :]
    acc = acc / (1.0 + tl.exp(-acc))
    own = (o_r >= OV) & (ot < T)
    tl.store(
        o + ot[:, None] * D + od[None, :],
        acc.to(o.dtype.element_ty),
        mask=own[:, None] & md[None, :],
    )


@triton.jit
def k_loop(x, w, o, T, D, W: tl.constexpr, CH: tl.constexpr, BD: tl.constexpr, NS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    nd = tl.cdiv(D, BD)
    i_d = pid % nd
    i_t = pid // nd
    t0 = i_t * CH
    od = i_d * BD + tl.arange(0, BD).to(tl.int64)
    md = od < D
    # window: tuple of W-1 rows before t0
    p0 = t0 - (W - 1)
    win = ()
    for k in tl.static_range(W - 1):
        win = win + (
            tl.load(x + (p0 + k) * D + od, mask=md & (p0 + k >= 0), other=0.0).to(tl.float32),
        )
    ws = ()
    for k in tl.static_range(W):
        ws = ws + (tl.load(w + od * W + k, mask=md, other=0.0),)
    t_end = tl.minimum(t0 + CH, T)
    for t in tl.range(t0, t_end, num_stages=NS):
        row = tl.load(x + t * D + od, mask=md, other=0.0).to(tl.float32)
        acc = row * ws[W - 1]
        for k in tl.static_range(W - 1):
            acc += win[k] * ws[k]
        acc = acc / (1.0 + tl.exp(-acc))
        tl.store(o + t * D + od, acc.to(o.dtype.element_ty), mask=md)
        win = win[1:] + (row,)


def run_case(T, W=4, D=8448):
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    w = 0.5 * torch.randn(D, W, device="cuda")
    o = torch.empty_like(x)
    xf = x.float()
    ref = torch.zeros(T, D, device="cuda")
    for k in range(W):
        sh = W - 1 - k
        ref[sh:] += xf[: T - sh] * w[:, k]
    ref = torch.nn.functional.silu(ref)
    nbytes = 2 * x.numel() * 2
    a = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    copy = 2 * a.numel() / cold_us(functools.partial(b.copy_, a)) / 1e3
    del a, b

    def report(name, kernel, grid, args, check=True, **meta):
        launch = functools.partial(kernel[grid], *args, **meta)
        try:
            us = cold_us(launch)
        except Exception as e:  # a strategy that fails to compile is reported, not fatal
            print(f"T={T} {name}: FAILED {type(e).__name__}: {str(e)[:300]}")
            return
        err = (o.float() - ref).abs().max().item() if check else float("nan")
        pct = 100 * nbytes / us / 1e3 / copy
        print(f"T={T} {name:28s} {us:9.1f} us {pct:5.1f}% err={err:.3g}", flush=True)

    for bt, bd, nw in ((32, 128, 4), (64, 128, 8), (32, 256, 8), (16, 512, 8)):
        g = (triton.cdiv(T, bt) * triton.cdiv(D, bd),)
        report(f"copy {bt}x{bd} w{nw}", k_copy, g, (x, o, T, D), False, BT=bt, BD=bd,
               num_warps=nw)  # fmt: skip
        report(f"shift {bt}x{bd} w{nw}", k_shift, g, (x, w, o, T, D), W=W, BT=bt, BD=bd,
               num_warps=nw)  # fmt: skip
    for bt, bd, nw in ((32, 128, 4), (64, 128, 8), (64, 64, 4), (128, 64, 8)):
        g = (triton.cdiv(T, bt - 4) * triton.cdiv(D, bd),)
        report(f"gather {bt}x{bd} w{nw}", k_gather, g, (x, w, o, T, D), W=W, OV=4, BT=bt,
               BD=bd, num_warps=nw)  # fmt: skip
    for ch, bd, nw, ns in ((64, 1024, 4, 1), (64, 1024, 4, 3), (256, 1024, 4, 3),
                           (32, 512, 2, 3), (128, 512, 2, 4), (64, 256, 1, 4),
                           (256, 256, 1, 4)):  # fmt: skip
        g = (triton.cdiv(T, ch) * triton.cdiv(D, bd),)
        report(f"loop ch{ch} {bd} w{nw} s{ns}", k_loop, g, (x, w, o, T, D), W=W, CH=ch,
               BD=bd, NS=ns, num_warps=nw)  # fmt: skip
    print(f"copy {copy:.0f} GB/s")


def main():
    for T in (2048, 131072):
        run_case(T)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
