"""Write a model directory for serving benchmarks: a Mamba2 ``config.json`` and Mistral's v3
SentencePiece tokenizer as a fast HF tokenizer, so prompts are real text with realistic
token counts. Serve it with random weights:

    python -m benchmarks.common.make_model_dir /tmp/codestral          # Mamba-Codestral-7B shape
    python -m benchmarks.common.make_model_dir /tmp/tiny --tiny        # 2 layers, hidden 64 (CPU)
    vllm serve /tmp/codestral --load-format dummy --dtype bfloat16

The tokenizer is ``mistral_common/data/mistral_instruct_tokenizer_240323.model.v3`` from the
PyPI package ``mistral-common`` (vocab 32768, the one Mamba-Codestral-7B uses), converted
here into ``tokenizer.json`` (a BPE with byte fallback, as HF's Mistral tokenizers are) plus
``tokenizer_config.json`` and ``special_tokens_map.json``. The output directory needs only
``tokenizers`` and ``transformers`` to load (no sentencepiece, no mistral-common, no
network): ``AutoTokenizer.from_pretrained(dir)`` gives a fast tokenizer. The conversion
needs ``sentencepiece`` (its model proto) and is checked on the spot against
SentencePiece's own encoding of a few texts (``--check-file`` adds the prompts of a
ShareGPT file).

``config.json`` holds the fields transformers' ``Mamba2Config`` writes; the loader
(``Mamba2ModelConfig.from_dict``) reads the shape fields and ignores the rest. The default
shape is ``Mamba2ModelConfig()``'s (Codestral-7B); ``--tiny`` keeps the vocab of 32768 so
the same tokenizer fits.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

V3_TOKENIZER = "mistral_instruct_tokenizer_240323.model.v3"
TINY_SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_heads=8,
    head_dim=16,
    state_size=16,
    n_groups=2,
    chunk_size=16,
)
# Mistral's instruct format ("[INST] question [/INST] answer</s>"); a system message goes in
# front of the first user turn, as Mistral's own templates put it.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\n\n' %}"
    "{% elif message['role'] == 'user' %}"
    "{{ '[INST] ' + ns.system + message['content'] + ' [/INST]' }}{% set ns.system = '' %}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
)
# SentencePiece piece types (sentencepiece_model.proto).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6
CHECK_TEXTS = (
    "Hello world, how are you?",
    "  Two leading spaces, a\ttab and\nnew lines\n\n  indented.",
    "Numbers 1234567 and 3.14159; unicode: ünïcødé, 中文, emoji 🙂.",
    "def f(x):\n    return x ** 2  # comment",
    "[INST] control strings in text [/INST]</s>",
)


def v3_tokenizer_path() -> Path:
    """The v3 model file inside the installed mistral-common (found without importing it:
    its __init__ needs dependencies the conversion does not)."""
    spec = importlib.util.find_spec("mistral_common")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "mistral-common is not installed: pip install -r requirements/bench.txt "
            "(it ships Mistral's SentencePiece tokenizers)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / V3_TOKENIZER
    if not path.is_file():
        raise SystemExit(f"{path} is missing from the installed mistral-common")
    return path


def load_proto(model_file: Path):
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_file.read_bytes())
    if proto.trainer_spec.model_type != 2:  # BPE
        raise SystemExit(f"{model_file} is not a BPE SentencePiece model")
    return proto


def bpe_merges(pieces: list[tuple[str, float, int]]) -> list[tuple[str, str]]:
    """The merges that make SentencePiece's BPE choices in HF's BPE.

    SentencePiece merges the adjacent pair whose joined piece scores highest; HF's BPE
    merges the pair ranked first in its list. So every split ``(left, right)`` of a normal
    piece with both halves in the vocabulary is a merge, ranked by the joined piece's score
    (then id), and the splits of one piece by the ids of their halves.
    """
    ids = {piece: i for piece, _, i in pieces}
    ranked = []
    for piece, score, i in pieces:
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append(((-score, i, ids[left], ids[right]), (left, right)))
    ranked.sort()
    return [pair for _, pair in ranked]


def build_tokenizer(model_file: Path):
    """A ``tokenizers.Tokenizer`` equal to SentencePiece's encoding of ``model_file``, and
    the special token strings (unk, bos, eos)."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        processors,
    )

    proto = load_proto(model_file)
    spec, norm = proto.trainer_spec, proto.normalizer_spec
    if norm.name != "identity" or not norm.add_dummy_prefix or norm.remove_extra_whitespaces:
        raise SystemExit(f"{model_file}: a normalizer this conversion does not handle")
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    normal = [(p.piece, p.score, i) for i, p in enumerate(proto.pieces) if p.type == NORMAL]
    unk = proto.pieces[spec.unk_id].piece
    model = models.BPE(
        vocab=vocab, merges=bpe_merges(normal), unk_token=unk, byte_fallback=True, fuse_unk=True
    )
    tok = Tokenizer(model)
    # SentencePiece's dummy prefix and whitespace escaping: one "▁" in front of the text
    # (even one that starts with a space) and every space a "▁"; no split at whitespace, so
    # whitespace-only pieces ("▁▁▁") match.
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    # No pre-tokenizer: SentencePiece's split_digits shaped training only (no normal piece
    # holds a digit beside anything but "▁"); HF's Digits splitter would also split "²".
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    bos, eos = proto.pieces[spec.bos_id].piece, proto.pieces[spec.eos_id].piece
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, spec.bos_id)]
    )
    # Control pieces ([INST], </s>, ...) are special tokens, as in HF's Mistral tokenizers;
    # user-defined pieces match in text, as SentencePiece matches them.
    specials = [p.piece for p in proto.pieces if p.type in (UNKNOWN, CONTROL)]
    tok.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in specials])
    users = [p.piece for p in proto.pieces if p.type == USER_DEFINED]
    tok.add_tokens([AddedToken(s, normalized=False, special=False) for s in users])
    if tok.get_vocab_size() != len(proto.pieces):
        raise SystemExit(f"conversion gave {tok.get_vocab_size()} ids, not {len(proto.pieces)}")
    return tok, (unk, bos, eos)


def write_tokenizer(out: Path, model_file: Path) -> dict:
    tok, (unk, bos, eos) = build_tokenizer(model_file)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    specials = {"bos_token": bos, "eos_token": eos, "unk_token": unk}
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
    return {"unk": tok.token_to_id(unk), "bos": tok.token_to_id(bos), "eos": tok.token_to_id(eos)}


def write_config(out: Path, shape: dict, ids: dict, dtype: str) -> dict:
    """``config.json`` with the fields transformers' Mamba2Config writes for this shape (the
    generic PretrainedConfig fields left out, as in the hub's Mamba2 configs)."""
    import inspect

    from transformers import Mamba2Config

    hf = Mamba2Config(
        **shape, bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["unk"]
    ).to_dict()
    own = set(inspect.signature(Mamba2Config.__init__).parameters) - {"self", "dtype"}
    generic = {"output_hidden_states", "return_dict", "chunk_size_feed_forward"}
    generic |= {"is_encoder_decoder", "id2label", "label2id", "problem_type"}
    config = {k: v for k, v in hf.items() if k in own - generic}
    config["architectures"] = ["Mamba2ForCausalLM"]
    config["model_type"] = "mamba2"
    # "torch_dtype", as checkpoints name it: the dtype "--dtype auto" serves.
    config["torch_dtype"] = dtype
    config["time_step_limit"] = [float(x) for x in config["time_step_limit"]]
    # json.dumps writes inf as Infinity, as the hub's checkpoints have it.
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return config


def model_shape(tiny: bool) -> dict:
    from dataclasses import asdict

    from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig

    config = Mamba2ModelConfig(**TINY_SHAPE) if tiny else Mamba2ModelConfig()
    shape = asdict(config)
    for name in ("dtype", "max_position_embeddings", "time_step_limit"):
        shape.pop(name)
    return shape


def check_tokenizer(out: Path, model_file: Path, texts: list[str]) -> dict:
    """The written directory, loaded as the server loads it, against SentencePiece."""
    import sentencepiece
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(out))
    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    if not hf.is_fast:
        raise SystemExit(f"{out}: AutoTokenizer did not load a fast tokenizer")
    differ = [t for t in texts if hf.encode(t, add_special_tokens=False) != sp.encode(t)]
    # Text holding a control string ("[INST]") is expected to differ: HF's Mistral
    # tokenizers read it as the control token, SentencePiece as plain text.
    added = hf.added_tokens_decoder.values()
    controls = [t.content for t in added if t.special and t.content != hf.unk_token]
    unexpected = [t for t in differ if not any(c in t for c in controls)]
    if unexpected:
        raise SystemExit(f"{len(unexpected)} texts tokenize differently, e.g. {unexpected[0]!r}")
    bad_decode = [t for t in texts[:200] if hf.decode(sp.encode(t)) != sp.decode(sp.encode(t))]
    if bad_decode:
        raise SystemExit(f"decode differs from SentencePiece's for {bad_decode[0]!r}")
    return {"texts": len(texts), "differ_by_control_strings": len(differ)}


def make_model_dir(out, *, tiny: bool = False, check_texts: list[str] | None = None) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model_file = v3_tokenizer_path()
    ids = write_tokenizer(out, model_file)
    # The tiny model runs on the CPU, where the interpreter's bf16 arithmetic is wrong.
    write_config(out, model_shape(tiny), ids, "float32" if tiny else "bfloat16")
    return check_tokenizer(out, model_file, [*CHECK_TEXTS, *(check_texts or [])])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", help="the directory to write (created)")
    p.add_argument("--tiny", action="store_true", help="a tiny shape for CPU runs")
    p.add_argument(
        "--check-file",
        default=None,
        help="a ShareGPT-format JSON whose first turns are also checked against SentencePiece",
    )
    p.add_argument("--check-limit", type=int, default=2000, help="how many of its turns")
    args = p.parse_args(argv)
    texts = []
    if args.check_file:
        from vllm.benchmarks.datasets import read_sharegpt

        for record in read_sharegpt(args.check_file).records:
            turns = record.get("conversations") if isinstance(record, dict) else None
            if turns and isinstance(turns[0].get("value"), str):
                texts.append(turns[0]["value"])
            if len(texts) >= args.check_limit:
                break
    check = make_model_dir(args.out, tiny=args.tiny, check_texts=texts)
    size = sum(f.stat().st_size for f in Path(args.out).iterdir()) / 2**20
    print(
        f"wrote {args.out} ({size:.1f} MiB): config.json ({'tiny' if args.tiny else 'Codestral-7B'}"
        f" shape), tokenizer.json (vocab 32768); {check['texts']} texts checked against "
        f"SentencePiece, {check['differ_by_control_strings']} differ only by control strings"
    )


if __name__ == "__main__":
    main()
