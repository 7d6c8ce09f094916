"""The engine core in its own process (``vllm/engine/core_proc.py``, AsyncLLM's default):
its step stats reach the stat loggers; a stop string found on the front end's side ends the
request in the core; an id reused right after its abort gets only its own tokens; a core
process that dies fails every stream and the engine refuses new requests; one that cannot
start says why; shutdown, streams open or not, leaves no process behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

from tests.engine.utils import STREAMS_CONFIG as CONFIG
from tests.engine.utils import STREAMS_OPTS as OPTS
from tests.engine.utils import Records, collect, delta
from tests.engine.utils import run_coro as run
from tests.tiny_model import make_tiny_model_dir
from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.async_llm import AsyncLLM, EngineDeadError

pytestmark = pytest.mark.timeout(600)


def start(stat_loggers=None) -> AsyncLLM:
    return AsyncLLM.from_engine_args(EngineArgs(CONFIG, **OPTS), stat_loggers, True)


@pytest.fixture(scope="module")
def offline():
    return LLM(CONFIG, **OPTS)


def test_steps_and_their_stats_come_from_the_core_process(offline):
    ps = [[1 + i, 2, 3, 4, 5][: 2 + i] for i in range(4)]
    want = [o.outputs[0].token_ids for o in offline.generate(ps, delta(7), False)]
    records = Records()

    async def main():
        engine = start([records])
        assert engine.core.proc.pid != os.getpid()
        got = await asyncio.gather(
            *(collect(engine, f"s{i}", p, delta(7)) for i, p in enumerate(ps))
        )
        await engine.shutdown()
        return got, engine.core.proc.exitcode

    got, exitcode = run(main())
    assert got == want and exitcode == 0
    steps = [r.step for r in records.records if r.step is not None]
    # Every prompt token was computed in a step of the core process, each decode token too
    # (the first token of each request comes from its last prefill step).
    assert sum(s.num_prefill_tokens for s in steps) == sum(map(len, ps))
    assert sum(s.num_decode_tokens for s in steps) == 4 * 6
    # The core's step time, and the output time this process added to the same record.
    assert all(s.total_s > 0 and s.output_s > 0 for s in steps)
    assert sum(r.num_generation_tokens for r in records.records) == 4 * 7
    assert [f.finish_reason for r in records.records for f in r.finished] == ["length"] * 4


def test_a_stop_string_ends_the_request_in_the_core(offline):
    prompt = [7, 8, 9]
    free = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24), False)
    text = free[0].outputs[0].text
    stop = text[5:7]
    params = SamplingParams(temperature=0.0, max_tokens=24, stop=[stop])
    want = offline.generate([prompt], params, False)[0].outputs[0]
    assert want.finish_reason == "stop" and len(want.text) < len(text)

    async def main():
        engine = start()
        outs = [out async for out in engine.generate(prompt, params, "stop")]
        for _ in range(100):  # the abort reaches the core before its next step
            if engine.num_requests_running == 0:
                break
            await asyncio.sleep(0.02)
        running = engine.num_requests_running
        await engine.shutdown()
        return outs[-1].outputs[0], running

    got, running = run(main())
    assert (got.text, got.finish_reason, got.stop_reason) == (want.text, "stop", stop)
    assert running == 0


def test_an_id_reused_after_its_abort_gets_only_its_own_tokens(offline):
    again = [3, 1, 4, 1, 5]
    want = offline.generate([again], delta(6), False)[0].outputs[0].token_ids

    async def main():
        engine = start()
        first = engine.add_request("same", [2, 7, 1], delta(40))
        await first.__anext__()  # it runs in the core
        await engine.abort("same")
        # Its tokens of the steps in flight are still on their way from the core.
        got = await collect(engine, "same", again, delta(6))
        await engine.shutdown()
        return got

    assert run(main()) == want


def test_a_dead_core_process_fails_every_stream():
    async def main():
        engine = start()
        tasks = [asyncio.create_task(collect(engine, f"d{i}", [1, i], delta(60))) for i in range(3)]
        while engine.num_requests_running < 3:
            await asyncio.sleep(0.01)
        os.kill(engine.core.proc.pid, signal.SIGKILL)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "engine core process exited" in str(results[0])
        assert engine.errored
        with pytest.raises(EngineDeadError, match="engine loop died"):
            engine.add_request("late", [1], delta(1))
        await engine.shutdown()

    run(main())


def test_shutdown_with_open_streams_stops_the_core_process():
    """The streams hear of the shutdown, and the core process, stepping when asked to stop,
    exits by itself (status 0: not killed) well within the shutdown's 30 s."""

    async def main():
        engine = start()
        tasks = [asyncio.create_task(collect(engine, f"o{i}", [1, i], delta(60))) for i in range(3)]
        while engine.num_requests_running < 3:
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        await engine.shutdown()
        took = time.monotonic() - t0
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return results, took, engine.core.proc.exitcode

    results, took, exitcode = run(main())
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert "shutting down" in str(results[0])
    assert exitcode == 0 and took < 20


def test_a_core_process_that_cannot_start_says_why(tmp_path):
    """Weights that do not fit their config.json are found where they are loaded, in the
    core process: the caller gets the core's own error (a ValueError that names the weight,
    which ``vllm serve`` prints as one line), not a wrapper around its text."""
    model = make_tiny_model_dir(tmp_path / "tiny")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "state_size": 8}))
    args = EngineArgs(str(model), device="cpu", max_num_seqs=2, max_model_len=64)
    with pytest.raises(ValueError, match="has shape .* in the checkpoint, but the config makes"):
        AsyncLLM.from_engine_args(args, None, True)


def test_tensor_parallel_workers_start_from_the_core_process(tmp_path):
    """The core process is not a daemon, so it may start the ranks' worker processes
    (CPU, gloo): two ranks give the tokens of one, and the core process exits cleanly."""
    model = str(make_tiny_model_dir(tmp_path / "tiny"))
    engine_opts = dict(device="cpu", max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    ps = [[5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61, 65, 69, 73], [7, 3], [11]]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(model, **engine_opts).generate(ps, greedy, False)]

    async def main():
        args = EngineArgs(model, tensor_parallel_size=2, **engine_opts)
        engine = AsyncLLM.from_engine_args(args, None, True)
        got = await asyncio.gather(
            *(collect(engine, f"t{i}", p, delta(6)) for i, p in enumerate(ps))
        )
        await engine.shutdown()
        return got, engine.core.proc.exitcode

    got, exitcode = run(main())
    assert got == want and exitcode == 0
