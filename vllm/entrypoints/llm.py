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


class LLM:
    """``model``: an HF model directory, or a ``Mamba2ModelConfig`` with
    ``load_format="dummy"``. Other keyword arguments are ``EngineArgs`` fields
    (``tokenizer``, ``dtype``, ``device``, ``seed``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``max_model_len``, ``enforce_eager``,
    ``mamba_ssm_cache_dtype``, ...), the options ``vllm serve`` takes."""

    def __init__(self, model: str | os.PathLike | Mamba2ModelConfig, **kwargs):
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs).create_engine_config())
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Outputs in the prompts' order; a prompt is a string, a list of token ids, or
        ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``. Every prompt and every
        SamplingParams is checked before any is queued: a call that raises leaves nothing
        behind. A request that fails while running comes back with finish reason "error"
        and its message in ``RequestOutput.error``; the others are unaffected."""
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
