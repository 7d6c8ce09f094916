"""What bounds the four small causal-conv1d steps still behind target (issue 14, item 3).

    python -m benchmarks.kernels.conv1d_bounds [--out F.json] [--md F.md] [--reps N] [--smoke]

Cases as benchmark_causal_conv1d.py builds them (bf16, width 4, SiLU, bias, dim 8448, a
1024-line pool, sequences on shuffled lines, the step's metadata passed): prefill 8192 x16
and 2048 x1, one ``causal_conv1d_fn`` call on 2048 prefill tokens + 255 decodes, and the
decode of one sequence. Each is timed cold (L2 flushed, host hidden) and in a CUDA graph
(benchmark_utils.py), next to floors that each isolate one cost:

- bandwidth: the bytes the op must move / the 4 GiB device copy's GB/s (copy_gbps);
- torch copy: ``dst.copy_(src)`` of half those bytes (read + write = the op's bytes): the
  copy floor at this size, ramp-up and tail included;
- grid copy: a Triton kernel with the op's grid, warps, register cap and tile shape (from
  the op's own config functions) that loads the tile and its W-1 halo rows and stores them
  to out, and whose heads move the state lines; no arithmetic, no metadata loads;
- no metadata: the op's arithmetic (its own ``_fwd_piece``; for decode its own kernel with
  ``HAS_INDICES=False``) with sequence bounds and lines computed from constants instead of
  the dependent loads of tile_seq / query_start_loc / cache_indices / has_initial_state;
- empty: an empty kernel on the same grid: launch and scheduling;
- decode only: index -> store, and index -> state row -> store (one and two dependent
  memory latencies), and the op's kernel launched directly (the op's own path, as control).

Every kernel is checked before it is timed: the copies' outputs equal their inputs and
their state lines the op's; the no-metadata variants' outputs and lines equal the op's,
bit for bit. Writes JSON (--out) and markdown (--md; conv1d_bounds_report.py): GPU,
versions, git sha, programs vs SMs. The floors' kernels are in conv1d_bounds_kernels.py.
``--smoke``: tiny shapes, the checks only (the CPU test, TRITON_INTERPRET=1).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
from pathlib import Path

import torch
import triton

from benchmarks.common.run_info import git_sha
from benchmarks.kernels.benchmark_utils import ColdTimer, copy_gbps, graph_samples, summarize
from benchmarks.kernels.conv1d_bounds_kernels import (
    _chain_kernel,
    _decode_copy_kernel,
    _empty_kernel,
    _fwd_no_metadata_kernel,
    _grid_copy_kernel,
)
from benchmarks.kernels.conv1d_bounds_report import (
    LOWER_BOUNDS,
    ROWS,
    kernel_info,
    markdown,
    primary,
)
from vllm.model_executor.layers.mamba.ops import causal_conv1d as conv

REPO = Path(__file__).resolve().parents[2]

W = 4
PAD = conv.PAD_SLOT_ID
# name: (kind, sequence lengths, has initial state, target us); smoke: tiny, same configs
CASES = {
    "prefill_8192x16": ("prefill", [512] * 16, False, 75.0),
    "prefill_2048x1": ("prefill", [2048], False, 22.0),
    "mixed_2048+255": ("mixed", [2048] + [1] * 255, True, 30.0),
    "decode_B1": ("decode", [1], True, 1.5),
}
SMOKE_CASES = {
    "prefill_256x2": ("prefill", [128] * 2, False, None),
    "prefill_128x1": ("prefill", [128], False, None),
    "mixed_64+31": ("mixed", [64] + [1] * 31, True, None),
    "decode_B1": ("decode", [1], True, None),
}


# --------------------------------------------------------------------------
# Cases: inputs, launches, checks
# --------------------------------------------------------------------------


def bytes_moved(lens, init, dim, es) -> int:
    """benchmark_causal_conv1d.Case.bytes_moved: x read, out written, weight, bias, states
    read where initial and written."""
    states = (len(lens) * init + len(lens)) * dim * (W - 1)
    return es * (2 * sum(lens) * dim + dim * (W + 1) + states)


class Step:
    """One case's inputs (as benchmark_causal_conv1d.build_inputs makes them) and runners."""

    def __init__(self, kind, lens, init, dim, dtype, device, lines, seed):
        g = torch.Generator(device=device).manual_seed(seed)
        self.kind, self.lens, self.init, self.dim, self.batch = kind, lens, init, dim, len(lens)
        self.tokens = sum(lens)
        self.x = torch.randn(self.tokens, dim, device=device, generator=g).to(dtype).t()
        self.weight = (0.5 * torch.randn(dim, W, device=device, generator=g)).to(dtype)
        self.bias = (0.2 * torch.randn(dim, device=device, generator=g)).to(dtype)
        pool = torch.randn(lines, dim, W - 1, device=device, generator=g).to(dtype)
        self.pool = pool.transpose(1, 2).contiguous().transpose(1, 2)  # feature-contiguous
        perm = 1 + torch.randperm(lines - 1, device=device, generator=g)[: self.batch]
        self.idx = perm.to(torch.int32)
        qsl_cpu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        self.qsl = qsl_cpu.to(device)
        self.has_init = torch.full((self.batch,), init, dtype=torch.bool, device=device)
        es = self.x.element_size()
        if kind == "decode":
            self.cfg = dict(conv._decode_config(self.batch, dim, es))
            self.grid = (self.batch, triton.cdiv(dim, self.cfg["BLOCK_D"]))
            self.meta = None
        else:
            self.meta = conv.compute_causal_conv1d_metadata(qsl_cpu, device)
            name = conv._fwd_config_name(self.tokens, self.batch)
            block_t = conv._fwd_block_t(self.tokens)
            self.cfg = {"name": name, "BLOCK_T": block_t, **conv._fwd_config(
                self.tokens, dim, W, es, self.batch)}  # fmt: skip
            self.n_tiles = triton.cdiv(self.tokens, block_t)
            n_heads = triton.cdiv(self.batch, self.cfg["HEAD_S"])
            self.grid = ((self.n_tiles + n_heads) * triton.cdiv(dim, self.cfg["BLOCK_D"]),)
        self.options = {k: self.cfg[k] for k in ("num_warps", "maxnreg") if k in self.cfg}
        self.tiles = {k: v for k, v in self.cfg.items() if k.startswith("BLOCK_") or k == "HEAD_S"}
        self.first = lens[0]
        self.rest = lens[1] if self.batch > 1 else 1
        self.bytes = bytes_moved(lens, init, dim, es)
        self.compiled = {}

    def local_pool(self):
        """A pool whose line s holds what sequence s's line holds (the variants use line s)."""
        pool = self.pool.clone()
        pool[: self.batch] = self.pool[self.idx.long()]
        return pool

    def op(self, pool):
        if self.kind == "decode":
            return conv.causal_conv1d_update(self.x.t(), pool, self.weight, self.bias, "silu",
                                             self.idx)  # fmt: skip
        return conv.causal_conv1d_fn(self.x, self.weight, self.bias, pool, self.qsl, self.idx,
                                     self.has_init, "silu", metadata=self.meta)  # fmt: skip

    def _launch(self, name, kernel, grid, *args, **constexprs):
        compiled = kernel[grid](*args, **constexprs)
        self.compiled.setdefault(name, compiled)

    def empty(self):
        self._launch("empty", _empty_kernel, self.grid, self.x, **self.options)

    def grid_copy(self, pool, out, sel=0):
        s = pool.stride()
        self._launch("grid_copy", _grid_copy_kernel, self.grid, self.x, pool, out, self.tokens,
                     self.n_tiles, self.dim, self.batch, self.first, self.rest, int(self.init),
                     self.x.stride(1), s[0], s[2], out.stride(1), sel, KERNEL_WIDTH=W,
                     **self.tiles, **self.options)  # fmt: skip

    def no_metadata(self, pool, out):
        s = pool.stride()
        self._launch("no_metadata", _fwd_no_metadata_kernel, self.grid, self.x, self.weight,
                     self.bias, pool, out, self.tokens, self.n_tiles, self.dim, self.batch,
                     self.first, self.rest, int(self.init), self.x.stride(1),
                     self.weight.stride(0), s[0], s[2], out.stride(1), KERNEL_WIDTH=W,
                     HAS_BIAS=True, SILU=True, **self.tiles, **self.options)  # fmt: skip

    def decode_kernel(self, name, pool, out, indices):
        x, s = self.x.t(), pool.stride()
        self._launch(name, conv._causal_conv1d_decode_kernel, self.grid, x, self.weight,
                     self.bias, pool, indices, out, self.dim, PAD, x.stride(0),
                     self.weight.stride(0), s[0], s[1], s[2], out.stride(0), KERNEL_WIDTH=W,
                     HAS_BIAS=True, SILU=True, HAS_INDICES=indices is not None,
                     STATE_D_CONTIG=True, **self.tiles, **self.options)  # fmt: skip

    def decode_copy(self, pool, out):
        x, s = self.x.t(), pool.stride()
        self._launch("grid_copy", _decode_copy_kernel, self.grid, x, pool, out, self.dim,
                     x.stride(0), s[0], s[2], out.stride(0), 0, KERNEL_WIDTH=W, **self.tiles,
                     **self.options)  # fmt: skip

    def chain(self, depth, out):
        name = ("chain_index", "chain_index_state")[depth - 1]
        self._launch(name, _chain_kernel, self.grid, self.idx, self.pool, out, self.dim,
                     self.pool.stride(0), DEPTH=depth, **self.tiles, **self.options)  # fmt: skip


def _close(out, ref) -> bool:
    """Within the main benchmark's tolerance of the op's output (bit-exact is expected: the
    same arithmetic; lines and copies are compared exactly)."""
    out, ref = out.float(), ref.float()
    return bool(((out - ref).abs() <= 2e-2 + 1e-2 * ref.abs()).all())


def build_runs(st: Step) -> tuple[dict, dict]:
    """(name -> zero-argument call to time, name -> check passed), each kernel run and
    checked once on fresh data first."""
    op_pool = st.pool.clone()
    ref_out = st.op(op_pool)
    ref_lines = op_pool[st.idx.long()]
    compiled = op_compiled(st)
    if compiled is not None and "maxnreg" not in st.options:
        # The variants get the op's register budget, so occupancy does not differ from it
        # (uncapped, the no-metadata mixed kernel takes 193 registers to the op's 168).
        st.options["maxnreg"] = compiled.n_regs
    checks, runs = {}, {}

    def same_lines(pool):
        return torch.equal(pool[: st.batch], ref_lines)

    pool = st.pool.clone()
    runs["op"] = lambda: st.op(pool)
    if st.kind == "decode":
        out_like = torch.empty_like(ref_out)
        for name, indices in (("op_direct", st.idx), ("no_metadata", None)):
            p, o = st.pool.clone() if indices is not None else st.local_pool(), out_like.clone()
            st.decode_kernel(name, p, o, indices)
            lines = p[st.idx.long()] if indices is not None else p[: st.batch]
            checks[name] = _close(o, ref_out) and torch.equal(lines, ref_lines)
            runs[name] = lambda p=p, o=o, n=name, i=indices: st.decode_kernel(n, p, o, i)
        p, o = st.local_pool(), out_like.clone()
        st.decode_copy(p, o)
        checks["grid_copy"] = torch.equal(o, st.x.t()) and same_lines(p)
        runs["grid_copy"] = lambda: st.decode_copy(p, o)
        o1 = torch.empty(st.batch, st.dim, dtype=torch.int32, device=st.x.device)
        o2 = torch.empty_like(ref_out)
        st.chain(1, o1)
        st.chain(2, o2)
        checks["chain_index"] = bool((o1 == st.idx[:, None]).all())
        checks["chain_index_state"] = torch.equal(o2, st.pool[st.idx.long(), :, 0])
        runs["chain_index"] = lambda: st.chain(1, o1)
        runs["chain_index_state"] = lambda: st.chain(2, o2)
    else:
        for name, fn in (("grid_copy", st.grid_copy), ("no_metadata", st.no_metadata)):
            p, o = st.local_pool(), torch.empty_like(ref_out)
            fn(p, o)
            same = torch.equal(o, st.x) if name == "grid_copy" else _close(o, ref_out)
            checks[name] = same and same_lines(p)
            runs[name] = lambda fn=fn, p=p, o=o: fn(p, o)
    runs["empty"] = st.empty
    st.empty()
    half = st.bytes // 2
    src = torch.empty(half, dtype=torch.uint8, device=st.x.device)
    dst = torch.empty_like(src)
    runs["torch_copy"] = lambda: dst.copy_(src)
    return runs, checks


def op_compiled(st: Step):
    """The op's compiled kernel for this case, from its launcher's cache (None: interpreter)."""
    launcher = conv._LAUNCH_DECODE if st.kind == "decode" else conv._LAUNCH_FWD
    want = {k: v for k, v in st.cfg.items() if k != "name"}
    for key, (compiled, _) in launcher.cache.items():
        if all(dict(key[2]).get(k) == v for k, v in want.items()):
            return compiled
    return None


# --------------------------------------------------------------------------
# Measuring (the report: conv1d_bounds_report.py)
# --------------------------------------------------------------------------


def _stats(samples) -> dict:
    med, lo, hi = summarize(samples)
    return {"median": med, "p20": lo, "p80": hi}


def measure_case(name, spec, dim, dtype, device, lines, seed, timer, copy, reps) -> dict:
    kind, lens, init, target = spec
    st = Step(kind, lens, init, dim, dtype, device, lines, seed)
    runs, checks = build_runs(st)
    for key in [k for k, ok in checks.items() if not ok]:  # reported, not timed
        print(f"{name}: {key} FAILED its check; not timed", flush=True)
        del runs[key]
    sms = torch.cuda.get_device_properties(device).multi_processor_count if timer else 132
    programs = st.grid[0] * (st.grid[1] if len(st.grid) > 1 else 1)
    warps = st.cfg["num_warps"]
    res = {
        "kind": kind, "target_us": target, "dim": dim, "dtype": str(dtype).split(".")[-1],
        "tokens": st.tokens, "seqs": st.batch, "bytes": st.bytes, "config": st.cfg,
        "grid": list(st.grid), "programs": programs, "sms": sms,
        "programs_per_sm": programs / sms, "timer": "graph" if kind == "decode" else "cold",
        "kernels": {k: kernel_info(c, warps, sms, programs) for k, c in
                    [("op", op_compiled(st)), *st.compiled.items()]},
        "checks": checks, "times": {}, "bandwidth_floor_us": None, "excess_us": {},
        "tightest_floor": None, "variant_options": st.options,
    }  # fmt: skip
    if timer is None:  # smoke on the CPU: checks only, no timing claims
        res["times"] = {k: {"cold": None, "graph": None} for k in runs}
        return res
    for key, fn in runs.items():
        res["times"][key] = {"cold": _stats(timer.samples(fn, reps)),
                             "graph": _stats(graph_samples(fn, calls=20, replays=15))}  # fmt: skip
    res["bandwidth_floor_us"] = st.bytes / copy / 1e3
    op = primary(res, "op")
    floors = {k: primary(res, k) for k in ROWS if k != "op" and primary(res, k) is not None}
    res["excess_us"] = {k: op - v for k, v in floors.items()}
    bounds = {k: v for k, v in floors.items() if k in LOWER_BOUNDS}
    res["tightest_floor"] = max(bounds, key=bounds.get)
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON results")
    ap.add_argument("--md", help="markdown tables")
    ap.add_argument("--reps", type=int, default=50, help="cold samples per measurement")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, checks only on the CPU")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        ap.error("needs a CUDA GPU (or --smoke, with TRITON_INTERPRET=1)")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32  # the interpreter's bf16 is wrong
    dim, lines, specs = (64, 64, SMOKE_CASES) if args.smoke else (8448, 1024, CASES)
    timer = ColdTimer() if cuda else None
    copy = copy_gbps(nbytes=(64 << 20) if args.smoke else 4 << 30, timer=timer) if cuda else None
    if cuda:
        torch.cuda.empty_cache()
    env = {
        "gpu": torch.cuda.get_device_name() if cuda else "none (CPU, Triton interpreter)",
        "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
        "git_sha": git_sha(), "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"),
        "command": shlex.join(["python", "benchmarks/kernels/conv1d_bounds.py", *argv]),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "copy_gbps": None if copy is None else round(copy, 1), "smoke": args.smoke,
        "reps": args.reps,
    }  # fmt: skip
    cases = {}
    for i, (name, spec) in enumerate(specs.items()):
        cases[name] = measure_case(name, spec, dim, dtype, device, lines, i, timer, copy,
                                   3 if args.smoke else args.reps)  # fmt: skip
        print(f"{name}: done", flush=True)
    if cuda:
        env["copy_gbps_end"] = round(copy_gbps(timer=timer), 1) if not args.smoke else None
    passed = all(all(c["checks"].values()) for c in cases.values())
    results = {"environment": env, "checks_passed": passed, "cases": cases,
               "markdown": markdown(env, cases)}  # fmt: skip
    print(results["markdown"])
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    if args.md:
        Path(args.md).write_text(results["markdown"])
    return results


if __name__ == "__main__":
    sys.exit(0 if main()["checks_passed"] else 1)
