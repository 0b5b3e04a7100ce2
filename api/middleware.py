"""ASGI middleware around the Starlette app: API keys (Bearer or x-api-key) on ``/v1/*`` (and its routes without
``/v1``), ``/debug/*`` and ``/internal/*``; ``x-request-id`` on every response; one log line per 4xx/5xx response
(ErrorLogMiddleware).

Both are plain ASGI (not Starlette's BaseHTTPMiddleware, which buffers streamed bodies and hides client
disconnects from the handlers): they look at the request's headers and add or answer with response headers.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import time
import uuid
from typing import Awaitable, Callable, Iterable

import orjson

from api.protocol import check_request_id, error_body
from ipc.arrivals import note_arrival
from pdserve.config import api_keys as load_api_keys  # noqa: F401 - the API process reads its keys here
from pdserve.errors import PdserveError

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]

log = logging.getLogger("pdserve.api")

ERROR_BODY_LOG_BYTES = 16384   # an error body is read for its message and param up to this size

# /health*, /metrics and / stay open (as vLLM does); the OpenAI routes are served without /v1 too
PROTECTED_PREFIXES = ("/v1/", "/debug/", "/internal/", "/chat/", "/completions", "/models", "/embeddings",
                      "/tokenize", "/detokenize")
ANTHROPIC_PREFIX = "/v1/messages"   # a 401 there is in Anthropic's error shape


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers") or ():
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class RequestIdMiddleware:
    """Every HTTP response carries ``x-request-id``: the one the handler set (a generation's id), else the
    client's ``X-Request-Id`` when it is acceptable (api.protocol.check_request_id), else a new ``req-...`` id.
    Covers responses made outside the routes too (404, 405, 413, 401 from ApiKeyMiddleware). A POST's id, arrival
    and status go into the arrival index (ipc/arrivals.py) as its answer starts."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        arrived_ns = time.monotonic_ns()
        try:
            default = check_request_id(_header(scope, b"x-request-id"), "")
        except PdserveError:
            default = ""
        default = default or f"req-{uuid.uuid4().hex[:24]}"

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or [])
                rid = next((v.decode("latin-1") for k, v in headers if k.lower() == b"x-request-id"), None)
                if rid is None:
                    rid = default
                    headers.append((b"x-request-id", default.encode("latin-1")))
                    message = {**message, "headers": headers}
                if scope.get("method") == "POST":
                    note_arrival(rid, arrived_ns, int(message["status"]))
            await send(message)

        await self.app(scope, receive, send_with_id)


class ApiKeyMiddleware:
    """``Authorization: Bearer <key>`` (or ``x-api-key: <key>``, when no Authorization header is sent) required on
    ``PROTECTED_PREFIXES`` (``/v1/*`` and its routes without ``/v1``, ``/tokenize``, ``/detokenize``, ``/debug/*``
    and the router-to-node ``/internal/*``) when keys are configured.

    Keys are compared in constant time: the SHA-256 digests of the offered and of every configured key go through
    ``hmac.compare_digest`` (equal lengths whatever the offered key's length), all of them, without an early
    exit. A missing header, another scheme or a wrong key is a 401 in OpenAI's error shape
    (``invalid_request_error``, code ``invalid_api_key``; on ``/v1/messages`` Anthropic's ``authentication_error``)
    with ``WWW-Authenticate: Bearer``.
    """

    def __init__(self, app: ASGIApp, keys: Iterable[str]):
        self.app = app
        self.digests = [hashlib.sha256(k.encode("utf-8")).digest() for k in keys]

    def authorized(self, header: str | None, x_api_key: str | None = None) -> bool:
        """Whether an ``Authorization`` header value (``Bearer <key>``), or else an ``x-api-key`` header value (as
        Anthropic's clients send it), carries one of the keys."""
        scheme, _, token = (header or "").strip().partition(" ")
        if header is not None and (scheme.lower() != "bearer" or not token.strip()):
            return False
        token = token.strip() if header is not None else (x_api_key or "").strip()
        if not token:
            return False
        offered = hashlib.sha256(token.encode("utf-8", errors="surrogateescape")).digest()
        match = False
        for digest in self.digests:
            match |= hmac.compare_digest(offered, digest)
        return match

    async def __call__(self, scope: dict, receive, send) -> None:
        if (scope["type"] != "http" or not self.digests or not scope.get("path", "").startswith(PROTECTED_PREFIXES)
                or self.authorized(_header(scope, b"authorization"), _header(scope, b"x-api-key"))):
            await self.app(scope, receive, send)
            return
        if _header(scope, b"authorization") is None and _header(scope, b"x-api-key") is None:
            message = ("You didn't provide an API key. Provide it in the Authorization header as "
                       "'Authorization: Bearer YOUR_KEY'.")
        else:
            message = "Incorrect API key provided (expected 'Authorization: Bearer YOUR_KEY' with a configured key)."
        if scope["path"].startswith(ANTHROPIC_PREFIX):   # Anthropic's clients parse their own error shape
            body = orjson.dumps({"type": "error", "error": {"type": "authentication_error", "message": message}})
        else:
            body = orjson.dumps(error_body(message, "invalid_request_error", None, "invalid_api_key"))
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b'Bearer realm="pdserve"')]})
        await send({"type": "http.response.body", "body": body})



HEALTH_PATHS = frozenset({"/health", "/health/ready"})


class ErrorLogMiddleware:
    """One log line per response with status >= 400: request id, method, route (the path, never the query),
    status, and the error's ``param`` and message from the JSON error body (the request body and the API key are
    never logged). 5xx at WARNING, 4xx at INFO; 499 (the client went away before the answer) names that.

    An error met after a streamed response started is a 200 on the wire and is logged by the stream itself
    (api/exchange.py). The health routes (HEALTH_PATHS) log their own changes (api/app.py ``Routes.health``):
    a probe every few seconds would otherwise be a WARNING line each while the engine starts."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status, rid, body = 0, "", bytearray()

        async def watch(message: dict) -> None:
            nonlocal status, rid
            if message["type"] == "http.response.start":
                status = int(message["status"])
                rid = next((v.decode("latin-1") for k, v in message.get("headers") or ()
                            if k.lower() == b"x-request-id"), "")
            elif message["type"] == "http.response.body" and status >= 400 and scope.get("path") not in HEALTH_PATHS:
                if len(body) < ERROR_BODY_LOG_BYTES:
                    body.extend(message.get("body", b"")[:ERROR_BODY_LOG_BYTES - len(body)])
                if not message.get("more_body", False):
                    log_error(rid, scope.get("method", ""), scope.get("path", ""), status, bytes(body))
            await send(message)

        await self.app(scope, receive, watch)


def error_reason(status: int, body: bytes) -> str:
    """``param=NAME: message`` from an error body (OpenAI or Anthropic shape), else a word for the status."""
    try:
        error = orjson.loads(body).get("error") if body else None
    except (orjson.JSONDecodeError, AttributeError):
        error = None
    if isinstance(error, dict):
        message = str(error.get("message", ""))[:300]
        return f"param={error['param']}: {message}" if error.get("param") else message
    return "the client closed the connection first" if status == 499 else "(no error body)"


def log_error(request_id: str, method: str, path: str, status: int, body: bytes) -> None:
    log.log(logging.WARNING if status >= 500 else logging.INFO, "request %s: %s %s -> %d %s", request_id or "-",
            method, path, status, error_reason(status, body))
