"""What benchmark_throughput.py sets up before the engine starts: the Triton cache the
process compiles into, and the requests.

Triton cache: by default a fresh empty folder (``TRITON_CACHE_DIR``, removed at the end),
so every kernel the run needs is compiled in it: a cold start, as a user's first run
is, and no compile from an earlier run can hide. ``--triton-cache-dir DIR`` uses that
folder as it is (empty or warm: recorded either way). Triton reads the variable when it
compiles, so it must be set before the first kernel is built; a process that imported
triton before (a test calling ``main`` in-process) keeps its in-memory kernels, which the
record says too (``triton_imported_before``).

Requests (token ids, output length):

- ``--input-len N``: every prompt N tokens, uniform over the vocabulary (vLLM's random
  data set); every output ``--output-len`` tokens.
- ``--dataset FILE``: a ShareGPT-format JSON (``[{"conversations": [{"from": ..., "value":
  ...}, ...]}, ...]``): the first human turn is the prompt, the first model turn's token
  count the output length unless ``--output-len``.
- otherwise synthetic ShareGPT-like lengths: log-normal, ``exp(N(log(median), sigma))``,
  clipped to [4, --max-prompt-len] and [4, --max-output-len], medians 150 and 180 tokens,
  sigmas 1.0 and 0.9 (chosen by hand for ShareGPT's heavy right tail, not fitted).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path


def _entries(path: Path) -> int:
    return sum(1 for _ in path.iterdir()) if path.is_dir() else 0


@contextlib.contextmanager
def triton_cache(given: str | None):
    """Set ``TRITON_CACHE_DIR`` for the duration; yields the record of it (completed with
    ``entries_at_end`` on exit: one entry per kernel variant compiled into it)."""
    before = os.environ.get("TRITON_CACHE_DIR")
    path = Path(given) if given else Path(tempfile.mkdtemp(prefix="triton_cold_"))
    path.mkdir(parents=True, exist_ok=True)
    info = {
        "dir": str(path),
        "given": given is not None,
        "entries_at_start": _entries(path),
        "triton_imported_before": "triton" in sys.modules,
    }
    info["cold"] = info["entries_at_start"] == 0 and not info["triton_imported_before"]
    os.environ["TRITON_CACHE_DIR"] = str(path)
    try:
        yield info
    finally:
        info["entries_at_end"] = _entries(path)
        if before is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = before
        if not given:
            shutil.rmtree(path, ignore_errors=True)


def fixed_requests(args, vocab_size: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    return [
        ([rng.randrange(vocab_size) for _ in range(args.input_len)], args.output_len)
        for _ in range(args.num_prompts)
    ]


def synthetic_requests(args, vocab_size: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)

    def draw(median: float, sigma: float, hi: int) -> int:
        return max(4, min(hi, round(math.exp(rng.gauss(math.log(median), sigma)))))

    out = []
    for _ in range(args.num_prompts):
        plen = draw(150, 1.0, args.max_prompt_len)
        olen = args.output_len or draw(180, 0.9, args.max_output_len)
        out.append(([rng.randrange(vocab_size) for _ in range(plen)], olen))
    return out


def sharegpt_requests(args, tokenizer) -> list[tuple[list[int], int]]:
    data = json.loads(Path(args.dataset).read_text())
    rng = random.Random(args.seed)
    rng.shuffle(data)
    out = []
    for item in data:
        turns = item.get("conversations") or []
        human = next((t["value"] for t in turns if t.get("from") == "human"), None)
        reply = next((t["value"] for t in turns if t.get("from") in ("gpt", "model")), None)
        if human is None or (reply is None and not args.output_len):
            continue
        ids = tokenizer.encode(human)[: args.max_prompt_len]
        olen = args.output_len or min(args.max_output_len, len(tokenizer.encode(reply)))
        if len(ids) < 4 or olen < 4:
            continue  # vLLM's benchmark drops such short pairs too
        out.append((ids, olen))
        if len(out) == args.num_prompts:
            break
    if len(out) < args.num_prompts:
        raise SystemExit(f"{args.dataset} gave only {len(out)} usable prompts")
    return out


def make_requests(args, vocab_size: int, tokenizer=None) -> list[tuple[list[int], int]]:
    if args.input_len:
        return fixed_requests(args, vocab_size)
    if args.dataset:
        return sharegpt_requests(args, tokenizer)
    return synthetic_requests(args, vocab_size)
