"""vllm/benchmarks/client.py against a real HTTP server (aiohttp.web on a local port, in the
test's event loop) that streams on purpose what a real server does now and then: events split
across TCP writes, an error event mid-stream, an HTTP error, a stream without usage, one cut
off before [DONE], one without text, a refused connection. Each request's outcome, error
text and timings are checked."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from aiohttp import web

from vllm.benchmarks.client import RequestInput, send_request

GAP_S = 0.05


def event(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def text_chunk(text: str) -> bytes:
    return event({"choices": [{"index": 0, "text": text, "finish_reason": None}]})


def chat_chunk(text: str) -> bytes:
    return event({"choices": [{"index": 0, "delta": {"content": text}}]})


USAGE = event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}})
DONE = b"data: [DONE]\n\n"


async def _stream(request: web.Request, parts: list[bytes]) -> web.StreamResponse:
    body = await request.json()
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for part in parts:
        await resp.write(part)
        await asyncio.sleep(GAP_S)
    return resp


def make_app(seen: list) -> web.Application:
    async def ok(request):
        seen.append(await request.json())
        first = text_chunk(" one")
        # The second event arrives in two writes: the client must wait for its end.
        second = text_chunk(" two")
        return await _stream(
            request, [first, second[:9], second[9:], text_chunk(" three"), USAGE, DONE]
        )

    async def chat(request):
        seen.append(await request.json())
        role = event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        return await _stream(request, [role, chat_chunk("Hi"), chat_chunk("!"), USAGE, DONE])

    async def error_mid(request):
        err = {"error": {"message": "the engine died", "type": "InternalServerError"}}
        return await _stream(request, [text_chunk(" one"), event(err), DONE])

    async def http_400(request):
        body = {"error": {"message": "prompt too long", "type": "BadRequestError"}}
        return web.json_response(body, status=400)

    async def no_usage(request):
        return await _stream(request, [text_chunk("a"), text_chunk("b"), DONE])

    async def cut(request):
        return await _stream(request, [text_chunk(" one"), text_chunk(" two")])

    async def empty(request):
        return await _stream(request, [USAGE, DONE])

    app = web.Application()
    for path, handler in [
        ("/ok", ok),
        ("/chat", chat),
        ("/error_mid", error_mid),
        ("/http_400", http_400),
        ("/no_usage", no_usage),
        ("/cut", cut),
        ("/empty", empty),
    ]:
        app.router.add_post(path, handler)
    return app


def run_requests(cases: list[tuple[str, str]], extra_url: str | None = None):
    """Start the app, send one request per (backend, path), stop; the outputs and the
    bodies the server saw."""
    seen: list = []

    async def main():
        runner = web.AppRunner(make_app(seen))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with aiohttp.ClientSession() as session:
                outs = []
                for backend, path in cases:
                    url = extra_url if path == "EXTRA" else f"http://127.0.0.1:{port}{path}"
                    inp = RequestInput("hello", 2, 3, url, "m", ignore_eos=True)
                    t0 = time.perf_counter()
                    outs.append(
                        (await send_request(session, backend, inp), time.perf_counter() - t0)
                    )
                return outs
        finally:
            await runner.cleanup()

    return asyncio.run(main()), seen


def test_timings_usage_and_split_events():
    [(out, wall), (chat, _)], seen = run_requests([("openai", "/ok"), ("openai-chat", "/chat")])
    assert out.success and out.error == ""
    assert out.generated_text == " one two three" and out.output_tokens == 3
    # TTFT at the first text chunk; the split second event counts once, when it completes.
    assert 0 < out.ttft < GAP_S and len(out.itl) == 2
    assert all(gap >= 0.9 * GAP_S for gap in out.itl)
    assert out.latency == pytest.approx(out.ttft + sum(out.itl), abs=1e-6)
    assert out.latency < wall
    assert seen[0]["prompt"] == "hello" and seen[0]["max_tokens"] == 3
    assert seen[0]["ignore_eos"] is True and seen[0]["temperature"] == 0.0
    # Chat: the role-only delta is no token; content deltas are.
    assert chat.success and chat.generated_text == "Hi!" and len(chat.itl) == 1
    assert seen[1]["messages"] == [{"role": "user", "content": "hello"}]
    assert seen[1]["max_completion_tokens"] == 3


@pytest.mark.parametrize(
    "path, success, error",
    [
        ("/error_mid", False, "error event in the stream: the engine died"),
        ("/http_400", False, "HTTP 400: prompt too long"),
        ("/no_usage", True, ""),
        ("/cut", False, "the stream ended before [DONE]"),
        ("/empty", False, "the stream ended without any text"),
    ],
    ids=["error_mid_stream", "http_error", "no_usage", "cut_before_done", "no_text"],
)
def test_failures_are_reported_with_their_text(path, success, error):
    [(out, _)], _ = run_requests([("openai", path)])
    assert out.success is success
    assert out.error.startswith(error)
    if path == "/no_usage":
        assert out.output_tokens is None and out.generated_text == "ab"
    if path == "/error_mid":
        assert out.generated_text == " one"  # what came before the error is kept


def test_connection_refused_is_a_failed_request():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1/completions"  # bound, not listening
        [(out, _)], _ = run_requests([("openai", "EXTRA")], extra_url=url)
    assert not out.success and out.error.startswith("ClientConnectorError")
