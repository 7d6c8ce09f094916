"""The OpenAI-compatible HTTP server: FastAPI routes over one ``AsyncLLM``, run by uvicorn.

    python -m vllm.entrypoints.openai.api_server --model DIR [options]   # or: vllm serve DIR

``build_app(engine, args)`` makes the app for an engine that already runs (tests and
``run_server`` use it); its lifespan shuts the engine down when the server stops. On SIGTERM
(or Ctrl-C) uvicorn stops accepting, gives in-flight requests ``--timeout-graceful-shutdown``
seconds, cancels the rest (which aborts their engine requests), then the engine stops and
the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hmac
import json
import signal
from contextlib import asynccontextmanager
from http import HTTPStatus

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

import vllm
from vllm import envs
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.metrics import PrometheusStatLogger
from vllm.engine.tokenizer import get_tokenizer
from vllm.entrypoints.cli.startup import run_or_exit
from vllm.entrypoints.openai.async_tokenizer import AsyncTokenizer
from vllm.entrypoints.openai.errors import APIError, from_validation_error
from vllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from vllm.entrypoints.openai.protocol_tokenize import DetokenizeRequest, tokenize_request_type
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm.entrypoints.openai.serving_models import OpenAIServingModels
from vllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from vllm.entrypoints.openai.sse import ClientDisconnected
from vllm.logger import init_logger

logger = init_logger(__name__)

# Status for a request whose client left before its answer (nginx's; nobody reads it).
CLIENT_CLOSED_REQUEST = 499


class APIKeyMiddleware:
    """Bearer auth on /v1/*, as ``vllm serve --api-key`` has it (health, metrics, version
    and the tokenizer endpoints stay open for probes and scrapers)."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            # Constant time: the comparison must not tell an attacker how much matched.
            if not hmac.compare_digest(given, self.expected):
                err = APIError("Unauthorized: a valid API key is required", HTTPStatus.UNAUTHORIZED)
                response = err.response()
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _validate(body: bytes, model):
    """The JSON body as ``model``; malformed JSON or a field of the wrong type or range is a
    400 naming the field (not FastAPI's 422: OpenAI clients expect 400)."""
    try:
        return model.model_validate_json(body)
    except ValidationError as err:
        raise from_validation_error(err) from None


def build_app(engine, args: argparse.Namespace, stat_logger: PrometheusStatLogger | None = None):
    """The FastAPI app serving ``engine`` (an ``AsyncLLM``). ``args`` gives the server
    options (``api_key``); ``stat_logger``, the engine's Prometheus logger, feeds /metrics."""
    config = engine.config
    models = OpenAIServingModels(config.served_model_name, str(config.model), config.max_model_len)
    # The child tokenizer process (for big prompts) builds the tokenizer as the engine did.
    make_tokenizer = functools.partial(
        get_tokenizer, config.tokenizer_dir, engine.tokenizer.vocab_size
    )
    async_tokenizer = AsyncTokenizer(engine.tokenizer, make_tokenizer)
    details = bool(getattr(args, "enable_prompt_tokens_details", False))
    completion = OpenAIServingCompletion(engine, models, async_tokenizer, details)
    chat = OpenAIServingChat(engine, models, async_tokenizer, details)
    tokenization = OpenAIServingTokenization(engine, models, async_tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:
            logger.info("shutting down the engine")
            async_tokenizer.shutdown()
            await engine.shutdown()
            app.state.engine_stopped = True

    app = FastAPI(title="vllm", version=vllm.__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.engine_stopped = False

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError):
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException):
        message = err.detail if isinstance(err.detail, str) else HTTPStatus(err.status_code).phrase
        return APIError(message, err.status_code).response()

    @app.exception_handler(ClientDisconnected)
    async def client_gone(_: Request, err: ClientDisconnected):
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(ClientDisconnect)
    async def client_gone_mid_body(request: Request, err: ClientDisconnect):
        # The client's doing, not a fault of ours: one line (anyone can open connections
        # and drop them, and a traceback each would flood the log).
        client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
        logger.info(
            "%s left before sending the whole body of %s %s",
            client,
            request.method,
            request.url.path,
        )
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception):
        # The traceback stays in the server's log; the client learns only that it failed.
        # (uvicorn logs the traceback after this handler: Starlette re-raises the error.)
        logger.error("unhandled error in %s %s: %r", request.method, request.url.path, err)
        return APIError("Internal server error", HTTPStatus.INTERNAL_SERVER_ERROR).response()

    @app.get("/health")
    async def health():
        if engine.errored:
            return APIError("the engine loop has died", HTTPStatus.INTERNAL_SERVER_ERROR).response()
        return Response(status_code=HTTPStatus.OK)

    @app.get("/version")
    async def version():
        return {"version": vllm.__version__}

    @app.get("/v1/models")
    async def show_models():
        return models.show_available_models()

    @app.post("/v1/completions")
    async def create_completion(raw_request: Request):
        request = _validate(await raw_request.body(), CompletionRequest)
        return await completion.create_completion(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(raw_request: Request):
        request = _validate(await raw_request.body(), ChatCompletionRequest)
        return await chat.create_chat_completion(request, raw_request)

    @app.post("/tokenize")
    async def tokenize(raw_request: Request):
        body = await raw_request.body()
        try:
            data = json.loads(body)
        except ValueError:
            data = None  # _validate reports the malformed JSON
        return await tokenization.tokenize(_validate(body, tokenize_request_type(data)))

    @app.post("/detokenize")
    async def detokenize(raw_request: Request):
        body = await raw_request.body()
        return await tokenization.detokenize(_validate(body, DetokenizeRequest))

    if getattr(args, "enable_tokenizer_info_endpoint", False):

        @app.get("/tokenizer_info")
        async def tokenizer_info():
            return tokenization.tokenizer_info()

    @app.get("/metrics")
    async def metrics():
        if stat_logger is None:
            return Response(b"", media_type=CONTENT_TYPE_LATEST)
        stat_logger.set_queue_lengths(engine.num_requests_running, engine.num_requests_waiting)
        return Response(generate_latest(stat_logger.registry), media_type=CONTENT_TYPE_LATEST)

    api_key = getattr(args, "api_key", None) or envs.VLLM_API_KEY
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app


def make_arg_parser(parser: argparse.ArgumentParser, positional_model: bool):
    """The server's options plus every engine option (``EngineArgs.add_cli_args``)."""
    if positional_model:
        parser.add_argument("model", help="HF model directory or Hub id (ORG/NAME) to serve")
    else:
        parser.add_argument("--model", required=True, help="HF model dir or Hub id to serve")
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    g.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
    )
    g.add_argument(
        "--timeout-graceful-shutdown",
        type=float,
        default=3.0,
        help="seconds in-flight requests get to finish after SIGTERM before they are aborted",
    )
    g.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="serve GET /tokenizer_info (the tokenizer's special tokens and chat template; "
        "lm-eval's tokenizer_backend=remote reads it)",
    )
    g.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage gets prompt_tokens_details.cached_tokens: the prompt tokens restored "
        "from the prefix cache (vLLM's option; off by default)",
    )
    EngineArgs.add_cli_args(parser)
    return parser


async def run_server(args: argparse.Namespace) -> None:
    """Start the engine (weights, compile, graphs: before the port opens), then serve."""
    from vllm.engine.async_llm import AsyncLLM

    config = EngineArgs.from_cli_args(args).create_engine_config()
    stat_logger = PrometheusStatLogger(config.served_model_name)
    engine = AsyncLLM(config, stat_loggers=[stat_logger])
    app = build_app(engine, args, stat_logger)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            timeout_graceful_shutdown=args.timeout_graceful_shutdown,
        )
    )
    # uvicorn handles SIGINT/SIGTERM while it serves (the graceful shutdown above) and, once
    # done, re-raises the signal to whatever handler was installed before it started. This
    # one makes that a clean exit (status 0) instead of death by signal. Installed only now,
    # so that a signal during the engine's start-up still stops the process at once.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: None)
    try:
        await server.serve()
    finally:
        if not app.state.engine_stopped:  # uvicorn failed before its lifespan ran
            await engine.shutdown()
    logger.info("server stopped")


def run(args: argparse.Namespace) -> None:
    asyncio.run(run_server(args))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m vllm.entrypoints.openai.api_server",
        description="OpenAI-compatible server for a Mamba2 model",
    )
    args = make_arg_parser(parser, positional_model=False).parse_args(argv)
    run_or_exit(parser.prog, run, args)


if __name__ == "__main__":
    main()
