"""One configuration of benchmark_tp.py, in a process of its own: an engine at one
tensor-parallel size and dtype, and what is measured through it.

    python -m benchmarks.tp.tp_bench_run SPEC.json OUT.json LOGITS.pt

benchmark_tp.py writes SPEC (its options plus ``tp``, ``dtype`` and ``role``) and reads
OUT (JSON) and LOGITS (``torch.save`` of the logits steps' fp32 logits, on the CPU). A
fresh process per configuration gives each engine the whole GPU memory and its own
torch.distributed state.

Role ``reference``: the logits steps only (the fp32 yardstick). Role ``bench``: also the
step latencies, the collectives each timed step makes (tp > 1), the time of those
all-reduces alone, and the throughput of ``LLM.generate``.

Steps go through the engine's executor to every rank's runner
(``executor.apply(forward, inputs)``: the inputs pickled to every rank as the engine's
steps are, every rank's forward, rank 0's logits back, no sampling), with inputs built by
hand (``StepInputs``) so that each step is exactly the one named. Decode-only steps replay
the engine's CUDA graphs where it captured them. Functions that must run on every rank go
through ``Worker.apply`` (``Engine.on_ranks``); they are module-level here, so they pickle
by name into the worker processes.
"""

from __future__ import annotations

import json
import os
import platform
import random
import sys
import time
from pathlib import Path

from benchmarks.common.model_shapes import named_config
from benchmarks.common.run_info import quantiles, triton_version

# The torch.distributed calls a step can make (communication_op's collectives).
COLLECTIVES = ("all_reduce", "all_gather", "gather", "broadcast")


def _stats(samples: list[float]) -> dict:
    return {**quantiles(samples), "n": len(samples)}


# -- the steps -----------------------------------------------------------------------------


def make_inputs(rows: list[tuple[int, int]], done: dict[int, int], rng, vocab: int):
    """A step of (slot, tokens) rows, one-token continuations first; every row samples its
    last token. ``done`` (slot: tokens already in its state) is advanced."""
    from vllm.step_io import StepInputs

    lens = [n for _, n in rows]
    contexts = [done.get(slot, 0) for slot, _ in rows]
    inp = StepInputs(
        lens=lens,
        slots=[slot for slot, _ in rows],
        contexts=contexts,
        num_decodes=sum(1 for n, c in zip(lens, contexts, strict=True) if n == 1 and c > 0),
    )
    inp.ids = [rng.randrange(vocab) for _ in range(sum(lens))]
    end = 0
    for n in lens:
        end += n
        inp.sample_rows.append(end - 1)
    for slot, n in rows:
        done[slot] = done.get(slot, 0) + n
    return inp


def logits_prompt_lens(n: int) -> tuple[int, int, int]:
    """The logits steps' three first prompts (their first step, the largest of them)."""
    return n, n // 2 + 1, n // 4 + 1


def logits_plan(n: int, decode_steps: int, vocab: int, seed: int) -> tuple[list, list[dict]]:
    """The fixed steps whose logits are compared: three fresh prompts (n, n/2 + 1, n/4 + 1
    tokens); a mixed step (two decodes, the third prompt continued, a fourth prompt);
    then ``decode_steps`` decodes of the four sequences."""
    rng, done = random.Random(seed), {}
    a, b, c = logits_prompt_lens(n)
    plan = [
        ("prefill", [(0, a), (1, b), (2, c)]),
        ("mixed", [(0, 1), (1, 1), (2, n // 4 + 1), (3, n // 2)]),
        *[("decode", [(s, 1) for s in range(4)]) for _ in range(decode_steps)],
    ]
    steps = [make_inputs(rows, done, rng, vocab) for _, rows in plan]
    info = [{"kind": k, "rows": len(r), "tokens": sum(t for _, t in r)} for k, r in plan]
    return steps, info


def latency_plan(spec: dict, vocab: int) -> list[tuple[str, object]]:
    """Decode steps of each batch size (every sequence one token, with a state) and one
    fresh ``prefill_len``-token prefill."""
    rng, out = random.Random(spec["seed"] + 1), []
    for b in spec["decode_batches"]:
        done = dict.fromkeys(range(b), 1)
        out.append((f"decode b={b}", make_inputs([(s, 1) for s in range(b)], done, rng, vocab)))
    n = spec["prefill_len"]
    out.append((f"prefill 1x{n}", make_inputs([(0, n)], {}, rng, vocab)))
    return out


# -- functions run on every rank (Worker.apply) ---------------------------------------------


def _layers(model):
    import torch

    n = model.config.num_hidden_layers
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return module
    raise ValueError(f"{type(model).__name__}: no ModuleList of its {n} layers")


def record_collectives(worker, inp) -> list[dict]:
    """The step ``inp`` run eagerly (graphs off, on every rank alike), every collective it
    makes noted: op, the tensor's shape and dtype, and the layer it ran in (None: outside
    the layers, e.g. the embedding and the LM head)."""
    import torch
    import torch.distributed as dist

    runner, where, calls = worker.runner, [None], []
    hooks = []
    for i, layer in enumerate(_layers(runner.model)):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: where.__setitem__(0, i)))
        hooks.append(layer.register_forward_hook(lambda m, a, o: where.__setitem__(0, None)))

    def noted(name, fn):
        def call(first, *args, **kwargs):
            t = first if isinstance(first, torch.Tensor) else args[0]
            dtype = str(t.dtype).removeprefix("torch.")
            calls.append({"op": name, "shape": list(t.shape), "dtype": dtype, "layer": where[0]})
            return fn(first, *args, **kwargs)

        return call

    originals = {name: getattr(dist, name) for name in COLLECTIVES}
    graphs, runner.graphs = runner.graphs, None
    try:
        for name, fn in originals.items():
            setattr(dist, name, noted(name, fn))
        runner.execute_inputs(inp)
        runner._sync()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        runner.graphs = graphs
        for hook in hooks:
            hook.remove()
    return calls


def time_all_reduce(worker, shape, dtype: str, warmup: int, iters: int, repeats: int) -> dict:
    """Microseconds per ``tensor_model_parallel_all_reduce`` (the layers' call, on the
    model's group) of a zero tensor of ``shape`` and ``dtype`` on this rank's device:
    ``iters`` calls back to back between two clock reads (CUDA events on a GPU), ``repeats``
    times, after ``warmup`` calls (which also line the ranks up)."""
    import torch

    from vllm.distributed import get_tp_group, tensor_model_parallel_all_reduce

    device = get_tp_group().device
    x = torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
    cuda = device.type == "cuda"
    for _ in range(warmup):
        tensor_model_parallel_all_reduce(x)
    if cuda:
        torch.cuda.synchronize(device)
    samples = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        for _ in range(iters):
            tensor_model_parallel_all_reduce(x)
        if cuda:
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / iters)
        else:
            samples.append((time.perf_counter() - t0) * 1e6 / iters)
    return {"us": _stats(samples), "bytes": x.numel() * x.element_size()}


def forward(worker, inp):
    """The step's forward on this rank (rank 0's result carries the logits)."""
    return worker.runner.execute_inputs(inp)


def rank_device(worker) -> str:
    import torch

    d = worker.runner.device
    return f"{d} ({torch.cuda.get_device_name(d)})" if d.type == "cuda" else str(d)


# -- the engine ------------------------------------------------------------------------------


class Engine:
    """An ``LLM`` of the spec's shape, tensor-parallel size and dtype, and its steps."""

    def __init__(self, spec: dict):
        from vllm import LLM

        t0 = time.perf_counter()
        self.llm = LLM(
            named_config(spec["model"]),
            load_format="dummy",
            dtype=spec["dtype"],
            device=spec["device"],
            seed=spec["seed"],
            tensor_parallel_size=spec["tp"],
            max_num_seqs=spec["max_num_seqs"],
            max_num_batched_tokens=spec["max_num_batched_tokens"],
            enforce_eager=spec["enforce_eager"],
            mamba_ssm_cache_dtype=spec["mamba_ssm_cache_dtype"],
        )
        self.runner = self.llm.engine.runner
        self.executor = self.llm.engine.engine_core.executor
        self.cuda = self.runner.device.type == "cuda"
        self.sync()
        self.startup_s = time.perf_counter() - t0
        self.vocab = self.runner.model.config.vocab_size

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.runner.device)

    def step(self, inp):
        return self.on_ranks(forward, inp)

    def on_ranks(self, fn, *args):
        """``fn(worker, *args)`` on every rank; rank 0's result."""
        return self.executor.apply(fn, *args)

    def uses_graph(self, inp) -> bool:
        g = self.runner.graphs
        n = len(inp.lens)
        return g is not None and inp.num_decodes == n == len(inp.sample_rows) and g.fits(n)

    def shutdown(self) -> None:
        self.llm.engine.core.shutdown()


def run_logits(eng: Engine, spec: dict) -> tuple[list, list[dict]]:
    steps, info = logits_plan(spec["logits_len"], spec["logits_decode_steps"], eng.vocab, 11)
    out = []
    for inp, row in zip(steps, info, strict=True):
        row["cuda_graph"] = eng.uses_graph(inp)
        out.append(eng.step(inp).logits.float().cpu())
    return out, info


def run_latency(eng: Engine, spec: dict) -> list[dict]:
    rows = []
    for name, inp in latency_plan(spec, eng.vocab):
        for _ in range(spec["warmup"]):
            eng.step(inp)
            eng.sync()
        samples = []
        for _ in range(spec["iters"]):
            t0 = time.perf_counter()
            eng.step(inp)
            eng.sync()
            samples.append((time.perf_counter() - t0) * 1e3)
        row = {"step": name, "tokens": len(inp.ids), "rows": len(inp.lens)}
        row.update(ms=_stats(samples), cuda_graph=eng.uses_graph(inp))
        if spec["tp"] > 1:
            row["collectives"] = eng.on_ranks(record_collectives, inp)
        rows.append(row)
    return rows


def run_all_reduce(eng: Engine, spec: dict, latency: list[dict]) -> list[dict]:
    """The time of each distinct all-reduce the timed steps made."""
    seen = []
    for row in latency:
        for c in row.get("collectives", []):
            key = (c["shape"], c["dtype"])
            if c["op"] == "all_reduce" and key not in seen:
                seen.append(key)
    out = []
    for shape, dtype in seen:
        args = (spec["allreduce_warmup"], spec["allreduce_iters"], spec["allreduce_repeats"])
        timed = eng.on_ranks(time_all_reduce, shape, dtype, *args)
        out.append({"shape": shape, "dtype": dtype, **timed})
    return out


def run_throughput(eng: Engine, spec: dict) -> dict:
    from vllm import SamplingParams

    rng = random.Random(spec["seed"])
    n_in, n_out = spec["input_len"], spec["output_len"]
    prompts = [[rng.randrange(eng.vocab) for _ in range(n_in)] for _ in range(spec["num_prompts"])]
    params = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
    eng.llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    eng.sync()
    steps = eng.llm.engine.num_steps
    t0 = time.perf_counter()
    outs = eng.llm.generate(prompts, params, use_tqdm=False)
    eng.sync()
    elapsed = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "num_prompts": len(prompts),
        "input_len": n_in,
        "output_len": n_out,
        "output_tokens": generated,
        "elapsed_s": elapsed,
        "output_tokens_per_s": generated / elapsed,
        "total_tokens_per_s": (generated + len(prompts) * n_in) / elapsed,
        "requests_per_s": len(prompts) / elapsed,
        "engine_steps": eng.llm.engine.num_steps - steps,
    }


def environment(spec: dict) -> dict:
    import torch

    from vllm.distributed.parallel_state import MULTICAST_OFF_ENV

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version(),
        "host": platform.node(),
        "env": {
            k: os.environ.get(k)
            for k in [*MULTICAST_OFF_ENV, "CUDA_VISIBLE_DEVICES", "VLLM_USE_TRITON_CONV1D"]
        },
    }
    if spec["device"] == "cuda":
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        try:
            v = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as err:  # noqa: BLE001 - a missing version must not end the run
            info["nccl"] = f"unknown ({type(err).__name__}: {err})"
    return info


def main(spec_path: str, out_path: str, logits_path: str) -> None:
    import torch

    spec = json.loads(Path(spec_path).read_text())
    eng = Engine(spec)
    try:
        res = {"spec": spec, "environment": environment(spec), "startup_s": eng.startup_s}
        res["engine_startup"] = eng.llm.engine.startup
        res["rank0_device"] = eng.on_ranks(rank_device)
        logits, res["logits_steps"] = run_logits(eng, spec)
        torch.save(logits, logits_path)
        if spec["role"] == "bench":
            res["latency"] = run_latency(eng, spec)
            res["all_reduce"] = run_all_reduce(eng, spec, res["latency"])
            res["throughput"] = run_throughput(eng, spec)
    finally:
        eng.shutdown()
    Path(out_path).write_text(json.dumps(res, indent=2, default=str))


if __name__ == "__main__":
    main(*sys.argv[1:4])
