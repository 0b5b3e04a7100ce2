"""The API's admission core: which requests enter the engine, on which actors, with which rows and reservation.
Plain code over ports (no shm, queue, HTTP or clock code here); api/engine_client.py passes the real ones,
tests/api/test_admission.py in-memory ones.

| name              | what                                                                              |
|-------------------|-----------------------------------------------------------------------------------|
| `RequestHandle`   | one admitted sequence: its row, reservation, events queue                         |
| `AdmissionPolicy` | capacity and deadline cap (also `pdserve router`'s, api/router_client.py)         |
| `Admission`       | admit / admit_embedding / admit_prefilled / transfer_done / stop / release over the ports |
| `PrefixLookup`    | a prompt's cached prefix on each prefill actor, from the cache summaries            |
| `TablePort` ...   | the table (with allocate/release), outbox, actors' loads, cache summaries, draining |

"Admit" is the API's step only: the row enters QUEUED (or BOOTSTRAP on a decode node); prefill's QUEUED ->
PREFILLING and decode's DECODE_WAITING -> DECODING are the actors' own moves (docs/architecture.md, "Who moves
which row").
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol, Sequence

from actors.messages import EmbedRequest, KVReady, PrefillRequest, TransferDone
from actors.topology import LOCAL_DECODE, NO_ACTOR, REMOTE, REMOTE_ACTOR, Topology
from actors.ports import Clock, OutboxPort
from actors.prefix_cache import block_keys
from api.router import ActorLoad, Routed, pick_decode, pick_prefill, route, with_routed
from ipc.actor_table import ActorHealth, ActorStatus
from ipc.lifecycle import RequestState as S
from pdserve.errors import (EngineOverloadedError, InvalidRequestError, MessageTooLargeError, QueueFullError,
                            StateTableFullError)
from pdserve.faults import DRILL_PREFIX
from pdserve.kv_budget import blocks_for

log = logging.getLogger("pdserve.api")



@dataclass
class RequestHandle:
    """One admitted sequence (a request, or one of the ``n`` choices of one): its row, and the asyncio queue its
    events arrive on.

    Events: ``("token", token_id, finish_reason|None, logprobs|None)`` (logprobs on the wire form ``[logprob,
    [[token_id, logprob], ...]]``) or ``("error", PdserveError)``; on a prefill node ``("kv_ready", KVReady)``,
    on a decode node ``("transfer_done",)`` (api/node_api.py carries both to the router); an embedding's one
    event ``("embedding", base64 of little-endian float32)`` (actors.messages.Embedding).
    """

    request: Any                   # api.protocol.GenerationRequest (api.embeddings.EmbeddingInput: an embedding)
    slot: int
    generation: int
    index: int = 0                 # the choice's index in the response (first_index .. first_index + n - 1)
    deadline_s: float = 0.0        # time.monotonic() after which the handler stops waiting
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    admitted_ns: int = field(default_factory=time.monotonic_ns)
    first_token_ns: int = 0
    completion_tokens: int = 0
    stop_string: str | None = None  # the stop string that ended the text (api.generation.generate_text), else None
    finish_reason: str | None = None   # the choice's finish reason once it ended (api.exchange.Exchange.release)
    timings: dict | None = None   # queue_s, prefill_s, transfer_s, transfer_bytes (from the decode actor)
    prompt_logprobs: list = field(default_factory=list)   # echo + logprobs: one wire entry per prompt token
    prefill_actor: int = NO_ACTOR  # the actors the router chose (actor-table indices; NO_ACTOR colocated)
    decode_actor: int = NO_ACTOR
    reserve_blocks: int = 0        # decode blocks the request will reserve (pdserve.kv_budget.blocks_for)
    prefilled: bool = False        # a token arrived: its prompt is off the prefill queue, its blocks reserved
    handed_across: bool = False    # a prefill node: its KVReady went to the router; the row ends by its messages
    ended_ns: int = 0              # when ``ended`` was first set (monotonic ns; api/blame.py: the engine's time)
    lost_since_ns: int = 0         # first seen with its row ended (final, freed or reused) and ``ended`` not set
    on_text_end: Any = None        # called with the handle once its text ended in the API (api.generation.merged_choices)

    @property
    def key(self) -> tuple[int, int]:
        return (self.slot, self.generation)

    @property
    def ended(self) -> bool:
        """Its last event (a finish reason or an error) reached the API, or the API ended it."""
        return self.ended_ns != 0

    @ended.setter
    def ended(self, value: bool) -> None:
        if value and not self.ended_ns:
            self.ended_ns = time.monotonic_ns()
        elif not value:
            self.ended_ns = 0


class TablePort(Protocol):
    """The request state table as the API uses it (ipc.state_table.StateTable fits it)."""

    def allocate(self, request_id: str, *, prompt_tokens: int, deadline_ns: int = 0,
                 prefill_actor: int = NO_ACTOR, decode_actor: int = NO_ACTOR,
                 state: int = S.QUEUED) -> tuple[int, int]: ...

    def update(self, slot: int, generation: int, **fields) -> bool: ...

    def transition(self, slot: int, generation: int, new_state: int, *, owner: int | None = None,
                   by: str | None = None) -> bool: ...

    def release(self, slot: int, generation: int) -> bool: ...

    def live_keys(self) -> set[tuple[int, int]]: ...


class ActorsPort(Protocol):
    """The actor table (ipc.actor_table.ActorTable fits it): rows with ``name``, ``status``, ``health``,
    ``kv_blocks_free``; the API is the one writer of ``routed_requests``."""

    def rows(self) -> list[dict]: ...

    def set_routed_requests(self, index: int, count: int) -> None: ...


def _healthy(row: dict) -> bool:
    """An actor row that could take work: READY, not hung or dead (a restarting row reads RESTARTING)."""
    return row["status"] == ActorStatus.READY and row["health"] not in (ActorHealth.HUNG, ActorHealth.DEAD)


def _serving(row: dict) -> bool:
    """An actor row that may get new work: healthy and not drained (actors/ejection.py; the monitor drains it)."""
    return _healthy(row) and not row.get("drained")


class SummariesPort(Protocol):
    """The prefill actors' cache summaries (ipc.cache_summary.CacheSummary fits it; region = prefill actor index)."""

    def cached_blocks(self, index: int, keys: Sequence[bytes], pid: int | None = None) -> int: ...

    def words(self, index: int, pid: int | None = None) -> Any: ...


class PrefixLookup:
    """``tokens(index, pid, prompt_ids)``: the tokens of a prompt's cached prefix on prefill actor ``index``
    (process ``pid``; None: unchecked) per its summary, in whole blocks of ``block_tokens``, at most
    ``(len - 1) // block_tokens`` of them (what the actor's cache would reuse: its last token is always
    computed). The prompt's chain keys (actors.prefix_cache.block_keys) are hashed once per prompt object."""

    def __init__(self, summaries: SummariesPort, block_tokens: int):
        self.summaries, self.block_tokens = summaries, block_tokens
        self._ids: Sequence[int] | None = None   # the last prompt hashed (held, so its identity stays its own)
        self._keys: list[bytes] = []

    def keys(self, prompt_ids: Sequence[int]) -> list[bytes]:
        if prompt_ids is not self._ids:
            bt = self.block_tokens
            usable = max(len(prompt_ids) - 1, 0) // bt * bt
            self._ids, self._keys = prompt_ids, block_keys(prompt_ids[:usable], bt)
        return self._keys

    def tokens(self, index: int, pid: int | None, prompt_ids: Sequence[int]) -> int:
        keys = self.keys(prompt_ids)
        return self.summaries.cached_blocks(index, keys, pid) * self.block_tokens if keys else 0


def is_drill(request_id: str) -> bool:
    """A watchdog drill's request (api/drill.py): the API gives no client's request this id prefix."""
    return request_id.startswith(DRILL_PREFIX)


class AdmissionPolicy:
    """Capacity and the deadline cap: ``max_queued_requests`` sequences in flight (every choice counts) and
    ``request_timeout_s`` as the longest deadline a client may ask for."""

    def __init__(self, max_queued_requests: int, request_timeout_s: float):
        self.max_queued_requests = max_queued_requests
        self.request_timeout_s = request_timeout_s

    def check_room(self, in_flight: int, n: int) -> None:
        """Raises InvalidRequestError (``n`` alone is over the limit: a 400, retrying cannot help) or
        EngineOverloadedError (``in_flight + n`` over it: 503, retry)."""
        limit = self.max_queued_requests
        if n > limit:
            raise InvalidRequestError(f"n={n} choices are more sequences than this server admits at once "
                                      f"(max_queued_requests={limit}); lower n", param="n")
        if in_flight + n > limit:
            raise EngineOverloadedError(f"{in_flight} sequences in flight, {n} more asked for "
                                        f"(max_queued_requests={limit}); retry")

    def timeout_s(self, request: Any, timeout_s: float | None = None) -> float:
        """The request's timeout in s: ``timeout_s``, else the request's own, else ``request_timeout_s``; capped
        at ``request_timeout_s`` so a client cannot hold a row longer than the server allows."""
        if timeout_s is None:
            timeout_s = getattr(request, "timeout_s", None)
        limit_s = self.request_timeout_s
        return limit_s if timeout_s is None else min(float(timeout_s), limit_s)


class Admission:
    """Admission and release of one API process's requests.

    Ports: ``table`` (TablePort), ``outbox`` (``send(address, message)``, actors/topology.py; raises QueueFullError
    / MessageTooLargeError), ``actors`` (ActorsPort), ``clock`` (monotonic ns), ``draining`` (() -> bool);
    ``topology``: which actor sits at which index (actors/topology.py ``Topology``); ``faults``: a pdserve.faults.FaultPlan or None;
    ``summaries``: the prefill actors' cache summaries (SummariesPort) or None (routing by load alone).
    """

    def __init__(self, config, table: TablePort, outbox: OutboxPort, actors: ActorsPort, clock: Clock,
                 draining: Callable[[], bool], *, owner: int, topology: Topology, faults=None, summaries: SummariesPort | None = None):
        self.config = config
        self.policy = AdmissionPolicy(config.max_queued_requests, config.request_timeout_s)
        self.table, self.outbox, self.actors, self.clock, self.draining = table, outbox, actors, clock, draining
        self.owner = owner
        self.topology = topology
        self.prefill, self.decode = list(topology.prefill), list(topology.decode)
        self.faults = faults
        self.prefix = PrefixLookup(summaries, config.kv_block_tokens) if summaries is not None else None
        self.handles: dict[tuple[int, int], RequestHandle] = {}
        self.drills = 0   # handles of watchdog drills (api/drill.py): not counted against max_queued_requests
        self.count_drift = 0   # fault router_count_drift: added to every published routed count
        self.stale_messages: collections.Counter[str] = collections.Counter()   # by message kind, for /metrics

    # ---- loads and routing ------------------------------------------------------------------------------
    def routed_counts(self) -> dict[int, int]:
        """The router's own count per engine actor (actor index -> rows it sent there that the API still holds:
        each row counts on its prefill and its decode actor). The monitor compares it with the table's. The fault
        ``router_count_drift:count_delta=K`` adds K to each (a router whose bookkeeping went wrong)."""
        counts = {i: self.count_drift for i in self.prefill + self.decode}
        for handle in self.handles.values():
            for index in (handle.prefill_actor, handle.decode_actor):
                if index not in (NO_ACTOR, REMOTE_ACTOR):   # REMOTE_ACTOR: the other side is another node's
                    counts[index] += 1
        return counts

    def publish_routed(self) -> None:
        """Write ``routed_counts`` into the actor table (the API is that field's one writer)."""
        for index, count in self.routed_counts().items():
            self.actors.set_routed_requests(index, count)

    def actor_loads(self, pin: int | None = None) -> tuple[list[ActorLoad], list[ActorLoad]]:
        """``(prefill loads, decode loads)`` for api/router.py: serving = READY, not hung, dead or drained (a
        restarting row reads as RESTARTING; drained ones serve when no undrained actor of their role does);
        ``pin``: an actor index whose role's list holds that actor alone,
        serving if healthy, drained or not (a readmission drill, api/drill.py); free blocks from the table less
        what requests routed there but not yet reserved will take; queued prompt tokens and running requests from
        the API's own handles; a prefill actor's cached prefix from its cache summary (``PrefixLookup``; the row's
        ``actor_pid`` names the process whose summary counts)."""
        rows = self.actors.rows()
        routed = [Routed(h.prefill_actor, h.decode_actor, len(h.request.prompt_ids), h.reserve_blocks, h.prefilled)
                  for h in self.handles.values()]
        # a role whose undrained actors all died or hung since the drain serves on its drained healthy ones: a
        # drain keeps work off a sick actor while another can take it, never the role's last working one
        fallback = {index for role in (self.prefill, self.decode) if not any(_serving(rows[i]) for i in role)
                    for index in role}

        def load(index: int, prefill: bool) -> ActorLoad:
            r = rows[index]
            serving = _healthy(r) if index == pin or index in fallback else _serving(r)
            cached = functools.partial(self.prefix.tokens, index, r.get("actor_pid")) \
                if prefill and self.prefix is not None else None
            return ActorLoad(index, r["name"], serving, kv_blocks_free=int(r["kv_blocks_free"]),
                             block_tokens=self.config.kv_block_tokens, cached_prefix_tokens=cached)
        prefill = [pin] if pin in self.prefill else self.prefill
        decode = [pin] if pin in self.decode else self.decode
        return (with_routed([load(i, True) for i in prefill], routed),
                with_routed([load(j, False) for j in decode], routed))

    def cached_words(self) -> Any:
        """The block keys (ipc/cache_summary.py slot values: sorted unique u8 array) the serving prefill actors'
        caches hold, all actors together; None without summaries. A prefill node reports them to `pdserve router`
        (api/node_api.py ``/internal/status``), which prefers the node caching a prompt's longest prefix."""
        if self.prefix is None:
            return None
        import numpy as np

        rows = self.actors.rows()
        parts = [self.prefix.summaries.words(i, rows[i].get("actor_pid")) for i in self.prefill
                 if _serving(rows[i])]
        return np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype="<u8")

    def _choose(self, request: Any, remote_decode: bool, pin: int | None = None) -> tuple[int, int]:
        """``(prefill actor, decode actor)`` indices; prefill NO_ACTOR = colocated, decode REMOTE_ACTOR = the
        router's decode node; ``pin``: the actor of its role to use (``actor_loads``). Raises EngineOverloadedError
        (none serving), InvalidRequestError for a prompt sent to a node of one side (only ``pdserve router`` talks
        to those)."""
        role = self.config.role
        if (role == "prefill") != remote_decode or role == "decode":
            raise InvalidRequestError(f"this node runs the {role} side only; send requests to `pdserve router`"
                                      if role != "both" else "this engine runs both sides; it takes no "
                                      "request for a remote decode node")
        prefill_loads, decode_loads = self.actor_loads(pin)
        bound = self.config.cache_routing_max_imbalance_tokens
        if remote_decode:
            return pick_prefill(prefill_loads, request.prompt_ids, bound).index, REMOTE_ACTOR
        chosen = route(prefill_loads, decode_loads, request.prompt_ids, request.sampling.reserved_output_tokens,
                       bound)
        return NO_ACTOR if chosen.prefill is None else chosen.prefill, chosen.decode

    # ---- admission ----------------------------------------------------------------------------------------
    def _open_rows(self, request: Any, n: int, timeout_s: float, *, prompt_tokens: int, max_tokens: int,
                   prefill_actor: int, decode_actor: int, state: int = S.QUEUED) -> list[RequestHandle]:
        """Allocate ``n`` rows (owner: the API) and their handles. Raises EngineOverloadedError (table full)
        with none left allocated."""
        now_ns = self.clock()
        reserve = blocks_for(prompt_tokens, max_tokens, self.config.kv_block_tokens)
        handles: list[RequestHandle] = []
        try:
            for index in range(n):
                slot, generation = self.table.allocate(
                    request.request_id, prompt_tokens=prompt_tokens, deadline_ns=now_ns + int(timeout_s * 1e9),
                    prefill_actor=prefill_actor, decode_actor=decode_actor, state=state)
                self.table.update(slot, generation, owner=self.owner)
                handle = RequestHandle(request, slot, generation, request.first_index + index,
                                       deadline_s=now_ns / 1e9 + timeout_s,
                                       admitted_ns=now_ns, prefill_actor=prefill_actor, decode_actor=decode_actor,
                                       reserve_blocks=reserve)
                self.handles[handle.key] = handle
                self.drills += is_drill(request.request_id)
                handles.append(handle)
        except StateTableFullError as exc:
            self.release_all(handles)
            raise EngineOverloadedError(f"request table full: {exc.message}") from None
        return handles

    def admit(self, request: Any, timeout_s: float | None = None, remote_decode: bool = False,
              pin: int | None = None) -> list[RequestHandle]:
        """Allocate the request's rows (QUEUED; one per choice, ``request.n``) and send one PrefillRequest for
        all of them to the chosen prefill actor (colocated: the decode actor). ``timeout_s`` is capped by
        ``AdmissionPolicy.timeout_s`` and written into each row, where the monitor enforces it. ``pin``: a
        watchdog drill's actor (an index of the actor table), taken even while drained (a readmission drill,
        api/drill.py); a client's request is never pinned (ValueError). Returns one handle per choice, in index
        order.

        Raises:
            InvalidRequestError: ``n`` alone is over ``max_queued_requests``, a one-sided node, or a message over
                one queue slot (retrying cannot help).
            EngineOverloadedError: draining, too many sequences in flight, no actor serving, the table is full,
                or the intake queue stayed full. Nothing stays allocated when it raises.
        """
        if pin is not None and not is_drill(request.request_id):
            raise ValueError(f"request {request.request_id}: only a watchdog drill is pinned to an actor")
        if self.draining():
            raise EngineOverloadedError("the engine is shutting down (draining); retry on another replica")
        self.policy.check_room(len(self.handles) - self.drills, request.n)
        timeout_s = self.policy.timeout_s(request, timeout_s)
        prefill_actor, decode_actor = self._choose(request, remote_decode, pin)
        handles = self._open_rows(request, request.n, timeout_s, prompt_tokens=len(request.prompt_ids),
                                  max_tokens=request.sampling.reserved_output_tokens, prefill_actor=prefill_actor,
                                  decode_actor=decode_actor)
        first = handles[0]
        colocated = prefill_actor == NO_ACTOR   # the decode actor prefills itself: KVReady stays inside it
        message = PrefillRequest(first.slot, first.generation, request.request_id, request.prompt_ids,
                                 request.sampling, [[h.slot, h.generation] for h in handles[1:]],
                                 LOCAL_DECODE if colocated else self.topology.address(decode_actor))
        try:
            self.outbox.send(self.topology.address(decode_actor if colocated else prefill_actor), message,
                             request.request_id)
        except QueueFullError:
            self.release_all(handles)
            raise EngineOverloadedError("the prefill queue is full; retry") from None
        except MessageTooLargeError as exc:   # prompt + grammar over one queue slot: retrying cannot help
            self.release_all(handles)
            raise InvalidRequestError(f"the request is too large for the engine's queues ({exc.message}); send a "
                                      "shorter prompt or schema, or raise queue_slot_bytes") from None
        drift = self.faults.fires("router_count_drift", request.request_id) if self.faults else None
        if drift is not None:   # fault injection: the router's bookkeeping goes wrong from here on
            self.count_drift += int(drift.number("count_delta"))
        if self.faults and self.faults.fires("duplicate_row", request.request_id):
            # fault injection: a second row for the request that no handle holds (the id held twice in the table)
            slot, generation = self.table.allocate(
                request.request_id, prompt_tokens=len(request.prompt_ids), deadline_ns=self.clock() + int(
                    timeout_s * 1e9), prefill_actor=prefill_actor, decode_actor=decode_actor)
            self.table.update(slot, generation, owner=self.owner)
        self.publish_routed()
        return handles

    def admit_embedding(self, item: Any, timeout_s: float | None = None) -> RequestHandle:
        """Admit one input of an embeddings request (``item``: api/embeddings.py EmbeddingInput: ``request_id``,
        ``prompt_ids``, ``first_index`` (its index in the answer)): a row (QUEUED) and an EmbedRequest, pooled as
        the config's ``pooling`` says, to the prefill actor ``pick_prefill`` chooses (colocated: the decode actor
        ``pick_decode`` chooses, whose prefill core takes it). No decode actor is named (the row's
        ``decode_actor`` is NO_ACTOR) and nothing is reserved there. The row ends FINISHED by the actor's
        Embedding, or by the deadlines as any prompt's. api/exchange.py ``submit_all`` admits a request's inputs
        back to back, all or none, so the prefill batcher packs them together.

        Raises:
            InvalidRequestError: a decode node (it has no prefill), or an input over one queue slot.
            EngineOverloadedError: draining, too many sequences in flight, no actor serving, the table or the
                intake queue full. Nothing stays allocated when it raises.
        """
        if self.config.role == "decode":
            raise InvalidRequestError("this node runs the decode side only; it computes no embeddings")
        if self.draining():
            raise EngineOverloadedError("the engine is shutting down (draining); retry on another replica")
        self.policy.check_room(len(self.handles) - self.drills, 1)
        handle = self._admit_embedding(item, self.config.pooling, timeout_s)
        self.publish_routed()
        return handle

    def _admit_embedding(self, item: Any, pooling: str, timeout_s: float | None) -> RequestHandle:
        prefill_loads, decode_loads = self.actor_loads()
        if self.prefill:
            actor = pick_prefill(prefill_loads, item.prompt_ids, self.config.cache_routing_max_imbalance_tokens)
            prefill_actor, decode_actor = actor.index, NO_ACTOR
        else:   # colocated: the decode actor's own prefill core (its pool holds the prompt)
            actor = pick_decode(decode_loads, len(item.prompt_ids), 0)
            prefill_actor, decode_actor = NO_ACTOR, actor.index
        handle, = self._open_rows(item, 1, self.policy.timeout_s(item, timeout_s), prompt_tokens=len(item.prompt_ids),
                                  max_tokens=0, prefill_actor=prefill_actor, decode_actor=decode_actor)
        message = EmbedRequest(handle.slot, handle.generation, item.request_id, list(item.prompt_ids), pooling)
        try:
            self.outbox.send(self.topology.address(actor.index), message, item.request_id)
        except QueueFullError:
            self.release(handle)
            raise EngineOverloadedError("the prefill queue is full; retry") from None
        except MessageTooLargeError as exc:
            self.release(handle)
            raise InvalidRequestError(f"an input is too large for the engine's queues ({exc.message}); send a "
                                      "shorter one, or raise queue_slot_bytes", param="input") from None
        return handle

    def admit_prefilled(self, request: Any, ready: KVReady, timeout_s: float | None = None) -> RequestHandle:
        """A decode node: admit a request a prefill node prefilled (``ready``: its KVReady with the source pool's
        descriptor in ``peer``). Its row starts at BOOTSTRAP on the decode actor api/router.py picks; the KVReady,
        renamed to that row, goes to the actor's inbox. A draining node still takes it (the request is under way,
        its prompt's KV waits on the prefill node). Raises InvalidRequestError (not a decode node, or no
        ``peer``), EngineOverloadedError (full, none serving, table or inbox full)."""
        if self.config.role != "decode":
            raise InvalidRequestError(f"this node runs role {self.config.role}; only a decode node takes prefilled "
                                      "requests")
        if not ready.peer:
            raise InvalidRequestError("a prefilled request needs the prefill pool's descriptor ('peer')")
        self.policy.check_room(len(self.handles) - self.drills, 1)
        timeout_s = self.policy.timeout_s(request, timeout_s)
        decode_actor = pick_decode(self.actor_loads()[1], ready.num_tokens,
                                   ready.sampling.reserved_output_tokens).index
        handle, = self._open_rows(request, 1, timeout_s, prompt_tokens=ready.num_tokens,
                                  max_tokens=ready.sampling.reserved_output_tokens, prefill_actor=NO_ACTOR,
                                  decode_actor=decode_actor, state=S.BOOTSTRAP)
        message = dataclasses.replace(ready, slot=handle.slot, generation=handle.generation,
                                      prefill_actor=REMOTE)
        try:
            self.outbox.send(self.topology.address(decode_actor), message, ready.request_id)
        except (QueueFullError, MessageTooLargeError) as exc:
            self.release(handle)
            raise EngineOverloadedError(f"decode actor {decode_actor}'s inbox refused the request ({exc}); retry") \
                from None
        self.publish_routed()
        return handle

    # ---- completion -----------------------------------------------------------------------------------------
    def transfer_done(self, slot: int, generation: int) -> bool:
        """A prefill node: the decode node holds its copy of row ``(slot, generation)``'s KV. The row ends
        FINISHED here, its prefill actor is woken to free the blocks (it also frees on seeing the row final), the
        row is released. Returns False for a row this API no longer holds (already ended: a late message)."""
        handle = self.handles.get((slot, generation))
        if handle is None:
            self.stale_messages["transfer_done"] += 1
            return False
        self.table.transition(slot, generation, S.FINISHED, owner=self.owner, by="api")
        try:
            self.outbox.send(self.topology.address(handle.prefill_actor), TransferDone(slot, generation),
                             handle.request.request_id)
        except QueueFullError:   # the wake-up only: the actor frees on seeing the row final anyway
            log.warning("prefill actor %d inbox full: its TransferDone wake-up is dropped", handle.prefill_actor)
        self.release(handle)
        return True

    def check_room(self, sequences: int) -> None:
        """Whether ``sequences`` more fit beside those in flight now (AdmissionPolicy.check_room's errors); admits
        nothing (api.exchange.submit_all checks a list of prompts whole before admitting any)."""
        self.policy.check_room(len(self.handles) - self.drills, sequences)

    def stop(self, handle: RequestHandle) -> None:
        """A stop string matched: the row is FINISHED; the decode actor sees it and frees its blocks."""
        handle.ended = True
        self.table.transition(handle.slot, handle.generation, S.FINISHED, owner=self.owner, by="api")

    def lost(self, now_ns: int, grace_ns: int) -> list[RequestHandle]:
        """Handles whose row ended in the engine (final, freed or reused) while their last event never reached this
        API, for ``grace_ns`` or longer: an actor died between moving the row and sending its last message (the
        supervisor fails only the rows still live). Each is returned once (marked ``ended``); the caller fails
        it. Without this its client would wait for the request's whole deadline."""
        lost = []
        live = self.table.live_keys()   # one vectorized read, not one row read per handle (the event loop's)
        for handle in list(self.handles.values()):
            if handle.ended or handle.handed_across:
                continue
            if handle.key in live:
                handle.lost_since_ns = 0
            elif not handle.lost_since_ns:
                handle.lost_since_ns = now_ns
            elif now_ns - handle.lost_since_ns >= grace_ns:
                handle.ended = True
                lost.append(handle)
        return lost

    def release(self, handle: RequestHandle) -> None:
        """The client has its answer (or is gone): abort the row if still live (a no-op on a final row: the
        transition refuses), then release it; a second call is a no-op."""
        if self.handles.pop(handle.key, None) is None:
            return
        self.drills -= is_drill(handle.request.request_id)
        self.table.transition(handle.slot, handle.generation, S.ABORTED, owner=self.owner, by="api")
        self.table.release(handle.slot, handle.generation)
        self.publish_routed()

    def release_all(self, handles: Iterable[RequestHandle]) -> None:
        for handle in handles:
            self.release(handle)
