"""The serve command's transport flags, vLLM's names: TLS (``--ssl-*``), CORS (``--allowed-*``,
``--allow-credentials``), ``--enable-request-id-headers`` and ``--show-hidden-metrics-for-version``;
what uvicorn and the app make of them (``ssl_kwargs``, ``add_cors``, ``RequestIdHeaders``)."""

from __future__ import annotations

import argparse
import json
import ssl
import uuid
from typing import Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send


def _json_list(text: str) -> list[str]:
    """vLLM's list flags: a JSON list (``'["https://a.example"]'``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}") from None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def version_string(text: str) -> str:
    """``--show-hidden-metrics-for-version``: a version such as ``0.25`` or ``0.25.1``."""
    from packaging.version import InvalidVersion, Version

    try:
        Version(text)
    except InvalidVersion:
        raise argparse.ArgumentTypeError(f"expected a version such as 0.25, got {text!r}") from None
    return text


def add_http_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("TLS and CORS", "vLLM's flags")
    group.add_argument("--ssl-keyfile", default=None, help="the TLS private key file: serve HTTPS")
    group.add_argument("--ssl-certfile", default=None, help="the TLS certificate file (with --ssl-keyfile)")
    group.add_argument("--ssl-ca-certs", default=None, help="CA certificates to verify clients' certificates with")
    group.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE),
                       help="whether client certificates are required: 0 none, 1 optional, 2 required "
                            "(Python's ssl.CERT_*; default 0)")
    group.add_argument("--allowed-origins", type=_json_list, default=["*"], help='CORS origins (JSON list; ["*"])')
    group.add_argument("--allowed-methods", type=_json_list, default=["*"], help='CORS methods (JSON list; ["*"])')
    group.add_argument("--allowed-headers", type=_json_list, default=["*"], help='CORS headers (JSON list; ["*"])')
    group.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    parser.add_argument("--enable-request-id-headers", action="store_true",
                        help="add an X-Request-Id header to every response: the request's own, else a random one")
    parser.add_argument("--show-hidden-metrics-for-version", type=version_string, default=None,
                        help="show again the metrics hidden since the given version (e.g. 0.25) while they "
                             "are deprecated (vLLM's flag; no metric is deprecated here yet)")


def check_ssl(keyfile: str | None, certfile: str | None, cert_reqs: int) -> None:
    """A key needs its certificate and the reverse; ``--ssl-cert-reqs`` is one of ssl.CERT_*."""
    if (keyfile is None) != (certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both or neither")
    if cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
        raise ValueError(f"--ssl-cert-reqs must be 0, 1 or 2, got {cert_reqs}")


def ssl_kwargs(keyfile: str | None, certfile: str | None, ca_certs: str | None, cert_reqs: int) -> dict[str, Any]:
    """uvicorn.Config's TLS arguments (none without a key: plain HTTP)."""
    if keyfile is None:
        return {}
    return {"ssl_keyfile": keyfile, "ssl_certfile": certfile, "ssl_ca_certs": ca_certs, "ssl_cert_reqs": cert_reqs}


def add_cors(app: FastAPI, origins: list[str], methods: list[str], headers: list[str], credentials: bool) -> None:
    """CORS outermost, as in vLLM: a browser's preflight is answered before the API key is asked."""
    app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=methods, allow_headers=headers,
                       allow_credentials=credentials)


class RequestIdHeaders:
    """``--enable-request-id-headers`` (vLLM's ``XRequestIdMiddleware``): every response carries an
    ``X-Request-Id`` header, the request's as sent (any length), else a random uuid4 in hex."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        value = next((v for k, v in scope.get("headers") or () if k == b"x-request-id"), None)
        if value is None:
            value = uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", value)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
