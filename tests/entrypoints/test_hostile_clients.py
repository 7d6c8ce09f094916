"""Clients that misbehave, against a real server process over real HTTP: clients that leave
halfway through a request body (one log line each, no traceback, the server serves on)."""

from __future__ import annotations

import socket
import time

import pytest

from tests.entrypoints.utils import assert_serves

pytestmark = pytest.mark.timeout(300)


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _leave_mid_body(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"prompt":')


def test_clients_that_leave_mid_body(server):
    """20 clients send headers (Content-Length 1000) and 10 bytes, then close: at most one
    INFO line each, no ERROR, no traceback, and the server serves on."""
    before = len(server.log())
    for _ in range(20):
        _leave_mid_body(server.port)
    # The server notices each close as it comes: wait until it logged all of them.
    _wait_for(lambda: server.log()[before:].count("\n") >= 20, 60, "the server's log lines")
    time.sleep(0.5)  # anything more it would write about them
    lines = server.log()[before:].splitlines()
    assert len(lines) <= 20, "\n".join(lines)
    assert all(line.startswith(("INFO", "DEBUG")) for line in lines), "\n".join(lines)
    assert not any("Traceback" in line for line in lines), "\n".join(lines)
    assert_serves(server)
