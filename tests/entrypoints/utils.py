"""A real server in a subprocess, for tests that talk to it over HTTP.

    with RemoteServer(model_dir, ["--max-num-seqs", "4"]) as server:
        client = server.openai_client()
        httpx.get(server.url_for("health"))

It runs ``python -m vllm.entrypoints.openai.api_server`` (or the ``vllm serve`` console
script) on 127.0.0.1 at a free port, with TRITON_INTERPRET=1 when there is no GPU, waits
for /health, shows the server's log when start-up fails, and stops it with SIGTERM.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny-mamba2"
MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 4
# What every test server runs with: 4 slots (so 32 clients must queue) and a short context
# (so length errors need short prompts only).
SERVER_ARGS = [
    "--served-model-name",
    MODEL_NAME,
    "--max-num-seqs",
    str(MAX_NUM_SEQS),
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--seed",
    "0",
]
STARTUP_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 20.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    import torch

    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


class RemoteServer:
    """``args`` are the server's options after the model; ``console_script`` starts it as
    ``vllm serve MODEL`` instead of the module form."""

    def __init__(
        self,
        model: str | os.PathLike,
        args: list[str] = (),
        *,
        console_script: bool = False,
        api_key: str | None = None,
    ):
        self.model = str(model)
        self.port = free_port()
        self.api_key = api_key
        extra = [*args, "--host", "127.0.0.1", "--port", str(self.port)]
        if api_key is not None:
            extra += ["--api-key", api_key]
        if console_script:
            exe = shutil.which("vllm", path=str(Path(sys.executable).parent))
            if exe is None:
                raise RuntimeError("the vllm console script is not installed beside python")
            self.cmd = [exe, "serve", self.model, *extra]
        else:
            module = "vllm.entrypoints.openai.api_server"
            self.cmd = [sys.executable, "-m", module, "--model", self.model, *extra]
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.TemporaryFile(mode="w+b")

    # -- life cycle ------------------------------------------------------------------

    def __enter__(self) -> RemoteServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.cmd, cwd=REPO, env=server_env(), stdout=self._log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the server exited with {self.proc.returncode} during start-up:\n{self.log()}"
                )
            try:
                if httpx.get(self.url_for("health"), timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.kill()
        raise RuntimeError(
            f"the server did not answer /health in {STARTUP_TIMEOUT_S} s:\n{self.log()}"
        )

    def terminate(self) -> None:
        """SIGTERM, as an orchestrator stops a server."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        self.terminate()
        try:
            return self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(
                f"the server ignored SIGTERM for {STOP_TIMEOUT_S} s:\n{self.log()}"
            ) from None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log(self) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    # -- clients ---------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url_for(self, *parts: str) -> str:
        return "/".join([self.base_url, *parts])

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def openai_client(self, **kwargs):
        import openai

        return openai.OpenAI(
            base_url=self.url_for("v1"), api_key=self.api_key or "EMPTY", max_retries=0, **kwargs
        )

    def async_openai_client(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(
            base_url=self.url_for("v1"), api_key=self.api_key or "EMPTY", max_retries=0, **kwargs
        )


def serve_for_module(model: str | os.PathLike, args: list[str] = SERVER_ARGS, **kwargs):
    """The body of a module-scoped server fixture (``yield from serve_for_module(...)``): a
    started ``RemoteServer``, which must exit cleanly (status 0) on SIGTERM at the end."""
    remote = RemoteServer(model, args, **kwargs)
    remote.start()
    try:
        yield remote
    finally:
        status = remote.stop()
    assert status == 0, remote.log()


def assert_serves(server: RemoteServer) -> None:
    """The server still answers a real generation (after a bad request, a disconnect...)."""
    r = httpx.post(
        server.url_for("v1", "completions"),
        json={"model": MODEL_NAME, "prompt": "still there?", "max_tokens": 1},
        headers=server.headers(),
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


def assert_error_body(response: httpx.Response, status: int, error_type: str) -> dict:
    """OpenAI's error body, and nothing of the server's insides."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == error_type and error["code"] == status, error
    assert isinstance(error["message"], str) and error["message"], error
    assert "Traceback" not in response.text and 'File "' not in response.text
    return error


def iter_sse(response: httpx.Response):
    """The ``data:`` payloads of an SSE response as they arrive; asserts the framing (every
    event is one ``data:`` line followed by a blank line)."""
    lines = response.iter_lines()
    for line in lines:
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        yield line[len("data: ") :]
        assert next(lines, "") == "", "an SSE event must end with a blank line"


def read_sse(response: httpx.Response) -> list[str]:
    return list(iter_sse(response))


def stream_post(server, path: str, body: dict, timeout: float = 120) -> list[str]:
    """POST with stream=True over raw HTTP; the SSE payloads (the last one [DONE])."""
    with httpx.stream(
        "POST",
        server.url_for(*path.split("/")),
        json=body,
        headers=server.headers(),
        timeout=timeout,
    ) as r:
        assert r.status_code == 200, r.read().decode()
        assert r.headers["content-type"].startswith("text/event-stream")
        return read_sse(r)
