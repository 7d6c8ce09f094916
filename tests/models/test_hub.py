"""Hugging Face Hub ids (``vllm/transformers_utils/hub.py``) through ``LLM`` and the engine
config, read from a real cache folder laid out as huggingface_hub writes it
(``tests/hub_cache.py``) with ``HF_HUB_OFFLINE=1``: no test touches the network."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from tests.hub_cache import add_snapshot, repo_folder
from tests.tiny_model import make_tiny_model_dir
from vllm import LLM, SamplingParams
from vllm.config import EngineConfig
from vllm.transformers_utils.hub import is_hub_id

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]


def tiny(path: Path, seed: int, max_position_embeddings: int) -> Path:
    """The tiny model; its max_position_embeddings (the engine's max_model_len) tells which
    snapshot was read."""
    make_tiny_model_dir(path, seed=seed, num_hidden_layers=1)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = max_position_embeddings
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    base = tmp_path_factory.mktemp("hub")
    cache = base / "cache"
    main_dir, v2_dir = tiny(base / "main", 0, 1024), tiny(base / "v2", 1, 512)
    return SimpleNamespace(
        cache=cache,
        main_dir=main_dir,
        main=add_snapshot(cache, "org/tiny", main_dir),
        v2=add_snapshot(cache, "org/tiny", v2_dir, ref="v2"),
        config_only=add_snapshot(
            cache, "org/cfg-only", main_dir, files=["config.json", *TOKENIZER_FILES]
        ),
    )


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def snapshot(hub, repo_id: str, commit: str) -> Path:
    return repo_folder(hub.cache, repo_id) / "snapshots" / commit


def test_llm_from_a_hub_id_generates_as_from_its_directory(hub):
    """``LLM("org/tiny")``: the cached snapshot of main, served under the id typed."""
    prompts = ["the state space model", "hello world"]
    from_hub = LLM("org/tiny", download_dir=hub.cache, device="cpu", max_num_seqs=2)
    config = from_hub.llm_engine.config
    assert config.model_dir == snapshot(hub, "org/tiny", hub.main)
    assert config.served_model_name == "org/tiny" and config.max_model_len == 1024
    got = [o.outputs[0].token_ids for o in from_hub.generate(prompts, GREEDY, use_tqdm=False)]
    local = LLM(str(hub.main_dir), device="cpu", max_num_seqs=2)
    want = [o.outputs[0].token_ids for o in local.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == want and all(len(t) == 4 for t in got)


@pytest.mark.parametrize("revision", [None, "main", "v2", "v2-commit"])
def test_revision_picks_the_snapshot_by_branch_or_commit(hub, revision):
    commit = hub.v2 if revision and revision.startswith("v2") else hub.main
    if revision == "v2-commit":
        revision = hub.v2
    config = EngineConfig(model="org/tiny", revision=revision, download_dir=hub.cache)
    assert config.model_dir == snapshot(hub, "org/tiny", commit)
    assert config.tokenizer_dir == config.model_dir  # the model's tokenizer, same revision
    assert config.max_model_len == (512 if commit == hub.v2 else 1024)


def test_tokenizer_hub_id_and_its_revision(hub):
    config = EngineConfig(
        model=str(hub.main_dir),
        tokenizer="org/tiny",
        tokenizer_revision="v2",
        download_dir=hub.cache,
    )
    assert config.model_dir == hub.main_dir
    assert config.tokenizer == "org/tiny"
    assert config.tokenizer_dir == snapshot(hub, "org/tiny", hub.v2)
    # Only the model's own tokenizer at another revision.
    config = EngineConfig(model="org/tiny", tokenizer_revision="v2", download_dir=hub.cache)
    assert config.model_dir == snapshot(hub, "org/tiny", hub.main)
    assert config.tokenizer_dir == snapshot(hub, "org/tiny", hub.v2)


def test_a_tokenizer_id_without_tokenizer_files(hub, tmp_path):
    cache = tmp_path / "cache"
    add_snapshot(cache, "org/weights", hub.main_dir, files=["config.json", "model.safetensors"])
    with pytest.raises(FileNotFoundError, match="tokenizer 'org/weights' .* has no tokenizer "):
        EngineConfig(model=str(hub.main_dir), tokenizer="org/weights", download_dir=cache)


def test_load_format_dummy_needs_only_config_and_tokenizer(hub):
    llm = LLM("org/cfg-only", load_format="dummy", download_dir=hub.cache, device="cpu")
    out = llm.generate(["hello"], GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    reference = AutoTokenizer.from_pretrained(str(hub.main_dir))
    assert out.prompt_token_ids == reference.encode("hello")  # the cached tokenizer's ids
    with pytest.raises(FileNotFoundError) as err:
        EngineConfig(model="org/cfg-only", download_dir=hub.cache)
    assert str(err.value) == (
        f"model 'org/cfg-only' (revision 'main') has no *.safetensors weights in the Hugging "
        f"Face cache {hub.cache}, and HF_HUB_OFFLINE is set, so nothing was downloaded: run "
        f"once with network access, or `hf download org/cfg-only --cache-dir {hub.cache}`, or "
        "use load_format='dummy' (--load-format dummy) for random weights"
    )


def test_an_uncached_id_offline_is_one_line_naming_the_id_the_cache_and_the_fix(hub):
    with pytest.raises(FileNotFoundError) as err:
        LLM("org/not-cached", revision="v1", download_dir=hub.cache, device="cpu")
    assert str(err.value) == (
        f"model 'org/not-cached' (revision 'v1') is not in the Hugging Face cache {hub.cache}, "
        "and HF_HUB_OFFLINE is set, so nothing was downloaded: run once with network access, "
        f"or `hf download org/not-cached --revision v1 --cache-dir {hub.cache}`, or give a "
        "local directory"
    )
    with pytest.raises(FileNotFoundError, match="tokenizer 'org/no-tok' .* is not in the Hugging"):
        EngineConfig(model=str(hub.main_dir), tokenizer="org/no-tok", download_dir=hub.cache)


def test_a_cached_shard_missing_offline(hub, tmp_path):
    """A snapshot whose index names a shard the cache lacks (an interrupted download)."""
    src = tmp_path / "src"
    shutil.copytree(hub.main_dir, src)
    index = {"weight_map": {"w": "model-00001-of-00002.safetensors", "v": "model.safetensors"}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    add_snapshot(tmp_path / "cache", "org/partial", src)
    lacks = "'org/partial' \\(revision 'main'\\) lacks model-00001-of-00002.safetensors"
    with pytest.raises(FileNotFoundError, match=f"{lacks} \\(listed in its model.safetensors"):
        EngineConfig(model="org/partial", download_dir=tmp_path / "cache")


def test_a_local_directory_wins_and_takes_no_revision(hub, tmp_path, monkeypatch):
    # A directory spelled like a hub id is the directory.
    monkeypatch.chdir(tmp_path)
    shutil.copytree(hub.main_dir, tmp_path / "org" / "tiny")
    config = EngineConfig(model="org/tiny", download_dir=hub.cache)
    assert config.model_dir == Path("org/tiny") and config.served_model_name == "org/tiny"
    local = "revision='v2' \\(--revision\\) picks a snapshot of a Hugging Face Hub id, but model"
    with pytest.raises(ValueError, match=f"{local} 'org/tiny' is a local directory"):
        EngineConfig(model="org/tiny", revision="v2")
    missing = "model directory 'no/such/dir' does not exist: give an existing directory or a"
    with pytest.raises(FileNotFoundError, match=f"{missing} Hugging Face Hub id"):
        EngineConfig(model="no/such/dir")


@pytest.mark.parametrize(
    "name, expected",
    [
        ("mistralai/Mamba-Codestral-7B-v0.1", True),
        ("org/name", True),
        ("name", False),
        ("/abs/dir", False),
        ("./org/name", False),
        ("a/b/c", False),
        ("org--x/name", False),
        ("org/na..me", False),
    ],
)
def test_what_counts_as_a_hub_id(name, expected):
    assert is_hub_id(name) is expected
