"""Model-level precision: bf16 last-token logits, ours and HF's, against an fp32 reference.

    python -m benchmarks.accuracy.benchmark_precision --out precision.json --md precision.md   # GPU
    python -m benchmarks.accuracy.benchmark_precision --tiny --device cpu --prompt-lens 5,17,40

Issue 10's target: our bf16 last-token logits of a mixed batch no further from an fp32
reference than HF transformers + mamba_ssm's are. One run, one device, one set of weights:

1. A random Mamba2 of the Mamba-Codestral-7B width (``Mamba2ModelConfig`` defaults: hidden
   4096, 128 heads of 64, state 128, 8 groups, vocab 32768, chunk 256) with ``--num-layers``
   layers (16), or ``--tiny`` (hidden 64, 8 heads of 16, state 16, 2 groups, chunk 16, 2
   layers). Weights: HF's own initialisation (``Mamba2ForCausalLM(config)`` after
   ``torch.manual_seed(--seed)``, built on the device), saved once with ``save_pretrained``
   in ``--checkpoint-dtype`` (bfloat16, as real Mamba2 checkpoints ship: every system then
   holds exactly the same values, and the errors are arithmetic only; with float32 the
   bf16 systems also round the weights, and HF's bf16 model rounds A_log, D and dt_bias,
   which ours keeps in fp32).
2. Reference: HF transformers' Mamba2 in float32 on its PyTorch path (HF's, not ours, so
   the reference shares no code with what it judges), each prompt alone, no padding, TF32
   off. transformers picks its kernels once per process, at import; the reference's
   forwards get HF's PyTorch functions by swapping the module's entry points for them,
   with the calls counted and checked (``precision_systems.hf_torch_path``).
3. Ours: ``get_model(dir, dtype="bfloat16")`` (fp32 SSM state pool), two variants: all
   prompts as fresh prefills in ONE step ("fresh"), and two steps whose second is mixed:
   decodes, chunked-prefill continuations and fresh prefills in one step ("mixed",
   ``precision_systems.mixed_plan``). On the CPU (``--tiny``) ours runs its PyTorch paths
   with ``TRITON_INTERPRET=0`` (bf16 arithmetic is wrong under the interpreter); on CUDA
   its Triton kernels.
4. HF bf16, each prompt alone, with the kernels transformers took (``--hf-kernels``, as in
   hf_generate.py: mamba_ssm's Triton scan and state update where they import, PyTorch's
   conv); one warm-up forward first, so mamba_ssm's autotuning runs outside the measure.

Metric: rel-L2 = ||x - ref|| / ||ref|| over the stacked last-token logits of all prompts,
the largest absolute error, each prompt's rel-L2, and ours / HF. The target is met when
both our variants' rel-L2 are at most HF's with mamba_ssm's scan. Default prompts: 8, of
37 to 700 random token ids (``--seed``). Time on an H200 (16 layers): a few minutes,
mostly writing and loading the 3.5 GB checkpoint and compiling both sides' kernels.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import datetime, timezone

from benchmarks.common.run_info import git_sha, write_results

DEFAULT_LENS = "37,61,128,200,256,383,512,700"
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    num_heads=8,
    head_dim=16,
    state_size=16,
    n_groups=2,
    chunk_size=16,
)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-layers", type=int, default=None, help="default 16 (--tiny: 2)")
    p.add_argument("--device", default="auto")
    p.add_argument("--hf-kernels", default="auto", choices=["auto", "mamba_ssm", "torch"])
    p.add_argument("--checkpoint-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-lens", default=DEFAULT_LENS, help="comma-separated, each >= 2")
    p.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke test)")
    p.add_argument("--out", default=None, help="the results as JSON")
    p.add_argument("--md", default=None, help="the markdown table")
    args = p.parse_args(argv)
    try:
        args.prompt_lens = [int(n) for n in args.prompt_lens.split(",") if n.strip()]
    except ValueError:
        p.error(f"--prompt-lens must be comma-separated integers, got {args.prompt_lens!r}")
    if not args.prompt_lens or min(args.prompt_lens) < 2:
        p.error("--prompt-lens needs at least one length, each >= 2 (a decode needs a prefix)")
    if args.num_layers is None:
        args.num_layers = 2 if args.tiny else 16
    if args.num_layers < 1:
        p.error("--num-layers must be >= 1")
    return args


def errors(x, ref) -> dict:
    """rel-L2 over all rows, the largest absolute error and each row's rel-L2 (in fp64)."""
    diff, ref = (x - ref).double(), ref.double()
    return {
        "rel_l2": (diff.norm() / ref.norm()).item(),
        "max_abs": diff.abs().max().item(),
        "per_prompt_rel_l2": (diff.norm(dim=1) / ref.norm(dim=1)).tolist(),
        "finite": bool(x.isfinite().all()),
    }


def versions(on_cuda: bool) -> dict:
    import torch
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__}
    out["python"] = platform.python_version()
    out["mamba_ssm"] = getattr(sys.modules.get("mamba_ssm"), "__version__", None)
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    out["gpu"] = torch.cuda.get_device_name() if on_cuda else None
    return out


def markdown(res: dict) -> str:
    s, v = res["setup"], res["setup"]["versions"]
    hf = res["systems"]["hf_bf16"]
    lens = "/".join(map(str, s["prompt_lens"]))
    lines = [
        f"# Model-level precision: bf16 last-token logits vs HF fp32 ({s['model']})",
        "",
        f"- Device: {v['gpu'] or 'cpu'}; torch {v['torch']}; triton {v['triton']}; "
        f"transformers {v['transformers']}; mamba_ssm {v['mamba_ssm']}; git {s['git_sha']}; "
        f"{s['date']}",
        f"- Command: `{s['command']}`",
        f"- {s['num_layers']} layers, {s['params']:,} parameters, HF init (seed "
        f"{s['seed']}), {s['checkpoint_dtype']} checkpoint, n_groups {s['n_groups']}; prompts "
        f"of {lens} random tokens",
        *([f"- {s['n_groups_note']}"] if s.get("n_groups_note") else []),
        f"- Reference: {s['reference']}",
        f"- Ours: {s['ours_path']}; HF bf16: {hf['kernels_note']}",
        "",
        "| system | rel-L2 | max abs | rel-L2 / HF bf16 | rel-L2 per prompt |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for name, r in res["systems"].items():
        ratio = res["ratios"].get(name)
        per = " ".join(f"{e:.3f}" for e in r["per_prompt_rel_l2"])
        lines.append(
            f"| {name} | {r['rel_l2']:.4f} | {r['max_abs']:.3f} | "
            f"{'' if ratio is None else f'{ratio:.3f}'} | {per} |"
        )
    roles = zip(s["prompt_lens"], res["mixed_roles"], strict=True)
    roles = ", ".join(f"{n}: {role}" for n, role in roles)
    lines += [
        "",
        f"ours_mixed's second step, by prompt length: {roles}. ours_mixed vs ours_fresh "
        f"rel-L2 {res['mixed_vs_fresh_rel_l2']:.2e}.",
        f"Target (ours no further than HF + mamba_ssm): {res['target']}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    on_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if on_cuda else "cpu")
    from benchmarks.common.hf_generate import kernels_taken, prepare_kernels

    not_fast = prepare_kernels(args.hf_kernels, on_cuda)  # before transformers' Mamba2
    from benchmarks.accuracy import precision_systems as ps
    from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig

    shape = dict(TINY) if args.tiny else {}
    groups_note = None
    if not ps.hf_norms_per_group():
        # This transformers' gated norm spans the whole inner dimension; ours (as Mamba2
        # and mamba_ssm) normalises per group. With one group they are the same model.
        groups_note = (
            "n_groups 1: this transformers' Mamba2 gated norm normalises over the whole "
            "inner dimension, not per group as Mamba2 (and ours) do, so with more groups "
            "HF would be a different model"
        )
        shape["n_groups"] = 1
        print(f"[precision] {groups_note}", flush=True)
    config = Mamba2ModelConfig(**shape, num_hidden_layers=args.num_layers)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [
        torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in args.prompt_lens
    ]
    times = {}

    def timed(name, fn, *fn_args):
        t0 = time.perf_counter()
        out = fn(*fn_args)
        times[name] = time.perf_counter() - t0
        print(f"[precision] {name} done in {times[name]:.1f} s", flush=True)
        return out

    with tempfile.TemporaryDirectory(prefix="precision_ckpt_") as path:
        ckpt_dtype = getattr(torch, args.checkpoint_dtype)
        params = timed(
            "checkpoint", ps.save_checkpoint, config, path, args.seed, ckpt_dtype, device
        )
        ref, calls = timed("fp32 reference", ps.fp32_reference, path, prompts, device)
        hf_logits = timed("hf bf16", ps.hf_bf16_last_logits, path, prompts, device)
        ours, roles = timed("ours bf16", ps.our_last_logits, path, prompts, device)
    kernels = kernels_taken()
    hf_note = (
        f"mamba_ssm Triton scan + state update ({kernels['mamba2_chunk_scan']})"
        if kernels["fast_scan"]
        else f"HF's PyTorch scan ({not_fast or 'mamba_ssm not taken'})"
    ) + (", Dao CUDA conv" if kernels["fast_conv"] else ", PyTorch conv")
    systems = {
        "ours_fresh": errors(ours["fresh"], ref),
        "ours_mixed": errors(ours["mixed"], ref),
        "hf_bf16": errors(hf_logits, ref) | {"kernels": kernels, "kernels_note": hf_note},
    }
    hf_err = systems["hf_bf16"]["rel_l2"]
    ratios = {k: systems[k]["rel_l2"] / hf_err for k in ("ours_fresh", "ours_mixed")}
    met = all(r <= 1.0 for r in ratios.values())
    target = "met" if met else "missed"
    if not kernels["fast_scan"]:
        target = "not judged (HF ran its PyTorch scan, not mamba_ssm's)"
    given = sys.argv[1:] if argv is None else argv
    command = " ".join(["python -m benchmarks.accuracy.benchmark_precision", *given])
    res = {
        "setup": {
            "model": "tiny" if args.tiny else "Mamba-Codestral-7B width",
            "model_config": asdict(config),
            "num_layers": args.num_layers,
            "n_groups": config.n_groups,
            "n_groups_note": groups_note,
            "params": params,
            "checkpoint_dtype": args.checkpoint_dtype,
            "seed": args.seed,
            "prompt_lens": args.prompt_lens,
            "device": str(device),
            "reference": "HF transformers fp32, its PyTorch conv and chunked scan (calls "
            f"counted: {calls}), each prompt alone, TF32 off",
            "reference_calls": calls,
            "ours_path": "Triton kernels (conv, SSD scan, norms), fp32 SSM state"
            if on_cuda
            else "PyTorch CPU paths with TRITON_INTERPRET=0 (bf16 is wrong under the "
            "Triton interpreter: not our Triton kernels), fp32 SSM state",
            "versions": versions(on_cuda),
            "git_sha": git_sha(),
            "command": command,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "times_s": times,  # by phase
        },
        "systems": systems,
        "ratios": ratios,
        "target_met": met if kernels["fast_scan"] else None,
        "target": target,
        "mixed_roles": [roles[i] for i in range(len(prompts))],
        "mixed_vs_fresh_rel_l2": errors(ours["mixed"], ours["fresh"])["rel_l2"],
    }
    res["markdown"] = markdown(res)
    print(res["markdown"])
    write_results(res, args.out, args.md)
    return res


if __name__ == "__main__":
    main()
