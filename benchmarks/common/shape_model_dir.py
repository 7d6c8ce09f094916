"""A served model directory for a named benchmark shape (model_shapes.py), with the
tokenizer of another directory (make_model_dir.py's Mistral v3), for `vllm serve DIR
--load-format dummy`:

    python -m benchmarks.common.shape_model_dir /tmp/bamba9b --shape bamba-9b \
        --tokenizer-from /tmp/codestral

``config.json`` holds the architecture, its model type and the config class's fields, with
``vocab_size`` set to the tokenizer's (a model with more ids than its tokenizer would sample
ids that detokenize to nothing: Bamba-9B's 128,256 becomes the v3 tokenizer's 32,768, which
shrinks only the embedding and the LM head). The layer kinds go where the architecture's
config.json has them (``layer_types``; NemotronH's ``layers_block_type``; Bamba's
``attn_layer_indices``), and the directory is loaded back and must give the shape's layers. Needs no network and no mistral-common: the
GPU box makes its hybrid directories this way from the carried Codestral one.
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import asdict
from pathlib import Path

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
    fields = {k: v for k, v in asdict(config).items() if v is not None}
    kinds = fields.pop("layer_types", None)
    if kinds is not None and _init_field(config, "layer_types"):
        # Bamba derives its kinds from attn_layer_indices (not a field of its own there);
        # the others list them, NemotronH under transformers' name.
        fields[LAYER_KEYS.get(config.model_type, "layer_types")] = list(kinds)
    fields["vocab_size"] = vocab
    raw = {"architectures": [config.architecture], "model_type": config.model_type, **fields}
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    check_round_trip(out, config)
    return raw


# The config.json key of the layer kinds where it is not ``layer_types``.
LAYER_KEYS = {"nemotron_h": "layers_block_type"}


def _init_field(config, name: str) -> bool:
    from dataclasses import fields

    return any(f.name == name and f.init for f in fields(config))


def check_round_trip(out: Path, config) -> None:
    """The written directory must load as the shape's config (the layer kinds above all: a
    dropped key would serve an all-Mamba model under the shape's name)."""
    from vllm.model_executor.models.registry import load_model_config

    loaded = load_model_config(str(out))
    got, want = getattr(loaded, "layer_types", None), getattr(config, "layer_types", None)
    if got != want or loaded.num_hidden_layers != config.num_hidden_layers:
        raise ValueError(f"{out}/config.json loads as layers {got}, not the shape's {want}")


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
