"""EngineCore: scheduler + runner + sampler; each step returns the new tokens of every
running request (deltas), not only the finished ones.

A step: the scheduler picks one mixed batch (and, for a model with attention layers, the
KV blocks its tokens go to: ``KVCacheManager``, sized by the runner), the runner computes
the logits of the rows that end a sequence's known tokens, the sampler draws one token
for each, and each of those sequences takes its token and may finish (EOS, a stop token
id, max_tokens, max_model_len), which frees its slot (and its blocks) at once. The core
knows token ids only: text, stop strings and the ``n > 1`` fan-out are the output
processor's.

Async scheduling (``EngineConfig.async_scheduling``, on by default, as vLLM's
``--async-scheduling``): a step is dispatched before the host has read the previous
step's tokens. Its decode rows take their input tokens on the device from the previous
step's sampled tokens (``PENDING_TOKEN`` stands for them on the host), and only then does
the host read the previous step's tokens while the GPU runs the new step. That read waits
for the previous step only: each step's tokens are copied into pinned host memory right
behind it, and the read waits for that copy's event (``host_copy.HostCopy``). A plain
``.tolist()`` would wait for the new step as well, and the GPU would then sit idle while the
host applies the tokens and prepares the next step. A sequence that
ends (EOS, or an abort: a stop string, a client gone) has been dispatched in one more step
by then; that step's token for it is dropped, so outputs are the same as without async
scheduling. ``max_tokens`` is known ahead, so no step is wasted on it.

Failures stay with their request: a request whose sampling fails is finished with
``error`` set and its slot freed; a forward that fails fails the requests of that batch
only. The scheduler's state is never left half-updated, so the next step runs normally.

Tensor parallelism (``tensor_parallel_size`` N > 1): a ``MultiprocExecutor`` runs one
``Worker`` per rank (``vllm/worker/worker.py``; rank 0's in this process, ``self.runner``
being its runner); each step rank 0 prepares the batch's flat inputs once and the executor
sends them to every rank (under async scheduling rank 0 also broadcasts the previous
step's sampled tokens on the device), rank 0's logits come back and are sampled here. A
failed tensor-parallel step (a worker that died or raised) leaves the ranks out of step:
the engine is then dead, every request fails with the error, new requests are refused.

Each step leaves its host timing and token counts in ``last_step`` (``StepStats``: the
scheduler, the dispatch, the read of a dispatched step's tokens); the clock reads add no
device sync. On CUDA each dispatched batch also carries two timing events (queued before
its forward and right behind its sampler), read with its tokens: the batch's device span.
A step that compiled a Triton kernel variant (one the start-up warm-up missed) counts it
and logs a warning naming the kernel.
"""

from __future__ import annotations

import functools
import time
import weakref
from dataclasses import dataclass, field

import torch

from vllm.config import EngineConfig
from vllm.engine.host_copy import DeviceSpan, HostCopy
from vllm.engine.sampler import SampledLogprobs, Sampler, compute_logprobs
from vllm.engine.scheduler import ScheduledBatch, Scheduler
from vllm.engine.sequence import PENDING_TOKEN, Sequence
from vllm.engine.stats import StepStats
from vllm.executor.multiproc import MultiprocExecutor
from vllm.logger import init_logger
from vllm.sampling_params import SamplingParams
from vllm.triton_utils.launch import launch_misses
from vllm.worker.model_runner import ModelRunner
from vllm.worker.worker import Worker

logger = init_logger(__name__)

# {token id: (logprob, rank)} at one position; the output processor adds the text.
TokenLogprobs = dict[int, tuple[float, int]]


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # n == 1: the output processor fans n > 1 out into children
    eos_token_id: int | None = None


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | None = None  # the stop token id that ended it
    error: str | None = None


@dataclass
class _Dispatched:
    """A step whose sampled tokens are still on the device: ``tokens[rows[i]]`` is the token
    of ``seqs[i]``, to go at ``positions[i]`` of its token list. ``host`` is their copy to
    the host, queued right behind the step (the read waits for it), followed by the
    tensors of the step's logprobs when ``has_logprobs`` and of its prompt logprobs when
    ``prompt_spans`` ((sequence, first position, count) of each) is not None."""

    seqs: list[Sequence]
    positions: list[int]
    rows: list[int]
    tokens: torch.Tensor
    has_logprobs: bool
    prompt_spans: list[tuple[Sequence, int, int]] | None
    host: HostCopy
    num_prefill_tokens: int = 0  # the prompt tokens the step computed
    # From the step's queueing to its sampler's end (ahead of the host copy, so it is done
    # when the copy is); None on CPU.
    span: DeviceSpan | None = None


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.executor: MultiprocExecutor | None = None
        self.dead: BaseException | None = None  # a failed tensor-parallel step
        if config.tensor_parallel_size > 1:
            self.executor = MultiprocExecutor(
                config.tensor_parallel_size,
                functools.partial(Worker, config),
                backend="nccl" if torch.device(config.device).type == "cuda" else "gloo",
                config=config.model_config,
            )
            weakref.finalize(self, self.executor.shutdown)
            self.runner = self.executor.driver_worker.runner
        else:
            self.runner = ModelRunner(config)
        self.vocab_size = self.runner.model.config.vocab_size
        kv = None
        if self.runner.cache.has_attention:
            from vllm.engine.kv_cache_manager import KVCacheManager

            kv = KVCacheManager(self.runner.cache.num_blocks, config.block_size)
        self.scheduler = Scheduler(
            config.max_num_seqs,
            config.max_num_batched_tokens,
            kv,
            config.max_model_len,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
        )
        self.sampler = Sampler(self.runner.device, config.seed)
        self.requests: dict[str, Sequence] = {}
        self.num_steps = 0
        self._in_flight: _Dispatched | None = None
        self.last_step = StepStats()
        # Outputs made outside a step's read (aborts, failed batches), sent with the next.
        self._pending_outputs: list[EngineCoreOutput] = []

    # -- requests ------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do on one rank). Idempotent."""
        if self.executor is not None:
            self.executor.shutdown()

    def add_request(self, req: EngineCoreRequest) -> None:
        if self.dead is not None:
            raise RuntimeError(
                f"the engine has failed and takes no requests: {type(self.dead).__name__}: "
                f"{self.dead}"
            )
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already running")
        max_tokens = self.config.max_model_len - len(req.prompt_token_ids)
        if req.params.max_tokens is not None:
            max_tokens = min(max_tokens, req.params.max_tokens)
        seq = Sequence(req.request_id, req.prompt_token_ids, req.params, max_tokens=max_tokens)
        seq.eos_token_id = req.eos_token_id
        self.requests[req.request_id] = seq
        self.scheduler.add(seq)

    def abort_requests(self, request_ids) -> None:
        """End these requests now (unknown or finished ids are ignored) and free their
        slots; a token of theirs still in flight is dropped when read."""
        for rid in request_ids:
            seq = self.requests.get(rid)
            if seq is not None:
                self._finish(seq, "abort")

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.sampler.forget(seq)
        del self.requests[seq.request_id]

    @property
    def startup(self) -> dict:
        """The runner's start-up times (weights, compile, graphs) and sizes."""
        return self.runner.startup

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self._in_flight is not None or bool(self._pending_outputs)

    # -- steps ---------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """Dispatch one step and read the one before it (under async scheduling; without
        it, read this one); the outputs of every request that got a token or finished."""
        t0 = time.perf_counter()
        misses = launch_misses()  # a dict over the ~10 launchers: microseconds
        batch = self.scheduler.schedule()
        t1 = time.perf_counter()
        prefill = num_prompt_tokens(batch)
        dispatched = self._dispatch(batch) if batch.seqs else None
        if dispatched is not None:
            dispatched.num_prefill_tokens = prefill
        t2 = time.perf_counter()
        read = self._in_flight
        outputs, self._pending_outputs = self._pending_outputs, []
        if self._in_flight is not None:
            outputs += self._read(self._in_flight)
        self._in_flight = dispatched
        if dispatched is not None and not self.config.async_scheduling:
            read = dispatched
            outputs += self._read(dispatched)
            self._in_flight = None
        t3 = time.perf_counter()
        missed = {k: n - misses.get(k, 0) for k, n in launch_misses().items()}
        compiles = sum(missed.values())
        if compiles:
            logger.warning(
                "step %d compiled %d Triton kernel variant(s) the start-up warm-up missed: %s",
                self.num_steps,
                compiles,
                ", ".join(f"{k} ({n})" for k, n in missed.items() if n),
            )
        read_prefill = read.num_prefill_tokens if read is not None else prefill
        self.last_step = StepStats(
            schedule_s=t1 - t0,
            dispatch_s=t2 - t1,
            read_s=t3 - t2,
            num_prefill_tokens=prefill,
            num_decode_tokens=batch.total_tokens - prefill,
            waited_on_prefill=read_prefill > 0,
            device_s=read.span.seconds() if read is not None and read.span else None,
            kernel_compiles=compiles,
        )
        return outputs

    def _dispatch(self, batch: ScheduledBatch) -> _Dispatched | None:
        """Queue the step on the device: model, sampler; the tokens stay there."""
        prev = self._in_flight.tokens if self._in_flight is not None else None
        span = DeviceSpan.open(self.runner.device)
        try:
            if self.executor is None:
                result = self.runner.execute(batch, prev)
            else:
                result = self.executor.run(
                    "execute_model",
                    self.runner.prepare(batch),
                    0 if prev is None else prev.shape[0],
                    driver_kwargs={"prev_tokens": prev},
                )
            prompt = self._prompt_logprobs(batch, result)
        except Exception as err:  # noqa: BLE001 - the batch's requests fail, the engine lives
            if self.executor is not None and self.executor.failed:
                self._die(err)
                return None
            logger.exception("a step's forward failed; failing its %d requests", len(batch))
            for seq in batch.seqs:
                self._fail(seq, f"the model step failed: {type(err).__name__}: {err}")
            return None
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            seq.num_computed_tokens += n
        sampled = [batch.seqs[i] for i in result.sample_idx]
        tokens, logprobs = self._sample(result.logits, sampled)
        seqs, positions, rows = [], [], []
        for row, seq in enumerate(sampled):
            if seq.is_finished:
                continue  # its sampling failed: it is gone
            seqs.append(seq)
            rows.append(row)
            positions.append(len(seq.token_ids))
            seq.token_ids.append(PENDING_TOKEN)
            seq.pending_row = row
        self.num_steps += 1
        parts = [tokens]
        if logprobs is not None:
            parts += logprobs.tensors()
        if prompt is not None:
            parts += prompt[0].tensors()
        spans = prompt[1] if prompt is not None else None
        span = span.close() if span is not None else None  # ahead of the copy
        host = HostCopy(parts)
        return _Dispatched(
            seqs, positions, rows, tokens, logprobs is not None, spans, host, span=span
        )

    def _die(self, err: BaseException) -> None:
        """A tensor-parallel step failed: the ranks are out of step, so every request
        fails with the error and the engine takes no more."""
        logger.error("the tensor-parallel engine failed: %s", err)
        self.dead = err
        message = f"the tensor-parallel engine failed: {type(err).__name__}: {err}"
        for seq in list(self.requests.values()):
            self._fail(seq, message)

    def _prompt_logprobs(self, batch: ScheduledBatch, result):
        """Device logprobs of the prompt tokens this step's chunks predict."""
        if not result.prompt_spans:
            return None
        spans, targets, k = [], [], 0
        for i, first, count in result.prompt_spans:
            seq = batch.seqs[i]
            spans.append((seq, first, count))
            targets += seq.prompt_token_ids[first + 1 : first + 1 + count]
            k = max(k, seq.params.prompt_logprobs)
        values = compute_logprobs(result.prompt_logits, targets, k)
        return values, spans

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]):
        """Tokens (and logprobs, where asked) of ``seqs``' rows; a request whose sampling
        fails is failed alone (its row is then sampled apart from the others)."""
        if not seqs:
            return logits.new_empty(0, dtype=torch.long), None
        try:
            tokens = self.sampler.sample(logits, seqs)
        except Exception:  # noqa: BLE001 - find the request(s) at fault, row by row
            logger.exception("sampling a batch failed; sampling its rows one by one")
            tokens = torch.zeros(len(seqs), dtype=torch.long, device=logits.device)
            for i, seq in enumerate(seqs):
                try:
                    tokens[i : i + 1] = self.sampler.sample(logits[i : i + 1], [seq])
                except Exception as err:  # noqa: BLE001
                    self._fail(seq, f"sampling failed: {type(err).__name__}: {err}")
        k = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
        logprobs = compute_logprobs(logits, tokens, max(k)) if k else None
        return tokens, logprobs

    def _fail(self, seq: Sequence, message: str) -> None:
        if seq.is_finished:
            return
        self._finish(seq, "error")
        self._pending_outputs.append(
            EngineCoreOutput(seq.request_id, finish_reason="error", error=message)
        )

    def _read(self, step: _Dispatched) -> list[EngineCoreOutput]:
        """Read a dispatched step's tokens (waits for that step only, not for a step queued
        after it) and apply them."""
        tokens, lps, prompt_values = self._host_lists(step)
        if step.prompt_spans is not None:
            offset = 0
            for seq, _, count in step.prompt_spans:
                if seq.prompt_logprobs is not None:  # None: finished meanwhile
                    k = seq.params.prompt_logprobs
                    seq.prompt_logprobs += [
                        prompt_values.position(offset + j, k) for j in range(count)
                    ]
                offset += count
        outputs = []
        for seq, pos, row in zip(step.seqs, step.positions, step.rows, strict=True):
            if seq.is_finished:
                continue  # ended (or aborted) before this token was read: dropped
            token = tokens[row]
            seq.token_ids[pos] = token
            out = EngineCoreOutput(seq.request_id, [token])
            if lps is not None and seq.params.logprobs is not None:
                out.new_logprobs = [lps.position(row, seq.params.logprobs)]
            if pos == seq.num_prompt_tokens and seq.prompt_logprobs is not None:
                out.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None
            reason, stop_token = self._check_stop(seq, pos)
            if reason is not None:
                del seq.token_ids[pos + 1 :]  # a later step's pending token
                self._finish(seq, reason)
                out.finish_reason, out.stop_reason = reason, stop_token
            outputs.append(out)
        return outputs

    @staticmethod
    def _host_lists(step: _Dispatched):
        """The step's tokens, and its logprobs and prompt logprobs where it has them, as host
        lists (the host copy holds them in that order)."""
        host = list(step.host.get())
        tokens = host.pop(0).tolist()
        n = SampledLogprobs.NUM_TENSORS
        lists = [SampledLogprobs(*host[i : i + n]).to_lists() for i in range(0, len(host), n)]
        lps = lists.pop(0) if step.has_logprobs else None
        prompt = lists.pop(0) if step.prompt_spans is not None else None
        return tokens, lps, prompt

    @staticmethod
    def _check_stop(seq: Sequence, pos: int) -> tuple[str | None, int | None]:
        """Whether the token at ``pos`` (the last one read) ends the sequence, and why."""
        params = seq.params
        token = seq.token_ids[pos]
        if not params.ignore_eos and seq.eos_token_id is not None and token == seq.eos_token_id:
            return "stop", None
        if token in params.stop_token_ids:
            return "stop", token
        if pos + 1 - seq.num_prompt_tokens >= seq.max_tokens:
            return "length", None
        return None, None


def num_prompt_tokens(batch: ScheduledBatch) -> int:
    """The batch's prompt tokens (counted before the step computes them): the rows of
    sequences not yet past their prompt."""
    return sum(
        n
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True)
        if seq.num_computed_tokens < seq.num_prompt_tokens
    )
