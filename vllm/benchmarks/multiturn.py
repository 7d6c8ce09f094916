"""Multi-turn conversations for the serving benchmark (``--dataset-name multiturn``): the
workload where prefix caching pays, each turn's prompt being the previous turn's prompt and
answer plus a new message.

Conversations come from a ShareGPT file (datasets.py reads it): records whose turns
alternate human, gpt from the start, with at least ``--multiturn-min-turns`` (human, gpt)
pairs, cut to ``--multiturn-max-turns``, in the seed's order. Each turn asks for as many
output tokens as the recorded answer has (or ``--sharegpt-output-len``); a conversation
whose messages and answers together pass ``--multiturn-max-total-len`` tokens is skipped.

Replay (``--backend openai-chat`` only): conversations start on the request schedule
(``--request-rate`` is the conversation start rate, ``--burstiness`` as for requests), at
most ``--max-concurrency`` conversations in flight. Turn k sends the whole history through
/v1/chat/completions: every earlier user message and the model's own answer to it (the
text it streamed, not the recorded one), then the new message; it is sent when turn k-1's
answer has arrived. A failed turn ends its conversation (its later turns are not sent and
are counted in ``turns_not_sent``).

Metrics, besides the usual ones over every turn: TTFT of the first turns and of the later
ones (``*_ttft_first_turn_ms``, ``*_ttft_later_turns_ms``: caching can only help the
latter), and with a server that reports cached tokens ``prefix_cache_reusable_hit_rate``:
the cached tokens of turns >= 2 over their reusable tokens: the tokens the previous turn
ran through the model (its prompt and its output but the last token, which is sampled and
never fed back), all of which a cache holding the end of every request could restore.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from vllm.benchmarks.datasets import conversation, token_counts


@dataclass
class Conversation:
    user_turns: list[str]
    output_lens: list[int]
    prompt_len: int  # the first message's tokens (the ready check's request)

    @property
    def prompt(self) -> str:
        return self.user_turns[0]

    @property
    def expected_output_len(self) -> int:
        return self.output_lens[0]


def add_cli_args(p) -> None:
    g = p.add_argument_group("multiturn dataset options")
    g.add_argument("--multiturn-min-turns", type=int, default=3, help="(human, gpt) pairs")
    g.add_argument("--multiturn-max-turns", type=int, default=8, help="later turns are cut")
    g.add_argument(
        "--multiturn-max-total-len",
        type=int,
        default=2048,
        help="skip conversations whose messages and answers pass this many tokens",
    )


def check_args(args) -> None:
    if args.multiturn_min_turns < 1 or args.multiturn_max_turns < args.multiturn_min_turns:
        raise SystemExit("need 1 <= --multiturn-min-turns <= --multiturn-max-turns")
    if args.dataset_name == "multiturn" and args.backend != "openai-chat":
        raise SystemExit("--dataset-name multiturn needs --backend openai-chat")


def _pairs(turns: list) -> list[tuple[str, str]]:
    """The leading (human, gpt) pairs of a ShareGPT conversation."""
    out = []
    for human, gpt in zip(turns[::2], turns[1::2], strict=False):
        if not (isinstance(human, dict) and isinstance(gpt, dict)):
            break
        q, a = human.get("value"), gpt.get("value")
        if human.get("from") != "human" or gpt.get("from") != "gpt":
            break
        if not (isinstance(q, str) and isinstance(a, str) and q.strip()):
            break
        out.append((q, a))
    return out


def sample_conversations(
    records: list,
    tokenizer,
    num_conversations: int,
    min_turns: int = 3,
    max_turns: int = 8,
    max_total_len: int = 2048,
    seed: int = 0,
    output_len: int | None = None,
) -> list[Conversation]:
    """Up to ``num_conversations`` conversations (fewer when the records run out)."""
    convs = [c for c in map(conversation, records) if c is not None]
    random.Random(seed).shuffle(convs)
    out: list[Conversation] = []
    for turns in convs:
        pairs = _pairs(turns)[:max_turns]
        if len(pairs) < min_turns:
            continue
        user_lens = token_counts(tokenizer, [q for q, _ in pairs])
        if output_len is None:
            out_lens = [max(1, n) for n in token_counts(tokenizer, [a for _, a in pairs])]
        else:
            out_lens = [output_len] * len(pairs)
        if sum(user_lens) + sum(out_lens) > max_total_len:
            continue
        out.append(Conversation([q for q, _ in pairs], out_lens, user_lens[0]))
        if len(out) == num_conversations:
            break
    return out


async def converse(conv: Conversation, send) -> list:
    """The turns of one conversation in order; ``send(messages, output_len)`` is one timed
    chat request (client.send_request)."""
    messages: list[dict] = []
    outputs: list = []
    for k, (user, n_out) in enumerate(zip(conv.user_turns, conv.output_lens, strict=True)):
        messages.append({"role": "user", "content": user})
        out = await send(list(messages), n_out)
        out.turn = k + 1
        if k > 0:
            prev = outputs[-1]
            ran = (prev.server_prompt_tokens or 0) + (prev.output_tokens or 0) - 1
            out.reusable_tokens = max(ran, 0)
        outputs.append(out)
        if not out.success:
            break
        messages.append({"role": "assistant", "content": out.generated_text})
    return outputs


async def run_conversations(
    conversations: list[Conversation], send, rate: float, burstiness: float, seed: int, limit
) -> tuple[list, int]:
    """Every conversation, started on the schedule and under ``limit`` (an
    asyncio.Semaphore or None); (the turns' outputs in start order, turns not sent)."""
    from vllm.benchmarks.serve import paced

    async def one(conv):
        if limit is None:
            return await converse(conv, send)
        async with limit:
            return await converse(conv, send)

    tasks = []
    async for conv in paced(conversations, rate, burstiness, seed):
        tasks.append(asyncio.create_task(one(conv)))
    done = await asyncio.gather(*tasks)
    outputs = [o for turns in done for o in turns]
    planned = sum(len(c.user_turns) for c in conversations)
    return outputs, planned - len(outputs)


def _stats(prefix: str, seconds: list[float], percentiles: list[float]) -> dict:
    import numpy as np

    from vllm.benchmarks.metrics import percentile_label

    values = np.asarray(seconds or [0.0]) * 1000.0
    out = {f"mean_{prefix}_ms": float(np.mean(values))}
    out[f"median_{prefix}_ms"] = float(np.median(values))
    for q in percentiles:
        out[f"p{percentile_label(q)}_{prefix}_ms"] = float(np.percentile(values, q))
    return out


def turn_metrics(outputs: list, turns_not_sent: int, percentiles: list[float]) -> dict:
    ok = [o for o in outputs if o.success]
    first = [o.ttft for o in ok if o.turn == 1]
    later = [o for o in ok if o.turn >= 2]
    result = {"num_turns": len(outputs), "turns_not_sent": turns_not_sent}
    result.update(_stats("ttft_first_turn", first, percentiles))
    result.update(_stats("ttft_later_turns", [o.ttft for o in later], percentiles))
    reported = [o for o in later if o.cached_tokens is not None]
    reusable = sum(o.reusable_tokens for o in reported)
    result["prefix_cache_reusable_tokens"] = reusable if reported else None
    result["prefix_cache_reusable_hit_rate"] = (
        sum(o.cached_tokens for o in reported) / max(reusable, 1) if reported else None
    )
    return result


def format_lines(result: dict, percentiles: list[float]) -> list[str]:
    from vllm.benchmarks.metrics import _row, percentile_label

    lines = ["{s:-^51}".format(s=" Multi-turn "), _row("Turns sent:", result["num_turns"])]
    lines.append(_row("Turns not sent (after a failure):", result["turns_not_sent"]))
    for name, label in (("first_turn", "turn 1"), ("later_turns", "turns >= 2")):
        lines.append(_row(f"Median TTFT {label} (ms):", result[f"median_ttft_{name}_ms"]))
        for q in percentiles:
            key = f"p{percentile_label(q)}_ttft_{name}_ms"
            lines.append(_row(f"P{percentile_label(q)} TTFT {label} (ms):", result[key]))
    if result["prefix_cache_reusable_hit_rate"] is not None:
        rate = result["prefix_cache_reusable_hit_rate"]
        lines.append(_row("Hit rate of reusable tokens:", rate))
    return lines
