"""Mamba2ForCausalLM with replayed decode (a pool with replay rings) equals the every-step
model, step by step, through what the engine does to a slot:

- decodes across flushes (the counters read back after each step), with padded rows;
- mixed steps (their decodes replayed, their prefills materialised first);
- a decode row that becomes a chunked-prefill continuation (its ring folded in first);
- a sequence finishing mid-ring, its slot reused by a fresh prompt right after a flush
  and right before one;
- the ``materialise`` hook (``ModelRunner.materialise``) for readers outside a step;
- greedy tokens over 1,000 decode steps of a tiny HF-parity model in fp32 (on the
  PyTorch paths, TRITON_INTERPRET=0: the interpreter would take an hour; the kernels
  under the interpreter are the other tests'), and on the GPU box of the Codestral
  layer shape (fp32 state), and CUDA-graph decode steps with the replayed update.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.mamba2_utils import (
    TINY,
    Driver,
    Row,
    assert_close,
    gen_for,
    hf_config,
    hf_oracle_groups,
    make_hf_model,
)
from vllm.model_executor.layers.mamba.ops.causal_conv1d_ref import NULL_BLOCK_ID
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig
from vllm.model_executor.models.utils import bind_state_pool

L = 3  # a short ring: flushes every third decode step


def drivers(model, num_slots: int = 6, buffer_len: int = L) -> tuple[Driver, Driver]:
    every, replayed = Driver(model, num_slots), Driver(model, num_slots)
    replayed.pool = model.allocate_state_pool(num_slots, replayssm_buffer_len=buffer_len)
    assert replayed.pool.rings and not every.pool.rings
    return every, replayed


def counters(driver: Driver, slot: int) -> set[int]:
    return set(driver.pool.rings["count"][:, slot].unique().tolist())


def toks(n: int, key) -> list[int]:
    return torch.randint(0, 96, (n,), generator=gen_for(key)).tolist()


@pytest.fixture(scope="module")
def tiny_model():
    config = Mamba2ModelConfig(**{**TINY, "n_groups": 2})
    return get_model(config, load_format="dummy", dtype="float32", device="cpu", seed=3)


def step_both(every: Driver, replayed: Driver, rows: list[Row], what: str) -> None:
    want, got = every.step(rows), replayed.step(rows)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_close(g, w, "batching", msg=f"{what}, row {i} (slot {rows[i].slot})")


def test_steps_through_a_slots_life(tiny_model):
    every, replayed = drivers(tiny_model)
    step_both(every, replayed, [Row(5, toks(5, 0)), Row(1, toks(3, 1)), Row(2, toks(1, 2))], "p")
    for s in range(L + 1):  # flush boundaries: counters 1, 2, then 0 (flushed), then 1
        rows = [Row(slot, toks(1, (slot, s)), True) for slot in (5, 1, 2)]
        rows.insert(1, Row(NULL_BLOCK_ID, [0]))
        step_both(every, replayed, rows, f"decode {s}")
        assert counters(replayed, 5) == {(s + 1) % L}, f"decode {s}"
    # Mixed: decodes of 5 and 1, slot 2 continues with a chunk of 3 tokens (its ring, one
    # step deep, folded in first), a fresh prompt in slot 3.
    rows = [Row(5, [7], True), Row(1, [8], True), Row(2, toks(3, "c"), True), Row(3, toks(4, 3))]
    step_both(every, replayed, rows, "mixed")
    assert counters(replayed, 2) == {0} and counters(replayed, 3) == {0}
    assert counters(replayed, 5) == {(L + 2) % L}
    # Slot 1 finishes here, mid-ring; slot 5 decodes until its ring is full (right before a
    # flush), then both are reused by fresh prompts: slot 1 mid-ring, slot 5 before a flush.
    while counters(replayed, 5) != {L - 1}:
        step_both(every, replayed, [Row(5, [9], True), Row(3, [4], True)], "decode 0, 3")
    rows = [Row(3, [5], True), Row(5, toks(2, "new0")), Row(1, toks(6, "new1"))]
    step_both(every, replayed, rows, "reuse")
    assert counters(replayed, 5) == {0} and counters(replayed, 1) == {0}
    # Slot 3 has just flushed (or not): reuse it right after its flush.
    while counters(replayed, 3) != {0}:
        step_both(every, replayed, [Row(3, [6], True), Row(5, [1], True)], "decode 3, 0")
    step_both(every, replayed, [Row(3, toks(3, "new3")), Row(5, [2], True)], "reuse after flush")
    for s in range(L):
        rows = [Row(slot, [s], True) for slot in (5, 1, 3)]
        step_both(every, replayed, rows, f"tail {s}")


def test_materialise_hook_gives_whole_states(tiny_model):
    every, replayed = drivers(tiny_model)
    prompts = [Row(5, toks(4, "m0")), Row(2, toks(6, "m2"))]
    step_both(every, replayed, prompts, "prefill")
    for s in range(L + 1):
        step_both(every, replayed, [Row(5, [s], True), Row(2, [s + 1], True)], f"decode {s}")
    assert counters(replayed, 5) == {1}  # one step buffered: the pool line is behind
    mixers = [layer.mixer for layer in tiny_model.backbone.layers]
    slots = torch.tensor([5, 2], dtype=torch.int32)
    bind_state_pool(tiny_model, replayed.pool)
    for mixer in mixers:  # ModelRunner.materialise does this per layer
        mixer.materialise(slots)
    assert counters(replayed, 5) == {0} and counters(replayed, 2) == {0}
    for k in range(len(mixers)):
        got, want = replayed.pool.ssm_state[k, [5, 2]], every.pool.ssm_state[k, [5, 2]]
        assert_close(got, want, "batching", msg=f"layer {k}")
    step_both(every, replayed, [Row(5, [3], True), Row(2, [4], True)], "after the hook")


def greedy(driver: Driver, prompts: dict[int, list[int]], steps: int) -> dict[int, list[int]]:
    first = driver.step([Row(slot, p) for slot, p in prompts.items()])
    out = {slot: [int(lg[-1].argmax())] for slot, lg in zip(prompts, first, strict=True)}
    for _ in range(steps):
        rows = [Row(slot, [toks_[-1]], True) for slot, toks_ in out.items()]
        for slot, lg in zip(out, driver.step(rows), strict=True):
            out[slot].append(int(lg[-1].argmax()))
    return out


def test_greedy_1000_steps_tiny_hf_model(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the PyTorch paths (module docstring)
    make_hf_model(hf_config(n_groups=hf_oracle_groups()), seed=5).save_pretrained(tmp_path)
    model = get_model(tmp_path, dtype="float32", device="cpu")
    every, replayed = drivers(model, num_slots=4, buffer_len=16)
    prompts = {1: toks(11, "g1"), 3: toks(4, "g3")}
    want = greedy(every, prompts, 1000)
    got = greedy(replayed, prompts, 1000)
    assert counters(replayed, 1) == {1000 % 16}  # 62 flushes each
    for slot in prompts:
        first_diff = next(
            (i for i, (a, b) in enumerate(zip(got[slot], want[slot], strict=True)) if a != b), None
        )
        assert first_diff is None, f"slot {slot}: tokens differ from step {first_diff}"


@pytest.mark.gpu_big_memory
@pytest.mark.gpu
def test_greedy_1000_steps_codestral_shape_cuda():
    config = Mamba2ModelConfig(num_hidden_layers=2)  # the Codestral-7B layer shape
    model = get_model(config, load_format="dummy", dtype="float32", device="cuda", seed=0)
    every, replayed = drivers(model, num_slots=4, buffer_len=16)
    prompts = {4: toks(37, "c0"), 2: toks(9, "c2")}
    want, got = greedy(every, prompts, 1000), greedy(replayed, prompts, 1000)
    assert counters(replayed, 4) == {1000 % 16}
    assert got == want


@pytest.mark.gpu
def test_cuda_graph_decode_replayed():
    from vllm.worker.cuda_graph import DecodeGraphs

    model = get_model(
        Mamba2ModelConfig(**{**TINY, "n_groups": 2}), load_format="dummy", device="cuda"
    )
    every, replayed = drivers(model, num_slots=8)
    prompts = [Row(slot, toks(3 + slot, ("cg", slot))) for slot in (1, 4, 6)]
    step_both(every, replayed, prompts, "prefill")
    bind_state_pool(model, replayed.pool)
    graphs = DecodeGraphs(model, 8)
    for s in range(2 * L + 1):  # 3 rows in the graph of 4: one padded row
        ids = [int(t) for t in toks(3, ("cg-step", s))]
        got = graphs.run(ids, [1, 4, 6])
        want = every.step([Row(slot, [t], True) for slot, t in zip((1, 4, 6), ids, strict=True)])
        assert_close(got, torch.cat(want).cuda(), "batching", msg=f"graph step {s}")
        assert counters(replayed, 4) == {(s + 1) % L}
