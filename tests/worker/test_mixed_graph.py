"""Mixed steps padded to a CUDA-graph bucket (cudagraph_mode FULL): the buckets, the padded
Mamba2 metadata, the Triton SSD over a padded layout, and whole engines whose mixed steps
run through the padded path eagerly (``capture=False``: the CPU has no graphs; the graphs'
own test is test_mixed_graph_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.utils import ASYNC_SCHED_CONFIG, prefix_llm, run_greedy
from tests.kernels.mamba.ssd_utils import small_blocks
from tests.worker.mixed_graph_engine import greedy, padded_path
from tests.worker.mixed_graph_models import MODELS
from vllm import LLM, SamplingParams
from vllm.model_executor.layers.mamba.mamba2_metadata import Mamba2MetadataBuilder
from vllm.model_executor.layers.mamba.mamba2_padded import (
    MixedBucket,
    decodes_lead,
    padded_chunk_count,
    prepare_padded,
)
from vllm.model_executor.layers.mamba.mamba_mixer import MambaMixer
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from vllm.model_executor.layers.mamba.mamba_utils import ConvBackend
from vllm.model_executor.layers.mamba.ops import ssd_chunk_state
from vllm.model_executor.layers.mamba.ops.ssd_combined import (
    mamba_chunk_scan_combined_varlen,
    plan_ssd_chunks,
)
from vllm.worker.mixed_graph import (
    full_graphs_unsupported,
    mixed_buckets,
    mixed_token_sizes,
)


def test_bucket_sizes_follow_the_limits():
    assert mixed_token_sizes(16) == [16]
    assert mixed_token_sizes(100) == [32, 64, 100]
    sizes = mixed_token_sizes(4096)
    assert sizes[:4] == [32, 64, 128, 192] and sizes[-3:] == [3584, 3840, 4096]
    assert len(sizes) == 33 and 1024 in sizes and 2048 in sizes
    # a step pads by at most 64 tokens up to 1024, then by at most an eighth
    assert all(b - a <= max(64, a // 8) for a, b in zip(sizes, sizes[1:], strict=False))
    buckets = mixed_buckets(2048, 64)
    assert [b.num_tokens for b in buckets] == mixed_token_sizes(2048)
    assert [b.max_prefills for b in mixed_buckets(2048, 64, ssd=False)] == [32] + [64] * 24
    assert buckets[0] == MixedBucket(32, 32, 4)
    assert buckets[-1] == MixedBucket(2048, 64, 16)
    assert all(b.max_prefills <= b.num_seqs <= min(b.num_tokens, 64) for b in buckets)
    with pytest.raises(ValueError, match="max_prefills <= num_seqs"):
        MixedBucket(8, 16, 4)


def test_decodes_lead():
    assert decodes_lead([1, 1, 5, 1], [3, 4, 0, 0], 2)  # then a fresh 1-token prompt
    assert decodes_lead([1, 5, 1], [3, 0, 3], 1)  # a 1-token chunk continuation
    assert not decodes_lead([5, 1], [0, 3], 1)
    assert not decodes_lead([1, 1], [2, 0], 2)
    assert decodes_lead([7], [2], 0)


def test_prepare_padded_layout():
    bucket = MixedBucket(32, 8, 4)
    lens, ctx, slots = [1, 1, 5, 9], [3, 4, 0, 2], [5, 2, 7, 1]
    plan = prepare_padded(bucket, 8, lens, slots, ctx, 2)
    h = {k: v.tolist() for k, v in plan.host.items()}
    assert h["conv.query_start_loc"] == [0, 1, 2, 7, 16, 16, 16, 16, 16, 32]
    assert h["state_indices"] == [5, 2, 7, 1, 0, 0, 0, 0, 0]
    assert h["has_initial_state"] == [True, True, False, True] + [False] * 5
    assert h["decode_slots"] == [5, 2, 0, 0, 0, 0, 0, 0]
    assert h["prefill_slots"] == [7, 1, 0, 0, 0]
    assert h["prefill_init"] == [False, True, False, False, False]
    assert h["prefill_query_start_loc"] == [0, 5, 14, 14, 14, 14]
    assert padded_chunk_count(32, 4, 8) == 8
    # rows 2..7 one chunk, rows 7..16 two; then five empty spare chunks of the last sequence
    assert h["layout.chunk_starts"] == [2, 7, 15, 16, 16, 16, 16, 16, 16]
    assert h["layout.chunk_seqs"] == [0, 1, 1, 4, 4, 4, 4, 4]
    assert h["layout.seq_chunk_starts"] == [0, 1, 3, 3, 3, 8]
    assert plan.counts == dict(num_tokens=32, batch_size=9, num_decode_tokens=8,
                               num_prefills=5, num_prefill_tokens=0)  # fmt: skip
    assert plan.conv_fields["max_query_len"] == 32
    # every tensor has the bucket's size whatever the step
    other = prepare_padded(bucket, 8, [1, 20], [3, 4], [6, 0], 1)
    assert {k: v.shape for k, v in other.host.items()} == {k: v.shape for k, v in plan.host.items()}
    padding = prepare_padded(bucket, 8, [], [], [], 0)
    assert padding.host["state_indices"].tolist() == [0] * 9
    assert padding.host["layout.chunk_seqs"].tolist() == [4] * 8


@pytest.mark.parametrize(
    "lens, ctx, d",
    [
        ([1] * 4 + [2] * 5, [1] * 4 + [0] * 5, 4),  # five prefills > P = 4
        ([1] * 9, [1] * 9, 9),  # nine rows > S = 8
        ([1, 32], [1, 0], 1),  # 33 tokens > T = 32
    ],
)
def test_prepare_padded_refuses_what_does_not_fit(lens, ctx, d):
    slots = list(range(1, len(lens) + 1))
    assert prepare_padded(MixedBucket(32, 8, 4), 8, lens, slots, ctx, d) is None


@pytest.mark.parametrize("mode", ["three_launches", "fused_pass", "fold_cb"])
def test_ssd_over_a_padded_layout_equals_the_step_layout(device, nan_poison, mode, monkeypatch):
    """The prefills' y and final states through the padded layout (spare empty chunks,
    sequences on the null line) are the eager layout's, bit for bit; no other line moves.
    With the SSD's ``FUSED_PASS`` (and ``FOLD_CB``) too: the padded sequences' empty chunks
    exit without a ticket's wait or publish, and no live chunk waits on them."""
    fused = mode != "three_launches"
    small_blocks(monkeypatch, chunk_state__FUSED_PASS=fused, chunk_state__FOLD_CB=mode == "fold_cb")
    ssd_chunk_state._SYNC.pop(ssd_chunk_state._device_key(device), None)
    gen = torch.Generator().manual_seed(5)
    heads, hd, ds, chunk = 4, 8, 16, 8
    bucket = MixedBucket(48, 6, 4)
    lens, ctx, slots = [1, 1, 11, 3, 17], [2, 5, 4, 0, 1], [3, 6, 1, 4, 2]
    t = bucket.num_tokens

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    x, dt = rand(t, heads, hd), rand(t, heads)
    B, C = rand(t, 2, ds), rand(t, 2, ds)
    A = -torch.rand(heads, generator=gen).to(device) - 0.5
    pool = rand(9, heads, hd, ds)
    plan = prepare_padded(bucket, chunk, lens, slots, ctx, 2)
    layout = plan.layout.to(device)
    got_pool, got_y = pool.clone(), torch.zeros(t, heads, hd, device=device)
    mamba_chunk_scan_combined_varlen(
        x, dt, A, B, C, layout, got_pool, plan.host["prefill_slots"].to(device),
        plan.host["prefill_init"].to(device), out=got_y, dt_softplus=True,
    )  # fmt: skip
    q = torch.tensor([2, 13, 16, 33], dtype=torch.int32)
    ref_pool, ref_y = pool.clone(), torch.zeros(t, heads, hd, device=device)
    mamba_chunk_scan_combined_varlen(
        x, dt, A, B, C, plan_ssd_chunks(q, chunk).to(device), ref_pool,
        torch.tensor([1, 4, 2], dtype=torch.int32, device=device),
        torch.tensor([True, False, True], device=device), out=ref_y, dt_softplus=True,
    )  # fmt: skip
    assert torch.equal(got_y[2:33], ref_y[2:33])
    assert torch.equal(got_pool, ref_pool)
    assert not torch.equal(got_pool[1], pool[1])  # the prefills did write their lines
    assert torch.equal(got_pool[[0, 3, 5, 6, 7, 8]], pool[[0, 3, 5, 6, 7, 8]])
    assert got_y[33:].abs().max() == 0 and got_y[:2].abs().max() == 0
    sync = ssd_chunk_state.existing_sync_buffer(device)
    assert (sync is not None and not sync.any()) if fused else sync is None


@pytest.mark.parametrize("name", ["falcon_mamba", "lfm2", "bamba"])
def test_without_mamba2_any_row_may_be_a_prefill(name, device, tmp_path):
    """Six fresh prompts in one 32-token step: the SSD's padded chunk layout caps a bucket's
    prefills (4 at 32 tokens), so Bamba runs that step eagerly; Mamba1 and the short conv
    have no such layout, so their buckets take a prefill in every row and graph it."""
    opts = dict(load_format="dummy", dtype="float32", device=device.type, max_num_seqs=8,
                max_num_batched_tokens=32, max_model_len=48, enforce_eager=True)  # fmt: skip
    prompts = [[(7 * i + j) % 90 + 1 for j in range(n)] for i, n in enumerate([3, 2, 4, 1, 5, 3])]
    model = MODELS[name](tmp_path)
    want = greedy(LLM(model, **opts), prompts, 3)
    llm = LLM(model, **opts)
    padded = padded_path(llm, device)
    got = greedy(llm, prompts, 3)
    assert [g[0] for g in got] == [w[0] for w in want]
    counts = llm.engine.runner.step_counts
    ssd = name == "bamba"
    assert [b.max_prefills for b in padded.buckets] == [4 if ssd else 8]
    assert counts["eager"] == (1 if ssd else 0) and counts["graph_mixed"] == padded.num_replays


@pytest.mark.parametrize("name", ["bamba", "granite_moe", "lfm2", "jamba"])
def test_which_models_graph_their_mixed_steps(name, tmp_path, monkeypatch):
    """FULL's check, run where the graphs would be (CUDA: the Triton SSD): every layer kind
    reads the padded metadata (Mamba2, Mamba1, ShortConv, attention) or needs none (the
    experts, the MLPs); what stays eager is named: the CUDA conv ops, and a Mamba2 scan
    that is not the Triton SSD."""
    llm = LLM(MODELS[name](tmp_path), load_format="dummy", dtype="float32", device="cpu",
              max_num_seqs=2, max_num_batched_tokens=16, max_model_len=48)  # fmt: skip
    model = llm.engine.runner.model
    chunk = llm.engine.runner.builder.chunk_size
    builder = Mamba2MetadataBuilder(chunk, "cpu", triton_ssd=chunk is not None)
    assert full_graphs_unsupported(model, builder) is None
    mixers = [m for m in model.modules() if isinstance(m, MambaMixer | MambaMixer2)]
    if any(isinstance(m, MambaMixer2) for m in mixers):
        no_ssd = Mamba2MetadataBuilder(chunk, "cpu", triton_ssd=False)
        assert "Triton SSD" in full_graphs_unsupported(model, no_ssd)
    for m in mixers:
        monkeypatch.setattr(m, "backend", ConvBackend.CUDA)
    if mixers:
        assert "VLLM_USE_TRITON_CONV1D=0" in full_graphs_unsupported(model, builder)


def test_prefix_cache_restores_into_padded_steps(device):
    """Prefix caching under FULL: the second turn restores the first's end-of-request state,
    and its padded steps continue from it as an eager engine without caching computes."""
    first = [5, 17, 3, 3, 40, 9, 71]
    on = prefix_llm(device, True, enforce_eager=True)
    padded = padded_path(on, device)
    out1, _, _ = run_greedy(on, first, 5)
    second = first + out1 + [12, 60, 2]
    out2, lps2, cached = run_greedy(on, second, 4)
    assert cached == len(first) + len(out1) - 1 and on.engine.runner.step_counts["eager"] == 0
    assert padded.num_replays > 4
    off = prefix_llm(device, False, enforce_eager=True)
    run_greedy(off, first, 5)
    ref2, ref_lps2, _ = run_greedy(off, second, 4)
    assert out2 == ref2
    assert lps2 == pytest.approx(ref_lps2, rel=1e-4, abs=1e-5)


def test_eager_mixed_steps_say_why(device, caplog):
    """A step no bucket holds runs eagerly and the runner counts and logs why: five prompts
    in one step against buckets of at most four prefills; prompt logprobs."""
    opts = dict(load_format="dummy", dtype="float32", device=device.type, max_num_seqs=8,
                max_num_batched_tokens=16, max_model_len=48, enforce_eager=True)  # fmt: skip
    llm = LLM(ASYNC_SCHED_CONFIG, **opts)
    padded = padded_path(llm, device)
    assert [(b.num_tokens, b.max_prefills) for b in padded.buckets] == [(16, 4)]
    runner = llm.engine.runner
    with caplog.at_level("INFO", logger="vllm.worker.model_runner"):
        greedy(llm, [[3 + i, 7, 11] for i in range(5)], 2)
    kind = "more prefills or SSD chunks than every bucket of its size"
    assert runner.eager_mixed_reasons == {kind: 1} and runner.step_counts["eager"] == 1
    assert f"{kind} (15 tokens, 5 rows, 5 prefills)" in caplog.text
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    llm.generate([{"prompt_token_ids": [4, 8, 15]}], params, use_tqdm=False)
    assert runner.eager_mixed_reasons == {kind: 1, "prompt logprobs": 1}
    assert padded.last_miss == "prompt logprobs"


@pytest.mark.parametrize("name", ["mamba2", "bamba"])
def test_replayed_decodes_through_the_padded_path(name, device, tmp_path, monkeypatch):
    """use_replayssm under FULL: the padded steps' decodes replay (L = 3, so rows flush
    inside them), their prefills materialise with the graph's padded prefills on the null
    line left alone, and the greedy tokens are the every-step eager engine's; no step runs
    eagerly, and the null line's state, ring and counters stay zero."""
    from vllm.model_executor.layers.mamba import mamba_mixer2

    pads = []
    original = mamba_mixer2.replay_ssm_materialise

    def spy(rs, A, slots, init, pad_slot_id=-1):  # inside the host-sync guard: kept, read later
        pads.append((slots.clone(), pad_slot_id))
        return original(rs, A, slots, init, pad_slot_id=pad_slot_id)

    monkeypatch.setattr(mamba_mixer2, "replay_ssm_materialise", spy)
    opts = dict(load_format="dummy", dtype="float32", device=device.type, max_num_seqs=4,
                max_num_batched_tokens=16, max_model_len=48, enforce_eager=True)  # fmt: skip
    model = MODELS[name](tmp_path)
    prompts = [[(5 * i + 3 * j) % 90 + 1 for j in range(n)] for i, n in enumerate([1, 9, 3, 20])]
    want = greedy(LLM(model, **opts), prompts, 5)
    llm = LLM(model, **opts, use_replayssm=True, replayssm_buffer_len=3)
    padded = padded_path(llm, device)
    got = greedy(llm, prompts, 5)  # 4 decodes a row: each flushes once (L = 3)
    assert padded.host_syncs == []
    assert [g[0] for g in got] == [w[0] for w in want]
    for (_, g), (_, w) in zip(got, want, strict=True):
        assert torch.allclose(torch.tensor(g), torch.tensor(w), atol=1e-4, rtol=1e-4)
    counts = llm.engine.runner.step_counts
    assert counts["eager"] == 0 and counts["graph_mixed"] == padded.num_replays > 5
    # a padded prefill on the null line reached the materialise, which was told to skip it
    assert any(p == 0 and bool((s == 0).any()) for s, p in pads)
    mixers = [m for m in llm.engine.runner.model.modules() if isinstance(m, MambaMixer2)]
    for rs in {id(m.kv_cache[1]): m.kv_cache[1] for m in mixers}.values():
        for t in (rs.state, rs.ring_x, rs.ring_B, rs.ring_dt, rs.count):
            assert not t[0].any()
