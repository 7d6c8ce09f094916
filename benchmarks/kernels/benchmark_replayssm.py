"""Replayed decode (ReplaySSM) against the every-step state update, ours and upstream's.

    python -m benchmarks.kernels.benchmark_replayssm [--batches 1,8,32,128,256,512]
        [--state-dtypes float32,bfloat16] [--buffer-len 16] [--tune | --tune-flush] [--out DIR]

One Codestral-7B layer shape (128 heads x 64 x 128 state, 8 groups, bf16 activations),
state lines drawn at random from the pool. Providers, side by side in one run:

- ``ours``: the every-step fused update (``ops/mamba_ssm_triton``);
- ``ours_replay``: the replayed update (``ops/mamba_ssm_replay``), per-step average over
  L steps, the flush included (every row flushes on the same step, as upstream's do here);
- ``upstream`` / ``upstream_replay``: vLLM 0.33.0's ``selective_state_update`` and its
  ReplaySSM output-only kernels, imported from ``upstream_vllm033`` (extracted from the
  wheel, never committed: put its parent folder on PYTHONPATH); skipped, with the reason,
  when absent. Upstream's host-side ring position and flush flag per step are precomputed.

Each provider is first checked over 2L steps of fresh random inputs against the PyTorch
every-step update with an fp32 state (rel-L2 of all outputs, and of the state after the
last step, which both replayed providers have just flushed). Timing: a CUDA graph of L
steps over K layers (distinct pools, K chosen so they exceed the L2 several times, as the
64 layers of a decode step do), replayed; microseconds per layer-step, median (p20, p80).
Bytes per step: every-step, each state line read and written; replayed, read every step,
written every L-th, plus the ring's mean (L-1)/2 entries read and one written (x, B, dt);
plus x, B, C, dt and out. % of copy: of the device-to-device copy measured in the same run.
``--tune`` sweeps the replayed kernel's launch configurations per batch bucket and writes
the winners as a launch table (``NVIDIA_H200.json`` form, into --out); ``--tune-flush`` keeps
the table's tiles and tries only the other flush variants on them. ``--smoke``: a tiny
shape on the CPU under the Triton interpreter (checks only; times are meaningless).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch

from benchmarks.common.run_info import git_sha
from benchmarks.kernels.benchmark_utils import copy_gbps, graph_samples, summarize
from vllm.model_executor.layers.mamba.ops import mamba_ssm_replay as replay
from vllm.model_executor.layers.mamba.ops.mamba_ssm_torch import (
    selective_state_update_torch,
)
from vllm.model_executor.layers.mamba.ops.mamba_ssm_triton import (
    selective_state_update_triton,
)
from vllm.triton_utils import configs

H, P, N, G = 128, 64, 128, 8
DEVICE = "cuda"
ACT = torch.bfloat16
L2_BYTES = 60 << 20
PROVIDERS = ("ours", "ours_replay", "upstream", "upstream_replay")
# Bounds on rel-L2 against the fp32-state reference, by state dtype. Upstream's replayed
# flush rounds its decayed inputs to the activation dtype before its product, so its states
# carry that rounding whatever the state dtype: it is held to the bf16 bound.
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def upstream_ops():
    """(selective_state_update, replayssm output-only) of vLLM 0.33.0, or the reason not."""
    try:
        from upstream_vllm033.ops.mamba_ssm import selective_state_update
        from upstream_vllm033.ops.selective_state_update_replayssm_output_only import (
            selective_state_update_replayssm_output_only,
        )
    except Exception as err:  # noqa: BLE001 - any import failure skips the provider
        return None, f"{type(err).__name__}: {err}"
    ssm = sys.modules["upstream_vllm033.ops.mamba_ssm"]
    for level in ("debug", "info", "warning"):  # the shim's logger is a plain one
        if not hasattr(ssm.logger, f"{level}_once"):
            setattr(ssm.logger, f"{level}_once", getattr(ssm.logger, level))
    if DEVICE == "cpu":  # its config lookup names the CUDA device
        ssm.get_ssm_device_name = lambda: "cpu"
    return (selective_state_update, selective_state_update_replayssm_output_only), None


class Case:
    """K layers of ``lines`` state lines (line 0 unused: upstream's null block) and one
    step's inputs for ``batch`` rows on distinct random lines."""

    def __init__(self, batch: int, state_dtype: torch.dtype, L: int, layers: int, seed: int):
        self.batch, self.dtype, self.L, self.layers = batch, state_dtype, L, layers
        self.lines = batch + 1
        self.gen = torch.Generator().manual_seed(seed)
        # States come from a generator on the device: a batch of 512 is 2 GiB of them.
        self.state_gen = torch.Generator(DEVICE).manual_seed(seed)
        g = self.gen
        self.idx = (1 + torch.randperm(batch, generator=g)).to(DEVICE, torch.int32)
        self.A = -(torch.rand(H, generator=g) + 0.5).to(DEVICE)
        self.D = torch.rand(H, generator=g).to(DEVICE)
        self.dt_bias = (torch.rand(H, generator=g) - 3).to(DEVICE)
        self.inputs = self.draw()

    def draw(self):
        g, b = self.gen, self.batch
        x, dt = torch.randn(b, H, P, generator=g), torch.randn(b, H, generator=g)
        B, C = torch.randn(b, G, N, generator=g), torch.randn(b, G, N, generator=g)
        return tuple(t.to(DEVICE, ACT) for t in (x, dt, B, C))

    def state(self) -> torch.Tensor:
        shape = (self.lines, H, P, N)
        return torch.randn(shape, generator=self.state_gen, device=DEVICE).to(self.dtype)


def make_provider(name: str, case: Case, states: list[torch.Tensor], up):
    """step(s, layer, inputs, out) for each of the case's layers (their pools: ``states``)."""
    A, D, dtb, idx, L = case.A, case.D, case.dt_bias, case.idx, case.L
    kw = dict(D=D, dt_bias=dtb, dt_softplus=True, state_batch_indices=idx)
    if name == "ours":
        return lambda s, k, i, out: selective_state_update_triton(
            states[k], *_sw(i, A), **kw, out=out
        )
    if name == "ours_replay":
        rings = [_our_ring(st, L) for st in states]
        return lambda s, k, i, out: replay.replay_ssm_update(rings[k], *_sw(i, A), **kw, out=out)
    ssu, rssm = up
    At, Dt, dtbt = (
        A[:, None, None].expand(H, P, N),
        D[:, None].expand(H, P),
        dtb[:, None].expand(H, P),
    )

    def tied(i):
        x, dt, B, C = i
        return x, dt[:, :, None].expand(-1, -1, P), At, B, C

    if name == "upstream":
        return lambda s, k, i, out: ssu(states[k], *tied(i), Dt, dtbt, dt_softplus=True,
                                         state_batch_indices=idx, out=out)  # fmt: skip
    caches = [_up_ring(case) for _ in states]
    pos = [torch.full((case.batch,), s, dtype=torch.int32, device=DEVICE) for s in range(L)]
    flush = [p == L - 1 for p in pos]
    bc = torch.empty(case.batch, G, L, dtype=torch.float32, device=DEVICE)

    def step(s, k, i, out):
        xc, dc, Bc = caches[k]
        rssm(states[k], *tied(i), D=Dt, dt_bias=dtbt, dt_softplus=True, x_cache=xc,
             dt_cache=dc, B_cache=Bc, bc_pre=bc, write_pos=pos[s % L], is_flush=flush[s % L],
             max_cache_len=L, state_batch_indices=idx, out=out)  # fmt: skip

    return step


def _sw(inputs, A):
    x, dt, B, C = inputs
    return x, dt, A, B, C


def _our_ring(state, L):
    lines = state.shape[0]
    z = dict(device=DEVICE)
    return replay.ReplayedSSMState(
        state,
        torch.zeros(lines, H, L - 1, P, dtype=ACT, **z),
        torch.zeros(lines, G, L - 1, N, dtype=ACT, **z),
        torch.zeros(lines, H, L - 1, dtype=torch.float32, **z),
        torch.zeros(lines, H, P, dtype=torch.int8, **z),
    )


def _up_ring(case):
    z, lines, L = dict(device=DEVICE), case.lines, case.L
    return (
        torch.zeros(lines, H, L, P, dtype=ACT, **z),
        torch.zeros(lines, H, L, dtype=torch.float32, **z),
        torch.zeros(lines, G, L, N, dtype=ACT, **z),
    )


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check(name: str, case: Case, up) -> dict:
    """2L steps of fresh inputs on one pool vs the fp32-state PyTorch update."""
    state = case.state()
    ref = state.to(torch.float32, copy=True)
    step = make_provider(name, case, [state], up)
    kw = dict(D=case.D, dt_bias=case.dt_bias, dt_softplus=True, state_batch_indices=case.idx)
    ys, want = [], []
    for s in range(2 * case.L):
        inputs = case.draw()
        out = torch.full_like(inputs[0], float("nan"))
        step(s, 0, inputs, out)
        ys.append(out)
        want.append(selective_state_update_torch(ref, *_sw(inputs, case.A), **kw))
    lines = case.idx.long()
    res = {
        "y_rel": rel(torch.stack(ys), torch.stack(want)),
        "state_rel": rel(state[lines], ref[lines]),
    }
    bound = TOL[torch.bfloat16 if name == "upstream_replay" else case.dtype]
    res["ok"] = all(math.isfinite(v) and v < bound for v in res.values())
    return res


def time_provider(name: str, case: Case, up) -> list[float]:
    states = [case.state() for _ in range(case.layers)]
    step = make_provider(name, case, states, up)
    out = torch.empty_like(case.inputs[0])
    calls = case.L * case.layers

    def cycle():
        for s in range(case.L):
            for k in range(case.layers):
                step(s, k, case.inputs, out)

    if DEVICE == "cpu":
        cycle()
        t0 = time.perf_counter()
        cycle()
        return [(time.perf_counter() - t0) * 1e6 / calls]
    samples = graph_samples(cycle, calls=1, replays=10)
    return [t / calls for t in samples]


def step_bytes(batch: int, dtype: torch.dtype, L: int | None) -> float:
    """Bytes one layer-step must move (see the module docstring); L None: every step."""
    a, es = 2, torch.empty((), dtype=dtype).element_size()
    state = H * P * N * es
    io = 2 * H * P * a + 2 * G * N * a + H * a
    if L is None:
        return batch * (2 * state + io)
    entry = H * P * a + G * N * a + H * 4
    return batch * (state + state / L + entry * ((L - 1) / 2 + (L - 1) / L) + io)


def tune_configs():
    # State rows per program x dstate tile x warps, around the table's picks (BLOCK_N 32-64,
    # BLOCK_P 16-64, 1-2 warps): the replayed kernel streams the state in BLOCK_N tiles and
    # holds the ring's tiles too, so the dstate tile is swept with the rest.
    return [dict(BLOCK_P=bp, BLOCK_N=bn, num_warps=nw) for bp, bn, nw in TUNE]


TUNE = tuple(
    (bp, bn, nw) for bp in (16, 32, 64) for bn in (32, 64, 128) for nw in (1, 2, 4)
    if bp * bn <= 64 * 64 or nw > 1
)  # fmt: skip


# The flushes --tune tries on the fastest tiles (the loop's is the tiles' own entry): the
# dots; bc_pre (B_k . C by a launch ahead) with the loop, the dots or a split step;
# fuse_flush with the loop and the dots (unroll, prefetch, the split step lost: their pages).
_BC = ({}, {"flush": "tf32x3"}, {"flush": "xsplit"}, {"split_flush": True})
FLUSH_VARIANTS = ({"flush": "tf32x3"}, {"flush": "xsplit"}, *({"bc_pre": True, **v} for v in _BC),
                  *({"fuse_flush": True, **v} for v in _BC[:3]))  # fmt: skip


def _with(cfg: dict, fn, *a):
    original = replay.launch_config
    replay.launch_config = lambda *_, cfg=cfg: dict(cfg)
    try:
        return fn(*a)
    finally:
        replay.launch_config = original


def check_with(cfg: dict, case: Case, up) -> dict:
    return _with(cfg, check, "ours_replay", case, up)


def time_with(cfg: dict, case: Case, up) -> float:
    return summarize(_with(cfg, time_provider, "ours_replay", case, up))[0]


def run_case(batch, dtype, args, gbps, up, up_skip, entries) -> dict:
    layers = max(1, min(64, math.ceil(4 * L2_BYTES / (batch * H * P * N * dtype.itemsize))))
    layers = min(layers, 2) if DEVICE == "cpu" else layers
    case = Case(batch, dtype, args.buffer_len, layers, seed=batch)
    row = {"batch": batch, "state_dtype": str(dtype).removeprefix("torch."), "layers": layers}
    original = replay.launch_config
    # Batches between buckets (256) run the next bucket's entry: only the buckets are tuned.
    if (args.tune or args.tune_flush) and replay.batch_bucket(batch) == batch:
        best, chosen = None, None  # --tune-flush: the table's tiles only, with the loop
        entry = {k: v for k, v in replay.launch_config(batch, P, N, dtype).items()
                 if k not in ("flush", "split_flush", "bc_pre", "fuse_flush")}  # fmt: skip
        for cfg in [entry] if args.tune_flush else tune_configs():
            try:
                us = time_with(cfg, case, up)
            except Exception as err:  # noqa: BLE001 - a config that fails is skipped, noted
                row.setdefault("tune", []).append({**cfg, "error": repr(err)[:200]})
                continue
            row.setdefault("tune", []).append({**cfg, "us": us})
            if best is None or us < best:
                best, chosen = us, cfg
        # The other flushes, and the step split in two launches, on the chosen tiles: taken
        # when faster and no less exact (final states within 2x the loop's rel-L2, or 1e-6).
        base = check_with(chosen, case, up)
        tiles = chosen
        for variant in FLUSH_VARIANTS:
            cfg = {**tiles, **variant}
            try:
                res = check_with(cfg, case, up)
                us = time_with(cfg, case, up)
            except Exception as err:  # noqa: BLE001 - a config that fails is skipped, noted
                row["tune"].append({**cfg, "error": repr(err)[:200]})
                continue
            exact = res["state_rel"] <= max(2 * base["state_rel"], 1e-6)
            row["tune"].append({**cfg, "us": us, "state_rel": res["state_rel"], "exact": exact})
            if exact and us < best:
                best, chosen = us, cfg
        key = configs.table_key(
            batch=replay.batch_bucket(batch), dstate=N, headdim=P, state_dtype=dtype
        )
        entries[key] = chosen
        replay.launch_config = lambda *a: dict(chosen)
    try:
        for name in PROVIDERS:
            if name.startswith("upstream") and up is None:
                row[name] = {"skipped": up_skip}
                continue
            try:
                res = check(name, case, up)
                med, p20, p80 = summarize(time_provider(name, case, up))
            except Exception as err:  # noqa: BLE001 - one provider's failure is noted
                row[name] = {"error": repr(err)[:300]}
                print(f"  {name}: {row[name]['error']}", flush=True)
                continue
            nbytes = step_bytes(batch, dtype, case.L if name.endswith("replay") else None)
            res.update(us=med, p20=p20, p80=p80, bytes=nbytes, gbps=nbytes / med / 1e3)
            res["pct_copy"] = 100 * res["gbps"] / gbps
            row[name] = res
            print(f"  {name}: {med:.1f} us ({res['pct_copy']:.0f}% of copy), y rel "
                  f"{res['y_rel']:.1e}, state rel {res['state_rel']:.1e}", flush=True)  # fmt: skip
    finally:
        replay.launch_config = original
    return row


def table(rows: list[dict]) -> str:
    head = "| state | batch | " + " | ".join(f"{p} us" for p in PROVIDERS)
    head += " | replay GB/s (% copy) | ours_replay vs ours | vs upstream_replay | checks |"
    lines = [head, "|" + " --- |" * (len(PROVIDERS) + 6)]
    nan = float("nan")
    for r in rows:
        us = [r[p].get("us") for p in PROVIDERS]
        cells = [f"{u:.1f}" if u else ("err" if "error" in r[p] else "skip") for u, p in
                 zip(us, PROVIDERS, strict=True)]  # fmt: skip
        o, orp, urp = (u or nan for u in (us[0], us[1], us[3]))
        ok = all(r[p].get("ok", "skipped" in r[p]) for p in PROVIDERS)
        mine = r["ours_replay"]
        lines.append(
            f"| {r['state_dtype']} | {r['batch']} | {' | '.join(cells)} | "
            f"{mine.get('gbps', nan):.0f} ({mine.get('pct_copy', nan):.0f}%) | "
            f"{o / orp:.2f}x | {urp / orp:.2f}x | {'ok' if ok else 'FAIL'} |"
        )
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,8,32,128,256,512")
    p.add_argument("--state-dtypes", default="float32,bfloat16")
    p.add_argument("--buffer-len", type=int, default=16)
    p.add_argument("--tune", action="store_true")
    p.add_argument("--tune-flush", action="store_true", help="--tune on the table's tiles only")
    p.add_argument("--out", default=None, help="folder for replayssm.json (+ the table)")
    p.add_argument("--smoke", action="store_true", help="tiny shape, CPU, interpreter")
    args = p.parse_args(argv)
    global H, P, N, G, DEVICE, ACT
    if args.smoke:  # fp16 activations: the interpreter's bf16 arithmetic is not exact
        H, P, N, G, DEVICE, ACT = 4, 16, 16, 2, "cpu", torch.float16
    up, up_skip = upstream_ops()
    gbps = 1.0 if args.smoke else copy_gbps()
    device = "cpu (smoke)" if args.smoke else torch.cuda.get_device_name()
    print(f"{device}: device copy {gbps:.0f} GB/s; upstream: "
          f"{'loaded' if up else up_skip}", flush=True)  # fmt: skip
    meta = {
        "command": " ".join(sys.argv),
        "commit": git_sha(),
        "device": device,
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "copy_gbps": gbps,
        "buffer_len": args.buffer_len,
    }
    rows, entries = [], {}
    for dtype, batch in itertools.product(args.state_dtypes.split(","), args.batches.split(",")):
        print(f"{dtype} state, batch {batch}:", flush=True)
        row = run_case(int(batch), getattr(torch, dtype), args, gbps, up, up_skip, entries)
        rows.append(row)
        if args.out:  # after every case: a run cut short keeps what it measured
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            text = json.dumps({"meta": meta, "rows": rows}, indent=1)
            (out / "replayssm.json").write_text(text)
            if entries:
                configs.write_table(out / f"{configs.device_file_name()}.json", entries, meta)
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
