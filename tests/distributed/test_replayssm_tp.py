"""Replayed decode under tensor parallelism: Mamba2ForCausalLM sharded over two gloo ranks,
each rank's pool holding the rings of its own heads (and groups), equals the unsharded
every-step model over decodes that cross flushes, a mixed step with a chunked-prefill
continuation of a decoding slot, and the ``materialise`` hook on every rank; each rank's
counters are read back."""

from __future__ import annotations

import torch

from tests.distributed.utils import TOL, dummy_config, run_ranks
from vllm.distributed import get_tp_group
from vllm.forward_context import ForwardContext, set_forward_context
from vllm.model_executor.model_loader import get_model

L = 3
# (tokens, slot, continues its state) per row, one list per step: prompts, L + 1 decodes
# (a flush, then one step in the rings), a decode beside a 3-token continuation of slot 1
# and a fresh prompt, then a decode of each. Slot s is pool line s + 1 (line 0 is the null
# line).
MIXED = L + 2
STEPS = (
    [[(5, 0, False), (2, 1, False)]]
    + [[(1, 0, True), (1, 1, True)]] * (L + 1)
    + [[(1, 0, True), (3, 1, True), (4, 2, False)]]
    + [[(1, 0, True), (1, 1, True), (1, 2, True)]]
)


def _run(model, replayssm_buffer_len: int) -> tuple[list, torch.Tensor, object]:
    """Logits of every step (None off rank 0), the counters after each step, the pool."""
    builder = model.metadata_builder("cpu")
    pool = model.allocate_state_pool(4, replayssm_buffer_len=replayssm_buffer_len)
    gen = torch.Generator().manual_seed(11)
    logits, counts = [], []
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
            logits.append(model.compute_logits(model(ids, None)))
        if pool.rings:
            counts.append(pool.rings["count"][:, 1:4].amax(dim=(0, 2, 3)))
    return logits, counts, pool


def _sharded_replay_equals(n_groups: int, expected: list, expected_states: torch.Tensor):
    tp = get_tp_group()
    model = get_model(dummy_config(n_groups), load_format="dummy")
    assert model.backbone.layers[0].mixer.num_heads == 4
    got, counts, pool = _run(model, L)
    assert pool.rings["ring_x"].shape[2] == 4  # this rank's heads only
    # slot 0 decodes every step after its prompt: its counter walks 1, 2, 0, 1, ...
    assert [int(c[0]) for c in counts[1:]] == [s % L for s in range(1, len(STEPS))]
    assert int(counts[MIXED - 1][1]) == 1 and int(counts[MIXED][1]) == 0  # folded in
    mixers = [layer.mixer for layer in model.backbone.layers]
    for mixer in mixers:  # the hook, on this rank's heads
        mixer.materialise(torch.tensor([1, 2, 3], dtype=torch.int32))
    heads = slice(4 * tp.rank, 4 * tp.rank + 4)
    torch.testing.assert_close(pool.ssm_state[:, 1:4], expected_states[:, 1:4, heads], **TOL)
    if tp.rank != 0:
        assert all(g is None for g in got)
        return
    for step, (g, e) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(g, e, **TOL, msg=f"step {step}")


def _every_case_equals(cases) -> None:
    for case in cases:
        _sharded_replay_equals(*case)


def test_two_rank_replayed_equals_one_rank_every_step_gloo():
    """Both n_groups in one spawn of the two-rank group."""
    cases = []
    for n_groups in (1, 2):
        model = get_model(dummy_config(n_groups), load_format="dummy")
        expected, _, pool = _run(model, 0)
        cases.append((n_groups, expected, pool.ssm_state))
    run_ranks(_every_case_equals, cases)
