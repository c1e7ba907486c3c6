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
from starlette.responses import Response

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

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> Response:
        log.exception("request failed", path=request.url.path)
        return error_response(OpenAIError(f"internal server error: {type(error).__name__}", 500))
