"""LLM: offline generation, ``LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import os
import time

from tqdm.auto import tqdm

from vllm.engine.config import EngineConfig
from vllm.engine.llm_engine import LLMEngine
from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams


class LLM:
    """``model``: an HF model directory, or a ``Mamba2ModelConfig`` with
    ``load_format="dummy"``. Other keyword arguments are ``EngineConfig`` fields
    (``tokenizer``, ``dtype``, ``device``, ``seed``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``enforce_eager``)."""

    def __init__(self, model: str | os.PathLike | Mamba2ModelConfig, **kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Outputs in the prompts' order; a prompt is a string or a list of token ids."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        engine = self.engine
        order = {}
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params, strict=True)):
            order[engine.add_request(prompt, params).request_id] = i
        results: list[RequestOutput | None] = [None] * len(prompts)
        bar = tqdm(total=len(prompts), desc="Generating", unit="req", disable=not use_tqdm)
        start, out_tokens = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                results[order[out.request_id]] = out
                out_tokens += len(out.outputs[0].token_ids)
                bar.update(1)
                elapsed = max(time.perf_counter() - start, 1e-9)
                bar.set_postfix_str(f"{out_tokens / elapsed:.1f} output tok/s")
        bar.close()
        return results
