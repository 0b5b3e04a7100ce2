"""The API process's view of the engine: admits requests into the state table and the prefill queue,
and routes token and error messages back to the waiting HTTP handlers.

One receiver thread blocks on the API's shm inbox (for at most ``idle_wait_s`` at a time, so it also notices
shutdown) and hands each message to the asyncio loop with ``call_soon_threadsafe``. The state table is the
arbiter of every request's fate: an abort here is a transition to ABORTED; the actors see it and free their KV
blocks.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from actors.base import EngineLayout, topology
from actors.messages import (REMOTE_ACTOR, KVReady, PrefillRequest, PromptLogprobs, RequestError, TokenBatch,
                             TransferDone, parse_frames, to_wire)
from api.protocol import GenerationRequest
from pdserve.errors import (EngineOverloadedError, InvalidRequestError, MessageTooLargeError, PdserveError,
                            QueueFullError, StateTableFullError)

log = logging.getLogger("pdserve.api")


@dataclass
class RequestHandle:
    """One admitted sequence (a request, or one of the ``n`` choices of one): its row, and the asyncio queue its
    events arrive on.

    Events: ``("token", token_id, finish_reason|None, logprobs|None)`` (logprobs on the wire form ``[logprob,
    [[token_id, logprob], ...]]``) or ``("error", PdserveError)``; on a prefill node ``("kv_ready", KVReady)``,
    on a decode node ``("transfer_done",)`` (api/node_api.py carries both to the router).
    """

    request: GenerationRequest
    slot: int
    generation: int
    index: int = 0                 # the choice's index (0 .. n - 1)
    deadline_s: float = 0.0        # time.monotonic() after which the handler stops waiting
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    admitted_ns: int = field(default_factory=time.monotonic_ns)
    first_token_ns: int = 0
    completion_tokens: int = 0
    stop_string: str | None = None  # the stop string that ended the text (api.app.generate_text), else None
    timings: dict | None = None   # queue_s, prefill_s, transfer_s, transfer_bytes (from the decode actor)
    prompt_logprobs: list = field(default_factory=list)   # echo + logprobs: one wire entry per prompt token
    prefill_actor: int = -1        # the actors the router chose (actor-table indices; -1 = none, colocated)
    decode_actor: int = -1
    reserve_blocks: int = 0        # decode blocks the request will reserve (prompt + max_tokens)
    prefilled: bool = False        # a token arrived: its prompt is off the prefill queue, its blocks reserved
    handed_across: bool = False    # a prefill node: its KVReady went to the router; the row ends by its messages

    @property
    def key(self) -> tuple[int, int]:
        return (self.slot, self.generation)


class EngineClient:
    def __init__(self, layout: EngineLayout):
        self.layout = layout
        self.config = layout.config
        self.handles: dict[tuple[int, int], RequestHandle] = {}
        self.topology = topology(layout.config)
        self.index = self.topology.api
        self.count_drift = 0   # fault router_count_drift: added to every published routed count
        self.stale_messages: collections.Counter[str] = collections.Counter()   # by message kind, for /metrics
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        from ipc.actor_table import ActorTable
        from ipc.engine_status import EngineStatus
        from ipc.shm_queue import ShmQueue
        from ipc.state_table import RequestState, StateTable

        self.S = RequestState
        self.loop = loop
        self.table = StateTable.attach(self.layout.segment("state"))
        self.actors = ActorTable.attach(self.layout.segment("actors"))
        self.status = EngineStatus.attach(self.layout.segment("status"))
        from pdserve.faults import FaultPlan

        # one inbox per actor taking new requests: the prefill actors (colocated mode: the decode actors)
        topo = self.topology
        self.intake = {i: ShmQueue.attach(self.layout.segment(topo.segment("q", i)))
                       for i in (topo.prefill or topo.decode)}
        self.faults = FaultPlan(self.config.faults, "api")
        self.inbox = ShmQueue.attach(self.layout.segment("q_api"))
        self._thread = threading.Thread(target=self._receive, name="engine-inbox", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    # ---- receiving ------------------------------------------------------------------------------------
    def _receive(self) -> None:
        while not self._stop.is_set():
            try:
                frames = self.inbox.get_many(256, self.config.idle_wait_s)
            except PdserveError:
                log.exception("api inbox failed")
                return
            for message in parse_frames(frames, log):
                self.loop.call_soon_threadsafe(self._dispatch, message)

    def _dispatch(self, message: Any) -> None:
        if isinstance(message, TokenBatch):
            for item in message.items:
                handle = self.handles.get((item[0], item[1]))
                if handle is None:
                    self.stale_messages[message.kind] += 1
                    continue
                extras = item[4] if len(item) > 4 else {}
                if "timings" in extras:
                    handle.timings = extras["timings"]
                handle.prefilled = True
                handle.events.put_nowait(("token", item[2], item[3], extras.get("logprobs")))
        elif isinstance(message, PromptLogprobs):
            handle = self.handles.get((message.slot, message.generation))
            if handle is None:
                self.stale_messages[message.kind] += 1
                return
            del handle.prompt_logprobs[message.start:]   # frames arrive in order; a repeat replaces
            handle.prompt_logprobs.extend(message.entries)
        elif isinstance(message, RequestError):
            handle = self.handles.get((message.slot, message.generation))
            if handle is None:
                self.stale_messages[message.kind] += 1
                return
            if handle.handed_across:   # nobody waits on it here any more (a deadline after the handoff)
                self.finish(handle)
                return
            error = PdserveError(message.message)
            error.http_status, error.error_type = message.http_status, message.error_type
            handle.events.put_nowait(("error", error))
        elif isinstance(message, (KVReady, TransferDone)):   # node roles: for the router (api/node_api.py)
            handle = self.handles.get((message.slot, message.generation))
            if handle is None:
                self.stale_messages[message.kind] += 1
                return
            handle.events.put_nowait(("kv_ready", message) if isinstance(message, KVReady) else ("transfer_done",))

    # ---- admission and completion -------------------------------------------------------------------
    def num_active(self) -> int:
        """Requests this API process is waiting on (compared with the table's count by tools/inspect)."""
        return len(self.handles)

    def routed_counts(self) -> dict[int, int]:
        """The router's own count per engine actor (actor index -> rows it sent there that the API still holds:
        each row counts on its prefill and its decode actor). The monitor compares it with the table's. The fault
        ``router_count_drift:count_delta=K`` adds K to each (a router whose bookkeeping went wrong)."""
        counts = {i: self.count_drift for i in self.topology.prefill + self.topology.decode}
        for handle in self.handles.values():
            for index in (handle.prefill_actor, handle.decode_actor):
                if index >= 0:   # REMOTE_ACTOR: the other side is another node's
                    counts[index] += 1
        return counts

    def publish_routed(self) -> None:
        """Write ``routed_counts`` into the actor table (the API is that field's one writer)."""
        for index, count in self.routed_counts().items():
            self.actors.set_routed_requests(index, count)

    def actor_loads(self) -> tuple[list, list]:
        """``(prefill loads, decode loads)`` for api/router.py: serving = READY, not hung or dead (a restarting
        row reads as RESTARTING); free blocks from the table less what requests routed there but not yet
        reserved will take; queued prompt tokens and running requests from the API's own handles."""
        from api.router import ActorLoad
        from ipc.actor_table import ActorHealth, ActorStatus

        rows = self.actors.rows()
        queued_tokens: dict[int, int] = {}
        pending_blocks: dict[int, int] = {}
        running: dict[int, int] = {}
        for handle in self.handles.values():
            if not handle.prefilled:
                queued_tokens[handle.prefill_actor] = queued_tokens.get(handle.prefill_actor, 0) + \
                    len(handle.request.prompt_ids)
                pending_blocks[handle.decode_actor] = pending_blocks.get(handle.decode_actor, 0) + \
                    handle.reserve_blocks
            running[handle.decode_actor] = running.get(handle.decode_actor, 0) + 1

        def load(index: int) -> ActorLoad:
            r = rows[index]
            serving = r["status"] == ActorStatus.READY and r["health"] not in (ActorHealth.HUNG, ActorHealth.DEAD)
            return ActorLoad(index, r["name"], serving, queued_prompt_tokens=queued_tokens.get(index, 0),
                             running=running.get(index, 0),
                             kv_blocks_free=int(r["kv_blocks_free"]) - pending_blocks.get(index, 0),
                             block_tokens=self.config.kv_block_tokens)
        return [load(i) for i in self.topology.prefill], [load(j) for j in self.topology.decode]

    def _choose(self, request: GenerationRequest, remote_decode: bool) -> tuple[int, int]:
        """``(prefill actor, decode actor)`` for a request (api/router.py); prefill -1 = colocated, decode
        REMOTE_ACTOR = the router's decode node. Raises EngineOverloadedError (none serving), InvalidRequestError
        for a prompt sent to a node of one side (only ``pdserve router`` talks to those)."""
        from api.router import pick_prefill, route

        role = self.config.role
        if (role == "prefill") != remote_decode or role == "decode":
            raise InvalidRequestError(f"this node runs the {role} side only; send requests to `pdserve router`"
                                      if role != "both" else "this engine runs both sides; it takes no "
                                      "request for a remote decode node")
        prefill_loads, decode_loads = self.actor_loads()
        if remote_decode:
            return pick_prefill(prefill_loads, request.prompt_ids).index, REMOTE_ACTOR
        chosen = route(prefill_loads, decode_loads, request.prompt_ids, request.sampling.max_tokens)
        return -1 if chosen.prefill is None else chosen.prefill, chosen.decode

    def _deadline_s(self, request: GenerationRequest, timeout_s: float | None) -> float:
        """The request's timeout: ``timeout_s``, else the request's own, else ``request_timeout_s``; capped at it."""
        if timeout_s is None:
            timeout_s = getattr(request, "timeout_s", None)
        limit_s = self.config.request_timeout_s
        return limit_s if timeout_s is None else min(float(timeout_s), limit_s)

    def submit(self, request: GenerationRequest, timeout_s: float | None = None,
               remote_decode: bool = False) -> list[RequestHandle]:
        """Allocate the request's rows (QUEUED; one per choice, ``request.n``) and send it to the prefill actor.

        The ``n`` rows travel in one PrefillRequest: the prompt is prefilled once and each row gets its own
        first token and decode sequence. ``timeout_s`` (default: ``request.timeout_s``, then
        ``config.request_timeout_s``) is the whole request's deadline, written into each row where the monitor
        enforces it; it is capped at ``config.request_timeout_s`` so a client cannot hold a row longer than the
        server allows. Returns one handle per choice, in index order.

        Raises:
            InvalidRequestError: ``n`` alone is over ``max_queued_requests`` (a 400: retrying cannot help).
            EngineOverloadedError: too many sequences in flight (``max_queued_requests`` counts every choice),
                the table is full, or the prefill queue stayed full (the caller answers 503 with Retry-After).
                Nothing stays allocated when it raises.
        """
        if self.status.rec["draining"]:
            raise EngineOverloadedError("the engine is shutting down (draining); retry on another replica")
        n = request.n
        if n > self.config.max_queued_requests:   # could never be admitted: not a retry-later condition
            raise InvalidRequestError(f"n={n} choices are more sequences than this server admits at once "
                                      f"(max_queued_requests={self.config.max_queued_requests}); lower n",
                                      param="n")
        if len(self.handles) + n > self.config.max_queued_requests:
            raise EngineOverloadedError(f"{len(self.handles)} sequences in flight, {n} more asked for "
                                        f"(max_queued_requests={self.config.max_queued_requests}); retry")
        timeout_s = self._deadline_s(request, timeout_s)
        prefill_actor, decode_actor = self._choose(request, remote_decode)
        block_tokens = self.config.kv_block_tokens
        reserve = -(-(len(request.prompt_ids) + request.sampling.max_tokens) // block_tokens)
        now_ns = time.monotonic_ns()
        deadline_ns = now_ns + int(timeout_s * 1e9)
        handles: list[RequestHandle] = []
        try:
            for index in range(n):
                slot, generation = self.table.allocate(request.request_id, prompt_tokens=len(request.prompt_ids),
                                                       deadline_ns=deadline_ns, prefill_actor=prefill_actor,
                                                       decode_actor=decode_actor)
                self.table.update(slot, generation, owner=self.index)
                handle = RequestHandle(request, slot, generation, index, deadline_s=time.monotonic() + timeout_s,
                                       prefill_actor=prefill_actor, decode_actor=decode_actor,
                                       reserve_blocks=reserve)
                self.handles[handle.key] = handle
                handles.append(handle)
        except StateTableFullError as exc:
            self.finish_all(handles)
            raise EngineOverloadedError(f"request table full: {exc.message}") from None
        try:
            first = handles[0]
            colocated = prefill_actor < 0   # the decode actor prefills itself: KVReady stays inside it
            message = PrefillRequest(first.slot, first.generation, request.request_id, request.prompt_ids,
                                     request.sampling, [[h.slot, h.generation] for h in handles[1:]],
                                     -1 if colocated else decode_actor)
            self.intake[decode_actor if colocated else prefill_actor].put(
                to_wire(message), timeout_s=self.config.admission_put_timeout_s)
        except QueueFullError:
            self.finish_all(handles)
            raise EngineOverloadedError("the prefill queue is full; retry") from None
        except MessageTooLargeError as exc:   # prompt + grammar over one queue slot: retrying cannot help
            self.finish_all(handles)
            raise InvalidRequestError(f"the request is too large for the engine's queues ({exc.message}); send a "
                                      "shorter prompt or schema, or raise queue_slot_bytes") from None
        drift = self.faults.fires("router_count_drift", request.request_id) if self.faults else None
        if drift is not None:   # fault injection: the router's bookkeeping goes wrong from here on
            self.count_drift += int(drift.number("count_delta"))
        self.publish_routed()
        return handles

    def admit_prefilled(self, request: GenerationRequest, ready: KVReady, timeout_s: float | None = None
                        ) -> RequestHandle:
        """A decode node: admit a request a prefill node prefilled (``ready``: its KVReady with the source pool's
        descriptor in ``peer``). Its row starts at BOOTSTRAP on the decode actor api/router.py picks; the KVReady,
        renamed to that row, goes to the actor's inbox. Raises InvalidRequestError (not a decode node, or no
        ``peer``), EngineOverloadedError (none serving, table or inbox full)."""
        from api.router import pick_decode

        if self.config.role != "decode":
            raise InvalidRequestError(f"this node runs role {self.config.role}; only a decode node takes prefilled "
                                      "requests")
        if not ready.peer:
            raise InvalidRequestError("a prefilled request needs the prefill pool's descriptor ('peer')")
        if len(self.handles) + 1 > self.config.max_queued_requests:
            raise EngineOverloadedError(f"{len(self.handles)} sequences in flight; retry")
        timeout_s = self._deadline_s(request, timeout_s)
        decode_actor = pick_decode(self.actor_loads()[1], ready.num_tokens, ready.sampling.max_tokens).index
        try:
            slot, generation = self.table.allocate(
                ready.request_id, prompt_tokens=ready.num_tokens, decode_actor=decode_actor, state=self.S.BOOTSTRAP,
                deadline_ns=time.monotonic_ns() + int(timeout_s * 1e9))
        except StateTableFullError as exc:
            raise EngineOverloadedError(f"request table full: {exc.message}") from None
        self.table.update(slot, generation, owner=self.index)
        reserve = -(-(ready.num_tokens + ready.sampling.max_tokens) // self.config.kv_block_tokens)
        handle = RequestHandle(request, slot, generation, deadline_s=time.monotonic() + timeout_s,
                               decode_actor=decode_actor, reserve_blocks=reserve)
        self.handles[handle.key] = handle
        message = dataclasses.replace(ready, slot=slot, generation=generation, prefill_actor=REMOTE_ACTOR)
        try:
            self.intake[decode_actor].put(to_wire(message), timeout_s=self.config.admission_put_timeout_s)
        except (QueueFullError, MessageTooLargeError) as exc:
            self.finish(handle)
            raise EngineOverloadedError(f"decode actor {decode_actor}'s inbox refused the request ({exc}); retry") \
                from None
        self.publish_routed()
        return handle

    def remote_transfer_done(self, slot: int, generation: int) -> bool:
        """A prefill node: the decode node holds its copy of row ``(slot, generation)``'s KV. The row ends
        FINISHED here, its prefill actor is woken to free the blocks (it also frees on seeing the row final), the
        row is released. Returns False for a row this API no longer holds (already ended: a late message)."""
        handle = self.handles.get((slot, generation))
        if handle is None:
            self.stale_messages["transfer_done"] += 1
            return False
        self.table.transition(slot, generation, self.S.FINISHED, owner=self.index)
        try:
            self.intake[handle.prefill_actor].put(to_wire(TransferDone(slot, generation)),
                                                  timeout_s=self.config.admission_put_timeout_s)
        except QueueFullError:   # the wake-up only: the actor frees on seeing the row final anyway
            log.warning("prefill actor %d inbox full: its TransferDone wake-up is dropped", handle.prefill_actor)
        self.finish(handle)
        return True

    def stop_generation(self, handle: RequestHandle) -> None:
        """A stop string matched: the request is done; the decode actor frees its blocks."""
        self.table.transition(handle.slot, handle.generation, self.S.FINISHED, owner=self.index)

    def finish(self, handle: RequestHandle) -> None:
        """The client has its answer (or is gone): abort the row if still live (a no-op on a final row: the
        transition refuses), then release it."""
        if self.handles.pop(handle.key, None) is None:
            return
        self.table.transition(handle.slot, handle.generation, self.S.ABORTED, owner=self.index)
        self.table.release(handle.slot, handle.generation)
        self.publish_routed()

    def finish_all(self, handles: list[RequestHandle]) -> None:
        """``finish`` every choice of a request (all its rows are aborted if live, then released)."""
        for handle in handles:
            self.finish(handle)

    async def next_event(self, handle: RequestHandle) -> tuple:
        """The request's next event, never past its deadline (``wait_event``)."""
        return await wait_event(handle, self.config.request_timeout_s)


async def wait_event(handle: RequestHandle, request_timeout_s: float) -> tuple:
    """Wait for ``handle``'s next event, never past its deadline.

    Raises:
        PdserveError (504): the deadline passed with no event (the monitor should have fired first).
    """
    remaining = handle.deadline_s - time.monotonic()
    try:
        return await asyncio.wait_for(handle.events.get(), timeout=max(remaining, 0.0) + 1.0)
    except asyncio.TimeoutError:
        from pdserve.errors import RequestTimeoutError

        limit = handle.request.timeout_s or request_timeout_s
        raise RequestTimeoutError(f"request {handle.request.request_id} passed its deadline of "
                                  f"{min(limit, request_timeout_s)} s (request_timeout_s or the "
                                  "request's 'timeout')") from None
