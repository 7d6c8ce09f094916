"""MambaForCausalLM and FalconMambaForCausalLM sharded over two gloo ranks equal the
unsharded models: the mixer by d_inner channels (in_proj column-parallel over x and z, the
conv, dt_proj, A and D per shard, x_proj and out_proj row-parallel), the embeddings and LM
head by vocabulary (logits gathered on rank 0). Tiny random checkpoints saved with
transformers' save_pretrained, and dummy weights drawn at full shape; fp32 logits of a
prefill step and a mixed step within 1e-5 (of the logits' scale) of one rank's, each
rank's state spec holding its own channels; LLM.generate's greedy tokens at TP=2 equal
TP=1's (both models' step comparisons run in that TP=2 engine's ranks: one spawn); a
d_inner that does not divide is refused before any process starts."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from tests.distributed.utils import check_generate_two_ranks_equals_one_rank
from tests.models.hybrid_utils import save_checkpoint
from tests.models.mamba1_utils import dummy_config, make_hf, run_steps
from vllm import LLM
from vllm.distributed import get_tp_group
from vllm.model_executor.model_loader import get_model


def _ranks_equal_one_rank(path, expected_ckpt, expected_dummy, atol) -> None:
    tp = get_tp_group()
    for load_format, expected in (("auto", expected_ckpt), ("dummy", expected_dummy)):
        model = get_model(path, load_format=load_format)
        mixer = model.backbone.layers[0].mixer
        assert mixer.intermediate_size == 64 // tp.world_size
        specs = list(model.get_cache_specs(4, torch.float32).values())
        assert {(s.conv_shape, s.ssm_shape) for s in specs} == {((32, 3), (32, 8))}
        got = run_steps(model)
        if tp.rank != 0:
            assert all(g is None for g in got)  # logits are gathered on rank 0 only
            continue
        for step, (g, e) in enumerate(zip(got, expected, strict=True)):
            torch.testing.assert_close(g, e, atol=atol, rtol=1e-5, msg=f"{load_format} step {step}")


def test_two_ranks_equal_one_rank_gloo_steps_and_generate(tmp_path):
    checks = []
    for kind in ("mamba", "falcon_mamba"):
        path = save_checkpoint(make_hf(kind, seed=1), tmp_path / kind)
        expected_ckpt = run_steps(get_model(path))
        expected_dummy = run_steps(get_model(path, load_format="dummy"))
        # fp32 partial sums added in another order over the all-reduces: 1e-5 of the scale
        scale = max(float(step.abs().max()) for step in expected_ckpt + expected_dummy)
        checks.append(
            (_ranks_equal_one_rank, str(path), expected_ckpt, expected_dummy, 1e-5 * scale)
        )
    gen = save_checkpoint(make_hf("falcon_mamba", seed=4), tmp_path / "gen")
    check_generate_two_ranks_equals_one_rank(gen, *checks)


def test_d_inner_that_does_not_shard_is_refused_before_any_process():
    before = set(multiprocessing.active_children())
    cfg = dummy_config(hidden_size=33, expand=1)
    with pytest.raises(
        ValueError, match=r"intermediate_size \(expand \* hidden_size\)=33 is not divisible by"
    ):
        LLM(cfg, load_format="dummy", device="cpu", max_model_len=64, tensor_parallel_size=2)
    assert set(multiprocessing.active_children()) == before
