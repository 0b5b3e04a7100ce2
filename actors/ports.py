"""The ports of the scheduler cores (actors/prefill_core.py, actors/decode_core.py): what a core may ask of the
world. The actor shells pass the real ones (StateTable, KVPool, KVTransport through ``TransportTransfers``,
ShmQueues through ``QueueOutbox``, ``time.monotonic_ns``); tests/actors/fakes.py passes in-memory ones.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Callable, Iterable, Protocol, Sequence

from actors.messages import to_wire
from actors.topology import LOCAL_PREFILL
from pdserve.errors import MessageTooLargeError, QueueFullError

log = logging.getLogger(__name__)
MAX_HELD_FRAMES = 2048   # frames one address may have waiting in an actor's outbox before the oldest are dropped

Clock = Callable[[], int]   # CLOCK_MONOTONIC now, in ns (time.monotonic_ns)


class TablePort(Protocol):
    """The request state table (ipc.state_table.StateTable fits it)."""

    def read(self, slot: int, generation: int) -> dict | None: ...

    def transition(self, slot: int, generation: int, new_state: int, *, owner: int | None = None,
                   by: str | None = None) -> bool: ...

    def update(self, slot: int, generation: int, **fields) -> bool: ...

    def update_many(self, updates: Iterable[tuple[int, int, dict]]) -> int: ...


class AllocatorPort(Protocol):
    """One KV pool's block allocator (ipc.kv_pool.KVPool fits it). ``allocate`` raises OutOfKVBlocksError."""

    block_tokens: int

    @property
    def num_free(self) -> int: ...

    def allocate(self, n: int, owner_slot: int) -> list[int]: ...

    def free(self, block_ids: Iterable[int], owner_slot: int) -> int: ...


class TransfersPort(Protocol):
    """KV pulls into the decode pool. ``poll`` returns ``(ipc.kv_transport.TransferStatus value or an unknown
    int, blocks received so far)``; ``synchronous`` = a transfer is finished by the time ``start`` returns;
    ``local`` = source and destination are one pool (colocated mode): a copy inside it, not a KV handoff."""

    synchronous: bool
    local: bool

    def start(self, request_id: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
              num_tokens: int, peer: str = LOCAL_PREFILL) -> int: ...

    def poll(self, handle: int) -> tuple[int, int]: ...

    def release(self, handle: int) -> None: ...


class OutboxPort(Protocol):
    """Messages to the other actors: ``dest`` is an address (actors/topology.py: an actor's name, ``API``,
    ``LOCAL_PREFILL`` / ``LOCAL_DECODE``, ``REMOTE``, a ``peer_address``); ``request_id`` lets a fault decorator
    aim at one request (pdserve/faults.py)."""

    def send(self, dest: str, message: Any, request_id: str = "") -> None: ...


class TransportTransfers:
    """TransfersPort over an ``ipc.kv_transport.KVTransport`` (which reports no partial progress: a transfer
    has received all its blocks when it is DONE, none before)."""

    def __init__(self, transport, synchronous: bool, local: bool = False):
        self.transport = transport
        self.synchronous = synchronous
        self.local = local
        self._blocks: dict[int, int] = {}

    def start(self, request_id, src_block_ids, dst_block_ids, num_tokens, peer: str = LOCAL_PREFILL) -> int:
        handle = self.transport.start_copy(list(src_block_ids), list(dst_block_ids), num_tokens=num_tokens)
        self._blocks[handle] = len(src_block_ids)
        return handle

    def poll(self, handle: int) -> tuple[int, int]:
        from ipc.kv_transport import TransferStatus

        status = self.transport.poll(handle)
        return int(status), self._blocks.get(handle, 0) if status == TransferStatus.DONE else 0

    def release(self, handle: int) -> None:
        self._blocks.pop(handle, None)
        self.transport.release(handle)


class PeerTransfers:
    """TransfersPort over one transfers port per source pool: ``start(..., peer=address)`` pulls from the pool of
    the prefill actor at that address (N x M: a decode actor opens one transport per prefill pool; a remote pool is
    a ``peer_address``). Raises KeyError for an unknown peer. Handles are this object's own (the inner ports'
    handles may collide)."""

    def __init__(self, by_peer: dict[str, Any], synchronous: bool, local: bool = False):
        self.by_peer = by_peer
        self.synchronous = synchronous
        self.local = local
        self._handles: dict[int, tuple[Any, int]] = {}
        self._next = 1

    def add_peer(self, peer: str, port) -> None:
        """Pull from ``port`` for ``start(..., peer=peer)`` from now on (a remote pool opened on first use)."""
        self.by_peer[peer] = port

    def start(self, request_id, src_block_ids, dst_block_ids, num_tokens, peer: str = LOCAL_PREFILL) -> int:
        inner = self.by_peer[peer]
        handle, self._next = self._next, self._next + 1
        self._handles[handle] = (inner, inner.start(request_id, src_block_ids, dst_block_ids, num_tokens))
        return handle

    def poll(self, handle: int) -> tuple[int, int]:
        inner, inner_handle = self._handles[handle]
        return inner.poll(inner_handle)

    def release(self, handle: int) -> None:
        entry = self._handles.pop(handle, None)
        if entry is not None:
            entry[0].release(entry[1])


class QueueOutbox:
    """OutboxPort and one process's address directory: an address (actors/topology.py) resolves to an shm queue
    (``{address: q}``: ``"prefill0"``, ``"api"``, ``REMOTE`` = the API's inbox...) or to a local core (colocated
    mode: ``LOCAL_PREFILL`` / ``LOCAL_DECODE``), registered with ``add_local``. Frames are
    ``actors.messages.to_wire`` lists, each put waiting at most ``put_timeout_s`` for room.

    A put that fails (QueueFullError: no room in time; or the queue's producer mutex held by another live process
    in a process that does not wait locks out, actors/base.py ``wait_out_stuck_locks``) is not raised into the
    actor's loop: the frame is held, later frames to that address queue behind it (order kept), and ``flush``
    (every loop iteration) retries them. Past
    ``max_held`` frames for one address the oldest are dropped (``dropped``; their requests end by their
    deadlines). ``hold=False`` (the API's admission, which answers 503 instead): ``send`` raises the
    QueueFullError. Raises KeyError for an address this process cannot reach."""

    def __init__(self, queues: dict[str, Any], put_timeout_s: float, max_held: int = MAX_HELD_FRAMES,
                 hold: bool = True):
        self.queues = queues
        self.hold = hold
        self.local: dict[str, Any] = {}
        self.put_timeout_s = put_timeout_s
        self.max_held = max_held
        self.held: dict[str, deque] = {}          # address -> frames waiting for room, oldest first
        self.held_since: dict[str, float] = {}    # address -> when its first frame was held (monotonic s)
        self.dropped = 0                          # held frames given up (past ``max_held``)

    def add_queue(self, dest: str, queue: Any) -> None:
        """Send to ``dest`` through ``queue`` (an shm queue) from now on (a remote prefill peer: via the API's)."""
        self.queues[dest] = queue

    def add_local(self, dest: str, core: Any) -> None:
        """Hand messages for ``dest`` straight to ``core.on_message(message)`` (a core in this process) from now
        on, instead of a queue."""
        self.local[dest] = core

    def send(self, dest: str, message: Any, request_id: str = "") -> None:
        core = self.local.get(dest)
        if core is not None:
            core.on_message(message)
            return
        queue, frame = self.queues[dest], to_wire(message)
        held = self.held.get(dest)
        if held is not None:   # earlier frames to ``dest`` wait: this one goes behind them (``flush`` retries)
            held.append(frame)
            self._bound(dest, held)
            return
        try:
            queue.put(frame, timeout_s=self.put_timeout_s)
        except QueueFullError as exc:
            if not self.hold:
                raise
            log.error("holding messages for %s, retried every loop iteration: %s", dest, exc)
            self.held[dest], self.held_since[dest] = deque([frame]), time.monotonic()

    def try_send(self, dest: int | str, message: Any, request_id: str = "") -> bool:
        """``send`` without waiting (a best-effort message): False, nothing sent, if ``dest``'s queue has no free
        slot now, the message does not fit one, or earlier frames to ``dest`` are held."""
        core = self.local.get(dest)
        if core is not None:
            core.on_message(message)
            return True
        if dest in self.held:
            return False
        try:
            self.queues[dest].put(to_wire(message), timeout_s=0.0)
        except (QueueFullError, MessageTooLargeError):
            return False
        return True

    def flush(self) -> None:
        """Retry the held frames, oldest first, without waiting for room (a held producer mutex still costs up to
        its lock timeout per address); an address whose frames all went is logged and forgotten."""
        for dest, held in list(self.held.items()):
            queue = self.queues[dest]
            try:
                while held:
                    queue.put(held[0], timeout_s=0.0)
                    held.popleft()
            except QueueFullError:
                continue
            log.warning("sent the messages held for %s after %.1f s", dest,
                        time.monotonic() - self.held_since.pop(dest))
            del self.held[dest]

    def held_messages(self) -> int:
        """Frames held for any address now."""
        return sum(len(h) for h in self.held.values())

    def _bound(self, dest: str, held: deque) -> None:
        if len(held) > self.max_held:
            if self.dropped == 0 or len(held) == self.max_held + 1:
                log.error("more than %d messages held for %s: dropping the oldest (their requests end by their "
                          "deadlines)", self.max_held, dest)
            while len(held) > self.max_held:
                held.popleft()
                self.dropped += 1
