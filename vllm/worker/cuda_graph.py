"""DecodeGraphs: CUDA graphs of decode-only steps, one per batch-size bucket.

A decode-only step of ``b`` sequences runs the graph of the smallest bucket >= b; rows past
``b`` are padding (on the null line, ``NULL_BLOCK_ID``: the conv and the scan leave every
state line alone). The layers' states are their bound views of the pool, which never move,
so a graph replays against the same lines it captured. Each bucket owns its metadata
builder, so the metadata tensors the graph captured stay where they are: a replay only
copies the step's input ids and slots into them. Graphs are captured on first use, with
every row padded, so capturing never touches a sequence's state; ``capture`` takes them
ahead of time (a benchmark does, so that no capture falls inside its timed run).

With attention layers (``attn_builder``: the runner's ``AttentionMetadataBuilder``, whose
device buffers persist across builds) a graph also captures the attention metadata built
with every row padded to its size, and a persistent positions buffer; a replay rebuilds
the metadata for the step's rows into the same buffers (padded to the graph's size) and
copies the positions (each decode token sits at its sequence's cached length) in.
"""

from __future__ import annotations

import torch

from vllm.forward_context import ForwardContext, set_forward_context
from vllm.model_executor.layers.mamba.ops.causal_conv1d import NULL_BLOCK_ID
from vllm.model_executor.staged_upload import StagedUpload


def graph_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to and including ``max_batch``."""
    sizes = [b for b in (1, 2, 4) if b < max_batch]
    sizes += list(range(8, max_batch, 8)) + [max_batch]
    return sorted(set(sizes))


def buckets_covering(buckets: list[int], max_batch: int) -> list[int]:
    """The buckets a decode batch of 1 .. ``max_batch`` sequences can run in."""
    top = next((b for b in buckets if b >= max_batch), buckets[-1])
    return [b for b in buckets if b <= top]


_WARMUP_STREAMS: dict[int, torch.cuda.Stream] = {}


def warm_up(step) -> None:
    """Run ``step`` once before its capture, on a side stream that every graph of the
    device shares: the caching allocator keeps the blocks a stream freed for that stream
    only, so a new stream per graph would strand each warm-up's memory."""
    device = torch.cuda.current_device()
    side = _WARMUP_STREAMS.get(device)
    if side is None:
        side = _WARMUP_STREAMS[device] = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)


class _Graph:
    def __init__(self, model, size: int, mempool, attn_builder=None):
        self.size = size
        self.builder = model.metadata_builder()
        device = self.builder.device
        self.md = self.builder.build(
            torch.arange(size + 1, dtype=torch.int32),
            torch.full((size,), NULL_BLOCK_ID, dtype=torch.int32),
            torch.ones(size, dtype=torch.bool),
        )
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = None
        attn_md = None
        if attn_builder is not None:
            self.positions = torch.zeros(size, dtype=torch.int64, device=device)
            attn_md = attn_builder.build([], [], [], 0, pad_tokens_to=size, pad_seqs_to=size)
        context = ForwardContext(mamba2_metadata=self.md, attn_metadata=attn_md)

        def step():
            with set_forward_context(context):
                hidden = model(self.input_ids, self.positions)
            return model.compute_logits(hidden)

        warm_up(step)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=mempool):
            self.logits = step()


class DecodeGraphs:
    def __init__(self, model, max_batch: int, attn_builder=None):
        self.model = model
        self.attn_builder = attn_builder
        self.buckets = graph_buckets(max_batch)
        self._graphs: dict[int, _Graph] = {}
        # Shared with the mixed-step graphs (mixed_graph.py): graphs never run at once.
        self.mempool = torch.cuda.graph_pool_handle()
        # A replay's host data (input ids, slots, positions, the rows of pending input
        # tokens and their source rows, the attention metadata) reaches the device in one
        # copy; device copies then move it into the buffers the graph captured.
        self.staging = StagedUpload("cuda")

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.buckets[-1]

    def capture(self, max_batch: int | None = None) -> list[int]:
        """Capture now the graphs of every bucket a batch of up to ``max_batch`` sequences
        (default: all buckets) can use; returns their sizes. Largest first, so the smaller
        graphs reuse the memory pool blocks the larger ones freed."""
        sizes = buckets_covering(self.buckets, max_batch or self.buckets[-1])
        for size in reversed(sizes):
            self._graph(size)
        return sizes

    def _graph(self, batch_size: int) -> _Graph:
        size = next(b for b in self.buckets if b >= batch_size)
        graph = self._graphs.get(size)
        if graph is None:
            graph = self._graphs[size] = _Graph(self.model, size, self.mempool, self.attn_builder)
        return graph

    @torch.no_grad()
    def run(
        self,
        input_ids: list[int],
        slots: list[int],
        pending: tuple[list[int], list[int], torch.Tensor] | None = None,
        attn: tuple[list[int], list[list[int]]] | None = None,
    ) -> torch.Tensor | None:
        """Logits (len(input_ids), vocab) of a decode-only step; rows in input order.
        ``pending`` = (rows, source rows, tokens): input ``rows`` take ``tokens[source
        rows]`` (tokens the previous step sampled, still on the device). ``attn`` =
        (cached lengths, block tables) of the rows, for a model with attention layers."""
        b = len(input_ids)
        g = self._graph(b)
        n_fill = len(pending[0]) if pending else 0
        fill_at = 3 * g.size if attn is not None else 2 * g.size
        host = torch.zeros(fill_at + 2 * n_fill, dtype=torch.int64)
        host[g.size : 2 * g.size] = NULL_BLOCK_ID
        host[:b] = torch.tensor(input_ids)
        host[g.size : g.size + b] = torch.tensor(slots)
        staged = {"inputs": host}
        if attn is not None:
            contexts, tables = attn
            host[2 * g.size : 2 * g.size + b] = torch.tensor(contexts)
            plan = self.attn_builder.prepare(
                [1] * b, contexts, tables, b, pad_tokens_to=g.size, pad_seqs_to=g.size
            )
            staged["attn"] = plan.host
        if n_fill:
            host[fill_at:] = torch.tensor(pending[0] + pending[1])
        staged = self.staging.upload(staged)
        dev = staged["inputs"]
        g.input_ids.copy_(dev[: g.size])
        if n_fill:
            fill = dev[fill_at:]
            g.input_ids.index_copy_(0, fill[:n_fill], pending[2].index_select(0, fill[n_fill:]))
        g.md.state_indices.copy_(dev[g.size : 2 * g.size])
        if attn is not None:
            g.positions.copy_(dev[2 * g.size : 3 * g.size])
            self.attn_builder.finish(plan, staged["attn"])
        g.graph.replay()
        # Under tensor parallelism the logits are gathered on rank 0 only.
        return None if g.logits is None else g.logits[:b]
