"""The HF transformers backend of benchmark_throughput.py: ``<Architecture>.generate``.

Same requests as the engine gets (equal prompt lengths, one output length), the same
model shape (transformers' class of the config's architecture: ``Mamba2ForCausalLM``,
``BambaForCausalLM``, ``MambaForCausalLM``, ``FalconMambaForCausalLM``,
``Lfm2ForCausalLM``, ``GraniteMoeHybridForCausalLM``, ``NemotronHForCausalLM``, ... with a
transformers config made from our config's fields by hf_models.py, random weights, or
``from_pretrained`` of a model directory), the same dtype and device. Prompts go in batches
of ``--hf-batch-size`` (default: all at once), each generating exactly the output length
(``min_new_tokens = max_new_tokens``; greedy at temperature 0, else sampling at that
temperature).

Which kernels HF runs is decided when transformers imports its model module (5.17:
``use_kernel_func_from_hub_with_fallback`` tries ``import mamba_ssm`` and looks up
``ops.triton.ssd_combined.mamba_chunk_scan_combined`` and
``ops.triton.selective_state_update.selective_state_update``, and ``import causal_conv1d``
for the conv; each missing one falls back to HF's PyTorch code). ``--hf-kernels``:
``mamba_ssm`` puts mamba_ssm's Triton modules in place first (mamba_ssm_import.py; an error
if they do not import), ``torch`` does not, ``auto`` does on CUDA when they import. What
HF really took is read back from the decorated functions of the model's module and
recorded (``hf.kernels``): the Mamba2 family's scan, state update and conv, Mamba1's scans
(mamba_ssm's CUDA ones, absent from the box: HF's PyTorch path) and LFM2's conv.

Timing: the prefill of each batch ends where the first logits processor call happens
(a processor that records a timestamp after a device sync: HF's generate syncs on
every step anyway, to test its stopping criteria), the rest is decode steps. Unless
``--no-hf-warmup``, one generation of the first batch with 2 new tokens runs before
timing, so that compiles and autotuning (mamba_ssm's Triton kernels tune on first use)
stay out of the timed run: HF is measured warm, ours cold.
"""

from __future__ import annotations

import inspect
import itertools
import statistics
import sys
import time

from benchmarks.common.hf_models import hf_config, hf_model_class

__all__ = ["hf_config", "build_model", "kernels_taken", "prepare_kernels", "run_hf"]

# The Mamba2 family's decorated entry points (transformers' mamba2, bamba,
# granitemoehybrid, nemotron_h and zamba2 modules name them alike).
_HF_FUNCS = (
    "mamba2_chunk_scan",
    "mamba2_selective_state_update",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)
# Those of the Mamba1 family (mamba, falcon_mamba, jamba) and of LFM2's short conv.
_MAMBA1_FUNCS = (
    "mamba_selective_scan",
    "mamba_selective_state_update",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)
_CONV_FUNCS = ("causal_conv1d_fn", "causal_conv1d_update")


# transformers' models whose scan is mamba_ssm's selective_scan_fn: a CUDA op, absent from
# the pure-Python wheel, so a module that only imports would be taken and fail when called.
_MAMBA1_ARCHITECTURES = ("MambaForCausalLM", "FalconMambaForCausalLM", "JambaForCausalLM")


def prepare_kernels(choice: str, on_cuda: bool, architecture: str | None = None) -> str | None:
    """Put mamba_ssm's Triton modules in place as ``choice`` asks (before transformers
    imports its Mamba2 model); returns why they were not, or None when they were. For a
    Mamba1 ``architecture`` they never are (HF's PyTorch scan; SystemExit if asked)."""
    if choice == "torch":
        return "--hf-kernels torch"
    if architecture in _MAMBA1_ARCHITECTURES:
        why = f"{architecture}'s scan is mamba_ssm's CUDA op, not in its pure-Python wheel"
        if choice == "mamba_ssm":
            raise SystemExit(f"--hf-kernels mamba_ssm: {why}")
        return why
    if choice == "auto" and not on_cuda:
        return "not on CUDA (auto)"
    from benchmarks.common.mamba_ssm_import import import_mamba_ssm_triton

    try:
        import_mamba_ssm_triton()
    except ImportError as err:
        if choice == "mamba_ssm":
            raise
        return str(err)
    return None


def _implementation(fn) -> str:
    """What a decorated HF entry point resolved to: "torch" (HF's own code), the
    implementation's dotted name, or "unknown" (absent)."""
    if fn is None:
        return "unknown"
    impl = None
    # transformers 5.25 with `kernels` installed wraps these in objects: no closure.
    if getattr(fn, "__closure__", None):
        impl = inspect.getclosurevars(fn).nonlocals.get("implementation")
    if impl is None:
        return "torch"
    where = f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__qualname__', '?')}"
    return "torch" if where.startswith("transformers.") else where


def kernels_taken(module=None) -> dict:
    """For each of HF's kernel entry points in ``module`` (a transformers modeling module;
    default: Mamba2's), the implementation it resolved to, and whether the scan and conv
    are fast ones (``fast_scan`` None: the model has no scan)."""
    if module is None:
        from transformers.models.mamba2 import modeling_mamba2 as module
    if hasattr(module, "mamba2_chunk_scan"):
        names, scans = _HF_FUNCS, ("mamba2_chunk_scan", "mamba2_selective_state_update")
    elif hasattr(module, "mamba_selective_scan"):
        names, scans = _MAMBA1_FUNCS, ("mamba_selective_scan", "mamba_selective_state_update")
    else:
        names, scans = _CONV_FUNCS, ()
    taken = {name: _implementation(getattr(module, name, None)) for name in names}
    slow = ("torch", "unknown")
    taken["fast_scan"] = all(taken[n] not in slow for n in scans) if scans else None
    taken["fast_conv"] = taken.get("causal_conv1d_fn", "torch") not in slow
    return taken


def build_model(model, config, load_format: str, dtype, device):
    """transformers' model of ``config``'s architecture: ``from_pretrained(model)`` for a
    directory read from disk, else random weights of the same shape."""
    import torch

    cls = hf_model_class(config)
    if isinstance(model, str) and load_format != "dummy":
        return cls.from_pretrained(model, dtype=dtype).to(device).eval()
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = cls(hf_config(config))
    finally:
        torch.set_default_dtype(default)
    return hf.eval()


class _StepClock:
    """A logits processor that only notes the time of each generation step."""

    def __init__(self, sync):
        self.sync, self.stamps = sync, []

    def __call__(self, input_ids, scores):
        self.sync()
        self.stamps.append(time.perf_counter())
        return scores


def _generate(hf, prompts, new_tokens: int, temperature: float, device, clock=None):
    import torch
    from transformers import LogitsProcessorList

    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    out = hf.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=hf.config.pad_token_id,
        use_cache=True,
        logits_processor=LogitsProcessorList([clock] if clock else []),
        **(sampling if temperature > 0 else dict(do_sample=False)),
    )
    return (out.shape[1] - ids.shape[1]) * ids.shape[0]


def state_dtype(hf, device) -> str | None:
    """The dtype HF keeps its SSM states in, read from the cache of a 4-token forward
    (the cache classes differ between releases: None where none of them is found)."""
    import torch

    try:
        out = hf(torch.tensor([[1, 2, 3, 4]], device=device), use_cache=True)
    except Exception:  # a probe only; the run's results stand without it
        return None
    names = ("cache", "cache_params", "past_key_values")
    cache = next((getattr(out, n) for n in names if getattr(out, n, None) is not None), None)
    if hasattr(cache, "get_recurrent_state"):
        states = cache.get_recurrent_state(0)
    else:
        layers = getattr(cache, "layers", None)
        states = getattr(layers[0], "recurrent_states", None) if layers else None
        states = getattr(cache, "ssm_states", None) if states is None else states
    if isinstance(states, dict):
        states = next(iter(states.values()), None)
    if isinstance(states, list | tuple):
        states = states[0] if states else None
    return str(states.dtype) if isinstance(states, torch.Tensor) else None


def run_hf(args, model, config, requests, t_start: float) -> dict:
    """The hf backend's whole run; returns the result fields benchmark_throughput reports."""
    import torch

    on_cuda = args.device == "cuda"
    device = torch.device(args.device)
    not_fast = prepare_kernels(args.hf_kernels, on_cuda, config.architecture)

    def sync():
        if on_cuda:
            torch.cuda.synchronize()

    lens = {len(ids) for ids, _ in requests}
    outs = {n for _, n in requests}
    if len(lens) != 1 or len(outs) != 1:
        raise SystemExit(
            "--backend hf needs one prompt length and one output length "
            "(--input-len and --output-len)"
        )
    new_tokens = outs.pop()
    torch.manual_seed(args.seed)
    hf = build_model(model, config, args.load_format, getattr(torch, args.dtype), device)
    sync()
    res = {"startup_s": time.perf_counter() - t_start}
    prompts = [ids for ids, _ in requests]
    bs = args.hf_batch_size or len(prompts)
    batches = [prompts[i : i + bs] for i in range(0, len(prompts), bs)]
    with torch.no_grad():
        if not args.no_first_token:
            _generate(hf, prompts[:1], 1, args.temperature, device)
            sync()
            res["first_token_s"] = time.perf_counter() - t_start
        if not args.no_hf_warmup:
            t0 = time.perf_counter()
            _generate(hf, batches[0], 2, args.temperature, device)
            sync()
            res["warmup_s"] = time.perf_counter() - t0
        prefill_s, steps_ms, n_out = 0.0, [], 0
        start = time.perf_counter()
        for batch in batches:
            clock = _StepClock(sync)
            t0 = time.perf_counter()
            n_out += _generate(hf, batch, new_tokens, args.temperature, device, clock)
            prefill_s += clock.stamps[0] - t0
            steps_ms += [(b - a) * 1e3 for a, b in itertools.pairwise(clock.stamps)]
        sync()
        res["elapsed_s"] = time.perf_counter() - start
        res["output_tokens"] = n_out
        if args.prefill_run:
            t0 = time.perf_counter()
            for batch in batches:
                _generate(hf, batch, 1, args.temperature, device)
            sync()
            res["prefill_run_s"] = time.perf_counter() - t0
        ssm_dtype = state_dtype(hf, device)
    res["hf"] = {
        "ssm_state_dtype": ssm_dtype,
        "batch_size": bs,
        "batches": len(batches),
        "architecture": config.architecture,
        "kernels": kernels_taken(sys.modules[type(hf).__module__]),
        "mamba_ssm_not_used_because": not_fast,
        "prefill_s_in_run": prefill_s,
        "prefill_tokens_per_s_in_run": sum(map(len, prompts)) / prefill_s,
        "decode_ms_per_step_median": statistics.median(steps_ms) if steps_ms else None,
        "decode_steps": len(steps_ms),
        "parameters": sum(p.numel() for p in hf.parameters()),
        "mamba_ssm": getattr(sys.modules.get("mamba_ssm"), "__version__", None),
    }
    return res


def versions() -> dict:
    import transformers

    out = {"transformers": transformers.__version__}
    try:
        from transformers.utils.import_utils import is_kernels_available

        out["hf_kernels_package"] = bool(is_kernels_available())
    except ImportError:
        pass
    return out
