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
"""

from __future__ import annotations

import torch

from vllm.triton_utils.launch import PrecompileReport, precompile


def dummy_steps(max_num_seqs: int, max_num_batched_tokens: int) -> list[list[tuple[int, bool]]]:
    """Steps as (tokens, has_initial_state) rows, within the limits, that together reach
    every launch site of the model: a decode-only step, and a step with a decode, a
    chunked-prefill continuation and a fresh prompt (the rows that fit; with one slot, a
    fresh prompt alone)."""
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
    return [[(1, True)], rows]


def run_dummy_step(model, builder, pool, rows: list[tuple[int, bool]]) -> torch.Tensor:
    """One forward over ``rows`` in state slots 0 .. len(rows) - 1; the logits of the last row."""
    lens = torch.tensor([n for n, _ in rows], dtype=torch.int32)
    qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
    torch.cumsum(lens, 0, out=qsl[1:])
    md = builder.build(
        qsl,
        torch.arange(len(rows), dtype=torch.int32),
        torch.tensor([init for _, init in rows]),
    )
    device = builder.device
    ids = torch.zeros(int(qsl[-1]), dtype=torch.int64, device=device)
    hidden = model(ids, md, pool)
    return model.compute_logits(hidden[-1:])


def _zero_slots(pool, num_slots: int) -> None:
    pool.conv_state[:, :num_slots].zero_()
    pool.ssm_state[:, :num_slots].zero_()


@torch.no_grad()
def compile_kernels(
    model, builder, pool, max_num_seqs: int, max_num_batched_tokens: int
) -> PrecompileReport:
    """Compile every kernel variant a step within the limits can select, then run one
    dummy step for real; leaves the state pool as it found it (zeros)."""
    steps = dummy_steps(max_num_seqs, max_num_batched_tokens)
    used = max(len(rows) for rows in steps)
    with precompile() as report:
        for rows in steps:
            run_dummy_step(model, builder, pool, rows)
    # No kernel ran in there, but PyTorch code (the CPU scan) may have written its
    # garbage into the slots: the real step starts from zeros.
    _zero_slots(pool, used)
    run_dummy_step(model, builder, pool, steps[-1])
    if builder.device.type == "cuda":
        torch.cuda.synchronize()
    _zero_slots(pool, used)
    return report
