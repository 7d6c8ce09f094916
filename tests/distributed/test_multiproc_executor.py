"""MultiprocExecutor on two gloo ranks: a sharded MLP driven step by step equals the
unsharded one; a worker that raises, is killed mid-step or between steps, or fails to
build makes the driver raise WorkerFailedError naming the rank and the cause, within
seconds; a configuration that does not shard fails before any process starts."""

from __future__ import annotations

import functools
import multiprocessing
import os
import re
import signal
import socket
import time
import traceback

import pytest
import torch
import torch.nn.functional as F

from tests.distributed.utils import GPU2_SKIP_REASON, set_multicast_off
from vllm.distributed import (
    get_tp_group,
    is_initialized,
    parallel_state,
    tensor_model_parallel_all_reduce,
)
from vllm.executor import MultiprocExecutor, WorkerFailedError, check_tp_divisibility
from vllm.executor.tp_process import STORE_HOST, open_store
from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from vllm.model_executor.models.bamba_config import BambaModelConfig
from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig
from vllm.model_executor.models.nemotron_h_config import NemotronHModelConfig
from vllm.model_executor.models.zamba2_config import Zamba2ModelConfig

TIMEOUT_S = 30.0  # every collective; a failure must surface far sooner
FAST = 15.0  # seconds within which a failure must be reported


def _mlp_weights():
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(8, 4, generator=g),
        torch.randn(4, 8, generator=g),
        torch.randn(4, generator=g),
    )


class MLPWorker:
    """A column- then row-parallel MLP over the group, built from the full weights."""

    def __init__(self, fail_rank: int | None = None, fail_how: str | None = None):
        tp = get_tp_group()
        self.rank, self.device = tp.rank, tp.device
        self.fail_rank, self.fail_how = fail_rank, fail_how
        w1, w2, b2 = _mlp_weights()
        with torch.device(self.device):
            self.up = ColumnParallelLinear(4, 8, bias=False)
            self.down = RowParallelLinear(8, 4)
        self.up.weight.weight_loader(self.up.weight, w1)
        self.down.weight.weight_loader(self.down.weight, w2)
        self.down.bias.weight_loader(self.down.bias, b2)
        if fail_how == "build" and self.rank == fail_rank:
            raise RuntimeError("no weights on this rank")
        if fail_how == "build_hang" and self.rank == fail_rank:
            time.sleep(600)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, step: int) -> tuple[int, torch.Tensor]:
        if step == 2 and self.rank == self.fail_rank:
            if self.fail_how == "raise":
                raise ValueError(f"bad input at step {step}")
            if self.fail_how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.fail_how == "hang":
                time.sleep(600)
        y = self.down(F.relu(self.up(x.to(self.device))))
        return self.rank, y.cpu()

    def rank_sum(self) -> float:
        one = torch.tensor([self.rank + 1.0], device=self.device)  # NCCL's path on GPUs
        return tensor_model_parallel_all_reduce(one).item()


def _reference(x):
    w1, w2, b2 = _mlp_weights()
    return F.linear(F.relu(F.linear(x, w1)), w2, b2)


@pytest.fixture(autouse=True)
def no_leftovers():
    yield
    assert not is_initialized(), "the executor left this process in a group"
    assert not multiprocessing.active_children(), "worker processes outlived the test"


def _executor(factory=MLPWorker, backend="gloo", **kw) -> MultiprocExecutor:
    return MultiprocExecutor(2, factory, backend=backend, timeout_s=TIMEOUT_S, **kw)


def _steps_then_kill_between_steps(backend: str) -> None:
    with _executor(backend=backend) as ex:
        with socket.socket() as probe, pytest.raises(OSError):  # rank 0's store holds it
            probe.bind((STORE_HOST, ex._store.port))
        assert ex.run("rank_sum") == 3.0
        for step in range(3):
            x = torch.randn(5, 4)
            rank, y = ex.run("forward", x, step)
            assert rank == 0
            torch.testing.assert_close(y, _reference(x), atol=1e-5, rtol=1e-5)
        with pytest.raises(AttributeError, match="MLPWorker has no method 'nope'"):
            ex.run("nope")
        assert ex.run("rank_sum") == 3.0, "an unknown method must not break the executor"
        (pid,) = ex.worker_pids.values()
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerFailedError, match="rank 1 was killed by SIGKILL"):
            ex.run("rank_sum")  # noticed before the call, or when its all-reduce breaks
        assert time.monotonic() - t0 < FAST
        with pytest.raises(RuntimeError, match="has failed before"):
            ex.run("rank_sum")


@pytest.mark.timeout(90)
def test_steps_equal_unsharded_then_a_killed_worker_is_reported():
    _steps_then_kill_between_steps("gloo")


MID_STEP = {
    "raises": ("raise", r"rank 1 raised ValueError: bad input at step 2"),
    "killed_mid_step": ("kill", r"rank 1 was killed by SIGKILL \(exit code -9\)"),
}


def _fail_mid_step(how: str, match: str, backend: str) -> None:
    factory = functools.partial(MLPWorker, fail_rank=1, fail_how=how)
    with _executor(factory, backend=backend) as ex:
        x = torch.randn(3, 4)
        ex.run("forward", x, 0)
        ex.run("forward", x, 1)
        t0 = time.monotonic()
        with pytest.raises(WorkerFailedError, match=match) as info:
            ex.run("forward", x, 2)  # rank 0's all-reduce waits on the dead rank
        assert time.monotonic() - t0 < FAST
        assert info.value.rank == 1
        if how == "raise":
            assert "in forward" in info.value.worker_traceback
            assert "--- worker rank 1 traceback ---" in str(info.value)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", list(MID_STEP))
def test_a_worker_failing_mid_step_is_a_clear_error(case):
    _fail_mid_step(*MID_STEP[case], backend="gloo")


@pytest.mark.timeout(90)
def test_a_stuck_worker_times_out_instead_of_hanging():
    factory = functools.partial(MLPWorker, fail_rank=1, fail_how="hang")
    ex = MultiprocExecutor(2, factory, backend="gloo", timeout_s=3.0, grace_s=1.0)
    with ex:
        x = torch.randn(3, 4)
        ex.run("forward", x, 0)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            ex.run("forward", x, 2)  # rank 1 sleeps: rank 0's all-reduce times out
        assert 3.0 <= time.monotonic() - t0 < FAST
        assert "every worker process was alive" in "".join(info.value.__notes__)
    # (the fixture checks that the stuck worker was stopped)


@pytest.mark.timeout(90)
def test_a_worker_that_fails_to_build_fails_the_start():
    t0 = time.monotonic()
    factory = functools.partial(MLPWorker, fail_rank=1, fail_how="build")
    with pytest.raises(WorkerFailedError, match="rank 1 raised RuntimeError: no weights"):
        _executor(factory)
    assert time.monotonic() - t0 < FAST + 10  # two interpreters start first


@pytest.mark.timeout(90)
def test_a_start_that_hangs_says_where_each_rank_was(capfd):
    """Rank 1 never finishes building: the start-up fails after timeout_s naming its stage,
    with rank 1's stack (faulthandler) on stderr."""
    factory = functools.partial(MLPWorker, fail_rank=1, fail_how="build_hang")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        MultiprocExecutor(2, factory, backend="gloo", timeout_s=3.0, grace_s=1.0)
    assert 3.0 <= time.monotonic() - t0 < FAST + 10
    message = str(info.value)
    assert re.search(
        r"workers \[1\] did not start .* rank 1 \(pid \d+\): building its worker \(reached", message
    ), message
    err = capfd.readouterr().err
    assert "in __init__" in err and "test_multiproc_executor.py" in err, err[-2000:]


def _arrive_late(delay_s: float):
    time.sleep(delay_s)  # runs in the worker while its arguments are unpickled, at start
    return MLPWorker


class LateFactory:
    """MLPWorker, but a worker process that unpickles it starts ``delay_s`` late (a slow
    interpreter start or import on a loaded machine)."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s

    def __call__(self) -> MLPWorker:  # rank 0's, in this process
        return MLPWorker()

    def __reduce__(self):
        return _arrive_late, (self.delay_s,)


@pytest.mark.timeout(90)
def test_a_worker_slower_to_start_than_the_timeout_still_joins():
    """The collectives' timeout (3 s) does not bound the workers' start: rank 0 joins the
    group once rank 1 has reached it, 4 s late."""
    t0 = time.monotonic()
    with MultiprocExecutor(2, LateFactory(4.0), backend="gloo", timeout_s=3.0) as ex:
        assert time.monotonic() - t0 >= 4.0
        x = torch.randn(5, 4)
        torch.testing.assert_close(ex.run("forward", x, 0)[1], _reference(x))


@pytest.mark.timeout(90)
def test_a_failed_join_does_not_break_the_next_start():
    """A rank 0 whose join failed (its peer never came) left torch's count of unnamed
    groups advanced: the next start's rank 0 waited on other store keys than its fresh
    worker, both until the timeout (CI, stop 43). The next start works and steps."""
    store = open_store(2, 1.0)
    with pytest.raises(RuntimeError):  # DistStoreError: nobody else joins
        parallel_state.init_distributed(2, 0, "gloo", None, 1.0, store=store)
    assert not is_initialized()
    del store
    with _executor() as ex:
        x = torch.randn(5, 4)
        torch.testing.assert_close(ex.run("forward", x, 1)[1], _reference(x))


@pytest.mark.parametrize("user", [None, "eth9"])
def test_gloo_goes_over_loopback_only_while_a_local_group_is_made(monkeypatch, user):
    if user is None:
        monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    else:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", user)
    with parallel_state._gloo_on_loopback(True):
        assert os.environ.get("GLOO_SOCKET_IFNAME") == (user or "lo")
    with parallel_state._gloo_on_loopback(False):
        assert os.environ.get("GLOO_SOCKET_IFNAME") == user
    assert os.environ.get("GLOO_SOCKET_IFNAME") == user


def test_a_config_that_does_not_shard_fails_before_any_process_starts():
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=3 .* num_heads=128 is not divisible"
    ):
        MultiprocExecutor(3, MLPWorker, config=Mamba2ModelConfig(), backend="gloo")
    assert not multiprocessing.active_children()
    with pytest.raises(ValueError, match="worker_factory must be picklable"):
        MultiprocExecutor(2, lambda: None, backend="gloo")
    assert not multiprocessing.active_children()
    check_tp_divisibility(Mamba2ModelConfig(), 2)  # 128 heads, 8 groups: fine


BAMBA_LIKE = dict(
    vocab_size=64,
    hidden_size=256,
    mamba_n_heads=128,
    mamba_d_head=4,
    mamba_n_groups=1,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
)


def _mamba2(**kw):
    return Mamba2ModelConfig(**{"hidden_size": kw["num_heads"] * 8, "head_dim": 16, **kw})


def _zamba2(**kw):
    return Zamba2ModelConfig(**{"hidden_size": 96, "n_mamba_heads": 6, **kw})


@pytest.mark.parametrize(
    "config, tp, match",
    [
        (lambda: _mamba2(num_heads=128, n_groups=8), 16, None),
        (lambda: _mamba2(num_heads=128, n_groups=1), 8, None),  # one group on 8 ranks
        (lambda: _mamba2(num_heads=24, n_groups=3), 2, "n_groups=3 neither divides tp_size=2"),
        (lambda: BambaModelConfig(**BAMBA_LIKE), 4, None),
        (lambda: _zamba2(num_attention_heads=32), 4, "n_mamba_heads=6 is not divisible"),
        (
            lambda: _zamba2(num_attention_heads=48, num_key_value_heads=3, n_mamba_heads=8),
            4,
            "num_key_value_heads=3 is fewer",
        ),
        (
            lambda: BambaModelConfig(**BAMBA_LIKE),
            3,
            "BambaModelConfig\\): mamba_n_heads=128 .*num_attention_heads=32 .*"
            "num_key_value_heads=8 .*intermediate_size=14336",
        ),
        (
            lambda: NemotronHModelConfig(num_key_value_heads=12, num_attention_heads=48),
            8,
            "num_key_value_heads=12 is not",
        ),
        (lambda: _zamba2(intermediate_size=100, n_mamba_heads=8), 8, "intermediate_size=100"),
    ],
    ids=[
        "mamba2_tp16",
        "one_group_tp8",
        "groups_3",
        "bamba_like",
        "zamba2_heads",
        "kv_3",
        "bamba_every_field",
        "kv_12",
        "mlp",
    ],
)
def test_check_tp_divisibility_names_the_field(config, tp, match):
    config = config()
    if match is None:
        check_tp_divisibility(config, tp)
        config.check_tp(tp)
    else:
        with pytest.raises(ValueError, match=match):
            check_tp_divisibility(config, tp)


def test_check_tp_refuses_a_bad_size_and_a_foreign_config():
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        check_tp_divisibility(Mamba2ModelConfig(), 0)
    with pytest.raises(TypeError, match="not a registered model config: dict"):
        check_tp_divisibility({"num_heads": 8}, 2)


def _nccl_scenarios(results) -> None:
    try:
        set_multicast_off()
        _steps_then_kill_between_steps("nccl")
        for case in MID_STEP:
            _fail_mid_step(*MID_STEP[case], backend="nccl")
        results.put("ok")
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put(traceback.format_exc())


@pytest.mark.gpu
@pytest.mark.timeout(180)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=GPU2_SKIP_REASON)
def test_nccl_worker_failures_are_reported():
    """Under NCCL a dead peer does not break the driver's collective at once: the liveness
    poll while rank 0 waits reports it. Run in a child process of its own, because NCCL's
    watchdog may still end a process whose collective lost its peer (not yet run on a
    2-GPU machine)."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_nccl_scenarios, args=(results,))
    child.start()
    try:
        outcome = results.get(timeout=150)
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join()
    assert outcome == "ok", outcome
