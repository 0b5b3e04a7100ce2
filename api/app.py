"""The ASGI app: the routes of every dialect over api/exchange.py, and the routes that generate nothing.

=======================  =========================================================================
``build_app``            the app behind api/middleware.py's API keys, request ids and error log, and CORS
``Routes``               the route table; the handlers that generate nothing (models, tokenize, health,
                         metrics, debug, stored responses, count_tokens) and the 404/405/500 answers
=======================  =========================================================================

Generating routes (each an api/exchange.py Exchange over its dialect): POST /v1/chat/completions and
/v1/completions (api/dialects/openai.py), POST /v1/responses (api/dialects/responses.py), POST /v1/messages
(api/dialects/anthropic.py). The others: GET and DELETE /v1/responses/{id}, POST /v1/messages/count_tokens,
GET /v1/models, GET /v1/models/{id}, POST /v1/embeddings (api/embeddings.py; llama.cpp's /embedding too), POST
/tokenize and /detokenize (vLLM's), POST /apply-template (llama.cpp's: a chat body's prompt text), GET (and HEAD) /, /health, /health/live, /health/ready, /metrics, /debug/state
(api/debug_state.py), /debug/requests/{id} (the request's timelines from the flight recorder, ipc/timeline.py).
The OpenAI routes (Responses included) answer without the ``/v1`` prefix too (as llama.cpp serves them);
/tokenize also takes llama.cpp's ``content`` form. Nothing raises out of a
handler; errors are in the dialect's shape.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Callable

from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api.blame import PeerBlame
from api.debug_state import DebugState
from api.dialects import anthropic, openai, responses
from api.embeddings import EmbeddingsDialect
from api.exchange import Dialect, Engine, Exchange, JSONResponse, answer_json, error_response
from api.middleware import ApiKeyMiddleware, ErrorLogMiddleware, RequestIdMiddleware
from api.protocol import RequestParser, error_body
from ipc.recorder import installed
from ipc.timeline import requests_report
from pdserve.errors import PdserveError

log = logging.getLogger("pdserve.api")


def request_timelines(client, request_id: str) -> dict | None:
    """``ipc.timeline.requests_report`` for ``request_id`` from this process's recorder; None without one."""
    writer = installed()
    if writer is None:
        return None
    return requests_report(writer.recorder.events(), time.monotonic_ns(), dataclasses.asdict(client.config),
                           client.topology.names, request_id)


def build_app(client, tokenizer, parser: RequestParser, metrics, api_keys: tuple[str, ...] = (),
              extra_routes: tuple = (), allowed_origins: tuple[str, ...] = (), admin_keys: tuple[str, ...] = (),
              node_secret: str = ""):
    """The ASGI app: the routes (plus ``extra_routes``, Starlette ``Route``s: a node's ``/internal/*``), behind
    api.middleware's credential check (``api_keys`` and ``admin_keys``: none = open; ``/debug/*`` wants an admin
    key once any key is configured; ``/internal/*`` wants ``node_secret`` when one is given), ``x-request-id`` on
    every response and a log line per error; CORS (Starlette's CORSMiddleware, outermost so a preflight needs no
    key) for ``allowed_origins`` (none = no CORS headers; ``*`` = any origin)."""
    app = Routes(client, tokenizer, parser, metrics).app(extra_routes)
    blame = PeerBlame(metrics.registry) if getattr(metrics, "registry", None) is not None else None
    app = ErrorLogMiddleware(RequestIdMiddleware(ApiKeyMiddleware(app, api_keys, admin_keys, node_secret), blame))
    if allowed_origins:
        app = CORSMiddleware(app, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"],
                             expose_headers=["x-request-id"], max_age=600)
    return app


class Routes:
    """The route table over one engine client (api/engine_client.py, or api/router_client.py in `pdserve router`)."""

    def __init__(self, client, tokenizer, parser: RequestParser, metrics,
                 store: responses.ResponseStore | None = None):
        self.engine = Engine(client, tokenizer, parser, metrics)
        self.client, self.parser, self.metrics = client, parser, metrics
        self.served = parser.served_model_name
        self.debug = DebugState(client)
        self.store = store or responses.ResponseStore()
        self.ready: bool | None = None   # the last /health answer: None until the first 200 (starting)
        metrics.registry.register(self.store)   # pdserve_response_store_entries / _bytes

    def exchange(self, dialect: Callable[[Request], Dialect]):
        """A generating route: ``dialect(request)`` through one Exchange."""
        async def endpoint(request: Request):
            return await Exchange(self.engine, request, dialect(request)).run()
        return endpoint

    def openai(self, kind: str):
        return self.exchange(lambda request: openai.OpenAIDialect(self.parser, self.engine.tokenizer, kind,
                                                                  request.headers.get("x-request-id")))

    def json_tool(self, build: Callable, shape: Callable[[PdserveError], dict] = error_body):
        """A route that reads a JSON body and answers ``build(body)``, admitting nothing."""
        async def endpoint(request: Request) -> Response:
            return await answer_json(request, build, self.client.config.body_read_timeout_s, shape)
        return endpoint

    async def stored_response(self, request: Request) -> Response:
        status, body = responses.stored(self.store, request.headers, request.path_params["response_id"])
        return JSONResponse(body, status_code=status)

    async def delete_response(self, request: Request) -> Response:
        status, body = responses.deleted(self.store, request.headers, request.path_params["response_id"])
        return JSONResponse(body, status_code=status)

    def model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "pdserve",
                "max_model_len": self.parser.max_context_tokens}

    async def models(self, request: Request) -> Response:
        """The served model under its first name (the others are aliases, accepted in ``model``)."""
        return JSONResponse({"object": "list", "data": [self.model_card(self.served)]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model_id"]
        if name not in self.parser.model_names and not self.parser.any_model:
            return JSONResponse(error_body(f"The model '{name}' does not exist", "not_found_error", "model",
                                           "model_not_found"), status_code=404)
        return JSONResponse(self.model_card(name))

    def embeddings(self, llama: bool = False):
        """POST /v1/embeddings (OpenAI's shape), or llama.cpp's /embedding with ``llama``: api/embeddings.py."""
        serves = hasattr(self.client, "admission")   # `pdserve router` routes none
        return self.exchange(lambda request: EmbeddingsDialect(self.parser, request.headers.get("x-request-id"),
                                                               llama, serves))


    async def health(self, request: Request) -> Response:
        """Readiness with its report: 200 while a route through prefill and decode serves, else 503 with the
        reasons (api.metrics.not_ready); ``problems`` also names actors down beside others that serve. Logged on a
        change only (api.middleware.HEALTH_PATHS): one INFO line when ready, a WARNING naming the reasons when it
        stops being ready; a 503 while starting is a DEBUG line."""
        report = self.metrics.health()
        ready, problems = report["status"] == "ok", "; ".join(report["problems"])
        if ready and not self.ready:
            log.info("ready: %s answers 200%s", request.url.path, " again" if self.ready is False else "")
        elif not ready and self.ready:
            log.warning("not ready: %s answers 503: %s", request.url.path, problems)
        elif not ready:
            log.debug("%s: %s answers 503: %s", "starting" if self.ready is None else "not ready", request.url.path,
                      problems)
        if ready or self.ready is not None:
            self.ready = ready
        return JSONResponse(report, status_code=200 if ready else 503)

    async def live(self, request: Request) -> Response:
        """Liveness: the API process answers (nothing else is looked at)."""
        return JSONResponse({"status": "ok"})

    async def metrics_route(self, request: Request) -> Response:
        data, content_type = self.metrics.render()
        return Response(data, media_type=content_type)

    async def debug_state(self, request: Request) -> Response:
        try:
            return JSONResponse(await self.debug.answer(request.query_params.get("sample_s")))
        except PdserveError as exc:
            return error_response(exc)


    async def debug_requests(self, request: Request) -> Response:
        """GET /debug/requests/{id}: the request's timelines from the flight recorder (ipc/timeline.py's
        ``requests_report``; the same JSON as tools/inspect --request ID --json)."""
        report = await asyncio.to_thread(request_timelines, self.client, request.path_params["request_id"])
        if report is None:
            return JSONResponse(error_body("this engine runs without a flight recorder (recorder_events=0)",
                                           "not_found_error"), status_code=404)
        return JSONResponse(report, status_code=200 if report["timelines"] else 404)

    async def not_found(self, request: Request, exc: Exception) -> Response:
        return JSONResponse(error_body(f"no route {request.method} {request.url.path}", "not_found_error"),
                            status_code=404)

    async def method_not_allowed(self, request: Request, exc: Exception) -> Response:
        allow = getattr(exc, "headers", None) or {}
        return JSONResponse(error_body(f"method {request.method} not allowed on {request.url.path}"),
                            status_code=405, headers={k: v for k, v in allow.items() if k.lower() == "allow"})

    async def server_error(self, request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return JSONResponse(error_body("internal error; see the server log", "internal_error"), status_code=500)

    def app(self, extra_routes: tuple = ()) -> Starlette:
        routes = [*extra_routes]
        for prefix in ("/v1", ""):   # /responses too, as llama.cpp serves it
            routes += [
                Route(prefix + "/responses", self.exchange(lambda r: responses.ResponsesDialect(
                    self.parser, self.store, r.headers)), methods=["POST"]),
                Route(prefix + "/responses/{response_id}", self.stored_response, methods=["GET"]),
                Route(prefix + "/responses/{response_id}", self.delete_response, methods=["DELETE"]),
            ]
        routes += [
            Route("/v1/messages", self.exchange(lambda r: anthropic.MessagesDialect(self.parser, r.headers)),
                  methods=["POST"]),
            Route("/v1/messages/count_tokens", self.json_tool(lambda body: anthropic.count_tokens(self.parser, body),
                                                              anthropic.error_body), methods=["POST"]),
        ]
        for prefix in ("/v1", ""):   # llama.cpp serves them without /v1 too
            routes += [
                Route(prefix + "/chat/completions", self.openai("chat"), methods=["POST"]),
                Route(prefix + "/completions", self.openai("completion"), methods=["POST"]),
                Route(prefix + "/models", self.models, methods=["GET"]),
                Route(prefix + "/models/{model_id:path}", self.model, methods=["GET"]),
                Route(prefix + "/embeddings", self.embeddings(), methods=["POST"]),
            ]
        routes.append(Route("/embedding", self.embeddings(llama=True), methods=["POST"]))   # llama.cpp's own shape
        routes += [   # GET routes answer HEAD too (Starlette)
            Route("/tokenize", self.json_tool(self.parser.tokenize), methods=["POST"]),
            Route("/detokenize", self.json_tool(self.parser.detokenize), methods=["POST"]),
            Route("/apply-template", self.json_tool(self.parser.apply_template), methods=["POST"]),   # llama.cpp's
            Route("/", self.live, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/health/live", self.live, methods=["GET"]),
            Route("/health/ready", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_route, methods=["GET"]),
            Route("/debug/state", self.debug_state, methods=["GET"]),
            Route("/debug/requests/{request_id:path}", self.debug_requests, methods=["GET"]),
        ]
        return Starlette(routes=routes, exception_handlers={404: self.not_found, 405: self.method_not_allowed,
                                                            500: self.server_error})
