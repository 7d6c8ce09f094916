"""Two local lm-eval tasks, written into a directory so that lm-eval runs with no hub access:

    gsm8k_local  generate-until, GSM8K's format ("... #### 42"), exact match (as gsm8k)
    mc_local     multiple choice, scored by loglikelihood (acc, acc_norm)

The items are made up here (seeded arithmetic word problems), written as JSONL beside task
YAMLs made from the ``*.yaml.in`` templates with absolute data paths; lm-eval loads them with
HF datasets' ``json`` builder (``dataset_path: json``, local ``data_files``).

    python -m tests.lm_eval.tasks DIR [--num-fewshot K --max-gen-toks N]
    lm_eval ... --include_path DIR --tasks gsm8k_local,mc_local
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
TASKS = ("gsm8k_local", "mc_local")
NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Farah", "Gus", "Hana", "Ivo", "Jun")
THINGS = ("apples", "pencils", "stamps", "marbles", "books", "shells", "cards", "coins")


def _problem(rng: random.Random) -> tuple[str, str, int]:
    """(question, GSM8K-style worked answer ending in "#### n", n)."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b, c = rng.randint(2, 30), rng.randint(2, 20), rng.randint(2, 5)
    kind = rng.randrange(3)
    if kind == 0:
        n = a + b
        q = f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?"
        steps = f"{name} has {a} + {b} = <<{a}+{b}={n}>>{n} {thing}."
    elif kind == 1:
        a += b
        n = a - b
        q = f"{name} had {a} {thing} and gave away {b}. How many {thing} are left?"
        steps = f"{name} has {a} - {b} = <<{a}-{b}={n}>>{n} {thing} left."
    else:
        n = a * c
        q = f"{name} buys {c} bags with {a} {thing} in each. How many {thing} is that?"
        steps = f"The bags hold {c} * {a} = <<{c}*{a}={n}>>{n} {thing}."
    return q, f"{steps}\n#### {n}", n


def gsm8k_items(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [dict(zip(("question", "answer"), _problem(rng)[:2], strict=True)) for _ in range(count)]


def mc_items(count: int, seed: int) -> list[dict]:
    """Four numeric choices per question; the right one at a seeded position."""
    rng = random.Random(seed)
    items = []
    for _ in range(count):
        question, _, n = _problem(rng)
        wrong = rng.sample([v for v in range(max(0, n - 9), n + 10) if v != n], 3)
        label = rng.randrange(4)
        choices = [str(v) for v in wrong[:label]] + [str(n)] + [str(v) for v in wrong[label:]]
        items.append({"question": question, "choices": choices, "label": label})
    return items


def _write_jsonl(path: Path, items: list[dict]) -> None:
    path.write_text("".join(json.dumps(item) + "\n" for item in items))


def write_tasks(
    out_dir: str | Path,
    *,
    num_test: int = 24,
    num_train: int = 8,
    num_fewshot: int = 5,
    max_gen_toks: int = 256,
    seed: int = 0,
) -> Path:
    """Write both tasks' data and YAMLs into ``out_dir`` (created); returns it, the
    directory to give lm-eval as ``include_path``. The defaults are gsm8k's (5 shots, 256
    new tokens at most); the CPU tests use fewer."""
    if not 0 <= num_fewshot <= num_train:
        raise ValueError(f"num_fewshot must be in [0, num_train={num_train}], got {num_fewshot}")
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    _write_jsonl(out / "gsm8k_local_train.jsonl", gsm8k_items(num_train, seed))
    _write_jsonl(out / "gsm8k_local_test.jsonl", gsm8k_items(num_test, seed + 1))
    _write_jsonl(out / "mc_local_test.jsonl", mc_items(num_test, seed + 2))
    for task in TASKS:
        text = (HERE / f"{task}.yaml.in").read_text()
        text = text.replace("@DATA_DIR@", out.as_posix())
        text = text.replace("@MAX_GEN_TOKS@", str(int(max_gen_toks)))
        text = text.replace("@NUM_FEWSHOT@", str(int(num_fewshot)))
        (out / f"{task}.yaml").write_text(text)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--num-test", type=int, default=24)
    parser.add_argument("--num-train", type=int, default=8)
    parser.add_argument("--num-fewshot", type=int, default=5)
    parser.add_argument("--max-gen-toks", type=int, default=256)
    args = parser.parse_args()
    out = write_tasks(
        args.out_dir,
        num_test=args.num_test,
        num_train=args.num_train,
        num_fewshot=args.num_fewshot,
        max_gen_toks=args.max_gen_toks,
    )
    print(out)


if __name__ == "__main__":
    main()
