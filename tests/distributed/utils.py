"""Running a test function on several ranks: one spawned process per rank, each joined to
a real torch.distributed group (gloo on CPU, NCCL on GPUs), with a bound on the run; the
tiny Mamba2 the sharded-model tests compare across ranks and their tolerance; the check
that LLM.generate at TP=2 equals TP=1, whose engine's ranks then run the model's other
two-rank checks (one spawn of the group serves them all)."""

from __future__ import annotations

import os
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.models.hybrid_utils import engine, tokens
from vllm import SamplingParams
from vllm.distributed import get_tp_group, parallel_state
from vllm.executor.tp_process import join_store, open_store
from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig

# Tests bound their collectives well below pytest's timeout, so a bug fails, not hangs.
COLLECTIVE_TIMEOUT_S = 30.0
RUN_TIMEOUT_S = 90.0
# Sharded against whole: fp32, the reductions' order the only difference.
TOL = dict(atol=1e-5, rtol=1e-5)
GPU2_SKIP_REASON = (
    "needs 2 CUDA GPUs: gpu_check's tp step runs these on a 2-GPU machine (docs/tensor_parallel.md)"
)


def set_multicast_off() -> None:
    """NVLink multicast off for NCCL and PyTorch (the GPU hosts are shared)."""
    os.environ.update(parallel_state.MULTICAST_OFF_ENV)


def _rank_main(rank, fn, world_size, backend, port, args) -> None:
    if backend == "nccl":
        set_multicast_off()
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 comparisons at 1e-5
    torch.set_num_threads(1)  # two ranks share the CI machine's cores
    store = join_store(port, world_size, COLLECTIVE_TIMEOUT_S)
    parallel_state.init_distributed(
        world_size, rank, backend, timeout_s=COLLECTIVE_TIMEOUT_S, store=store
    )
    try:
        fn(*args)
    finally:
        parallel_state.destroy()


def run_ranks(fn, *args, world_size: int = 2, backend: str = "gloo") -> None:
    """``fn(*args)`` on every rank of a fresh ``world_size``-rank group; a rank's exception
    (an assertion) is re-raised here with its traceback. ``fn`` must be a module-level
    function (it is pickled by name into the spawned processes)."""
    if backend == "nccl":
        set_multicast_off()
    store = open_store(world_size, COLLECTIVE_TIMEOUT_S)  # held here until the ranks end
    ctx = mp.start_processes(
        _rank_main,
        args=(fn, world_size, backend, store.port, args),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"{fn.__name__} did not finish on {world_size} ranks")


def dummy_config(n_groups: int) -> Mamba2ModelConfig:
    return Mamba2ModelConfig(
        vocab_size=100,  # not a multiple of 64: the sharded table pads, TP=1's does not
        hidden_size=32,
        num_hidden_layers=2,
        num_heads=8,
        head_dim=8,
        state_size=8,
        n_groups=n_groups,
        chunk_size=4,
        tie_word_embeddings=True,
    )


def _on_every_rank(worker, fn, *args) -> None:
    """``Executor.apply`` target: ``fn(*args)`` on this rank; every rank's failure (a
    rank 1 assertion too, which the executor would not see once rank 0 has returned) is
    gathered and raised on rank 0."""
    tp = get_tp_group()
    try:
        fn(*args)
        failure = None
    except Exception:
        failure = traceback.format_exc()
    failures = [None] * tp.world_size
    dist.all_gather_object(failures, failure, group=tp.cpu_group)
    failed = [f"rank {r}:\n{f}" for r, f in enumerate(failures) if f is not None]
    if tp.rank == 0 and failed:
        raise AssertionError("\n".join(failed))


def check_generate_two_ranks_equals_one_rank(path, *rank_checks) -> None:
    """Greedy tokens of ``LLM.generate`` at tensor_parallel_size=2 equal one rank's; then
    each ``(fn, *args)`` of ``rank_checks`` runs on both ranks of that same TP=2 engine
    (its processes, its joined group), as ``run_ranks`` would run it on a group of its own.
    ``fn`` is a module-level function; it may load any checkpoint (``get_model``)."""
    prompts = [tokens(n, "P", n) for n in (3, 11, 7)]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    one = [o.outputs[0].token_ids for o in engine(path).generate(prompts, params)]
    llm = engine(path, tensor_parallel_size=2)
    try:
        two = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert two == one
        for fn, *args in rank_checks:
            llm.engine.core.engine_core.executor.apply(_on_every_rank, fn, *args)
    finally:
        llm.engine.core.shutdown()
