"""Check the two causal-conv1d ops against their fp32 references, then time them.

    python examples/causal_conv1d_demo.py [--json PATH] [--reps N]

Two cases:
  mixed_fn    one continuous-batching step through ``causal_conv1d_fn``: one-token
              decodes, prefills of different lengths (some starting from a cached
              state, one shorter than the convolution window) and a padded row, in one
              launch with metadata built once by ``compute_causal_conv1d_metadata``.
  decode_upd  a decode batch through ``causal_conv1d_update``, with a padded row.

Each op runs on a copy of a state pool and its reference on another copy: outputs are
compared within the dtype's tolerance, the pools must be bit-identical afterwards, and
cache lines that no sequence uses must be untouched.

With a CUDA GPU: bf16, dim 8448, width 4. Times are CUDA-event medians with L2 flushed
before each call and the launch queued behind a GPU sleep, so they measure the kernels
and not the host. Without one: small fp32 cases through the Triton interpreter, whose
times say nothing about speed. Exits 1 if a check fails.
"""

import argparse
import importlib.metadata
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

import torch

# (atol, rtol) per dtype: one rounding of the output on top of fp32 arithmetic.
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1e-2, 1e-2),
}


@dataclass
class Sizes:
    dtype: torch.dtype
    dim: int
    width: int
    decodes: int  # one-token sequences continuing from a cached state
    fresh_prefill: int  # a prefill starting from zeros
    cached_prefills: tuple[int, ...]  # prefills continuing from a cached state
    update_batch: int  # rows of the causal_conv1d_update case, the last one padded
    spare_lines: int  # cache lines no sequence uses: they must stay untouched


GPU_SIZES = Sizes(
    dtype=torch.bfloat16,
    dim=8448,
    width=4,
    decodes=254,
    fresh_prefill=1280,
    cached_prefills=(512, 256),
    update_batch=512,
    spare_lines=16,
)
# The interpreter runs every program in Python: keep it to ~40 tokens.
CPU_SIZES = Sizes(
    dtype=torch.float32,
    dim=64,
    width=4,
    decodes=8,
    fresh_prefill=17,
    cached_prefills=(9, 2),
    update_batch=6,
    spare_lines=3,
)


@dataclass
class Result:
    case: str
    provider: str
    median_us: float
    p20_us: float
    p80_us: float
    max_abs_diff: float | None = None
    state_ok: bool | None = None
    passed: bool | None = None


def time_cuda(fn: Callable[[], object], reps: int) -> list[float]:
    """Per-call kernel times in us: L2 flushed before each, launch hidden behind a sleep."""
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    for _ in range(3):  # compile and autotune outside the measurement
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        flush.zero_()
        # Keeps the GPU busy while the host queues the call, so host launch cost is hidden.
        torch.cuda._sleep(400_000)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return [start.elapsed_time(end) * 1e3 for start, end in events]


def time_cpu(fn: Callable[[], object], reps: int) -> list[float]:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return times


def timing(case: str, provider: str, times: list[float]) -> Result:
    q = statistics.quantiles(times, n=10) if len(times) > 1 else times * 9
    return Result(case, provider, statistics.median(times), q[1], q[7])


def state_pool(lines: int, dim: int, width: int, dtype, device) -> torch.Tensor:
    """(lines, dim, width-1) with the features contiguous, as the Triton ops require."""
    return torch.randn(lines, width - 1, dim, dtype=dtype, device=device).transpose(1, 2)


def copy_pool(pool: torch.Tensor) -> torch.Tensor:
    copy = torch.empty_like(pool.transpose(1, 2)).transpose(1, 2)
    copy.copy_(pool)
    return copy


def compare(
    out: torch.Tensor,
    ref: torch.Tensor,
    pool: torch.Tensor,
    ref_pool: torch.Tensor,
    pool_before: torch.Tensor,
    used_lines: list[int],
) -> tuple[float, bool, bool]:
    """(max |out - ref|, outputs within tolerance, pools equal with spare lines untouched)."""
    atol, rtol = TOLERANCES[out.dtype]
    diff = (out.float() - ref.float()).abs().max().item()
    out_ok = torch.allclose(out.float(), ref.float(), atol=atol, rtol=rtol)
    used = set(used_lines)
    spare = [line for line in range(pool.shape[0]) if line not in used]
    state_ok = torch.equal(pool, ref_pool) and torch.equal(pool[spare], pool_before[spare])
    return diff, out_ok, state_ok


def run_mixed_fn(ops, s: Sizes, device: str, reps: int, bench) -> list[Result]:
    """One mixed step through causal_conv1d_fn: decodes, prefills and a padded row."""
    lengths = [1] * s.decodes + [s.fresh_prefill, *s.cached_prefills] + [1]
    has_init = [True] * s.decodes + [False] + [True] * len(s.cached_prefills) + [False]
    batch = len(lengths)
    num_lines = batch - 1 + s.spare_lines
    lines = torch.randperm(num_lines)[: batch - 1].tolist()  # scattered, as in a live pool
    cache_indices = lines + [ops.PAD_SLOT_ID]  # the last row is batch padding

    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    num_tokens = offsets[-1]
    query_start_loc_cpu = torch.tensor(offsets, dtype=torch.int32)
    query_start_loc = query_start_loc_cpu.to(device)
    cache_indices_t = torch.tensor(cache_indices, dtype=torch.int32, device=device)
    has_init_t = torch.tensor(has_init, dtype=torch.bool, device=device)

    x = torch.randn(num_tokens, s.dim, dtype=s.dtype, device=device).t()  # (dim, tokens)
    weight = torch.randn(s.dim, s.width, dtype=s.dtype, device=device) / s.width**0.5
    bias = torch.randn(s.dim, dtype=s.dtype, device=device) / 4
    pool_before = state_pool(num_lines, s.dim, s.width, s.dtype, device)
    pool = copy_pool(pool_before)
    ref_pool = copy_pool(pool_before)
    metadata = ops.compute_causal_conv1d_metadata(query_start_loc_cpu, device)

    def op(states: torch.Tensor) -> torch.Tensor:
        return ops.causal_conv1d_fn(
            x,
            weight,
            bias,
            states,
            query_start_loc,
            cache_indices=cache_indices_t,
            has_initial_state=has_init_t,
            activation="silu",
            pad_slot_id=ops.PAD_SLOT_ID,
            metadata=metadata,
        )

    def ref(states: torch.Tensor) -> torch.Tensor:
        return ops.causal_conv1d_ref(
            x,
            weight,
            bias,
            states,
            query_start_loc,
            cache_indices=cache_indices_t,
            has_initial_state=has_init_t,
            activation="silu",
            pad_slot_id=ops.PAD_SLOT_ID,
        )

    out = op(pool)
    out_ref = ref(ref_pool)
    diff, out_ok, state_ok = compare(out, out_ref, pool, ref_pool, pool_before, lines)

    case = f"mixed_fn T{num_tokens}_B{batch}"
    ours = timing(case, "triton", bench(lambda: op(pool), reps))
    ours.max_abs_diff, ours.state_ok, ours.passed = diff, state_ok, out_ok and state_ok
    return [ours, timing(case, "reference", bench(lambda: ref(ref_pool), reps))]


def run_decode_update(ops, s: Sizes, device: str, reps: int, bench) -> list[Result]:
    """A decode batch through causal_conv1d_update; the last row is padding."""
    batch = s.update_batch
    num_lines = batch - 1 + s.spare_lines
    lines = torch.randperm(num_lines)[: batch - 1].tolist()
    indices = torch.tensor(lines + [ops.PAD_SLOT_ID], dtype=torch.int32, device=device)

    x = torch.randn(batch, s.dim, dtype=s.dtype, device=device)
    weight = torch.randn(s.dim, s.width, dtype=s.dtype, device=device) / s.width**0.5
    bias = torch.randn(s.dim, dtype=s.dtype, device=device) / 4
    pool_before = state_pool(num_lines, s.dim, s.width, s.dtype, device)
    pool = copy_pool(pool_before)
    ref_pool = copy_pool(pool_before)

    def op(states: torch.Tensor) -> torch.Tensor:
        return ops.causal_conv1d_update(
            x,
            states,
            weight,
            bias,
            activation="silu",
            conv_state_indices=indices,
            pad_slot_id=ops.PAD_SLOT_ID,
        )

    def ref(states: torch.Tensor) -> torch.Tensor:
        return ops.causal_conv1d_update_ref(
            x,
            states,
            weight,
            bias,
            activation="silu",
            conv_state_indices=indices,
            pad_slot_id=ops.PAD_SLOT_ID,
        )

    out = op(pool)
    out_ref = ref(ref_pool)
    diff, out_ok, state_ok = compare(out, out_ref, pool, ref_pool, pool_before, lines)

    case = f"decode_upd B{batch}"
    ours = timing(case, "triton", bench(lambda: op(pool), reps))
    ours.max_abs_diff, ours.state_ok, ours.passed = diff, state_ok, out_ok and state_ok
    return [ours, timing(case, "reference", bench(lambda: ref(ref_pool), reps))]


def print_table(results: list[Result]) -> None:
    def cell(value, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    print(f"{'case':<24} {'provider':<10} {'median us':>12} {'max|diff|':>10} {'state ok':>9}")
    for r in results:
        state = "-" if r.state_ok is None else ("yes" if r.state_ok else "NO")
        print(
            f"{r.case:<24} {r.provider:<10} {r.median_us:>12.1f} "
            f"{cell(r.max_abs_diff, '.3g'):>10} {state:>9}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--reps", type=int, help="timed calls per provider (GPU 50, CPU 3)")
    args = parser.parse_args()

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        # Triton decides at decoration time whether kernels are interpreted, so this must
        # happen before the op module is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        print(
            "No CUDA GPU: running the Triton kernels on the CPU through the Triton "
            f"interpreter (TRITON_INTERPRET={os.environ['TRITON_INTERPRET']}). Small fp32 "
            "cases; the interpreter's times say nothing about speed."
        )
    from vllm.model_executor.layers.mamba.ops import causal_conv1d as ops

    device = "cuda" if on_gpu else "cpu"
    sizes = GPU_SIZES if on_gpu else CPU_SIZES
    reps = args.reps or (50 if on_gpu else 3)
    bench = time_cuda if on_gpu else time_cpu
    torch.manual_seed(0)

    results = run_mixed_fn(ops, sizes, device, reps, bench)
    results += run_decode_update(ops, sizes, device, reps, bench)

    triton_version = importlib.metadata.version("triton")
    device_name = torch.cuda.get_device_name() if on_gpu else "cpu (Triton interpreter)"
    print(
        f"\n{device_name}, torch {torch.__version__}, triton {triton_version}, "
        f"{str(sizes.dtype).removeprefix('torch.')}, dim {sizes.dim}, width {sizes.width}, "
        f"{reps} timed calls each"
    )
    print_table(results)
    failed = [r.case for r in results if r.passed is False]
    print("FAILED: " + ", ".join(failed) if failed else "all checks passed")

    if args.json:
        report = {
            "device": device_name,
            "torch": torch.__version__,
            "triton": triton_version,
            "dtype": str(sizes.dtype).removeprefix("torch."),
            "sizes": {f.name: getattr(sizes, f.name) for f in fields(sizes) if f.name != "dtype"},
            "reps": reps,
            "timing": "CUDA events, L2 flushed" if on_gpu else "perf_counter, interpreter",
            "results": [asdict(r) for r in results],
            "passed": not failed,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
