"""unified_attention (one launch per mixed step, paged KV) vs the fp32 reference.

On a CPU box the kernel runs under the Triton interpreter (tests/conftest.py); cases are
small there. bf16 and large cases carry the gpu mark (bf16 arithmetic is wrong in the
interpreter).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

from vllm.model_executor.layers.attention.ops import unified_attention as ua_mod
from vllm.model_executor.layers.attention.ops.unified_attention import (
    unified_attention,
    unified_attention_ref,
)

from .attn_utils import (
    DTYPE_NAMES,
    PAD,
    assert_close,
    assert_no_nan,
    gen_for,
    make_step,
    randn,
)

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
gpu = pytest.mark.gpu


@dataclass(frozen=True)
class Case:
    seqs: tuple[tuple[int, int], ...]  # (q_len, context_len); context PAD: padded sequence
    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    block_size: int = 16
    pad_tokens: int = 0
    noncontig: bool = False
    hints: bool = False  # pass num_decodes / max_query_len / max_seq_len
    query_len_hint: int | None = None  # overrides the max_query_len hint (a tile choice)
    tags: tuple[str, ...] = field(default=())

    @property
    def id(self) -> str:
        tokens = sum(q for q, _ in self.seqs) + self.pad_tokens
        s = (
            f"S{len(self.seqs)}_T{tokens}_H{self.num_heads}kv{self.num_kv_heads}"
            f"_D{self.head_size}_bs{self.block_size}_{DTYPE_NAMES[self.dtype]}"
        )
        if any(c == PAD for _, c in self.seqs) or self.pad_tokens:
            s += "_pad"
        if self.noncontig:
            s += "_nc"
        if self.hints:
            s += "_hints"
        if self.query_len_hint is not None:
            s += f"_mq{self.query_len_hint}"
        return s

    def hint_kwargs(self) -> dict:
        if not self.hints:
            return {}
        lens = [0 if c == PAD else c + q for q, c in self.seqs]
        num_decodes = 0  # the leading one-token sequences
        while num_decodes < len(self.seqs) and self.seqs[num_decodes][0] == 1:
            num_decodes += 1
        mq = max((q for q, _ in self.seqs), default=0)
        if self.query_len_hint is not None:
            mq = self.query_len_hint
        return dict(num_decodes=num_decodes, max_query_len=mq, max_seq_len=max(lens, default=0))


def _case(*args, marks=(), **kwargs):
    c = Case(*args, **kwargs)
    return pytest.param(c, id=c.id, marks=marks)


MIXED = ((1, 5), (1, 30), (7, 0), (13, 17), (20, 9))  # decodes, a fresh prefill, chunks
CASES = [
    # decodes + a fresh prefill + chunked prefills with cached context, every GQA ratio
    _case(MIXED, 4, 4, 32, FP32),
    _case(((1, 12), (1, 47), (9, 3), (16, 0)), 4, 2, 80, FP16),
    _case(((1, 3), (1, 9), (5, 11), (12, 0)), 8, 2, 16, FP32, block_size=8),
    _case(((1, 20), (2, 30), (11, 6)), 8, 1, 32, FP16, hints=True),
    # head sizes that are not powers of two (Zamba2's 160, 80), non-contiguous q
    _case(((1, 70), (6, 40)), 2, 2, 160, FP32, noncontig=True),
    # contexts of several key tiles (the running max and sum are rescaled between tiles)
    _case(((1, 150), (9, 140), (70, 0)), 4, 2, 16, FP32),
    _case(((1, 200), (1, 66), (5, 130)), 4, 4, 32, FP16, hints=True),
    _case(((1, 7), (5, 26)), 4, 2, 80, FP32, hints=True),
    # a group that is not a power of two (rows of the tile left unused)
    _case(((1, 4), (4, 9), (3, 0)), 6, 2, 16, FP32),
    # decode only (one query token per program)
    _case(tuple((1, n) for n in (0, 3, 15, 16, 17, 31, 40, 2)), 4, 2, 32, FP16, hints=True),
    # the prefill tiles (64 query rows per program), picked by the max_query_len hint
    _case(((40, 0), (33, 97), (1, 8)), 4, 2, 32, FP32, hints=True, query_len_hint=40),
    _case(((19, 45), (1, 3)), 4, 1, 64, FP16, noncontig=True, hints=True, query_len_hint=64),
    # larger blocks, sequences ending mid-block and exactly on a block end
    _case(((1, 31), (1, 63), (32, 32), (5, 1)), 2, 2, 32, FP32, block_size=32),
    # padding: a padded decode row (seq_len 0), a sequence with no tokens (offsets
    # repeating), a padded chunk, and tokens after the last sequence
    _case(((1, 5), (1, PAD), (0, PAD), (6, 4), (3, PAD), (1, 7)), 4, 2, 32, FP32, pad_tokens=3),
    _case(((1, 9), (1, PAD), (1, PAD)), 4, 4, 16, FP16, pad_tokens=5, hints=True),
    # no sequence at all: every token is padding
    _case((), 2, 1, 16, FP32, pad_tokens=4),
    # GPU: bf16, the models' head sizes, long contexts, many sequences
    _case(MIXED, 8, 2, 128, BF16, marks=gpu),
    _case(((1, 900), (1, 33), (300, 700), (64, 0)), 32, 32, 160, BF16, marks=gpu),
    _case(((1, 2047), (1, 5), (512, 1500)), 32, 8, 128, FP16, hints=True, marks=gpu),
    _case(((1, 1000), (129, 2000)), 16, 2, 64, BF16, noncontig=True, marks=gpu),
    _case(((1, 700), (77, 300)), 32, 8, 80, BF16, hints=True, marks=gpu),
    _case(
        tuple((1, (37 * i) % 1500) for i in range(96)) + ((200, 100),),
        32,
        8,
        128,
        BF16,
        hints=True,
        marks=gpu,
    ),
    _case(((1, 999), (250, 1001), (1, PAD)), 8, 4, 128, FP32, pad_tokens=7, marks=gpu),
]


def _run(case: Case, device) -> None:
    g = gen_for(case.id)
    step = make_step(
        case.seqs,
        case.num_heads,
        case.num_kv_heads,
        case.head_size,
        case.block_size,
        case.dtype,
        device,
        g,
        pad_tokens=case.pad_tokens,
        noncontig=case.noncontig,
    )
    scale = case.head_size**-0.5
    cache_before = step.kv_cache.clone()
    out = torch.full(step.q.shape, float("nan"), dtype=case.dtype, device=device)
    got = unified_attention(
        step.q, step.kv_cache, out, scale=scale, **step.kwargs(), **case.hint_kwargs()
    )
    assert got is out
    expected = unified_attention_ref(
        step.q, step.kv_cache, torch.empty_like(out), scale=scale, **step.kwargs()
    )
    assert_no_nan(out)
    assert_close(out, expected, case.id)
    # Padded tokens are exactly 0; the cache is only read.
    owned = int(step.query_start_loc[-1])
    assert torch.equal(out[owned:], torch.zeros_like(out[owned:]))
    assert torch.equal(step.kv_cache.isnan(), cache_before.isnan())
    assert torch.equal(step.kv_cache.nan_to_num(), cache_before.nan_to_num())


@pytest.mark.parametrize("case", CASES)
def test_unified_attention(case, device):
    _run(case, device)


def test_empty_step(device):
    q = torch.empty(0, 2, 16, device=device)
    kv = torch.zeros(2, 1, 16, 1, 16, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    got = unified_attention(
        q,
        kv,
        out,
        query_start_loc=torch.zeros(1, **i32),
        seq_lens=torch.zeros(0, **i32),
        block_table=torch.zeros(0, 1, **i32),
        scale=0.25,
    )
    assert got is out


# --- the reference itself -----------------------------------------------------------


def test_reference_matches_sdpa():
    """The oracle against torch's SDPA on dense K/V: a chunk of 6 queries after 9 cached
    tokens attends to the cache and causally within itself (GQA 2)."""
    g = gen_for("ref-sdpa")
    step = make_step(((6, 9),), 4, 2, 16, 4, FP32, "cpu", g)
    n, bs = 15, 4
    blocks = step.block_table[0, : -(-n // bs)].long()
    k = step.kv_cache[0, blocks].reshape(-1, 2, 16)[:n].repeat_interleave(2, dim=1)
    v = step.kv_cache[1, blocks].reshape(-1, 2, 16)[:n].repeat_interleave(2, dim=1)
    mask = torch.arange(n)[None, :] <= torch.arange(9, 15)[:, None]
    expected = F.scaled_dot_product_attention(
        step.q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=0.3
    ).transpose(0, 1)
    got = unified_attention_ref(
        step.q, step.kv_cache, torch.empty_like(step.q), scale=0.3, **step.kwargs()
    )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_cpu_path_without_interpreter_is_the_reference(monkeypatch):
    """With the interpreter off, CPU tensors take the reference (bit-identical result)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    step = make_step(MIXED, 4, 2, 16, 16, FP32, "cpu", gen_for("cpu-path"))
    out = unified_attention(
        step.q, step.kv_cache, torch.empty_like(step.q), scale=0.2, **step.kwargs()
    )
    ref = unified_attention_ref(
        step.q, step.kv_cache, torch.empty_like(step.q), scale=0.2, **step.kwargs()
    )
    assert torch.equal(out, ref)


# --- CUDA-graph safety: persistent buffers, values change between runs ---------------


def _decode_steps(device, dtype, capture: bool) -> None:
    """Three decode steps on the SAME tensors (as a captured graph sees them): each step
    writes the new token's K/V, grows seq_lens in place (one sequence crosses into a new
    block, its block-table entry written in place) and fills q; the run must match the
    reference of the new lengths. With ``capture`` the launch is a CUDA graph replayed."""
    g = gen_for("decode-steps", dtype, capture)
    heads, kv_heads, d, bs = 4, 2, 32, 16
    ctx = (5, 15, 30, 0)  # the 2nd and 3rd cross a block boundary during the steps
    step = make_step(
        tuple((1, c) for c in ctx), heads, kv_heads, d, bs, dtype, device, g, extra_cols=3
    )
    free_blocks = [
        b
        for b in range(step.kv_cache.shape[1])
        if b not in set(step.block_table.flatten().tolist())
    ] + [step.poison_block]
    out = torch.full_like(step.q, float("nan"))
    kwargs = dict(scale=d**-0.5, **step.kwargs(), num_decodes=len(ctx), max_query_len=1)

    def launch():
        unified_attention(step.q, step.kv_cache, out, **kwargs)

    graph = None
    if capture:
        launch()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launch()
    lens = [c + 1 for c in ctx]
    for _ in range(3):
        if graph is not None:
            graph.replay()
        else:
            launch()
        expected = unified_attention_ref(
            step.q, step.kv_cache, torch.empty_like(out), scale=d**-0.5, **step.kwargs()
        )
        assert_no_nan(out)
        assert_close(out, expected, f"lens {lens}")
        # The next step: one more token per sequence, in place.
        for i, n in enumerate(lens):
            if n % bs == 0:  # the new token opens a block
                step.block_table[i, n // bs] = free_blocks.pop(0)
            blk = int(step.block_table[i, n // bs])
            step.kv_cache[:, blk, n % bs] = randn((2, kv_heads, d), g, dtype, device)
        lens = [n + 1 for n in lens]
        step.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        step.q.copy_(randn(step.q.shape, g, dtype, device))
        out.fill_(float("nan"))


@pytest.mark.parametrize("dtype", [FP32, FP16], ids=["fp32", "fp16"])
def test_decode_steps_on_persistent_buffers(device, dtype):
    _decode_steps(device, dtype, capture=False)


@gpu
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_decode_steps_cuda_graph(dtype):
    _decode_steps(torch.device("cuda"), dtype, capture=True)


# --- torch.library ------------------------------------------------------------------


@pytest.mark.parametrize("device_name", ["cpu", pytest.param("cuda", marks=gpu)])
def test_opcheck(device_name):
    step = make_step(
        ((1, 5), (3, 2), (1, PAD)), 4, 2, 16, 8, FP32, device_name, gen_for("opcheck"), pad_tokens=1
    )
    out = torch.empty_like(step.q)
    args = (
        step.q,
        step.kv_cache,
        out,
        step.query_start_loc,
        step.seq_lens,
        step.block_table,
        0.25,
        None,
        1,
        None,
    )
    torch.library.opcheck(torch.ops.vllm.unified_attention.default, args)


def test_compiled_call_matches_eager():
    """Under torch.compile the wrapper goes through the registered op."""
    step = make_step(MIXED, 4, 2, 16, 16, FP32, "cpu", gen_for("compile"))
    eager = unified_attention(
        step.q, step.kv_cache, torch.empty_like(step.q), scale=0.3, **step.kwargs()
    )

    def fn(q, kv, qsl, sl, bt):
        out = torch.empty_like(q)
        return unified_attention(
            q, kv, out, query_start_loc=qsl, seq_lens=sl, block_table=bt, scale=0.3
        )

    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    got = compiled(step.q, step.kv_cache, step.query_start_loc, step.seq_lens, step.block_table)
    assert torch.equal(got, eager)


# --- bad input ----------------------------------------------------------------------


def _valid(device) -> dict:
    step = make_step(((1, 3), (4, 2)), 4, 2, 16, 8, FP32, device, gen_for("errors"))
    return dict(
        q=step.q, kv_cache=step.kv_cache, out=torch.empty_like(step.q), scale=0.25, **step.kwargs()
    )


def _bad(name, fn, match):
    return pytest.param(fn, match, id=name)


BAD = [
    _bad("q_2d", lambda a: a.update(q=a["q"][:, 0]), "q must have 3 dims"),
    _bad("q_int", lambda a: a.update(q=a["q"].int()), "q must have dtype"),
    _bad(
        "q_strided",
        lambda a: a.update(q=a["q"].transpose(1, 2).contiguous().transpose(1, 2)),
        "q must have stride 1 along head_size",
    ),
    _bad("out_shape", lambda a: a.update(out=a["out"][1:]), "out must match q"),
    _bad("out_dtype", lambda a: a.update(out=a["out"].half()), "out must match q"),
    _bad("kv_dtype", lambda a: a.update(kv_cache=a["kv_cache"].half()), "kv_cache dtype"),
    _bad("kv_4d", lambda a: a.update(kv_cache=a["kv_cache"][0]), "kv_cache must have 5 dims"),
    _bad("kv_not_2", lambda a: a.update(kv_cache=a["kv_cache"][:1]), r"kv_cache must be \(2,"),
    _bad("kv_head_size", lambda a: a.update(kv_cache=a["kv_cache"][..., :8]), "head_size 8"),
    _bad("gqa", lambda a: a.update(q=a["q"][:, :3], out=a["out"][:, :3]), "multiple of"),
    _bad(
        "qsl_int64",
        lambda a: a.update(query_start_loc=a["query_start_loc"].long()),
        "query_start_loc must have dtype",
    ),
    _bad("seq_lens_len", lambda a: a.update(seq_lens=a["seq_lens"][:1]), "seq_lens must have"),
    _bad("table_rows", lambda a: a.update(block_table=a["block_table"][:1]), "block_table must"),
    _bad("table_1d", lambda a: a.update(block_table=a["block_table"][0]), "block_table must"),
    _bad("scale", lambda a: a.update(scale=float("nan")), "scale must be finite"),
    _bad("hint_neg", lambda a: a.update(max_query_len=-1), "max_query_len must be"),
    _bad("num_decodes", lambda a: a.update(num_decodes=3), "num_decodes=3 exceeds 2"),
]


@pytest.mark.parametrize("mutate,match", BAD)
def test_bad_input(mutate, match):
    args = _valid("cpu")
    mutate(args)
    q, kv, out = args.pop("q"), args.pop("kv_cache"), args.pop("out")
    with pytest.raises(ValueError, match=match):
        unified_attention(q, kv, out, **args)


def test_reference_rejects_bad_data():
    args = _valid("cpu")
    args["block_table"][1, 0] = args["kv_cache"].shape[1]  # outside the cache
    q, kv, out = args.pop("q"), args.pop("kv_cache"), args.pop("out")
    with pytest.raises(ValueError, match="block_table entries must be in"):
        unified_attention_ref(q, kv, out, **args)


def test_variants_cover_the_chosen_config():
    """Every configuration the launcher can pick is among those the engine precompiles."""
    for group in (1, 2, 4, 8, 16, 32):
        for head_pad in (16, 64, 128, 256):
            base = dict(GROUP=group)
            variants = ua_mod._variants(base, head_pad, group)
            for mq in (None, 1, 3, 16, 64, 4096):
                for msl in (None, 1, 32, 33, 10**5):
                    cfg = ua_mod._config(100, 7, group, head_pad, None, mq, msl)
                    assert {**base, **cfg} in variants, (group, head_pad, mq, msl)
