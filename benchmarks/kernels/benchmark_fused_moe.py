"""The fused-MoE op (issue 34, item 4): ours against upstream vLLM 0.33.0's Triton kernel
and a per-expert PyTorch loop, one run.

    python -m benchmarks.kernels.benchmark_fused_moe [--tokens 1,16,64,256,4096]
        [--shapes granite-4.0-h-small,nemotron-3-nano] [--reps 25] [--out DIR]
    python -m benchmarks.kernels.benchmark_fused_moe --smoke      # CPU, interpreter

Layer shapes (routed experts only; the shared expert is a plain MLP beside the op):

- ``granite-4.0-h-small``: hidden 4096, 72 experts of intermediate 768, top 10, SwiGLU
  (w13 (72, 1536, 4096)); from ibm-granite/granite-4.0-h-small's published config.json,
  written without a download (upstream ships E=72,N=768 tables for H100 and MI300X, which
  agrees);
- ``nemotron-3-nano``: hidden 2688, 128 experts of 1856, top 6, relu^2 without a gate
  (w13 (128, 1856, 2688)); the fields tests/models/test_nemotron_h_moe.py reads.

bf16 weights and activations, random; the routing is a softmax top-k of random logits
(renormalised), the same ids and weights for every provider; the router is not timed.

Providers:

- ``ours``: ``fused_moe.fused_experts`` (alignment, gate+up, down, top-k sum);
- ``upstream``: vLLM 0.33.0's ``fused_moe_kernel`` through its ``invoke_fused_moe_triton_kernel``,
  with the launch configuration its ``get_moe_configs`` / ``get_default_config`` pick on this
  device, called as its ``fused_experts_impl`` calls it (the naive block assignment when
  tokens x top_k x 4 <= experts). Its alignment, SiLU-and-mul and top-k sum are CUDA ops
  of the wheel's compiled extension, which does not load against our torch: ours
  ``moe_align_block_size`` (same buffers) and torch's ``silu(g) * u`` / ``relu(h)^2`` and
  ``sum`` stand in. Extracted from the wheel into ``upstream_vllm033/fused_moe`` (git-ignored,
  never committed; docs/gpu_box.md); skipped with the reason when it does not import;
- ``torch``: ``fused_moe_ref`` in bf16 arithmetic instead of fp32: a loop over the used
  experts (reads the ids back: one host sync), how a plain PyTorch MoE block runs.

Before timing, each provider's output is compared with the fp32 reference (rel-L2 under
TOL). Timing: ColdTimer (L2 flushed, GPU kept busy so launches are hidden), median and
p20/p80 of --reps calls. Floors: bytes (the used experts' weights, x, out) / the device
copy bandwidth measured in the same run, and FLOPs / a bf16 8192^3 matmul's rate measured
in the same run. ``--smoke``: tiny shapes on the CPU under TRITON_INTERPRET=1, fp32 (checks
only; times are wall clock of the interpreter).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks.common.run_info import git_sha, triton_version
from benchmarks.kernels.benchmark_utils import ColdTimer, copy_gbps, summarize

# name: (hidden, experts, intermediate, top_k, gated)
SHAPES = {
    "granite-4.0-h-small": (4096, 72, 768, 10, True),
    "nemotron-3-nano": (2688, 128, 1856, 6, False),
}
SMOKE_SHAPES = {"smoke-gated": (32, 16, 16, 3, True), "smoke-relu2": (24, 6, 16, 2, False)}
PROVIDERS = ("ours", "upstream", "torch")
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}


def upstream_module():
    """vLLM 0.33.0's extracted fused_moe module, or (None, the reason it is absent)."""
    try:
        from upstream_vllm033.fused_moe import fused_moe as up
    except Exception as err:  # noqa: BLE001 - any import failure skips the provider
        return None, f"skipped: not found ({type(err).__name__}: {err})"
    return up, None


@functools.cache
def expert_weights(shape, dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13, w2) of a shape, drawn once on the device (Granite's are 0.7 G values: drawing
    them on the host for every token count would take minutes)."""
    hidden, experts, inter, _, gated = shape
    g = torch.Generator(device).manual_seed(1)
    rows = 2 * inter if gated else inter

    def rand(*size, scale):
        return (torch.randn(*size, generator=g, device=device) * scale).to(dtype)

    return rand(experts, rows, hidden, scale=hidden**-0.5), rand(experts, hidden, inter,
                                                                 scale=inter**-0.5)  # fmt: skip


class Case:
    def __init__(self, shape, tokens: int, dtype, device: str, seed: int = 0):
        hidden, experts, inter, top_k, gated = shape
        self.hidden, self.experts, self.inter, self.top_k, self.gated = shape
        g = torch.Generator().manual_seed(seed)

        def rand(*s, scale=1.0):
            return (torch.randn(*s, generator=g) * scale).to(device, dtype)

        self.x = rand(tokens, hidden)
        self.w13, self.w2 = expert_weights(shape, dtype, device)
        logits = torch.randn(tokens, experts, generator=g)
        w, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
        self.weights = (w / w.sum(-1, keepdim=True)).to(device)
        self.ids = ids.to(device, torch.int32)
        self.activation = "silu" if gated else "relu2"

    def reference(self) -> torch.Tensor:
        from vllm.model_executor.layers.fused_moe.fused_moe_ref import fused_experts_ref

        args = (self.x, self.w13, self.w2, self.weights, self.ids, self.activation)
        return fused_experts_ref(*args, self.gated).float()

    def work(self) -> tuple[float, float]:
        """(bytes, FLOPs) of the call: each used expert's weights once, x read, out written;
        two GEMMs per (token, k) pair."""
        es = self.x.element_size()
        used = torch.unique(self.ids).numel()
        rows = self.w13.shape[1]  # w13[e] (rows, H), w2[e] (H, I)
        nbytes = used * self.hidden * (rows + self.inter) * es + 2 * self.x.numel() * es
        flops = 2 * self.ids.numel() * (rows + self.inter) * self.hidden
        return float(nbytes), float(flops)


def make_provider(name: str, case: Case, up):
    """A zero-argument call of the provider on the case, returning its output."""
    if name == "ours":
        from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

        args = (case.x, case.w13, case.w2, case.weights, case.ids, case.activation, case.gated)
        return lambda: fused_experts(*args)
    if name == "torch":
        return lambda: torch_loop(case)
    return upstream_call(case, up)


def torch_loop(case: Case) -> torch.Tensor:
    """Per used expert: gather its pairs, two matmuls in the activation dtype, index_add."""
    x, out = case.x, torch.zeros_like(case.x)
    ids = case.ids.long()
    for e in torch.unique(ids).tolist():
        token, k = (ids == e).nonzero(as_tuple=True)
        h = x[token] @ case.w13[e].t()
        if case.gated:
            h = torch.nn.functional.silu(h[:, : case.inter]) * h[:, case.inter :]
        else:
            h = torch.relu(h).square()
        y = (h @ case.w2[e].t()) * case.weights[token, k].to(x.dtype)[:, None]
        out.index_add_(0, token, y)
    return out


def upstream_config(case: Case, up) -> dict:
    """What upstream's try_get_optimal_moe_config picks (no override): its table for
    (E, N) on this device, the nearest batch key, else its default config."""
    tokens, dtype = case.x.shape[0], None  # bf16/fp16: no dtype in the file name
    tables = up.get_moe_configs(case.experts, case.inter, dtype) if case.x.is_cuda else None
    if tables:
        return dict(tables[min(tables, key=lambda m: abs(m - tokens))])
    args = (tokens, case.experts, case.inter, case.hidden, case.top_k, dtype)
    return up.get_default_config(*args)


def upstream_call(case: Case, up):
    from vllm.model_executor.layers.fused_moe.moe_align import moe_align_block_size

    tokens, top_k, dev = case.x.shape[0], case.top_k, case.x.device
    cfg = upstream_config(case, up)
    compute = {torch.bfloat16: up.tl.bfloat16, torch.float16: up.tl.float16}
    compute_type = compute.get(case.x.dtype, up.tl.float32)
    n1 = case.w13.shape[1]
    flags = dict(use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False,
                 use_int4_w4a16=False, per_channel_quant=False)  # fmt: skip

    def call():
        if tokens * top_k * 4 <= case.experts:  # its naive block assignment
            sorted_ids, expert_ids = None, case.ids.view(-1)
            post = torch.full((1,), case.ids.numel() * cfg["BLOCK_SIZE_M"], dtype=torch.int32,
                              device=dev)  # fmt: skip
        else:
            sorted_ids, expert_ids, post = moe_align_block_size(
                case.ids, cfg["BLOCK_SIZE_M"], case.experts
            )
        c1 = torch.empty(tokens, top_k, n1, dtype=case.x.dtype, device=dev)
        c3 = torch.empty(tokens, top_k, case.hidden, dtype=case.x.dtype, device=dev)
        ids = (sorted_ids, expert_ids, post)
        first = (case.x, case.w13, c1, None, None, case.weights, *ids, False, top_k, cfg)
        up.invoke_fused_moe_triton_kernel(*first, compute_type, **flags)
        g = c1.view(-1, n1)
        if case.gated:
            h = torch.nn.functional.silu(g[:, : case.inter]) * g[:, case.inter :]
        else:
            h = torch.relu(g).square()
        second = (h, case.w2, c3, None, None, case.weights, *ids, True, 1, cfg)
        up.invoke_fused_moe_triton_kernel(*second, compute_type, **flags)
        return c3.sum(dim=1)

    return call


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b).norm() / b.norm().clamp_min(1e-30)).item()


def measure(fn, reps: int, timer) -> list[float]:
    if timer is None:  # CPU smoke: wall clock of the interpreter
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
        return samples
    return timer.samples(fn, reps)


def run_case(shape_name, shape, tokens, args, up, up_skip, floors, timer) -> dict:
    case = Case(shape, tokens, args.dtype, args.device, seed=tokens)
    nbytes, flops = case.work()
    byte_us = nbytes / floors["copy_gbps"] / 1e3
    flop_us = flops / floors["mm_tflops"] / 1e6
    row = {"shape": shape_name, "tokens": tokens, "bytes": nbytes, "flops": flops,
           "byte_floor_us": byte_us, "flop_floor_us": flop_us}  # fmt: skip
    want = case.reference()
    for name in args.providers:
        if name == "upstream" and up is None:
            row[name] = {"skipped": up_skip}
            continue
        try:
            fn = make_provider(name, case, up)
            err = rel(fn(), want)
            res = {"rel": err, "ok": math.isfinite(err) and err < TOL[args.dtype]}
            if res["ok"]:
                med, p20, p80 = summarize(measure(fn, args.reps, timer))
                floor = max(byte_us, flop_us)
                res.update(us=med, p20=p20, p80=p80, pct_floor=100 * floor / med)
        except Exception as exc:  # noqa: BLE001 - one provider's failure is noted
            res = {"error": repr(exc)[:300], "ok": False}
        row[name] = res
        print(f"  {name}: {res}", flush=True)
    return row


def _cell(res: dict) -> str:
    if "us" in res:
        return f"{res['us']:.1f} ({res['p20']:.1f}-{res['p80']:.1f})"
    if "skipped" in res:
        return "skip"
    return "err" if "error" in res else "FAIL"


def table(rows: list[dict], providers) -> str:
    head = "| shape | tokens | " + " | ".join(f"{p} us (p20-p80)" for p in providers)
    head += " | byte floor us | FLOP floor us | ours % of floor | upstream / ours | checks |"
    lines = [head, "|" + " --- |" * (len(providers) + 7)]
    for r in rows:
        ours, upr = r.get("ours", {}), r.get("upstream", {})
        ratio = upr["us"] / ours["us"] if "us" in ours and "us" in upr else float("nan")
        ok = all(r[p].get("ok", "skipped" in r[p]) for p in providers)
        cells = " | ".join(_cell(r[p]) for p in providers)
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {cells} | {r['byte_floor_us']:.1f} | "
            f"{r['flop_floor_us']:.1f} | {ours.get('pct_floor', float('nan')):.0f}% | "
            f"{ratio:.2f}x | {'ok' if ok else 'FAIL'} |"
        )
    return "\n".join(lines)


def matmul_tflops(timer) -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    us = summarize(timer.samples(lambda: a @ a, 10))[0]
    return 2 * 8192**3 / us / 1e6


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="1,16,64,256,4096")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--providers", default=",".join(PROVIDERS))
    p.add_argument("--reps", type=int, default=None, help="timed calls (25; smoke 1)")
    p.add_argument("--out", default=None, help="folder for fused_moe_bench.{json,md}")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, CPU, interpreter, fp32")
    args = p.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module imports
        shapes, args.device, args.dtype = SMOKE_SHAPES, "cpu", torch.float32
        tokens = [1, 5] if args.tokens == p.get_default("tokens") else args.tokens.split(",")
    else:
        if not torch.cuda.is_available():
            sys.exit("benchmark_fused_moe: needs a CUDA GPU (or --smoke)")
        shapes = {n: SHAPES[n] for n in args.shapes.split(",")}
        args.device, args.dtype, tokens = "cuda", torch.bfloat16, args.tokens.split(",")
    args.providers = args.providers.split(",")
    args.reps = args.reps or (1 if args.smoke else 25)
    up, up_skip = upstream_module()
    timer = None if args.smoke else ColdTimer()
    floors = {"copy_gbps": 1.0, "mm_tflops": 1.0}
    if timer is not None:
        floors = {"copy_gbps": copy_gbps(timer=timer), "mm_tflops": matmul_tflops(timer)}
    device = "cpu (smoke)" if args.smoke else torch.cuda.get_device_name()
    rates = f"copy {floors['copy_gbps']:.0f} GB/s, bf16 matmul {floors['mm_tflops']:.0f} TFLOP/s"
    print(f"{device}: {rates}; upstream: {up_skip or 'loaded'}", flush=True)
    meta = {"command": " ".join(sys.argv), "commit": git_sha(), "device": device,
            "torch": torch.__version__, "triton": triton_version(), **floors,
            "upstream": up_skip or "vllm 0.33.0 (extracted)", "shapes": shapes}  # fmt: skip
    rows = []
    for name, shape in shapes.items():
        for t in tokens:
            print(f"{name}, {t} tokens:", flush=True)
            rows.append(run_case(name, shape, int(t), args, up, up_skip, floors, timer))
            if args.out:  # after every case: a run cut short keeps what it measured
                out = Path(args.out)
                out.mkdir(parents=True, exist_ok=True)
                text = json.dumps({"meta": meta, "rows": rows}, indent=1)
                (out / "fused_moe_bench.json").write_text(text)
                (out / "fused_moe_bench.md").write_text(table(rows, args.providers) + "\n")
    print(table(rows, args.providers))
    return rows


def failed(rows: list[dict]) -> list[str]:
    """The (case, provider) pairs whose check failed or raised: the run then exits 1."""
    bad = []
    for r in rows:
        for name in PROVIDERS:
            res = r.get(name)
            if res is not None and not res.get("ok", "skipped" in res):
                bad.append(
                    f"{name} at { {k: v for k, v in r.items() if isinstance(v, (int, str))} }"
                )
    return bad


if __name__ == "__main__":
    problems = failed(main())
    if problems:
        print("FAILED checks:", *problems, sep="\n  ", file=sys.stderr)
        sys.exit(1)
