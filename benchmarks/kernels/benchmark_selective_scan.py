"""Mamba1's selective scan and decode update (issue 33, item 4), one run.

    python -m benchmarks.kernels.benchmark_selective_scan [--cases 1x8192,16x512]
        [--decode-batches 1,32,128] [--state-dtypes float32,bfloat16] [--reps 25] [--out DIR]
    python -m benchmarks.kernels.benchmark_selective_scan --smoke    # CPU, interpreter

falcon-mamba-7b's layer shape: dim (d_inner) 8192, dstate 16, bf16 activations (u, delta,
z, y, B, C), A, D and the dt bias fp32, softplus on; fp32 and bf16 state pools. Prefill
cases ``SxL`` are S sequences of L tokens, every one starting from its pool line's state
(initial states on) on random distinct lines; the decode update runs batches of one token
per sequence.

Providers:

- ``ours``: ``ops/selective_scan.selective_scan_fn`` (prefill; the launch table's chunk
  plan) and ``selective_state_update_mamba1`` (decode);
- ``hf``: transformers' PyTorch path for the prefill: the undecorated
  ``mamba_selective_scan`` of ``models/falcon_mamba/modeling_falcon_mamba.py`` (else of
  ``models/mamba/modeling_mamba.py``, the same math; in neither: skipped, saying why): its
  token loop, the one ``FalconMambaMixer.slow_forward`` runs without mamba_ssm (unwrapped so
  that an installed mamba_ssm is not picked instead), on the (S, dim, L) layout it takes. It has
  no initial state (it starts from zeros): it is checked against the reference from zeros
  and timed so; its (S, dim, L, dstate) fp32 intermediates are its own cost. Decode has no
  HF op to call (the step is inline in ``slow_forward``): none there.
- the byte floor: bytes / the device-copy bandwidth measured in the same run (u, delta, z
  read and y written in bf16, B and C, each sequence's state line read and written).

Next to them, the compute bounds docs/selective_scan.md derives for the H200 (Triton 3.6's
SASS of the scan loop, one channel per thread): SFU, 18 ex2 per (token, channel) at 16 per
clock per SM; issue, 217 instructions per (token, channel) per warp-lane at one per clock
per scheduler (528 at 1.98 GHz). A chunked plan rescans every chunk after a sequence's
first (~165 instructions per token and channel for the first pass of those chunks): the
``issue`` bound counts that (``passes``).

Checks before timing: each provider's y and final states against the fp32 reference
(``selective_scan_ref``), rel-L2 under TOL. Timing: ColdTimer (L2 flushed, launches
hidden), median and p20/p80. ``--smoke``: tiny shapes on the CPU under TRITON_INTERPRET=1
(fp16 activations; checks only; times are the interpreter's wall clock).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks.common.run_info import git_sha, triton_version
from benchmarks.kernels.benchmark_utils import ColdTimer, copy_gbps, summarize

DIM, DSTATE, ACT = 8192, 16, torch.bfloat16
# H200 bounds of docs/selective_scan.md: SFU results and scheduler issue per second.
SFU_PER_S = 132 * 16 * 1.98e9
ISSUE_PER_S = 528 * 1.98e9
EX2_PER_TD, INSTR_PER_TD, INSTR_FIRST_PASS = 18, 217, 165
# rel-L2 bounds against the fp32 reference: y in bf16 (fp16 in smoke) and the pool's dtype.
TOL = {torch.float32: 2e-2, torch.bfloat16: 3e-2, torch.float16: 2e-2}


def hf_scan():
    """transformers' PyTorch scan (unwrapped from its kernel-hub decorator), or the reason."""
    import importlib

    reasons = []
    for name in ("falcon_mamba.modeling_falcon_mamba", "mamba.modeling_mamba"):
        try:
            m = importlib.import_module(f"transformers.models.{name}")
            fn = inspect.unwrap(m.mamba_selective_scan)
        except Exception as err:  # noqa: BLE001 - no transformers (or no such op): next
            reasons.append(f"{name}: {type(err).__name__}: {err}")
            continue
        if fn.__code__.co_filename == m.__file__:
            return fn, None
        reasons.append(f"{name}: unwraps to {fn.__module__}, not the PyTorch path")
    return None, "skipped: " + "; ".join(reasons)


class Case:
    """``seqs`` sequences of ``length`` tokens (decode: length 1), pool lines at random."""

    def __init__(self, seqs, length, state_dtype, device, seed=0):
        g = torch.Generator().manual_seed(seed)
        n, d, self.seqs, self.length = seqs * length, DIM, seqs, length
        self.device, self.state_dtype = device, state_dtype

        def act(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(device, ACT)

        self.u, self.delta, self.z = act(n, d), act(n, d, scale=0.5), act(n, d)
        self.B, self.C = act(n, DSTATE), act(n, DSTATE)
        self.A = (-torch.exp(torch.rand(d, DSTATE, generator=g) * 2)).to(device)
        self.D = torch.rand(d, generator=g).to(device)
        self.bias = (torch.rand(d, generator=g) - 4).to(device)
        lines = 2 * seqs + 1
        self.pool0 = (torch.randn(lines, d, DSTATE, generator=g) * 0.5).to(device, state_dtype)
        self.idx = (1 + torch.randperm(lines - 1, generator=g)[:seqs]).to(device, torch.int32)
        self.qsl = (torch.arange(seqs + 1) * length).to(device, torch.int32)
        self.init = torch.ones(seqs, dtype=torch.bool, device=device)

    def params(self):
        return dict(D=self.D, z=self.z, delta_bias=self.bias, delta_softplus=True)

    def reference(self, initial: bool):
        from vllm.model_executor.layers.mamba.ops.selective_scan_ref import selective_scan_ref

        pool = self.pool0.to(torch.float32, copy=True)
        init = self.init if initial else torch.zeros_like(self.init)
        y = selective_scan_ref(self.u, self.delta, self.A, self.B, self.C, self.qsl, pool,
                               self.idx, init, **self.params())  # fmt: skip
        return y.float(), pool[self.idx.long()]

    def nbytes(self) -> float:
        a, es = ACT.itemsize, self.state_dtype.itemsize
        n = self.seqs * self.length
        return float(4 * n * DIM * a + 2 * n * DSTATE * a + 2 * self.seqs * DIM * DSTATE * es)


def bounds(case: Case) -> dict:
    """Byte-independent H200 bounds (us): SFU and issue, one pass and with the rescan."""
    from vllm.model_executor.layers.mamba.ops.selective_scan import chunk_plan

    n, td = case.seqs * case.length, case.seqs * case.length * DIM
    chunk, _ = chunk_plan(n, case.seqs, DIM, DSTATE, ACT)
    later = case.seqs * max(0, case.length - chunk)  # tokens in chunks after the first
    passes = 1 + later / n * INSTR_FIRST_PASS / INSTR_PER_TD
    sfu = td * EX2_PER_TD / SFU_PER_S * 1e6
    issue = td / 32 * INSTR_PER_TD * passes / ISSUE_PER_S * 1e6
    return {"chunk_len": chunk, "passes": passes, "sfu_us": sfu, "issue_us": issue}


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def prefill_provider(name, case: Case, hf):
    """(call, check) for a fresh pool each call: check returns (y, final states)."""
    from vllm.model_executor.layers.mamba.ops.selective_scan import selective_scan_fn

    if name == "ours":
        pool = case.pool0.clone()

        def call():
            return selective_scan_fn(case.u, case.delta, case.A, case.B, case.C, case.qsl,
                                     pool, case.idx, case.init, **case.params())  # fmt: skip

        def check():
            pool.copy_(case.pool0)
            return call(), pool[case.idx.long()]

        return call, check
    s, L = case.seqs, case.length

    def batch(t):  # (S * L, X) -> (S, X, L), the layout HF's scan takes
        return t.view(s, L, -1).transpose(1, 2)

    def call():
        return hf(batch(case.u), batch(case.delta), case.A, batch(case.B), batch(case.C),
                  D=case.D, z=batch(case.z), delta_bias=case.bias, delta_softplus=True,
                  return_last_state=True)  # fmt: skip

    def check():
        y, state = call()
        return y.transpose(1, 2).reshape(s * L, DIM), state

    return call, check


def update_call(case: Case):
    from vllm.model_executor.layers.mamba.ops.selective_scan import (
        selective_state_update_mamba1,
    )

    pool = case.pool0.clone()

    args = (pool, case.u, case.delta, case.A, case.B, case.C)

    def call():
        return selective_state_update_mamba1(*args, **case.params(), state_batch_indices=case.idx)

    def check():
        pool.copy_(case.pool0)
        return call(), pool[case.idx.long()]

    return call, check


def measure(fn, reps, timer) -> list[float]:
    if timer is None:  # CPU smoke: wall clock of the interpreter
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e6)
        return out
    return timer.samples(fn, reps)


def run_one(name, call, check, want, reps, timer, tol, floor_us) -> dict:
    try:
        y, state = check()
        res = {"y_rel": rel(y, want[0]), "state_rel": rel(state, want[1])}
        res["ok"] = all(math.isfinite(v) and v < tol for v in res.values())
        if res["ok"]:
            med, p20, p80 = summarize(measure(call, reps, timer))
            res.update(us=med, p20=p20, p80=p80, pct_floor=100 * floor_us / med)
    except Exception as exc:  # noqa: BLE001 - one provider's failure is noted
        res = {"error": repr(exc)[:300], "ok": False}
    print(f"  {name}: {res}", flush=True)
    return res


def run_case(kind, seqs, length, dtype, args, gbps, hf, hf_skip, timer) -> dict:
    case = Case(seqs, length, dtype, args.device, seed=seqs * 7 + length)
    nbytes = case.nbytes()
    floor_us = nbytes / gbps / 1e3
    tol = TOL[dtype]
    row = {"op": kind, "seqs": seqs, "tokens": seqs * length,
           "state_dtype": str(dtype).removeprefix("torch."), "bytes": nbytes,
           "byte_floor_us": floor_us}  # fmt: skip
    if kind == "decode":
        from vllm.model_executor.layers.mamba.ops.selective_scan_ref import (
            selective_state_update_ref,
        )

        pool = case.pool0.to(torch.float32, copy=True)
        y = selective_state_update_ref(pool, case.u, case.delta, case.A, case.B, case.C,
                                       **case.params(), state_batch_indices=case.idx)  # fmt: skip
        want = (y.float(), pool[case.idx.long()])
        row["ours"] = run_one("ours", *update_call(case), want, args.reps, timer, tol, floor_us)
        return row
    row.update(bounds(case))
    want = case.reference(initial=True)
    call, check = prefill_provider("ours", case, hf)
    row["ours"] = run_one("ours", call, check, want, args.reps, timer, tol, floor_us)
    if "hf" in args.providers:
        if hf is None:
            row["hf"] = {"skipped": hf_skip}
        else:  # HF starts from zeros and keeps a bf16 state between tokens
            call, check = prefill_provider("hf", case, hf)
            row["hf"] = run_one("hf", call, check, case.reference(initial=False),
                                args.hf_reps, timer, TOL[torch.bfloat16], floor_us)  # fmt: skip
    return row


def _cell(res: dict | None) -> str:
    if not res:
        return "-"
    if "us" in res:
        return f"{res['us']:.1f} ({res['p20']:.1f}-{res['p80']:.1f})"
    return "skip" if "skipped" in res else ("err" if "error" in res else "FAIL")


def table(rows) -> str:
    head = (
        "| op | state | seqs x tokens | ours us (p20-p80) | hf us (p20-p80) | byte floor us | "
        "ours % of floor | SFU bound us | issue bound us (passes) | hf / ours | checks |"
    )
    lines = [head, "|" + " --- |" * 11]
    nan = float("nan")
    for r in rows:
        ours, hf = r["ours"], r.get("hf")
        ratio = f"{hf['us'] / ours['us']:.1f}x" if hf and "us" in hf and "us" in ours else "-"
        ok = all(p.get("ok", "skipped" in p) for p in (ours, hf) if p)
        issue = f"{r['issue_us']:.0f} ({r['passes']:.2f})" if "issue_us" in r else "-"
        sfu = f"{r['sfu_us']:.0f}" if "sfu_us" in r else "-"
        lines.append(
            f"| {r['op']} | {r['state_dtype']} | {r['seqs']} x {r['tokens'] // r['seqs']} | "
            f"{_cell(ours)} | {_cell(hf)} | {r['byte_floor_us']:.1f} | "
            f"{ours.get('pct_floor', nan):.0f}% | {sfu} | {issue} | {ratio} | "
            f"{'ok' if ok else 'FAIL'} |"
        )
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="1x8192,16x512", help="prefill: SEQSxTOKENS, comma list")
    p.add_argument("--decode-batches", default="1,32,128")
    p.add_argument("--state-dtypes", default="float32,bfloat16")
    p.add_argument("--providers", default="ours,hf")
    p.add_argument("--reps", type=int, default=None, help="timed calls (25; smoke 1)")
    p.add_argument("--hf-reps", type=int, default=None, help="HF's timed calls (3; smoke 1)")
    p.add_argument("--out", default=None, help="folder for selective_scan_bench.{json,md}")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, CPU, interpreter")
    args = p.parse_args(argv)
    global DIM, DSTATE, ACT
    if args.smoke:  # fp16: the interpreter's bf16 arithmetic is not exact
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module imports
        DIM, DSTATE, ACT, args.device = 8, 4, torch.float16, "cpu"
        if args.cases == p.get_default("cases"):
            args.cases, args.decode_batches = "1x70,2x4", "1,3"  # 1x70: two chunks
    elif not torch.cuda.is_available():
        sys.exit("benchmark_selective_scan: needs a CUDA GPU (or --smoke)")
    else:
        args.device = "cuda"
    args.providers = args.providers.split(",")
    args.reps = args.reps or (1 if args.smoke else 25)
    args.hf_reps = args.hf_reps or (1 if args.smoke else 3)
    hf, hf_skip = hf_scan()
    timer = None if args.smoke else ColdTimer()
    gbps = 1.0 if timer is None else copy_gbps(timer=timer)
    device = "cpu (smoke)" if args.smoke else torch.cuda.get_device_name()
    hf_name = hf_skip or f"{hf.__module__}.{hf.__name__}"
    print(f"{device}: copy {gbps:.0f} GB/s; hf: {hf_name}", flush=True)
    meta = {"command": " ".join(sys.argv), "commit": git_sha(), "device": device,
            "torch": torch.__version__, "triton": triton_version(), "copy_gbps": gbps,
            "dim": DIM, "dstate": DSTATE, "act": str(ACT), "hf": hf_name}  # fmt: skip
    work = [("prefill", *map(int, c.split("x"))) for c in args.cases.split(",") if c]
    work += [("decode", int(b), 1) for b in args.decode_batches.split(",") if b]
    rows = []
    for dtype in args.state_dtypes.split(","):
        for kind, seqs, length in work:
            print(f"{kind} {seqs} x {length}, {dtype} state:", flush=True)
            rows.append(run_case(kind, seqs, length, getattr(torch, dtype), args, gbps, hf,
                                 hf_skip, timer))  # fmt: skip
            if args.out:  # after every case: a run cut short keeps what it measured
                out = Path(args.out)
                out.mkdir(parents=True, exist_ok=True)
                text = json.dumps({"meta": meta, "rows": rows}, indent=1)
                (out / "selective_scan_bench.json").write_text(text)
                (out / "selective_scan_bench.md").write_text(table(rows) + "\n")
    print(table(rows))
    return rows


def failed(rows: list[dict]) -> list[str]:
    """The (case, provider) pairs whose check failed or raised: the run then exits 1."""
    bad = []
    for r in rows:
        for name in ("ours", "hf"):
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
