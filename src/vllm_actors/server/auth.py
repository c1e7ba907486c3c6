"""API keys (``--api-key``, ``VLLM_API_KEY``: vLLM's names): every request but ``/health`` must
carry ``Authorization: Bearer <key>`` (or, on Anthropic's ``/v1/messages`` routes, ``x-api-key:
<key>``, as Anthropic's clients send it), else it gets 401 in OpenAI's error shape.

The keys are kept as SHA-256 digests and compared with ``hmac.compare_digest`` against the digest
of what the client sent: the comparison takes the same time whatever the key and whatever was
sent (its length included), and the server keeps no key in clear after start-up. A pure ASGI
middleware: it runs before any body is read, so an unauthenticated client costs one header
lookup.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping

import msgspec
import structlog
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from vllm_actors.envs import Envs
from vllm_actors.server.errors import edge_context, error_body

log = structlog.get_logger(__name__)

API_KEY_ENV = "VLLM_API_KEY"
OPEN_PATHS = frozenset({"/health"})  # load balancers and supervisors probe without a key
X_API_KEY_PATHS = ("/v1/messages",)  # Anthropic's API: its clients send the key as ``x-api-key: <key>``


def api_keys_from(flag: Iterable[str] | str | None, environ: Mapping[str, str] | None = None) -> list[str]:
    """The keys to require: the ``--api-key`` flag's, else ``VLLM_API_KEY``'s (vLLM's rule); none
    given means no authentication. An empty key is refused (it would let an empty header in)."""
    if isinstance(flag, str):
        flag = [flag]
    keys = list(flag or [])
    if not keys:
        value = Envs(environ).VLLM_API_KEY
        keys = [value] if value else []
    if any(not key for key in keys):
        raise ValueError("--api-key must not be empty")
    return keys


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class ApiKeyMiddleware:
    """401 for any HTTP request without a valid bearer key, except on ``OPEN_PATHS``."""

    def __init__(self, app: ASGIApp, keys: Iterable[str]) -> None:
        self.app = app
        self._digests = [_digest(key.encode()) for key in keys]
        if not self._digests:
            raise ValueError("ApiKeyMiddleware needs at least one key")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _route_path(scope) in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        log.info("unauthorized request", **edge_context(scope), method=scope.get("method", ""))
        body = error_body("Unauthorized: a valid API key is required (Authorization: Bearer <key>)", 401)
        response = Response(msgspec.json.encode(body), status_code=401, media_type="application/json",
                            headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        header: bytes | None = None
        api_key: bytes | None = None
        for name, value in scope.get("headers") or ():  # the first of each counts
            if name == b"authorization" and header is None:
                header = value
            elif name == b"x-api-key" and api_key is None:
                api_key = value
        scheme, _, token = (header or b"").partition(b" ")
        sent = _digest(token.strip()) if scheme.lower() == b"bearer" else _digest(b"\0not a bearer token")
        if self._matches(sent) and scheme.lower() == b"bearer":
            return True
        path = _route_path(scope)
        anthropic = any(path == prefix or path.startswith(prefix + "/") for prefix in X_API_KEY_PATHS)
        return api_key is not None and anthropic and self._matches(_digest(api_key.strip()))

    def _matches(self, sent: bytes) -> bool:
        matched = False
        for digest in self._digests:  # every key compared: the time does not say which one matched
            matched |= hmac.compare_digest(sent, digest)
        return matched


def _route_path(scope: Scope) -> str:
    """The path inside this app (an app mounted under ``/llm`` sees ``/llm/health``)."""
    path = str(scope.get("path", ""))
    root = str(scope.get("root_path", ""))
    if root and path.startswith(root):
        path = path[len(root):]
    return path.rstrip("/") or "/"
