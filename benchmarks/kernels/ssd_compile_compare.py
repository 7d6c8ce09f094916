"""Compile our SSD's three launches and upstream vLLM 0.33.0's five SSD kernels for sm_90 on a
machine without a GPU, and compare what the compiler made of each.

    python -m benchmarks.kernels.ssd_compile_compare [--shapes codestral,granite]
        [--set chunk_state.KEY=VALUE ...] [--no-upstream] [--json PATH]

Ours: the launches ``ssd_compile_report.record_launches`` records at the configuration
``ssd_configs`` gives (the device table for sm_90 is NVIDIA_H200.json where it has the
shape, else default.json; ``--set`` changes it). Upstream (``.upstream`` on PYTHONPATH,
docs/gpu_box.md): its ``mamba_chunk_scan_combined_varlen`` is called on CPU tensors of a
1 x T step as its Mamba2 mixer calls it, with ``launch_autotuned`` replaced by a recorder,
and each recorded kernel is compiled at EVERY config of its autotune list (the autotuner
picks by timing at run time; its chunk scan list is already cut by its own
``_drop_racy_wgmma_configs`` for sm_90). Both sides get a Codestral bf16 launch's
specialisations (16-byte aligned pointers, ints equal to 1 or divisible by 16).

Per kernel and config: ``dot`` (wgmma or mma.sync; ``rs`` = wgmma whose A operand comes from
registers, ``n`` = the wgmma N sizes), registers, spill bytes, shared memory, ``bufs`` (the
deepest shared-memory ring in the TTGIR: pipelined loads when > 1), ``pend`` (the largest
``warp_group_dot_wait`` pendings: 0 = every wgmma is waited for in its own trip), and per
trip of the main loop (the loop with the most MMA instructions; the largest loop without
any) the SASS instructions, MMAs, ex2 (MUFU.EX2), conversions (F2F/F2FP/I2F), barriers,
global loads (LDG + LDGSTS) and integer/predicate instructions; ``sass`` all instructions;
``programs`` the grid at 1 x T. Nothing runs on a GPU.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import os
import re
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile the real kernels

import torch

from benchmarks.kernels.moe_compile_report import INT_OPS, ptxas_usage
from benchmarks.kernels.sm90_compile import compile_sm90, sass_loops, sass_opcode
from benchmarks.kernels.ssd_compile_report import SHAPES, record_launches

OURS = {"_ssd_chunk_state_kernel": "chunk state", "_ssd_state_passing_kernel": "passing+CB",
        "_ssd_chunk_scan_kernel": "chunk scan"}  # fmt: skip
UPSTREAM = {"_chunk_cumsum_fwd_kernel": "cumsum", "_chunk_state_fwd_kernel": "chunk state",
            "_state_passing_fwd_kernel": "passing", "_bmm_chunk_fwd_kernel": "bmm (CB)",
            "_chunk_scan_fwd_kernel": "chunk scan"}  # fmt: skip
CVT = ("F2F", "F2FP", "I2F", "F2I", "I2FP", "F2IP")


def sass_counts(cubin: bytes) -> tuple[int, list[collections.Counter]]:
    """(all SASS instructions, the op counts of every loop: a back branch's region)."""
    lines, loops = sass_loops(cubin)
    return sum(sass_opcode(ln) is not None for ln in lines), [ops for ops, _ in loops]


def main_loop(loops: list[collections.Counter]) -> collections.Counter:
    mma = lambda c: c["HGMMA"] + c["HMMA"]  # noqa: E731
    if not loops:
        return collections.Counter()
    return max(loops, key=lambda c: (mma(c), sum(c.values())))


def inspect(compiled) -> dict:
    ptx, ttgir = compiled.asm["ptx"], compiled.asm["ttgir"]
    wgmma = re.findall(r"\bwgmma\.mma_async\.[^;]*;", ptx, flags=re.S)
    mma = len(re.findall(r"\bmma\.sync", ptx))
    bufs = [int(n) for n in re.findall(r"ttg\.local_alloc\s*:.*?memdesc<(\d+)x\d+x\d+x", ttgir)]
    pend = [int(n) for n in re.findall(r"warp_group_dot_wait.*?pendings\s*=\s*(\d+)", ttgir)]
    total, loops = sass_counts(compiled.asm["cubin"])
    best = main_loop(loops)
    return dict(
        **ptxas_usage(ptx),
        shared=compiled.metadata.shared,
        dot="wgmma" if wgmma else ("mma.sync" if mma else "none"),
        rs=sum(bool(re.search(r"\},\s*\{", w)) for w in wgmma),
        wgmma_n=sorted({int(n) for n in re.findall(r"\.m64n(\d+)k", " ".join(wgmma))}),
        cp_async=len(re.findall(r"\bcp\.async\.c[ag]\.shared", ptx)),
        bufs=max(bufs, default=1),
        pend=max(pend, default=0),
        sass=total,
        loops=[
            dict(
                instrs=sum(c.values()),
                mma=c["HGMMA"] + c["HMMA"],
                ex2=c["MUFU"],
                gld=c["LDG"] + c["LDGSTS"],
                bar=c["BAR"],
                shfl=c["SHFL"],
            )
            for c in loops
        ],
        loop=sum(best.values()),
        mma=best["HGMMA"] + best["HMMA"],
        ex2=best["MUFU"],
        cvt=sum(best[o] for o in CVT),
        bar=best["BAR"] + best["WARPGROUP"] + best["DEPBAR"] + best["WARPSYNC"],
        gld=best["LDG"] + best["LDGSTS"],
        shfl=best["SHFL"],
        int=sum(best[o] for o in INT_OPS),
    )


def tile_of(constexprs: dict) -> str:
    """The launch's tile and schedule, short: ``M 64, K 32, w 4, s 1, SPLIT 0``."""
    keep = (
        "BLOCK",
        "num_warps",
        "num_stages",
        "maxnreg",
        "SPLIT",
        "RELOAD",
        "FUSED",
        "FOLD",
        "PREFETCH",
        "HEADS",
    )
    short = {"num_warps": "w", "num_stages": "s", "BLOCK_SIZE_": "", "BLOCK_": ""}
    out = []
    for k, v in constexprs.items():
        if v is None:  # an option left to the compiler (maxnreg None: no cap)
            continue
        if k.startswith(keep) and k not in ("BLOCK_SIZE_CHUNK", "BLOCK_SIZE_DSTATE"):
            for a, b in short.items():
                k = k.replace(a, b)
            out.append(f"{k} {int(v)}")
    return ", ".join(out)


def lookup_as(stem: str):
    """``configs.lookup_first`` as on a device whose table file is ``stem``.json."""
    from vllm.triton_utils import configs

    def lookup_first(folder, keys, device=None):
        for k in (*keys, configs.WILDCARD):
            for name in (stem, configs.DEFAULT):
                entries = configs._read(Path(folder) / f"{name}.json")
                if k in entries:
                    return copy.deepcopy(entries[k])
        raise KeyError(f"no launch configuration for {keys!r} in {folder}")

    return lookup_first


def describe(kernel, args, constexprs) -> dict:
    try:
        compiled = compile_sm90(kernel, args, constexprs)
    except Exception as err:  # a config that does not compile is the finding
        return dict(config=tile_of(constexprs), error=f"{type(err).__name__}: {str(err)[:200]}")
    return dict(config=tile_of(constexprs), **inspect(compiled))


def ours(shape_name: str, tokens: int, changes: dict, device: str) -> list[dict]:
    from vllm.model_executor.layers.mamba.ops.ssd_chunk_scan import chunk_scan_programs
    from vllm.model_executor.layers.mamba.ops.ssd_chunk_state import chunk_state_programs
    from vllm.model_executor.layers.mamba.ops.ssd_state_passing import state_passing_programs
    from vllm.triton_utils import configs

    s = SHAPES[shape_name]
    H, P, N, G, L = (s[k] for k in ("nheads", "headdim", "dstate", "ngroups", "chunk"))
    chunks = -(-tokens // L)
    real, configs.lookup_first = configs.lookup_first, lookup_as(device)
    try:
        launches = record_launches(s, torch.bfloat16, torch.bfloat16, changes)
    finally:
        configs.lookup_first = real
    rows = []
    for launcher, args, constexprs in launches:
        name = OURS[launcher.kernel.fn.__name__]
        if name == "chunk state":
            programs = chunk_state_programs(chunks, H, P, N, constexprs)
        elif name == "chunk scan":
            programs = chunk_scan_programs(chunks, H, P, L, constexprs)
        else:
            programs = "+".join(
                map(str, state_passing_programs(1, chunks, H, P, N, G, L, constexprs))
            )
        rows.append(dict(shape=shape_name, who="ours", kernel=name, programs=programs,
                         **describe(launcher.kernel, args, constexprs)))  # fmt: skip
    return rows


def upstream_module():
    try:
        from upstream_vllm033.ops import ssd_combined
    except Exception as err:  # noqa: BLE001 - any import failure skips upstream
        return None, f"{type(err).__name__}: {err}"
    return ssd_combined, None


def record_upstream(up, shape_name: str, tokens: int) -> list[tuple]:
    """[(autotuned kernel, grid, kwargs)] of upstream's call on a 1 x ``tokens`` step."""
    s = SHAPES[shape_name]
    H, P, N, G, L = (s[k] for k in ("nheads", "headdim", "dstate", "ngroups", "chunk"))
    bf = torch.bfloat16
    x, dt = torch.empty(tokens, H, P, dtype=bf), torch.empty(tokens, H, dtype=bf)
    B, C = torch.empty(tokens, G, N, dtype=bf), torch.empty(tokens, G, N, dtype=bf)
    chunks = -(-tokens // L)
    cu_chunk = torch.tensor([min(i * L, tokens) for i in range(chunks + 1)], dtype=torch.int32)
    pool = torch.empty(9, H, P, N)
    caught = []
    mods = [sys.modules[f"upstream_vllm033.ops.{m}"] for m in
            ("ssd_chunk_state", "ssd_bmm", "ssd_state_passing", "ssd_chunk_scan")]  # fmt: skip
    real = [m.launch_autotuned for m in mods]
    for m in mods:
        m.launch_autotuned = lambda kernel, grid, **kw: caught.append((kernel, grid, kw))
    try:
        up.mamba_chunk_scan_combined_varlen(
            x, dt, -torch.rand(H), B, C, L, cu_seqlens=torch.tensor([0, tokens], dtype=torch.int32),
            cu_chunk_seqlens=cu_chunk, last_chunk_indices=torch.tensor([chunks - 1]),
            seq_idx=torch.zeros(chunks, dtype=torch.int32), out=torch.empty_like(x),
            initial_states=None, state_dtype=torch.float32, final_states_out=pool,
            final_state_indices=torch.tensor([1], dtype=torch.int32), D=torch.randn(H),
            dt_bias=torch.randn(H), dt_softplus=True,
        )  # fmt: skip
    except Exception:  # noqa: BLE001 - only the launches matter; CPU glue after them may fail
        if len(caught) < 5:
            raise
    finally:
        for m, r in zip(mods, real, strict=True):
            m.launch_autotuned = r
    return caught


def upstream(up, shape_name: str, tokens: int) -> list[dict]:
    rows = []
    for kernel, grid, kwargs in record_upstream(up, shape_name, tokens):
        name = UPSTREAM[kernel.fn.__name__]
        for i, cfg in enumerate(kernel.configs):
            constexprs = dict(kwargs, **cfg.all_kwargs())
            g = grid(constexprs) if callable(grid) else grid
            programs = 1
            for d in g:
                programs *= d
            rows.append(dict(shape=shape_name, who="upstream", kernel=name, cfg_index=i,
                             programs=programs, **describe(kernel.fn, (), constexprs)))  # fmt: skip
    return rows


def markdown(rows: list[dict]) -> str:
    cols = ("shape", "who", "kernel", "config", "programs", "dot", "wgmma_n", "rs", "regs",
            "spill", "shared KiB", "bufs", "pend", "loop", "mma", "ex2", "cvt", "bar", "gld",
            "int", "sass")  # fmt: skip
    out = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['shape']} | {r['who']} | {r['kernel']} | {r['config']} | "
                       f"FAILED: {r['error']} |")  # fmt: skip
            continue
        r = dict(r, spill=r["spill_st"] + r["spill_ld"], **{"shared KiB": r["shared"] // 1024})
        r["wgmma_n"] = "/".join(map(str, r["wgmma_n"])) or "-"
        out.append("| " + " | ".join(str(r[c]) for c in cols) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="codestral,granite")
    p.add_argument("--tokens", type=int, default=8192, help="the step's tokens (grid sizes)")
    p.add_argument("--set", nargs="*", default=[], help="kernel.KEY=VALUE changes of ours")
    p.add_argument("--device", default="NVIDIA_H200", help="our launch table's device file")
    p.add_argument("--no-upstream", action="store_true")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    changes = {}
    for item in args.set:
        key, value = item.split("=", 1)
        changes[key] = json.loads(value) if value not in ("True", "False") else value == "True"
    up, why = (None, "--no-upstream") if args.no_upstream else upstream_module()
    if up is None and not args.no_upstream:
        print(f"upstream skipped: {why}", file=sys.stderr)
    rows = []
    for name in args.shapes.split(","):
        rows += ours(name, args.tokens, changes, args.device)
        if up is not None:
            rows += upstream(up, name, args.tokens)
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
