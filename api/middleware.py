"""ASGI middleware around the Starlette app: API keys (Bearer or x-api-key) on ``/v1/*`` (and its routes without
``/v1``), admin keys on ``/debug/*``, the node secret on ``/internal/*``; ``x-request-id`` on every response; one
log line per 4xx/5xx response (ErrorLogMiddleware).

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

from api.blame import proxy_wait_ns, split_of
from api.protocol import check_request_id, error_body
from ipc.arrivals import note_arrival
from pdserve.config import admin_keys, node_secret  # noqa: F401 - the API process reads its credentials here
from pdserve.config import api_keys as load_api_keys  # noqa: F401
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
    Covers responses made outside the routes too (404, 405, 413, 401 from ApiKeyMiddleware). At a POST's end its
    id, arrival, status and time split (api/blame.py ``split_of``: a proxy's ``X-Request-Start``, the engine
    requests api/http_edges.py ``note_engine_requests`` put in the scope) go into the arrival index
    (ipc/arrivals.py), and into ``blame`` (api/blame.py ``PeerBlame``, per connection peer) when given."""

    def __init__(self, app: ASGIApp, blame=None):
        self.app = app
        self.blame = blame

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        arrived_ns, arrived_wall_ns = time.monotonic_ns(), time.time_ns()
        try:
            default = check_request_id(_header(scope, b"x-request-id"), "")
        except PdserveError:
            default = ""
        default = default or f"req-{uuid.uuid4().hex[:24]}"
        answer = {"rid": default, "status": 0, "noted": scope.get("method") != "POST"}

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or [])
                rid = next((v.decode("latin-1") for k, v in headers if k.lower() == b"x-request-id"), None)
                if rid is None:
                    headers.append((b"x-request-id", default.encode("latin-1")))
                    message = {**message, "headers": headers}
                answer["rid"], answer["status"] = rid or default, int(message["status"])
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                self._note(scope, answer, arrived_ns, arrived_wall_ns)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self._note(scope, answer, arrived_ns, arrived_wall_ns)

    def _note(self, scope: dict, answer: dict, arrived_ns: int, arrived_wall_ns: int) -> None:
        """A POST's entry in the arrival index and its peer's blame, once (its response ended, or never began)."""
        if answer["noted"]:
            return
        answer["noted"] = True
        split = split_of(arrived_ns, time.monotonic_ns(), scope.get("pdserve.handles", ()),
                         proxy_wait_ns(_header(scope, b"x-request-start"), arrived_wall_ns))
        note_arrival(answer["rid"], arrived_ns, answer["status"], split)
        if self.blame is not None and answer["status"]:
            self.blame.observe(str((scope.get("client") or ("?",))[0]), split)


class ApiKeyMiddleware:
    """Who may call what, when credentials are configured (``Authorization: Bearer <key>``, or ``x-api-key: <key>``
    when no Authorization header is sent):

    =====================  ====================================================================================
    ``/internal/*``        the node secret only (``node_secret``; none configured: open, as on a plain engine,
                           where those routes are not mounted and answer 404); an API or admin key is a 401
    ``/debug/*``           an admin key (``admin_keys``) once any API or admin key is configured: the views show
                           every tenant's requests; a valid API key there is a 403
    ``PROTECTED_PREFIXES`` an API key or an admin key (``/v1/*`` and its routes without ``/v1``, ``/tokenize``,
                           ``/detokenize``); the node secret is not one
    the rest               open (``/health*``, ``/metrics``, ``/``)
    =====================  ====================================================================================

    Keys are compared in constant time: the SHA-256 digests of the offered and of every configured key go through
    ``hmac.compare_digest`` (equal lengths whatever the offered key's length), all of them, without an early
    exit. A missing header, another scheme or a wrong key is a 401 in OpenAI's error shape
    (``invalid_request_error``, code ``invalid_api_key``; on ``/v1/messages`` Anthropic's ``authentication_error``)
    with ``WWW-Authenticate: Bearer``.
    """

    def __init__(self, app: ASGIApp, keys: Iterable[str], admin_keys: Iterable[str] = (), node_secret: str = ""):
        self.app = app
        self.admin = [hashlib.sha256(k.encode("utf-8")).digest() for k in admin_keys]
        self.digests = [hashlib.sha256(k.encode("utf-8")).digest() for k in keys] + self.admin
        self.node = [hashlib.sha256(node_secret.encode("utf-8")).digest()] if node_secret else []

    @staticmethod
    def offered(header: str | None, x_api_key: str | None = None) -> bytes | None:
        """The SHA-256 digest of the key an ``Authorization`` header value (``Bearer <key>``), or else an
        ``x-api-key`` header value, carries; None when there is none (or another scheme)."""
        scheme, _, token = (header or "").strip().partition(" ")
        if header is not None and (scheme.lower() != "bearer" or not token.strip()):
            return None
        token = token.strip() if header is not None else (x_api_key or "").strip()
        return hashlib.sha256(token.encode("utf-8", errors="surrogateescape")).digest() if token else None

    @staticmethod
    def _matches(offered: bytes | None, digests: list[bytes]) -> bool:
        match = False
        for digest in digests:   # every one, no early exit
            match |= hmac.compare_digest(offered or b"", digest)
        return match and offered is not None

    def authorized(self, header: str | None, x_api_key: str | None = None) -> bool:
        """Whether the headers carry one of the API or admin keys."""
        return self._matches(self.offered(header, x_api_key), self.digests)

    async def __call__(self, scope: dict, receive, send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path.startswith("/internal/"):
            needed, guarded = self.node, bool(self.node)
        elif path.startswith("/debug/") and self.digests:
            needed, guarded = self.admin, True   # no admin key configured: nobody reads them over HTTP
        elif path.startswith(PROTECTED_PREFIXES):
            needed, guarded = self.digests, bool(self.digests)
        else:
            needed, guarded = [], False
        if not guarded:
            await self.app(scope, receive, send)
            return
        offered = self.offered(_header(scope, b"authorization"), _header(scope, b"x-api-key"))
        if self._matches(offered, needed):
            await self.app(scope, receive, send)
            return
        status = 401
        if offered is None:
            message = ("You didn't provide an API key. Provide it in the Authorization header as "
                       "'Authorization: Bearer YOUR_KEY'.")
        elif path.startswith("/debug/") and self._matches(offered, self.digests):
            status, message = 403, ("the debug views show every tenant's requests: they need an admin key "
                                    "(admin_key / admin_key_file)")
        elif path.startswith("/internal/"):
            message = "the node routes take the router's node secret (node_secret), not an API key"
        else:
            message = "Incorrect API key provided (expected 'Authorization: Bearer YOUR_KEY' with a configured key)."
        if path.startswith(ANTHROPIC_PREFIX):   # Anthropic's clients parse their own error shape
            body = orjson.dumps({"type": "error", "error": {"type": "authentication_error", "message": message}})
        elif status == 403:
            body = orjson.dumps(error_body(message, "permission_error", None, "admin_key_required"))
        else:
            body = orjson.dumps(error_body(message, "invalid_request_error", None, "invalid_api_key"))
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b'Bearer realm="pdserve"'))
        await send({"type": "http.response.start", "status": status, "headers": headers})
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
