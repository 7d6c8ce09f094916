"""Mamba2ForCausalLM sharded over two gloo ranks equals the unsharded model: the mixer by
heads (n_groups 1: groups replicated, the norm reducing across ranks; n_groups 2: groups
split), the embedding and LM head by vocabulary (logits gathered on rank 0), weights read
per rank from HF safetensors and dummy weights drawn at full shape. fp32 logits of a
prefill step and of a mixed step (a decode, a continued prefill, a new prefill) within
1e-5 of one rank's; both n_groups in one spawn of the two-rank group."""

from __future__ import annotations

import torch

from tests.distributed.utils import TOL, run_ranks
from tests.distributed.utils import dummy_config as _dummy_config
from tests.tiny_model import make_tiny_model_dir
from vllm.distributed import get_tp_group
from vllm.forward_context import ForwardContext, set_forward_context
from vllm.model_executor.model_loader import get_model

# (tokens, slot, continues its state) per row, one list per step; slot s is pool line s + 1
# (line 0 is the null line).
STEPS = [
    [(5, 0, False), (3, 1, False)],
    [(1, 0, True), (4, 1, True), (6, 2, False)],
]


def _run_steps(model) -> list[torch.Tensor | None]:
    """Logits of every row of every step (None off rank 0 under tensor parallelism)."""
    builder = model.metadata_builder("cpu")
    model.allocate_state_pool(4)  # bound to the layers
    gen = torch.Generator().manual_seed(7)
    out = []
    for rows in STEPS:
        lens = torch.tensor([n for n, _, _ in rows], dtype=torch.int32)
        qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
        torch.cumsum(lens, 0, out=qsl[1:])
        md = builder.build(
            qsl,
            torch.tensor([s + 1 for _, s, _ in rows], dtype=torch.int32),
            torch.tensor([init for _, _, init in rows]),
        )
        ids = torch.randint(0, model.config.vocab_size, (int(lens.sum()),), generator=gen)
        with torch.no_grad(), set_forward_context(ForwardContext(mamba2_metadata=md)):
            out.append(model.compute_logits(model(ids, None)))
    return out


def _ranks_equal_one_rank(model_dir, n_groups, expected_ckpt, expected_dummy) -> None:
    tp = get_tp_group()
    for model, expected in [
        (get_model(model_dir), expected_ckpt),
        (get_model(_dummy_config(n_groups), load_format="dummy"), expected_dummy),
    ]:
        mixer = model.backbone.layers[0].mixer
        assert (
            mixer.num_heads == 4 and mixer.intermediate_size == model.config.intermediate_size // 2
        )
        assert (mixer.norm.shared_group is not None) == (n_groups == 1)
        assert mixer.spec.ssm_shape[0] == 4  # this rank's heads only in its state pool
        got = _run_steps(model)
        if tp.rank != 0:
            assert all(g is None for g in got)  # logits are gathered on rank 0 only
            continue
        for step, (g, e) in enumerate(zip(got, expected, strict=True)):
            torch.testing.assert_close(g, e, **TOL, msg=f"step {step}")


def _every_case_equals_one_rank(cases) -> None:
    for case in cases:
        _ranks_equal_one_rank(*case)


def test_two_rank_model_equals_one_rank_gloo(tmp_path):
    cases = []
    for n_groups in (1, 2):
        tiny = tmp_path / f"tiny{n_groups}"
        model_dir = str(make_tiny_model_dir(tiny, n_groups=n_groups, vocab_size=300))
        expected_ckpt = _run_steps(get_model(model_dir))
        dummy = get_model(_dummy_config(n_groups), load_format="dummy")
        assert dummy.backbone.embeddings.weight.shape == (128, 32)  # padded to 64 rows, as vLLM
        cases.append((model_dir, n_groups, expected_ckpt, _run_steps(dummy)))
    run_ranks(_every_case_equals_one_rank, cases)


def _no_collective(*args, **kwargs):
    raise AssertionError("a collective at world size 1")


def test_one_rank_holds_every_weight_whole(monkeypatch):
    """At world size 1 the parallel layers hold the whole tensors under the checkpoint's
    names and shapes (the vocabulary padded as vLLM pads it), and a step makes no
    torch.distributed call."""
    model = get_model(_dummy_config(1), load_format="dummy")
    for op in ("all_reduce", "all_gather", "gather", "broadcast"):
        monkeypatch.setattr(torch.distributed, op, _no_collective)
    assert all(logits.isfinite().all() for logits in _run_steps(model))
    model = get_model(_dummy_config(2), load_format="dummy")
    mixer = model.backbone.layers[0].mixer
    assert (mixer.num_heads, mixer.n_groups, mixer.norm.shared_group) == (8, 2, None)
    assert model.lm_head.weight is model.backbone.embeddings.weight  # tied
    shapes = {n: tuple(p.shape) for n, p in mixer.named_parameters()}
    assert shapes == {
        "in_proj.weight": (2 * 64 + 2 * 2 * 8 + 8, 32),
        "conv1d.weight": (64 + 2 * 2 * 8, 4),
        "conv1d.bias": (64 + 2 * 2 * 8,),
        "A_log": (8,),
        "D": (8,),
        "dt_bias": (8,),
        "norm.weight": (64,),
        "out_proj.weight": (32, 64),
    }
