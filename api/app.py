"""Starlette app: OpenAI-compatible routes, vLLM's /tokenize and /detokenize, health, /metrics and /debug/state.

Routes: POST /v1/chat/completions, POST /v1/completions (stream or not), GET /v1/models, GET /v1/models/{id},
POST /v1/embeddings (a 400: a generation model), each also without the ``/v1`` prefix (as llama.cpp serves them);
the Responses and Messages dialects' routes (api/dialects/routes.py); POST /tokenize, POST /detokenize; GET (and
HEAD) /, /health (readiness, with its report), /health/live, /health/ready; GET /metrics, GET /debug/state
(tools/inspect's snapshot, api/debug_state.py), GET /debug/requests/{id} (the request's timelines from the flight
recorder, ipc/timeline.py). Errors are OpenAI error JSON (Anthropic's on /v1/messages) with the right status;
nothing raises out of a handler; a 503/504 names the request id and how to read its timeline.
"""
from __future__ import annotations

import asyncio
import logging
import time
import zlib
from typing import Any, AsyncIterator

import orjson
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from api.debug_state import DebugState
from api.engine_client import EngineClient, RequestHandle
from api.http_edges import note_engine_requests
from api.protocol import (ChoiceResult, GenerationRequest, RequestParser, chat_logprobs, chunk, completion_logprobs,
                          error_body, full_response, prompt_counts, usage)
from api.sse import with_pings
from api.formats import ChatDeltas, finish_choice, marker_texts, request_formats
from ipc.recorder import ClosedBy, EventKind, record_request
from pdserve.errors import InvalidRequestError, PdserveError

log = logging.getLogger("pdserve.api")

MAX_BODY_BYTES = 4 * 1024 * 1024   # larger request bodies get a 413 (checked on Content-Length and on the bytes read)
MAX_DRAIN_BYTES = 64 * 1024 * 1024   # a refused body up to this size is read to its end before the 413 (_drain)
INLINE_PARSE_BYTES = 64 * 1024     # larger bodies are parsed and tokenized in a worker thread


class PayloadTooLargeError(InvalidRequestError):
    http_status = 413


class BodyReadTimeoutError(InvalidRequestError):
    http_status = 408
    error_type = "timeout_error"


class UnsupportedEncodingError(InvalidRequestError):
    http_status = 415


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def request_usage(handles: list[RequestHandle]) -> dict:
    """OpenAI ``usage`` of one HTTP request's sequences: each prompt once (api.protocol.prompt_counts), every
    choice's completion tokens."""
    prompt_tokens, cached_tokens = prompt_counts(handles)
    return usage(prompt_tokens, sum(h.completion_tokens for h in handles), cached_tokens)


def submit_all(client: EngineClient, requests: list[GenerationRequest]) -> list[RequestHandle]:
    """Admit one HTTP request's engine requests (a completions list: one per prompt, each with its ``n`` choices),
    all or none: back to back, with nothing awaited between them, so the actors take them together; when one is
    refused, those admitted before it are finished (their rows aborted) and its error raised. A list whose
    sequences do not fit beside those in flight (``max_queued_requests``) is refused before any is admitted, its
    503 counting them all (admitted one by one, its last prompt's 503 counted the list's own rows as in flight and
    asked for one prompt's; and the actors got prompts only to abort them). Returns every handle (each choice's
    ``index`` is its place in the response)."""
    if len(requests) > 1:
        client.check_room(sum(r.n for r in requests))
    handles: list[RequestHandle] = []
    try:
        for request in requests:
            handles += client.submit(request)
    except BaseException:   # all or none, whatever stopped it
        client.finish_all(handles)
        raise
    return handles


def error_response(error: PdserveError, request_id: str | None = None) -> JSONResponse:
    """OpenAI error JSON; ``request_id`` (else RequestIdMiddleware's) goes in ``x-request-id``."""
    headers = {}
    if error.http_status in (429, 503):
        headers["Retry-After"] = "1"
    elif error.http_status == 415:
        headers["Accept-Encoding"] = ", ".join(BODY_ENCODINGS)   # RFC 9110 section 15.5.16
    if request_id:
        headers["x-request-id"] = request_id
    body = error_body(error)
    body["error"]["message"] += timeline_hint(error.http_status, request_id)
    return JSONResponse(body, status_code=error.http_status, headers=headers or None)


def record_api(kind: int, handles: list[RequestHandle], **fields) -> None:
    """One flight-recorder event (ipc/recorder.py) per row of a request: headers, admission, bytes, close."""
    for h in handles:
        record_request(kind, h.request.request_id, h.slot, h.generation, **fields)


def request_timelines(client: EngineClient, request_id: str) -> dict | None:
    """``ipc.timeline.requests_report`` for ``request_id`` from this process's recorder; None without one."""
    import dataclasses

    from ipc.recorder import installed
    from ipc.timeline import requests_report

    writer = installed()
    if writer is None:
        return None
    return requests_report(writer.recorder.events(), time.monotonic_ns(), dataclasses.asdict(client.config),
                           client.topology.names, request_id)


def timeline_hint(status: int, request_id: str | None) -> str:
    """What a 503/504 body and log line add: the id and how to read its timeline (ipc/recorder.py)."""
    if status not in (503, 504) or not request_id:
        return ""
    return f" (request id {request_id}; its timeline: tools/inspect --request {request_id})"


class StopStringMatcher:
    """Holds back streamed text that could be the start of a stop string; the stop text is never returned."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""
        self.matched: str | None = None   # the stop string that ended the text

    def push(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, matched)."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            first = min(hits)
            self.matched = next(s for s in self.stops if self.pending.find(s) == first)
            out, self.pending = self.pending[:first], ""
            return out, True
        cut = max(len(self.pending) - self.hold, 0)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


async def generate_text(client: EngineClient, tokenizer, handle: RequestHandle,
                        metrics=None) -> AsyncIterator[tuple[str, str | None, list]]:
    """Yield ``(text_delta, finish_reason, logprobs)`` for one sequence; the last item has a finish reason.

    ``logprobs`` lists ``(token_id, [logprob, [[top_id, top_logprob], ...]])`` for the tokens received since the
    previous item (empty unless the request asked for log-probabilities; text held back by the stop-string
    matcher carries its tokens' logprobs to the next item).

    Raises:
        PdserveError: the engine or the monitor reported an error, or the deadline passed.
    """
    from gpu.tokenizer import IncrementalDetokenizer

    # a chat choice's parser markers stay in its text when they are special tokens (the rest are skipped)
    request = handle.request
    markers = marker_texts(request_formats(request), tools=getattr(request, "tools", None) is not None)
    detok = IncrementalDetokenizer(tokenizer, keep=tokenizer.special_ids_of(markers) if markers else frozenset())
    stops = StopStringMatcher(handle.request.stop)
    handle.completion_tokens = 0
    last_ns = 0
    logprobs: list = []
    while True:
        event = await client.next_event(handle)
        if event[0] == "error":
            raise event[1]
        _, token, reason, token_logprobs = event
        if request.echo_only:   # max_tokens 1 ran for the prompt's scores: its token is not part of the answer
            if reason is None:
                continue
            yield "", "length", []
            return
        if token_logprobs is not None:
            logprobs.append((token, token_logprobs))
        handle.completion_tokens += 1
        now_ns = time.monotonic_ns()
        if handle.first_token_ns == 0:
            handle.first_token_ns = now_ns
        elif metrics is not None:
            metrics.on_token((now_ns - last_ns) / 1e9)
        last_ns = now_ns
        text = detok.push(token)
        if reason is not None:
            # held-back bytes at the end (the output was cut inside a multi-byte character, e.g. at max_tokens)
            # decode to U+FFFD; they are not a character, so they are dropped rather than sent broken (S12)
            text += detok.flush().rstrip("\ufffd")
        out, matched = stops.push(text)
        if matched:
            handle.stop_string = stops.matched
            client.stop_generation(handle)
            yield out, "stop", logprobs
            return
        if reason is not None:
            yield out + stops.flush(), reason, logprobs
            return
        if out:
            yield out, None, logprobs
            logprobs = []


async def merged_choices(client: EngineClient, tokenizer, handles: list[RequestHandle],
                         metrics=None) -> AsyncIterator[tuple[int, str, str | None, list]]:
    """The ``n`` choices' :func:`generate_text` items merged in arrival order, as ``(index, text, finish_reason,
    logprobs)``. The first error of any choice is raised (the caller finishes every choice)."""
    if len(handles) == 1:
        async for item in generate_text(client, tokenizer, handles[0], metrics):
            yield (handles[0].index, *item)
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(handle: RequestHandle) -> None:
        try:
            async for item in generate_text(client, tokenizer, handle, metrics):
                queue.put_nowait((handle.index, item))
        except PdserveError as exc:
            queue.put_nowait((handle.index, exc))
        finally:
            if handle.on_text_end is not None:
                handle.on_text_end(handle)
            queue.put_nowait((handle.index, done))

    tasks = [asyncio.ensure_future(pump(h)) for h in handles]
    try:
        remaining = len(handles)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, PdserveError):
                raise item
            else:
                yield (index, *item)
    finally:
        for task in tasks:
            task.cancel()


async def read_body(request: Request, limit: int | None = None, timeout_s: float = 30.0) -> bytes:
    """The request body, never more than ``limit`` (default MAX_BODY_BYTES) bytes held in memory, each piece
    within ``timeout_s`` seconds of the previous one.

    Raises:
        PayloadTooLargeError (413): Content-Length or the bytes actually received exceed the limit.
        InvalidRequestError (400): Content-Length is not a number, or the body is empty.
        BodyReadTimeoutError (408): the client stopped sending in the middle of the body (slowloris).
        starlette.requests.ClientDisconnect: the client went away before the body was complete.
    """
    limit = MAX_BODY_BYTES if limit is None else limit
    declared = request.headers.get("content-length")
    pieces = request.stream().__aiter__()
    if declared is not None:
        if not declared.strip().isdigit():
            raise InvalidRequestError(f"Content-Length {declared!r} is not a number", param="Content-Length")
        if int(declared) > limit:
            await _drain(pieces, int(declared), timeout_s)
            raise PayloadTooLargeError(f"the request body has {int(declared)} bytes; the limit is {limit} "
                                       "(MAX_BODY_BYTES)")
    parts, size = [], 0
    while True:
        try:
            part = await asyncio.wait_for(pieces.__anext__(), timeout_s)
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise BodyReadTimeoutError(f"the request body stopped arriving: no bytes for {timeout_s:g} s after "
                                       f"{size} bytes (body_read_timeout_s)") from None
        size += len(part)
        if size > limit:
            await _drain(pieces, MAX_DRAIN_BYTES, timeout_s)
            raise PayloadTooLargeError(f"the request body is over the limit of {limit} bytes (MAX_BODY_BYTES)")
        parts.append(part)
    if size == 0:
        raise InvalidRequestError("the request body is empty; send a JSON object")
    return b"".join(parts)


async def _drain(pieces, declared_bytes: int, timeout_s: float) -> None:
    """Read and drop the rest of a refused body (at most MAX_DRAIN_BYTES, each piece within ``timeout_s``), so a
    client still sending it reads the 413 instead of a connection reset; a larger body is not read (the
    connection closes on it)."""
    if declared_bytes > MAX_DRAIN_BYTES:
        return
    dropped = 0
    try:
        while dropped <= MAX_DRAIN_BYTES:
            dropped += len(await asyncio.wait_for(pieces.__anext__(), timeout_s))
    except (StopAsyncIteration, asyncio.TimeoutError, ClientDisconnect):
        pass


# Content-Encoding codings of request bodies -> zlib wbits (None: nothing to decode)
BODY_ENCODINGS = {"identity": None, "gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS,
                  "deflate": zlib.MAX_WBITS}


def decode_body(raw: bytes, content_encoding: str | None, limit: int | None = None) -> bytes:
    """``raw`` decoded by its ``Content-Encoding`` (RFC 9110 section 8.4: codings listed in the order they were
    applied; ``identity``, ``gzip``/``x-gzip`` (concatenated members too) and ``deflate``, zlib-wrapped as the RFC
    says or raw as some clients send it), never holding more than ``limit`` (default MAX_BODY_BYTES) decoded
    bytes: the body limit applies to the decoded size, so a small body that inflates past it is refused.

    Raises:
        UnsupportedEncodingError (415): a coding other than those, named in the message.
        PayloadTooLargeError (413): the decoded body is over the limit.
        InvalidRequestError (400): the bytes are not valid data of their coding (corrupt or truncated).
    """
    if content_encoding is None or not content_encoding.strip():
        return raw
    limit = MAX_BODY_BYTES if limit is None else limit
    codings = [c.strip().lower() for c in content_encoding.split(",") if c.strip()]
    for coding in codings:
        if coding not in BODY_ENCODINGS:
            raise UnsupportedEncodingError(f"Content-Encoding {coding!r} is not supported; send the body as "
                                           f"{', '.join(BODY_ENCODINGS)}", param="Content-Encoding")
    for coding in reversed(codings):
        if BODY_ENCODINGS[coding] is not None:
            raw = _inflate(raw, coding, limit)
    return raw


def _inflate(data: bytes, coding: str, limit: int) -> bytes:
    wbits = BODY_ENCODINGS[coding]
    out = bytearray()
    try:
        while True:
            inflater = zlib.decompressobj(wbits)
            try:
                out += inflater.decompress(data, limit + 1 - len(out))
            except zlib.error:
                if coding != "deflate" or wbits < 0 or out:
                    raise
                wbits = -zlib.MAX_WBITS   # raw deflate (no zlib header): what some clients send as "deflate"
                continue
            if len(out) > limit:
                raise PayloadTooLargeError(f"the request body inflates past the limit of {limit} bytes "
                                           f"(MAX_BODY_BYTES, applied to the decoded body; Content-Encoding {coding})")
            if not inflater.eof:
                raise zlib.error("the compressed data ends early")
            data = inflater.unused_data
            if not (data.strip(b"\0") and wbits == BODY_ENCODINGS["gzip"]):   # another gzip member, or the end
                break
    except zlib.error as exc:
        raise InvalidRequestError(f"the request body is not valid {coding} data ({exc})",
                                  param="Content-Encoding") from None
    if data.strip(b"\0"):   # trailing bytes after the compressed data (gzip writers may pad with zeros)
        raise InvalidRequestError(f"the request body has bytes after its {coding} data", param="Content-Encoding")
    return bytes(out)


async def read_decoded_body(request: Request, timeout_s: float) -> bytes:
    """``read_body`` then ``decode_body`` by the request's Content-Encoding (inflating up to 4 MiB: off the event
    loop). Raises as both."""
    raw = await read_body(request, timeout_s=timeout_s)
    encoding = request.headers.get("content-encoding")
    return raw if encoding is None else await asyncio.to_thread(decode_body, raw, encoding)


def parse_json(raw: bytes) -> Any:
    """orjson, which rejects invalid UTF-8 and lone surrogates (``"\\ud800"``) as well as bad syntax."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}") from None


def parse_request(parser: RequestParser, kind: str, raw: bytes, request_id: str | None) -> list[GenerationRequest]:
    """Body bytes -> the validated engine requests: a chat's one, a completion's one per prompt. Bad input of any
    shape is a PdserveError (4xx), never a crash."""
    body = parse_json(raw)
    try:
        return [parser.chat(body, request_id)] if kind == "chat" else parser.completions(body, request_id)
    except PdserveError:
        raise
    except (RecursionError, MemoryError):
        raise InvalidRequestError("the request is nested too deeply or too large to validate") from None
    except Exception as exc:  # noqa: BLE001 - input the validator did not foresee: a 400, and a log line to fix it
        log.exception("unexpected error while validating a %s request", kind)
        raise InvalidRequestError(f"the request could not be validated ({type(exc).__name__})") from None


def build_app(client: EngineClient, tokenizer, parser: RequestParser, metrics, api_keys: tuple[str, ...] = (),
              extra_routes: tuple = (), allowed_origins: tuple[str, ...] = ()):
    """The ASGI app: the routes (plus ``extra_routes``, Starlette ``Route``s: a node's ``/internal/*``), behind
    api.middleware's API-key check (``api_keys``: none = open), ``x-request-id`` on every response and a log line
    per error; CORS (Starlette's CORSMiddleware, outermost so a preflight needs no key) for ``allowed_origins``
    (none = no CORS headers; ``*`` = any origin)."""
    from api.middleware import ApiKeyMiddleware, ErrorLogMiddleware, RequestIdMiddleware

    app = Routes(client, tokenizer, parser, metrics).app(extra_routes)
    app = ErrorLogMiddleware(RequestIdMiddleware(ApiKeyMiddleware(app, api_keys)))
    if allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app = CORSMiddleware(app, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"],
                             expose_headers=["x-request-id"], max_age=600)
    return app


class Routes:
    """The HTTP handlers over one EngineClient: OpenAI routes, /health, /metrics, and the error handlers."""

    def __init__(self, client: EngineClient, tokenizer, parser: RequestParser, metrics):
        self.client, self.tokenizer, self.parser, self.metrics = client, tokenizer, parser, metrics
        self.served = parser.served_model_name
        self.debug = DebugState(client)

    async def run_request(self, request: Request, kind: str) -> Response:
        headers_ns = time.monotonic_ns()
        rid = request.headers.get("x-request-id")
        try:
            raw = await read_decoded_body(request, self.client.config.body_read_timeout_s)
            if len(raw) > INLINE_PARSE_BYTES:
                # JSON + chat template + tokenizer over a large body: off the event loop (heartbeats, other streams)
                gens = await asyncio.to_thread(parse_request, self.parser, kind, raw, rid)
            else:
                gens = parse_request(self.parser, kind, raw, rid)
        except PdserveError as exc:
            return error_response(exc)   # the middleware names the client's id, or a new one
        except ClientDisconnect:   # gone before its body was complete: nobody to answer, nothing admitted
            return Response(status_code=499)
        gen = gens[0]   # the id, kind and stream settings of them all
        try:
            handles = submit_all(self.client, gens)
        except PdserveError as exc:
            return error_response(exc, gen.request_id)
        note_engine_requests(request.scope, handles)   # the connection ledger (api/http_edges.py)
        for _ in handles:
            self.metrics.on_admitted()
        record_api(EventKind.HTTP_HEADERS, handles, t_ns=headers_ns, a=len(raw))
        record_api(EventKind.ADMITTED, handles)
        if gen.stream:
            events = with_pings(self.stream_events(handles), self.client.config.sse_ping_interval_s)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "x-request-id": gen.request_id})
        return await self.complete(request, handles)

    def format_logprobs(self, choice: RequestHandle, handles: list[RequestHandle], tokens: list, text_offset: int,
                        with_prompt: bool = False) -> dict | None:
        """``choice``'s logprobs body; ``with_prompt`` (echo + logprobs) puts its prompt's tokens first, from
        offset 0 (the prefill actor sent their log-probabilities to one of the handles of that prompt's choices,
        among ``handles``)."""
        req = choice.request
        if req.sampling.logprobs is None:
            return None
        if req.kind == "chat":
            return chat_logprobs(self.tokenizer, tokens)
        if with_prompt and req.sampling.prompt_logprobs is not None:
            entries = next((h.prompt_logprobs for h in handles if h.request is req and h.prompt_logprobs), [])
            tokens = list(zip(req.prompt_ids, entries)) + tokens
        return completion_logprobs(self.tokenizer, tokens, text_offset)

    def finished(self, handles: list[RequestHandle], reasons: dict[int, str | None], status: int = 200) -> None:
        """Count every choice once: with its own finish reason, or (unfinished) as an abort (499) or an error."""
        for h in handles:
            reason = h.finish_reason = reasons.get(h.index)
            if reason is None:
                self.metrics.on_finished(h, "abort" if status == 499 else "error", status)
            else:
                self.metrics.on_finished(h, reason)

    async def complete(self, request: Request, handles: list[RequestHandle]) -> Response:
        req = handles[0].request
        choice_of = {h.index: h for h in handles}

        async def collect() -> list[ChoiceResult]:
            texts: dict[int, list[str]] = {h.index: [h.request.echo_text or ""] for h in handles}
            tokens: dict[int, list] = {h.index: [] for h in handles}
            async for index, text, reason, logprobs in merged_choices(
                    self.client, self.tokenizer, handles, self.metrics):
                texts[index].append(text)
                tokens[index].extend(logprobs)
                if reason is not None:
                    reasons[index] = reason
            results = [ChoiceResult(i, "".join(texts[i]), reasons.get(i),
                                    self.format_logprobs(choice_of[i], handles, tokens[i], 0, True)) for i in texts]
            formats = request_formats(req)
            if formats is not None:   # reasoning, then the tool calls (or a named function's arguments)
                for c in results:
                    finish_choice(formats, req.tools, c)
                    reasons[c.index] = c.finish_reason
            return results

        async def wait_disconnect() -> None:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    return

        reasons: dict[int, str | None] = {}
        work = asyncio.ensure_future(collect())
        watch = asyncio.ensure_future(wait_disconnect())
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if work not in done:
                self.finished(handles, reasons, 499)
                record_api(EventKind.CLOSED, handles, aux=ClosedBy.CLIENT, a=499)
                return Response(status_code=499)
            try:
                choices = work.result()
            except PdserveError as exc:   # logged by ErrorLogMiddleware
                self.finished(handles, reasons, exc.http_status)
                record_api(EventKind.CLOSED, handles, aux=ClosedBy.SERVER, a=exc.http_status)
                return error_response(exc, req.request_id)
            self.finished(handles, reasons)
            record_api(EventKind.LAST_BYTE, handles, a=200)
            record_api(EventKind.CLOSED, handles, aux=ClosedBy.SERVER, a=200)
            return JSONResponse(full_response(req, choices, request_usage(handles)),
                                headers={"x-request-id": req.request_id})
        finally:
            for task in (work, watch):
                task.cancel()
            self.client.finish_all(handles)

    async def stream_events(self, handles: list[RequestHandle]) -> AsyncIterator[bytes]:
        req = handles[0].request
        reasons: dict[int, str | None] = {}
        status = 499   # until the stream ends normally or with an error event
        choice_of = {h.index: h for h in handles}
        first = set(choice_of)   # choices whose first chunk is still to come
        offsets = {h.index: 0 for h in handles}   # characters of the choice's text sent so far (echo included)
        formats = request_formats(req)   # reasoning and tool calls parsed out of the text (api/formats.py)
        tools = {h.index: ChatDeltas(formats, req.tools) for h in handles} if formats is not None else {}
        try:
            try:
                async for index, text, reason, logprobs in merged_choices(
                    self.client, self.tokenizer, handles, self.metrics):
                    echo = choice_of[index].request.echo_text
                    if index in first and echo:
                        text = echo + text
                    pieces: list = [(text, None, None)]
                    if tools:   # text becomes content, delta.tool_calls and delta.reasoning_content pieces
                        pieces = tools[index].push(text, reason) or [("", None, None)]
                        reason = tools[index].finish_reason(reason)
                    if reason is not None:
                        reasons[index] = reason
                    for k, (piece, calls, thought) in enumerate(pieces):
                        piece_reason = reason if k == len(pieces) - 1 else None
                        piece_logprobs = logprobs if k == 0 else []
                        if piece or calls or thought or piece_reason is not None or index in first or piece_logprobs:
                            body = chunk(req, piece, piece_reason, first=index in first, index=index,
                                         logprobs=self.format_logprobs(choice_of[index], handles, piece_logprobs,
                                                                       offsets[index], index in first),
                                         tool_calls=calls, reasoning=thought)
                            offsets[index] += len(piece or "")
                            if len(first) == len(handles):
                                record_api(EventKind.FIRST_BYTE, handles)
                            first.discard(index)
                            yield b"data: " + orjson.dumps(body) + b"\n\n"
                status = 200
                if req.include_usage:
                    body = chunk(req, None, None, usage_body=request_usage(handles))
                    yield b"data: " + orjson.dumps(body) + b"\n\n"
            except PdserveError as exc:
                log.warning("request %s: %d %s%s", req.request_id, exc.http_status, exc.message,   # the whole id
                            timeline_hint(exc.http_status, req.request_id))
                status = exc.http_status
                body = error_body(exc)
                body["error"]["message"] += timeline_hint(exc.http_status, req.request_id)
                yield b"data: " + orjson.dumps(body) + b"\n\n"
            yield b"data: [DONE]\n\n"
            record_api(EventKind.LAST_BYTE, handles, a=status)
        finally:
            record_api(EventKind.CLOSED, handles, aux=ClosedBy.CLIENT if status == 499 else ClosedBy.SERVER, a=status)
            self.finished(handles, reasons, status)
            self.client.finish_all(handles)

    async def chat_completions(self, request: Request) -> Response:
        return await self.run_request(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self.run_request(request, "completion")

    def model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "pdserve",
                "max_model_len": self.parser.max_context_tokens}

    async def models(self, request: Request) -> Response:
        """The served model under its first name (the others are aliases, accepted in ``model``)."""
        return JSONResponse({"object": "list", "data": [self.model_card(self.served)]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model_id"]
        if name not in self.parser.model_names:
            return JSONResponse(error_body(f"The model '{name}' does not exist", "not_found_error", "model",
                                           "model_not_found"), status_code=404)
        return JSONResponse(self.model_card(name))

    async def embeddings(self, request: Request) -> Response:
        return JSONResponse(error_body(f"'{self.served}' is a generation model; this server does not compute "
                                       "embeddings (serve an embedding model elsewhere)", "invalid_request_error",
                                       "model", "model_not_supported"), status_code=400)

    async def tokenize(self, request: Request) -> Response:
        return await self.json_tool(request, self.parser.tokenize)

    async def detokenize(self, request: Request) -> Response:
        return await self.json_tool(request, self.parser.detokenize)

    async def json_tool(self, request: Request, handler) -> Response:
        """A small JSON-in, JSON-out route: the body through ``handler`` (off the event loop: a tokenizer run)."""
        try:
            body = parse_json(await read_decoded_body(request, self.client.config.body_read_timeout_s))
            return JSONResponse(await asyncio.to_thread(handler, body))
        except PdserveError as exc:
            return error_response(exc)
        except ClientDisconnect:
            return Response(status_code=499)

    async def health(self, request: Request) -> Response:
        """Readiness with its report: 200 while a route through prefill and decode serves, else 503 with the
        reasons (api.metrics.not_ready); ``problems`` also names actors down beside others that serve."""
        report = self.metrics.health()
        return JSONResponse(report, status_code=200 if report["status"] == "ok" else 503)

    async def live(self, request: Request) -> Response:
        """Liveness: the API process answers (nothing else is looked at)."""
        return JSONResponse({"status": "ok"})

    async def metrics_route(self, request: Request) -> Response:
        data, content_type = self.metrics.render()
        return Response(data, media_type=content_type)

    async def debug_state(self, request: Request) -> Response:
        try:
            sample_s = self.debug.sample_s(request.query_params.get("sample_s"))
            # copies of the tables plus a loop-rate sample: a worker thread, never the event loop
            return JSONResponse(await asyncio.to_thread(self.debug.snapshot, sample_s))
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
        from api.dialects.routes import DialectRoutes

        routes = [*extra_routes, *DialectRoutes(self).routes()]
        for prefix in ("/v1", ""):   # llama.cpp serves them without /v1 too
            routes += [
                Route(prefix + "/chat/completions", self.chat_completions, methods=["POST"]),
                Route(prefix + "/completions", self.completions, methods=["POST"]),
                Route(prefix + "/models", self.models, methods=["GET"]),
                Route(prefix + "/models/{model_id:path}", self.model, methods=["GET"]),
                Route(prefix + "/embeddings", self.embeddings, methods=["POST"]),
            ]
        routes += [   # GET routes answer HEAD too (Starlette)
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
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
