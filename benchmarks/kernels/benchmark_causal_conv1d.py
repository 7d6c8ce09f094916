"""Causal-conv1d benchmark: our Triton ops, our CUDA ops, the torch reference, and
Dao-AILab's ``causal_conv1d`` package when it is importable.

    python -m benchmarks.kernels.benchmark_causal_conv1d [--quick] [--dims 8448 ...]
        [--cases prefill mixed decode] [--providers triton cuda torch dao] [--out DIR]

bf16, width 4, SiLU, bias; state pools of 1024 lines, sequences on shuffled lines.

- prefill: 2048, 8192, 32768 and 131072 tokens as 1 and as 16 equal sequences, no
  initial state.
- mixed: one 2048-token prefill with an initial state, then 15, 63 or 255 one-token
  decodes with initial states. Triton: one ``causal_conv1d_fn`` call. CUDA: the forward
  op on the prefill and the update op on the decodes, both writing into one output.
  Dao: its update on the decodes, its fn on the prefill with initial and final states,
  and a copy of the final state into the line (the old vLLM CUDA path; no concat).
- decode: 1, 8, 32, 128, 256 and 512 sequences of one token.

Each provider keeps its state pool in its own layout (Triton: feature-contiguous;
CUDA and Dao decode: width-contiguous; Dao mixed: feature-contiguous, as vLLM had it).
Before timing, each provider runs once on the case's data and is compared with the fp32
reference: every output within 2e-2 + 1e-2 * |ref| and no NaN, and the state pool equal
to the reference's, bit for bit (Dao's varlen prefill writes no states: not checked).
A provider that fails is not timed, and the run exits with 1.

Times (benchmark_utils.py): "cold" GPU time of one call (L2 flushed, host launch hidden
behind a GPU sleep), median with p20/p80, for every case; CUDA-graph replay (warm L2)
for mixed and decode; "host" = one eager call in a back-to-back loop (the larger of host
and GPU cost). The torch reference syncs with the host inside, so its cold time includes
its host time; it is not graph-captured. GB/s = bytes the op must move (x read, out
written, weight, bias, states read and written) / time; % copy is of the device-copy
bandwidth measured at the start of the same run.

Writes OUT/causal_conv1d_bench.{csv,md,json,png} with the GPU, versions, git sha and the
command line. ``--quick`` (one dim, fewer sizes and repetitions) runs in a few minutes.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import functools
import json
import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton

from benchmarks.kernels.benchmark_utils import (
    ColdTimer,
    copy_gbps,
    graph_samples,
    host_us,
    summarize,
)
from vllm import _custom_ops as cuda_ops
from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
    PAD_SLOT_ID,
    causal_conv1d_fn,
    causal_conv1d_ref,
    causal_conv1d_update,
    causal_conv1d_update_ref,
    compute_causal_conv1d_metadata,
)

DEVICE = "cuda"
DTYPE = torch.bfloat16
WIDTH = 4
NUM_LINES = 1024
PREFILL_SEQS = (1, 16)
MIXED_PREFILL = 2048
REPO = Path(__file__).resolve().parents[2]
PROVIDERS = ("triton", "cuda", "torch", "dao", "cuda-r4", "cuda-r8", "cuda-r16")
DEFAULT_PROVIDERS = ("triton", "cuda", "torch", "dao")
# cuda-r4 / cuda-r8 / cuda-r16: the CUDA forward with its row width forced (cuda: the launcher's
# choice), to compare the two; decode has no forward call, so they skip it.
ROW_BYTES = {"cuda": 0, "cuda-r4": 4, "cuda-r8": 8, "cuda-r16": 16}
OUR_PROVIDERS = (
    "triton",
    "cuda",
    "torch",
    "cuda-r4",
    "cuda-r8",
    "cuda-r16",
)  # their failures fail the run

SIZES = {
    False: dict(
        dims=(4096, 8448, 10240),
        prefill=(2048, 8192, 32768, 131072),
        mixed=(15, 63, 255),
        decode=(1, 8, 32, 128, 256, 512),
        cold_reps=30,
        graph_replays=15,
        host_calls=200,
    ),
    True: dict(
        dims=(8448,),
        prefill=(2048, 8192, 131072),
        mixed=(15, 255),
        decode=(1, 32, 512),
        cold_reps=15,
        graph_replays=10,
        host_calls=100,
    ),
}
TIME_BUDGET_S = 1.5  # per measurement of one provider on one case


# --------------------------------------------------------------------------
# Cases and their data
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    kind: str  # "prefill", "mixed" or "decode"
    dim: int
    lens: list[int]
    init: list[bool]

    @property
    def tokens(self) -> int:
        return sum(self.lens)

    @property
    def seqs(self) -> int:
        return len(self.lens)

    @property
    def label(self) -> str:
        if self.kind == "prefill":
            return f"T={self.tokens} x{self.seqs}"
        if self.kind == "mixed":
            return f"{MIXED_PREFILL}+{self.seqs - 1}"
        return f"B={self.seqs}"

    def bytes_moved(self) -> int:
        es = torch.finfo(DTYPE).bits // 8
        w1 = WIDTH - 1
        tokens = 2 * self.tokens * self.dim  # x read, out written
        params = self.dim * (WIDTH + 1)  # weight, bias
        states = (sum(self.init) + self.seqs) * self.dim * w1  # read where init, written
        return es * (tokens + params + states)


def make_cases(kinds, dims, sizes) -> list[Case]:
    cases = []
    for dim in dims:
        if "prefill" in kinds:
            for tokens in sizes["prefill"]:
                for seqs in PREFILL_SEQS:
                    cases.append(Case("prefill", dim, [tokens // seqs] * seqs, [False] * seqs))
        if "mixed" in kinds:
            for n in sizes["mixed"]:
                cases.append(Case("mixed", dim, [MIXED_PREFILL] + [1] * n, [True] * (n + 1)))
        if "decode" in kinds:
            for b in sizes["decode"]:
                cases.append(Case("decode", dim, [1] * b, [True] * b))
    return cases


@dataclasses.dataclass
class Inputs:
    x: torch.Tensor  # (dim, tokens), feature-contiguous
    weight: torch.Tensor
    bias: torch.Tensor
    pool_w: torch.Tensor  # (lines, dim, W-1) width-contiguous (CUDA, Dao decode)
    pool_f: torch.Tensor  # the same values, feature-contiguous (Triton, vLLM)
    qsl: torch.Tensor
    idx: torch.Tensor
    lines: list[int]
    init: torch.Tensor
    meta: object
    ref_out: torch.Tensor  # fp32, shaped like the op's output
    ref_pool: torch.Tensor  # expected pool after the call, DTYPE, width-contiguous

    @property
    def x_rows(self) -> torch.Tensor:
        """x as (tokens, dim) rows: the decode ops' input."""
        return self.x.t()


def build_inputs(case: Case, seed: int) -> Inputs:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    dim = case.dim
    x = torch.randn(case.tokens, dim, device=DEVICE, generator=g).to(DTYPE).t()
    weight = (0.5 * torch.randn(dim, WIDTH, device=DEVICE, generator=g)).to(DTYPE)
    bias = (0.2 * torch.randn(dim, device=DEVICE, generator=g)).to(DTYPE)
    pool_w = torch.randn(NUM_LINES, dim, WIDTH - 1, device=DEVICE, generator=g).to(DTYPE)
    pool_f = pool_w.transpose(1, 2).contiguous().transpose(1, 2)
    perm = 1 + torch.randperm(NUM_LINES - 1, device=DEVICE, generator=g)[: case.seqs]
    idx = perm.to(torch.int32)
    qsl_cpu = torch.tensor([0] + list(_cumsum(case.lens)), dtype=torch.int32)
    qsl = qsl_cpu.to(DEVICE)
    init = torch.tensor(case.init, device=DEVICE)
    meta = compute_causal_conv1d_metadata(qsl_cpu, DEVICE) if case.kind != "decode" else None
    # The fp32 reference: inputs are bf16 values, so its states are exact bf16 values.
    ref_pool = pool_w.float()
    if case.kind == "decode":
        ref_out = causal_conv1d_update_ref(
            x.t().float(), ref_pool, weight.float(), bias.float(), "silu", idx
        )
    else:
        ref_out = causal_conv1d_ref(
            x.float(), weight.float(), bias.float(), ref_pool, qsl, idx, init, "silu"
        )
    return Inputs(
        x,
        weight,
        bias,
        pool_w,
        pool_f,
        qsl,
        idx,
        perm.tolist(),
        init,
        meta,
        ref_out,
        ref_pool.to(DTYPE),
    )


def _cumsum(values):
    total = 0
    for v in values:
        total += v
        yield total


# --------------------------------------------------------------------------
# Providers
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Provider:
    """One implementation on one case: run(pool) -> result, on a pool in its layout."""

    run: Callable[[torch.Tensor], object]
    pool: torch.Tensor  # the initial pool, in this provider's layout
    collect: Callable[[object], torch.Tensor] = lambda out: out  # result -> ref's shape
    checks_states: bool = True
    graphable: bool = True
    note: str = ""


def triton_provider(case: Case, inp: Inputs) -> Provider:
    if case.kind == "decode":
        x = inp.x_rows

        def run(pool):
            return causal_conv1d_update(x, pool, inp.weight, inp.bias, "silu", inp.idx)
    else:

        def run(pool):
            return causal_conv1d_fn(
                inp.x,
                inp.weight,
                inp.bias,
                pool,
                inp.qsl,
                inp.idx,
                inp.init,
                "silu",
                metadata=inp.meta,
            )

    note = "one call" if case.kind == "mixed" else ""
    return Provider(run, inp.pool_f, note=note)


def cuda_provider(case: Case, inp: Inputs, row_bytes: int) -> Provider:
    upd = cuda_ops.causal_conv1d_update_cuda
    fwd = functools.partial(cuda_ops.causal_conv1d_fwd_cuda, row_bytes=row_bytes)
    if case.kind == "decode":
        x = inp.x_rows

        def run(pool):
            return upd(x, pool, inp.weight, inp.bias, True, inp.idx, PAD_SLOT_ID)

        return Provider(run, inp.pool_w)
    if case.kind == "prefill":

        def run(pool):
            return fwd(
                inp.x, inp.weight, inp.bias, pool, inp.qsl, inp.idx, inp.init, True, PAD_SLOT_ID
            )

        return Provider(run, inp.pool_w)
    # mixed: the prefill (sequence 0) through the forward op, the decodes through update
    n = MIXED_PREFILL
    x_pre, x_dec = inp.x[:, :n], inp.x[:, n:].t()
    qsl_pre, idx_pre, init_pre, idx_dec = inp.qsl[:2], inp.idx[:1], inp.init[:1], inp.idx[1:]
    dim, tokens = inp.x.shape

    def run(pool):
        out = torch.empty(tokens, dim, dtype=DTYPE, device=DEVICE).t()
        fwd(
            x_pre,
            inp.weight,
            inp.bias,
            pool,
            qsl_pre,
            idx_pre,
            init_pre,
            True,
            PAD_SLOT_ID,
            out=out[:, :n],
        )
        upd(x_dec, pool, inp.weight, inp.bias, True, idx_dec, PAD_SLOT_ID, out=out[:, n:].t())
        return out

    return Provider(run, inp.pool_w, note="split: fwd + update")


def torch_provider(case: Case, inp: Inputs) -> Provider:
    if case.kind == "decode":
        x = inp.x_rows

        def run(pool):
            return causal_conv1d_update_ref(x, pool, inp.weight, inp.bias, "silu", inp.idx)
    else:

        def run(pool):
            return causal_conv1d_ref(
                inp.x, inp.weight, inp.bias, pool, inp.qsl, inp.idx, inp.init, "silu"
            )

    return Provider(run, inp.pool_f, graphable=False, note="syncs: cold includes host")


def dao_provider(case: Case, inp: Inputs, dao) -> Provider:
    dao_fn, dao_update = dao
    if case.kind == "decode":
        x = inp.x_rows

        def run(pool):
            return dao_update(
                x, pool, inp.weight, inp.bias, activation="silu", conv_state_indices=inp.idx
            )

        return Provider(run, inp.pool_w, note="native layout")
    if case.kind == "prefill":
        x3 = inp.x.unsqueeze(0)  # (1, dim, tokens), channel-last
        seq_idx = None
        if case.seqs > 1:
            lens = torch.tensor(case.lens, device=DEVICE)
            seq_idx = torch.repeat_interleave(torch.arange(case.seqs, device=DEVICE), lens)
            seq_idx = seq_idx.to(torch.int32).unsqueeze(0)

        def run(pool):
            return dao_fn(x3, inp.weight, inp.bias, seq_idx=seq_idx, activation="silu")

        return Provider(
            run,
            inp.pool_w,
            collect=lambda out: out[0],
            checks_states=False,
            note="no state write" + (", seq_idx" if seq_idx is not None else ""),
        )
    # mixed: update(decodes) + fn(prefill, initial/final states) + copy of the final state
    n, line0 = MIXED_PREFILL, inp.lines[0]
    x_pre, x_dec, idx_dec = inp.x[:, :n].unsqueeze(0), inp.x[:, n:].t(), inp.idx[1:]

    def run(pool):
        out_dec = dao_update(
            x_dec, pool, inp.weight, inp.bias, activation="silu", conv_state_indices=idx_dec
        )
        out_pre, final = dao_fn(
            x_pre,
            inp.weight,
            inp.bias,
            initial_states=pool[line0 : line0 + 1],
            return_final_states=True,
            activation="silu",
        )
        pool[line0].copy_(final[0])
        return out_pre, out_dec

    def collect(result):
        out_pre, out_dec = result
        return torch.cat([out_pre[0], out_dec.t()], dim=1)

    return Provider(run, inp.pool_f, collect=collect, note="split: update + fn + copy")


def load_dao():
    """(causal_conv1d_fn, causal_conv1d_update), version; or None and why not."""
    try:
        import causal_conv1d
        from causal_conv1d import causal_conv1d_fn as dao_fn
        from causal_conv1d import causal_conv1d_update as dao_update
    except Exception as e:  # any import failure just means "not available"
        return None, f"not importable ({type(e).__name__}: {e})"
    return (dao_fn, dao_update), getattr(causal_conv1d, "__version__", "unknown version")


# --------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    kind: str
    dim: int
    case: str
    tokens: int
    seqs: int
    provider: str
    mbytes: float
    status: str = "ok"  # ok, FAIL (wrong results), ERROR (raised), n/a
    max_abs_err: float = math.nan
    rel_l2: float = math.nan
    states_exact: bool | None = None
    cold_us: float = math.nan
    cold_p20: float = math.nan
    cold_p80: float = math.nan
    graph_us: float = math.nan
    graph_p20: float = math.nan
    graph_p80: float = math.nan
    host_us: float = math.nan
    cold_gbps: float = math.nan
    cold_pct_copy: float = math.nan
    graph_gbps: float = math.nan
    graph_pct_copy: float = math.nan
    note: str = ""


def check(provider: Provider, inp: Inputs, res: Result) -> None:
    """Run once on a fresh pool and compare with the reference (sets res.status)."""
    pool = provider.pool.clone()
    result = provider.run(pool)
    out = provider.collect(result).float()
    ref = inp.ref_out
    diff = (out - ref).abs()
    finite = not bool(torch.isnan(out).any())
    within = bool((diff <= 2e-2 + 1e-2 * ref.abs()).all())
    res.max_abs_err = diff.max().item() if diff.numel() else 0.0
    res.rel_l2 = (diff.norm() / ref.norm().clamp_min(1e-30)).item() if diff.numel() else 0.0
    if provider.checks_states:
        res.states_exact = torch.equal(pool, inp.ref_pool)
    ok = finite and within and res.states_exact is not False
    if not ok:
        res.status = "FAIL"
        res.note = (
            f"nan={not finite} within_tol={within} states_exact={res.states_exact}; " + res.note
        ).strip("; ")


def measure(provider: Provider, case: Case, res: Result, sizes, timer, copy):
    pool = provider.pool.clone()

    def call():
        return provider.run(pool)

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    call()
    torch.cuda.synchronize()
    est_s = time.perf_counter() - t0  # one warm eager call: sizes the repetitions
    reps = max(5, min(sizes["cold_reps"], int(TIME_BUDGET_S / (est_s + 4e-4))))
    res.cold_us, res.cold_p20, res.cold_p80 = summarize(timer.samples(call, reps))
    nbytes = case.bytes_moved()
    res.cold_gbps = nbytes / res.cold_us / 1e3
    res.cold_pct_copy = 100 * res.cold_gbps / copy
    if provider.graphable and case.kind in ("mixed", "decode"):
        try:
            samples = graph_samples(call, calls=20, replays=sizes["graph_replays"])
        except Exception as e:  # a provider that cannot be captured is reported, not fatal
            res.note = f"{res.note}; graph capture failed: {type(e).__name__}".strip("; ")
        else:
            res.graph_us, res.graph_p20, res.graph_p80 = summarize(samples)
            res.graph_gbps = nbytes / res.graph_us / 1e3
            res.graph_pct_copy = 100 * res.graph_gbps / copy
    if res.provider != "torch":
        n = max(5, min(sizes["host_calls"], int(TIME_BUDGET_S / max(est_s, 1e-5))))
        res.host_us = host_us(call, n=n)


def run_case(case, providers, sizes, timer, copy, dao, seed) -> list[Result]:
    inp = build_inputs(case, seed)
    results = []
    for name in providers:
        res = Result(
            case.kind, case.dim, case.label, case.tokens, case.seqs, name, case.bytes_moved() / 1e6
        )
        if name in ROW_BYTES and not cuda_ops.cuda_ops_available():
            res.status, res.note = "n/a", "CUDA ops not built"
        elif ROW_BYTES.get(name) and case.kind == "decode":
            res.status, res.note = "n/a", "no forward call in decode"
        elif name == "dao" and dao is None:
            res.status, res.note = "n/a", "causal_conv1d not importable"
        else:
            try:
                if name == "triton":
                    provider = triton_provider(case, inp)
                elif name in ROW_BYTES:
                    provider = cuda_provider(case, inp, ROW_BYTES[name])
                elif name == "torch":
                    provider = torch_provider(case, inp)
                else:
                    provider = dao_provider(case, inp, dao)
                res.note = provider.note
                check(provider, inp, res)
                if res.status == "ok":
                    measure(provider, case, res, sizes, timer, copy)
            except Exception as e:  # reported in the results; the run goes on
                res.status = "ERROR"
                res.note = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            torch.cuda.synchronize()
        results.append(res)
        print(_progress_line(res), flush=True)
    del inp
    torch.cuda.empty_cache()
    return results


def _progress_line(r: Result) -> str:
    parts = [f"{r.kind:7s} D={r.dim:<5d} {r.case:16s} {r.provider:8s} {r.status:5s}"]
    if r.status == "ok":
        parts.append(f"cold {r.cold_us:9.1f} us ({r.cold_pct_copy:5.1f}% copy)")
        if not math.isnan(r.graph_us):
            parts.append(f"graph {r.graph_us:8.2f} us")
        if not math.isnan(r.host_us):
            parts.append(f"host {r.host_us:8.1f} us")
        parts.append(f"maxerr {r.max_abs_err:.3g}")
    if r.note:
        parts.append(f"[{r.note}]")
    return "  ".join(parts)


# --------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------


def environment(args, copy_start) -> dict:
    def git(*cmd):
        try:
            return subprocess.run(
                ["git", "-C", str(REPO), *cmd], capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    # VLLM_RUN_SHA: see benchmarks/common/run_info.py (a copied tree may carry a stale .git).
    sha = os.environ.get("VLLM_RUN_SHA")
    if not sha:
        sha = git("rev-parse", "HEAD")
        if sha is not None and git("status", "--porcelain", "--untracked-files=no"):
            sha += " (with uncommitted changes)"
    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "git_sha": sha or "unknown (no git repository)",
        "command": "python " + shlex.join([str(Path(sys.argv[0])), *sys.argv[1:]]),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "copy_gbps_start": round(copy_start, 1),
        "quick": args.quick,
        "dtype": "bf16",
        "width": WIDTH,
        "cuda_ops": "built" if cuda_ops.cuda_ops_available() else "not built",
    }


def _fmt(v, digits=1):
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def _cell_time(r: Result, which: str) -> str:
    if r.status != "ok":
        return r.status
    med, lo, hi = (
        getattr(r, f"{which}_us"),
        getattr(r, f"{which}_p20"),
        getattr(r, f"{which}_p80"),
    )
    if math.isnan(med):
        return ""
    digits = 2 if med < 100 else 1
    return f"{med:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def markdown(env, results, copy_end, dao_note) -> str:
    lines = [
        "# Causal-conv1d benchmark",
        "",
        f"- GPU: {env['gpu']}; torch {env['torch']} (CUDA {env['cuda']}); triton {env['triton']}",
        f"- git: {env['git_sha']}; {env['date_utc']} UTC",
        f"- command: `{env['command']}`",
        f"- device copy (4 GiB `b.copy_(a)`, cold median): {env['copy_gbps_start']:.0f} GB/s at "
        f"the start, {copy_end:.0f} GB/s at the end; % copy is of the first",
        f"- bf16, width {WIDTH}, SiLU, bias; pools of {NUM_LINES} lines, shuffled lines",
        f"- providers: triton (ours), cuda (ours: {env['cuda_ops']}), torch (fp32 "
        f"reference), dao ({dao_note})",
        "- times in us: median [p20, p80]. cold = GPU time, L2 flushed, host hidden; graph = "
        "per call in a CUDA graph, warm L2; host = one eager call, back to back. "
        "GB/s and % copy: bytes moved / cold time (graph time for decode)",
        "",
    ]
    providers = [p for p in PROVIDERS if any(r.provider == p for r in results)]
    for kind in ("prefill", "mixed", "decode"):
        for dim in sorted({r.dim for r in results if r.kind == kind}):
            rows = [r for r in results if r.kind == kind and r.dim == dim]
            lines += _kind_table(kind, dim, rows, providers)
    failed = [r for r in results if r.status in ("FAIL", "ERROR")]
    if failed:
        lines += ["## Failures", ""]
        lines += [
            f"- {r.kind} D={r.dim} {r.case} {r.provider}: {r.status} {r.note}" for r in failed
        ]
        lines.append("")
    notes = sorted({f"{r.provider}: {r.note}" for r in results if r.note and r.status == "ok"})
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)


def _kind_table(kind, dim, rows, providers) -> list[str]:
    """One row per case; per provider its time columns, % copy and host cost. A provider
    that did not run (n/a everywhere) and columns with no value at all are left out."""
    primary = "graph" if kind == "decode" else "cold"
    pct = "graph_pct_copy" if kind == "decode" else "cold_pct_copy"
    metrics = {
        "prefill": [
            ("cold us", "cold"),
            ("GB/s", "cold_gbps"),
            ("% copy", pct),
            ("host us", "host_us"),
        ],
        "mixed": [
            ("cold us", "cold"),
            ("% copy", pct),
            ("graph us", "graph"),
            ("host us", "host_us"),
        ],
        "decode": [
            ("graph us", "graph"),
            ("cold us", "cold"),
            ("% copy", pct),
            ("host us", "host_us"),
        ],
    }[kind]

    def cell(r: Result | None, metric: str) -> str:
        if r is None:
            return ""
        if metric in ("cold", "graph"):
            return _cell_time(r, metric)
        return (
            _fmt(getattr(r, metric), 0 if metric.endswith("gbps") else 1)
            if r.status == "ok"
            else ""
        )

    labels = list(dict.fromkeys(r.case for r in rows))
    by_case = {label: {r.provider: r for r in rows if r.case == label} for label in labels}
    columns = [
        ("case", lambda label: label),
        ("MB", lambda label: f"{by_case[label][next(iter(by_case[label]))].mbytes:.1f}"),
    ]
    for p in providers:
        if all(
            by_case[label].get(p) is None or by_case[label][p].status == "n/a" for label in labels
        ):
            continue
        for title, metric in metrics:
            columns.append(
                (f"{p} {title}", lambda label, p=p, m=metric: cell(by_case[label].get(p), m))
            )
    if "triton" in providers and "cuda" in providers:

        def ratio(label):
            t, c = by_case[label].get("triton"), by_case[label].get("cuda")
            if t and c and t.status == c.status == "ok":
                return _fmt(getattr(c, f"{primary}_us") / getattr(t, f"{primary}_us"), 2)
            return ""

        columns.append((f"cuda/triton {primary} time", ratio))
    table = [[fn(label) for _, fn in columns] for label in labels]
    keep = [i for i in range(len(columns)) if i < 2 or any(row[i] for row in table)]
    head = [columns[i][0] for i in keep]
    out = [f"## {kind}, dim {dim}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(row[i] for i in keep) + " |" for row in table]
    return out + [""]


def plot(results, path: Path, copy) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no plot"
    ok = [r for r in results if r.status == "ok"]
    dims = sorted({r.dim for r in ok})
    if not dims:
        return "nothing to plot"
    fig, axes = plt.subplots(len(dims), 3, figsize=(16, 4.2 * len(dims)), squeeze=False)
    for row, dim in zip(axes, dims, strict=True):
        ax = row[0]
        for p in PROVIDERS:
            for seqs, style in ((16, "-o"), (1, "--x")):
                pts = [
                    (r.tokens, r.cold_pct_copy)
                    for r in ok
                    if r.kind == "prefill" and r.dim == dim and r.provider == p and r.seqs == seqs
                ]
                if pts:
                    ax.plot(*zip(*sorted(pts), strict=True), style, label=f"{p} x{seqs}")
        ax.set(
            xscale="log",
            xlabel="tokens",
            ylabel="% of copy bandwidth (cold)",
            title=f"prefill, dim {dim}",
            ylim=(0, 100),
        )
        for ax, kind, which, xlabel in (
            (row[1], "mixed", "cold", "decodes"),
            (row[2], "decode", "graph", "batch"),
        ):
            for p in PROVIDERS:
                pts = [
                    (r.seqs - (kind == "mixed"), getattr(r, f"{which}_us"))
                    for r in ok
                    if r.kind == kind and r.dim == dim and r.provider == p
                ]
                pts = [pt for pt in pts if not math.isnan(pt[1])]
                if pts:
                    ax.plot(*zip(*sorted(pts), strict=True), "-o", label=p)
            ax.set(
                xscale="log",
                yscale="log",
                xlabel=xlabel,
                ylabel=f"{which} us",
                title=f"{kind}, dim {dim}",
            )
        for ax in row:
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
            ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"causal-conv1d, bf16, width {WIDTH} (copy {copy:.0f} GB/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one dim, fewer sizes and reps")
    parser.add_argument("--dims", type=int, nargs="+", help="dims (default: per --quick)")
    parser.add_argument(
        "--cases",
        nargs="+",
        choices=("prefill", "mixed", "decode"),
        default=["prefill", "mixed", "decode"],
    )
    parser.add_argument(
        "--providers", nargs="+", choices=PROVIDERS, default=list(DEFAULT_PROVIDERS)
    )
    parser.add_argument(
        "--out", type=Path, default=REPO / "docs" / "benchmarks" / "raw", help="output directory"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmark_causal_conv1d: needs a CUDA GPU", file=sys.stderr)
        return 2
    sizes = SIZES[args.quick]
    dims = tuple(args.dims) if args.dims else sizes["dims"]
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    dao, dao_note = load_dao()
    timer = ColdTimer()
    copy = copy_gbps(timer=timer)
    torch.cuda.empty_cache()
    env = environment(args, copy)
    print(
        f"{env['gpu']}: device copy {copy:.0f} GB/s; CUDA ops {env['cuda_ops']}; dao {dao_note}",
        flush=True,
    )

    results = []
    for i, case in enumerate(make_cases(args.cases, dims, sizes)):
        results += run_case(case, args.providers, sizes, timer, copy, dao, args.seed + i)
    copy_end = copy_gbps(timer=timer)
    torch.cuda.empty_cache()

    stem = args.out / "causal_conv1d_bench"
    fields = [f.name for f in dataclasses.fields(Result)]
    with open(f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(dataclasses.asdict(r) for r in results)
    env["copy_gbps_end"] = round(copy_end, 1)
    env["dao"] = dao_note
    env["seconds"] = round(time.perf_counter() - started, 1)
    with open(f"{stem}.json", "w") as f:
        json.dump(
            {"environment": env, "results": [dataclasses.asdict(r) for r in results]}, f, indent=1
        )
    table = markdown(env, results, copy_end, dao_note)
    Path(f"{stem}.md").write_text(table)
    png = plot(results, Path(f"{stem}.png"), copy)
    print()
    print(table)
    print(f"wrote {stem}.csv, .json, .md; plot: {png}; {env['seconds']} s")
    bad = [r for r in results if r.status in ("FAIL", "ERROR") and r.provider in OUR_PROVIDERS]
    if bad:
        print(f"{len(bad)} of our provider runs failed their check or raised", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
