"""The fused MoE in a mixed step padded to a CUDA-graph bucket (cudagraph_mode FULL,
``vllm/worker/mixed_graph.py``): the layer sees T rows, the step's n real rows first and
T - n padded ones. A padded row routes wherever its values send it (NaN and inf here,
where the engine's are finite) and must leave every real row as the n-row call computes
it, on each path the token count picks: unsorted (a block per pair), the one-program
alignment, the two-launch one. The path follows from the pair count alone for the
router's ids (int32, contiguous, aligned: ``_unsorted``'s layout conditions always hold),
so a graph's capture fixes it for every step it replays."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.moe.moe_utils import (
    TOLERANCES,
    expert_weights,
    gen_for,
    limit_kernel_pairs,
    tie_free_logits,
)
from vllm.model_executor.layers.fused_moe import fused_moe as fm
from vllm.model_executor.layers.fused_moe import moe_align
from vllm.model_executor.layers.fused_moe.fused_moe_ref import fused_experts_ref
from vllm.model_executor.layers.fused_moe.router import select_experts

HIDDEN, INTER = 32, 24


def _watch_paths(monkeypatch) -> list[str]:
    """The alignment paths the op takes, call by call: "align" for each alignment (none:
    unsorted), "chunks" when it went through the two-launch path."""
    seen: list[str] = []
    align, chunks = fm.moe_align_block_size, moe_align._align_chunks
    monkeypatch.setattr(fm, "moe_align_block_size", lambda *a: seen.append("align") or align(*a))
    monkeypatch.setattr(moe_align, "_align_chunks",
                        lambda *a: seen.append("chunks") or chunks(*a))  # fmt: skip
    return seen


# real rows n, bucket rows T, top_k, experts, max_kernel_pairs, the padded call's path
CASES = [
    (1, 2, 2, 16, None, []),  # 4 pairs <= 16 // 4: unsorted
    (5, 16, 3, 8, None, ["align"]),  # the one-program alignment
    (12, 32, 2, 8, 16, ["align", "chunks"]),  # 64 pairs > 16: the two-launch alignment
]


# The interpreter's numpy matmul warns of the padded rows' NaN and inf.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("n, t, top_k, experts, most, path", CASES)
@pytest.mark.parametrize("activation", ["silu", "relu2"])
def test_padded_rows_leave_the_real_rows_alone(n, t, top_k, experts, most, path, activation,
                                               kernels, monkeypatch, nan_poison):  # fmt: skip
    gen = gen_for("fused-moe-padding", n, t, top_k, experts, activation)
    gated = activation == "silu"
    x = torch.randn(t, HIDDEN, generator=gen)
    logits = tie_free_logits(t, experts, gen)
    x[n:] = float("nan")
    x[n::2] = float("inf")
    logits[n::2] = float("nan")  # padded rows route anywhere, or as NaN says
    w13, w2 = expert_weights(experts, HIDDEN, INTER, torch.float32, gen, act_and_mul=gated)
    x, logits, w13, w2 = (v.to(kernels) for v in (x, logits, w13, w2))
    opts = dict(activation=activation, is_act_and_mul=gated, renormalize=True)
    with monkeypatch.context() as m:
        if most is not None:
            limit_kernel_pairs(m, most)
        seen = _watch_paths(m)
        padded = fm.fused_moe(x, w13, w2, logits, top_k, **opts)
        assert seen == path
        alone = fm.fused_moe(x[:n].clone(), w13, w2, logits[:n].clone(), top_k, **opts)
    weights, ids = select_experts(logits[:n], top_k, renormalize=True)
    ref = fused_experts_ref(x[:n], w13, w2, weights, ids, activation, gated)
    assert torch.isfinite(padded[:n]).all()
    torch.testing.assert_close(padded[:n], ref, **TOLERANCES[torch.float32])
    torch.testing.assert_close(padded[:n], alone, **TOLERANCES[torch.float32])
    # The router's ids meet the unsorted path's layout conditions whatever the rows hold.
    _, ids = select_experts(logits, top_k, renormalize=True)
    assert ids.dtype == torch.int32 and ids.is_contiguous() and ids.data_ptr() % 16 == 0
    assert bool(((ids >= 0) & (ids < experts)).all())
