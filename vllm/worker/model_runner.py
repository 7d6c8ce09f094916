"""ModelRunner: turns a step's flat inputs into the model's, runs the forward, returns logits.

Once per step (``execute_inputs``; the worker samples the logits) it fills host buffers
(pinned on CUDA) with the input ids, the token positions (models with attention layers),
the rows whose logits are needed, and the metadata's host data, copies them to the device
without a sync, builds the step's metadata once (the Mamba2 metadata; the attention
metadata from the step's block tables), and runs the model inside ``set_forward_context``,
where each layer reads the part it needs. On CUDA, by ``cudagraph_mode``: decode-only
steps replay a captured graph instead (``cuda_graph.py``; FULL_DECODE_ONLY and FULL), and
with FULL so do mixed steps that fit a bucket (``mixed_graph.py``); NONE (``enforce_eager``)
runs every step eagerly. ``step_counts`` counts the steps by how they ran.

Start-up (``__init__``) does all the one-time work before the first request: weights,
the caches the model's specs describe (``cache_engine.py``: the state pool, and the KV
cache, first a small one for the start-up steps), every Triton kernel variant a step
within the limits can select (``warmup.py``), on CUDA a profile step of a full token budget
for the activations' peak, the KV cache sized from it, and the decode CUDA graphs of every
batch-size bucket; ``startup`` records the seconds each part took.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from vllm.config import EngineConfig
from vllm.distributed.parallel_state import get_tp_group
from vllm.forward_context import ForwardContext, set_forward_context
from vllm.logger import init_logger
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.staged_upload import StagedUpload
from vllm.step_io import StepInputs
from vllm.worker.cache_engine import CacheEngine, checkpoint_lines_for, replay_len_for
from vllm.worker.cuda_graph import DecodeGraphs
from vllm.worker.mixed_graph import (
    MixedGraphs,
    full_graphs_unsupported,
    graph_pool_gib,
    measure_mixed_graphs,
)
from vllm.worker.warmup import compile_kernels, dummy_steps

logger = init_logger(__name__)

# Tokens a start-up dummy row that continues a sequence has in the cache already.
_DUMMY_CONTEXT = 2


@dataclass
class StepResult:
    """fp32 logits: ``logits[j]`` of ``StepInputs.sample_rows[j]``, ``prompt_logits[j]`` of
    ``prompt_rows[j]`` (None when the step has none); rank 0's (None on the other ranks
    under tensor parallelism)."""

    logits: torch.Tensor | None
    prompt_logits: torch.Tensor | None = None
    graph: bool = False  # the step replayed a CUDA graph (decode-only or mixed)


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        tp = get_tp_group()
        if tp.world_size > 1 and self.device.type == "cuda":
            self.device = tp.device  # this rank's GPU
        n_tok, n_seq = config.max_num_batched_tokens, config.max_num_seqs
        t0 = time.perf_counter()
        self.model = get_model(
            config.model_dir,
            load_format=config.load_format,
            dtype=config.dtype,
            device=self.device,
            seed=config.seed,
        )
        self._sync()
        t1 = time.perf_counter()
        self.builder = self.model.metadata_builder(self.device)
        # Prefix-cache checkpoint lines: as given, or what memory allows (cache_engine.py).
        replay = replay_len_for(self.model, config, self.device)
        lines = checkpoint_lines_for(self.model, config, self.device, replay)
        self.num_checkpoint_lines = lines
        self.cache = CacheEngine(
            self.model,
            num_slots=n_seq + lines,
            block_size=config.block_size,
            ssm_dtype=config.ssm_state_dtype,
            device=self.device,
            replayssm_buffer_len=replay,
            num_checkpoint_lines=lines,
        )
        self.pool = self.cache.mamba_pool
        self.attn_builder = None
        if self.cache.has_attention:
            from vllm.model_executor.layers.attention import AttentionMetadataBuilder

            self.attn_builder = AttentionMetadataBuilder(
                config.block_size,
                n_seq,
                n_tok,
                self.cache.blocks_for(config.max_model_len),
                self.device,
            )
        # A step's host-built tensors (input ids, positions, sampled rows, pending-token
        # rows, the Mamba and attention metadata) reach the device in one copy.
        self.staging = StagedUpload(self.device)
        self._sync()
        t2 = time.perf_counter()
        mode = config.cudagraph_mode if self.device.type == "cuda" else "NONE"
        self.full_graphs_off = None  # why FULL (asked for or the default) was not given
        if mode == "FULL":
            self.full_graphs_off = full_graphs_unsupported(self.model, self.builder)
            if self.full_graphs_off is not None:  # a warning where FULL was asked for
                asked = config.compilation_config.cudagraph_mode is not None
                (logger.warning if asked else logger.info)(
                    "cudagraph_mode FULL: mixed steps run eagerly: %s", self.full_graphs_off
                )
                mode = "FULL_DECODE_ONLY"
        profile_rows = self._profile_rows()
        self.cache.allocate_kv(self._startup_blocks(profile_rows))
        kernels = compile_kernels(self.dummy_step, self._zero_state, n_seq, n_tok, self.device)
        peak = self._activation_peak(profile_rows) if profile_rows else 0
        cap = config.compilation_config.capture_size  # the most tokens of a graphed step
        # Where the KV cache is sized from free memory, it leaves the mixed graphs what a
        # throwaway capture of them took (their budget), beside the eager steps' peak.
        graph_budget = None
        if mode == "FULL" and profile_rows:
            graph_budget = measure_mixed_graphs(self.model, self.builder, min(n_tok, cap), n_seq,
                                                self.attn_builder, self._reserved)  # fmt: skip
        reserved_peak = peak + (graph_budget or 0)
        if self.cache.has_attention:
            self.cache.allocate_kv(
                self.cache.num_kv_blocks(
                    override=config.num_gpu_blocks_override,
                    gpu_memory_utilization=config.gpu_memory_utilization,
                    max_num_seqs=n_seq,
                    max_model_len=config.max_model_len,
                    peak_activation_bytes=reserved_peak,
                )
            )
        self._sync()
        t3 = time.perf_counter()
        self.graphs = self.mixed_graphs = None
        pool_before = self._reserved() if mode != "NONE" else 0
        if mode != "NONE":
            self.graphs = DecodeGraphs(self.model, min(n_seq, cap), self.attn_builder)
            self.graphs.capture()
            self._sync()
        t4 = time.perf_counter()
        pool_mid = self._reserved() if mode != "NONE" else 0
        if mode == "FULL":
            self.mixed_graphs = MixedGraphs(self.model, self.builder, min(n_tok, cap), n_seq,
                                            self.graphs.mempool, self.attn_builder)  # fmt: skip
            self.mixed_graphs.capture()
            self._sync()
        t5 = time.perf_counter()
        pool_after = self._reserved() if mode != "NONE" else 0
        if graph_budget is not None and pool_after - pool_mid > graph_budget:
            logger.warning(
                "the mixed-step CUDA graphs took %.2f GiB, over their budget, what their "
                "throwaway capture took (%.2f GiB), which the KV cache left free for them: "
                "lower gpu_memory_utilization if steps run out of memory",
                (pool_after - pool_mid) / 2**30, graph_budget / 2**30,
            )  # fmt: skip
        self.cudagraph_mode = mode
        # Steps by how they ran: decode-only graphs, mixed graphs, eager.
        self.step_counts = {"graph_decode": 0, "graph_mixed": 0, "eager": 0}
        # cudagraph_mode FULL: mixed steps that ran eagerly, by why (``MixedGraphs.select``).
        self.eager_mixed_reasons: dict[str, int] = {}
        self.startup = {
            "weights_s": t1 - t0,
            "state_pool_s": t2 - t1,
            "compile_s": kernels.seconds,
            "warmup_s": t3 - t2,
            "graph_capture_s": t4 - t3,
            "mixed_graph_capture_s": t5 - t4,
            "cudagraph_mode": mode,
            "num_mixed_graphs": 0 if self.mixed_graphs is None else len(self.mixed_graphs.buckets),
            "graph_pool_gib": graph_pool_gib(pool_before, pool_after),
            "mixed_graph_pool_gib": graph_pool_gib(pool_mid, pool_after),
            # None: nothing sized from free memory (no KV cache, or its size given)
            "graph_budget_gib": None if graph_budget is None else graph_budget / 2**30,
            "num_kernels": kernels.num_variants,
            "num_kernels_compiled": kernels.num_new,
            "kernel_variants": kernels.variants,
            "kernel_finished_s": kernels.finished_s,
            "num_graphs": 0 if self.graphs is None else len(self.graphs.buckets),
            "state_pool_gib": 0.0 if self.pool is None else self.pool.nbytes() / 2**30,
            "replayssm_buffer_len": 0 if self.pool is None else self.pool.replay_len,
            "replay_ring_gib": 0.0 if self.pool is None else self.pool.ring_nbytes() / 2**30,
            "num_checkpoint_lines": self.num_checkpoint_lines,
            "checkpoint_gib": 0.0
            if self.pool is None
            else self.pool.nbytes() * self.num_checkpoint_lines / (self.pool.num_slots + 1) / 2**30,
            "num_kv_blocks": self.cache.num_blocks,
            "kv_cache_gib": self.cache.kv_nbytes() / 2**30,
        }

    def _reserved(self) -> int:
        """Device memory the caching allocator holds, its unused cached blocks released
        first: what graphs captured since the last call keep."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(self.device)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- start-up ------------------------------------------------------------------------

    def _profile_rows(self) -> list[tuple[int, bool]]:
        """Fresh prompts filling the token budget: the step whose activations peak, run on
        CUDA where the KV cache is sized from free memory (none otherwise)."""
        c = self.config
        if self.device.type != "cuda":
            return []
        if not self.cache.has_attention or c.num_gpu_blocks_override is not None:
            return []
        total = min(c.max_num_batched_tokens, c.max_num_seqs * c.max_model_len)
        rows = []
        while total > 0:
            n = min(total, c.max_model_len)
            rows.append((n, False))
            total -= n
        return rows

    def _startup_blocks(self, profile_rows) -> int:
        """KV blocks the start-up steps use (distinct blocks per row)."""
        steps = dummy_steps(self.config.max_num_seqs, self.config.max_num_batched_tokens)
        return max(sum(len(t) for t in self._dummy_tables(rows)) for rows in [*steps, profile_rows])

    def _dummy_tables(self, rows) -> list[list[int]]:
        tables, first = [], 0
        for n, init in rows:
            count = self.cache.blocks_for((_DUMMY_CONTEXT if init else 0) + n)
            tables.append(list(range(first, first + count)))
            first += count
        return tables

    def _activation_peak(self, rows) -> int:
        """Bytes a full-budget step allocates beyond what is resident (CUDA)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        with torch.no_grad():
            self.dummy_step(rows)
        torch.cuda.synchronize(self.device)
        self._zero_state(len(rows))
        return torch.cuda.max_memory_allocated(self.device) - base

    def _zero_state(self, num_slots: int) -> None:
        if self.pool is not None:
            self.pool.zero_slots(num_slots)

    @torch.no_grad()
    def materialise(self, slots) -> None:
        """Fold the replayed decode steps of state slots ``slots`` (distinct) into every
        Mamba layer's states, so that a reader outside a step (a prefix-cache checkpoint, a
        speculative-decoding rollback) sees whole states; nothing to do without replay.
        Queued on the stream like a step: no sync."""
        if self.pool is None or not self.pool.rings:
            return
        from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

        idx = torch.as_tensor(slots, dtype=torch.int32).to(self.device)
        for mixer in self.model.modules():
            if isinstance(mixer, MambaMixer2):
                mixer.materialise(idx)

    @torch.no_grad()
    def copy_state_lines(self, copies) -> None:
        """Prefix caching: copy whole state-pool lines, (src, dst) in order (a checkpoint
        written from a sequence's line, or restored into one); queued, no sync."""
        if self.pool is None:
            raise RuntimeError("state copies for a model without Mamba layers")
        for src, dst in copies:
            self.pool.copy_line(src, dst)

    @torch.no_grad()
    def copy_kv_blocks(self, copies) -> None:
        """Prefix caching of hybrids: copy whole KV blocks, (src, dst) in order, in every
        attention layer's cache (this rank's heads); queued, no sync."""
        if not self.cache.kv_caches:
            raise RuntimeError("KV block copies for a model without attention layers")
        for cache in self.cache.kv_caches.values():  # (2, num_blocks, block_size, ...)
            for src, dst in copies:
                cache[:, dst].copy_(cache[:, src])

    def dummy_step(self, rows: list[tuple[int, bool]]) -> torch.Tensor:
        """One forward over (tokens, has_initial_state) rows in state slots 1 ..
        len(rows) and distinct KV blocks from 0 (a row with an initial state has
        ``_DUMMY_CONTEXT`` cached tokens); the logits of the last row."""
        lens = [n for n, _ in rows]
        contexts = [_DUMMY_CONTEXT if init else 0 for _, init in rows]
        qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0, out=qsl[1:])
        md = self.builder.build(
            qsl,
            torch.arange(1, len(rows) + 1, dtype=torch.int32),
            torch.tensor([init for _, init in rows]),
        )
        positions, attn_md = None, None
        if self.attn_builder is not None:
            pos = [p for c, n in zip(contexts, lens, strict=True) for p in range(c, c + n)]
            positions = torch.tensor(pos, dtype=torch.int64).to(self.device)
            attn_md = self.attn_builder.build(
                lens, contexts, self._dummy_tables(rows), md.num_decode_tokens
            )
        ids = torch.zeros(sum(lens), dtype=torch.int64, device=self.device)
        with set_forward_context(ForwardContext(mamba2_metadata=md, attn_metadata=attn_md)):
            hidden = self.model(ids, positions)
        return self.model.compute_logits(hidden[-1:])

    # -- steps ---------------------------------------------------------------------------

    def _note_eager_mixed(self, why: str | None) -> None:
        """Count a FULL-mode mixed step that ran eagerly; log each kind of reason once (the
        server's log then names what no bucket held)."""
        kind = (why or "unknown").split(" (")[0]
        if kind not in self.eager_mixed_reasons:
            logger.info("cudagraph_mode FULL: a mixed step ran eagerly: %s", why)
        self.eager_mixed_reasons[kind] = self.eager_mixed_reasons.get(kind, 0) + 1

    @torch.no_grad()
    def execute_inputs(
        self, inp: StepInputs, prev_tokens: torch.Tensor | None = None
    ) -> StepResult:
        """The step's forward: fp32 logits of ``inp.sample_rows`` (and of ``inp.prompt_rows``).
        Under tensor parallelism every rank runs the same inputs; the logits are rank 0's.

        An input token still on the device (row ``fill_dst[i]``: sampled by the step before,
        whose tokens the host has not read) is taken from ``prev_tokens``, that step's
        sampled tokens, at row ``fill_src[i]``; a device gather, no sync.
        """
        ids, positions, lens = inp.ids, inp.positions, inp.lens
        sample_rows, fill_dst, fill_src = inp.sample_rows, inp.fill_dst, inp.fill_src
        slots, contexts = inp.slots, inp.contexts
        if fill_dst and prev_tokens is None:
            raise RuntimeError("pending input tokens but no previous step's tokens to fill them")
        attention = self.attn_builder is not None
        num_tokens, num_rows, num_seqs = len(ids), len(sample_rows), len(lens)
        if (
            self.graphs is not None
            and inp.num_decodes == num_seqs
            and num_rows == num_seqs
            and self.graphs.fits(num_seqs)
        ):
            pending = (fill_dst, fill_src, prev_tokens) if fill_dst else None
            attn = (contexts, inp.block_tables) if attention else None
            # Every row of this step ends its sequence's known tokens: all sample.
            self.step_counts["graph_decode"] += 1
            return StepResult(self.graphs.run(ids, slots, pending, attn), graph=True)
        if self.mixed_graphs is not None:
            selected = self.mixed_graphs.select(inp)
            if selected is not None:
                self.step_counts["graph_mixed"] += 1
                logits = self.mixed_graphs.run(inp, selected, prev_tokens)
                return StepResult(logits, graph=True)
            self._note_eager_mixed(self.mixed_graphs.last_miss)
        self.step_counts["eager"] += 1

        n_fill, n_pos = len(fill_dst), len(positions)
        tail = num_tokens + n_pos
        host = {"inputs": torch.tensor(ids + positions + sample_rows + fill_dst + fill_src)}
        if inp.prompt_rows:
            host["prompt_rows"] = torch.tensor(inp.prompt_rows, dtype=torch.int64)
        qsl = torch.zeros(num_seqs + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0, out=qsl[1:])
        mamba = self.builder.prepare(
            qsl,
            torch.tensor(slots, dtype=torch.int32),
            torch.tensor([c > 0 for c in contexts]),
        )
        host.update({f"mamba.{name}": t for name, t in mamba.host.items()})
        if attention:
            attn = self.attn_builder.prepare(lens, contexts, inp.block_tables, inp.num_decodes)
            host["attn"] = attn.host
        dev = self.staging.upload(host)
        md = self.builder.finish(mamba, {name: dev[f"mamba.{name}"] for name in mamba.host})
        attn_md = self.attn_builder.finish(attn, dev["attn"]) if attention else None
        inputs = dev["inputs"]
        input_ids = inputs[:num_tokens]
        if n_fill:
            fill = inputs[tail + num_rows :]
            input_ids.index_copy_(0, fill[:n_fill], prev_tokens.index_select(0, fill[n_fill:]))
        with set_forward_context(ForwardContext(mamba2_metadata=md, attn_metadata=attn_md)):
            hidden = self.model(input_ids, inputs[num_tokens:tail] if n_pos else None)
        rows = inputs[tail : tail + num_rows]
        result = StepResult(self.model.compute_logits(hidden.index_select(0, rows)))
        if inp.prompt_rows:
            rows = dev["prompt_rows"]
            result.prompt_logits = self.model.compute_logits(hidden.index_select(0, rows))
        return result
