"""A launch table entry's second chunk-state config for calls of many chunks
(``chunk_state_many`` from ``many_chunks`` chunks on: ``ssd_configs``' ``many``): the call
picks its variant by its chunk count, outputs and pools stay bit-identical to the one-config
op (here the variant is ``FUSED_PASS``, itself bit-identical), a recording call (the
warm-up) compiles both variants so that no chunk count compiles later, and the table's
keys are checked."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.mamba.ssd_utils import Case, build, run_ssd, small_blocks
from vllm.model_executor.layers.mamba.ops import ssd_combined, ssd_launch
from vllm.triton_utils import configs
from vllm.triton_utils.launch import launch_misses, precompile

THRESHOLD = 3  # chunks (of 8 tokens, the cases' chunk)
MANY = Case((37,), heads=2, groups=1)  # 5 chunks
TWO = Case((12,))  # 2 chunks


def _with_many(monkeypatch) -> None:
    """The small blocks of the interpreter's tests, plus a FUSED_PASS variant from
    ``THRESHOLD`` chunks on."""
    small_blocks(monkeypatch)
    blocks = ssd_combined.ssd_configs

    def configs_with_many(*args):
        cfg = blocks(*args)
        state = dict(cfg["chunk_state"], FUSED_PASS=True)
        cfg["many"] = {**cfg, "chunk_state": state, "many_chunks": THRESHOLD}
        return cfg

    monkeypatch.setattr(ssd_combined, "ssd_configs", configs_with_many)


@pytest.fixture
def fused_calls(monkeypatch):
    """FUSED_PASS of each chunk-state launch made through ``launch_all``."""
    calls = []
    original = ssd_launch.launch_chunk_state

    def noted(*args, **kwargs):
        calls.append(bool(args[14].get("FUSED_PASS")))  # its cfg argument
        return original(*args, **kwargs)

    monkeypatch.setattr(ssd_launch, "launch_chunk_state", noted)
    return calls


def _chunks(case: Case) -> int:
    return sum(-(-n // case.chunk) for n in case.lens)


@pytest.mark.parametrize("case", [TWO, MANY], ids=["2chunks", "5chunks"])
def test_the_call_takes_its_variant_by_chunk_count(case, device, monkeypatch, fused_calls):
    small_blocks(monkeypatch)
    inp = build(case, device)
    y0 = run_ssd(case, inp, device)
    pool0 = inp.pool.clone()
    _with_many(monkeypatch)
    inp = build(case, device)
    y1 = run_ssd(case, inp, device)
    many = _chunks(case) >= THRESHOLD
    assert fused_calls == [False, many]
    rows = slice(case.offset, case.offset + sum(case.lens))
    assert torch.equal(y1[rows], y0[rows]) and torch.equal(inp.pool, pool0)


def test_config_for_picks_from_the_threshold_on():
    cfg = {"chunk_state": {"FUSED_PASS": False}, "many": None}
    assert ssd_combined.config_for(cfg, 100) is cfg
    cfg["many"] = many = {**cfg, "chunk_state": {"FUSED_PASS": True}, "many_chunks": 16}
    assert ssd_combined.config_for(cfg, 15) is cfg
    assert ssd_combined.config_for(cfg, 16) is many
    assert ssd_combined.config_for(cfg, 0) is cfg


def test_recording_compiles_both_variants(device, monkeypatch, fused_calls):
    """The warm-up records a small call: both variants are asked for, and afterwards
    neither a few-chunk nor a many-chunk call compiles anything."""
    _with_many(monkeypatch)
    state_kernel = ssd_launch._STATE_LAUNCHER.name
    inp = build(TWO, device)
    with precompile() as report:
        run_ssd(TWO, inp, device)
    assert fused_calls == [True, False]  # the many plan, then the call's own
    assert report.variants[state_kernel] == 2
    before = launch_misses()
    for case in (TWO, MANY):
        run_ssd(case, build(case, device), device)
    assert fused_calls[2:] == [False, True]
    assert launch_misses() == before, "a chunk count compiled a variant the warm-up missed"


_LOOKUP = configs.lookup_first


def _entry(**extra) -> dict:
    """default.json's general entry (a copy) with ``extra`` keys."""
    return {**_LOOKUP(ssd_combined.CONFIG_FOLDER, ["*"]), **extra}


@pytest.mark.parametrize(
    "extra, message",
    [
        (dict(many_chunks=4), "chunk_state_many and many_chunks go together"),
        (dict(chunk_state_many={"BLOCK_N": 64, "BLOCK_P": 64, "BLOCK_T": 32}),
         "chunk_state_many and many_chunks go together"),
        (dict(chunk_state_many={"BLOCK_N": 64, "BLOCK_P": 64, "BLOCK_T": 32}, many_chunks=0),
         "many_chunks must be an integer >= 1"),
        (dict(chunk_state_many={"BLOCK_N": 64, "BLOCK_P": 64, "BLOCK_T": 32}, many_chunks=2.5),
         "many_chunks must be an integer >= 1"),
        (dict(chunk_state_many={"BLOCK_N": 64, "BLOCK_P": 64, "BLOCK_T": 32, "FOLD_CB": True},
              many_chunks=8), "FOLD_CB needs FUSED_PASS"),
    ],
)  # fmt: skip
def test_table_keys_are_checked(extra, message, monkeypatch):
    monkeypatch.setattr(configs, "lookup_first", lambda *a, **k: _entry(**extra))
    with pytest.raises(ValueError, match=message):
        ssd_combined.ssd_configs.__wrapped__(8, 16, 32, 2, 64, torch.bfloat16, torch.bfloat16)


def test_a_table_rule_reaches_the_configs(monkeypatch):
    many = {"BLOCK_N": 64, "BLOCK_P": 64, "BLOCK_T": 32, "FUSED_PASS": True, "maxnreg": 168}
    monkeypatch.setattr(
        configs, "lookup_first", lambda *a, **k: _entry(chunk_state_many=many, many_chunks=16)
    )
    cfg = ssd_combined.ssd_configs.__wrapped__(8, 16, 32, 2, 64, torch.bfloat16, torch.bfloat16)
    assert not cfg["chunk_state"]["FUSED_PASS"]
    variant = cfg["many"]
    assert variant["many_chunks"] == 16 and variant["many"] is None
    state = variant["chunk_state"]
    assert state["FUSED_PASS"] and state["maxnreg"] == 168 and not state["FOLD_CB"]
    # Cut to the shape as the main config is (headdim 16, state 32), split dots on.
    assert (state["BLOCK_P"], state["BLOCK_N"], state["SPLIT"]) == (16, 32, True)
    assert variant["chunk_scan"] is cfg["chunk_scan"]
    assert variant["state_passing"] is cfg["state_passing"]
