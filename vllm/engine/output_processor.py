"""OutputProcessor: the core's token deltas -> ``RequestOutput``s.

Per request it detokenizes incrementally, applies stop strings (a hit ends the request:
its id comes back in ``to_abort`` so the core frees the slot), attaches the text of each
logprob's token, merges the ``n`` samples of one prompt (children ``"{i}_{request_id}"``
in the core) back into one request, and shapes each output by ``output_kind``. A request
with ``detokenize=False`` gets token ids and logprobs only (no text, no token text); its
``skip_special_tokens`` / ``spaces_between_special_tokens`` go to the tokenizer's decode. It also
keeps each request's times for the metrics (``IterationStats``).

``process_step`` is what ``LLMEngine`` and ``AsyncLLM`` both do with a client's
``EngineCoreOutputs``: the outputs above, one finished output with reason "error" for each
request that failed, and the step's ``output_s``.

While a request may still hit a stop string, the last ``len(longest stop) - 1``
characters are held back from streamed outputs, so a client never sees text that the stop
string will cut.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from vllm.engine.core import EngineCoreOutput, EngineCoreRequest
from vllm.engine.core_client import EngineCoreOutputs
from vllm.engine.stats import FinishedRequestStats, IterationStats
from vllm.engine.tokenizer import IncrementalDetokenizer
from vllm.logger import init_logger
from vllm.outputs import CompletionOutput, Logprob, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams

logger = init_logger(__name__)


def child_id(index: int, request_id: str) -> str:
    return f"{index}_{request_id}"


class _Sample:
    """One sample (one core request) of a request."""

    def __init__(self, index: int, core_id: str, tokenizer, prompt_ids: list[int], params):
        self.index = index
        self.core_id = core_id
        self.params: SamplingParams = params
        self.tokenizer = tokenizer
        self.all_ids = list(prompt_ids)
        self.num_prompt = len(prompt_ids)
        self.detokenize = params.detokenize
        # Only what differs from decode's defaults, so a tokenizer with a bare decode(ids)
        # serves every request that keeps them.
        decode_kwargs = {
            name: False
            for name in ("skip_special_tokens", "spaces_between_special_tokens")
            if not getattr(params, name)
        }
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, **decode_kwargs)
        self.text = ""
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.sent_tokens = 0  # what DELTA outputs have sent already
        self.sent_text = 0
        self.hold = max(map(len, params.stop_strings), default=1) - 1

    @property
    def token_ids(self) -> list[int]:
        return self.all_ids[self.num_prompt :]

    def add(self, out: EngineCoreOutput) -> bool:
        """Apply the core's delta; True when a stop string ended the sample here."""
        # The EOS that ends a sample stays out of its text, as in vLLM (it shows otherwise
        # with skip_special_tokens=False); its id is in token_ids.
        eos_end = out.finish_reason == "stop" and out.stop_reason is None
        last = len(out.new_token_ids) - 1
        for i, token in enumerate(out.new_token_ids):
            self.all_ids.append(token)
            if out.new_logprobs is not None and self.logprobs is not None:
                lps = self.logprobs_of(out.new_logprobs[i])
                self.logprobs.append(lps)
                self.cumulative_logprob += lps[token].logprob
            if not self.detokenize or (eos_end and i == last):
                continue
            delta = self.detok.step(self.all_ids)
            # min_tokens: stop strings count only after that many tokens (vLLM's rule).
            if delta and self._stop_string(delta, len(self.token_ids) > self.params.min_tokens):
                return True
        if out.finish_reason is not None:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        return False

    def _stop_string(self, delta: str, armed: bool = True) -> bool:
        self.text += delta
        stops = self.params.stop_strings
        if not stops or not armed:
            return False
        # Only the tail can hold a stop string that this delta completed.
        tail_from = max(0, len(self.text) - len(delta) - self.hold)
        hits = [(i, s) for s in stops if (i := self.text.find(s, tail_from)) >= 0]
        if not hits:
            return False
        cut, stop = min(hits)
        self.text = self.text[:cut]
        self.finish_reason, self.stop_reason = "stop", stop
        return True

    def logprobs_of(self, values: dict[int, tuple[float, int]]) -> dict[int, Logprob]:
        if not self.detokenize:
            return {t: Logprob(lp, rank) for t, (lp, rank) in values.items()}
        decode = self.tokenizer.decode
        return {t: Logprob(lp, rank, decode([t])) for t, (lp, rank) in values.items()}

    def completion(self, kind: RequestOutputKind) -> CompletionOutput:
        finished = self.finish_reason is not None
        shown = len(self.text) if finished else max(self.sent_text, len(self.text) - self.hold)
        tokens, text, lps = self.token_ids, self.text[:shown], self.logprobs
        if kind is RequestOutputKind.DELTA:
            tokens, text = tokens[self.sent_tokens :], text[self.sent_text :]
            lps = None if lps is None else lps[self.sent_tokens :]
            self.sent_tokens, self.sent_text = len(self.token_ids), shown
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=list(tokens),
            finish_reason=self.finish_reason,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if lps is None else list(lps),
            stop_reason=self.stop_reason,
        )


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    arrival_time: float
    prompt_logprobs: list | None = None
    sent_prompt_logprobs: bool = False
    num_cached_tokens: int | None = None
    first_token_time: float | None = None
    last_token_time: float = 0.0
    num_generation_tokens: int = 0
    error: str | None = None
    done: set[int] = field(default_factory=set)  # indices of finished samples

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.samples)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, _Request] = {}
        self._by_core_id: dict[str, tuple[_Request, _Sample]] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> list[EngineCoreRequest]:
        """Track a request; the core requests of its samples, for the client."""
        if params.n == 1:
            children = [(request_id, params)]
        else:
            children = [(child_id(i, request_id), params.child(i)) for i in range(params.n)]
        samples = [
            _Sample(i, cid, self.tokenizer, prompt_token_ids, p)
            for i, (cid, p) in enumerate(children)
        ]
        req = _Request(
            request_id,
            prompt,
            list(prompt_token_ids),
            params,
            samples,
            time.monotonic() if arrival_time is None else arrival_time,
        )
        self.requests[request_id] = req
        for sample in samples:
            self._by_core_id[sample.core_id] = (req, sample)
        eos = self.tokenizer.eos_token_id
        return [EngineCoreRequest(cid, prompt_token_ids, p, eos) for cid, p in children]

    def abort(self, request_id: str, stats: IterationStats | None = None) -> list[str]:
        """Forget a request (counted as finished by "abort" in ``stats``); the core ids to
        abort."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return []
        if stats is not None:
            stats.finished.append(self._finished_stats(req, time.monotonic(), "abort"))
        for s in req.samples:
            self._by_core_id.pop(s.core_id, None)
        return [s.core_id for s in req.samples if s.index not in req.done]

    def process_step(
        self, result: EngineCoreOutputs, stats: IterationStats | None, in_process: bool
    ) -> tuple[list[RequestOutput], list[str], dict[str, str]]:
        """(request outputs, core ids to abort, {request id: error}) of one client result; a
        request that failed is one finished output, reason "error", its message in
        ``error``. The step (None: the core ran none) gets ``output_s``; a core in this
        process (``in_process``) ran the step on this thread just before, so its
        ``total_s`` covers this too. ``stats.step`` is the step."""
        t0 = time.perf_counter()
        outputs, to_abort, errors = self.process_outputs(result.outputs, stats)
        for rid, message in errors.items():
            logger.warning("request %s failed: %s", rid, message)
            completion = CompletionOutput(0, "", [], finish_reason="error")
            outputs.append(RequestOutput(rid, None, [], [completion], finished=True, error=message))
        step = result.step
        if step is not None:
            step.output_s = time.perf_counter() - t0
            if in_process:
                step.total_s += step.output_s
        if stats is not None:
            stats.step = step
        return outputs, to_abort, errors

    def process_outputs(
        self, outputs: list[EngineCoreOutput], stats: IterationStats | None = None
    ) -> tuple[list[RequestOutput], list[str], dict[str, str]]:
        """(request outputs, core ids to abort, {request id: error}) of one core step."""
        now = time.monotonic()
        results: dict[str, RequestOutput] = {}
        to_abort: list[str] = []
        errors: dict[str, str] = {}
        for out in outputs:
            entry = self._by_core_id.get(out.request_id)
            if entry is None:
                continue  # aborted meanwhile
            req, sample = entry
            if out.error is not None:
                errors[req.request_id] = out.error
                to_abort += [cid for cid in self.abort(req.request_id) if cid != out.request_id]
                results.pop(req.request_id, None)
                if stats is not None:
                    stats.finished.append(self._finished_stats(req, now, "error"))
                continue
            try:
                stopped = sample.add(out)
            except Exception as err:  # noqa: BLE001 - detokenizing fails this request only
                errors[req.request_id] = f"detokenizing failed: {type(err).__name__}: {err}"
                to_abort += self.abort(req.request_id)
                results.pop(req.request_id, None)
                continue
            if stopped:
                to_abort.append(sample.core_id)
            if out.num_cached_tokens is not None and sample.index == 0:
                req.num_cached_tokens = out.num_cached_tokens
            if out.prompt_logprobs is not None and sample.index == 0:
                req.prompt_logprobs = [
                    None if p is None else sample.logprobs_of(p) for p in out.prompt_logprobs
                ]
            self._account(req, out, now, stats)
            if sample.finish_reason is not None:
                req.done.add(sample.index)
                self._by_core_id.pop(sample.core_id, None)
            made = self._make_output(req, sample)
            if made is not None:
                prev = results.get(req.request_id)
                if prev is not None and req.params.output_kind is RequestOutputKind.DELTA:
                    prev.outputs += made.outputs
                    prev.finished = made.finished
                else:
                    results[req.request_id] = made
            if req.finished:
                del self.requests[req.request_id]
                if stats is not None:
                    stats.finished.append(self._finished_stats(req, now, sample.finish_reason))
        return list(results.values()), to_abort, errors

    def _account(self, req: _Request, out: EngineCoreOutput, now: float, stats) -> None:
        n = len(out.new_token_ids)
        if n == 0:
            return
        req.num_generation_tokens += n
        if stats is None:
            req.first_token_time = req.first_token_time or now
            return
        stats.num_generation_tokens += n
        if req.first_token_time is None:
            req.first_token_time = now
            stats.num_prompt_tokens += len(req.prompt_token_ids)
            stats.time_to_first_tokens_s.append(now - req.arrival_time)
        elif len(req.samples) == 1:
            stats.inter_token_latencies_s.append(now - req.last_token_time)
        req.last_token_time = now

    @staticmethod
    def _finished_stats(req: _Request, now: float, reason) -> FinishedRequestStats:
        return FinishedRequestStats(
            now - req.arrival_time, len(req.prompt_token_ids), req.num_generation_tokens, reason
        )

    def _make_output(self, req: _Request, sample: _Sample) -> RequestOutput | None:
        kind = req.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY:
            if not req.finished:
                return None
            outputs = [s.completion(kind) for s in req.samples]
        elif kind is RequestOutputKind.DELTA:
            outputs = [sample.completion(kind)]
        else:
            outputs = [s.completion(kind) for s in req.samples if s.all_ids[s.num_prompt :]]
        prompt_lps = req.prompt_logprobs
        if kind is RequestOutputKind.DELTA:
            if req.sent_prompt_logprobs:
                prompt_lps = None
            elif prompt_lps is not None:
                req.sent_prompt_logprobs = True
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=outputs,
            finished=req.finished,
            prompt_logprobs=prompt_lps,
            num_cached_tokens=req.num_cached_tokens,
        )
