"""Granite-4.0-H sharded over two gloo ranks equals the unsharded model: the experts by
their intermediate dimension (each rank's rows of every expert's gate and up, its columns
of down; the router replicated), the shared MLP by width, the experts' and the shared
MLP's partial sums added and all-reduced once, the Mamba2 mixers by heads (one group,
replicated), attention by heads, embeddings and head by vocabulary. fp32 logits of mixed
steps within 1e-5 of the logits' scale of one rank's (rtol 1e-5): only the reductions'
order differs; a wrong slice moves them by O(0.1). Tiny checkpoints from transformers'
own model; every rank's routing gaps are watched as in the single-rank tests."""

from __future__ import annotations

from tests.distributed.utils import run_ranks
from tests.models.granitemoehybrid_utils import RoutingMargins, make_granite_hf
from tests.models.hybrid_utils import check_steps_match, run_steps, save_checkpoint
from vllm.distributed import get_tp_group
from vllm.model_executor.layers.fused_moe import FusedMoE
from vllm.model_executor.model_loader import get_model


def _ranks_equal_one_rank(path, expected, atol):
    tp = get_tp_group()
    model = get_model(path)
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert [tuple(m.w13_weight.shape) for m in experts] == [(4, 48 // tp.world_size, 32)] * 4
    assert [tuple(m.w2_weight.shape) for m in experts] == [(4, 32, 24 // tp.world_size)] * 4
    shared = model.model.layers[0].shared_mlp
    assert tuple(shared.input_linear.weight.shape) == (80 // tp.world_size, 32)
    margins = RoutingMargins().watch_ours(model)
    check_steps_match(model, expected, atol)
    margins.check()


def test_two_ranks_equal_one_rank_gloo(tmp_path):
    """Experts with RoPE attention (two KV heads, one per rank), one Mamba group shared."""
    hf = make_granite_hf(seed=1, mamba_n_groups=1)
    path = save_checkpoint(hf, tmp_path / "granite")
    expected = run_steps(get_model(path))
    scale = max(float(r.abs().max()) for step in expected for r in step)
    run_ranks(_ranks_equal_one_rank, str(path), expected, 1e-5 * max(scale, 1.0))
