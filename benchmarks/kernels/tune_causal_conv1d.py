"""Sweep launch configurations of the causal-conv1d kernels on a GPU.

Prints, per case, the cold GPU time of each configuration (L2 flushed, GPU
kept busy with ``torch.cuda._sleep`` so host launch cost is hidden) and checks
every configuration against the fp32 reference first. Used to pick the
heuristics in ``_fwd_config`` / ``_update_config``; the numbers it prints are
exploration, the benchmark of record is ``benchmark_causal_conv1d.py``.

    python benchmarks/kernels/tune_causal_conv1d.py [--quick] [--json PATH]
"""

import argparse
import functools
import itertools
import json

import torch
from benchmark_utils import cold_us, copy_gbps, graph_us, host_us

from vllm.model_executor.layers.mamba.ops import causal_conv1d as cc

DTYPE = torch.bfloat16
WIDTH = 4


def make_fn_case(dim, lens, n_decode=0, init_prefill=False, lines=1024):
    lens = list(lens) + [1] * n_decode
    batch = len(lens)
    qsl_cpu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)
    T = int(qsl_cpu[-1])
    x = torch.randn(T, dim, device="cuda", dtype=DTYPE).t()
    w = (0.5 * torch.randn(dim, WIDTH, device="cuda")).to(DTYPE)
    b = (0.2 * torch.randn(dim, device="cuda")).to(DTYPE)
    states = torch.randn(lines, WIDTH - 1, dim, device="cuda", dtype=DTYPE).transpose(1, 2)
    idx = torch.randperm(lines, device="cuda")[:batch].int()
    init = torch.zeros(batch, dtype=torch.bool, device="cuda")
    init[len(lens) - n_decode :] = True
    if init_prefill:
        init[0] = True
    qsl = qsl_cpu.cuda()
    meta = cc.compute_causal_conv1d_metadata(qsl_cpu, "cuda")
    return dict(x=x, w=w, b=b, states=states, qsl=qsl, idx=idx, init=init, meta=meta, T=T)


def check_fn(c):
    s1, s2 = c["states"].clone(), c["states"].clone()
    o1 = cc.causal_conv1d_fn(c["x"], c["w"], c["b"], s1, c["qsl"], c["idx"], c["init"],
                             metadata=c["meta"])  # fmt: skip
    o2 = cc.causal_conv1d_ref(c["x"], c["w"], c["b"], s2, c["qsl"], c["idx"], c["init"])
    err = (o1.float() - o2.float()).abs()
    tol = 2e-2 + 1e-2 * o2.float().abs()
    ok = bool((err <= tol).all()) and not bool(o1.isnan().any()) and torch.equal(s1, s2)
    return ok, err.max().item()


def run_fn(c):
    return cc.causal_conv1d_fn(c["x"], c["w"], c["b"], c["states"], c["qsl"], c["idx"],
                               c["init"], metadata=c["meta"])  # fmt: skip


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json")
    args = p.parse_args()
    torch.manual_seed(0)
    results = {"copy_gbps": copy_gbps()}
    print(f"device copy: {results['copy_gbps']:.0f} GB/s")

    orig_fwd = cc._fwd_config
    fwd_cases = {
        "T2048x1": ([2048], 0, False),
        "T8192x16": ([512] * 16, 0, False),
        "T131072x1": ([131072], 0, False),
        "T131072x16": ([8192] * 16, 0, False),
        "mix2048+255": ([2048], 255, True),
    }
    if args.quick:
        fwd_cases = {k: fwd_cases[k] for k in ("T2048x1", "T8192x16", "T131072x1", "mix2048+255")}
    configs = [
        dict(
            BLOCK_T=bt,
            BLOCK_G=bg,
            BLOCK_R=br,
            BLOCK_DS=ds,
            BLOCK_D=8 * 32 * nw,
            num_warps=nw,
            DS_STAGES=st,
        )  # fmt: skip
        for bt, bg, br, ds, nw, st in (
            (64, 8, 8, 32, 1, 1),
            (64, 8, 8, 32, 1, 2),
            (32, 8, 8, 32, 1, 1),
            (32, 8, 16, 16, 1, 2),
            (64, 8, 8, 64, 2, 1),
            (128, 8, 8, 32, 1, 2),
            (64, 16, 8, 32, 1, 1),
        )
    ]
    results["fwd"] = {}
    for name, (lens, nd, ip) in fwd_cases.items():
        c = make_fn_case(8448, lens, nd, ip)
        nbytes = 2 * c["T"] * 8448 * 2
        row = {}
        for cfg in configs:

            def patched(num_tokens, dim, width, elem_size, cfg=cfg):
                base = orig_fwd(num_tokens, dim, width, elem_size)
                base.update(cfg)
                return base

            cc._fwd_config = patched
            key = "T{BLOCK_T}_G{BLOCK_G}_R{BLOCK_R}_DS{BLOCK_DS}_s{DS_STAGES}_w{num_warps}".format(
                **cfg
            )
            try:
                ok, err = check_fn(c)
                us = cold_us(lambda c=c: run_fn(c))
            except Exception as e:  # a config that fails to compile is reported, not fatal
                print(f"{name} {key}: FAILED {type(e).__name__}: {e}")
                continue
            row[key] = dict(us=us, ok=ok, err=err, pct=nbytes / us / 1e3 / results["copy_gbps"])
        cc._fwd_config = orig_fwd
        best = sorted(row.items(), key=lambda kv: kv[1]["us"])
        print(f"\n{name}: T={c['T']} bytes={nbytes / 1e6:.1f} MB")
        for key, r in best[:6]:
            print(f"  {key:16s} {r['us']:9.1f} us {100 * r['pct']:5.1f}% ok={r['ok']} "
                  f"maxerr={r['err']:.3g}")  # fmt: skip
        bad = [k for k, r in row.items() if not r["ok"]]
        if bad:
            print(f"  WRONG RESULTS: {bad}")
        default_us = cold_us(lambda c=c: run_fn(c))
        host = host_us(lambda c=c: run_fn(c))
        print(f"  default config: {default_us:.1f} us; host/call {host:.1f} us")
        results["fwd"][name] = row
        del c
        torch.cuda.empty_cache()

    # Decode: one token per sequence, 1024-line pool, CUDA graph.
    orig_upd = cc._update_config
    results["update"] = {}
    for B in (1, 32, 512) if args.quick else (1, 8, 32, 128, 512):
        dim = 8448
        x = torch.randn(B, dim, device="cuda", dtype=DTYPE)
        w = (0.5 * torch.randn(dim, WIDTH, device="cuda")).to(DTYPE)
        b = (0.2 * torch.randn(dim, device="cuda")).to(DTYPE)
        st = torch.randn(1024, WIDTH - 1, dim, device="cuda", dtype=DTYPE).transpose(1, 2)
        idx = torch.randperm(1024, device="cuda")[:B].int()
        s1, s2 = st.clone(), st.clone()
        o1 = cc.causal_conv1d_update(x, s1, w, b, "silu", idx)
        o2 = cc.causal_conv1d_update_ref(x, s2, w, b, "silu", idx)
        ok = torch.equal(s1, s2) and (o1.float() - o2.float()).abs().max().item() < 5e-2
        row = {}
        for bd, nw in itertools.product((32, 64, 128, 256), (1, 4)):

            def patched(batch, dim, block_l, width, bd=bd, nw=nw):
                base = orig_upd(batch, dim, block_l, width)
                base.update(BLOCK_D=bd, num_warps=nw)
                return base

            cc._update_config = patched
            fn = functools.partial(cc.causal_conv1d_update, x, st, w, b, "silu", idx)
            row[f"D{bd}_w{nw}"] = dict(graph=graph_us(fn), cold=cold_us(fn))
        cc._update_config = orig_upd
        fn = functools.partial(cc.causal_conv1d_update, x, st, w, b, "silu", idx)
        default = dict(graph=graph_us(fn), cold=cold_us(fn), host=host_us(fn))
        best = sorted(row.items(), key=lambda kv: kv[1]["graph"])[:4]
        print(f"\ndecode B={B}: ok={ok} default {default}")
        for key, r in best:
            print(f"  {key:10s} graph {r['graph']:7.2f} us cold {r['cold']:7.2f} us")
        results["update"][f"B{B}"] = dict(configs=row, default=default, ok=ok)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
