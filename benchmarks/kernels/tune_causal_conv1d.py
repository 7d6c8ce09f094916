"""Sweep launch configurations of the causal-conv1d kernels on a GPU.

Prints, per case, the cold GPU time of each configuration (L2 flushed, GPU
kept busy with ``torch.cuda._sleep`` so host launch cost is hidden) and checks
every configuration against the fp32 reference first. Used to pick the launch
configurations (``configs/causal_conv1d/*.json``, read by ``causal_conv1d_host``'s
``_fwd_block_t`` / ``_fwd_configs`` / ``_decode_configs``); the numbers it prints are
exploration, the benchmark of record is ``benchmark_causal_conv1d.py``.

    python -m benchmarks.kernels.tune_causal_conv1d [--quick | --small-steps] [--json PATH]
        [--write [PATH]]

``--write`` writes the device's table (or PATH): the current entries, with the decode
kernel's configurations replaced by the fastest correct ones of the sweep (``lone`` from
batches of one or two sequences, ``batch`` from the others, by CUDA-graph time).

``--small-steps`` sweeps a wider grid of forward configurations on steps of 2048 to
32768 tokens only (no decode, host or CUDA parts).
"""

import argparse
import functools
import itertools
import json

import torch

from benchmarks.kernels.benchmark_utils import cold_us, copy_gbps, graph_us, host_us
from vllm.model_executor.layers.mamba.ops import causal_conv1d as cc
from vllm.model_executor.layers.mamba.ops import causal_conv1d_host as host

# The plans read their configurations in causal_conv1d_host, the full path in causal_conv1d:
# a sweep swaps both, and forgets the plans made with the previous configuration.
_CONFIG_NAMES = ("_fwd_config", "_fwd_block_t", "_fwd_configs", "_decode_config", "_decode_configs")


def swap_configs(**functions) -> dict:
    """Replace the named configuration functions in both modules; returns the originals."""
    original = {name: getattr(host, name) for name in _CONFIG_NAMES}
    for name, fn in functions.items():
        setattr(host, name, fn)
        if hasattr(cc, name):
            setattr(cc, name, fn)
    cc.clear_host_caches()
    return original


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
    idx = (1 + torch.randperm(lines - 1, device="cuda")[:batch]).int()
    init = torch.zeros(batch, dtype=torch.bool, device="cuda")
    init[len(lens) - n_decode :] = True
    if init_prefill:
        init[0] = True
    qsl = qsl_cpu.cuda()
    meta = cc.compute_causal_conv1d_metadata(qsl_cpu, "cuda")
    return dict(x=x, w=w, b=b, states=states, qsl=qsl, idx=idx, init=init, meta=meta, T=T,
                qsl_cpu=qsl_cpu)  # fmt: skip


def check_fn(c):
    s1, s2 = c["states"].clone(), c["states"].clone()
    o1 = cc.causal_conv1d_fn(c["x"], c["w"], c["b"], s1, c["qsl"], c["idx"], c["init"],
                             metadata=c["meta"])  # fmt: skip
    o2 = cc.causal_conv1d_ref(c["x"], c["w"], c["b"], s2, c["qsl"], c["idx"], c["init"])
    err = (o1.float() - o2.float()).abs()
    tol = 2e-2 + 1e-2 * o2.float().abs()
    ok = bool((err <= tol).all()) and not bool(o1.isnan().any()) and torch.equal(s1, s2)
    return ok, err.max().item()


def run_fn(c, meta=True):
    return cc.causal_conv1d_fn(c["x"], c["w"], c["b"], c["states"], c["qsl"], c["idx"],
                               c["init"], metadata=c["meta"] if meta else None)  # fmt: skip


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--small-steps", action="store_true", help="wide forward sweep, small steps")
    p.add_argument("--json")
    p.add_argument("--write", nargs="?", const="", default=None, help="write the table")
    args = p.parse_args()
    torch.manual_seed(0)
    results = {"copy_gbps": copy_gbps()}
    print(f"device copy: {results['copy_gbps']:.0f} GB/s")

    original = {name: getattr(host, name) for name in _CONFIG_NAMES}
    fwd_cases = {
        "T2048x1": ([2048], 0, False),
        "T8192x16": ([512] * 16, 0, False),
        "T131072x1": ([131072], 0, False),
        "T131072x16": ([8192] * 16, 0, False),
        "mix2048+255": ([2048], 255, True),
    }
    if args.quick:
        fwd_cases = {k: fwd_cases[k] for k in ("T2048x1", "T8192x16", "T131072x1", "mix2048+255")}
    # (tokens per tile, rows per group, bytes per thread per row, warps, sequences per
    # head program, register cap)
    configs = [
        (32, 8, 8, 1, 1, None), (64, 8, 8, 1, 1, None), (32, 8, 8, 1, 4, None),
        (64, 8, 8, 1, 4, None), (32, 8, 8, 1, 2, None), (32, 8, 4, 1, 4, None),
        (32, 8, 8, 1, 4, 128), (16, 8, 8, 1, 1, None), (32, 16, 8, 1, 1, None),
    ]  # fmt: skip
    if args.small_steps:
        fwd_cases = {
            "T2048x1": ([2048], 0, False),
            "T2048x16": ([128] * 16, 0, False),
            "T8192x16": ([512] * 16, 0, False),
            "T32768x16": ([2048] * 16, 0, False),
        }
        tiles = ((16, 8), (16, 16), (32, 4), (32, 8), (32, 16), (64, 8))
        configs = [
            (bt, bg, vec, nw, 1, maxr)
            for (bt, bg), vec, nw, maxr in itertools.product(tiles, (4, 8, 16), (1, 2), (None, 80))
        ]
    results["fwd"] = {}
    for name, (lens, nd, ip) in fwd_cases.items():
        c = make_fn_case(8448, lens, nd, ip)
        nbytes = 2 * c["T"] * 8448 * 2
        row = {}
        for bt, bg, vec, nw, hs, maxr in configs:
            cfg = dict(BLOCK_G=bg, BLOCK_D=vec // 2 * 32 * nw, HEAD_S=hs, num_warps=nw)
            if maxr:
                cfg["maxnreg"] = maxr
            swap_configs(
                _fwd_config=lambda *a, cfg=cfg: dict(cfg),
                _fwd_configs=lambda es, cfg=cfg: {n: cfg for n in ("small_step", "tiles",
                                                                     "many_heads")},
                _fwd_block_t=lambda n, bt=bt: bt,
            )  # fmt: skip
            c["meta"] = cc.compute_causal_conv1d_metadata(c["qsl_cpu"], "cuda")
            key = f"T{bt}_G{bg}_V{vec}_w{nw}_S{hs}" + (f"_r{maxr}" if maxr else "")
            try:
                ok, err = check_fn(c)
                us = cold_us(lambda c=c: run_fn(c))
            except Exception as e:  # a config that fails to compile is reported, not fatal
                print(f"{name} {key}: FAILED {type(e).__name__}: {e}")
                continue
            row[key] = dict(us=us, ok=ok, err=err, pct=nbytes / us / 1e3 / results["copy_gbps"])
        swap_configs(**original)
        c["meta"] = cc.compute_causal_conv1d_metadata(c["qsl_cpu"], "cuda")
        best = sorted(row.items(), key=lambda kv: kv[1]["us"])
        print(f"\n{name}: T={c['T']} bytes={nbytes / 1e6:.1f} MB")
        for key, r in best:
            print(f"  {key:16s} {r['us']:9.1f} us {100 * r['pct']:5.1f}% ok={r['ok']} "
                  f"maxerr={r['err']:.3g}")  # fmt: skip
        bad = [k for k, r in row.items() if not r["ok"]]
        if bad:
            print(f"  WRONG RESULTS: {bad}")
        default_us = cold_us(lambda c=c: run_fn(c))
        nometa_us = cold_us(lambda c=c: run_fn(c, meta=False))
        print(f"  default config: {default_us:.1f} us (no metadata {nometa_us:.1f} us)")
        results["fwd"][name] = row
        del c
        torch.cuda.empty_cache()

    if args.small_steps:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return

    # Host cost of one eager call, and where it goes (a 16-token step: GPU time is small).
    c = make_fn_case(8448, [8], 8, True)
    parts = {
        "fn_with_metadata": lambda: run_fn(c),
        "fn_without_metadata": lambda: run_fn(c, meta=False),
        "fwd_impl_only": lambda: cc._fwd_impl(
            c["x"], c["w"], c["b"], c["states"], c["qsl"], c["idx"], c["init"], True,
            cc.PAD_SLOT_ID, c["meta"].tile_seq, c["meta"].block_t),
        "torch_empty_only": lambda: torch.empty(16, 8448, dtype=DTYPE, device="cuda"),
    }  # fmt: skip
    xd = torch.randn(8, 8448, device="cuda", dtype=DTYPE)
    idx8 = c["idx"][:8].contiguous()
    parts["update_decode"] = lambda: cc.causal_conv1d_update(
        xd, c["states"], c["w"], c["b"], "silu", idx8
    )
    parts["decode_impl_only"] = lambda: cc._decode(
        xd, c["states"], c["w"], c["b"], True, idx8, cc.PAD_SLOT_ID
    )
    results["host"] = {k: host_us(f) for k, f in parts.items()}
    print("\nhost us per eager call:", {k: round(v, 1) for k, v in results["host"].items()})

    # Decode: one token per sequence, 1024-line pool, CUDA graph.
    orig_dec = original["_decode_config"]
    results["update"] = {}
    for B in (1, 32, 512) if args.quick else (1, 8, 32, 128, 256, 512):
        dim = 8448
        x = torch.randn(B, dim, device="cuda", dtype=DTYPE)
        w = (0.5 * torch.randn(dim, WIDTH, device="cuda")).to(DTYPE)
        b = (0.2 * torch.randn(dim, device="cuda")).to(DTYPE)
        st = torch.randn(1024, WIDTH - 1, dim, device="cuda", dtype=DTYPE).transpose(1, 2)
        idx = (1 + torch.randperm(1023, device="cuda")[:B]).int()
        row = {}
        pairs = itertools.product((64, 128, 256, 512, 1024), (1, 2, 4))
        dec_configs = [(bd, nw) for bd, nw in pairs if bd >= 32 * nw]
        if args.quick:
            dec_configs = [(64, 1), (128, 2), (256, 4), (256, 2), (512, 4)]
        for bd, nw in dec_configs:
            cfg = dict(BLOCK_D=bd, num_warps=nw)
            swap_configs(
                _decode_config=lambda *a, cfg=cfg: dict(cfg),
                _decode_configs=lambda es, cfg=cfg: {"lone": cfg, "batch": cfg},
            )
            s1, s2 = st.clone(), st.clone()
            o1 = cc.causal_conv1d_update(x, s1, w, b, "silu", idx)
            o2 = cc.causal_conv1d_update_ref(x, s2, w, b, "silu", idx)
            ok = torch.equal(s1, s2) and (o1.float() - o2.float()).abs().max().item() < 5e-2
            fn = functools.partial(cc.causal_conv1d_update, x, st, w, b, "silu", idx)
            row[f"D{bd}_w{nw}"] = dict(graph=graph_us(fn), cold=cold_us(fn), ok=ok)
        swap_configs(**original)
        fn = functools.partial(cc.causal_conv1d_update, x, st, w, b, "silu", idx)
        default = dict(graph=graph_us(fn), cold=cold_us(fn), host=host_us(fn),
                       cfg=orig_dec(B, dim, 2))  # fmt: skip
        best = sorted(row.items(), key=lambda kv: kv[1]["graph"])
        print(f"\ndecode B={B}: default {default}")
        for key, r in best[:6]:
            print(f"  {key:10s} graph {r['graph']:7.2f} us cold {r['cold']:7.2f} us ok={r['ok']}")
        bad = [k for k, r in row.items() if not r["ok"]]
        if bad:
            print(f"  WRONG RESULTS: {bad}")
        results["update"][f"B{B}"] = dict(configs=row, default=default)
    # The CUDA pathway's forward: 16- vs 4-byte rows (vllm/_custom_ops.py chooses).
    from vllm import _custom_ops as cuda_ops

    if cuda_ops.cuda_ops_available():
        results["cuda_row_bytes"] = {}
        for name, lens in (("T2048x16", [128] * 16), ("T8192x16", [512] * 16),
                           ("T32768x16", [2048] * 16), ("T131072x16", [8192] * 16),
                           ("T8192x64", [128] * 64)):  # fmt: skip
            c = make_fn_case(8448, lens)
            pool = torch.empty(1024, 8448, WIDTH - 1, device="cuda", dtype=DTYPE)
            row = {}
            for rb in (0, 4, 8, 16):
                fn = functools.partial(
                    cuda_ops.causal_conv1d_fwd_cuda, c["x"], c["w"], c["b"], pool, c["qsl"],
                    c["idx"], c["init"], True, cc.PAD_SLOT_ID, row_bytes=rb,
                )  # fmt: skip
                row[rb] = cold_us(fn)
            print(f"cuda fwd {name}: " + ", ".join(f"rows {k}: {v:.1f} us" for k, v in row.items()))
            results["cuda_row_bytes"][name] = row
            del c

    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.write is not None:
        write_table(args, results["update"])


def write_table(args, update: dict) -> None:
    """The current entries, with the decode configurations the sweep found fastest."""
    import sys
    from datetime import datetime, timezone
    from pathlib import Path

    from benchmarks.common.run_info import git_sha
    from vllm.triton_utils import configs as tables

    def best(batches):
        totals: dict = {}
        for b in batches:
            for key, r in update[b]["configs"].items():
                if r["ok"] and totals.get(key, 0.0) != float("inf"):
                    totals[key] = totals.get(key, 0.0) + r["graph"]
                else:
                    totals[key] = float("inf")
        key = min(totals, key=totals.get)
        bd, nw = key[1:].split("_w")
        return dict(BLOCK_D=int(bd), num_warps=int(nw))

    key = tables.table_key(elem_size=torch.empty(0, dtype=DTYPE).element_size())
    entry = tables.lookup(host.CONFIG_FOLDER, key)
    lone = [b for b in update if int(b[1:]) <= 2]
    entry["decode"] = dict(entry["decode"], batch=best([b for b in update if b not in lone]))
    if lone:
        entry["decode"]["lone"] = best(lone)
    path = Path(args.write or host.CONFIG_FOLDER / f"{tables.device_file_name()}.json")
    old = json.loads(path.read_text())["entries"] if path.is_file() else {}
    entries = dict(old, **{key: entry, "tiles": tables.lookup(host.CONFIG_FOLDER, "tiles")})
    meta = dict(
        command="python -m benchmarks.kernels.tune_causal_conv1d " + " ".join(sys.argv[1:]),
        commit=git_sha(),
        device=torch.cuda.get_device_name(),
        date_utc=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
    )
    tables.write_table(path, entries, meta)
    print(f"wrote {path} [{key}]: {entry}")


if __name__ == "__main__":
    main()
