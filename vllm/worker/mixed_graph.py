"""MixedGraphs: CUDA graphs of mixed steps (prefill chunks beside decodes), ``cudagraph_mode``
FULL.

An eager step of a 64-layer model issues thousands of launches from the host (~30 ms),
whatever its tokens; a graph replays them in one call. A mixed step of ``n`` tokens and
``r`` sequences runs the graph of the smallest bucket (``mixed_buckets``: T tokens, S =
min(T, max_num_seqs) rows, at most P prefills) that holds it, with its Mamba2 metadata
padded to the bucket (``mamba2_padded``: fixed row, chunk and sequence counts; padded rows
on the null line, spare chunks empty) and its attention metadata padded by the attention
builder (padded sequences without tokens, padded tokens owned by none). A step that fits
no bucket, asks for prompt logprobs, or whose leading rows are not its decodes runs
eagerly; ``ModelRunner`` counts both.

Each graph owns a fixed host buffer and its device copy: the input ids, positions, the
sampled rows and the Mamba2 metadata at offsets that never change, so the graph reads a
step's data where it read its capture's. A step packs its data there on the host, sends it
with the attention plan and the pending-token rows in ONE upload (``StagedUpload``), and
one device copy moves the fixed part into place; the attention builder's ``finish`` writes
its persistent buffers, which the graph captured. The graph ends at the hidden states of
the S sampled rows; the logits of the real ones follow it (one matmul, outside). Graphs
share the decode graphs' memory pool (they never run at once) and are captured largest
first at start-up, every row padded, so capturing touches no sequence's state.
``capture=False`` runs the padded steps eagerly instead: the CPU tests' check of the
padding (graphs are CUDA-only).
"""

from __future__ import annotations

import gc
import math
from dataclasses import replace

import torch

from vllm.forward_context import ForwardContext, set_forward_context
from vllm.model_executor.layers.mamba.mamba2_padded import (
    MixedBucket,
    decodes_lead,
    finish_padded,
    prepare_padded,
)
from vllm.model_executor.staged_upload import ALIGN_BYTES, StagedUpload, packed_offsets
from vllm.worker.cuda_graph import warm_up


def mixed_token_sizes(max_tokens: int) -> list[int]:
    """Token counts of the buckets: 32, then every 64 up to 1024, every 128 up to 2048,
    every 256 above, and ``max_tokens`` itself; none above it. A step pads to the next one:
    by at most 64 tokens up to 1024, by at most an eighth above."""
    sizes = [32, *range(64, 1025, 64), *range(1152, 2049, 128), *range(2304, max_tokens, 256)]
    return sorted({t for t in sizes if t < max_tokens} | {max_tokens})


def mixed_buckets(max_tokens: int, max_seqs: int, ssd: bool = True) -> list[MixedBucket]:
    """The buckets of a mixed step within the limits, smallest first: S = min(T,
    max_seqs) rows, P = min(S, max(4, T // 128)) prefills (a step carries few prompt
    chunks; each may add a chunk to the SSD's padded layout). Without Mamba2 layers
    (``ssd`` False: no chunk layout to size) any row may be a prefill: P = S."""
    out = []
    for t in mixed_token_sizes(max_tokens):
        s = min(t, max_seqs)
        out.append(MixedBucket(t, s, min(s, max(4, t // 128)) if ssd else s))
    return out


class _Fields:
    """Named typed views at fixed, 16-byte aligned offsets of one byte buffer."""

    def __init__(self, specs: dict[str, tuple[torch.dtype, int]]):
        self.specs = specs
        self.offsets, total = packed_offsets({n: d.itemsize * k for n, (d, k) in specs.items()})
        self.nbytes = max(total, ALIGN_BYTES)

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for name, (dtype, numel) in self.specs.items():
            off = self.offsets[name]
            out[name] = buf[off : off + numel * dtype.itemsize].view(dtype)
        return out


class _MixedGraph:
    def __init__(self, model, bucket: MixedBucket, chunk_size: int, device, mempool,
                 attn_builder, capture: bool = True):  # fmt: skip
        self.bucket, self.chunk_size = bucket, chunk_size
        t, s = bucket.num_tokens, bucket.num_seqs
        padding = prepare_padded(bucket, chunk_size, [], [], [], 0)
        specs = {"ids": (torch.int64, t), "rows": (torch.int64, s)}
        if attn_builder is not None:
            specs["positions"] = (torch.int64, t)
        for name, v in padding.host.items():
            specs[f"mamba.{name}"] = (v.dtype, v.numel())
        self.fields = _Fields(specs)
        self.host_buf = torch.zeros(self.fields.nbytes, dtype=torch.uint8)
        self.dev_buf = torch.zeros(self.fields.nbytes, dtype=torch.uint8, device=device)
        self.host = self.fields.views(self.host_buf)
        self.dev = self.fields.views(self.dev_buf)
        self._fill_mamba(padding.host)
        self.dev_buf.copy_(self.host_buf)
        md = finish_padded(padding, {n[6:]: v for n, v in self.dev.items() if n[:6] == "mamba."})
        self.input_ids, self.rows = self.dev["ids"], self.dev["rows"]
        self.positions, attn_md = self.dev.get("positions"), None
        if attn_builder is not None:
            attn_md = attn_builder.build([], [], [], 0, pad_tokens_to=t, pad_seqs_to=s)
            # A prefill's tiles: the graph serves any query lengths (the hints pick tiles).
            attn_md = replace(attn_md, max_query_len=t, max_seq_len=None)
        context = ForwardContext(mamba2_metadata=md, attn_metadata=attn_md)

        def step():
            with set_forward_context(context):
                hidden = model(self.input_ids, self.positions)
            return hidden.index_select(0, self.rows)

        self.graph = None
        if not capture:
            # The padded step run eagerly (the CPU's check of the padding: no graphs there).
            self.step = step
            return
        warm_up(step)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=mempool):
            self.hidden = step()

    def _fill_mamba(self, host: dict[str, torch.Tensor]) -> None:
        for name, v in host.items():
            self.host[f"mamba.{name}"].copy_(v.reshape(-1))

    def pack(self, inp, plan) -> None:
        """The step's fixed data into the host buffer (the rest of each field zeroed)."""
        n, r = len(inp.ids), len(inp.sample_rows)
        ids, rows = self.host["ids"], self.host["rows"]
        ids[:n] = torch.tensor(inp.ids, dtype=torch.int64)
        ids[n:] = 0
        rows[:r] = torch.tensor(inp.sample_rows, dtype=torch.int64)
        rows[r:] = 0
        if "positions" in self.host:
            pos = self.host["positions"]
            pos[:n] = torch.tensor(inp.positions, dtype=torch.int64)
            pos[n:] = 0
        self._fill_mamba(plan.host)


class MixedGraphs:
    """The mixed-step graphs of one model (module docstring). ``select`` says whether a step
    has a graph (and prepares its padded metadata); ``run`` replays it."""

    def __init__(self, model, builder, max_tokens: int, max_seqs: int, mempool,
                 attn_builder=None, capture: bool = True):  # fmt: skip
        self.model, self.attn_builder, self._capture = model, attn_builder, capture
        from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

        # Only Mamba2 layers read the SSD's chunk layout (Mamba1 and the short conv: none).
        ssd = any(isinstance(m, MambaMixer2) for m in model.modules())
        self.chunk_size = builder.chunk_size if ssd else None
        self.buckets = mixed_buckets(max_tokens, max_seqs, ssd)
        self._graphs: dict[MixedBucket, _MixedGraph] = {}
        self._mempool = mempool
        self.device = builder.device
        self.staging = StagedUpload(self.device)
        self.num_replays = 0
        self.last_miss: str | None = None  # why ``select`` last returned None

    def capture(self) -> list[MixedBucket]:
        """Capture every bucket's graph now, largest first (the smaller ones reuse the pool
        blocks the larger ones freed); returns the buckets."""
        for bucket in reversed(self.buckets):
            self._graph(bucket)
        return list(self.buckets)

    def _graph(self, bucket: MixedBucket) -> _MixedGraph:
        g = self._graphs.get(bucket)
        if g is None:
            g = _MixedGraph(self.model, bucket, self.chunk_size, self.device, self._mempool,
                            self.attn_builder, self._capture)  # fmt: skip
            self._graphs[bucket] = g
        return g

    def select(self, inp):
        """(bucket, padded Mamba2 plan) of the smallest bucket holding step ``inp``, or None
        when it must run eagerly (the leading rows are not decodes, prompt logprobs, too
        many tokens, rows, prefills or chunks); then ``last_miss`` says which, with the
        step's counts."""
        self.last_miss = None
        if inp.prompt_rows or not inp.lens:
            self.last_miss = "prompt logprobs" if inp.prompt_rows else "no rows"
            return None
        d = inp.num_decodes
        if not decodes_lead(inp.lens, inp.contexts, d):
            self.last_miss = "the leading rows are not all decodes"
            return None
        n, r, p = len(inp.ids), len(inp.lens), len(inp.lens) - d
        for bucket in self.buckets:
            if n > bucket.num_tokens or r > bucket.num_seqs or p > bucket.max_prefills:
                continue
            plan = prepare_padded(bucket, self.chunk_size, inp.lens, inp.slots, inp.contexts, d)
            if plan is not None:
                return bucket, plan
        top = self.buckets[-1]
        if n > top.num_tokens:
            why = "more tokens than the largest bucket"
        elif r > top.num_seqs:
            why = "more rows than the largest bucket"
        else:
            why = "more prefills or SSD chunks than every bucket of its size"
        self.last_miss = f"{why} ({n} tokens, {r} rows, {p} prefills)"
        return None

    @torch.no_grad()
    def run(self, inp, selected, prev_tokens: torch.Tensor | None) -> torch.Tensor | None:
        """Logits (len(inp.sample_rows), vocab) of step ``inp`` through the graph that
        ``select`` chose; pending input tokens taken from ``prev_tokens`` as in an eager
        step."""
        bucket, plan = selected
        g = self._graph(bucket)
        g.pack(inp, plan)
        staged = {"fixed": g.host_buf}
        attn = None
        if self.attn_builder is not None:
            attn = self.attn_builder.prepare(
                inp.lens, inp.contexts, inp.block_tables, inp.num_decodes,
                pad_tokens_to=bucket.num_tokens, pad_seqs_to=bucket.num_seqs,
            )  # fmt: skip
            staged["attn"] = attn.host
        n_fill = len(inp.fill_dst)
        if n_fill:
            staged["fill"] = torch.tensor(inp.fill_dst + inp.fill_src, dtype=torch.int64)
        dev = self.staging.upload(staged)
        g.dev_buf.copy_(dev["fixed"])
        if attn is not None:
            self.attn_builder.finish(attn, dev["attn"])
        if n_fill:
            fill = dev["fill"]
            g.input_ids.index_copy_(0, fill[:n_fill], prev_tokens.index_select(0, fill[n_fill:]))
        if g.graph is None:
            hidden = g.step()
        else:
            g.graph.replay()
            hidden = g.hidden
        self.num_replays += 1
        # The logits of the real sampled rows only, after the replay: a graph's output is
        # its S rows of hidden states, not S rows of fp32 logits (33 buckets x 256 rows of
        # a 32k vocabulary held 1.1 GB), and the head's matmul skips the padded rows.
        return self.model.compute_logits(hidden[: len(inp.sample_rows)])


def full_graphs_unsupported(model, builder) -> str | None:
    """Why the model's mixed steps cannot be graphed (None: they can). Every layer kind
    reads the padded metadata (``mamba2_padded``) or needs none: Mamba2 (the Triton conv
    and SSD), Mamba1 (the Triton conv, one selective scan over every row), ShortConv (the
    Triton conv), attention (the builder's padding); FusedMoE and the MLPs work row by
    row, their sizes and launches following the bucket's token count, and padded tokens
    are rows of their own (their routing reaches no real row). The replayed decode
    (``use_replayssm``) too: its update and its materialise leave the padded rows' null
    line alone."""
    from vllm.model_executor.layers.mamba.mamba_mixer import MambaMixer
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
    from vllm.model_executor.layers.mamba.mamba_utils import ConvBackend

    for module in model.modules():
        mamba2 = isinstance(module, MambaMixer2)
        if mamba2 and (builder.chunk_size is None or not builder.triton_ssd):
            return "its Mamba2 layers do not scan through the Triton SSD"
        if (mamba2 or isinstance(module, MambaMixer)) and module.backend is not ConvBackend.TRITON:
            return "VLLM_USE_TRITON_CONV1D=0 (the CUDA conv ops split the step by its counts)"
    return None


def measure_mixed_graphs(
    model, builder, max_tokens: int, max_seqs: int, attn_builder, reserved
) -> int:
    """Bytes the mixed graphs take, measured: every bucket captured into a throwaway pool
    (``reserved()``: the allocator's reserved bytes, its unused cached blocks released), then
    freed. Run before the KV cache is sized, which leaves this much free for the real
    capture: the graphs hold each bucket's padded layouts and scratch (Mamba1's padded scan
    too), more than one eager step of the same tokens (docs/cuda_graphs.md, Memory). Their
    attention reads the start-up's small KV cache here; no sequence's state is touched
    (every row is padded)."""
    before = reserved()
    graphs = MixedGraphs(model, builder, max_tokens, max_seqs, torch.cuda.graph_pool_handle(),
                         attn_builder)  # fmt: skip
    graphs.capture()
    taken = reserved() - before
    del graphs
    gc.collect()  # the graphs free their pool once no reference is left
    reserved()
    return max(taken, 0)


def graph_pool_gib(before: int, after: int) -> float:
    """Reserved device memory the captures added, in GiB (rounded up to 1 MiB)."""
    return math.ceil(max(after - before, 0) / 2**20) / 1024
