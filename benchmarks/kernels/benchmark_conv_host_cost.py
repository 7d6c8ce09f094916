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
The timing loops and the launch stubs: conv_host_cost_timing.py; the report:
conv_host_cost_report.py.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from benchmarks.common.run_info import write_results
from benchmarks.kernels.conv_host_cost_report import environment, markdown
from benchmarks.kernels.conv_host_cost_timing import profile_top, stubbed_launches, time_loop
from vllm.model_executor.layers.mamba.ops import causal_conv1d as conv_ops
from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
    PAD_SLOT_ID,
    causal_conv1d_fn,
    causal_conv1d_ref,
    causal_conv1d_update,
    causal_conv1d_update_ref,
    compute_causal_conv1d_metadata,
)

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


def target_of(kind: str) -> float | None:
    return TARGETS_US.get(kind)


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
