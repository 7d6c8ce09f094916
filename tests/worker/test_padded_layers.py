"""The layer kinds' forwards in a mixed step padded to a CUDA-graph bucket (``mamba2_padded``),
at the layer, on the CPU: what a graph would capture makes no host sync
(``host_sync_guard``), and Mamba1's one selective scan over the bucket's rows (decodes as
one-token sequences, a prefill cut into chunks over time) gives the eager step's outputs
and states, touching no other line. The whole engines' padded steps: test_mixed_graph.py."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from tests.kernels.moe.moe_utils import limit_kernel_pairs
from tests.models.mamba1_utils import dummy_config
from tests.models.mamba2_utils import run_mixer
from tests.worker.host_sync_guard import HostSyncError, no_host_sync
from vllm.model_executor.layers.fused_moe import fused_moe as fm
from vllm.model_executor.layers.mamba import mamba_mixer
from vllm.model_executor.layers.mamba.mamba2_metadata import Mamba2MetadataBuilder
from vllm.model_executor.layers.mamba.mamba2_padded import (
    MixedBucket,
    finish_padded,
    prepare_padded,
)
from vllm.model_executor.layers.mamba.mamba_mixer import MambaMixer
from vllm.model_executor.layers.mamba.ops.selective_scan import chunk_plan
from vllm.model_executor.model_loader import get_model


def test_the_guard_catches_host_syncs():
    t = torch.arange(6)
    syncs = [
        lambda: t[0].item(),
        lambda: int(t[1]),
        lambda: bool(t[2] > 0),
        lambda: t.tolist(),
        lambda: t.cpu(),
        lambda: torch.nonzero(t),
        lambda: t.masked_select(t > 2),
        lambda: torch.unique(t),
        lambda: torch.repeat_interleave(t, t),
        lambda: t[t > 2],
    ]
    for sync in syncs:
        with pytest.raises(HostSyncError), no_host_sync():
            sync()
    with no_host_sync():  # shapes only, or sizes given
        torch.repeat_interleave(t, t, output_size=15)
        t.masked_fill(t > 2, 0)
        torch.where(t > 2, t, 0)
    assert t.tolist() == [0, 1, 2, 3, 4, 5]  # restored


# Two decodes (slots 1, 2), a prefill continuing its state over 70 tokens (slot 3: two
# chunks of the padded scan, so the state pass and the rescan run) and a fresh one (slot
# 4); slot 5 is free and line 0 the null line. The bucket pads 77 tokens to 96.
LENS, SLOTS, CONTEXTS, DECODES = [1, 1, 70, 5], [1, 2, 3, 4], [4, 9, 12, 0], 2
BUCKET = MixedBucket(96, 6, 4)


@torch.no_grad()
def test_mamba1_padded_scan_equals_the_eager_step(nan_poison):
    model = get_model(dummy_config(), load_format="dummy", seed=3, device="cpu")
    mixer = next(m for m in model.modules() if isinstance(m, MambaMixer))
    pool = model.allocate_state_pool(5)
    state = pool.layer(0)
    gen = torch.Generator().manual_seed(11)
    start = [torch.randn(s.shape, generator=gen) for s in state]
    t, real = BUCKET.num_tokens, sum(LENS)
    hidden = torch.randn(t, mixer.hidden_size, generator=gen)
    hidden[real:] = float("nan")  # padded tokens are rows of their own

    def run(md, rows):
        for s, s0 in zip(state, start, strict=True):
            s.copy_(s0)
        out = run_mixer(mixer, hidden[:rows], state, md)
        return out, [s.clone() for s in state]

    qsl = torch.tensor([0, *LENS], dtype=torch.int32).cumsum(0).to(torch.int32)
    eager_md = Mamba2MetadataBuilder(None, "cpu").build(
        qsl, torch.tensor(SLOTS, dtype=torch.int32), torch.tensor(CONTEXTS) > 0
    )
    want, want_state = run(eager_md, real)
    plan = prepare_padded(BUCKET, None, LENS, SLOTS, CONTEXTS, DECODES)
    padded_md = finish_padded(plan, plan.host)
    dim, dstate = mixer.intermediate_size, mixer.state_size
    assert chunk_plan(t, 1, dim, dstate, torch.float32)[1] > 1  # the scan is chunked
    with no_host_sync():
        got, got_state = run(padded_md, t)
    torch.testing.assert_close(got[:real], want, rtol=1e-5, atol=1e-5)
    assert not got[real:].any()  # padded tokens (NaN here): y = 0, no out_proj bias
    for g, w, s0 in zip(got_state, want_state, start, strict=True):
        torch.testing.assert_close(g[1:5], w[1:5], rtol=1e-5, atol=1e-5)
        assert torch.equal(g[[0, 5]], s0[[0, 5]])  # the null line and the free slot


def test_mamba1_padded_scan_chunks_for_one_long_prefill(monkeypatch):
    """A bucket's scan is planned once, for whatever steps replay it: its chunk length must
    serve the worst of them, one prefill holding nearly every token, not the bucket's
    P + 1 prefill rows (mostly empty). Shapes of falcon-mamba-7b (d_inner 8192, d_state
    16), bucket T 1024 with P 8: P + 1 rows x 128 channel blocks reach the default table's
    target programs, which would leave the 1,000-token prefill one serial chunk."""
    seen = {}

    def spy(x, *args, chunk_len=None, **kwargs):
        seen["chunk_len"] = chunk_len
        return x

    monkeypatch.setattr(mamba_mixer, "selective_scan_fn", spy)
    mixer = SimpleNamespace(intermediate_size=8192, state_size=16)
    mixer._padded_chunks = functools.partial(MambaMixer._padded_chunks, mixer)
    md = SimpleNamespace(num_tokens=1024, num_prefills=9, query_start_loc=None,
                         state_indices=None, has_initial_state=None)  # fmt: skip
    x = torch.empty(0, dtype=torch.bfloat16)
    MambaMixer._scan_padded(mixer, x, None, None, None, None, None, None, md, {})
    worst = chunk_plan(1024, 1, 8192, 16, torch.bfloat16)
    assert worst[1] > 1 and seen["chunk_len"] == worst[0]


# tokens, top_k, experts, max_kernel_pairs: unsorted, one-program and two-launch alignment
MOE_PATHS = [(2, 2, 16, None), (16, 3, 8, None), (32, 2, 8, 16)]


@pytest.mark.parametrize("tokens, top_k, experts, most", MOE_PATHS)
@pytest.mark.parametrize("grouped", [False, True], ids=["softmax", "grouped_sigmoid"])
@torch.no_grad()
def test_fused_moe_makes_no_host_sync(tokens, top_k, experts, most, grouped, monkeypatch):
    """The experts op and its routers on every alignment path, as a graph captures them."""
    if not fm.use_moe_kernel(torch.empty(1)):
        pytest.skip("the fused-MoE kernels need CUDA or TRITON_INTERPRET=1")
    if most is not None:
        limit_kernel_pairs(monkeypatch, most)
    gen = torch.Generator().manual_seed(tokens + experts)
    x = torch.randn(tokens, 32, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)
    w13 = torch.randn(experts, 48, 32, generator=gen) / 8
    w2 = torch.randn(experts, 32, 24, generator=gen) / 8
    opts = dict(scoring="softmax", renormalize=False)
    if grouped:
        opts = dict(scoring="sigmoid", renormalize=True, num_expert_group=4, topk_group=2,
                    correction_bias=torch.rand(experts, generator=gen))  # fmt: skip
    with no_host_sync():
        out = fm.fused_moe(x, w13, w2, logits, top_k, **opts)
    assert torch.isfinite(out).all()
