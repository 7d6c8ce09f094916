"""``vllm serve ORG/NAME``: real server processes reading a Hugging Face cache folder laid out
as huggingface_hub writes it (``tests/hub_cache.py``), with ``HF_HUB_OFFLINE=1`` (no test
touches the network) and the cache given by ``HF_HUB_CACHE`` or ``--download-dir``."""

from __future__ import annotations

import json

import httpx
import pytest
from transformers import AutoTokenizer

from tests.entrypoints.utils import RemoteServer
from tests.hub_cache import add_snapshot
from tests.tiny_model import make_tiny_model_dir
from vllm import LLM, SamplingParams

ARGS = ["--max-num-seqs", "4", "--seed", "0"]
TEXT = "the state space model serves a stream of tokens"


def set_max_positions(path, n: int):
    """max_position_embeddings is the server's max_model_len (/v1/models): it tells which
    snapshot a server read."""
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": n}))
    return path


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    base = tmp_path_factory.mktemp("hub_serve")
    main = set_max_positions(make_tiny_model_dir(base / "main", num_hidden_layers=1), 1024)
    other = make_tiny_model_dir(base / "other", seed=1, num_hidden_layers=1)
    set_max_positions(other, 512)
    env_cache, flag_cache = base / "env_cache", base / "flag_cache"
    add_snapshot(env_cache, "org/tiny", main)
    # Only in the --download-dir cache, and only by its commit (no ref points at it).
    other_commit = add_snapshot(flag_cache, "org/tiny", other, ref=None)
    tokenizer_files = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
    add_snapshot(flag_cache, "org/tok", main, files=tokenizer_files)
    return dict(main=main, other=other, env=env_cache, flag=flag_cache, commit=other_commit)


@pytest.fixture
def offline_cache(monkeypatch, caches):
    """The servers' environment (they inherit ours): offline, HF_HUB_CACHE the env cache."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(caches["env"]))
    return caches


def models_of(server) -> dict:
    [model] = httpx.get(server.url_for("v1", "models"), timeout=30).json()["data"]
    return model


def test_vllm_serve_a_hub_id_from_the_cache_offline(offline_cache):
    """``vllm serve org/tiny``: listed under the id typed, the main snapshot's weights."""
    with RemoteServer("org/tiny", ARGS, console_script=True) as server:
        model = models_of(server)
        body = {"model": "org/tiny", "prompt": TEXT, "max_tokens": 4, "temperature": 0.0}
        body["ignore_eos"] = True
        r = httpx.post(server.url_for("v1", "completions"), json=body, timeout=120)
    assert model["id"] == "org/tiny" and model["root"] == "org/tiny", model
    assert model["max_model_len"] == 1024, model
    assert r.status_code == 200, r.text
    local = LLM(str(offline_cache["main"]), device="cpu", max_num_seqs=1)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert r.json()["choices"][0]["text"] == local.generate([TEXT], params)[0].outputs[0].text


def test_vllm_serve_revision_download_dir_and_tokenizer_ids(offline_cache):
    """``--revision COMMIT --download-dir DIR --tokenizer org/tok``: the snapshot of that
    commit in that cache (not in HF_HUB_CACHE's), and the tokenizer of another repo."""
    caches = offline_cache
    ours = AutoTokenizer.from_pretrained(str(caches["main"])).encode(TEXT)
    # Precondition: the model's own tokenizer would give other ids.
    assert AutoTokenizer.from_pretrained(str(caches["other"])).encode(TEXT) != ours
    args = [*ARGS, "--revision", caches["commit"], "--download-dir", str(caches["flag"])]
    args += ["--tokenizer", "org/tok"]
    with RemoteServer("org/tiny", args, console_script=True) as server:
        model = models_of(server)
        r = httpx.post(server.url_for("tokenize"), json={"model": "org/tiny", "prompt": TEXT})
    assert model["id"] == "org/tiny" and model["max_model_len"] == 512, model
    assert r.status_code == 200 and r.json()["tokens"] == ours, r.text
