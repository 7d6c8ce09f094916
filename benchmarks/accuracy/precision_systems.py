"""The systems benchmark_precision.py compares, all loading one HF checkpoint directory.

- ``save_checkpoint``: HF's own initialisation of a ``Mamba2ModelConfig`` (seeded), saved
  with ``save_pretrained`` in the dtype asked for.
- ``fp32_reference``: HF transformers' Mamba2 in float32 on its PyTorch code, each prompt
  alone. transformers resolves its kernel entry points (``mamba2_chunk_scan``, the state
  update, the convs) once, when it imports ``modeling_mamba2``, so that choice cannot be
  made per model; ``hf_torch_path`` instead swaps the module's entry points, for the
  reference's forwards only, for the PyTorch functions they wrap (``inspect.unwrap``: the
  decorator keeps them via ``functools.wraps``) and counts the calls, so a run whose
  reference did not go through them fails instead of reporting. TF32 is off meanwhile
  (matmuls and cuDNN's conv), so "fp32" means fp32.
- ``hf_last_logits`` on a bf16 HF model: the kernels transformers took at import
  (mamba_ssm's Triton scan and state update where ``prepare_kernels`` put them in place).
- ``OurSteps``: our ``Mamba2ForCausalLM`` driven one continuous-batching step at a time
  through its metadata builder and state pool, as the engine's model runner does.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import os

import torch

from benchmarks.common.hf_generate import _HF_FUNCS, hf_config


def hf_norms_per_group() -> bool:
    """Whether the installed transformers' Mamba2 gated RMSNorm normalises per group
    (newer releases: a ``group_size`` argument) rather than over the whole dimension."""
    from transformers.models.mamba2 import modeling_mamba2

    # MambaRMSNormGated until 5.24, Mamba2RMSNormGated from 5.25.
    norm = getattr(modeling_mamba2, "Mamba2RMSNormGated", None)
    init = (norm or modeling_mamba2.MambaRMSNormGated).__init__
    return "group_size" in inspect.signature(init).parameters


def free(device: torch.device) -> None:
    """Give the memory of models dropped by the caller back before the next is built."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def save_checkpoint(config, path, seed: int, dtype: torch.dtype, device: torch.device) -> int:
    """HF's initialisation of ``config`` under ``torch.manual_seed(seed)``, built on
    ``device`` (seconds for the 7B width on a GPU), saved at ``path`` in ``dtype``; returns
    the parameter count."""
    from transformers import Mamba2ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        hf = Mamba2ForCausalLM(hf_config(config))
    count = sum(p.numel() for p in hf.parameters())
    hf.to(dtype).save_pretrained(path)
    del hf
    free(device)
    return count


def load_hf(path, dtype: torch.dtype, device: torch.device):
    from transformers import Mamba2ForCausalLM

    return Mamba2ForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


@torch.no_grad()
def hf_last_logits(hf, prompts: list[list[int]], device: torch.device) -> torch.Tensor:
    """(len(prompts), vocab) fp32: the last token's logits of each prompt, run alone."""
    rows = []
    for prompt in prompts:
        out = hf(torch.tensor([prompt], device=device), use_cache=False)
        rows.append(out.logits[0, -1].float().cpu())
    return torch.stack(rows)


def _counting(calls: dict, name: str, fn):
    def counted(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)

    return counted


@contextlib.contextmanager
def hf_torch_path():
    """HF's own PyTorch code behind every Mamba2 kernel entry point while inside; yields
    the number of calls per entry point."""
    from transformers.models.mamba2 import modeling_mamba2 as module

    saved = {name: getattr(module, name) for name in _HF_FUNCS if hasattr(module, name)}
    torch_fns = {name: inspect.unwrap(fn) for name, fn in saved.items()}
    for name, fn in torch_fns.items():
        if fn.__module__ != module.__name__:
            raise RuntimeError(f"{name} does not wrap HF's PyTorch code: {fn!r}")
    calls = dict.fromkeys(saved, 0)
    for name, fn in torch_fns.items():
        setattr(module, name, _counting(calls, name, fn))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


@contextlib.contextmanager
def full_fp32():
    """No TF32 in fp32 matmuls and cuDNN convs while inside."""
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = cudnn


def fp32_reference(path, prompts, device: torch.device) -> tuple[torch.Tensor, dict]:
    """HF fp32 on its PyTorch code: last-token logits and the entry points' call counts
    (every layer must have run HF's PyTorch conv and chunked scan on every prompt)."""
    hf = load_hf(path, torch.float32, device)
    with hf_torch_path() as calls, full_fp32():
        logits = hf_last_logits(hf, prompts, device)
    expected = hf.config.num_hidden_layers * len(prompts)
    for name in ("mamba2_chunk_scan", "causal_conv1d_fn"):
        if calls.get(name) != expected:
            raise RuntimeError(
                f"the fp32 reference called HF's PyTorch {name} {calls.get(name)} times, "
                f"expected {expected} (one per layer and prompt): it is no reference"
            )
    del hf
    free(device)
    return logits, calls


def hf_bf16_last_logits(path, prompts, device: torch.device) -> torch.Tensor:
    """HF bf16 on the kernels transformers took, after one warm-up forward (mamba_ssm's
    autotuner times its configs on the first call: kept out of the measured forwards)."""
    hf = load_hf(path, torch.bfloat16, device)
    hf_last_logits(hf, prompts[:1], device)
    logits = hf_last_logits(hf, prompts, device)
    del hf
    free(device)
    return logits


@contextlib.contextmanager
def cpu_paths_for_bf16(device: torch.device):
    """On the CPU, our bf16 model through its PyTorch paths (fp32 references of the conv
    and norms, the PyTorch scan): bf16 arithmetic is wrong under the Triton interpreter,
    and with ``TRITON_INTERPRET=0`` the ops send CPU tensors to those paths (read per call)."""
    before = os.environ.get("TRITON_INTERPRET")
    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


class OurSteps:
    """Our model with a fresh metadata builder and state pool, one step per ``step``."""

    def __init__(self, model, num_slots: int):
        self.model = model
        self.device = model.backbone.embeddings.weight.device
        self.builder = model.metadata_builder(self.device)
        self.pool = model.allocate_state_pool(num_slots)

    @torch.no_grad()
    def step(self, rows: list[tuple[int, list[int], bool]]) -> dict[int, torch.Tensor]:
        """Rows of (slot, tokens, continues its slot's state); the fp32 logits of each
        row's last token, by slot."""
        lens = torch.tensor([0] + [len(tokens) for _, tokens, _ in rows])
        qsl = lens.cumsum(0).to(torch.int32)
        md = self.builder.build(
            qsl,
            # slot s is pool line s + 1 (line 0 is the null line)
            torch.tensor([slot + 1 for slot, _, _ in rows], dtype=torch.int32),
            torch.tensor([cont for _, _, cont in rows], dtype=torch.bool),
        )
        ids = torch.tensor([t for _, tokens, _ in rows for t in tokens], device=self.device)
        from vllm.forward_context import ForwardContext, set_forward_context
        from vllm.model_executor.models.utils import bind_state_pool

        bind_state_pool(self.model, self.pool)
        with set_forward_context(ForwardContext(mamba2_metadata=md)):
            hidden = self.model(ids, None)
        last = (qsl[1:] - 1).long().to(self.device)
        logits = self.model.compute_logits(hidden.index_select(0, last)).cpu()
        return {slot: logits[i] for i, (slot, _, _) in enumerate(rows)}


def mixed_plan(prompts: list[list[int]]) -> tuple[list, list, dict]:
    """Two steps that make the second one truly mixed: prompt i with i % 3 == 0 comes
    fresh in step 2; i % 3 == 1 is a chunked prefill (its first 3/5 in step 1, the rest
    continuing in step 2); i % 3 == 2 prefills all but its last token in step 1 and
    decodes that token in step 2. Step 2's rows go decodes first, as the scheduler's do.
    Returns both steps' rows and each prompt's role."""
    first, decodes, continuing, fresh, roles = [], [], [], [], {}
    for slot, prompt in enumerate(prompts):
        kind = slot % 3
        if kind == 0:
            fresh.append((slot, prompt, False))
            roles[slot] = "fresh"
            continue
        split = max(1, len(prompt) * 3 // 5) if kind == 1 else len(prompt) - 1
        first.append((slot, prompt[:split], False))
        (continuing if kind == 1 else decodes).append((slot, prompt[split:], True))
        roles[slot] = f"chunked {split}+{len(prompt) - split}" if kind == 1 else "decode"
    return first, decodes + continuing + fresh, roles


def our_last_logits(path, prompts, device: torch.device) -> tuple[dict, dict]:
    """Ours in bf16: all prompts fresh in ONE step, and the two-step mixed plan; the
    (len(prompts), vocab) last-token logits of each, and the mixed plan's roles."""
    from vllm.model_executor.model_loader import get_model

    model = get_model(path, dtype="bfloat16", device=device)
    n = len(prompts)
    with cpu_paths_for_bf16(device):
        fresh = OurSteps(model, n).step([(slot, p, False) for slot, p in enumerate(prompts)])
        first, second, roles = mixed_plan(prompts)
        steps = OurSteps(model, n)
        steps.step(first)
        mixed = steps.step(second)
    del model, steps
    free(device)
    stack = {
        k: torch.stack([d[s] for s in range(n)]) for k, d in (("fresh", fresh), ("mixed", mixed))
    }
    return stack, roles
