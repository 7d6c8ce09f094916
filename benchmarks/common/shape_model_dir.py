"""A served model directory for a named benchmark shape (model_shapes.py), with the
tokenizer of another directory (make_model_dir.py's Mistral v3), for `vllm serve DIR
--load-format dummy`:

    python -m benchmarks.common.shape_model_dir /tmp/bamba9b --shape bamba-9b \
        --tokenizer-from /tmp/codestral

``config.json`` holds the architecture, its model type and the config's fields as
transformers names them (``hf_models.hf_config_kwargs``), with
``vocab_size`` set to the tokenizer's (a model with more ids than its tokenizer would sample
ids that detokenize to nothing: Bamba-9B's 128,256 becomes the v3 tokenizer's 32,768, which
shrinks only the embedding and the LM head). The directory is loaded back and must give
the shape's layers (NemotronH's are ``layers_block_type`` there, Bamba's
``attn_layer_indices``). Needs no network and no mistral-common: the
GPU box makes its hybrid directories this way from the carried Codestral one.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from benchmarks.common.hf_models import config_differences, hf_config_kwargs

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_shape_dir(out, shape: str, tokenizer_from) -> dict:
    from transformers import AutoTokenizer

    from benchmarks.common.model_shapes import named_config

    out, source = Path(out), Path(tokenizer_from)
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    vocab = len(AutoTokenizer.from_pretrained(str(source)))
    config = named_config(shape)
    # transformers' own keys (hf_models: NemotronH's layers_block_type, RoPE's parameters),
    # which is what a checkpoint's config.json holds and our loader reads.
    fields = hf_config_kwargs(config)
    fields["vocab_size"] = vocab
    raw = {"model_type": config.model_type, **fields}
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    check_loads_as(out, config)
    return raw


def check_loads_as(out: Path, config) -> None:
    """The written directory must load as the shape's config with the tokenizer's vocabulary
    (the layer kinds above all: a dropped key would serve an all-Mamba model under the
    shape's name)."""
    from dataclasses import replace

    from vllm.model_executor.models.registry import load_model_config

    loaded = load_model_config(str(out))
    wrong = config_differences(replace(config, vocab_size=loaded.vocab_size), loaded)
    if wrong:
        raise ValueError(f"{out}/config.json does not load as the shape: " + "; ".join(
            f"{k}: {a!r} read back as {b!r}" for k, (a, b) in wrong.items()))  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", help="the directory to write (created)")
    p.add_argument("--shape", required=True, help="a name of benchmarks/common/model_shapes.py")
    p.add_argument("--tokenizer-from", required=True, help="a directory with tokenizer.json")
    args = p.parse_args(argv)
    raw = write_shape_dir(args.out, args.shape, args.tokenizer_from)
    print(f"wrote {args.out}: {raw['architectures'][0]} ({args.shape}), vocab {raw['vocab_size']}")


if __name__ == "__main__":
    main()
