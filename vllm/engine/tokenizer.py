"""Tokenizers: HF ``AutoTokenizer`` from the model directory, or a byte-level fallback.

The fallback serves models without tokenizer files (dummy weights, test models): token id
``b % vocab_size`` for each UTF-8 byte ``b`` of the text, and id ``t`` decodes to byte
``t % 256`` (invalid UTF-8 shows as U+FFFD). It round-trips text when ``vocab_size >= 256``;
it has no end-of-sequence token, so generation ends by ``max_tokens`` or ``stop``.

``decode(ids, skip_special_tokens=True, spaces_between_special_tokens=True)``: the
SamplingParams of the same names reach it through the output processor (the fallback has no
special tokens, so both change nothing there).
"""

from __future__ import annotations

import os
from pathlib import Path

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _no_template() -> ValueError:
    return ValueError(
        "this model's tokenizer has no chat template (tokenizer_config.json has no "
        "'chat_template'), so chat messages cannot be rendered: use completions instead"
    )


class ByteTokenizer:
    eos_token_id = None
    chat_template = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b % self.vocab_size for b in text.encode("utf-8")]

    def decode(
        self,
        token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        return bytes(t % 256 for t in token_ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        raise _no_template()

    def info(self) -> dict:
        """What ``GET /tokenizer_info`` reports: no special tokens, no template."""
        return {
            "tokenizer_class": type(self).__name__,
            "vocab_size": self.vocab_size,
            "bos_token": None,
            "eos_token": None,
            "pad_token": None,
            "unk_token": None,
            "chat_template": None,
        }


class HFTokenizer:
    """The calls the engine and the server need from a transformers tokenizer."""

    def __init__(self, path: str | os.PathLike):
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(path))
        self.eos_token_id = self._tok.eos_token_id
        self.vocab_size = len(self._tok)
        self.chat_template = getattr(self._tok, "chat_template", None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens)

    def decode(
        self,
        token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        return self._tok.decode(
            token_ids,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
        )

    def info(self) -> dict:
        """What ``GET /tokenizer_info`` reports (vLLM's endpoint, which lm-eval's remote
        tokenizer reads): the class, the special tokens as text and the chat template."""
        tok = self._tok
        return {
            "tokenizer_class": type(tok).__name__,
            "vocab_size": self.vocab_size,
            "model_max_length": tok.model_max_length,
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "pad_token": tok.pad_token,
            "unk_token": tok.unk_token,
            "add_bos_token": getattr(tok, "add_bos_token", None),
            "chat_template": self.chat_template,
        }

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        """The messages rendered as the prompt text (ValueError without a template)."""
        if not self.chat_template:
            raise _no_template()
        try:
            return self._tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as err:  # jinja's errors: the messages do not fit the template
            raise ValueError(f"the chat template could not render the messages: {err}") from None


def get_tokenizer(path: str | os.PathLike | None, vocab_size: int):
    """HF's tokenizer when ``path`` is a directory with tokenizer files, else the fallback."""
    if path is not None:
        d = Path(path)
        if any((d / name).is_file() for name in _TOKENIZER_FILES):
            return HFTokenizer(d)
    return ByteTokenizer(vocab_size)


class IncrementalDetokenizer:
    """Text of a growing token list, one delta per new token.

    Decoding each token alone breaks words that span tokens and multi-byte characters. This
    decodes a short window from ``prefix`` on, and emits the text past the window's first
    part once it no longer ends in U+FFFD (an unfinished character).
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], **decode_kwargs):
        """``decode_kwargs``: ``skip_special_tokens`` / ``spaces_between_special_tokens``."""
        self.tokenizer = tokenizer
        self.decode_kwargs = decode_kwargs
        # A few prompt tokens give the first output token its left context (spacing).
        self.prefix = max(0, len(prompt_token_ids) - 4)
        self.read = len(prompt_token_ids)

    def step(self, token_ids: list[int], end: int | None = None) -> str:
        """New text after ``token_ids[:end]`` grew (the full prompt + output list; ``end``
        None: all of it)."""
        end = len(token_ids) if end is None else end
        decode, kwargs = self.tokenizer.decode, self.decode_kwargs
        before = decode(token_ids[self.prefix : self.read], **kwargs)
        after = decode(token_ids[self.prefix : end], **kwargs)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, end
        return after[len(before) :]
