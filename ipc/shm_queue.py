"""ShmQueue: a bounded multi-producer multi-consumer queue of orjson frames in one POSIX shm ring.

Shared-memory layout of segment ``name`` (little endian; ``HEADER`` / ``PRODUCER`` / ``CONSUMER`` below)::

    offset  size  field
    0       4     magic            b"PDSQ"
    4       4     version          u4 = 1
    8       4     num_slots        u4
    12      4     slot_bytes       u4  (a slot = u4 payload length + payload; payload <= slot_bytes - 4)
    16      8     slots_offset     u8  = HEADER_BYTES
    24      4     lock_timeout_ms  u4  (how long a producer/consumer mutex may be waited for)
    64      8     tail             u8  messages ever committed (written under the producer mutex)
    72      8     producer lock record (ipc._shm.LOCK_RECORD: holder pid i4, reserved u4)
    80      8     tail_at_lock     u8  tail when the current producer took the mutex (for repair)
    128     8     head             u8  messages ever taken (written under the consumer mutex)
    136     8     consumer lock record
    144     8     head_at_lock     u8  head when the current consumer took the mutex (for repair)
    152     4     items_at_lock    u4  "items" tokens the current consumer holds (for repair)
    256     ...   num_slots slots of slot_bytes each; message i lives in slot i % num_slots

Semaphores (all ``name`` + suffix, mode 0600): ``_it`` items (messages ready, starts 0), ``_fr`` free slots
(starts num_slots), ``_pm`` producer mutex, ``_cm`` consumer mutex, ``_rp`` lock-repair mutex.

put:  wait _fr (timeout) -> lock _pm -> write slot[tail], tail += 1, post _it -> unlock _pm
get:  wait _it (timeout) -> lock _cm -> read slot[head], head += 1, post _fr -> unlock _cm

Waits block in the kernel (sem_timedwait), so an idle consumer uses no CPU. The mutexes are held for one
memcpy; waiting for them is bounded by ``lock_timeout_s`` (header), never forever.

Dead processes (SIGKILL) and what they cost:
- killed while holding a mutex: the next waiter finds the holder's pid dead after ``lock_timeout_s`` (a
  waiting consumer also checks whenever its wait times out, and at least every ``RECHECK_S``) and takes
  the mutex over, repairing the counters (a producer's uncommitted slot is given back; a consumer's untaken
  items are given back so another consumer gets them; a message a consumer had already taken is lost with it).
- killed between its semaphore wait and the mutex (or in the few instructions between taking the mutex and
  recording its pid): not detectable. A producer then leaks one slot of capacity; a consumer leaves one
  message undelivered until the next put (then every later message is one put late). Re-creating the queue
  (restart of the owner) is the cure; the supervisor restarts actors, not queues, so this is a known limit.
- a live holder that is stopped (SIGSTOP) or hung is reported with ShmLockTimeoutError / QueueFullError,
  never robbed.
"""
from __future__ import annotations

import struct
import time
from typing import Any

import orjson

from ipc import _shm
from ipc._shm import RobustLock, ShmLockTimeoutError
from pdserve.errors import MessageTooLargeError, QueueClosedError, QueueFullError

MAGIC = b"PDSQ"
VERSION = 1
HEADER_BYTES = 256
HEADER = struct.Struct("<4sIIIQI")  # magic, version, num_slots, slot_bytes, slots_offset, lock_timeout_ms
OFF_TAIL = 64
OFF_PRODUCER_LOCK = 72
OFF_TAIL_AT_LOCK = 80
OFF_HEAD = 128
OFF_CONSUMER_LOCK = 136
OFF_HEAD_AT_LOCK = 144
OFF_ITEMS_AT_LOCK = 152
U8 = struct.Struct("<Q")
U4 = struct.Struct("<I")
LEN = struct.Struct("<I")  # slot payload length prefix

SEM_SUFFIXES = ("_it", "_fr", "_pm", "_cm", "_rp")
DEFAULT_LOCK_TIMEOUT_S = 1.0
RECHECK_S = 1.0  # a waiting consumer checks for a dead consumer-mutex holder at least this often
ORJSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY


class QueueLockTimeoutError(ShmLockTimeoutError, QueueFullError):
    """A queue mutex stayed held by a live (stopped/hung) process; is-a QueueFullError for put() callers.

    Defined here until ``pdserve/errors.py`` takes it.
    """


class ShmQueue(_shm.ShmSegment):
    """Bounded MPMC queue of orjson-encoded messages in a POSIX shm ring (layout in the module docstring).

    Create it once in the owner (``create``), hand it to other processes by pickling (only the name travels;
    unpickling attaches) or by name (``attach``). put/get are safe from any number of processes and threads
    (all shared state is guarded by the semaphores; waits release the GIL); ``close`` must not race them.
    Segment plumbing (create/attach/close/unlink): ``ipc._shm.ShmSegment``.
    """

    MAGIC = MAGIC
    VERSION = VERSION
    KIND = "queue"
    SEM_SUFFIXES = SEM_SUFFIXES

    # ------------------------------------------------------------------ construction

    def __init__(self) -> None:  # use create() / attach()
        super().__init__()
        self.num_slots = 0
        self.slot_bytes = 0
        self.max_message_bytes = 0
        self.lock_timeout_s = DEFAULT_LOCK_TIMEOUT_S
        self._items = self._free = self._pm_sem = self._cm_sem = self._repair = None
        self._plock: RobustLock | None = None
        self._clock: RobustLock | None = None

    @classmethod
    def create(cls, name: str, *, num_slots: int = 256, slot_bytes: int = 65536,
               lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S) -> "ShmQueue":
        """Create (O_CREX, mode 0600) and own the queue ``name``: ``num_slots`` slots of ``slot_bytes`` bytes.

        A message may be at most ``slot_bytes - 4`` bytes once encoded. The owner alone calls ``unlink``.
        Raises ValueError for sizes out of range, FileExistsError if ``name`` (or a semaphore of it) exists.
        """
        if not 1 <= num_slots <= 1 << 24:
            raise ValueError(f"num_slots={num_slots} must be in 1..{1 << 24}")
        if not 8 <= slot_bytes <= 1 << 30:
            raise ValueError(f"slot_bytes={slot_bytes} must be in 8..{1 << 30}")
        if not 0.001 <= lock_timeout_s <= 3600:
            raise ValueError(f"lock_timeout_s={lock_timeout_s} must be in 0.001..3600 seconds")

        def init(mm) -> None:
            HEADER.pack_into(mm, 0, b"\0\0\0\0", VERSION, num_slots, slot_bytes, HEADER_BYTES,
                             int(lock_timeout_s * 1000))

        return cls._create(name, HEADER_BYTES + num_slots * slot_bytes, init,
                           sem_values=(0, num_slots, 1, 1, 1))

    @classmethod
    def attach(cls, name: str) -> "ShmQueue":
        """Attach to the existing queue ``name`` (sizes come from its header).

        Raises QueueClosedError if the queue does not exist (yet, or any more) or is not a ShmQueue.
        """
        return super().attach(name)

    def _attach_into(self, name: str, readonly: bool = False) -> None:
        try:
            super()._attach_into(name, False)
        except FileNotFoundError as exc:
            raise QueueClosedError(f"queue {name!r} does not exist: not created yet, or unlinked because the "
                                   f"engine is shutting down ({exc})") from exc
        except ValueError as exc:
            raise QueueClosedError(str(exc)) from exc

    def _setup(self, mm) -> None:
        _, _, num_slots, slot_bytes, _, lock_ms = HEADER.unpack_from(mm, 0)
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.max_message_bytes = slot_bytes - LEN.size
        self.lock_timeout_s = lock_ms / 1000.0
        self._items, self._free, self._pm_sem, self._cm_sem, self._repair = self._sems
        self._plock = RobustLock(self._pm_sem, self._repair, mm, OFF_PRODUCER_LOCK,
                                 f"producer mutex of queue {self.name!r}", self.lock_timeout_s)
        self._clock = RobustLock(self._cm_sem, self._repair, mm, OFF_CONSUMER_LOCK,
                                 f"consumer mutex of queue {self.name!r}", self.lock_timeout_s)

    def _teardown(self) -> None:
        self._items = self._free = self._pm_sem = self._cm_sem = self._repair = None
        self._plock = self._clock = None

    def _repr_fields(self) -> str:
        return f", num_slots={self.num_slots}, slot_bytes={self.slot_bytes}"

    # ------------------------------------------------------------------ producer side

    def put(self, obj: Any, timeout_s: float | None = 5.0) -> None:
        """Encode ``obj`` with orjson (dicts, lists, str, int, float, bool, None, dataclasses, numpy) and
        enqueue it, waiting at most ``timeout_s`` seconds for a free slot (None = forever).

        Raises MessageTooLargeError if the encoding exceeds ``slot_bytes - 4`` bytes; QueueFullError if no
        slot frees up in time (QueueLockTimeoutError, a subclass, if a live process holds the producer mutex
        past ``lock_timeout_s``); TypeError (orjson.JSONEncodeError) if ``obj`` is not serializable;
        QueueClosedError after ``close()``.
        """
        self.put_bytes(orjson.dumps(obj, option=ORJSON_OPTIONS), timeout_s)

    def put_bytes(self, data: bytes, timeout_s: float | None = 5.0) -> None:
        """Enqueue one raw frame ``data`` (bytes-like, at most ``slot_bytes - 4`` bytes). Errors: as put."""
        mm = self._check_open()
        n = len(data)
        if n > self.max_message_bytes:
            raise MessageTooLargeError(f"message of {n} bytes does not fit a slot of queue {self.name!r} "
                                       f"(max {self.max_message_bytes} bytes): raise slot_bytes or send less")
        if not _shm.sem_wait(self._free, timeout_s):
            raise QueueFullError(f"queue {self.name!r} stayed full ({self.num_slots} slots) for "
                                 f"{timeout_s} s: its consumer is slow, hung or dead")
        try:
            if self._plock.acquire(self._stamp_producer):
                self._repair_producer()
        except ShmLockTimeoutError as exc:
            self._free.release()
            raise QueueLockTimeoutError(str(exc)) from exc
        try:
            tail = U8.unpack_from(mm, OFF_TAIL)[0]
            off = HEADER_BYTES + (tail % self.num_slots) * self.slot_bytes
            LEN.pack_into(mm, off, n)
            mm[off + 4:off + 4 + n] = data
            U8.pack_into(mm, OFF_TAIL, tail + 1)
            self._items.release()
        finally:
            self._plock.release()

    def _stamp_producer(self) -> None:
        self._mm[OFF_TAIL_AT_LOCK:OFF_TAIL_AT_LOCK + 8] = self._mm[OFF_TAIL:OFF_TAIL + 8]

    def _repair_producer(self) -> None:
        """We took the producer mutex over from a dead producer; it held one "free" token."""
        mm = self._mm
        tail = U8.unpack_from(mm, OFF_TAIL)[0]
        if tail == U8.unpack_from(mm, OFF_TAIL_AT_LOCK)[0]:
            self._free.release()  # it never committed: give its slot back
        # else it committed (and posted "items" right after, bar a window of one instruction)
        self._stamp_producer()

    # ------------------------------------------------------------------ consumer side

    def get(self, timeout_s: float | None) -> Any | None:
        """Dequeue one message and decode it; None if nothing arrived within ``timeout_s`` seconds.

        ``timeout_s`` is required: ``0`` polls without blocking; ``None`` blocks until a message arrives (the
        only way to block forever; an actor loop should pass its heartbeat period instead).
        Raises ShmLockTimeoutError if a live process holds the consumer mutex past
        ``lock_timeout_s``, QueueClosedError after ``close()``, orjson.JSONDecodeError on a corrupt frame.
        """
        data = self.get_bytes(timeout_s)
        return None if data is None else orjson.loads(data)

    def get_bytes(self, timeout_s: float | None) -> bytes | None:
        """Dequeue one raw frame; None on timeout. Semantics and errors as ``get``."""
        self._check_open()
        if not self._wait_items(timeout_s):
            return None
        return self._take(1)[0]

    def get_many(self, max_items: int, timeout_s: float | None) -> list[Any]:
        """Up to ``max_items`` decoded messages: waits at most ``timeout_s`` for the first, then takes what is
        already there without waiting. Returns [] on timeout. Errors as ``get``. (Actors batch with this.)"""
        return [orjson.loads(b) for b in self.get_many_bytes(max_items, timeout_s)]

    def get_many_bytes(self, max_items: int, timeout_s: float | None) -> list[bytes]:
        """Raw-frame variant of ``get_many``."""
        self._check_open()
        if max_items < 1:
            raise ValueError(f"max_items={max_items} must be >= 1")
        if not self._wait_items(timeout_s):
            return []
        k = 1
        while k < max_items and _shm.sem_wait(self._items, 0):
            k += 1
        return self._take(k)

    def _wait_items(self, timeout_s: float | None) -> bool:
        """Take one "items" token within ``timeout_s`` (None = forever). Between waits of at most
        ``min(RECHECK_S, lock_timeout_s)`` it checks for a consumer that died holding the consumer mutex
        (and with it an item no one else would wait for) and repairs that, so a lone consumer is never
        starved by a dead one."""
        deadline = None if timeout_s is None else time.monotonic() + max(0.0, timeout_s)
        while True:
            recheck = max(0.05, min(RECHECK_S, self.lock_timeout_s))
            step = recheck if deadline is None else min(recheck, max(0.0, deadline - time.monotonic()))
            if _shm.sem_wait(self._items, step):
                return True
            if self._clock.recover_if_dead():
                try:
                    self._repair_consumer()
                finally:
                    self._clock.release()
                continue  # the dead consumer's items are back: try again at once
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def _take(self, k: int) -> list[bytes]:
        """Read ``k`` messages; the caller already holds ``k`` "items" tokens."""
        mm = self._mm
        try:
            recovered = self._clock.acquire(lambda: self._stamp_consumer(k))
        except ShmLockTimeoutError:
            for _ in range(k):
                self._items.release()
            raise
        try:
            if recovered:
                self._repair_consumer()
                self._stamp_consumer(k)
            head = U8.unpack_from(mm, OFF_HEAD)[0]
            out = []
            for _ in range(k):
                off = HEADER_BYTES + (head % self.num_slots) * self.slot_bytes
                n = LEN.unpack_from(mm, off)[0]
                if n > self.max_message_bytes:  # torn/corrupt slot: never read past it
                    n = 0
                out.append(mm[off + 4:off + 4 + n])
                head += 1
                U8.pack_into(mm, OFF_HEAD, head)
                self._free.release()
            return out
        finally:
            self._clock.release()

    def _stamp_consumer(self, k: int) -> None:
        mm = self._mm
        mm[OFF_HEAD_AT_LOCK:OFF_HEAD_AT_LOCK + 8] = mm[OFF_HEAD:OFF_HEAD + 8]
        U4.pack_into(mm, OFF_ITEMS_AT_LOCK, k)

    def _repair_consumer(self) -> None:
        """We took the consumer mutex over from a dead consumer; give back the items it had not taken."""
        mm = self._mm
        taken = U8.unpack_from(mm, OFF_HEAD)[0] - U8.unpack_from(mm, OFF_HEAD_AT_LOCK)[0]
        held = U4.unpack_from(mm, OFF_ITEMS_AT_LOCK)[0]
        for _ in range(max(0, held - taken)):
            self._items.release()

    # ------------------------------------------------------------------ status and lifetime

    def qsize(self) -> int:
        """Messages committed and not yet taken (a racy snapshot; 0 after close())."""
        if self._closed:
            return 0
        tail = U8.unpack_from(self._mm, OFF_TAIL)[0]
        head = U8.unpack_from(self._mm, OFF_HEAD)[0]
        return max(0, tail - head)

    def empty(self) -> bool:
        return self.qsize() == 0

    def _check_open(self):
        if self._closed:
            raise QueueClosedError(f"queue {self.name!r} is closed in this process")
        return self._mm
