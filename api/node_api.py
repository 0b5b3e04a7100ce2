"""A node's side of multi-node serving: the ``/internal/*`` routes `pdserve router` (api/router_client.py) calls
on a node started with ``--role prefill`` or ``--role decode`` (docs/architecture.md, "Nodes and the router").

Prefill node:
    ``POST /internal/prefill``  ``{"request": REQUEST}`` -> admits it (rows QUEUED, decode actor REMOTE_ACTOR),
        waits for every choice's KVReady (the prefill actor sends it to this API) and answers ``{"engine_id",
        "rows": [[slot, generation], ...], "kv_ready": [KVReady wire frame, ...], "peer": descriptor JSON,
        "prompt_logprobs": [...]}``; the rows stay in BOOTSTRAP (the inflight queue) until
    ``POST /internal/transfer_done`` ``{"slot", "generation"}`` (the decode node holds its copy: the row ends
        FINISHED, the blocks are freed) or ``POST /internal/abort`` ``{"rows": [[slot, generation], ...]}``, or
        this node's monitor fails them at their deadline.
Decode node:
    ``POST /internal/decode`` ``{"request": REQUEST, "kv_ready": KVReady wire frame, "peer": descriptor JSON}``
        -> admits the prefilled request at BOOTSTRAP and streams NDJSON lines: ``{"row": [slot, generation]}``
        first (the router aborts it there by ``/internal/abort`` when it ends the request early), ``{"transfer_done":
        true}`` once the
        KV is pulled, ``{"token": [token_id, finish_reason, logprobs], "timings": {...}}`` per token (timings with
        the first), ``{"error": {"message", "type", "status"}}``. Closing the stream aborts the row.
Both: ``GET /internal/status`` -> ``{"engine_id", "role", "healthy", "problems", "active", "kv_blocks_free"}``; a
prefill node with a prefix cache adds ``"cache": {"block_tokens", "words"}``: the block keys its prefill actors
cache (ipc/cache_summary.py ``encode_words``), for `pdserve router`'s cache-aware choice. ``GET /internal/state``
-> the node's ``/debug/state`` snapshot (api/debug_state.py), which the router's own ``/debug/state`` gathers.

Only a node (``role`` prefill or decode) mounts these routes (api/server.py), and api/middleware.py lets through
only the router's ``node_secret`` to them (an API key is a 401). Bodies are read as the public routes' are
(api/body.py: MAX_BODY_BYTES decoded, Content-Encoding, body_read_timeout_s).

REQUEST is ``{"request_id", "prompt_ids", "sampling": Sampling wire list, "n", "timeout_s"}``. Errors before a
stream starts are OpenAI error JSON with their status (a bad body: 400; too large: 413; too slow: 408).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, AsyncIterator

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from actors.messages import KVReady, from_wire, to_wire
from api.debug_state import DebugState
from api.engine_client import EngineClient, RequestHandle
from api.protocol import SAMPLING_BOUNDS, SAMPLING_NOT_ZERO, GenerationRequest, error_body
from ipc.cache_summary import encode_words
from pdserve.errors import InvalidRequestError, PdserveError
from pdserve.sampling import Sampling

log = logging.getLogger("pdserve.api")


def generation_request(body: Any, limits: "NodeLimits | None" = None) -> GenerationRequest:
    """The REQUEST object of an internal call, checked as the public parser checks a request (token ids in the
    vocabulary, prompt + max_tokens within the context: ``limits``). Raises InvalidRequestError naming the bad
    field."""
    if not isinstance(body, dict):
        raise InvalidRequestError("'request' must be an object")
    rid, prompt_ids, n = body.get("request_id"), body.get("prompt_ids"), body.get("n", 1)
    if not isinstance(rid, str) or not rid:
        raise InvalidRequestError("'request_id' must be a non-empty string", param="request_id")
    if (not isinstance(prompt_ids, list) or not prompt_ids
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt_ids)):
        raise InvalidRequestError("'prompt_ids' must be a non-empty list of token ids", param="prompt_ids")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise InvalidRequestError("'n' must be a positive integer", param="n")
    sampling = sampling_from_wire(body.get("sampling"))
    if limits is not None:
        limits.check_prompt(len(prompt_ids), max([*prompt_ids, *sampling.logit_bias_ids]), sampling.max_tokens)
    if n > 128:
        raise InvalidRequestError("'n' must be at most 128", param="n")
    timeout_s = body.get("timeout_s")
    if timeout_s is not None and (not isinstance(timeout_s, (int, float)) or timeout_s <= 0):
        raise InvalidRequestError("'timeout_s' must be a positive number", param="timeout_s")
    return GenerationRequest("completion", rid, "", prompt_ids, sampling, n=n, timeout_s=timeout_s)


_OPTIONAL_INT = ("seed", "logprobs", "prompt_logprobs")


def _field_ok(name: str, default: Any, value: Any) -> bool:
    """``value``'s type fits Sampling field ``name`` (whose default is ``default``)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if name in _OPTIONAL_INT:
        return value is None or (isinstance(value, int) and not isinstance(value, bool))
    if name == "grammar":
        return value is None or isinstance(value, str)
    if name == "reasoning_end":
        return isinstance(value, str) and len(value) <= 64
    if name == "reasoning_budget":
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
    if name == "logit_bias_values":
        return isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                        for v in value)
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        return number
    return isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _in_bounds(name: str, value: Any) -> bool:
    """``value`` is within what the public parser accepts for Sampling field ``name`` (api/protocol.py
    ``SAMPLING_BOUNDS``, ``SAMPLING_NOT_ZERO``); a field without bounds always is."""
    if name not in SAMPLING_BOUNDS or value is None:
        return True
    low, high = SAMPLING_BOUNDS[name]
    values = value if isinstance(value, (list, tuple)) else (value,)
    return all(low <= v <= high and not (v == 0 and name in SAMPLING_NOT_ZERO) for v in values)


def sampling_from_wire(values: Any) -> Sampling:
    """A ``Sampling`` from its wire list (``dataclasses.astuple`` order), every field type-checked and within the
    public parser's bounds: the actors trust what reaches them. Raises InvalidRequestError naming the first bad
    field."""
    fields = dataclasses.fields(Sampling)
    if not isinstance(values, list) or len(values) != len(fields):
        raise InvalidRequestError(f"'sampling' must be a list of {len(fields)} values", param="sampling")
    for f, value in zip(fields, values):
        if not _field_ok(f.name, f.default, value) or not _in_bounds(f.name, value):
            raise InvalidRequestError(f"'sampling' field {f.name} has a bad value {value!r}", param="sampling")
    sampling = Sampling(*values)
    if len(sampling.logit_bias_ids) != len(sampling.logit_bias_values) or any(t < 0 for t in sampling.logit_bias_ids):
        raise InvalidRequestError("'sampling' logit_bias ids must be token ids, as many as its values",
                                  param="sampling")
    return dataclasses.replace(sampling, stop_token_ids=tuple(sampling.stop_token_ids),
                               logit_bias_ids=tuple(sampling.logit_bias_ids),
                               logit_bias_values=tuple(sampling.logit_bias_values))


@dataclasses.dataclass(frozen=True)
class NodeLimits:
    """What this node can hold: the vocabulary, the context (prompt + output tokens), the KV block size."""

    vocab_size: int
    max_context_tokens: int
    block_tokens: int

    def check_prompt(self, prompt_tokens: int, max_token_id: int, max_tokens: int) -> None:
        if max_token_id >= self.vocab_size:   # the prompt's and logit_bias's
            raise InvalidRequestError(f"token ids must be in [0, {self.vocab_size})", param="prompt_ids")
        if prompt_tokens + max_tokens > self.max_context_tokens:
            raise InvalidRequestError(f"prompt ({prompt_tokens}) + max_tokens ({max_tokens}) exceed the context "
                                      f"({self.max_context_tokens})", param="max_tokens")

    def check_kv_ready(self, ready: KVReady) -> None:
        """A KVReady's numbers before any actor sees them: a prompt that fits, one block id per block of it,
        ids within the source pool (``ready.peer``'s descriptor), a first token in the vocabulary. Raises
        InvalidRequestError."""
        ids = ready.src_block_ids
        if not isinstance(ready.num_tokens, int) or isinstance(ready.num_tokens, bool) or ready.num_tokens < 1:
            raise InvalidRequestError("'kv_ready' num_tokens must be a positive integer", param="kv_ready")
        self.check_prompt(ready.num_tokens, max(ready.sampling.logit_bias_ids, default=0), ready.sampling.max_tokens)
        if not isinstance(ids, list) or len(ids) != -(-ready.num_tokens // self.block_tokens):
            raise InvalidRequestError("'kv_ready' needs one source block id per block of the prompt",
                                      param="kv_ready")
        try:
            # ipc.mooncake_transport.PeerDescriptor's JSON (read here without importing the optional library)
            num_blocks = orjson.loads(ready.peer)["num_blocks"]
            if not isinstance(num_blocks, int):
                raise TypeError(f"num_blocks {num_blocks!r}")
        except (orjson.JSONDecodeError, TypeError, KeyError) as exc:
            raise InvalidRequestError(f"'peer' is not a KV pool descriptor ({exc})", param="peer") from None
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_blocks for i in ids):
            raise InvalidRequestError(f"'kv_ready' block ids must be in [0, {num_blocks})", param="kv_ready")
        token = ready.first_token
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < self.vocab_size:
            raise InvalidRequestError(f"'kv_ready' first_token must be in [0, {self.vocab_size})", param="kv_ready")

        def ints(values, low: int, high: int) -> bool:
            return isinstance(values, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                                    and low <= v < high for v in values)
        checks = {"request_id": isinstance(ready.request_id, str) and 0 < len(ready.request_id) <= 256,
                  "queue_s": _seconds(ready.queue_s), "prefill_s": _seconds(ready.prefill_s),
                  "prompt_ids": ints(ready.prompt_ids, 0, self.vocab_size)
                  and len(ready.prompt_ids) in (0, ready.num_tokens),
                  "cached_tokens": ints([ready.cached_tokens], 0, ready.num_tokens + 1),
                  "prompt_row": ints(ready.prompt_row, 0, 2**32) and len(ready.prompt_row) in (0, 2),
                  "first_logprobs": ready.first_logprobs is None or _logprob_entry(ready.first_logprobs)}
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise InvalidRequestError(f"'kv_ready' has bad {', '.join(bad)}", param="kv_ready")


def _seconds(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1e9


def _logprob_entry(entry: Any) -> bool:
    """``[logprob, [[token_id, logprob], ...]]``"""
    def pair(p: Any) -> bool:
        return isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and isinstance(p[1], (int, float))
    return (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], (int, float))
            and isinstance(entry[1], list) and all(pair(p) for p in entry[1]))


def request_wire(request: GenerationRequest) -> dict:
    """The REQUEST object of ``request`` (the router's side of ``generation_request``)."""
    return {"request_id": request.request_id, "prompt_ids": list(request.prompt_ids),
            "sampling": list(dataclasses.astuple(request.sampling)), "n": request.n, "timeout_s": request.timeout_s}


def node_timeout(handle: RequestHandle) -> PdserveError:
    from pdserve.errors import RequestTimeoutError

    return RequestTimeoutError(f"request {handle.request.request_id} passed its deadline waiting for its KV")


def note_trace(scope: dict, handles: list[RequestHandle]) -> None:
    """Give the internal call's trace note (api/tracing.py, when tracing is on) its rows, so this node exports the
    request's stages under the ``traceparent`` the router sent (one trace across the router's nodes)."""
    trace = scope.get("pdserve.trace")
    if trace is not None:
        trace.handles = list(handles)


def error_json(error: PdserveError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.http_status)


class NodeRoutes:
    """The ``/internal/*`` handlers over this node's EngineClient; ``health`` is the node's /health report
    (api.metrics.EngineMetrics.health), ``engine_id`` names the node in every answer."""

    def __init__(self, client: EngineClient, health, engine_id: str, limits: NodeLimits):
        self.client, self.health, self.engine_id, self.limits = client, health, engine_id, limits
        self._descriptors: dict[int, Any] = {}
        self.debug = DebugState(client)

    def routes(self) -> list[Route]:
        return [Route("/internal/prefill", self.prefill, methods=["POST"]),
                Route("/internal/transfer_done", self.transfer_done, methods=["POST"]),
                Route("/internal/abort", self.abort, methods=["POST"]),
                Route("/internal/decode", self.decode, methods=["POST"]),
                Route("/internal/status", self.status, methods=["GET"]),
                Route("/internal/state", self.state, methods=["GET"])]

    async def _body(self, request: Request) -> dict:
        """The JSON object of the call's body, read as a public route's (api/body.py). Raises PdserveError: 400
        (not JSON, not an object), 408 (too slow), 413 (over MAX_BODY_BYTES decoded), 415 (a coding), 499 (the
        router went away mid-body)."""
        from starlette.requests import ClientDisconnect

        from api.body import parse_json, read_decoded_body

        try:
            body = parse_json(await read_decoded_body(request, self.client.config.body_read_timeout_s))
        except ClientDisconnect:
            error = PdserveError("the router closed the connection before sending the whole body")
            error.http_status, error.error_type = 499, "client_closed_request"
            raise error from None
        if not isinstance(body, dict):
            raise InvalidRequestError("the body must be a JSON object")
        return body

    # ---- prefill node -----------------------------------------------------------------------------
    def peer_descriptor(self, prefill_actor: int) -> str:
        """The Mooncake descriptor JSON prefill actor ``prefill_actor`` published for its pool (read each call:
        a restarted actor republishes). Raises FileNotFoundError if it is not published."""
        from ipc.mooncake_transport import attach_descriptor, descriptor_name, read_descriptor

        name = descriptor_name(self.client.layout.segment(self.client.topology.segment("kv", prefill_actor)))
        if prefill_actor not in self._descriptors:
            self._descriptors[prefill_actor] = attach_descriptor(name)
        return read_descriptor(self._descriptors[prefill_actor], name)[1].to_json()

    async def prefill(self, request: Request) -> Response:
        handles: list[RequestHandle] = []
        done = False
        try:
            gen = generation_request((await self._body(request)).get("request"), self.limits)
            handles = self.client.submit(gen, remote_decode=True)
            note_trace(request.scope, handles)
            readies = [await self._kv_ready(h, request) for h in handles]
            answer = {"engine_id": self.engine_id, "rows": [list(h.key) for h in handles],
                      "kv_ready": [to_wire(r) for r in readies],
                      "peer": self.peer_descriptor(handles[0].prefill_actor),
                      "prompt_logprobs": handles[0].prompt_logprobs}
            for h in handles:
                h.handed_across = True
            done = True
            return Response(orjson.dumps(answer), media_type="application/json")
        except PdserveError as exc:
            return error_json(exc)
        except FileNotFoundError as exc:   # the prefill actor restarted between its KVReady and now
            return error_json(PdserveError(f"the prefill pool's descriptor is gone ({exc}); retry"))
        finally:
            if not done:   # an error, or the router went away while waiting (cancelled): nobody takes the KV
                self.client.finish_all(handles)

    async def _kv_ready(self, handle: RequestHandle, request: Request) -> KVReady:
        """The choice's KVReady. Raises its error, or InvalidRequestError (499) when the router went away
        meanwhile (checked every ``monitor_tick_s``: its rows are then aborted, not left to the deadline)."""
        while True:
            try:   # a cancelled Queue.get loses no item
                event = await asyncio.wait_for(handle.events.get(), self.client.config.monitor_tick_s)
            except asyncio.TimeoutError:
                if time.monotonic() > handle.deadline_s + 1.0:   # the monitor should have fired first
                    raise node_timeout(handle) from None
                if await request.is_disconnected():
                    error = PdserveError("the router closed the connection before the KV was ready")
                    error.http_status, error.error_type = 499, "client_closed_request"
                    raise error from None
                continue
            if event[0] == "error":
                raise event[1]
            if event[0] == "kv_ready":
                return event[1]

    async def transfer_done(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            slot, generation = int(body["slot"]), int(body["generation"])
        except PdserveError as exc:
            return error_json(exc)
        except (KeyError, TypeError, ValueError):
            return error_json(InvalidRequestError("'slot' and 'generation' must be integers"))
        held = self.client.remote_transfer_done(slot, generation)
        return JSONResponse({"held": held})

    async def abort(self, request: Request) -> Response:
        try:
            rows = [(int(s), int(g)) for s, g in (await self._body(request)).get("rows", [])]
        except PdserveError as exc:
            return error_json(exc)
        except (TypeError, ValueError):
            return error_json(InvalidRequestError("'rows' must be a list of [slot, generation]"))
        handles = [h for h in (self.client.handles.get(key) for key in rows) if h is not None]
        for handle in handles:   # a stream or a prefill still waiting on it ends now
            error = PdserveError("the router aborted the request")
            error.http_status, error.error_type = 499, "client_closed_request"
            handle.events.put_nowait(("error", error))
        self.client.finish_all(handles)
        return JSONResponse({"aborted": len(handles)})

    # ---- decode node ------------------------------------------------------------------------------
    async def decode(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            if self.client.config.role != "decode":
                raise InvalidRequestError(f"this node runs the {self.client.config.role} side; /internal/decode is "
                                          "a decode node's")
            gen = generation_request(body.get("request"), self.limits)
            frame = body.get("kv_ready")
            if not isinstance(frame, list) or frame[:1] != [KVReady.kind] or not isinstance(body.get("peer"), str):
                raise InvalidRequestError("'kv_ready' must be a KVReady frame and 'peer' a descriptor string")
            try:   # the sampling that travels is the request's, checked above
                ready = dataclasses.replace(from_wire(frame), sampling=gen.sampling, peer=body["peer"])
            except (ValueError, TypeError) as exc:
                raise InvalidRequestError(f"'kv_ready' is not a KVReady frame ({exc})") from None
            self.limits.check_kv_ready(ready)
            handle = self.client.admit_prefilled(gen, ready, gen.timeout_s)
            note_trace(request.scope, [handle])
        except PdserveError as exc:
            return error_json(exc)
        return StreamingResponse(self._stream(handle), media_type="application/x-ndjson")

    async def _stream(self, handle: RequestHandle) -> AsyncIterator[bytes]:
        first = True
        try:
            yield orjson.dumps({"row": list(handle.key)}) + b"\n"   # what the router names in /internal/abort
            while True:
                try:
                    event = await self.client.next_event(handle)
                except PdserveError as exc:
                    event = ("error", exc)
                if event[0] == "error":
                    err = event[1]
                    yield orjson.dumps({"error": {"message": err.message, "type": err.error_type,
                                                  "status": err.http_status}}) + b"\n"
                    return
                if event[0] == "transfer_done":
                    yield b'{"transfer_done":true}\n'
                    continue
                line: dict[str, Any] = {"token": list(event[1:])}
                if first:
                    line["timings"] = handle.timings
                    first = False
                yield orjson.dumps(line) + b"\n"
                if event[2] is not None:   # a finish reason: the sequence is over
                    return
        finally:   # done, or the router closed the stream (client gone, stop string): the row ends here
            self.client.finish(handle)

    # ---- both -------------------------------------------------------------------------------------
    async def state(self, request: Request) -> Response:
        """The node's /debug/state snapshot (``sample_s`` as there), for the router's /debug/state."""
        try:
            return JSONResponse(await self.debug.answer(request.query_params.get("sample_s")))
        except PdserveError as exc:
            return error_json(exc)

    async def status(self, request: Request) -> Response:
        report = await asyncio.get_running_loop().run_in_executor(None, self.health)
        rows = self.client.actors.rows()
        engine = self.client.topology.prefill + self.client.topology.decode
        answer = {"engine_id": self.engine_id, "role": self.client.config.role,
                  "healthy": report["status"] == "ok", "problems": report["problems"],
                  "active": self.client.num_active(),
                  "kv_blocks_free": sum(int(rows[i]["kv_blocks_free"]) for i in engine)}
        words = self.client.admission.cached_words() if self.client.config.role == "prefill" else None
        if words is not None:   # what its prefill caches hold, for the router's cache-aware choice
            answer["cache"] = {"block_tokens": self.client.config.kv_block_tokens, "words": encode_words(words)}
        return JSONResponse(answer)
