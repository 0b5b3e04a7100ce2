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
        -> admits the prefilled request at BOOTSTRAP and streams NDJSON lines: ``{"transfer_done": true}`` once the
        KV is pulled, ``{"token": [token_id, finish_reason, logprobs], "timings": {...}}`` per token (timings with
        the first), ``{"error": {"message", "type", "status"}}``. Closing the stream aborts the row.
Both: ``GET /internal/status`` -> ``{"engine_id", "role", "healthy", "problems", "active", "kv_blocks_free"}``.

REQUEST is ``{"request_id", "prompt_ids", "sampling": Sampling wire list, "n", "timeout_s"}``. Errors before a
stream starts are OpenAI error JSON with their status (a bad body: 400).
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

from actors.messages import KVReady, Sampling, from_wire, to_wire
from api.engine_client import EngineClient, RequestHandle
from api.protocol import GenerationRequest, error_body
from pdserve.errors import InvalidRequestError, PdserveError

log = logging.getLogger("pdserve.api")


def generation_request(body: Any) -> GenerationRequest:
    """The REQUEST object of an internal call. Raises InvalidRequestError naming the bad field."""
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
    timeout_s = body.get("timeout_s")
    if timeout_s is not None and (not isinstance(timeout_s, (int, float)) or timeout_s <= 0):
        raise InvalidRequestError("'timeout_s' must be a positive number", param="timeout_s")
    return GenerationRequest("completion", rid, "", prompt_ids, sampling, n=n, timeout_s=timeout_s)


_OPTIONAL_INT = ("seed", "logprobs", "prompt_logprobs")


def _field_ok(name: str, default: Any, value: Any) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if name in _OPTIONAL_INT:
        return value is None or (isinstance(value, int) and not isinstance(value, bool))
    if name == "grammar":
        return value is None or isinstance(value, str)
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        return number
    return isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def sampling_from_wire(values: Any) -> Sampling:
    """A ``Sampling`` from its wire list (``dataclasses.astuple`` order), every field type-checked: the actors
    trust what reaches them. Raises InvalidRequestError naming the first bad field."""
    fields = dataclasses.fields(Sampling)
    if not isinstance(values, list) or len(values) != len(fields):
        raise InvalidRequestError(f"'sampling' must be a list of {len(fields)} values", param="sampling")
    for f, value in zip(fields, values):
        if not _field_ok(f.name, f.default, value):
            raise InvalidRequestError(f"'sampling' field {f.name} has a bad value {value!r}", param="sampling")
    sampling = Sampling(*values)
    return dataclasses.replace(sampling, stop_token_ids=tuple(sampling.stop_token_ids))


def request_wire(request: GenerationRequest) -> dict:
    """The REQUEST object of ``request`` (the router's side of ``generation_request``)."""
    return {"request_id": request.request_id, "prompt_ids": list(request.prompt_ids),
            "sampling": list(dataclasses.astuple(request.sampling)), "n": request.n, "timeout_s": request.timeout_s}


def node_timeout(handle: RequestHandle) -> PdserveError:
    from pdserve.errors import RequestTimeoutError

    return RequestTimeoutError(f"request {handle.request.request_id} passed its deadline waiting for its KV")


def error_json(error: PdserveError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.http_status)


class NodeRoutes:
    """The ``/internal/*`` handlers over this node's EngineClient; ``health`` is the node's /health report
    (api.metrics.EngineMetrics.health), ``engine_id`` names the node in every answer."""

    def __init__(self, client: EngineClient, health, engine_id: str):
        self.client, self.health, self.engine_id = client, health, engine_id
        self._descriptors: dict[int, Any] = {}

    def routes(self) -> list[Route]:
        return [Route("/internal/prefill", self.prefill, methods=["POST"]),
                Route("/internal/transfer_done", self.transfer_done, methods=["POST"]),
                Route("/internal/abort", self.abort, methods=["POST"]),
                Route("/internal/decode", self.decode, methods=["POST"]),
                Route("/internal/status", self.status, methods=["GET"])]

    async def _body(self, request: Request) -> dict:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as exc:
            raise InvalidRequestError(f"the body is not valid JSON ({exc})") from None
        if not isinstance(body, dict):
            raise InvalidRequestError("the body must be a JSON object")
        return body

    # ---- prefill node -----------------------------------------------------------------------------
    def peer_descriptor(self, prefill_actor: int) -> str:
        """The Mooncake descriptor JSON prefill actor ``prefill_actor`` published for its pool (read each call:
        a restarted actor republishes). Raises FileNotFoundError if it is not published."""
        from ipc import _shm
        from ipc.mooncake_transport import descriptor_name, read_descriptor

        name = descriptor_name(self.client.layout.segment(self.client.topology.segment("kv", prefill_actor)))
        if prefill_actor not in self._descriptors:
            self._descriptors[prefill_actor] = _shm.attach_segment(name, readonly=True)
        return read_descriptor(self._descriptors[prefill_actor], name)[1].to_json()

    async def prefill(self, request: Request) -> Response:
        handles: list[RequestHandle] = []
        done = False
        try:
            gen = generation_request((await self._body(request)).get("request"))
            handles = self.client.submit(gen, remote_decode=True)
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
        self.client.finish_all(handles)
        return JSONResponse({"aborted": len(handles)})

    # ---- decode node ------------------------------------------------------------------------------
    async def decode(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            gen = generation_request(body.get("request"))
            try:
                ready = from_wire(body.get("kv_ready"))
            except (ValueError, TypeError) as exc:
                raise InvalidRequestError(f"'kv_ready' is not a KVReady frame ({exc})") from None
            if not isinstance(ready, KVReady) or not isinstance(body.get("peer"), str):
                raise InvalidRequestError("'kv_ready' must be a KVReady frame and 'peer' a descriptor string")
            ready = dataclasses.replace(ready, peer=body["peer"])
            handle = self.client.admit_prefilled(gen, ready, gen.timeout_s)
        except PdserveError as exc:
            return error_json(exc)
        return StreamingResponse(self._stream(handle), media_type="application/x-ndjson")

    async def _stream(self, handle: RequestHandle) -> AsyncIterator[bytes]:
        first = True
        try:
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
    async def status(self, request: Request) -> Response:
        report = await asyncio.get_running_loop().run_in_executor(None, self.health)
        rows = self.client.actors.rows()
        engine = self.client.topology.prefill + self.client.topology.decode
        return JSONResponse({"engine_id": self.engine_id, "role": self.client.config.role,
                             "healthy": report["status"] == "ok", "problems": report["problems"],
                             "active": self.client.num_active(),
                             "kv_blocks_free": sum(int(rows[i]["kv_blocks_free"]) for i in engine)})
