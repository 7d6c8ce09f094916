"""Fixtures of the server tests: the tiny model directories (made once per session) and a
helper that starts one real server per test module."""

from __future__ import annotations

import pytest

from tests.entrypoints.utils import SERVER_ARGS, RemoteServer
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
    remote = RemoteServer(tiny_model_dir, SERVER_ARGS)
    remote.start()
    try:
        yield remote
    finally:
        status = remote.stop()
    assert status == 0, remote.log()


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()
