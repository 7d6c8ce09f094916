"""The server's tokenizer work (encoding prompts, rendering chats, decoding ids) off the event
loop, so that one large prompt never holds up /health, the open streams or other requests.

Two lanes, as the size of the text decides:

* Ordinary texts go to one thread (the tokenizer's calls there run one at a time, in order,
  as vLLM's AsyncMicrobatchTokenizer keeps them). A fast (Rust) tokenizer lets go of the GIL
  while it encodes, so the event loop runs meanwhile.
* Texts over ``BIG_TEXT_CHARS`` go to a tokenizer of their own in a spawned child process.
  Measured in one process (a 20 MB prompt, 4.7 M tokens), a thread would still stall the
  loop for 0.1-0.6 s at a time: turning the ids into a Python list and freeing the Rust
  encoding hold the GIL, and its huge reallocations block the other threads' page faults.
  The child does that work on its own; the caller gets the ids back only when there are at
  most ``max_ids`` of them (the prompt fits), else just their count, which is what the
  refusal names. One big text at a time: others wait for the child, ordinary ones do not.

The child starts on the first big text (its imports take seconds; most servers never see
one), ignores Ctrl-C (the server decides when it stops), exits when the server's end of its
pipe closes, and is started again should it die (a prompt that exhausted its memory).
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing as mp
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from vllm.logger import init_logger

logger = init_logger(__name__)

# Up to this many characters (at most a few hundred thousand tokens) the thread's stalls of
# the event loop stay under ~10 ms (1 M characters: 30 ms, 4 M: 120 ms here).
BIG_TEXT_CHARS = 1 << 17


class TokenizerProcessError(RuntimeError):
    """The child tokenizer process failed or died on a text."""


@dataclass
class Encoded:
    """A text's token count, and its ids (None when there are more than ``max_ids``)."""

    count: int
    ids: list[int] | None


def _encode(tokenizer, text: str, add_special_tokens: bool, max_ids: int | None) -> Encoded:
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    fits = max_ids is None or len(ids) <= max_ids
    return Encoded(len(ids), ids if fits else None)


def _child_main(make_tokenizer: Callable, conn) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tokenizer = make_tokenizer()
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return  # the server closed its end
        try:
            reply = ("ok", _encode(tokenizer, *job))
        except Exception as err:  # noqa: BLE001 - the caller reports it
            reply = ("error", f"{type(err).__name__}: {err}")
        try:
            conn.send(reply)
        except OSError:
            return


class _Child:
    """The child process and the parent's end of its pipe."""

    def __init__(self, make_tokenizer: Callable):
        ctx = mp.get_context("spawn")
        self.conn, child_end = ctx.Pipe()
        self.proc = ctx.Process(
            target=_child_main,
            args=(make_tokenizer, child_end),
            name="vllm-tokenizer",
            daemon=True,
        )
        self.proc.start()
        # Only the child holds its end now, so its death reads as EOF here.
        child_end.close()
        logger.info(
            "started tokenizer process %d for prompts over %d characters",
            self.proc.pid,
            BIG_TEXT_CHARS,
        )

    def kill(self) -> None:
        # The thread that may be waiting on the pipe then reads EOF (closing the pipe under
        # it would not wake it).
        if self.proc.is_alive():
            self.proc.terminate()
        self.proc.join(5)


class AsyncTokenizer:
    """``tokenizer``: the server's tokenizer (encode, decode, apply_chat_template);
    ``make_tokenizer``: a picklable callable that builds the same tokenizer in the child."""

    def __init__(self, tokenizer, make_tokenizer: Callable):
        self.tokenizer = tokenizer
        self._make_tokenizer = make_tokenizer
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        # Its one thread sends a big text to the child and waits for the answer.
        self._big = ThreadPoolExecutor(1, thread_name_prefix="tokenizer-big")
        self._child: _Child | None = None
        self._closed = False

    async def run(self, fn: Callable, *args, **kwargs):
        """``fn(*args, **kwargs)`` on the tokenizer thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, functools.partial(fn, *args, **kwargs))

    async def encode(
        self, text: str, add_special_tokens: bool = True, max_ids: int | None = None
    ) -> Encoded:
        if len(text) <= BIG_TEXT_CHARS:
            return await self.run(_encode, self.tokenizer, text, add_special_tokens, max_ids)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._big, self._encode_in_child, text, add_special_tokens, max_ids
        )

    async def decode(self, token_ids: list[int], **kwargs) -> str:
        return await self.run(self.tokenizer.decode, token_ids, **kwargs)

    def _encode_in_child(self, text: str, add_special_tokens: bool, max_ids: int | None):
        if self._closed:
            raise TokenizerProcessError("the server is shutting down")
        if self._child is None or not self._child.proc.is_alive():
            if self._child is not None:
                self._child.conn.close()
            self._child = _Child(self._make_tokenizer)
        child = self._child
        try:
            child.conn.send((text, add_special_tokens, max_ids))
            kind, payload = child.conn.recv()
        except (EOFError, OSError):
            child.proc.join(1)
            if not self._closed:
                logger.error("the tokenizer process died (exit status %s)", child.proc.exitcode)
            raise TokenizerProcessError(
                f"the tokenizer process died on a text of {len(text)} characters"
            ) from None
        if kind != "ok":
            raise TokenizerProcessError(f"tokenizing failed: {payload}")
        return payload

    def shutdown(self) -> None:
        """Stop the child (a text in progress is abandoned) and the threads."""
        self._closed = True
        if self._child is not None:
            self._child.kill()
        self._thread.shutdown(wait=False, cancel_futures=True)
        self._big.shutdown(wait=False, cancel_futures=True)
