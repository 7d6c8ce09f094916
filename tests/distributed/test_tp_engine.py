"""The engine over two tensor-parallel ranks (CPU, gloo): ``LLM(..., tensor_parallel_size=2)``
gives the greedy tokens of one rank for a tiny Mamba2 (n_groups 1 and 2) through
``LLM.generate``; a config that does not shard is refused before any process starts, and
so is a model class without ``supports_tensor_parallel`` (every registered one has it: the
check is run on a plain class); a killed worker fails every request with an error
naming it, instead of hanging, and the engine then refuses new requests."""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import time

import pytest
import torch

from tests.distributed.utils import GPU2_SKIP_REASON
from tests.tiny_model import make_tiny_model_dir
from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.model_loader.loader import check_tensor_parallel_support
from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig

# Small limits: prompts longer than the token budget are prefilled in chunks, next to
# other sequences' decodes (mixed steps).
ENGINE = dict(device="cpu", max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
PROMPTS = [[5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61, 65, 69, 73], [7, 3], [11]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _check_equals_one_rank(llm: LLM, expected, async_scheduling: bool) -> None:
    """Under async scheduling the decode rows' input tokens are the previous step's, which
    rank 0 broadcasts on the device; without it they come in the inputs."""
    assert llm.engine.engine_core.executor.world_size == 2
    assert llm.engine.config.async_scheduling is async_scheduling
    # Rank 0's pool: 4 of the 8 heads; conv over their x and one group's B, C (its
    # own of 2 groups, or the 1 group replicated).
    pool = llm.engine.runner.pool
    assert pool.ssm_state.shape[2] == 4
    assert pool.conv_state.shape[2] == 4 * 16 + 2 * 16
    assert _tokens(llm) == expected


# (2 groups, async scheduling) runs in the killed-worker test below, before the kill: one
# TP=2 engine for both.
@pytest.mark.parametrize(
    "n_groups, async_scheduling", [(1, True), (2, False)], ids=lambda v: str(v)
)
def test_two_ranks_generate_the_tokens_of_one_rank(tmp_path, n_groups, async_scheduling):
    model_dir = str(make_tiny_model_dir(tmp_path / "tiny", n_groups=n_groups))
    expected = _tokens(LLM(model_dir, **ENGINE))
    llm = LLM(model_dir, tensor_parallel_size=2, async_scheduling=async_scheduling, **ENGINE)
    try:
        _check_equals_one_rank(llm, expected, async_scheduling)
    finally:
        llm.engine.core.shutdown()


def test_configs_that_do_not_shard_are_refused_before_any_process(tmp_path):
    before = set(multiprocessing.active_children())
    odd = Mamba2ModelConfig(
        vocab_size=64, hidden_size=24, num_hidden_layers=1, num_heads=6, head_dim=8, n_groups=3
    )
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not fit.*num_heads=6"):
        LLM(odd, load_format="dummy", tensor_parallel_size=4, **ENGINE)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        LLM(odd, load_format="dummy", tensor_parallel_size=0, **ENGINE)
    assert set(multiprocessing.active_children()) == before


def test_a_model_class_without_tensor_parallelism_is_refused():
    check_tensor_parallel_support(type("Plain", (), {}), 1)
    with pytest.raises(ValueError, match="Plain does not support tensor parallelism"):
        check_tensor_parallel_support(type("Plain", (), {}), 2)


def test_the_cli_takes_the_tensor_parallel_size():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    parser.add_argument("model")
    parse = lambda *argv: EngineArgs.from_cli_args(parser.parse_args(["m", *argv]))  # noqa: E731
    assert parse("-tp", "2").tensor_parallel_size == 2
    assert parse("--tensor-parallel-size", "4").tensor_parallel_size == 4
    assert parse().tensor_parallel_size == 1


def test_a_killed_worker_fails_the_engine_instead_of_hanging(tmp_path):
    """First, alive: the greedy tokens of one rank (2 groups, async scheduling)."""
    model_dir = str(make_tiny_model_dir(tmp_path / "tiny", n_groups=2))
    expected = _tokens(LLM(model_dir, **ENGINE))
    llm = LLM(model_dir, tensor_parallel_size=2, async_scheduling=True, **ENGINE)
    try:
        _check_equals_one_rank(llm, expected, True)
        [pid] = llm.engine.engine_core.executor.worker_pids.values()
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert time.monotonic() - t0 < 30
        for out in outs:
            assert out.outputs[0].finish_reason == "error"
            assert "tensor-parallel worker rank 1 was killed by SIGKILL" in out.error
        with pytest.raises(RuntimeError, match="the engine has failed"):
            llm.generate([[1, 2]], GREEDY, use_tqdm=False)
    finally:
        llm.engine.core.shutdown()


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=GPU2_SKIP_REASON)
def test_two_gpus_generate_the_tokens_of_one_gpu(tmp_path):
    """NCCL, one process per GPU, CUDA-graph decode captured on each rank (not yet run on
    a 2-GPU machine)."""
    model_dir = str(make_tiny_model_dir(tmp_path / "tiny", n_groups=1))
    gpu = dict(ENGINE, device="cuda")
    expected = _tokens(LLM(model_dir, **gpu))
    llm = LLM(model_dir, tensor_parallel_size=2, **gpu)
    try:
        assert llm.engine.runner.graphs is not None
        assert _tokens(llm) == expected
    finally:
        llm.engine.core.shutdown()
