"""Fixtures of the server tests: the tiny model directories (made once per session) and a
helper that starts one real server per test module.

The tiny model here has one layer: these tests check the server (HTTP, streaming, queuing,
errors, outputs equal to offline ones), which a second layer leaves as it is while doubling
every interpreted step; tests/models compares the model itself with HF transformers'."""

from __future__ import annotations

import pytest

from tests.entrypoints.utils import serve_for_module
from tests.tiny_model import make_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_mamba2"), num_hidden_layers=1)


@pytest.fixture(scope="session")
def tiny_model_dir_no_template(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_no_template")
    return make_tiny_model_dir(path, chat_template=None, num_hidden_layers=1)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    """One server for the whole module (start-up costs seconds on the CPU); it must exit
    cleanly (status 0) on SIGTERM at the end."""
    yield from serve_for_module(tiny_model_dir)


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()
