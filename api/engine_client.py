"""The API process's engine I/O: attaches the engine's segments, builds the admission core (api/admission.py) over
them, and carries token and error messages back to the waiting HTTP handlers.

| name          | what                                                                              |
|---------------|-----------------------------------------------------------------------------------|
| `EngineClient`| attach (``start``), the receiver thread, ``_dispatch``; admission calls delegate   |
| `wait_event`  | a handle's next event, never past its deadline                                    |

One receiver thread blocks on the API's shm inbox (for at most ``idle_wait_s`` at a time, so it also notices
shutdown) and hands each message to the asyncio loop with ``call_soon_threadsafe``. The state table is the
arbiter of every request's fate: an abort here is a transition to ABORTED; the actors see it and free their KV
blocks.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import Any

from actors.base import EngineLayout
from actors.topology import topology
from actors.messages import Embedding, KVReady, PromptLogprobs, RequestError, TokenBatch, TransferDone, parse_frames
from api.admission import Admission, RequestHandle
from api.protocol import GenerationRequest
from pdserve.errors import PdserveError

__all__ = ["EngineClient", "RequestHandle", "wait_event"]

log = logging.getLogger("pdserve.api")
LOST_GRACE_S = 5.0   # a row ended with no last message this long is lost (EngineClient.fail_lost)


class EngineClient:
    def __init__(self, layout: EngineLayout):
        self.layout = layout
        self.config = layout.config
        self.topology = topology(layout.config)
        self.index = self.topology.api
        self.admission: Admission | None = None   # built by start() over the attached segments
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        from actors.ports import QueueOutbox
        from ipc.actor_table import ActorTable
        from ipc.engine_status import EngineStatus
        from ipc.shm_queue import ShmQueue
        from ipc.state_table import StateTable
        from pdserve.faults import FaultPlan

        self.loop = loop
        self.table = StateTable.attach(self.layout.segment("state"))
        self.actors = ActorTable.attach(self.layout.segment("actors"))
        self.status = EngineStatus.attach(self.layout.segment("status"))
        # one inbox per actor taking new requests: the prefill actors (colocated mode: the decode actors)
        topo = self.topology
        self.intake = {topo.address(i): ShmQueue.attach(self.layout.segment(topo.segment("q", i)))
                       for i in (topo.prefill or topo.decode)}
        self.faults = FaultPlan(self.config.faults, "api")
        outbox = QueueOutbox(self.intake, self.config.admission_put_timeout_s, hold=False)   # full: a 503
        summaries = None
        if "cachesum" in self.layout.segments:   # the prefill actors' cache contents, for routing
            from ipc.cache_summary import CacheSummary

            summaries = CacheSummary.attach(self.layout.segment("cachesum"), readonly=True)
        self.admission = Admission(self.config, self.table, outbox,
                                   self.actors, time.monotonic_ns, lambda: bool(self.status.rec["draining"]),
                                   owner=self.index, topology=topo, faults=self.faults,
                                   summaries=summaries)
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
                handle.ended = handle.ended or item[3] is not None
                handle.events.put_nowait(("token", item[2], item[3], extras.get("logprobs")))
        elif isinstance(message, Embedding):   # an embedding's one and last event
            handle = self.handles.get((message.slot, message.generation))
            if handle is None:
                self.stale_messages[message.kind] += 1
                return
            handle.prefilled = handle.ended = True
            handle.events.put_nowait(("embedding", message.data))
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
            handle.ended = True
            handle.events.put_nowait(("error", error))
        elif isinstance(message, (KVReady, TransferDone)):   # node roles: for the router (api/node_api.py)
            handle = self.handles.get((message.slot, message.generation))
            if handle is None:
                self.stale_messages[message.kind] += 1
                return
            handle.events.put_nowait(("kv_ready", message) if isinstance(message, KVReady) else ("transfer_done",))

    # ---- admission and completion: api/admission.py decides --------------------------------------------
    @property
    def handles(self) -> dict[tuple[int, int], RequestHandle]:
        return self.admission.handles

    @property
    def stale_messages(self) -> collections.Counter[str]:
        return self.admission.stale_messages

    def num_active(self) -> int:
        """Requests this API process is waiting on (compared with the table's count by tools/inspect)."""
        return len(self.admission.handles)

    def check_room(self, sequences: int) -> None:
        """Admission.check_room: raises when ``sequences`` more do not fit beside those in flight."""
        self.admission.check_room(sequences)

    def routed_counts(self) -> dict[int, int]:
        return self.admission.routed_counts()

    def publish_routed(self) -> None:
        self.admission.publish_routed()

    def actor_loads(self) -> tuple[list, list]:
        return self.admission.actor_loads()

    def submit(self, request: GenerationRequest, timeout_s: float | None = None,
               remote_decode: bool = False, pin: int | None = None) -> list[RequestHandle]:
        """``Admission.admit`` (``pin``: a drill's actor): one handle per choice; an embedding's input
        (api/embeddings.py, ``embedding`` set) ``Admission.admit_embedding``, its one event ``("embedding", base64
        of float32)``. Raises InvalidRequestError / EngineOverloadedError."""
        if getattr(request, "embedding", False):
            return [self.admission.admit_embedding(request, timeout_s)]
        return self.admission.admit(request, timeout_s, remote_decode, pin)

    def admit_prefilled(self, request: GenerationRequest, ready: KVReady, timeout_s: float | None = None
                        ) -> RequestHandle:
        return self.admission.admit_prefilled(request, ready, timeout_s)

    def remote_transfer_done(self, slot: int, generation: int) -> bool:
        return self.admission.transfer_done(slot, generation)

    def stop_generation(self, handle: RequestHandle) -> None:
        self.admission.stop(handle)

    def finish(self, handle: RequestHandle) -> None:
        self.admission.release(handle)

    def finish_all(self, handles: list[RequestHandle]) -> None:
        self.admission.release_all(handles)

    def fail_lost(self) -> int:
        """Fail (502) every request whose row ended in the engine without its last message reaching this API
        (``Admission.lost``; grace: ``LOST_GRACE_S`` or four monitor ticks, whichever is longer, so a message
        still in flight is never overtaken). Called from the API's heartbeat loop; returns how many."""
        grace_ns = int(max(LOST_GRACE_S, 4 * self.config.monitor_tick_s) * 1e9)
        lost = self.admission.lost(time.monotonic_ns(), grace_ns)
        for handle in lost:
            log.error("request %s (slot %d gen %d): its row ended in the engine without its last message reaching "
                      "the API (an actor died at its end?); failing it with 502", handle.request.request_id,
                      handle.slot, handle.generation)
            error = PdserveError(f"request {handle.request.request_id}: the engine ended it without its last "
                                 "message (an actor died at its end); retry")
            error.http_status, error.error_type = 502, "bad_gateway"
            handle.events.put_nowait(("error", error))
        return len(lost)

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
