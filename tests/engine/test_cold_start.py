"""No kernel compiles after start-up: the engine compiles every variant while it starts.

On CPU the kernels run under the interpreter, which compiles nothing, so the test counts
the launch cache's misses instead (``CachedLauncher.misses``: a launch of a variant not
compiled or registered before; on the GPU box the same test runs on CUDA). On the GPU box
a fresh process with an empty Triton cache also counts Triton's own compilations (its
post-compile hook) after start-up.
Each serves a mixed random workload: prompts of many lengths (chunked when longer than the
step budget), arrivals in waves so decode steps run at many batch sizes, next to prefills.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.models.mamba2_utils import TINY
from tests.utils import serve_random_workload
from vllm import LLM, SamplingParams
from vllm.engine.stats import startup_line
from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig
from vllm.triton_utils.launch import launch_misses, precompile
from vllm.worker.warmup import dummy_steps

pytestmark = pytest.mark.timeout(600)

# The shared tiny shape, wider: two groups of four heads; one layer, as every layer
# launches the same kernel variants (a second one doubles each step's interpreter work and
# adds no variant).
CONFIG = Mamba2ModelConfig(
    **{
        **TINY,
        "vocab_size": 256,
        "hidden_size": 64,
        "num_hidden_layers": 1,
        "num_heads": 8,
        "state_size": 16,
        "n_groups": 2,
    }
)


@pytest.mark.parametrize(
    "max_num_seqs,max_num_batched_tokens", [(1, 4), (3, 3), (4, 16), (6, 20)], ids=str
)
def test_no_launch_miss_after_startup(max_num_seqs, max_num_batched_tokens, device):
    llm = LLM(
        CONFIG,
        load_format="dummy",
        dtype="float32",
        device=device.type,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    startup = llm.engine.startup
    assert startup["num_kernels"] > 0 and startup["total_s"] >= startup["warmup_s"] > 0
    before = launch_misses()
    served = serve_random_workload(llm, seed=max_num_seqs, waves=3, max_len=30, vocab=256)
    assert served > 0
    assert launch_misses() == before, "a kernel variant was first launched after start-up"
    assert llm.engine.step_totals.kernel_compiles == 0
    # The start-up line names the kernel whose compiling finished last (on the CPU the
    # interpreter compiles nothing, so only with finishing times put in).
    assert "last done" not in startup_line({**startup, "kernel_finished_s": {}})
    line = startup_line({**startup, "kernel_finished_s": {"_a": 1.5, "_b": 7.25}})
    assert "the last done: _b at 7.2 s" in line


def test_a_variant_missed_by_the_warmup_is_counted_and_logged(device, monkeypatch, caplog):
    """What the server exports as vllm:engine_kernel_compiles_total: a step that launches a
    variant the warm-up did not compile counts it in its StepStats and names the kernel in
    a warning. The launch caches are emptied after start-up, as if the warm-up had missed
    every variant. Eager steps (NONE): a replayed CUDA graph launches nothing through the
    launchers, and under the default (FULL) every step of this workload replays one."""
    from vllm.triton_utils import launch

    llm = LLM(CONFIG, load_format="dummy", dtype="float32", device=device.type,
              max_num_seqs=4, max_num_batched_tokens=16,
              compilation_config={"cudagraph_mode": "NONE"})  # fmt: skip
    for launcher in launch._LAUNCHERS:
        monkeypatch.setattr(launcher, "seen", set())
        monkeypatch.setattr(launcher, "cache", {})
    before = launch_misses()
    root = logging.getLogger("vllm")
    root.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm"):
            serve_random_workload(llm, seed=5, waves=1, max_len=20, vocab=256)
    finally:
        root.removeHandler(caplog.handler)
    missed = {k: n - before.get(k, 0) for k, n in launch_misses().items() if n > before.get(k, 0)}
    assert missed, "no launch went through a launcher"
    assert llm.engine.step_totals.kernel_compiles == sum(missed.values())
    logged = " ".join(r.getMessage() for r in caplog.records if "warm-up missed" in r.getMessage())
    assert all(name in logged for name in missed), (missed, logged)


def _decode_args(dim: int, batch: int, device):
    x = torch.randn(batch, dim, device=device)
    state = torch.randn(batch + 1, 3, dim, device=device).transpose(1, 2)
    w, b = torch.randn(dim, 4, device=device), torch.randn(dim, device=device)
    return x, state, w, b, "silu", torch.arange(batch, dtype=torch.int32, device=device)


def test_misses_counted_and_precompiled(device, monkeypatch):
    """The counter the test above relies on counts a variant's first launch, and a
    ``precompile`` block registers the launch site's whole table (no miss afterwards).
    The decode launcher starts as in a fresh process, whatever ran before in this one (a
    kernel test launches these variants too; under pytest-xdist any file may come first)."""
    from vllm.model_executor.layers.mamba.ops import causal_conv1d as cc

    launcher = cc._LAUNCH_DECODE
    monkeypatch.setattr(launcher, "seen", set())
    monkeypatch.setattr(launcher, "cache", {})
    cc.clear_host_caches()  # a kept plan would launch a variant it knows past the launcher
    misses = launcher.misses
    cc.causal_conv1d_update(*_decode_args(37, 3, device))
    assert launcher.misses == misses + 1
    cc.causal_conv1d_update(*_decode_args(37, 5, device))  # same variant
    assert launcher.misses == misses + 1

    with precompile() as report:
        cc.causal_conv1d_update(*_decode_args(41, 3, device))
    assert report.variants == {"_causal_conv1d_decode_kernel": 2}  # its table: lone, batch
    assert report.num_new <= 2  # what an earlier test compiled is not compiled again
    for batch in (1, 2, 3, 9):
        cc.causal_conv1d_update(*_decode_args(41, batch, device))
    assert launcher.misses == misses + 1


def _fwd_args(lengths: list[int], device):
    dim = 40
    x = torch.randn(sum(lengths), dim, device=device).t()
    w, b = torch.randn(dim, 4, device=device), torch.randn(dim, device=device)
    states = torch.zeros(len(lengths), 3, dim, device=device).transpose(1, 2)
    qsl = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                       device=device)  # fmt: skip
    return x, w, b, states, qsl


# One forward step per launch configuration (_fwd_config_name): 8 one-token sequences in
# one tile ("tiles"), one 128-token sequence in 4 tiles ("small_step", which adds
# ``maxnreg``), 32 one-token sequences ("many_heads").
_FWD_SHAPES = {"tiles": [1] * 8, "small_step": [128], "many_heads": [1] * 32}


@pytest.mark.parametrize("first", sorted(_FWD_SHAPES))
def test_precompiling_one_forward_config_registers_the_others(first, device, monkeypatch):
    """The warm-up compiles the forward's whole table from whichever configuration its
    launch chose; each variant must carry the key a real launch of that configuration
    builds, options in the same order (on the GPU box a ``maxnreg`` appended after
    ``num_warps`` made the small-step variant compile again while serving)."""
    from vllm.model_executor.layers.mamba.ops import causal_conv1d as cc

    launcher = cc._LAUNCH_FWD
    monkeypatch.setattr(launcher, "seen", set())
    monkeypatch.setattr(launcher, "cache", {})
    cc.clear_host_caches()
    names = {n: cc._fwd_config_name(sum(ls), len(ls)) for n, ls in _FWD_SHAPES.items()}
    assert names == {n: n for n in _FWD_SHAPES}, names
    with precompile():
        cc.causal_conv1d_fn(*_fwd_args(_FWD_SHAPES[first], device))
    misses = launcher.misses
    for lengths in _FWD_SHAPES.values():
        cc.causal_conv1d_fn(*_fwd_args(lengths, device))
    assert launcher.misses == misses, "a forward configuration missed by the precompile"


def test_dummy_steps_fit_the_limits():
    for seqs, tokens in [(1, 1), (1, 4), (2, 2), (3, 3), (3, 5), (8, 8), (256, 8192)]:
        steps = dummy_steps(seqs, tokens)
        assert any(rows == [(1, True)] for rows in steps)
        for rows in steps:
            assert len(rows) <= seqs and sum(n for n, _ in rows) <= tokens
        mixed = steps[-1]
        assert any(n > 1 or not init for n, init in mixed), "no prefill row"
        if seqs >= 2 and tokens >= 3:
            assert any(n == 1 and init for n, init in mixed), "no decode beside the prefill"


def test_launcher_key_ignores_unspecialised_ints():
    """``do_not_specialize`` ints (the forward's token count) do not split the key; others
    (its feature count) do, by Triton's classes (1, multiple of 16, other)."""
    from vllm.model_executor.layers.mamba.ops import causal_conv1d as cc

    launcher = cc._LAUNCH_FWD
    names = cc._causal_conv1d_fwd_kernel.arg_names
    i_tokens, i_dim = names.index("num_tokens"), names.index("dim")
    assert i_tokens in launcher._plain and i_dim not in launcher._plain

    def key(pos: int, value: int):
        args = [0] * (i_dim + 1)
        args[pos] = value
        return launcher.key(tuple(args), {})

    assert key(i_tokens, 1) == key(i_tokens, 16) == key(i_tokens, 17)
    assert len({key(i_dim, 1), key(i_dim, 16), key(i_dim, 17)}) == 3
    assert key(i_dim, 17) == key(i_dim, 19)


def test_ssm_cache_dtype():
    llm = LLM(
        CONFIG,
        load_format="dummy",
        dtype="float32",
        device="cpu",
        max_num_seqs=2,
        max_num_batched_tokens=8,
        mamba_ssm_cache_dtype="bfloat16",
    )
    assert llm.engine.runner.pool.ssm_state.dtype == torch.bfloat16
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype"):
        LLM(CONFIG, load_format="dummy", device="cpu", mamba_ssm_cache_dtype="int8")


_CHILD = textwrap.dedent(
    """
    import json, random, sys, time
    t_start = time.perf_counter()
    import torch
    from triton import knobs
    compiles = []
    def hook(*args, **kwargs):
        compiles.append(kwargs.get("repr") or "?")
        return False
    knobs.runtime.jit_post_compile_hook = hook
    from tests.utils import serve_random_workload
    from vllm import LLM
    from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig
    cfg = Mamba2ModelConfig(vocab_size=512, hidden_size=256, num_hidden_layers=3, num_heads=8,
                            head_dim=64, state_size=128, n_groups=2, chunk_size=64)
    llm = LLM(cfg, load_format="dummy", dtype="bfloat16", device="cuda", max_num_seqs=24,
              max_num_batched_tokens=256)
    at_start = len(compiles)
    served = serve_random_workload(llm, seed=1, waves=4, max_len=700, vocab=512)
    s = llm.engine.startup
    print(json.dumps({"startup": len(compiles[:at_start]), "after": compiles[at_start:],
                      "served": served, "startup_s": s["total_s"], "compile_s": s["compile_s"],
                      "variants": list(s["kernel_variants"]),
                      "finished": s["kernel_finished_s"]}))
    """
)


@pytest.mark.gpu
def test_no_compile_after_startup_gpu(tmp_path):
    """A fresh process, an empty Triton cache: every compile happens during start-up."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton_cache"))
    env.pop("TRITON_INTERPRET", None)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, cwd=root, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["served"] > 0
    assert res["startup"] > 0, "start-up compiled nothing: was the cache really empty?"
    assert res["after"] == [], f"compiled after start-up: {res['after']}"
    # Every kernel compiled (a cold cache) has its finishing time, within the compiling.
    assert sorted(res["finished"]) == sorted(res["variants"])
    assert 0 < max(res["finished"].values()) <= res["compile_s"]
