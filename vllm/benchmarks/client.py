"""One streamed request to an OpenAI-compatible server, timed chunk by chunk (aiohttp).

Backends: ``openai`` (POST /v1/completions, ``prompt``, ``max_tokens``) and ``openai-chat``
(POST /v1/chat/completions, one user message, ``max_completion_tokens``). Both ask for
``stream: true`` and ``stream_options: {"include_usage": true}``, greedy sampling, and
``ignore_eos`` when given. A completions prompt may be token ids; with ``return_token_ids``
(vLLM's request field) the output's token ids are collected from the chunks' ``token_ids``
(multiturn.py's token-level history).

Timing (``time.perf_counter``): TTFT is the arrival of the first chunk that carries text
(or, with ``return_token_ids``, token ids: a token whose text is an unfinished character
still arrives), each later such chunk adds one inter-token latency (the gap since the
previous one; the server sends one chunk per engine step), and the end-to-end latency ends
at the last such chunk. The output token count is the ``completion_tokens`` of the final
usage chunk; its ``prompt_tokens`` and, from a server run with --enable-prompt-tokens-details,
``prompt_tokens_details.cached_tokens`` (the prompt tokens its prefix cache restored) are
kept too. A chat request's prompt is one user message, or a list of messages (the history
of a multi-turn conversation, multiturn.py).

A request fails, with its error text kept, on an HTTP status other than 200 (the error
body's message), an error event in the stream, a connection error or timeout, a stream
that ends without any text chunk, or one that ends before ``data: [DONE]``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import aiohttp

# A request may queue behind many others at rate inf: the same generous bound as vLLM's.
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)


@dataclass
class RequestInput:
    prompt: str | list[dict] | list[int]  # chat messages (openai-chat), token ids (openai)
    prompt_len: int
    output_len: int
    api_url: str
    model: str
    ignore_eos: bool = False
    headers: dict = field(default_factory=dict)
    return_token_ids: bool = False  # vLLM's field: the output's ids come back in the chunks


@dataclass
class RequestOutput:
    prompt_len: int = 0
    success: bool = False
    generated_text: str = ""
    output_tokens: int | None = None  # the server's usage count (None: no usage chunk)
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""
    server_prompt_tokens: int | None = None  # usage.prompt_tokens
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    turn: int = 0  # the conversation turn (multiturn.py; 0: a single-turn request)
    reusable_tokens: int = 0  # multiturn.py: what the previous turn ran through the model
    output_token_ids: list[int] | None = None  # with return_token_ids: the generated ids


def completions_payload(inp: RequestInput) -> dict:
    prompt = inp.prompt
    if not (isinstance(prompt, str) or all(isinstance(t, int) for t in prompt)):
        raise ValueError("the openai backend takes a text or token-id prompt, not chat messages")
    return {"model": inp.model, "prompt": prompt, "max_tokens": inp.output_len}


def chat_payload(inp: RequestInput) -> dict:
    messages = inp.prompt
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    return {
        "model": inp.model,
        "messages": messages,
        "max_completion_tokens": inp.output_len,
    }


def completions_text(choice: dict) -> str:
    return choice.get("text") or ""


def chat_text(choice: dict) -> str:
    return (choice.get("delta") or {}).get("content") or ""


BACKENDS = {
    "openai": ("/v1/completions", completions_payload, completions_text),
    "openai-chat": ("/v1/chat/completions", chat_payload, chat_text),
}


def error_message(status: int, body: bytes) -> str:
    """``HTTP 400: <message>`` from an OpenAI error body, else the body's start."""
    text = body.decode("utf-8", errors="replace")
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = text.strip()[:500] or "(empty body)"
    return f"HTTP {status}: {message}"


def sse_events(buffer: bytes) -> tuple[list[str], bytes]:
    """The complete events' ``data`` payloads in ``buffer``, and the unfinished rest."""
    *events, rest = buffer.replace(b"\r\n", b"\n").split(b"\n\n")
    payloads = []
    for event in events:
        lines = [ln[5:].lstrip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
        if lines:
            payloads.append(b"\n".join(lines).decode("utf-8"))
    return payloads, rest


class _Stream:
    """Folds the payloads of one stream into a RequestOutput."""

    def __init__(self, out: RequestOutput, start: float, text_of):
        self.out, self.start, self.text_of = out, start, text_of
        self.last: float | None = None
        self.done = False

    def feed(self, payload: str, now: float) -> None:
        if payload == "[DONE]":
            self.done = True
            return
        data = json.loads(payload)
        if "error" in data:
            err = data["error"]
            message = err.get("message") if isinstance(err, dict) else err
            self.fail(f"error event in the stream: {message}")
            return
        choices = data.get("choices") or ()
        text = "".join(self.text_of(c) for c in choices)
        ids = [t for c in choices for t in (c.get("token_ids") or ())]
        if ids:
            if self.out.output_token_ids is None:
                self.out.output_token_ids = []
            self.out.output_token_ids.extend(ids)
        if text or ids:
            if self.last is None:
                self.out.ttft = now - self.start
            else:
                self.out.itl.append(now - self.last)
            self.last = now
            self.out.generated_text += text
        usage = data.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            self.out.output_tokens = usage["completion_tokens"]
        if usage:
            self.out.server_prompt_tokens = usage.get("prompt_tokens")
            details = usage.get("prompt_tokens_details") or {}
            self.out.cached_tokens = details.get("cached_tokens")

    def fail(self, message: str) -> None:
        if not self.out.error:  # the first error is the cause; later ones follow from it
            self.out.error = message

    def finish(self) -> RequestOutput:
        out = self.out
        if not out.error and self.last is None:
            out.error = "the stream ended without any text"
        if not out.error and not self.done:
            out.error = "the stream ended before [DONE] (the answer may be cut short)"
        out.success = not out.error
        out.latency = (self.last - self.start) if self.last is not None else 0.0
        return out


async def send_request(
    session: aiohttp.ClientSession, backend: str, inp: RequestInput, pbar=None
) -> RequestOutput:
    _, make_payload, text_of = BACKENDS[backend]
    payload = {
        **make_payload(inp),
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if inp.ignore_eos:
        payload["ignore_eos"] = True
    if inp.return_token_ids:
        payload["return_token_ids"] = True
    out = RequestOutput(prompt_len=inp.prompt_len)
    start = time.perf_counter()
    stream = _Stream(out, start, text_of)
    try:
        async with session.post(inp.api_url, json=payload, headers=inp.headers) as response:
            if response.status != 200:
                stream.fail(error_message(response.status, await response.read()))
            else:
                buffer = b""
                async for data in response.content.iter_any():
                    now = time.perf_counter()
                    payloads, buffer = sse_events(buffer + data)
                    for p in payloads:
                        stream.feed(p, now)
    except (aiohttp.ClientError, TimeoutError, ValueError, UnicodeDecodeError) as err:
        stream.fail(f"{type(err).__name__}: {err}")
    result = stream.finish()
    if pbar is not None:
        pbar.update(1)
    return result
