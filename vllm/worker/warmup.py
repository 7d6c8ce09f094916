"""Start-up warm-up: every Triton kernel variant compiled before the first request.

A kernel's compiled variant depends on its constexprs and launch options (chosen per step
by each launch site's rule from its configuration table) and on the arguments' dtypes,
alignments and integer classes (fixed by the model: the ints that change from step to step
are ``do_not_specialize``). So one run of the model through each launch site, inside
``vllm.triton_utils.launch.precompile``, compiles every variant any step can select: each
launch site hands over its whole table, and nothing runs on the device meanwhile. The
dummy steps below reach every launch site of a step (the decode-only conv, the decode
state update, the prefill conv and scan, continuations and fresh prompts); which of them
fit is decided by the engine's limits.

Then one dummy step runs for real (as vLLM's profile run: any launch failure shows at
start-up, and lazy library initialisation happens here), and the state lines it used are
zeroed again. CUDA graphs of decode-only steps are captured afterwards by the runner.
The dummy steps go through the runner's own step path (``ModelRunner.dummy_step``), so
attention layers see the same metadata and KV cache a real step gives them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm.triton_utils.launch import PrecompileReport, precompile


def dummy_steps(max_num_seqs: int, max_num_batched_tokens: int) -> list[list[tuple[int, bool]]]:
    """Steps as (tokens, has_initial_state) rows, within the limits, that together reach
    every launch site of the model: decode-only steps of one and of two sequences (a
    batch of one has size-1 views whose strides PyTorch may report otherwise, and Triton
    keys its variants on them), and a step with a decode, a chunked-prefill continuation
    and a fresh prompt (the rows that fit; with one slot, a fresh prompt alone). The mixed
    step comes last: it is the one run for real."""
    rows: list[tuple[int, bool]] = []
    budget, slots = max_num_batched_tokens, max_num_seqs
    if slots >= 2:
        rows.append((1, True))  # a decode
        budget, slots = budget - 1, slots - 1
    fresh = min(2, budget)  # budget >= 1 here: max_num_batched_tokens >= max_num_seqs
    budget, slots = budget - fresh, slots - 1
    if slots >= 1 and budget >= 2:
        rows.append((2, True))  # a chunked-prefill continuation (one token would decode)
    rows.append((fresh, False))
    decodes = [[(1, True)]] + ([[(1, True), (1, True)]] if max_num_seqs >= 2 else [])
    return [*decodes, rows]


@torch.no_grad()
def compile_kernels(
    run_step: Callable[[list[tuple[int, bool]]], torch.Tensor],
    zero_state: Callable[[int], None],
    max_num_seqs: int,
    max_num_batched_tokens: int,
    device: torch.device,
) -> PrecompileReport:
    """Compile every kernel variant a step within the limits can select, then run one
    dummy step for real; leaves the state lines it used as it found them (zeros).

    ``run_step(rows)`` runs one forward over (tokens, has_initial_state) rows in state
    slots 1 .. len(rows) (the runner's dummy step: its metadata, its forward context);
    ``zero_state(n)`` zeroes the first n state slots.
    """
    steps = dummy_steps(max_num_seqs, max_num_batched_tokens)
    used = max(len(rows) for rows in steps)
    with precompile() as report:
        for rows in steps:
            run_step(rows)
    # No kernel ran in there, but PyTorch code (the CPU scan) may have written its
    # garbage into the slots: the real step starts from zeros.
    zero_state(used)
    run_step(steps[-1])
    if device.type == "cuda":
        torch.cuda.synchronize()
    zero_state(used)
    return report
