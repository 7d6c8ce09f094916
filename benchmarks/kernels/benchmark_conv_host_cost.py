"""Host cost of one eager causal-conv1d call, and where it goes.

    python -m benchmarks.kernels.benchmark_conv_host_cost [--smoke] [--out F.json] [--md F.md]
        [--calls N] [--reps R] [--stub-launch] [--profile]

The method is the anchors' (../shared/design/anchors-h200.md, "host"): N calls back to
back with no sync inside, ``time.perf_counter`` around them, one sync at the end. Two
numbers per repetition, medians and p20/p80 over the repetitions:

- ``loop_us``: (time to the end of the final sync) / N, the anchors' figure (the larger of
  the host cost and the GPU time); the targets are checked against it;
- ``enqueue_us``: (time when the last call returned) / N, the host's own cost even where
  the GPU is slower (N is kept below the launch queue's depth).

Cases (bf16, width 4, SiLU, bias, dim 8448, a 1024-line pool, sequences on shuffled lines):

- ``update_B{1,64,256}``: ``causal_conv1d_update`` on one-token decodes;
- ``fn_meta_<step>`` / ``fn_nometa_<step>``: ``causal_conv1d_fn`` on a mixed step with the
  step's metadata passed or not; steps ``64+15`` (a 64-token continuation and 15 decodes),
  ``4x32+60`` and ``2048+255`` (GPU-bound, so no target: its loop time is the kernel's,
  its enqueue time still the host cost);
- ``metadata_<step>``: ``compute_causal_conv1d_metadata`` for those steps and a decode-only
  step of 256 (its host-to-device copies are asynchronous and included);
- floors, GPU only: a one-element ``add_`` (one torch op) and an empty Triton kernel
  launched through ``kernel[grid]``; and the CUDA pathway's update where it is built.

Every op case is first checked against the fp32 reference (outputs within 2e-2 + 1e-2 *
|ref|, no NaN, the pool equal to the reference's); a failure exits with 1 before timing.

Where the time goes:

- ``--profile`` runs each case under cProfile and lists the functions with the most own
  time per call (cProfile inflates every Python call; read the shares, not the sums);
- ``breakdown`` times the pieces of the host path on their own, where the op module
  exposes them (``causal_conv1d.host_path_pieces``): the plan lookup (every check a
  repeated call makes), the per-step checks, the output allocation, the stream lookup,
  the launch;
- ``--stub-launch`` replaces every kernel launch by a no-op, so the loop times the Python
  host path alone. It is the default without a GPU: there the kernels would run in Triton's
  interpreter (milliseconds), and only the host path is worth timing; the reference check
  still runs the real kernels.

Writes the results as JSON (``--out``) and markdown (``--md``), with the device, versions,
git sha and command line. ``--smoke`` runs tiny shapes and few calls (the CPU test).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import os
import pstats
import shlex
import statistics
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from benchmarks.common.run_info import git_sha, write_results
from vllm.model_executor.layers.mamba.ops import causal_conv1d as conv_ops
from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
    PAD_SLOT_ID,
    causal_conv1d_fn,
    causal_conv1d_ref,
    causal_conv1d_update,
    causal_conv1d_update_ref,
    compute_causal_conv1d_metadata,
)
from vllm.triton_utils.launch import CachedLauncher

REPO = Path(__file__).resolve().parents[2]

TARGETS_US = {"update": 15.0, "fn_meta": 20.0, "metadata": 30.0}  # issue 14, on the H200
WIDTH, NUM_LINES = 4, 1024
STEPS = {  # name: (sequence lengths, has-history flags)
    "64+15": ([64] + [1] * 15, [True] * 16),
    "4x32+60": ([32] * 4 + [1] * 60, [False, True, False, True] + [True] * 60),
    "2048+255": ([2048] + [1] * 255, [True] * 256),
}
GPU_BOUND_STEPS = {"2048+255"}  # ~41 us of kernel on an H200 (causal_conv1d_h200.md)
SMOKE_STEPS = {"5+3": ([5, 1, 1, 1], [True, True, False, True])}


@dataclass
class Setup:
    device: torch.device
    dtype: torch.dtype
    dim: int
    num_lines: int
    update_batches: tuple[int, ...]
    steps: dict
    calls: int
    reps: int


def make_setup(args) -> Setup:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if args.smoke:
        return Setup(device, torch.float32 if not cuda else torch.bfloat16, 64, 16, (1, 4),
                     SMOKE_STEPS, args.calls or 20, args.reps or 3)  # fmt: skip
    # bf16 arithmetic is wrong in Triton's interpreter: fp16 on the CPU
    dtype = torch.bfloat16 if cuda else torch.float16
    return Setup(device, dtype, 8448, NUM_LINES, (1, 64, 256), STEPS, args.calls or 200,
                 args.reps or 7)  # fmt: skip


# --------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_loop(fn: Callable[[], object], device, calls: int, reps: int) -> dict:
    """Back-to-back calls, no sync inside; per repetition the enqueue and loop time per call."""
    for _ in range(min(10, calls)):
        fn()
    _sync(device)
    enq, loop = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        _sync(device)
        t2 = time.perf_counter()
        enq.append((t1 - t0) / calls * 1e6)
        loop.append((t2 - t0) / calls * 1e6)
    return {"enqueue_us": _stats(enq), "loop_us": _stats(loop), "calls": calls, "reps": reps}


def _stats(samples: list[float]) -> dict:
    s = sorted(samples)

    def q(p):
        pos = p * (len(s) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)

    return {"median": statistics.median(s), "p20": q(0.2), "p80": q(0.8)}


def profile_top(fn: Callable[[], object], calls: int, top: int = 12) -> list[dict]:
    """The functions with the most own time per call, under cProfile."""
    fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (path, line, name), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        rows.append(
            {
                "function": f"{Path(path).name}:{line}({name})" if line else name,
                "own_us_per_call": tottime / calls * 1e6,
                "cum_us_per_call": cumtime / calls * 1e6,
                "calls_per_call": ncalls / calls,
            }
        )
    rows.sort(key=lambda r: -r["own_us_per_call"])
    return rows[:top]


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kw)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def stubbed_launches() -> Iterator[None]:
    """Every launcher of the op module launches nothing (the host path alone is timed)."""
    saved = []
    for value in vars(conv_ops).values():
        if isinstance(value, CachedLauncher):
            saved.append((value, value.kernel, value.direct))
            value.kernel, value.direct = _NoLaunch(), False
    clear = getattr(conv_ops, "clear_host_caches", None)
    if clear is not None:
        clear()  # cached launch plans hold compiled kernels: rebuild them as stubs
    try:
        yield
    finally:
        for launcher, kernel, direct in saved:
            launcher.kernel, launcher.direct = kernel, direct
        if clear is not None:
            clear()


# --------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------


@dataclass
class OpCase:
    name: str
    kind: str  # "update", "fn_meta", "fn_nometa", "metadata", "floor"
    call: Callable[[], object]
    check: Callable[[], str | None] | None  # None when right, else what is wrong
    op_args: tuple | None = None  # (op, args, kwargs) of an op case, for the breakdown


def _close(out: torch.Tensor, ref: torch.Tensor) -> bool:
    o, r = out.float(), ref.float()
    return bool(torch.isfinite(o).all()) and bool(((o - r).abs() <= 2e-2 + 1e-2 * r.abs()).all())


def _gen(s: Setup, *key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr((s.dim, *key)).encode()))


def _rand(shape, g, s: Setup, scale=1.0) -> torch.Tensor:
    return (scale * torch.randn(shape, generator=g)).to(s.dtype).to(s.device)


def _params(s: Setup, g):
    weight = _rand((s.dim, WIDTH), g, s, 0.5)
    bias = _rand((s.dim,), g, s, 0.2)
    pool = _rand((s.num_lines, WIDTH - 1, s.dim), g, s).transpose(1, 2)
    return weight, bias, pool


def update_case(s: Setup, batch: int) -> OpCase:
    g = _gen(s, "update", batch)
    weight, bias, pool = _params(s, g)
    x = _rand((batch, s.dim), g, s)
    lines = 1 + torch.randperm(s.num_lines - 1, generator=g)[:batch]
    idx = lines.to(torch.int32).to(s.device)

    def check():
        p, rp = pool.clone(), pool.clone()
        out = causal_conv1d_update(x, p, weight, bias, "silu", idx, pad_slot_id=PAD_SLOT_ID)
        ref = causal_conv1d_update_ref(x.float(), rp, weight, bias, "silu", idx)
        if not _close(out, ref):
            return "outputs differ from the reference"
        return None if torch.equal(p, rp) else "states differ from the reference"

    args, kwargs = (x, pool, weight, bias, "silu", idx), {"pad_slot_id": PAD_SLOT_ID}

    def call():
        return causal_conv1d_update(*args, **kwargs)

    return OpCase(f"update_B{batch}", "update", call, check, (causal_conv1d_update, args, kwargs))


def _step_inputs(s: Setup, step: str):
    lens, init = s.steps[step]
    g = _gen(s, "fn", step)
    weight, bias, pool = _params(s, g)
    x = _rand((sum(lens), s.dim), g, s).t()
    qsl_cpu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    lines = 1 + torch.randperm(s.num_lines - 1, generator=g)[: len(lens)]
    idx = lines.to(torch.int32).to(s.device)
    flags = torch.tensor(init, device=s.device)
    return x, weight, bias, pool, qsl_cpu, idx, flags


def fn_case(s: Setup, step: str, with_meta: bool) -> OpCase:
    x, weight, bias, pool, qsl_cpu, idx, init = _step_inputs(s, step)
    qsl = qsl_cpu.to(s.device)
    meta = compute_causal_conv1d_metadata(qsl_cpu, s.device) if with_meta else None

    def check():
        p, rp = pool.clone(), pool.clone()
        out = causal_conv1d_fn(x, weight, bias, p, qsl, idx, init, "silu", metadata=meta)
        ref = causal_conv1d_ref(x.float(), weight, bias, rp, qsl, idx, init, "silu")
        if not _close(out, ref):
            return "outputs differ from the reference"
        return None if torch.equal(p, rp) else "states differ from the reference"

    args, kwargs = (x, weight, bias, pool, qsl, idx, init, "silu"), {"metadata": meta}

    def call():
        return causal_conv1d_fn(*args, **kwargs)

    kind = "fn_meta" if with_meta else "fn_nometa"
    if step in GPU_BOUND_STEPS:
        kind += "_gpu_bound"  # its loop time is the kernel's: no host target
    return OpCase(f"{kind}_{step}", kind, call, check, (causal_conv1d_fn, args, kwargs))


def metadata_case(s: Setup, name: str, lens: list[int]) -> OpCase:
    qsl_cpu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)

    def check():
        meta = compute_causal_conv1d_metadata(qsl_cpu, s.device)
        starts = qsl_cpu[:-1].tolist()
        tiles = meta.tile_seq.cpu().tolist()
        for p, b in enumerate(tiles):
            if not starts[b] <= p * meta.block_t < starts[b] + lens[b]:
                return f"tile {p} mapped to sequence {b}"
        if meta.query_start_loc.cpu().tolist() != qsl_cpu.tolist():
            return "query_start_loc copy differs"
        return None

    return OpCase(f"metadata_{name}", "metadata",
                  lambda: compute_causal_conv1d_metadata(qsl_cpu, s.device), check)  # fmt: skip


@triton.jit
def _empty_kernel(p, BLOCK: tl.constexpr):
    pass


def floor_cases(s: Setup) -> list[OpCase]:
    """One torch op and one empty Triton kernel: the host floor of any launch (GPU only)."""
    if s.device.type != "cuda":
        return []
    t = torch.zeros(1, device=s.device)
    cases = [
        OpCase("floor_torch_add_", "floor", lambda: t.add_(1), None),
        OpCase(
            "floor_empty_triton_kernel", "floor", lambda: _empty_kernel[(1,)](t, BLOCK=1), None
        ),  # fmt: skip
    ]
    from vllm import _custom_ops as cuda_ops

    if cuda_ops.cuda_ops_available():
        g = _gen(s, "cuda-update")
        weight, bias, _ = _params(s, g)
        pool_w = _rand((s.num_lines, s.dim, WIDTH - 1), g, s)
        x = _rand((1, s.dim), g, s)
        idx = torch.zeros(1, dtype=torch.int32, device=s.device)
        cases.append(
            OpCase(
                "cuda_pathway_update_B1",
                "floor",
                lambda: cuda_ops.causal_conv1d_update_cuda(
                    x, pool_w, weight, bias, True, idx, PAD_SLOT_ID
                ),
                None,
            )  # fmt: skip
        )
    return cases


def make_cases(s: Setup) -> list[OpCase]:
    cases = [update_case(s, b) for b in s.update_batches]
    for step in s.steps:
        cases += [fn_case(s, step, True), fn_case(s, step, False)]
    for step, (lens, _) in s.steps.items():
        cases.append(metadata_case(s, step, lens))
    cases.append(metadata_case(s, f"decode{max(s.update_batches)}", [1] * max(s.update_batches)))
    return cases + floor_cases(s)


# --------------------------------------------------------------------------
# Breakdown: the pieces of the host path, where the module exposes them
# --------------------------------------------------------------------------


def breakdown(s: Setup, cases: list[OpCase]) -> dict:
    pieces_of = getattr(conv_ops, "host_path_pieces", None)
    if pieces_of is None:
        return {"available": False, "why": "the op module has no host_path_pieces()"}
    out = {"available": True, "cases": {}}
    for case in cases:
        if case.op_args is None:
            continue
        op, args, kwargs = case.op_args
        pieces = pieces_of(op, *args, **kwargs)
        out["cases"][case.name] = {
            name: time_loop(piece, s.device, s.calls, s.reps)["enqueue_us"]["median"]
            for name, piece in pieces.items()
        }
    return out


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------


def environment(s: Setup, stub: bool) -> dict:
    cuda = s.device.type == "cuda"
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"),
        "launches": "stubbed (host path only)" if stub else "real",
        "dtype": str(s.dtype).replace("torch.", ""),
        "dim": s.dim,
        "git_sha": git_sha(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "command": shlex.join([sys.executable, *sys.argv]),
    }


def target_of(kind: str) -> float | None:
    return TARGETS_US.get(kind)


def markdown(res: dict) -> str:
    env = res["environment"]
    lines = [
        "# causal-conv1d host cost per eager call",
        "",
        f"- {env['device']}, torch {env['torch']}, triton {env['triton']}, {env['dtype']}, "
        f"dim {env['dim']}; launches {env['launches']}",
        f"- git {env['git_sha']}; {env['date_utc']} UTC; `{env['command']}`",
        "",
        "| case | loop us/call [p20, p80] | enqueue us/call | target us | met |",
        "|---|---|---|---|---|",
    ]
    for name, row in res["cases"].items():
        lp, eq = row["loop_us"], row["enqueue_us"]
        target = row.get("target_us")
        met = "" if target is None else ("yes" if row["met"] else "no")
        lines.append(
            f"| {name} | {lp['median']:.2f} [{lp['p20']:.2f}, {lp['p80']:.2f}] | "
            f"{eq['median']:.2f} | {'' if target is None else target} | {met} |"
        )
    bd = res["breakdown"]
    if bd.get("available"):
        names = sorted({p for row in bd["cases"].values() for p in row})
        head = "| case | " + " | ".join(names) + " |"
        rule = "|---" * (len(names) + 1) + "|"
        lines += [
            "",
            "Pieces of the host path, each timed alone (enqueue us/call):",
            "",
            head,
            rule,
        ]
        for case, row in bd["cases"].items():
            cells = [f"{row[n]:.2f}" if n in row else "" for n in names]
            lines.append(f"| {case} | " + " | ".join(cells) + " |")
    for case, rows in res.get("profile", {}).items():
        lines += ["", f"cProfile, {case} (own us per call, inflated by the profiler):", ""]
        lines += [f"- {r['own_us_per_call']:.2f} {r['function']}" for r in rows[:8]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, few calls (CPU test)")
    parser.add_argument("--calls", type=int, help="calls per repetition (default 200; smoke 20)")
    parser.add_argument("--reps", type=int, help="repetitions (default 7; smoke 3)")
    stub_help = "every launch a no-op: the host path alone (default off a GPU)"
    parser.add_argument("--stub-launch", action="store_true", help=stub_help)
    parser.add_argument("--profile", action="store_true", help="cProfile each case")
    parser.add_argument("--skip-check", action="store_true",
                        help="no reference check (only with stubbed launches: on a CPU the "
                        "interpreter takes minutes on the full shapes)")  # fmt: skip
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--md", help="write the markdown table here")
    args = parser.parse_args(argv)
    s = make_setup(args)
    stub = args.stub_launch or s.device.type != "cuda"
    if args.skip_check and not stub:
        parser.error("--skip-check times stubbed launches only (add --stub-launch)")
    cases = make_cases(s)

    failures = []
    for case in cases:
        if case.check is not None and not args.skip_check:
            why = case.check()
            if why:
                failures.append(f"{case.name}: {why}")
    if failures:
        print("reference check failed, nothing timed:\n  " + "\n  ".join(failures))
        sys.exit(1)

    res = {"environment": environment(s, stub), "targets_us": TARGETS_US, "cases": {},
           "checked": not args.skip_check}  # fmt: skip
    with stubbed_launches() if stub else contextlib.nullcontext():
        for case in cases:
            if stub and case.kind == "floor":
                continue
            row = time_loop(case.call, s.device, s.calls, s.reps)
            target = target_of(case.kind)
            if target is not None:
                row["target_us"] = target
                row["met"] = row["loop_us"]["median"] <= target
            res["cases"][case.name] = row
            print(f"{case.name:32s} loop {row['loop_us']['median']:8.2f} us  "
                  f"enqueue {row['enqueue_us']['median']:8.2f} us")  # fmt: skip
        res["breakdown"] = breakdown(s, cases)
        if args.profile:
            res["profile"] = {
                c.name: profile_top(c.call, s.calls) for c in cases if c.kind != "floor"
            }
    res["markdown"] = markdown(res)
    print(res["markdown"])
    write_results(res, args.out, args.md)
    return res


if __name__ == "__main__":
    main()
