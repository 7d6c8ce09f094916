"""GET /tokenizer_info (vLLM's, behind --enable-tokenizer-info-endpoint) against a real
server, read by lm-eval's own RemoteTokenizer (``tokenizer_backend=remote`` of its
local-completions model), which also tokenizes through /tokenize and /detokenize."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from tests.entrypoints.utils import SERVER_ARGS, serve_for_module

TEXTS = ["Mamba layers keep a state.", "", "  two  spaces, ünïcode and 123"]


@pytest.fixture(scope="module")
def info_server(tiny_model_dir):
    yield from serve_for_module(tiny_model_dir, [*SERVER_ARGS, "--enable-tokenizer-info-endpoint"])


def test_tokenizer_info_reports_the_served_tokenizer(info_server, tiny_model_dir):
    hf = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    resp = httpx.get(info_server.url_for("tokenizer_info"), timeout=30)
    assert resp.status_code == 200, resp.text
    info = resp.json()
    assert info["tokenizer_class"] == type(hf).__name__
    assert info["vocab_size"] == len(hf)
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert info[name] == getattr(hf, name), name
    assert info["eos_token"] is not None
    assert info["chat_template"] == hf.chat_template and info["chat_template"]


def test_lm_eval_remote_tokenizer_against_the_server(info_server, tiny_model_dir):
    utils = pytest.importorskip("lm_eval.utils", reason="lm-eval is a test dependency")
    hf = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    remote = utils.RemoteTokenizer(info_server.url_for("v1", "completions"))
    assert remote.eos_token == hf.eos_token
    assert remote.eos_token_id == hf.eos_token_id
    for text in TEXTS:
        ids = remote.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert remote.decode(ids) == hf.decode(ids)
    # lm-eval renders the served template with the messages alone; a template that reads
    # special tokens (this one's bos_token) needs them passed, as HF passes them itself.
    messages = [{"role": "user", "content": "hi"}]
    rendered = remote.apply_chat_template(messages, bos_token=remote.bos_token)
    assert rendered == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_the_endpoint_is_off_by_default(server):
    resp = httpx.get(server.url_for("tokenizer_info"), timeout=30)
    assert resp.status_code == 404, resp.text
