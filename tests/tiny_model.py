"""A tiny Mamba2 HF directory made offline: config.json, random safetensors weights and a real
byte-level BPE tokenizer (``tokenizers`` + ``PreTrainedTokenizerFast``) with a chat template.

    path = make_tiny_model_dir(tmp_path / "tiny")                     # chat template included
    path = make_tiny_model_dir(tmp_path / "plain", chat_template=None)  # none: chat gives 400

The server tests need what a downloaded model has (a tokenizer with special tokens, a chat
template, weights on disk) without a network; everything is seeded, so two calls with the
same arguments write the same files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

# examples/generate_demo.py's TINY shape: 2 layers, hidden 64, grouped heads, 16-token chunks.
# Its vocab of 512 is also the tokenizer's: every id the model can sample decodes to text.
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_heads=8,
    head_dim=16,
    state_size=16,
    n_groups=2,
    chunk_size=16,
    expand=2,
    conv_kernel=4,
)

PAD, BOS, EOS, IM_START, IM_END = "<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]  # ids 0..4, in this order

# ChatML, as many chat models render it; the BOS comes from the template, so a rendered chat
# prompt is tokenized without adding special tokens again (as vLLM does).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_DEFAULT = object()

_WORDS = (
    "the a an state space model mamba token tokens sequence step scan chunk kernel triton "
    "server request response stream client hello world prompt answer question what why how "
    "is are was be can will not and or but if then else for while with from into over under "
    "fast slow small large tiny big one two three four five six seven eight nine ten zero "
    "def return class import self none true false print list dict value key index batch cache "
    "slot engine queue async await yield loop thread time second minute data text word line "
    "user assistant system chat message content role model serve vllm open api json http"
).split()


def _corpus(rng: random.Random, lines: int) -> list[str]:
    """Sentences, code-like lines and numbers, so that the merges cover the usual shapes."""
    out = []
    for i in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 14))]
        kind = i % 4
        if kind == 0:
            out.append(" ".join(words).capitalize() + rng.choice([".", "?", "!"]))
        elif kind == 1:
            out.append(f"def {words[0]}_{words[1]}({', '.join(words[2:5])}):")
            out.append(f"    return {words[-1]} + {rng.randint(0, 999)}")
        elif kind == 2:
            out.append(", ".join(words) + f" {rng.randint(0, 10**6)}")
        else:
            out.append(f'{{"{words[0]}": "{" ".join(words[1:])}", "n": {rng.random():.3f}}}')
    return out


def _build_tokenizer(vocab_size: int, seed: int, chat_template: str | None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Byte-level: every string encodes (no unknown token), every id decodes to bytes.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(random.Random(seed), 400), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"the tokenizer learned {tok.get_vocab_size()} tokens, not {vocab_size}: give a "
            "vocab_size the corpus can fill (between 261 and ~2000)"
        )
    # A BOS in front of every encoded text, like Llama-style tokenizers: it makes
    # add_special_tokens matter, which completions (True) and chat (False) must get right.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)]
    )
    kwargs = dict(bos_token=BOS, eos_token=EOS, pad_token=PAD)
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)
    fast.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    return fast


def save_tiny_tokenizer(path, vocab_size: int = 512, seed: int = 0, chat_template=_DEFAULT):
    """Write the tiny byte-level BPE tokenizer (``vocab_size`` tokens, the specials first)
    into ``path``, beside a model another tool saved there (a transformers model's
    ``save_pretrained``); returns the tokenizer."""
    template = CHAT_TEMPLATE if chat_template is _DEFAULT else chat_template
    tokenizer = _build_tokenizer(vocab_size, seed, template)
    tokenizer.save_pretrained(str(path))
    return tokenizer


def _write_weights(path: Path, shape: dict, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    from vllm.model_executor.model_loader.weight_utils import dummy_weights
    from vllm.model_executor.models.mamba2 import Mamba2ForCausalLM
    from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig

    config = Mamba2ModelConfig(**shape)
    net = Mamba2ForCausalLM(config, dtype=torch.float32)
    # The engine's dummy checkpoint has trained-like scales (negative A, small dt), so the
    # tiny model's logits are finite and vary with the prompt.
    tensors = {}
    for name, t in dummy_weights(net, seed):
        if name.endswith("conv1d.weight"):
            t = t.unsqueeze(1)  # HF's nn.Conv1d layout (dim, 1, width), as checkpoints hold it
        tensors[name] = t.contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def make_tiny_model_dir(path, *, seed: int = 0, chat_template=_DEFAULT, **overrides) -> Path:
    """Write the tiny model into ``path`` (created) and return it.

    ``overrides`` change config fields (``vocab_size`` also sizes the tokenizer);
    ``chat_template=None`` leaves the tokenizer without one, a string replaces the default.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shape = {**TINY, **overrides}
    template = CHAT_TEMPLATE if chat_template is _DEFAULT else chat_template
    tokenizer = _build_tokenizer(shape["vocab_size"], seed, template)
    tokenizer.save_pretrained(str(path))
    ids = {
        name: tokenizer.convert_tokens_to_ids(tok)
        for name, tok in (("pad", PAD), ("bos", BOS), ("eos", EOS))
    }
    config = {
        "architectures": ["Mamba2ForCausalLM"],
        "model_type": "mamba2",
        **shape,
        "use_bias": False,
        "use_conv_bias": True,
        "layer_norm_epsilon": 1e-5,
        "residual_in_fp32": True,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "time_step_limit": [0.0, float("inf")],  # json writes Infinity, as HF's configs do
        "torch_dtype": "float32",
        "pad_token_id": ids["pad"],
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
    }
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _write_weights(path, shape, seed)
    return path
