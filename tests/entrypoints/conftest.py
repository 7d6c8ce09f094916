"""Fixtures of the server tests: the tiny model directories (made once per session) and a
helper that starts one real server per test module."""

from __future__ import annotations

import pytest

from tests.entrypoints.utils import serve_for_module
from tests.tiny_model import make_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_mamba2"))


@pytest.fixture(scope="session")
def tiny_model_dir_no_template(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_no_template"), chat_template=None)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    """One server for the whole module (start-up costs seconds on the CPU); it must exit
    cleanly (status 0) on SIGTERM at the end."""
    yield from serve_for_module(tiny_model_dir)


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()
