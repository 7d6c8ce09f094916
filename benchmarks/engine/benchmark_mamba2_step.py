"""Forward time of one Mamba2 model step with each causal-conv1d backend.

    python -m benchmarks.engine.benchmark_mamba2_step                      # codestral-7b, bf16, GPU
    python -m benchmarks.engine.benchmark_mamba2_step --profile --out step.json
    python -m benchmarks.engine.benchmark_mamba2_step --model tiny --device cpu --prefill-len 32 \\
        --num-decodes 3 --decode-batch 4 --iters 2 --warmup 1

Steps (rows in the engine's order: decodes first, then the prefill):

- mixed: ``--num-decodes`` one-token decodes continuing their slots' states plus one
  ``--prefill-len``-token prefill (no initial state unless ``--prefill-has-initial-state``);
  the default, 255 + 2048, is the issue's "1 x 2048 prefill + 255 decodes";
- decode: ``--decode-batch`` one-token decodes, eager (the Triton backend takes
  ``causal_conv1d_update``);
- decode_graph (CUDA, unless ``--no-cuda-graph``): the same decodes replayed from the
  engine's CUDA graphs (``vllm/worker/cuda_graph.py``), all buckets up to the batch captured
  first; the capture time and the memory it took are reported;
- mixed_graph (CUDA, Triton backend, unless ``--no-cuda-graph``): the mixed step replayed
  from the graph of its bucket (``vllm/worker/mixed_graph.py``, cudagraph_mode FULL: padded
  to the bucket's tokens within ``--max-num-batched-tokens``), its host packing and upload
  included.

``--use-replayssm`` (default: off; the engine's own default is the GPU's, docs/replayssm.md)
gives the pool the replay rings of ``--replayssm-buffer-len`` steps, so decode rows take the
replayed update; each decode slot's counter starts at its slot number mod L (its ring
entries zero, a valid state), so every step flushes the share of rows a long-running engine
does, not all or none of them.

A step is the model forward plus the logits of the rows the engine samples (each decode and
the prefill's last token); the metadata is built once per step kind, outside the timing.
The logits of each backend's first mixed step (fresh pool) are checked to be finite and,
with both backends, compared (``check`` in the JSON).
The model is built once (dummy weights) and switched between backends with
``set_conv_backend``; each backend gets its own state pool, since the conv-state layout
differs (only one pool is alive at a time: the 7B pool of 256 slots holds 64 GiB of fp32
SSM state). States start at zero; the kernels' speed does not depend on the values.

Timing: CUDA events around each step, median (p20, p80) of ``--iters`` after ``--warmup``
(on CPU: ``time.perf_counter``); ``host ms`` is the time the host takes to issue the step.
``--profile`` then runs ``--profile-steps`` more steps of each kind under
``torch.profiler`` and splits the wall time into conv, scan, matmul, other and idle (see
``step_profile.py``), and lists, per eager step kind, the host's self time by event (aten
ops, CUDA runtime calls such as launches, and the Python between ops as the ranges' own
time): where the host's time to issue a step goes. The CUDA backend is skipped, with the
reason printed, when the CUDA ops are not built or the device is not CUDA.

Budget on an H200 (7B shape, defaults): a mixed step is a few hundred ms and an eager
256-decode step ~150-200 ms (the PyTorch scan reads and writes the 4 MiB fp32 SSM state of
each sequence per layer several times); model build, two pools, two graph captures (35
buckets each) and the profile bring the whole run to about 1.5 minutes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks.common.model_shapes import NAMED_CONFIGS
from benchmarks.common.run_info import cuda_skip_reason, git_sha
from benchmarks.engine.mamba2_step_report import markdown, profile_steps, timed


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="codestral-7b", choices=sorted(NAMED_CONFIGS))
    p.add_argument("--backends", default="triton,cuda", help="comma-separated: triton, cuda")
    p.add_argument("--num-decodes", type=int, default=255, help="decodes in the mixed step")
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--prefill-has-initial-state", action="store_true")
    p.add_argument("--decode-batch", type=int, default=256, help="sequences in the decode step")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument(
        "--no-cuda-graph", action="store_true", help="skip the decode_graph and mixed_graph steps"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the engine limit the mixed step's graph bucket is chosen within (default: the "
        "mixed step's own tokens, so a bucket holds it)",
    )
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-steps", type=int, default=2, help="profiled steps per kind")
    p.add_argument(
        "--mamba-ssm-cache-dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="dtype of the SSM state pool",
    )
    p.add_argument(
        "--use-replayssm",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="replayed decode (default off; the engine's default is the GPU's)",
    )
    p.add_argument("--replayssm-buffer-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(args.backends) - {"triton", "cuda"}
    if unknown:
        p.error(f"unknown backends {sorted(unknown)}: use triton and/or cuda")
    if args.prefill_len < 1 or args.num_decodes < 0 or args.decode_batch < 1 or args.iters < 1:
        p.error("need --prefill-len >= 1, --num-decodes >= 0, --decode-batch >= 1, --iters >= 1")
    if args.max_num_batched_tokens is None:  # a fixed 2,048 left the default step outside
        args.max_num_batched_tokens = args.num_decodes + args.prefill_len
    return args


class StepCase:
    """One step kind: its metadata (own builder, so it stays valid), ids and sampled rows.

    ``rows`` are (slot, tokens, has_initial_state), in the engine's order."""

    def __init__(self, model, device, rows: list[tuple[int, int, bool]], vocab: int, gen):
        import torch

        slots, lens, init = (list(col) for col in zip(*rows, strict=True))
        qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0, out=qsl[1:])
        self.builder = model.metadata_builder(device)
        start = time.perf_counter()
        self.md = self.builder.build(
            qsl, torch.tensor(slots, dtype=torch.int32), torch.tensor(init, dtype=torch.bool)
        )
        self.build_ms = (time.perf_counter() - start) * 1e3
        self.num_tokens = int(qsl[-1])
        self.ids = torch.randint(0, vocab, (self.num_tokens,), generator=gen).to(device)
        self.rows = (qsl[1:] - 1).long().to(device)  # each row's last token: sampled
        self.slots, self.lens, self.init = slots, lens, init

    def run(self, model, pool):
        from vllm.forward_context import ForwardContext, set_forward_context
        from vllm.model_executor.models.utils import bind_state_pool

        bind_state_pool(model, pool)
        with set_forward_context(ForwardContext(mamba2_metadata=self.md)):
            hidden = model(self.ids, None)
        return model.compute_logits(hidden.index_select(0, self.rows))


def decode_floor(model, pool, batch: int) -> dict:
    """The bytes a decode step of ``batch`` sequences must move, and their time at the
    measured copy bandwidth: every weight once (the embedding: ``batch`` rows), each
    sequence's SSM and conv state of every layer read and written once."""
    emb = model.backbone.embeddings.weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights -= emb.numel() * emb.element_size() - batch * emb.shape[1] * emb.element_size()
    if model.lm_head.weight is emb:
        weights += emb.numel() * emb.element_size()  # tied: the logits read it whole
    layers = pool.ssm_state.shape[0]
    ssm = 2 * layers * batch * pool.ssm_state[0, 0].numel() * pool.ssm_state.element_size()
    if pool.replay_len:  # read every step, written every L-th, the ring's mean traffic
        L = pool.replay_len
        ring = [pool.rings[name][0, 0] for name in ("ring_x", "ring_B", "ring_dt")]
        entry = sum(t.numel() * t.element_size() for t in ring) / (L - 1)
        ssm = ssm / 2 * (1 + 1 / L) + layers * batch * entry * ((L - 1) / 2 + (L - 1) / L)
    conv = 2 * layers * batch * pool.conv_state[0, 0].numel() * pool.conv_state.element_size()
    total = weights + ssm + conv
    from benchmarks.kernels.benchmark_utils import copy_gbps  # the kernels' "% of copy"

    bw = copy_gbps()
    return {
        "batch": batch,
        "bytes": total,
        "weight_bytes": weights,
        "ssm_state_bytes": ssm,
        "conv_state_bytes": conv,
        "copy_gbps": bw,
        "floor_ms": total / (bw * 1e9) * 1e3,
    }


def mixed_graph_step(model, case, mempool, args):
    """The mixed step replayed from the graph of its bucket within the engine's limits
    (``--max-num-batched-tokens``, ``max(num_decodes + 1, decode_batch)`` sequences), as
    ``cudagraph_mode`` FULL runs it, host packing and upload included; (step, capture)."""
    import torch

    from vllm.step_io import StepInputs
    from vllm.worker.mixed_graph import MixedGraphs

    lens, slots = case.lens, case.slots
    inp = StepInputs(
        lens=lens, slots=slots, contexts=[2 if i else 0 for i in case.init],
        num_decodes=args.num_decodes, ids=case.ids.tolist(),
        sample_rows=(case.rows.cpu()).tolist(),
    )  # fmt: skip
    graphs = MixedGraphs(model, case.builder, args.max_num_batched_tokens,
                         max(args.num_decodes + 1, args.decode_batch), mempool)  # fmt: skip
    selected = graphs.select(inp)
    if selected is None:
        raise SystemExit(f"the mixed step fits no mixed-graph bucket of {graphs.buckets}")
    t0 = time.perf_counter()
    reserved = torch.cuda.memory_reserved()
    graphs._graph(selected[0])
    torch.cuda.synchronize()
    capture = {
        "bucket": vars(selected[0]),
        "seconds": time.perf_counter() - t0,
        "memory_gib": (torch.cuda.memory_reserved() - reserved) / 2**30,
    }
    print(f"captured the mixed step's graph {capture}", flush=True)
    return (lambda: graphs.run(inp, selected, None)), capture


def run_backend(name, model, cases, args, on_cuda) -> dict:
    import torch

    from vllm.model_executor.layers.mamba.mamba_utils import ConvBackend
    from vllm.model_executor.models.utils import bind_state_pool

    os.environ["VLLM_USE_TRITON_CONV1D"] = "1" if name == "triton" else "0"
    model.set_conv_backend(ConvBackend(name))
    num_slots = max(args.num_decodes + 1, args.decode_batch)
    L = args.replayssm_buffer_len if args.use_replayssm else 0
    pool = model.allocate_state_pool(
        num_slots, ssm_dtype=getattr(torch, args.mamba_ssm_cache_dtype), replayssm_buffer_len=L
    )
    if L:  # staggered phases (module docstring)
        phase = torch.arange(num_slots + 1, dtype=torch.int8, device=pool.ssm_state.device) % L
        pool.rings["count"].copy_(phase[None, :, None, None].expand_as(pool.rings["count"]))
    out: dict = {"pool_gib": pool.nbytes() / 2**30, "ring_gib": pool.ring_nbytes() / 2**30}
    # The first mixed step on the fresh pool: its logits are compared across backends.
    out["first_logits"] = cases["mixed"].run(model, pool).float().cpu()
    steps = {
        "mixed": lambda: cases["mixed"].run(model, pool),
        "decode": lambda: cases["decode"].run(model, pool),
    }
    if on_cuda and not args.no_cuda_graph:
        from vllm.worker.cuda_graph import DecodeGraphs

        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        t0 = time.perf_counter()
        bind_state_pool(model, pool)
        graphs = DecodeGraphs(model, args.decode_batch)
        sizes = graphs.capture()
        torch.cuda.synchronize()
        out["graph_capture"] = {
            "graphs": len(sizes),
            "batch_sizes": sizes,
            "seconds": time.perf_counter() - t0,
            "memory_gib": (torch.cuda.memory_reserved() - reserved) / 2**30,
        }
        print(
            f"[{name}] captured {len(sizes)} decode graphs (batch {sizes[0]}..{sizes[-1]}) in "
            f"{out['graph_capture']['seconds']:.1f} s, "
            f"+{out['graph_capture']['memory_gib']:.2f} GiB reserved",
            flush=True,
        )
        ids, slots = cases["decode"].ids.tolist(), cases["decode"].slots
        steps["decode_graph"] = lambda: graphs.run(ids, slots)
        if name == "triton":
            steps["mixed_graph"], out["mixed_graph_capture"] = mixed_graph_step(
                model, cases["mixed"], graphs.mempool, args
            )
    for kind, fn in steps.items():
        res = timed(fn, args.iters, args.warmup, on_cuda)
        out[kind] = res
        print(
            f"[{name}] {kind}: {res['ms']['median']:.2f} ms "
            f"(p20 {res['ms']['p20']:.2f}, p80 {res['ms']['p80']:.2f}), "
            f"host {res['host_ms']:.2f} ms",
            flush=True,
        )
    if on_cuda and "decode_graph" in out:
        out["decode_floor"] = decode_floor(model, pool, args.decode_batch)
        out["decode_floor"]["graph_over_floor"] = (
            out["decode_graph"]["ms"]["median"] / out["decode_floor"]["floor_ms"]
        )
        f = out["decode_floor"]
        print(
            f"[{name}] decode floor {f['floor_ms']:.2f} ms ({f['bytes'] / 1e9:.2f} GB at "
            f"{f['copy_gbps']:.0f} GB/s copy): graph step {f['graph_over_floor']:.3f}x of it",
            flush=True,
        )
    if args.profile:
        out["profile"], out["decode_graph_kernels"], out["host_ops"] = profile_steps(
            steps, args.profile_steps, on_cuda, ("decode_graph", "mixed_graph")
        )
    return out  # the pool and the graphs die here, before the next backend's are made


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    on_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if on_cuda else "cpu")
    if not on_cuda:
        # The Triton kernels take CPU tensors only under the interpreter, which must be on
        # before the kernel module is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # Built with the Triton backend, which needs no build; run_backend switches per backend.
    os.environ["VLLM_USE_TRITON_CONV1D"] = "1"
    from vllm.model_executor.model_loader import get_model
    from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig

    dtype = args.dtype or ("bfloat16" if on_cuda else "float32")
    config = Mamba2ModelConfig(**NAMED_CONFIGS[args.model])
    t0 = time.perf_counter()
    model = get_model(config, load_format="dummy", dtype=dtype, device=device, seed=args.seed)
    build_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(args.seed)
    n_dec = args.num_decodes
    mixed = [(slot, 1, True) for slot in range(1, n_dec + 1)]
    # Slots are pool lines 1 .. num_slots (line 0 is the null line).
    mixed.append((n_dec + 1, args.prefill_len, args.prefill_has_initial_state))
    decode = [(slot, 1, True) for slot in range(1, args.decode_batch + 1)]
    vocab = config.vocab_size
    cases = {
        "mixed": StepCase(model, device, mixed, vocab, gen),
        "decode": StepCase(model, device, decode, vocab, gen),
    }
    results: dict = {
        "setup": {
            "model": args.model,
            "model_config": asdict(config),
            "dtype": dtype,
            "device": torch.cuda.get_device_name() if on_cuda else "cpu",
            "num_decodes": n_dec,
            "prefill_len": args.prefill_len,
            "prefill_has_initial_state": args.prefill_has_initial_state,
            "decode_batch": args.decode_batch,
            "mamba_ssm_cache_dtype": args.mamba_ssm_cache_dtype,
            "use_replayssm": args.use_replayssm,
            "replayssm_buffer_len": args.replayssm_buffer_len,
            "tokens": {k: c.num_tokens for k, c in cases.items()},
            "metadata_build_ms": {k: c.build_ms for k, c in cases.items()},
            "iters": args.iters,
            "warmup": args.warmup,
            "model_build_s": build_s,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "git_sha": git_sha(),
            "argv": ["benchmark_mamba2_step.py", *(sys.argv[1:] if argv is None else argv)],
        },
        "backends": {},
    }
    try:
        import triton

        results["setup"]["triton"] = triton.__version__
    except ImportError:
        results["setup"]["triton"] = None
    print(
        f"{args.model} ({dtype}, {results['setup']['device']}) built in {build_s:.1f} s",
        flush=True,
    )
    for name in args.backends:
        reason = cuda_skip_reason(on_cuda) if name == "cuda" else None
        if reason:
            print(f"[cuda] skipped: {reason}", flush=True)
            results["backends"][name] = {"skipped": reason}
            continue
        results["backends"][name] = run_backend(name, model, cases, args, on_cuda)
        if on_cuda:
            gc.collect()  # the pool (64 GiB for the 7B shape) must go before the next one
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    done = results["backends"]
    logits = {n: r.pop("first_logits") for n, r in done.items() if "first_logits" in r}
    results["check"] = {f"{n}_logits_finite": bool(t.isfinite().all()) for n, t in logits.items()}
    if len(logits) == 2:
        diff = (logits["triton"] - logits["cuda"]).abs().max().item()
        results["check"]["max_abs_logit_diff_triton_cuda"] = diff
        print(f"first mixed step: max |logits(triton) - logits(cuda)| = {diff:.3g}")
    if all("skipped" not in done.get(b, {"skipped": 1}) for b in ("triton", "cuda")):
        results["triton_over_cuda"] = {
            kind: done["cuda"][kind]["ms"]["median"] / done["triton"][kind]["ms"]["median"]
            for kind in ("mixed", "decode", "decode_graph")
            if kind in done["triton"] and kind in done["cuda"]
        }
    table = markdown(results)
    results["markdown"] = table
    print("\n" + table, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2, default=str))
        print(f"results written to {args.out}")
    return results


if __name__ == "__main__":
    main()
