"""HTTP handlers of the Responses and Messages dialects, over api.app.Routes (its parser, engine client and metrics).

Routes: POST /v1/responses, GET and DELETE /v1/responses/{id}, POST /v1/messages, POST /v1/messages/count_tokens.
Each body goes through its dialect's ``translate`` and RequestParser.chat once (a worker thread for large bodies),
is admitted like a chat request, and its engine events (api/dialects/events.py) are rendered in the dialect's shape.
A client gone before the end (a closed stream, or a disconnect while a full answer is computed) aborts the request,
as chat does (Routes.finished + EngineClient.finish_all), so its KV blocks are freed. The API's events (headers,
admission, first and last byte, close) go to the flight recorder (ipc/recorder.py) as chat's do.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Any, Callable

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from api.dialects import anthropic, responses
from api.dialects.events import Outcome, engine_events
from api.http_edges import note_engine_requests
from api.protocol import check_request_id, error_body, prompt_counts
from api.sse import with_pings
from ipc.recorder import ClosedBy, EventKind
from pdserve.errors import InvalidRequestError, PdserveError

log = logging.getLogger("pdserve.api")

SSE_HEADERS = {"Cache-Control": "no-cache"}


def api_key_digest(request: Request) -> str:
    """The offered API key (Bearer, else x-api-key) as a SHA-256 hex digest; "" when none: the store's owner key."""
    scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
    token = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "").strip()
    return hashlib.sha256(token.encode("utf-8", errors="surrogateescape")).hexdigest() if token else ""


class DialectRoutes:
    """The dialect handlers; ``routes`` is api.app.Routes (parser, client, tokenizer, metrics, finished)."""

    def __init__(self, routes, store: responses.ResponseStore | None = None):
        self.r = routes
        self.store = store or responses.ResponseStore()

    def routes(self) -> list[Route]:
        return [Route("/v1/responses", self.create_response, methods=["POST"]),
                Route("/v1/responses/{response_id}", self.get_response, methods=["GET"]),
                Route("/v1/responses/{response_id}", self.delete_response, methods=["DELETE"]),
                Route("/v1/messages", self.create_message, methods=["POST"]),
                Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"])]

    # -- shared ---------------------------------------------------------------------------------------------

    async def _prepare(self, request: Request, build: Callable[[Any], Any]) -> Any:
        """Read the body and run ``build(parsed JSON)`` (a worker thread past INLINE_PARSE_BYTES). Raises
        PdserveError (4xx) for any bad input, ClientDisconnect when the client left mid-body. Notes when the
        headers came and the body's size in ``request.state`` (the recorder's HTTP_HEADERS event, ``_submit``)."""
        from api.app import INLINE_PARSE_BYTES, parse_json, read_decoded_body

        request.state.headers_ns = time.monotonic_ns()
        raw = await read_decoded_body(request, self.r.client.config.body_read_timeout_s)
        request.state.body_bytes = len(raw)

        def run() -> Any:
            try:
                return build(parse_json(raw))
            except PdserveError:
                raise
            except (RecursionError, MemoryError):
                raise InvalidRequestError("the request is nested too deeply or too large to validate") from None
            except Exception as exc:  # noqa: BLE001 - input nobody foresaw: a 400 and a log line to fix it
                log.exception("unexpected error while validating a %s request", request.url.path)
                raise InvalidRequestError(f"the request could not be validated ({type(exc).__name__})") from None

        return await asyncio.to_thread(run) if len(raw) > INLINE_PARSE_BYTES else run()

    def _chat(self, chat_body: dict, request_id: str, renamed: Callable) -> Any:
        try:
            return self.r.parser.chat(chat_body, request_id)
        except PdserveError as exc:
            raise renamed(exc) from None

    def _submit(self, request: Request, gen) -> list:
        from api.app import record_api

        handles = self.r.client.submit(gen)
        for _ in handles:
            self.r.metrics.on_admitted()
        note_engine_requests(request.scope, handles)   # the connection ledger (api/http_edges.py)
        record_api(EventKind.HTTP_HEADERS, handles, t_ns=request.state.headers_ns, a=request.state.body_bytes)
        record_api(EventKind.ADMITTED, handles)
        return handles

    def _sse(self, events, rid: str) -> StreamingResponse:
        """A dialect's event stream with SSE comment pings while it is silent (api/sse.py)."""
        return StreamingResponse(with_pings(events, self.r.client.config.sse_ping_interval_s),
                                 media_type="text/event-stream", headers={**SSE_HEADERS, "x-request-id": rid})

    def _usage(self, handles: list, shape: Callable) -> dict:
        prompt_tokens, cached_tokens = prompt_counts(handles)
        return shape(prompt_tokens, handles[0].completion_tokens, cached_tokens)

    async def _collect(self, request: Request, handles: list) -> Outcome | PdserveError | None:
        """The whole answer; None when the client went away first (the request is aborted); the engine's error."""
        from api.app import record_api

        reasons: dict[int, str | None] = {}

        async def work() -> Outcome:
            outcome = Outcome()
            async for event in engine_events(self.r.client, self.r.tokenizer, handles[0], self.r.metrics, reasons):
                outcome.add(event)
            return outcome

        async def gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        tasks = [asyncio.ensure_future(work()), asyncio.ensure_future(gone())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if tasks[0] not in done:
                self.r.finished(handles, reasons, 499)
                record_api(EventKind.CLOSED, handles, aux=ClosedBy.CLIENT, a=499)
                return None
            try:
                outcome = tasks[0].result()
            except PdserveError as exc:   # answered with its status: logged by ErrorLogMiddleware
                self.r.finished(handles, reasons, exc.http_status)
                record_api(EventKind.CLOSED, handles, aux=ClosedBy.SERVER, a=exc.http_status)
                return exc
            self.r.finished(handles, reasons)
            record_api(EventKind.LAST_BYTE, handles, a=200)
            record_api(EventKind.CLOSED, handles, aux=ClosedBy.SERVER, a=200)
            return outcome
        finally:
            for task in tasks:
                task.cancel()
            self.r.client.finish_all(handles)

    async def _stream(self, handles: list, renderer, start: list[bytes], on_finish: Callable,
                      on_error: Callable) -> Any:
        """SSE frames: ``start`` (the first byte the recorder notes), then ``renderer.event`` per engine event,
        ``on_finish(event, outcome)`` for the last one, ``on_error(exc)`` for an engine error. Closing the stream
        early aborts the request."""
        from api.app import record_api

        reasons: dict[int, str | None] = {}
        status = 499
        outcome = Outcome()
        try:
            for k, frame in enumerate(start):
                if k == 0:
                    record_api(EventKind.FIRST_BYTE, handles)
                yield frame
            try:
                async for event in engine_events(self.r.client, self.r.tokenizer, handles[0], self.r.metrics,
                                                 reasons):
                    outcome.add(event)
                    for frame in (on_finish(event, outcome) if event[0] == "finish" else renderer.event(event)):
                        yield frame
                status = 200
            except PdserveError as exc:
                log.warning("request %s: %d %s", handles[0].request.request_id, exc.http_status, exc.message)
                status = exc.http_status
                yield on_error(exc)
            record_api(EventKind.LAST_BYTE, handles, a=status)
        finally:
            record_api(EventKind.CLOSED, handles, aux=ClosedBy.CLIENT if status == 499 else ClosedBy.SERVER, a=status)
            self.r.finished(handles, reasons, status)
            self.r.client.finish_all(handles)

    # -- OpenAI Responses -------------------------------------------------------------------------------------

    def _openai_error(self, exc: PdserveError, request_id: str | None = None) -> Response:
        from api.app import error_response

        return error_response(exc, request_id)

    async def create_response(self, request: Request) -> Response:
        key = api_key_digest(request)
        response_id = responses.new_id("resp")
        rid = check_request_id(request.headers.get("x-request-id"), response_id)

        def build(body: Any) -> tuple:
            history = None
            if isinstance(body, dict) and body.get("previous_response_id") is not None:
                history = self.store.history(key, body["previous_response_id"])
            chat_body, conversation = responses.translate(body, history)
            gen = self._chat(chat_body, rid, responses.renamed)
            return body, gen, conversation

        try:
            body, gen, conversation = await self._prepare(request, build)
            handles = self._submit(request, gen)
        except PdserveError as exc:   # logged by ErrorLogMiddleware (api/middleware.py)
            return self._openai_error(exc)
        except ClientDisconnect:
            return Response(status_code=499)
        meta = responses.ResponseMeta(response_id, gen.model, body)
        store = body.get("store") is not False

        def keep(outcome: Outcome, response: dict) -> None:
            if store:
                self.store.put(key, response, conversation + [responses.assistant_message(outcome)])

        if body.get("stream"):
            stream = responses.ResponseStream(meta)

            def on_finish(event: tuple, outcome: Outcome) -> list[bytes]:
                frames, response = stream.finish(event[1], self._usage(handles, responses.usage_body))
                keep(outcome, response)
                return frames

            return self._sse(self._stream(handles, stream, stream.start(), on_finish, stream.failed), rid)
        outcome = await self._collect(request, handles)
        if outcome is None:
            return Response(status_code=499)
        if isinstance(outcome, PdserveError):
            return self._openai_error(outcome, rid)
        response = responses.response_object(meta, outcome, self._usage(handles, responses.usage_body))
        keep(outcome, response)
        from api.app import JSONResponse

        return JSONResponse(response, headers={"x-request-id": rid})

    def _not_stored(self, response_id: str) -> Response:
        from api.app import JSONResponse

        return JSONResponse(error_body(f"No response with id '{response_id}' found (responses are kept "
                                       f"{self.store.ttl_s:g} s, at most {self.store.max_entries}, and only with "
                                       "'store' true)", "invalid_request_error", "response_id", "not_found"),
                            status_code=404)

    async def get_response(self, request: Request) -> Response:
        from api.app import JSONResponse

        response_id = request.path_params["response_id"]
        entry = self.store.get(api_key_digest(request), response_id)
        return self._not_stored(response_id) if entry is None else JSONResponse(entry.response)

    async def delete_response(self, request: Request) -> Response:
        from api.app import JSONResponse

        response_id = request.path_params["response_id"]
        if not self.store.delete(api_key_digest(request), response_id):
            return self._not_stored(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    # -- Anthropic Messages -----------------------------------------------------------------------------------

    @staticmethod
    def _anthropic_error(exc: PdserveError, request_id: str | None = None) -> Response:
        from api.app import JSONResponse

        headers = {"Retry-After": "1"} if exc.http_status in (429, 503) else {}
        if request_id:
            headers["x-request-id"] = request_id
        return JSONResponse(anthropic.error_body(exc), status_code=exc.http_status, headers=headers or None)

    async def create_message(self, request: Request) -> Response:
        message_id = anthropic.new_id()
        rid = check_request_id(request.headers.get("x-request-id"), message_id)

        def build(body: Any) -> Any:
            return self._chat(anthropic.translate(body), rid, anthropic.renamed)

        try:
            gen = await self._prepare(request, build)
            handles = self._submit(request, gen)
        except PdserveError as exc:   # logged by ErrorLogMiddleware (api/middleware.py)
            return self._anthropic_error(exc)
        except ClientDisconnect:
            return Response(status_code=499)
        if gen.stream:
            stream = anthropic.MessageStream(message_id, gen.model)
            start = stream.start(anthropic.usage_body(len(gen.prompt_ids), 0))

            def on_finish(event: tuple, outcome: Outcome) -> list[bytes]:
                return stream.finish(event[1], event[2], self._usage(handles, anthropic.usage_body))

            return self._sse(self._stream(handles, stream, start, on_finish, stream.failed), rid)
        outcome = await self._collect(request, handles)
        if outcome is None:
            return Response(status_code=499)
        if isinstance(outcome, PdserveError):
            return self._anthropic_error(outcome, rid)
        from api.app import JSONResponse

        body = anthropic.message_object(message_id, gen.model, outcome, self._usage(handles, anthropic.usage_body))
        return JSONResponse(body, headers={"x-request-id": rid})

    async def count_tokens(self, request: Request) -> Response:
        def build(body: Any) -> int:
            translated = anthropic.translate(body, count_only=True)
            return len(self._chat(translated, "count-tokens", anthropic.renamed).prompt_ids)

        try:
            count = await self._prepare(request, build)
        except PdserveError as exc:
            return self._anthropic_error(exc)
        except ClientDisconnect:
            return Response(status_code=499)
        return Response(orjson.dumps({"input_tokens": count}), media_type="application/json")
