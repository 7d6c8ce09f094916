"""benchmark_throughput.py's ``--profile``: a short generation run one engine step at a
time under ``torch.profiler``, each step named by its kind (mixed, decode, or decode_graph
when its batch replays a CUDA graph) and split by ``step_profile.py``."""

from __future__ import annotations

import time

from benchmarks.common.step_profile import kernel_records, summarize

PROFILE_PREFIX = "engine:"


def profile_engine(llm, requests, args) -> dict:
    """Profile a short generation step by step (see the module docstring); the
    ``step_profile`` summary per step kind: mixed, decode (eager) or decode_graph."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from vllm import SamplingParams

    engine, runner = llm.engine, llm.engine.runner
    on_cuda = runner.device.type == "cuda"
    n = min(args.profile_prompts or len(requests), args.max_num_seqs, len(requests))
    params = SamplingParams(max_tokens=args.profile_decode_steps + 1, ignore_eos=True)
    for i, (ids, _) in enumerate(requests[:n]):
        engine.add_request(f"profile-{i}", ids[: args.profile_prompt_len], params)

    # The kind of a step is known once the scheduler has made its batch: the executor's
    # execute_model is wrapped, for this run only, to note it from the step's inputs.
    kinds: list[str] = []
    executor = engine.engine_core.executor
    execute = executor.execute_model

    def noting_execute(inputs):
        num_seqs = len(inputs.lens)
        if inputs.num_decodes < num_seqs:
            kinds.append("mixed")
        elif runner.graphs is not None and runner.graphs.fits(num_seqs):
            kinds.append("decode_graph")
        else:
            kinds.append("decode")
        return execute(inputs)

    executor.execute_model = noting_execute
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    walls = {}
    # One engine step per profiled step: without async scheduling a step reads its own
    # tokens, so each step's time (and its host part) is its own.
    async_scheduling, engine.config.async_scheduling = engine.config.async_scheduling, False
    try:
        with profile(activities=activities) as prof:
            while engine.has_unfinished_requests():
                name = f"{PROFILE_PREFIX}#{len(walls)}"
                t0 = time.perf_counter()
                with record_function(name):
                    engine.step()  # ends in a host sync: the sampled tokens
                    if on_cuda:
                        torch.cuda.synchronize()
                walls[name] = (time.perf_counter() - t0) * 1e3
    finally:
        del executor.execute_model
        engine.config.async_scheduling = async_scheduling
    steps = {name: (kind, wall) for (name, wall), kind in zip(walls.items(), kinds, strict=True)}
    records = kernel_records(prof.events(), PROFILE_PREFIX, on_cuda)
    summary = summarize(records, steps, PROFILE_PREFIX, graphed_kinds=("decode_graph",))
    summary["_requests"] = {"prompts": n, "prompt_len_max": args.profile_prompt_len}
    return summary
