"""ModelRunner: turns a scheduled batch into the model's inputs, runs it, returns logits.

Once per step it fills host buffers (pinned on CUDA) with the input ids, the rows whose
logits are needed, and the metadata's host data, copies them to the device without a
sync, builds the Mamba2 metadata once, and runs the model. Decode-only steps on CUDA replay
a captured graph instead (``cuda_graph.py``) unless ``enforce_eager``.

Start-up (``__init__``) does all the one-time work before the first request: weights,
the state pool, every Triton kernel variant a step within the limits can select
(``warmup.py``), and the decode CUDA graphs of every batch-size bucket; ``startup`` records
the seconds each part took.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from vllm.engine.config import EngineConfig
from vllm.engine.sampler import _small
from vllm.engine.scheduler import ScheduledBatch
from vllm.engine.sequence import PENDING_TOKEN
from vllm.model_executor.model_loader import get_model
from vllm.worker.cuda_graph import DecodeGraphs
from vllm.worker.warmup import compile_kernels


@dataclass
class StepResult:
    """``logits[j]`` (fp32) ends the known tokens of ``batch.seqs[sample_idx[j]]``;
    ``prompt_logits`` rows predict prompt tokens: span (i, first, count) of ``batch.seqs[i]``
    covers its positions first .. first + count - 1, rows in span order."""

    logits: torch.Tensor
    sample_idx: list[int]
    prompt_logits: torch.Tensor | None = None
    prompt_spans: list[tuple[int, int, int]] = field(default_factory=list)


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        t0 = time.perf_counter()
        self.model = get_model(
            config.model,
            load_format=config.load_format,
            dtype=config.dtype,
            device=self.device,
            seed=config.seed,
        )
        self._sync()
        t1 = time.perf_counter()
        self.builder = self.model.metadata_builder(self.device)
        self.pool = self.model.allocate_state_pool(
            config.max_num_seqs, ssm_dtype=config.ssm_state_dtype
        )
        pin = self.device.type == "cuda"
        n_tok, n_seq = config.max_num_batched_tokens, config.max_num_seqs
        # One int64 host buffer: input ids, the rows to sample, then the positions of
        # pending input tokens and their rows in the previous step's tokens; one copy.
        self._host = torch.zeros(n_tok + 3 * n_seq, dtype=torch.int64, pin_memory=pin)
        self._dev = torch.zeros(n_tok + 3 * n_seq, dtype=torch.int64, device=self.device)
        self._copied: torch.cuda.Event | None = None
        self._sync()
        t2 = time.perf_counter()
        kernels = compile_kernels(
            self.model, self.builder, self.pool, n_seq, config.max_num_batched_tokens
        )
        t3 = time.perf_counter()
        self.graphs = None
        if self.device.type == "cuda" and not config.enforce_eager:
            self.graphs = DecodeGraphs(self.model, self.pool, config.max_num_seqs)
            self.graphs.capture()
            self._sync()
        t4 = time.perf_counter()
        self.startup = {
            "weights_s": t1 - t0,
            "state_pool_s": t2 - t1,
            "compile_s": kernels.seconds,
            "warmup_s": t3 - t2,
            "graph_capture_s": t4 - t3,
            "num_kernels": kernels.num_variants,
            "num_kernels_compiled": kernels.num_new,
            "kernel_variants": kernels.variants,
            "num_graphs": 0 if self.graphs is None else len(self.graphs.buckets),
            "state_pool_gib": self.pool.nbytes() / 2**30,
        }

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def execute(self, batch: ScheduledBatch, prev_tokens: torch.Tensor | None = None) -> StepResult:
        """fp32 logits of the rows that end a sequence's known tokens, and those rows'
        indices into ``batch.seqs`` (a prefill chunk short of the prompt's end samples
        nothing); for sequences that ask for prompt logprobs, the logits of their chunk's
        rows that predict a prompt token.

        An input token still on the device (``PENDING_TOKEN``: sampled by the step before,
        whose tokens the host has not read) is taken from ``prev_tokens``, that step's
        sampled tokens, at row ``seq.pending_row``; a device gather, no sync.
        """
        lens = batch.num_tokens
        ids: list[int] = []
        sample_seqs: list[int] = []
        sample_rows: list[int] = []
        fill_dst: list[int] = []
        fill_src: list[int] = []
        prompt_rows: list[int] = []
        prompt_spans: list[tuple[int, int, int]] = []
        for i, (seq, n) in enumerate(zip(batch.seqs, lens, strict=True)):
            start = seq.num_computed_tokens
            chunk = seq.token_ids[start : start + n]
            count = min(n, seq.num_prompt_tokens - 1 - start)
            if seq.params.prompt_logprobs is not None and count > 0:
                prompt_spans.append((i, start, count))
                prompt_rows.extend(range(len(ids), len(ids) + count))
            if chunk[-1] == PENDING_TOKEN:
                if prev_tokens is None or PENDING_TOKEN in chunk[:-1]:
                    raise RuntimeError(f"{seq}: a pending input token the runner cannot fill")
                fill_dst.append(len(ids) + n - 1)
                fill_src.append(seq.pending_row)
            ids.extend(chunk)
            if start + n == len(seq.token_ids):
                sample_seqs.append(i)
                sample_rows.append(len(ids) - 1)
        num_tokens, num_rows = len(ids), len(sample_rows)
        slots = [seq.slot for seq in batch.seqs]
        if (
            self.graphs is not None
            and batch.num_decodes == len(batch)
            and self.graphs.fits(len(batch))
        ):
            pending = (fill_dst, fill_src, prev_tokens) if fill_dst else None
            # Every row of a decode-only step ends its sequence's known tokens: all sample.
            return StepResult(self.graphs.run(ids, slots, pending), sample_seqs)

        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy out of the host buffer
        n_fill = len(fill_dst)
        used = num_tokens + num_rows + 2 * n_fill
        self._host[:used] = torch.tensor(ids + sample_rows + fill_dst + fill_src)
        self._dev[:used].copy_(self._host[:used], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        input_ids = self._dev[:num_tokens]
        if n_fill:
            fill = self._dev[num_tokens + num_rows : used]
            input_ids.index_copy_(0, fill[:n_fill], prev_tokens.index_select(0, fill[n_fill:]))
        qsl = torch.zeros(len(batch) + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0, out=qsl[1:])
        md = self.builder.build(
            qsl,
            torch.tensor(slots, dtype=torch.int32),
            torch.tensor([seq.num_computed_tokens > 0 for seq in batch.seqs]),
        )
        hidden = self.model(input_ids, md, self.pool)
        rows = self._dev[num_tokens : num_tokens + num_rows]
        result = StepResult(self.model.compute_logits(hidden.index_select(0, rows)), sample_seqs)
        if prompt_spans:
            rows = _small(prompt_rows, self.device, dtype=torch.long)
            result.prompt_logits = self.model.compute_logits(hidden.index_select(0, rows))
            result.prompt_spans = prompt_spans
        return result
