"""JambaForCausalLM sharded over two gloo ranks equals the unsharded model: the Mamba1
mixers by d_inner channels (their dt/B/C norms replicated), attention by heads, the dense
MLPs and the experts by intermediate features (each rank's partial expert sums
all-reduced), the router replicated, embeddings and LM head by vocabulary (logits gathered
on rank 0). A tiny random checkpoint saved with transformers' save_pretrained; fp32
logits of mixed steps (fresh prompts, a chunked prefill continued, decodes beside them)
within 1e-5 of the logits' scale of one rank's; LLM.generate's greedy tokens at TP=2 equal
TP=1's (the steps' comparison runs in that TP=2 engine's ranks: one spawn for both); a
shape that does not shard is refused before any process starts. Dummy weights
at full shape are left to the layers' own tests (tests/kernels/moe,
tests/distributed/test_hybrid_tp.py), so the module stays under a minute."""

from __future__ import annotations

import multiprocessing

import pytest

from tests.distributed.utils import check_generate_two_ranks_equals_one_rank
from tests.models.hybrid_utils import check_steps_match, run_steps, save_checkpoint
from tests.models.jamba_utils import dummy_config, make_jamba_hf
from vllm import LLM
from vllm.distributed import get_tp_group
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.fused_moe import FusedMoE
from vllm.model_executor.layers.mamba.mamba_mixer import MambaMixer
from vllm.model_executor.model_loader import get_model


def _ranks_equal_one_rank(path, expected, atol) -> None:
    ws = get_tp_group().world_size
    model = get_model(path)
    mixers = [m for m in model.modules() if isinstance(m, MambaMixer)]
    assert {m.intermediate_size for m in mixers} == {64 // ws}
    assert {tuple(m.dt_layernorm.weight.shape) for m in mixers} == {(4,)}  # replicated
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(experts) == 2 and {m.local_intermediate for m in experts} == {48 // ws}
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    assert {(a.num_heads, a.num_kv_heads) for a in attns} == {(4 // ws, 2 // ws)}
    check_steps_match(model, expected, atol)


def test_two_ranks_equal_one_rank_gloo_steps_and_generate(tmp_path):
    path = save_checkpoint(make_jamba_hf(seed=6), tmp_path / "jamba")
    expected = run_steps(get_model(path))
    # fp32 partial sums added in another order over the all-reduces: 1e-5 of the scale
    scale = max(float(r.abs().max()) for step in expected for r in step)
    check_generate_two_ranks_equals_one_rank(
        path, (_ranks_equal_one_rank, str(path), expected, 1e-5 * scale)
    )


def test_shapes_that_do_not_shard_are_refused_before_any_process():
    before = set(multiprocessing.active_children())
    cfg = dummy_config(intermediate_size=50)
    with pytest.raises(ValueError, match="intermediate_size=50 is not divisible by tp_size=4"):
        LLM(cfg, load_format="dummy", device="cpu", max_model_len=64, tensor_parallel_size=4)
    assert set(multiprocessing.active_children()) == before
