"""``get_tokenizer``: the HF tokenizer of a model, by vLLM's signature and rules.

Clients that drive ``vllm.LLM`` tokenize on their side with it (lm-eval looks it up here)
and send token ids; the engine's own tokenizer (``vllm/engine/tokenizer.py``) loads the
same files with ``AutoTokenizer``, so both sides agree on every id. Unlike the engine's
wrapper this returns the transformers tokenizer itself (``__call__``, ``batch_decode``,
``apply_chat_template``, ``name_or_path``, ...), which is what such clients use.
"""

from __future__ import annotations

import os

_MODES = ("auto", "slow")


def get_tokenizer(
    tokenizer_name: str | os.PathLike,
    *args,
    tokenizer_mode: str = "auto",
    trust_remote_code: bool = False,
    revision: str | None = None,
    download_dir: str | None = None,
    **kwargs,
):
    """``AutoTokenizer.from_pretrained(tokenizer_name, ...)``; ``tokenizer_mode`` "auto"
    (the fast tokenizer where there is one) or "slow" (``use_fast=False``); other keyword
    arguments go to ``from_pretrained`` (``add_bos_token``, ...). Truncation, when a caller
    asks for it, keeps the end of a prompt (``truncation_side="left"``), as in vLLM."""
    if tokenizer_mode not in _MODES:
        raise ValueError(
            f"tokenizer_mode must be one of {', '.join(_MODES)}, got {tokenizer_mode!r} "
            "(the mistral and custom modes are not supported by this package)"
        )
    if tokenizer_mode == "slow":
        if kwargs.get("use_fast", False):
            raise ValueError("tokenizer_mode 'slow' cannot be combined with use_fast=True")
        kwargs["use_fast"] = False
    kwargs.setdefault("truncation_side", "left")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(tokenizer_name),
        *args,
        trust_remote_code=trust_remote_code,
        revision=revision,
        cache_dir=download_dir,
        **kwargs,
    )
