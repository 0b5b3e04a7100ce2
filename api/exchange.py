"""One HTTP request's life in the API process, written once for every dialect that generates.

=======================  =========================================================================
``Exchange``             read and build the body, admit, answer (collect with the disconnect watch, or
                         stream with pings), and in one ``finally`` record the close and release
``Dialect``              what a dialect gives: ``build(body) -> requests``, ``renderer(handles)``, its error body
``Renderer``             ``start``, ``event``, ``finish``, ``failed``: engine text -> the dialect's bytes or JSON
``submit_all``           admit one HTTP request's engine requests, all or none
``error_response``       a dialect's error JSON with its status, Retry-After and ``x-request-id``
``answer_json``          a body in, JSON out, nothing admitted (tokenize, count_tokens)
=======================  =========================================================================

A new dialect is a module under api/dialects/ with a Dialect and its Renderer (see openai.py, responses.py,
anthropic.py) and a route in api/app.py; it never touches admission, the recorder or the sockets. Each choice's
text comes from api/generation.py (detokenization, stop strings, logprobs).
"""
from __future__ import annotations

import asyncio
import copy
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Protocol

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from api.body import BODY_ENCODINGS, read_and_build
from api.generation import merged_choices
from api.http_edges import note_engine_requests
from api.llama_timings import Telemetry
from api.protocol import GenerationRequest, error_body
from api.sse import with_pings
from ipc.recorder import ClosedBy, EventKind, record_request
from pdserve.errors import PdserveError

log = logging.getLogger("pdserve.api")

SSE_HEADERS = {"Cache-Control": "no-cache"}


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class Renderer(Protocol):
    """Engine text -> a dialect's answer. ``stream``: SSE frames, else one JSON body. ``reasons``: each choice's
    finish reason once known, by choice index (the metrics count the request by them)."""

    stream: bool
    reasons: dict[int, str | None]

    def start(self) -> list[bytes]:
        """The frames before any text (a stream's opening events); [] for a full answer."""

    def event(self, index: int, text: str, reason: str | None, logprobs: list) -> list[bytes]:
        """Frames of one text piece of choice ``index`` (api.generation.merged_choices' items); a full answer
        keeps it and returns []."""

    def finish(self) -> list[bytes] | dict:
        """A stream's closing frames, or the full answer's JSON body."""

    def failed(self, exc: PdserveError) -> list[bytes]:
        """A stream's frames for an engine error (a full answer's error is ``Dialect.error_body``)."""

    def progress(self, prompt_progress: dict) -> list[bytes]:
        """A stream's llama.cpp ``prompt_progress`` frames (api/llama_timings.py); [] in a dialect without them."""


class Dialect(Protocol):
    """One HTTP request in a dialect. ``build`` runs once, in a worker thread for a large body."""

    def build(self, body: Any) -> list[GenerationRequest]:
        """The parsed JSON body -> the engine requests. Raises PdserveError (4xx) in the dialect's words."""

    def renderer(self, handles: list) -> Renderer:
        """The renderer of the admitted requests (``handles``: api.admission.RequestHandle, in choice order)."""

    def error_body(self, error: PdserveError) -> dict:
        """The dialect's error JSON; its message is at ``["error"]["message"]``."""


@dataclass
class Engine:
    """What an exchange uses of its process: the engine client (api/engine_client.py or api/router_client.py),
    the tokenizer, the request parser (api/protocol.py) and the metrics (api/metrics.py)."""

    client: Any
    tokenizer: Any
    parser: Any
    metrics: Any


def submit_all(client, requests: list[GenerationRequest]) -> list:
    """Admit one HTTP request's engine requests (a completions list: one per prompt, each with its ``n`` choices),
    all or none: back to back, with nothing awaited between them, so the actors take them together; when one is
    refused, those admitted before it are finished (their rows aborted) and its error raised. A list whose
    sequences do not fit beside those in flight (``max_queued_requests``) is refused before any is admitted, its
    503 counting them all. Returns every handle (each choice's ``index`` is its place in the response)."""
    if len(requests) > 1:
        client.check_room(sum(r.n for r in requests))
    handles: list = []
    try:
        for request in requests:
            handles += client.submit(request)
    except BaseException:   # all or none, whatever stopped it
        client.finish_all(handles)
        raise
    return handles


def record_api(kind: int, handles: list, **fields) -> None:
    """One flight-recorder event (ipc/recorder.py) per row of a request: headers, admission, bytes, close."""
    for h in handles:
        record_request(kind, h.request.request_id, h.slot, h.generation, **fields)


def timeline_hint(status: int, request_id: str | None) -> str:
    """What a 503/504 body and log line add: the id and how to read its timeline (ipc/recorder.py)."""
    if status not in (503, 504) or not request_id:
        return ""
    return f" (request id {request_id}; its timeline: tools/inspect --request {request_id})"


def with_hint(error: PdserveError, request_id: str | None) -> PdserveError:
    """``error`` with :func:`timeline_hint` after its message (a copy; the same error when there is none)."""
    hint = timeline_hint(error.http_status, request_id)
    if not hint:
        return error
    hinted = copy.copy(error)
    hinted.message = error.message + hint
    return hinted


def error_response(error: PdserveError, request_id: str | None = None,
                   shape: Callable[[PdserveError], dict] = error_body) -> JSONResponse:
    """``shape``'s error JSON (OpenAI's by default) with the error's status; ``request_id`` (else
    RequestIdMiddleware's) goes in ``x-request-id`` and, on a 503/504, in the message."""
    headers = {}
    if error.http_status in (429, 503):
        headers["Retry-After"] = "1"
    elif error.http_status == 415:
        headers["Accept-Encoding"] = ", ".join(BODY_ENCODINGS)   # RFC 9110 section 15.5.16
    if request_id:
        headers["x-request-id"] = request_id
    return JSONResponse(shape(with_hint(error, request_id)), status_code=error.http_status, headers=headers or None)


async def answer_json(request: Request, build: Callable[[Any], Any], timeout_s: float,
                      shape: Callable[[PdserveError], dict] = error_body) -> Response:
    """A small JSON-in, JSON-out route that admits nothing: the body through ``build`` (api.body.read_and_build)."""
    try:
        answer, _ = await read_and_build(request, build, timeout_s)
    except PdserveError as exc:
        return error_response(exc, shape=shape)
    except ClientDisconnect:
        return Response(status_code=499)
    return JSONResponse(answer)


class Exchange:
    """One generating HTTP request: ``await Exchange(engine, request, dialect).run()`` is the route's answer.

    ``run`` reads and builds the body and admits it; a refusal is answered there and nothing is held. Once admitted,
    the exchange itself is the ASGI response: ``__call__`` answers (a full answer: collected while a watch waits
    for ``http.disconnect``, 499 when it comes first; a stream: the renderer's frames with SSE pings) and in its
    one ``finally`` records the last byte and the close, counts every choice and releases every handle, whatever
    stopped it (the client gone, an engine error, a renderer's bug)."""

    def __init__(self, engine: Engine, request: Request, dialect: Dialect):
        self.engine, self.request, self.dialect = engine, request, dialect
        self.handles: list = []
        self.renderer: Renderer | None = None
        self.request_id: str | None = None
        self.status = 499          # until the answer is out: 200 or the error's status; 500 for a bug
        self.sent_all = False      # the answer's last byte went out
        self.headers_ns = self.body_bytes = 0

    async def run(self) -> Response | Exchange:
        self.headers_ns = time.monotonic_ns()
        try:
            requests, self.body_bytes = await read_and_build(self.request, self.dialect.build,
                                                             self.engine.client.config.body_read_timeout_s)
        except PdserveError as exc:
            return self.error(exc)   # the middleware names the client's id, or a new one
        except ClientDisconnect:   # gone before its body was complete: nobody to answer, nothing admitted
            return Response(status_code=499)
        self.request_id = requests[0].request_id   # the id, kind and stream settings of them all
        try:
            self.handles = submit_all(self.engine.client, requests)
        except PdserveError as exc:
            return self.error(exc)
        return self

    def error(self, exc: PdserveError) -> JSONResponse:
        return error_response(exc, self.request_id, self.dialect.error_body)

    def inject(self, step: str) -> None:
        """The ``exchange_bug`` fault (pdserve/faults.py): raise at ``step`` as a bug would, for the tests that
        check a failure at any step releases everything."""
        faults = getattr(self.engine.client, "faults", None)
        if faults and faults.fires("exchange_bug", self.request_id or "", step=step):
            raise RuntimeError(f"injected fault exchange_bug at step {step}")

    async def __call__(self, scope: dict, receive, send) -> None:
        try:
            try:
                self.admitted(scope)
                self.inject("renderer")
                self.renderer = self.dialect.renderer(self.handles)
                if self.renderer.stream:
                    response: Response = StreamingResponse(
                        with_pings(self.frames(self.renderer), self.engine.client.config.sse_ping_interval_s),
                        media_type="text/event-stream", headers={**SSE_HEADERS, "x-request-id": self.request_id})
                else:
                    response = await self.collect(self.renderer, receive)
                self.inject("send")
            except Exception:   # a bug before the answer's first byte: a 500 in the dialect's shape
                log.exception("request %s: internal error", self.request_id)
                self.status = 500
                response = self.error(PdserveError("internal error; see the server log"))
            await response(scope, receive, send)
            self.sent_all = self.sent_all or self.status != 499
        except ClientDisconnect:   # an ASGI 2.4 server's send to a closed connection: the client's doing
            raise
        except Exception:
            self.status = 500   # a bug while sending (logged by Starlette's error handler): not the client's doing
            raise
        finally:
            self.release()

    def admitted(self, scope: dict) -> None:
        self.inject("admitted")
        note_engine_requests(scope, self.handles)   # the connection ledger (api/http_edges.py)
        for _ in self.handles:
            self.engine.metrics.on_admitted()
        record_api(EventKind.HTTP_HEADERS, self.handles, t_ns=self.headers_ns, a=self.body_bytes)
        record_api(EventKind.ADMITTED, self.handles)

    def texts(self) -> AsyncIterator[tuple[int, str, str | None, list]]:
        engine = self.engine
        return merged_choices(engine.client, engine.tokenizer, self.handles, engine.metrics)

    async def collect(self, renderer: Renderer, receive) -> Response:
        """The full answer, or a 499 when the client goes away first (the request is aborted), or the engine's
        error in the dialect's shape."""
        async def work() -> dict:
            async for item in self.texts():
                self.inject("event")
                renderer.event(*item)
            self.inject("finish")
            body = renderer.finish()
            telemetry = Telemetry.of(self.handles)
            if telemetry is not None and telemetry.per_token:   # llama.cpp's timings in a full answer
                body["timings"] = telemetry.timings()
            return body

        async def gone() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        tasks = [asyncio.ensure_future(work()), asyncio.ensure_future(gone())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if tasks[0] not in done:
                return Response(status_code=499)
            try:
                body = tasks[0].result()
            except PdserveError as exc:   # answered with its status: logged by ErrorLogMiddleware
                self.status = exc.http_status
                return self.error(exc)
            self.status = 200
            return JSONResponse(body, headers={"x-request-id": self.request_id})
        finally:
            for task in tasks:
                task.cancel()

    async def frames(self, renderer: Renderer) -> AsyncIterator[bytes]:
        """The stream: the renderer's frames; on an engine error its ``failed`` frames, and on a bug (logged with
        its traceback) ``failed`` frames of a 500 when the renderer can still make them. Closing it early (the
        client gone) leaves ``status`` at 499."""
        sent = 0
        telemetry = Telemetry.of(self.handles)   # llama.cpp's timings and prompt progress, when asked for
        try:
            self.inject("start")
            for frame in renderer.start():
                sent = self.first_byte(sent)
                yield frame
            async for item in self.texts():
                self.inject("event")
                if telemetry is None:
                    frames = renderer.event(*item)
                else:   # the progress chunks before the first text's frames
                    frames = telemetry.opening(renderer.progress)
                    frames += telemetry.decorate(renderer.event(*item))
                for frame in frames:
                    sent = self.first_byte(sent)
                    yield frame
            self.inject("finish")
            end, status = renderer.finish(), 200
            if telemetry is not None:
                end = telemetry.decorate(end)
        except PdserveError as exc:
            log.warning("request %s: %d %s%s", self.request_id, exc.http_status, exc.message,   # the whole id
                        timeline_hint(exc.http_status, self.request_id))
            end, status = renderer.failed(with_hint(exc, self.request_id)), exc.http_status
        except Exception:   # a bug: the stream still ends with the dialect's error event, and everything is released
            self.status = 500
            log.exception("request %s: internal error while streaming", self.request_id)
            end, status = renderer.failed(PdserveError("internal error; see the server log")), 500
        for frame in end:
            sent = self.first_byte(sent)
            yield frame
        self.status, self.sent_all = status, True

    def first_byte(self, sent: int) -> int:
        """The recorder's FIRST_BYTE before a stream's first frame; ``sent``: frames so far."""
        if sent == 0:
            record_api(EventKind.FIRST_BYTE, self.handles)
        return sent + 1

    def release(self) -> None:
        """The request's end: its last byte and close in the recorder, each choice counted once (by its finish
        reason, or as an abort (499) or an error), every handle finished (the rows of unfinished ones aborted)."""
        handles, status = self.handles, self.status
        try:
            if self.sent_all:
                record_api(EventKind.LAST_BYTE, handles, a=status)
            record_api(EventKind.CLOSED, handles, aux=ClosedBy.CLIENT if status == 499 else ClosedBy.SERVER,
                       a=status)
            reasons = self.renderer.reasons if self.renderer is not None else {}
            for h in handles:
                reason = h.finish_reason = reasons.get(h.index)
                if reason is None or status == 500:   # a renderer's bug: no choice reached the client whole
                    self.engine.metrics.on_finished(h, "abort" if status == 499 else "error", status)
                else:
                    self.engine.metrics.on_finished(h, reason)
        finally:
            self.engine.client.finish_all(handles)
