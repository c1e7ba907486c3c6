"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``.

The ``type`` strings and the numeric ``code`` follow vLLM's OpenAI server (``BadRequestError``,
``NotFoundError``, ...), which is what clients of vLLM already parse.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from http import HTTPStatus

import msgspec
import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = structlog.get_logger(__name__)

_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "PayloadTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    """An error the server answers in OpenAI's shape."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        *,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, object]:
        return error_body(self.message, self.status, self.param)


def error_body(message: str, status: int, param: str | None = None) -> dict[str, object]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, HTTPStatus(status).phrase.replace(" ", "") + "Error"),
            "param": param,
            "code": status,
        }
    }


def error_response(error: OpenAIError) -> Response:
    return Response(msgspec.json.encode(error.body()), status_code=error.status, headers=error.headers,
                    media_type="application/json")


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(message, 400, param=param if param is not None else param_of(message))


_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\b")


def param_of(message: str) -> str | None:
    """The field a validation message starts with ("temperature must be >= 0" -> temperature)."""
    match = _FIELD.match(message)
    return match.group(1) if match else None


def from_decode_error(error: msgspec.DecodeError | UnicodeDecodeError | RecursionError,
                      content_type: str | None = None) -> OpenAIError:
    """A body that does not decode -> 400: a msgspec error names the field ("Expected `float`, got
    `str` - at `$.temperature`"); invalid UTF-8 and JSON nested deeper than the decoder's
    recursion limit say so; malformed JSON sent with another Content-Type (a form) names it."""
    if isinstance(error, UnicodeDecodeError):
        return OpenAIError(f"the request body is not valid UTF-8: invalid byte at position {error.start}", 400)
    if isinstance(error, RecursionError):
        return OpenAIError("the request body is nested too deeply (JSON depth limit exceeded)", 400)
    text = str(error)
    media_type = (content_type or "").partition(";")[0].strip().lower()
    if not isinstance(error, msgspec.ValidationError) and media_type and not _is_json(media_type):
        return OpenAIError(f"the request body must be JSON (Content-Type: application/json), got Content-Type "
                           f"{media_type[:100]!r}: {text}", 400)
    if not isinstance(error, msgspec.ValidationError) and "UTF-8" in text:  # msgspec >= 0.23 says so itself
        return OpenAIError(f"the request body is not valid UTF-8: {text}", 400)
    if not isinstance(error, msgspec.ValidationError):
        return OpenAIError(f"the request body is not valid JSON: {text}", 400)
    message, _, where = text.partition(" - at ")
    path = where.strip("`").removeprefix("$").lstrip(".")
    missing = re.search(r"missing required field `([^`]+)`", message)
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    if not path:
        return OpenAIError(f"invalid request body: {message}", 400)
    return OpenAIError(f"{path}: {message}", 400, param=re.split(r"[.\[]", path)[0])


def _is_json(media_type: str) -> bool:
    return media_type == "application/json" or media_type.endswith("+json")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, error: OpenAIError) -> Response:
        return error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> Response:
        return error_response(OpenAIError(str(error.detail), error.status_code, headers=error.headers))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> Response:
        first = error.errors()[0] if error.errors() else {}
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        return error_response(OpenAIError(f"{'.'.join(location)}: {first.get('msg', 'invalid')}", 400,
                                          param=location[0] if location else None))

    app.add_middleware(InternalErrorMiddleware)


# --------------------------------------------------------------------------- errors at the edge
_MAX_LOGGED_ID = 64  # a client's X-Request-Id may be long: a log line carries its start only


def edge_context(scope: Scope) -> dict[str, str]:
    """What an error line at the HTTP edge names: the request id (the engine's, once the endpoint
    has made one, else the client's X-Request-Id, cut short) and the path."""
    request_id = scope.get("state", {}).get("request_id")
    if request_id is None:
        header = dict(scope.get("headers") or ()).get(b"x-request-id", b"")
        request_id = header[:_MAX_LOGGED_ID].decode("latin-1") or "-"
    return {"request_id": one_line(str(request_id), _MAX_LOGGED_ID), "path": one_line(str(scope.get("path", "")))}


def one_line(text: str, limit: int = 500) -> str:
    """``text`` cut to ``limit`` characters, control characters escaped: a client's path (``%0A``
    decodes to a newline) or message can neither split a log line nor forge one."""
    return text[:limit].encode("unicode_escape").decode("ascii")


def log_edge_error(message: str, scope: Scope, error: BaseException) -> None:
    """One line per failure (error level), the traceback on a second line at debug level only (a
    traceback with local variables ran to ~1,460 lines per failed request)."""
    context = edge_context(scope)
    log.error(message, **context, error=repr(error)[:500])  # repr: a message's newlines stay escaped
    log.debug(f"{message}: traceback", **context, exc_info=error)


class InternalErrorMiddleware:
    """An unexpected exception is a 500 in OpenAI's shape, logged as one line, and the connection
    stays open: Starlette's own handler for ``Exception`` re-raises after answering, which makes
    the server log the traceback again and drop the keep-alive connection. An exception after the
    response has started (a stream) cannot be answered any more: logged, and the connection ends."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except ClientDisconnect:  # the client left before its body was whole: nobody to answer
            log.debug("client left before its request body was whole", path=scope.get("path"))
        except Exception as error:
            log_edge_error("request failed", scope, error)
            if not started:
                response = error_response(OpenAIError(f"internal server error: {type(error).__name__}", 500))
                await response(scope, receive, send)
