"""The Attention layer over the paged cache, through the forward context like a model step.

Invariant: a prefill of k tokens (in chunks) followed by one-token decodes equals full
causal attention over each whole sequence, computed directly with torch's
scaled_dot_product_attention. Run with the Triton kernels (the interpreter on CPU) and
with the PyTorch references (the CPU path without the interpreter).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm.cache_spec import AttentionSpec
from vllm.forward_context import ForwardContext, set_forward_context
from vllm.model_executor.layers.attention import (
    Attention,
    AttentionMetadata,
    AttentionMetadataBuilder,
)
from vllm.model_executor.layers.attention.ops import unified_attention as ua_mod

from ..kernels.attention.attn_utils import TOLERANCES, gen_for, randn

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
gpu = pytest.mark.gpu


class Engine:
    """The engine's part, kept minimal: blocks from a shuffled free list, one builder."""

    def __init__(self, layer: Attention, num_blocks, block_size, dtype, device, gen):
        self.block_size = block_size
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables: dict[int, list[int]] = {}
        self.cached: dict[int, int] = {}  # tokens in the cache per sequence
        layer.kv_cache = randn(
            (2, num_blocks, block_size, layer.num_kv_heads, layer.head_size), gen, dtype, device
        )
        self.builder = AttentionMetadataBuilder(block_size, 8, 64, num_blocks, device, num_blocks)

    def step(self, chunks: list[tuple[int, int]], **pad) -> AttentionMetadata:
        """chunks: (seq_id, new tokens), decodes first."""
        for sid, n in chunks:
            table = self.tables.setdefault(sid, [])
            total = self.cached.get(sid, 0) + n
            while len(table) * self.block_size < total:
                table.append(self.free.pop())
        num_decodes = 0
        while (
            num_decodes < len(chunks)
            and chunks[num_decodes][1] == 1
            and self.cached.get(chunks[num_decodes][0])
        ):
            num_decodes += 1
        md = self.builder.build(
            [n for _, n in chunks],
            [self.cached.get(sid, 0) for sid, _ in chunks],
            [self.tables[sid] for sid, _ in chunks],
            num_decodes,
            **pad,
        )
        for sid, n in chunks:
            self.cached[sid] = self.cached.get(sid, 0) + n
        return md


def _sdpa(q, k, v, num_heads, num_kv_heads, head_size, scale):
    """Causal attention over one whole sequence, fp32, GQA by repeating kv heads."""
    t = q.shape[0]
    group = num_heads // num_kv_heads
    q4 = q.float().view(t, num_heads, head_size).transpose(0, 1)
    k4 = k.float().view(t, num_kv_heads, head_size).repeat_interleave(group, 1).transpose(0, 1)
    v4 = v.float().view(t, num_kv_heads, head_size).repeat_interleave(group, 1).transpose(0, 1)
    out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale)
    return out.transpose(0, 1).reshape(t, num_heads * head_size)


# Two sequences: A (prompt 7 in one piece), B (prompt 13 in chunks of 8 and 5), then
# decodes; C joins later with a 3-token prompt. Decodes first in every step.
SCHEDULE = [
    [("A", 7), ("B", 8)],
    [("A", 1), ("B", 5)],
    [("A", 1), ("B", 1), ("C", 3)],
    [("A", 1), ("B", 1), ("C", 1)],
    [("A", 1), ("B", 1), ("C", 1)],
]


def _run_schedule(num_heads, num_kv_heads, head_size, dtype, device, block_size=4, pad=None):
    g = gen_for("layer", num_heads, num_kv_heads, head_size, dtype, block_size)
    scale = head_size**-0.5
    layer = Attention(num_heads, head_size, scale, num_kv_heads, prefix="model.layers.3.attn")
    engine = Engine(layer, 24, block_size, dtype, device, g)
    seen = {sid: ([], [], [], []) for sid in "ABC"}  # q, k, v, out per sequence
    for chunks in SCHEDULE:
        md = engine.step(chunks, **(pad or {}))
        t = md.num_padded_tokens
        q = randn((t, num_heads * head_size), g, dtype, device)
        k = randn((t, num_kv_heads * head_size), g, dtype, device)
        v = randn((t, num_kv_heads * head_size), g, dtype, device)
        with set_forward_context(ForwardContext(attn_metadata=md)):
            out = layer(q, k, v)
        assert out.shape == q.shape and out.dtype == dtype
        start = 0
        for sid, n in chunks:
            for lst, x in zip(seen[sid], (q, k, v, out), strict=True):
                lst.append(x[start : start + n])
            start += n
        if t > start:
            assert torch.equal(out[start:], torch.zeros_like(out[start:]))
    for sid, parts in seen.items():
        q, k, v, out = (torch.cat(p) for p in parts)
        expected = _sdpa(q, k, v, num_heads, num_kv_heads, head_size, scale).to(dtype)
        torch.testing.assert_close(out, expected, **TOLERANCES[dtype], msg=f"sequence {sid}")


BACKENDS = ["triton", "torch"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """ "torch": the interpreter off, so CPU tensors take the references."""
    if request.param == "torch":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    elif not (torch.cuda.is_available() or ua_mod._LAUNCH.runs_cpu_tensors()):
        pytest.fail("the Triton backend needs a GPU or TRITON_INTERPRET=1 (tests/conftest.py)")
    return request.param


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,dtype",
    [
        pytest.param(4, 4, 16, FP32, id="H4kv4_D16_fp32"),
        pytest.param(4, 2, 32, FP32, id="H4kv2_D32_fp32"),
        pytest.param(8, 2, 80, FP16, id="H8kv2_D80_fp16"),
    ],
)
def test_prefill_then_decodes_equals_full_attention(
    num_heads, num_kv_heads, head_size, dtype, backend
):
    _run_schedule(num_heads, num_kv_heads, head_size, dtype, "cpu")


def test_padded_steps(backend):
    """CUDA-graph-style padding (extra sequences and tokens) changes no real output, and
    padded tokens come out 0."""
    _run_schedule(4, 2, 16, FP32, "cpu", pad=dict(pad_tokens_to=20, pad_seqs_to=5))


@gpu
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,dtype",
    [
        pytest.param(32, 8, 128, BF16, id="H32kv8_D128_bf16"),
        pytest.param(32, 32, 160, BF16, id="H32kv32_D160_bf16"),
        pytest.param(16, 4, 64, FP16, id="H16kv4_D64_fp16"),
    ],
)
def test_prefill_then_decodes_gpu(num_heads, num_kv_heads, head_size, dtype):
    _run_schedule(num_heads, num_kv_heads, head_size, dtype, "cuda", block_size=16)


def test_kv_lands_in_its_slots():
    """After a step, each token's k and v sit at its slot; every other slot is unchanged."""
    g = gen_for("slots")
    layer = Attention(4, 16, 0.25, 2)
    engine = Engine(layer, 12, 4, FP32, "cpu", g)
    engine.step([("A", 5)])
    before = layer.kv_cache.clone()
    md = engine.step([("A", 1), ("B", 6)], pad_tokens_to=9)
    q = randn((9, 64), g, FP32, "cpu")
    k, v = randn((9, 32), g, FP32, "cpu"), randn((9, 32), g, FP32, "cpu")
    with set_forward_context(ForwardContext(attn_metadata=md)):
        layer(q, k, v)
    expected = before.clone()
    slots = md.slot_mapping.tolist()
    assert slots[-2:] == [-1, -1]
    for t, s in enumerate(slots[:7]):
        expected[0, s // 4, s % 4] = k[t].view(2, 16)
        expected[1, s // 4, s % 4] = v[t].view(2, 16)
    assert torch.equal(layer.kv_cache, expected)


def test_kv_cache_spec():
    layer = Attention(8, 80, 80**-0.5, num_kv_heads=2)
    spec = layer.get_kv_cache_spec(16, BF16)
    assert spec == AttentionSpec(block_size=16, num_kv_heads=2, head_size=80, dtype=BF16)
    assert spec.bytes_per_block == 2 * 16 * 2 * 80 * 2
    assert Attention(4, 32, 1.0).get_kv_cache_spec(8, FP32).num_kv_heads == 4


def _step_inputs():
    layer = Attention(4, 16, 0.25, 2, prefix="attn")
    engine = Engine(layer, 8, 4, FP32, "cpu", gen_for("errors"))
    md = engine.step([("A", 3)])
    q, k, v = torch.randn(3, 64), torch.randn(3, 32), torch.randn(3, 32)
    return layer, md, q, k, v


def test_unbound_cache_is_an_error():
    layer, md, q, k, v = _step_inputs()
    layer.kv_cache = None
    with set_forward_context(ForwardContext(attn_metadata=md)):
        with pytest.raises(RuntimeError, match="'attn': kv_cache is not bound"):
            layer(q, k, v)


def test_missing_metadata_is_an_error():
    layer, md, q, k, v = _step_inputs()
    with set_forward_context(ForwardContext()):
        with pytest.raises(RuntimeError, match="carries no AttentionMetadata"):
            layer(q, k, v)
    with pytest.raises(RuntimeError, match="no forward context is set"):
        layer(q, k, v)


@pytest.mark.parametrize(
    "which,shape,match",
    [
        ("q", (3, 60), r"q must be \(num_tokens=3, 4 \* 16\)"),
        ("k", (3, 64), r"k must be \(num_tokens=3, 2 \* 16\)"),
        ("v", (2, 32), r"v must be \(num_tokens=3, 2 \* 16\)"),
        ("all", (4, 0), "has 3 \\(padded\\) tokens in its metadata but q has 4"),
    ],
)
def test_bad_shapes(which, shape, match):
    layer, md, q, k, v = _step_inputs()
    if which == "all":
        q, k, v = torch.randn(4, 64), torch.randn(4, 32), torch.randn(4, 32)
    else:
        given = {"q": q, "k": k, "v": v, which: torch.randn(shape)}
        q, k, v = given["q"], given["k"], given["v"]
    with set_forward_context(ForwardContext(attn_metadata=md)):
        with pytest.raises(ValueError, match=match):
            layer(q, k, v)


@pytest.mark.parametrize(
    "args,match",
    [
        ((4, 16, 1.0, 3), "multiple of num_kv_heads=3"),
        ((0, 16, 1.0), "num_heads must be an int >= 1"),
        ((4, 0, 1.0), "head_size must be an int >= 1"),
    ],
)
def test_bad_construction(args, match):
    with pytest.raises(ValueError, match=match):
        Attention(*args)


def _graph_decode_steps(device: str, capture: bool) -> None:
    """The engine's decode graph: the layer runs (or is captured) once on static q/k/v and
    the first step's metadata; later steps only rebuild the metadata (same padding, so
    the same device memory) and refill q/k/v, then run the same call again (or replay).
    Each step's outputs must equal full causal attention over the sequences so far."""
    g = gen_for("graph-steps", device)
    heads, kv_heads, d, bs = 4, 2, 32, 4
    layer = Attention(heads, d, d**-0.5, kv_heads)
    engine = Engine(layer, 32, bs, FP32, device, g)
    prompts = {"A": 3, "B": 6, "C": 1}
    seen = {sid: ([], [], [], []) for sid in prompts}

    def record(chunks, q, k, v, out):
        start = 0
        for sid, n in chunks:
            for lst, x in zip(seen[sid], (q, k, v, out), strict=True):
                lst.append(x[start : start + n].clone())
            start += n

    # Prefill eagerly, then decodes of the three sequences padded to a bucket of 4.
    chunks = list(prompts.items())
    md = engine.step(chunks)
    q, k, v = (randn((10, h * d), g, FP32, device) for h in (heads, kv_heads, kv_heads))
    with set_forward_context(ForwardContext(attn_metadata=md)):
        record(chunks, q, k, v, layer(q, k, v))
    decodes = [(sid, 1) for sid in prompts]
    pad = dict(pad_tokens_to=4, pad_seqs_to=4)
    static = [torch.zeros(4, h * d, device=device) for h in (heads, kv_heads, kv_heads)]
    md0 = engine.step(decodes, **pad)
    ctx = ForwardContext(attn_metadata=md0)
    graph = None
    if capture:
        with set_forward_context(ctx):
            layer(*static)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with set_forward_context(ctx), torch.cuda.graph(graph):
            static_out = layer(*static)
    for step in range(6):
        if step:
            md = engine.step(decodes, **pad)
            assert md.seq_lens.data_ptr() == md0.seq_lens.data_ptr()
        for buf in static:
            buf.copy_(randn(buf.shape, g, FP32, device))
        if graph is not None:
            graph.replay()
            out = static_out
        else:  # the first step's metadata object, now holding this step's values
            with set_forward_context(ctx):
                out = layer(*static)
        record(decodes, *static, out)
    for sid, parts in seen.items():
        q, k, v, out = (torch.cat(p) for p in parts)
        expected = _sdpa(q, k, v, heads, kv_heads, d, d**-0.5)
        torch.testing.assert_close(out, expected, **TOLERANCES[FP32], msg=f"sequence {sid}")


def test_decode_steps_on_the_first_steps_metadata():
    _graph_decode_steps("cpu", capture=False)


@gpu
def test_decode_steps_cuda_graph():
    _graph_decode_steps("cuda", capture=True)
