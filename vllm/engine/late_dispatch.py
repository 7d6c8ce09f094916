"""Late dispatch: under async scheduling, wait for new requests until just before the
device finishes the step it runs, then schedule the next one (``--late-dispatch``, on by
default with async scheduling; ``--no-late-dispatch``).

Async scheduling dispatches step k+1 while the device runs step k, so the device never
waits for the host. The engine loop schedules k+1 as soon as it has read step k-1, that is
when step k starts on the device; a request arriving while k runs then waits for k+1 to
run before its prefill can: one step more of time to first token than without async
scheduling (a decode step of a 7B model on the H200 is ~7 ms). With late dispatch the loop
waits for messages until ``deadline()``: the moment step k is expected to end, less the
host time the next schedule and dispatch take and a margin. A request that arrives in the
wait is scheduled at once, into step k+1; if none comes, k+1 is dispatched at the deadline,
still before k ends, so the device keeps running back to back.

Step k's end is estimated from k-1's measured device span where k and k-1 are both
decode-only and k has no more rows than k-1; otherwise (k carries prompt tokens, k-1 did,
or k is wider) from the engine's fitted step times (``step_budget.StepTimes``: t_dec(D)
plus the prompt tokens' fitted cost), taken at ``MODEL_SHARE`` of their value: an
estimate too short only shortens the wait, one too long would leave the device idle. So
a request arriving while a step with a prompt chunk runs also joins the very next step.
Both need device spans (CUDA events: on a CPU device, or without them, nothing is
estimated and the loop never waits). Nothing is waited for when no new request could
join k+1 (one is waiting already, or every sequence slot or the token budget is taken).
A wrong estimate costs a gap on the device of at most its error: the deadline is a
floor, never a wait on the device.

The loops that run the core (``core_proc._serve``, ``InprocClient.wait_for_output``) wait
on their message queues with the deadline as timeout and report the time spent so
(``late_wait_s``) and the requests that arrived in it (``late_arrivals``) with the step.
"""

from __future__ import annotations

import time

# The host time of the next schedule and dispatch, estimated as this many times the last
# one's, plus this margin, is left before the device is expected to be done.
HOST_FACTOR = 2.0
MARGIN_S = 0.5e-3
# The share of a fitted step time the wait may use (a model's estimate, not a measurement).
MODEL_SHARE = 0.9


def step_end_estimate(in_flight, last_read, read_done_at: float | None,
                      times=None) -> float | None:  # fmt: skip
    """When the in-flight step should end (perf_counter clock), or None where that cannot
    be told: from the last step's device span where both are decode-only and the
    in-flight one is no wider, else from ``times`` (``StepTimes``) fitted to device
    spans, at ``MODEL_SHARE``."""
    if in_flight is None or read_done_at is None:
        return None
    if (
        last_read is not None
        and not (in_flight.num_prefill_tokens or last_read.num_prefill_tokens)
        and len(in_flight.seqs) <= len(last_read.seqs)
        and last_read.output is not None
        and last_read.output.device_s is not None
    ):
        return read_done_at + last_read.output.device_s
    if times is None or not times.on_device:
        return None
    t = times.step_time(in_flight.num_decode_tokens, in_flight.num_prefill_tokens)
    return None if t is None else read_done_at + MODEL_SHARE * t


def can_admit(scheduler) -> bool:
    """Whether a request arriving now could join the next step: nothing is queued before
    it, a sequence slot is free and the token budget is not taken by the decodes."""
    if scheduler.waiting or scheduler.slots.num_free == 0:
        return False
    return len(scheduler.running) < scheduler.max_num_batched_tokens


def deadline(core, now: float | None = None) -> float | None:
    """Until when the loop may wait for requests before ``core.step()``; None: step now."""
    config = core.config
    if not (config.late_dispatch and config.async_scheduling):
        return None
    end = step_end_estimate(core._in_flight, core._last_read, core._read_done_at,
                            core.step_times)  # fmt: skip
    if end is None or not can_admit(core.scheduler):
        return None
    last = core.last_step
    at = end - HOST_FACTOR * (last.schedule_s + last.dispatch_s) - MARGIN_S
    now = time.perf_counter() if now is None else now
    return at if at > now else None
