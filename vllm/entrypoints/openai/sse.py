"""Server-Sent Events, and the client-disconnect watch every generation request runs under.

A stream is ``data: {json}\\n\\n`` per chunk and ``data: [DONE]\\n\\n`` at the end, as OpenAI
sends it. A client that goes away must abort its engine request at once (its state slot is
a scarce resource: max_num_seqs of them): the stream, or the non-streaming handler, runs in a
task that a watcher on the ASGI ``receive`` channel cancels on ``http.disconnect``, and the
cancellation reaches the engine stream's ``finally`` (serving_engine.py aborts there).
Starlette's own StreamingResponse notices a disconnect only when its next send fails (ASGI
2.4), which leaves the request running until it yields again.

When the server stops, uvicorn cancels what is still running after its graceful timeout;
the client is then told why its answer ends (a 503 error event and [DONE] in a stream, a 503
body otherwise) instead of finding the connection cut.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from http import HTTPStatus
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from vllm.entrypoints.openai.errors import APIError

DONE = "data: [DONE]\n\n"
T = TypeVar("T")


def sse_data(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


def sse_error(err: APIError) -> str:
    return f"data: {err.body().model_dump_json()}\n\n"


def shutting_down() -> APIError:
    return APIError("the server is shutting down", HTTPStatus.SERVICE_UNAVAILABLE)


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _first_done(work: asyncio.Future, watcher: asyncio.Future) -> None:
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Either the work finished (stop watching) or the client left (stop working); a
        # cancellation of this task itself (server shutdown) stops both as well.
        for task in (work, watcher):
            task.cancel()
        # Waits for the cancelled side to unwind (its finally blocks abort the engine
        # request); the caller reads the work's outcome from the task.
        await asyncio.gather(work, watcher, return_exceptions=True)


class SSEResponse(StreamingResponse):
    """A text/event-stream response whose generator is cancelled when the client leaves."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]):
        super().__init__(content, headers={"Cache-Control": "no-cache"})
        self._started = False

    async def _send(self, send: Send, message: Message) -> None:
        self._started = self._started or message["type"] == "http.response.start"
        await send(message)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        work = asyncio.ensure_future(self.stream_response(lambda m: self._send(send, m)))
        watcher = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await _first_done(work, watcher)
        except asyncio.CancelledError:
            # Only uvicorn's shutdown cancels a request; what it wants is this request
            # over, which it is once the client has been told.
            await self._send_shutdown(send)
            return
        finally:
            # A cancellation that landed in a send leaves the generator suspended at a
            # yield: close it now, not at garbage collection (its finally aborts).
            await self.body_iterator.aclose()
        if not work.cancelled() and work.exception() is not None:
            exc = work.exception()
            if not isinstance(exc, OSError):  # OSError: the client went away mid-send
                raise exc

    async def _send_shutdown(self, send: Send) -> None:
        body = (sse_error(shutting_down()) + DONE).encode()
        with contextlib.suppress(OSError):  # the client may be gone as well
            if not self._started:
                await send(
                    {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
                )
            await send({"type": "http.response.body", "body": body, "more_body": False})


class ClientDisconnected(Exception):
    """The client went away before a non-streaming response was ready."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``await work``, cancelled (ClientDisconnected) if the client disconnects first; a
    server shutdown that cancels it is a 503."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnect(request.receive))
    try:
        await _first_done(task, watcher)
    except asyncio.CancelledError:
        raise shutting_down() from None
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()
