"""LLM: offline generation, ``LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
import itertools
import os
import time

from tqdm.auto import tqdm

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.llm_engine import LLMEngine
from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams


def _one(name: str, what: str):
    def check(value):
        if value not in (None, 1):
            raise ValueError(f"{name}={value!r}: {what} is not supported yet (give 1)")

    return check


def _none(name: str, why: str):
    def check(value):
        if value is not None:
            raise ValueError(f"{name}={value!r}: {why}")

    return check


def _false(name: str, why: str):
    def check(value):
        if value not in (None, False):
            raise ValueError(f"{name}={value!r}: {why}")

    return check


def _non_negative(value):
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int | float) or value < 0
    ):
        raise ValueError(f"swap_space must be a number of GiB >= 0, got {value!r}")


def _bool(name: str):
    def check(value):
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")

    return check


def _tokenizer_mode(value):
    if value not in (None, "auto"):
        raise ValueError(
            f"tokenizer_mode={value!r} is not supported: the engine decodes with the model's "
            "fast tokenizer (give 'auto')"
        )


_NO_LORA = "LoRA adapters are not supported by this package"

# vLLM's LLM keywords that are not EngineArgs fields (yet). Each either runs as asked or is
# refused: a check that passes means the value changes nothing here (documented per entry).
# A keyword that becomes an EngineArgs field is passed to EngineArgs instead.
_VLLM_OPTIONS = {
    "pipeline_parallel_size": _one("pipeline_parallel_size", "pipeline parallelism"),
    # CPU swap space for preempted sequences' KV blocks: this engine never preempts.
    "swap_space": _non_negative,
    "quantization": _none("quantization", "quantized models are not supported"),
    "code_revision": _none("code_revision", "this package runs no remote model code"),
    # Permission only: the model classes are this package's, and the tokenizer loads without
    # remote code (a tokenizer that needs it fails to load, saying so).
    "trust_remote_code": _bool("trust_remote_code"),
    "tokenizer_mode": _tokenizer_mode,
    "enable_lora": _false("enable_lora", _NO_LORA),
    # They size LoRA, which is off.
    "max_lora_rank": lambda value: None,
    "max_loras": lambda value: None,
    "max_cpu_loras": lambda value: None,
}


def _engine_kwargs(kwargs: dict) -> dict:
    """The EngineArgs keywords of ``LLM(**kwargs)``; vLLM's other keywords checked (and
    dropped when they change nothing here, refused otherwise)."""
    engine_fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    out, unknown = {}, []
    for key, value in kwargs.items():
        field = engine_fields.get(key)
        if field is not None:
            if value is None and field.default is not None:
                continue  # vLLM's None: the default (lm-eval passes max_num_seqs=None)
            out[key] = None if key == "dtype" and value == "auto" else value
        elif key in _VLLM_OPTIONS:
            _VLLM_OPTIONS[key](value)
        else:
            unknown.append(key)
    if unknown:
        known = sorted({*engine_fields, *_VLLM_OPTIONS} - {"model"})
        raise TypeError(
            f"LLM() got unknown keyword argument(s) {', '.join(map(repr, unknown))}; "
            f"it takes: {', '.join(known)}"
        )
    return out


class LLM:
    """``model``: an HF model directory, a Hugging Face Hub id (``"ORG/NAME"``: the cache,
    or a download; ``revision``, ``download_dir``, ``HF_HUB_OFFLINE``), or a
    ``Mamba2ModelConfig`` with ``load_format="dummy"``. Other keyword arguments are
    ``EngineArgs`` fields (``tokenizer``, ``dtype``, ``device``, ``seed``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``long_prefill_token_threshold``, ``max_model_len``,
    ``enforce_eager``, ``compilation_config`` (vLLM's: ``{"cudagraph_mode": "FULL"}``),
    ``mamba_ssm_cache_dtype``, ``gpu_memory_utilization``, ...), the
    options ``vllm serve`` takes (``tensor_parallel_size`` among them: the model shards
    over that many processes, the hybrids as Mamba2), or vLLM's other ``LLM`` keywords
    (``swap_space``, ``quantization``, ``trust_remote_code``, ``code_revision``,
    ``tokenizer_mode``, ``enable_lora``, ...): each is either
    run as asked or refused with a ValueError that says why (``_VLLM_OPTIONS`` below). As
    in vLLM, None for an option means its default, and ``dtype="auto"`` the config's
    dtype."""

    def __init__(self, model: str | os.PathLike | Mamba2ModelConfig, **kwargs):
        args = EngineArgs(model=model, **_engine_kwargs(kwargs))
        self.engine = LLMEngine(args.create_engine_config())
        self._ids = itertools.count()

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for the engine (``self.engine``)."""
        return self.engine

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request=None,
    ) -> list[RequestOutput]:
        """Outputs in the prompts' order; a prompt is a string, a list of token ids, or
        a ``TextPrompt`` / ``TokensPrompt`` (``{"prompt": ...}`` /
        ``{"prompt_token_ids": [...]}``). Every prompt and every SamplingParams is checked
        before any is queued: a call that raises leaves nothing behind. A request that fails
        while running comes back with finish reason "error" and its message in
        ``RequestOutput.error``; the others are unaffected. ``lora_request`` must be None
        (or a list of None): this package serves no LoRA adapters."""
        requested = lora_request if isinstance(lora_request, list | tuple) else [lora_request]
        if any(r is not None for r in requested):
            raise ValueError(
                "LoRA adapters are not supported by this package: lora_request must be None"
            )
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list | tuple) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        if not isinstance(prompts, list | tuple):
            raise ValueError(
                f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}"
            )
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, list | tuple):
            if len(sampling_params) != len(prompts):
                raise ValueError(
                    f"give one SamplingParams, or one per prompt: got {len(sampling_params)} "
                    f"for {len(prompts)} prompts"
                )
        else:
            sampling_params = [sampling_params] * len(prompts)
        engine = self.engine
        checked = []
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params, strict=True)):
            try:
                checked.append(engine.process(prompt, params))
            except ValueError as err:
                raise ValueError(f"prompt {i}: {err}") from None
        order = {}
        for i, (processed, params) in enumerate(zip(checked, sampling_params, strict=True)):
            rid = f"llm-{next(self._ids)}"
            final = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
            engine.add_processed(rid, processed, final)
            order[rid] = i
        return self._run(order, use_tqdm)

    def _run(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        results: list[RequestOutput | None] = [None] * len(order)
        bar = tqdm(total=len(order), desc="Generating", unit="req", disable=not use_tqdm)
        start, out_tokens = time.perf_counter(), 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.request_id not in order or not out.finished:
                        continue
                    results[order[out.request_id]] = out
                    engine.errors.pop(out.request_id, None)
                    out_tokens += sum(len(c.token_ids) for c in out.outputs)
                    bar.update(1)
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(f"{out_tokens / elapsed:.1f} output tok/s")
        except BaseException:
            # Interrupted (Ctrl-C, a bug): leave no request of this call behind.
            engine.abort_request([rid for rid in order if results[order[rid]] is None])
            raise
        finally:
            bar.close()
        return results
