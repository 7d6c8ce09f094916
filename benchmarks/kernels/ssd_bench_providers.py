"""The SSD benchmark's providers (benchmark_ssd.py says what each one is).

Upstream vLLM 0.33.0's Triton SSD is imported as the package ``upstream_vllm033`` (its
``ops/ssd_*.py`` and helpers from the PyPI wheel, with small shims for its imports of
vllm's platforms, triton_utils and envs), which is never committed: the GPU run carries the
folder that holds it and puts it on ``PYTHONPATH``. Without it the provider says why.

``make_provider`` gives ``(run, plan)``: ``run(pool) -> y`` does one call on the case's
data, reading initial states from and writing final states to the pool lines of the
sequences; ``plan()`` rebuilds the host-side layout (None where there is none). Or it
gives a string: why the provider cannot run here.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import torch


def first_line(err: Exception) -> str:
    """An exception as one line, with the source line that raised it (an assert's text)."""
    message = str(err).strip().splitlines()[0] if str(err).strip() else ""
    text = type(err).__name__ + (f": {message}" if message else "")
    frame = traceback.extract_tb(err.__traceback__)[-1]
    return f"{text} (at {Path(frame.filename).name}:{frame.lineno}: {frame.line})"[:300]


def load_ops(providers) -> dict:
    """Each provider family's entry points, or the reason it cannot run."""
    ops = {}
    if "triton" in providers:
        try:
            from vllm.model_executor.layers.mamba.ops import ssd_combined

            ops["triton"] = (
                ssd_combined.plan_ssd_chunks,
                ssd_combined.mamba_chunk_scan_combined_varlen,
            )
        except ImportError as err:
            ops["triton"] = f"ssd_combined not importable ({err})"
    if "upstream" in providers:
        try:
            from upstream_vllm033.ops import ssd_combined as upstream

            ops["upstream"] = upstream
            if not torch.cuda.is_available():
                _first_config_only(upstream)
        except ImportError as err:
            ops["upstream"] = (
                f"upstream_vllm033 not importable ({err}): put the folder holding it on PYTHONPATH"
            )
    if {"mamba_ssm", "mamba_ssm_batch"} & set(providers):
        from benchmarks.common.mamba_ssm_import import import_mamba_ssm_triton, interpreter_shims

        try:
            ops["mamba_ssm"] = import_mamba_ssm_triton()
        except ImportError as err:
            ops["mamba_ssm"] = str(err)
        else:
            if not torch.cuda.is_available():
                interpreter_shims()
    return ops


def compile_autotune_configs_in_parallel(workers: int | None = None) -> None:
    """Make every Triton autotuner compile all of a key's configs at once, in threads
    (Triton releases the GIL while compiling), before it benchmarks them one by one: its
    own loop compiles each config as it reaches it, which at upstream's and mamba_ssm's
    dozens of configs per kernel costs minutes of device time. What the autotuner then
    measures and picks is unchanged. Process-wide; a failure leaves the plain path."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    from triton.runtime._async_compile import AsyncCompileMode
    from triton.runtime.autotuner import Autotuner

    original = Autotuner.run
    if getattr(original, "_parallel", False):
        return

    def run(self, *args, **kwargs):
        try:
            nargs = {**dict(zip(self.arg_names, args, strict=False)), **kwargs}
            named = {k: v for k, v in nargs.items() if k in self.arg_names}
            key = [named[k] for k in self.keys if k in named]
            key += [str(v.dtype) for v in named.values() if hasattr(v, "dtype")]
            if len(self.configs) > 1 and tuple(key) not in self.cache:
                rest = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
                n = workers or os.cpu_count() or 1
                with ThreadPoolExecutor(n) as pool, AsyncCompileMode(pool, ignore_errors=True):
                    for config in self.prune_configs(kwargs):
                        self.fn.warmup(*args, grid=(1,), **rest, **config.all_kwargs())
        except Exception:  # the autotuner's own path still compiles what is missing
            pass
        return original(self, *args, **kwargs)

    run._parallel = True
    Autotuner.run = run


def upstream_autotune_choices() -> dict:
    """What upstream's autotuners chose in this run: per kernel, each key it was called
    with (shapes, dtypes) and the config it timed best (block sizes, warps, stages), so a
    compile comparison can be read against the config that actually ran (docs/ssd.md)."""
    import sys

    from triton.runtime.autotuner import Autotuner

    out = {}
    for name, mod in sorted(sys.modules.items()):
        if not name.startswith("upstream_vllm033.ops") or mod is None:
            continue
        for attr, value in sorted(vars(mod).items()):
            if isinstance(value, Autotuner) and getattr(value, "cache", None):
                out[f"{name.rsplit('.', 1)[-1]}.{attr}"] = {
                    str(key): str(config) for key, config in value.cache.items()
                }
    return out


def _first_config_only(module) -> None:
    """Under the interpreter (CPU smoke) an autotuner would time every config: keep each of
    the upstream kernels' autotuners at its first."""
    import sys

    from triton.runtime.autotuner import Autotuner

    for name, mod in list(sys.modules.items()):
        if name.startswith("upstream_vllm033.ops"):
            for value in vars(mod).values():
                if isinstance(value, Autotuner):
                    value.configs = value.configs[:1]


def _kw(inp) -> dict:
    return dict(D=inp.D, dt_bias=inp.dt_bias, dt_softplus=True)


def _initial(inp, pool):
    """The sequences' initial states from the pool: their lines, or zeros without one."""
    return torch.where(inp.init[:, None, None, None], pool.index_select(0, inp.idx.long()), 0.0)


def _triton(case, inp, plan, scan):
    def make_layout():
        return plan(inp.qsl_cpu, case.shape.chunk).to(inp.x.device)

    layout, out = make_layout(), torch.empty_like(inp.x)

    def run(pool):
        return scan(
            inp.x, inp.dt, inp.A, inp.B, inp.C, layout, pool, inp.idx, inp.init,
            out=out, **_kw(inp),
        )  # fmt: skip

    return run, make_layout


def _torch(case, inp):
    from vllm.model_executor.layers.mamba.ops import mamba_ssm_torch as mt

    lens = inp.qsl_cpu.diff()

    def make_layout():
        return mt.plan_chunked_scan(lens, case.shape.chunk).to(inp.x.device)

    layout, out = make_layout(), torch.empty_like(inp.x)

    def run(pool):  # as MambaMixer2 calls it
        _, final = mt.chunk_scan_varlen(
            inp.x, inp.dt, inp.A, inp.B, inp.C, layout, _initial(inp, pool), out=out, **_kw(inp)
        )
        pool.index_copy_(0, inp.idx.long(), final.to(pool.dtype))
        return out

    return run, make_layout


def _upstream(case, inp, upstream):
    """vLLM 0.33.0's ``mamba_chunk_scan_combined_varlen`` called as its Mamba2 mixer calls
    it: the step's chunk metadata built on the host beforehand (as vLLM's metadata builder
    does; ours likewise), the initial states gathered from the pool (zeros for sequences
    without one), the final states written into the pool by the kernel
    (``final_states_out``, ``final_state_indices``), ``state_dtype`` the pool's."""
    from vllm.model_executor.layers.mamba.ops.ssd_layout import plan_ssd_chunks

    dev = inp.x.device
    lay = plan_ssd_chunks(inp.qsl_cpu, case.shape.chunk)
    cu_seqlens = inp.qsl_cpu.to(dev)
    cu_chunk = lay.chunk_starts.to(dev)
    last_chunk = (lay.seq_chunk_starts[1:] - 1).to(dev)
    seq_idx = lay.chunk_seqs.to(dev)
    out = torch.empty_like(inp.x)

    def run(pool):
        initial = _initial(inp, pool) if any(case.init) else None
        upstream.mamba_chunk_scan_combined_varlen(
            inp.x, inp.dt, inp.A, inp.B, inp.C, case.shape.chunk, cu_seqlens=cu_seqlens,
            cu_chunk_seqlens=cu_chunk, last_chunk_indices=last_chunk, seq_idx=seq_idx,
            out=out, initial_states=initial, state_dtype=pool.dtype, final_states_out=pool,
            final_state_indices=inp.idx, **_kw(inp),
        )  # fmt: skip
        return out

    return run, None


def _mamba_ssm_packed(case, inp, scan):
    """One packed row (batch 1) with ``seq_idx``; initial states are per batch row in
    mamba_ssm's API, so with several sequences that have them the call is refused."""
    dev = inp.x.device
    cu = inp.qsl_cpu.to(dev)
    seq_idx = torch.repeat_interleave(
        torch.arange(case.seqs, dtype=torch.int32, device=dev), cu.diff()
    ).view(1, case.tokens)
    packed = (inp.x[None], inp.dt[None], inp.A, inp.B[None], inp.C[None], case.shape.chunk)

    def run(pool):
        if any(case.init):
            y, final = scan(
                *packed, initial_states=_initial(inp, pool), seq_idx=seq_idx,
                return_final_states=True, **_kw(inp),
            )  # fmt: skip
        else:
            y, final = scan(
                *packed, seq_idx=seq_idx, cu_seqlens=cu, return_varlen_states=True, **_kw(inp)
            )
        pool.index_copy_(0, inp.idx.long(), final.to(pool.dtype))
        return y[0]

    return run, None


def _mamba_ssm_batch(case, inp, scan):
    """A (seqs, len) batch of equal-length sequences, as HF transformers calls it."""
    if len(set(case.lens)) != 1:
        return "sequences of unequal lengths do not make a batch"

    def batch(t):
        return t.view(case.seqs, case.lens[0], *t.shape[1:])

    args = (batch(inp.x), batch(inp.dt), inp.A, batch(inp.B), batch(inp.C), case.shape.chunk)

    def run(pool):
        initial = _initial(inp, pool) if any(case.init) else None
        y, final = scan(*args, initial_states=initial, return_final_states=True, **_kw(inp))
        pool.index_copy_(0, inp.idx.long(), final.to(pool.dtype))
        return y.reshape(inp.x.shape)

    return run, None


def make_provider(name, case, inp, ops):
    if name == "torch":
        return _torch(case, inp)
    if name == "upstream":
        return (
            ops["upstream"]
            if isinstance(ops["upstream"], str)
            else _upstream(case, inp, ops["upstream"])
        )
    family = "triton" if name == "triton" else "mamba_ssm"
    if isinstance(ops[family], str):
        return ops[family]
    if name == "triton":
        return _triton(case, inp, *ops["triton"])
    scan = ops["mamba_ssm"].mamba_chunk_scan_combined
    if name == "mamba_ssm":
        return _mamba_ssm_packed(case, inp, scan)
    return _mamba_ssm_batch(case, inp, scan)
