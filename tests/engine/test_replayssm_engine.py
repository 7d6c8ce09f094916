"""Replayed decode in the engine: the flags, the pool's memory, and outputs equal to the
every-step engine's, with async scheduling on and off, requests finishing mid-ring, slots
reused, chunked prefills; the replayed path is observed (its counters and calls), and a
flushed or hook-materialised state equals the every-step engine's."""

from __future__ import annotations

import argparse

import pytest
import torch

from tests.engine.utils import ASYNC_SCHED_CONFIG as CONFIG
from tests.engine.utils import bamba_llm, workload
from tests.engine.utils import generate_outcomes as run
from tests.models.mamba1_utils import dummy_config as mamba1_config
from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.stats import startup_line
from vllm.model_executor.layers.mamba import mamba_mixer2
from vllm.model_executor.layers.mamba.ops import mamba_ssm_replay
from vllm.triton_utils.launch import launch_misses

pytestmark = pytest.mark.timeout(900)
L = 3


def make_llm(device, replay: bool, async_scheduling: bool = True, **kw) -> LLM:
    return LLM(
        CONFIG,
        load_format="dummy",
        dtype="float32",
        device=device.type,
        max_num_seqs=4,
        max_num_batched_tokens=12,
        async_scheduling=async_scheduling,
        use_replayssm=replay,
        replayssm_buffer_len=L,
        **kw,
    )


def test_flags_parse_and_validate(monkeypatch):
    monkeypatch.delenv("VLLM_USE_REPLAYSSM", raising=False)
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())

    def args(*argv):
        ns = parser.parse_args(list(argv))
        ns.model = CONFIG
        return EngineArgs.from_cli_args(ns)

    def resolved(**kw):
        return EngineArgs(CONFIG, device="cpu", **kw).create_engine_config().use_replayssm

    assert args().use_replayssm is None and args().replayssm_buffer_len == 16
    assert args().create_engine_config().use_replayssm is None  # the workers' device default
    assert args("--use-replayssm", "--replayssm-buffer-len", "8").use_replayssm is True
    assert args("--no-use-replayssm").use_replayssm is False
    assert resolved() is None and resolved(use_replayssm=None) is None
    # The variable sets the default only: a value given wins, a bad value names it.
    monkeypatch.setenv("VLLM_USE_REPLAYSSM", "1")
    assert resolved() is True and args().create_engine_config().use_replayssm is True
    assert resolved(use_replayssm=False) is False
    assert args("--no-use-replayssm").create_engine_config().use_replayssm is False
    monkeypatch.setenv("VLLM_USE_REPLAYSSM", "0")
    assert resolved() is False
    monkeypatch.setenv("VLLM_USE_REPLAYSSM", "sometimes")
    with pytest.raises(ValueError, match="VLLM_USE_REPLAYSSM"):
        resolved()
    monkeypatch.delenv("VLLM_USE_REPLAYSSM")
    for bad in (1, 129, 2.0, True):
        with pytest.raises(ValueError, match="--replayssm-buffer-len"):
            EngineArgs(CONFIG, device="cpu", replayssm_buffer_len=bad).create_engine_config()


def test_default_from_the_variable_skips_mamba1_models(monkeypatch):
    """VLLM_USE_REPLAYSSM=1 turns replay on where it applies: a Mamba2 model's pool gets
    the rings, a Mamba1 model starts (and generates) without; asked for explicitly, the
    Mamba1 model refuses it by name."""
    monkeypatch.setenv("VLLM_USE_REPLAYSSM", "1")
    opts = dict(load_format="dummy", dtype="float32", device="cpu", max_num_seqs=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    mamba2 = LLM(CONFIG, **opts)
    assert mamba2.engine.runner.pool.replay_len == 16
    falcon = LLM(mamba1_config("falcon_mamba"), **opts)
    assert falcon.engine.config.use_replayssm is True  # the default asked, the model declined
    assert falcon.engine.runner.pool.replay_len == 0
    out = falcon.generate([{"prompt_token_ids": [3, 5, 7]}], greedy, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="Mamba2 layers only"):
        LLM(mamba1_config("falcon_mamba"), use_replayssm=True, **opts)


def test_unset_takes_the_devices_measured_default(device, monkeypatch):
    """Nothing given: replay is on where engine_default.json says it won (the H100), off
    elsewhere and on the CPU; each device listed there is spelled as its launch table."""
    monkeypatch.delenv("VLLM_USE_REPLAYSSM", raising=False)
    llm = LLM(CONFIG, load_format="dummy", dtype="float32", device=device.type, max_num_seqs=2)
    config = llm.engine.config
    on = mamba_ssm_replay.default_on(llm.engine.runner.device, config.ssm_state_dtype)
    assert llm.engine.runner.pool.replay_len == (16 if on else 0)
    assert config.use_replayssm is None
    assert mamba_ssm_replay.default_on(torch.device("cpu"), torch.float32) is False
    listed = mamba_ssm_replay._engine_defaults()
    assert listed["NVIDIA_H100_80GB_HBM3"]["use_replayssm"] is True
    for name, entry in listed.items():
        assert (mamba_ssm_replay.CONFIG_DIR / f"{name}.json").is_file(), name
        by_dtype = entry["use_replayssm"]
        if not isinstance(by_dtype, dict):  # one value for every state dtype
            by_dtype = {"float32": by_dtype}
        # Per state dtype: torch's names, each True or False.
        assert by_dtype and all(isinstance(getattr(torch, k), torch.dtype) for k in by_dtype)
        assert all(isinstance(v, bool) for v in by_dtype.values()), name
        assert entry["measured"], name


def test_a_default_per_state_dtype(monkeypatch):
    """An entry may name state dtypes: on for those marked true only; a dtype it does not
    name stays off (the H200's entry: fp32 state on, bf16 off)."""
    gpu = torch.device("cuda", 0)  # a name only: nothing runs on it
    monkeypatch.setattr(mamba_ssm_replay.configs, "device_file_name", lambda d: "GPU_X")
    table = {"GPU_X": {"use_replayssm": {"float32": True, "bfloat16": False}, "measured": "-"}}
    monkeypatch.setattr(mamba_ssm_replay, "_engine_defaults", lambda: table)
    assert mamba_ssm_replay.default_on(gpu, torch.float32) is True
    assert mamba_ssm_replay.default_on(gpu, torch.bfloat16) is False
    assert mamba_ssm_replay.default_on(gpu, torch.float16) is False
    assert mamba_ssm_replay.default_on(torch.device("cpu"), torch.float32) is False
    table["GPU_X"]["use_replayssm"] = True
    assert mamba_ssm_replay.default_on(gpu, torch.bfloat16) is True


def test_pool_memory_counts_the_ring(device):
    llm = make_llm(device, True)
    runner = llm.engine.runner
    pool, spec = runner.pool, next(iter(runner.cache.mamba_specs.values()))
    nheads, headdim, dstate = spec.ssm_shape
    groups, act = CONFIG.n_groups, 4  # fp32 model
    entry = nheads * headdim * act + groups * dstate * act + nheads * 4
    ring = (L - 1) * entry + nheads * headdim  # + the int8 counters
    assert spec.replay_len == L and spec.ring_bytes_per_slot == ring
    lines = pool.num_layers * (pool.num_slots + 1)
    assert pool.ring_nbytes() == lines * ring
    assert pool.nbytes() == lines * spec.bytes_per_slot
    off = make_llm(device, False).engine.runner.pool
    assert pool.nbytes() - off.nbytes() == pool.ring_nbytes()
    line = startup_line(llm.engine.startup)
    assert f"replay rings (replayssm_buffer_len {L})" in line, line


def test_outputs_equal_every_step(device, monkeypatch):
    """Replayed with async scheduling against every-step without (test_async_scheduling
    holds the every-step engine's async and sync runs equal)."""
    calls = {"update": 0, "materialise": 0}
    for name in ("update", "materialise"):
        fn = getattr(mamba_mixer2, f"replay_ssm_{name}")

        def counted(*a, _fn=fn, _name=name, **k):
            calls[_name] += 1
            return _fn(*a, **k)

        monkeypatch.setattr(mamba_mixer2, f"replay_ssm_{name}", counted)
    # 9 requests on 4 slots: slots reused, rings mid-way; prompts of up to 16 tokens,
    # prefilled in chunks of at most 5 (up to 4 chunks each).
    prompts, params = workload(5, max_prompt_len=16)
    kw = dict(long_prefill_token_threshold=5)
    want = run(make_llm(device, False, False, **kw), prompts, params)
    assert calls == {"update": 0, "materialise": 0}
    got = run(make_llm(device, True, True, **kw), prompts, params)
    assert got == want
    assert calls["update"] > 0 and calls["materialise"] > 0


@pytest.mark.parametrize("mode", ["one-launch", "split-flush", "bc-pre-at-1"])
def test_flushed_and_hooked_states_equal_every_step(device, monkeypatch, mode):
    """One request alone (slot 1, the first: line 0 is the null line): 2L decode steps end
    on a flush; then a second request's L + 1 decodes end one step into the ring, and the
    hook folds it in. Also with every launch configuration's step split in two launches
    (split_flush), and with bc_pre in batch 1's entry only (its launch ahead, which the
    warm-up must compile too)."""
    real = mamba_ssm_replay.launch_config
    extra = {"one-launch": {}, "split-flush": {"split_flush": True}}.get(mode)
    if extra is None:  # bc-pre-at-1
        monkeypatch.setattr(mamba_ssm_replay, "launch_config",
                            lambda b, *a: {**real(b, *a), "bc_pre": b == 1})  # fmt: skip
    elif extra:
        monkeypatch.setattr(mamba_ssm_replay, "launch_config",
                            lambda *a: {**real(*a), **extra})  # fmt: skip
    bc_rows, real_bc = [], mamba_ssm_replay._launch_bc
    monkeypatch.setattr(mamba_ssm_replay, "_launch_bc",
                        lambda *a: bc_rows.append(a[3].shape[0]) or real_bc(*a))  # fmt: skip
    split = mode == "split-flush"
    parts, launch = set(), mamba_ssm_replay._LAUNCH

    def recorded(grid, args, constexprs, *rest):
        parts.add((constexprs["STEP"], constexprs["PART"]))
        return launch(grid, args, constexprs, *rest)

    recorded.runs_cpu_tensors = launch.runs_cpu_tensors
    monkeypatch.setattr(mamba_ssm_replay, "_LAUNCH", recorded)
    engines = {r: make_llm(device, r) for r in (False, True)}
    misses = launch_misses()
    for tokens, want_count in ((2 * L + 1, 0), (L + 2, 1)):
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        outs = {
            r: llm.generate([[5, 6, 7, 8]], params, use_tqdm=False) for r, llm in engines.items()
        }
        assert outs[True][0].outputs[0].token_ids == outs[False][0].outputs[0].token_ids
        pools = {r: llm.engine.runner.pool for r, llm in engines.items()}
        count = pools[True].rings["count"][:, 1]
        assert set(count.unique().tolist()) == {want_count}, "decodes - 1 = steps in the ring"
        if want_count:
            engines[True].engine.engine_core.materialise([1])
            assert set(pools[True].rings["count"][:, 1].unique().tolist()) == {0}
        torch.testing.assert_close(
            pools[True].ssm_state[:, 1], pools[False].ssm_state[:, 1], atol=2e-5, rtol=2e-5
        )
    assert launch_misses() == misses, "the warm-up missed a replayed kernel variant"
    # steps in two launches when split, else one; a materialisation is always one
    assert parts == ({(True, 1), (True, 2)} if split else {(True, 0)}) | {(False, 0)}
    # bc_pre's launch ahead ran on the one-row steps (and only with bc_pre)
    assert (1 in bc_rows) == (mode == "bc-pre-at-1"), bc_rows


def test_hybrid_mamba2_layers_replayed():
    """Bamba (Mamba2 + attention): its Mamba2 layers replay, outputs as every-step's."""
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=2 * L + 2, ignore_eos=True)
    outs = {}
    for replay in (False, True):
        llm = bamba_llm(max_num_seqs=2, use_replayssm=replay, replayssm_buffer_len=L)
        assert bool(llm.engine.runner.pool.rings) == replay
        outs[replay] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs[True] == outs[False]
