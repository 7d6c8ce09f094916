"""Errors as OpenAI sends them: ``{"error": {"message", "type", "param", "code"}}``.

``type`` is the OpenAI client's exception name for the status (as upstream vLLM names it),
``code`` the HTTP status. Everything a handler refuses is an ``APIError``; the app turns it
into this body (``api_server.py``), or, once a stream has started, into an SSE event.
"""

from __future__ import annotations

from http import HTTPStatus

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from vllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """A request the server refuses or cannot serve, with what the client is told."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.param = param

    def body(self) -> ErrorResponse:
        error_type = _TYPES.get(self.status)
        if error_type is None:
            error_type = HTTPStatus(self.status).phrase.replace(" ", "") + "Error"
        return ErrorResponse(
            error=ErrorInfo(
                message=self.message, type=error_type, param=self.param, code=self.status
            )
        )

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(message, HTTPStatus.BAD_REQUEST, param)


def from_validation_error(err: ValidationError) -> APIError:
    """A 400 naming the first offending field (its dotted path in ``param``)."""
    errors = err.errors(include_url=False)
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    if first["type"] == "json_invalid":
        reason = first.get("ctx", {}).get("error", first["msg"])
        return bad_request(f"the request body is not valid JSON: {reason}")
    loc = [str(part) for part in first["loc"]]
    # A union reports each member it tried ("str", "list[int]", ...) in the path; the
    # client named a field, not a type.
    loc = [p for p in loc if not _is_type_name(p)]
    param = ".".join(loc) or None
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "model_type" and not loc:
        msg = "the request body must be a JSON object"
    where = f"field '{param}': " if param else ""
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return bad_request(f"{where}{msg}{more}", param)


def _is_type_name(part: str) -> bool:
    return part in ("str", "int", "float", "bool") or part.startswith(("list[", "dict["))
