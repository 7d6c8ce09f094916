"""Falcon-H1 sharded over two gloo ranks equals the unsharded model: each layer's mixer by
heads and attention by heads side by side, the MLP by width, embeddings and head by
vocabulary, and the muP multipliers folded into each rank's own rows after loading (the
five in_proj slices are cut per rank, so a fold by global offsets would scale the wrong
rows). fp32 logits of mixed steps within 1e-5 of the logits' scale of one rank's (rtol
1e-5): only the reductions' order differs. Two checkpoints: the grouped norm before the
gate with one group spread over both ranks (``NormThenGate``'s cross-rank sum of
squares), and the gate without a norm, both compared in one spawn of the two-rank group;
tiny checkpoints from transformers' own model."""

from __future__ import annotations

from tests.distributed.utils import run_ranks
from tests.models.falcon_h1_utils import make_falcon_h1_hf
from tests.models.hybrid_utils import check_steps_match, run_steps, save_checkpoint
from vllm.distributed import get_tp_group
from vllm.model_executor.model_loader import get_model


def _ranks_equal_one_rank(cases):
    tp = get_tp_group()
    for path, expected, atol in cases:
        model = get_model(path)
        layer = model.model.layers[0]
        # z, x: 48 / 2 each; B, C: one group of 8, replicated; dt: 4 heads / 2
        assert list(layer.mamba.in_proj.local_sizes) == [24, 24, 8, 8, 2]
        assert tuple(layer.feed_forward.gate_up_proj.weight.shape) == (80 // tp.world_size, 32)
        check_steps_match(model, expected, atol)


def test_two_ranks_equal_one_rank_gloo(tmp_path):
    """norm-before-gate (mamba_rms_norm) and gate-only checkpoints, in one group."""
    cases = []
    for name, overrides in (
        ("norm-before-gate", dict(mamba_n_groups=1)),
        ("gate-only", dict(mamba_n_groups=1, mamba_rms_norm=False)),
    ):
        path = save_checkpoint(make_falcon_h1_hf(seed=1, **overrides), tmp_path / name)
        expected = run_steps(get_model(path))
        scale = max(float(r.abs().max()) for step in expected for r in step)
        cases.append((str(path), expected, 1e-5 * max(scale, 1.0)))
    run_ranks(_ranks_equal_one_rank, cases)
