"""Multi-turn conversations for the serving benchmark (``--dataset-name multiturn``): the
workload where prefix caching pays, each turn's prompt being the previous turn's prompt and
answer plus a new message.

Conversations come from a ShareGPT file (datasets.py reads it): records whose turns
alternate human, gpt from the start, with at least ``--multiturn-min-turns`` (human, gpt)
pairs, cut to ``--multiturn-max-turns``, in the seed's order. Each turn asks for as many
output tokens as the recorded answer has (or ``--sharegpt-output-len``); a conversation
whose messages and answers together pass ``--multiturn-max-total-len`` tokens is skipped.

Replay: conversations start on the request schedule (``--request-rate`` is the
conversation start rate, ``--burstiness`` as for requests), at most ``--max-concurrency``
conversations in flight. Turn k sends the whole history: every earlier user message and the
model's own answer to it (not the recorded one), then the new message; it is sent when turn
k-1's answer has arrived. A failed turn ends its conversation (its later turns are not sent
and are counted in ``turns_not_sent``). The history goes one of two ways:

- ``--backend openai-chat``: as chat messages to /v1/chat/completions, the answer as the
  text it streamed (``ChatHistory``). The server renders and tokenizes it again, so turn k
  starts with turn k-1's prompt + answer ids only when the answer's text tokenizes back to
  the ids generated: a trained model's answers mostly do; a random-weight model's do not
  (byte pieces, merges across its first token), and its end-of-request checkpoints then
  never match.
- ``--backend openai``: as token ids to /v1/completions (``TokenHistory``): turn 1 is the
  chat template's rendering of the first message, tokenized here; turn k is turn k-1's
  prompt ids + the ids it generated (``return_token_ids``) + the template's tokens between
  an answer and the next generation prompt. That is the prompt a chat turn has when its
  answer tokenizes back exactly, whatever the weights: what a benchmark with random weights
  needs to measure a cache's reuse of whole turns.

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


def kept_pairs(
    turns: list,
    tokenizer,
    min_turns: int = 3,
    max_turns: int = 8,
    max_total_len: int = 2048,
    output_len: int | None = None,
):
    """A ShareGPT conversation as the benchmark reads it: (its leading (human, gpt) pairs,
    cut to ``max_turns``; the user turns' token counts; each turn's output length), or None
    when it has fewer than ``min_turns`` pairs or passes ``max_total_len`` tokens."""
    pairs = _pairs(turns)[:max_turns]
    if len(pairs) < min_turns:
        return None
    user_lens = token_counts(tokenizer, [q for q, _ in pairs])
    if output_len is None:
        out_lens = [max(1, n) for n in token_counts(tokenizer, [a for _, a in pairs])]
    else:
        out_lens = [output_len] * len(pairs)
    if sum(user_lens) + sum(out_lens) > max_total_len:
        return None
    return pairs, user_lens, out_lens


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
        kept = kept_pairs(turns, tokenizer, min_turns, max_turns, max_total_len, output_len)
        if kept is None:
            continue
        pairs, user_lens, out_lens = kept
        out.append(Conversation([q for q, _ in pairs], out_lens, user_lens[0]))
        if len(out) == num_conversations:
            break
    return out


class ChatHistory:
    """A conversation as chat messages, answers as the text streamed (openai-chat)."""

    def __init__(self):
        self.messages: list[dict] = []

    def ask(self, user: str) -> list[dict]:
        self.messages.append({"role": "user", "content": user})
        return list(self.messages)

    def answer(self, out) -> str:
        self.messages.append({"role": "assistant", "content": out.generated_text})
        return ""


# A stand-in for an answer in a rendered template, found again to cut what follows it.
_ANSWER = "\u2063ANSWER\u2063"


def _template_ids(encoded) -> list[int]:
    """apply_chat_template(tokenize=True)'s ids: a list, or a BatchEncoding (transformers 5)."""
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    return [int(t) for t in ids]


class TokenHistory:
    """A conversation as token ids (openai): each turn's prompt is the previous prompt, the
    ids it generated and the template's tokens up to the next generation prompt."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []

    def ask(self, user: str) -> list[int]:
        tok = self.tokenizer
        if not self.ids:
            first = [{"role": "user", "content": user}]
            rendered = tok.apply_chat_template(first, add_generation_prompt=True, tokenize=True)
            self.ids = _template_ids(rendered)
        else:
            self.ids += self.turn_suffix(user)
        return list(self.ids)

    def turn_suffix(self, user: str) -> list[int]:
        """The template's tokens after an answer, through the next generation prompt."""
        messages = [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": _ANSWER},
            {"role": "user", "content": user},
        ]
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        at = text.find(_ANSWER)
        if at < 0:
            raise SystemExit("the chat template drops the answers from the history")
        suffix = self.tokenizer.encode(text[at + len(_ANSWER) :], add_special_tokens=False)
        eos = self.tokenizer.eos_token_id
        if self.ids and eos is not None and self.ids[-1] == eos and suffix[:1] == [eos]:
            suffix = suffix[1:]  # the answer ended on the end-of-turn token the template adds
        return suffix

    def answer(self, out) -> str:
        if out.output_token_ids is None:
            return "the server sent no token ids (it needs vLLM's return_token_ids)"
        if out.output_tokens is not None and len(out.output_token_ids) != out.output_tokens:
            return (
                f"the server sent {len(out.output_token_ids)} token ids for "
                f"{out.output_tokens} completion tokens"
            )
        self.ids += out.output_token_ids
        return ""


async def converse(conv: Conversation, send, history=None) -> list:
    """The turns of one conversation in order; ``send(prompt, output_len)`` is one timed
    request (client.send_request) of the history's prompt: chat messages (``ChatHistory``,
    the default) or token ids (``TokenHistory``)."""
    history = history if history is not None else ChatHistory()
    outputs: list = []
    for k, (user, n_out) in enumerate(zip(conv.user_turns, conv.output_lens, strict=True)):
        out = await send(history.ask(user), n_out)
        out.turn = k + 1
        if k > 0:
            prev = outputs[-1]
            ran = (prev.server_prompt_tokens or 0) + (prev.output_tokens or 0) - 1
            out.reusable_tokens = max(ran, 0)
        outputs.append(out)
        if not out.success:
            break
        problem = history.answer(out)
        if problem:
            out.success, out.error = False, problem
            break
    return outputs


async def run_conversations(
    conversations: list[Conversation],
    send,
    rate: float,
    burstiness: float,
    seed: int,
    limit,
    new_history=ChatHistory,
) -> tuple[list, int]:
    """Every conversation, started on the schedule and under ``limit`` (an
    asyncio.Semaphore or None), each with ``new_history()``; (the turns' outputs in start
    order, turns not sent)."""
    from vllm.benchmarks.serve import paced

    async def one(conv):
        if limit is None:
            return await converse(conv, send, new_history())
        async with limit:
            return await converse(conv, send, new_history())

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
