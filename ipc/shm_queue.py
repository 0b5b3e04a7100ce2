"""ShmQueue: a bounded queue of orjson frames in one POSIX shm ring, in one of two modes chosen at creation.

- ``"mpmc"``: any number of producer and consumer processes; a mutex per side guards the counters.
- ``"spsc"``: one producer process and one consumer process, no mutex: ``tail`` is written only by the
  producer, ``head`` only by the consumer, and a side is woken through a semaphore only when it said it sleeps,
  so a busy consumer takes messages with no system call. The roles are claimed (pid in the header) on the
  first put / get; a second live producer or consumer gets QueueRoleError, and a dead one's role is taken
  over by its successor (a restarted actor).

Shared-memory layout of segment ``name`` (little endian; ``HEADER`` and the ``OFF_*`` constants below)::

    offset  size  field
    0       4     magic            b"PDSQ"
    4       4     version          u4 = 3
    8       4     num_slots        u4
    12      4     slot_bytes       u4  (a slot = u4 payload length + payload; payload <= slot_bytes - 4)
    16      8     slots_offset     u8  = HEADER_BYTES
    24      4     lock_timeout_ms  u4  (how long a producer/consumer mutex may be waited for)
    28      4     mode             u4  MODE_MPMC = 0, MODE_SPSC = 1
    64      8     tail             u8  messages ever committed (mpmc: under the producer mutex; spsc: producer)
    72      8     producer lock record (ipc._shm.LOCK_RECORD: holder pid i4, reserved u4)
    80      8     tail_at_lock     u8  mpmc: tail when the current producer took the mutex (for repair)
    88      4     frees_at_lock    u4  mpmc: "free" tokens the current producer holds (for repair)
    92      4     producer_pid     u4  spsc: the process holding the producer role, 0 = none
    128     8     head             u8  messages ever taken (mpmc: under the consumer mutex; spsc: consumer)
    136     8     consumer lock record
    144     8     head_at_lock     u8  mpmc: head when the current consumer took the mutex (for repair)
    152     4     items_at_lock    u4  mpmc: "items" tokens the current consumer holds (for repair)
    156     4     consumer_pid     u4  spsc: the process holding the consumer role, 0 = none
    192     4     consumer_waiting u4  spsc: 1 = the consumer sleeps on _it waiting for messages
    196     4     producer_waiting u4  spsc: 1 = the producer sleeps on _fr waiting for room
    256     ...   num_slots slots of slot_bytes each; message i lives in slot i % num_slots

Each side's counter has a 64-byte cache line of its own (tail at 64, head at 128) and the two waiter flags share
a third that is written only when a side goes to sleep, so a spsc put or get that reads the flag of the other
side does not pull in the line the other side writes on every message.

Semaphores (all ``name`` + suffix, mode 0600): ``_it`` items, ``_fr`` free slots, ``_pm`` producer mutex,
``_cm`` consumer mutex, ``_rp`` lock-repair mutex. In spsc mode ``_it`` and ``_fr`` only wake sleepers (both
start at 0) and ``_pm`` / ``_cm`` only guard the role claims.

mpmc put_many(k):  wait _fr k times (timeout) -> lock _pm -> write k slots, tail += k, post _it k times
                   -> unlock _pm
mpmc get_many(k):  wait _it once (timeout), then k-1 more without waiting -> lock _cm -> read k slots,
                   head += k, post _fr k times -> unlock _cm
spsc put_many(k):  room = num_slots - (tail - head); if short: wait for room -> write k slots -> tail += k
                   (one aligned 8-byte store: the commit) -> full barrier -> if consumer_waiting: clear it,
                   post _it
spsc get_many(k):  avail = tail - head; if 0: wait for messages -> read min(k, avail) slots -> head += that
                   -> full barrier -> if producer_waiting: clear it, post _fr
spsc put / get of one frame (the claimed side's fast path, a closure built at claim time): the same steps with
                   the other side's counter read from a private copy (a lower bound: counters only grow), which
                   is re-read from shm only when it says "full" / "empty"
spsc wait (the consumer's for messages; the producer's for room mirrors it): spin up to ``spin_s`` re-reading
                   tail (sched_yield between reads) -> consumer_waiting = 1 -> full barrier -> re-read tail (a
                   commit that raced the flag is seen here, or its producer sees the flag: no lost wake-up) ->
                   sleep on _it for at most RECHECK_S -> consumer_waiting = 0 -> re-read tail.

The spsc ordering argument needs total store order (x86-64: stores become visible in program order, so the
slot bytes are visible before the tail that commits them) and a full barrier between each side's store and
its read of the other side's flag; the barrier is an uncontended ``threading.Lock`` acquire/release, which
executes a locked instruction (glibc sem_trywait/sem_post; CPython 3.13's PyMutex CAS). Counters are read and
written as aligned 8-byte words through a memoryview (one load / one store each, never torn). On other CPUs
``SPSC_SUPPORTED`` is False and ``create(mode="spsc")`` refuses.

Waits block in the kernel (sem_timedwait), so an idle side uses no CPU beyond a spsc waiter's short spin.

Dead processes (SIGKILL) and what they cost:
- spsc producer killed while writing slots: tail is not advanced, so the consumer never sees the frames (no
  torn frame); its restarted successor takes the role over and rewrites those slots. Killed after the commit
  but before posting a sleeping consumer: the consumer finds the messages at its next re-check (at most
  RECHECK_S, or its own shorter timeout).
- spsc consumer killed while taking: head is not advanced, so its successor takes that batch again
  (at least once, never lost).
- mpmc, killed while holding a mutex: the next waiter finds the holder's pid dead after ``lock_timeout_s`` (a
  waiting consumer also checks whenever its wait times out, and at least every ``RECHECK_S``) and takes
  the mutex over, repairing the counters (a producer's uncommitted slots are given back; a consumer's untaken
  items are given back so another consumer gets them; messages a consumer had already taken are lost with it).
- mpmc, killed between its semaphore waits and the mutex (or in the few instructions between taking the mutex
  and recording its pid, or between a batch's commit and its last "items" post): not detectable. A producer
  then leaks slots of capacity; a consumer leaves messages undelivered until later puts (then every later
  message is late). Re-creating the queue (restart of the owner) is the cure; the supervisor restarts actors,
  not queues, so this is a known limit.
- a live holder that is stopped (SIGSTOP) or hung is reported with ShmLockTimeoutError / QueueFullError,
  never robbed.
"""
from __future__ import annotations

import os
import platform
import struct
import threading
import time
import weakref
from typing import Any, Iterable

import orjson

from ipc import _shm
from ipc._shm import RobustLock, ShmLockTimeoutError
from pdserve.errors import MessageTooLargeError, QueueClosedError, QueueFullError, QueueRoleError

MAGIC = b"PDSQ"
VERSION = 3
HEADER_BYTES = 256
HEADER = struct.Struct("<4sIIIQII")  # magic, version, num_slots, slot_bytes, slots_offset, lock_timeout_ms, mode
MODE_MPMC, MODE_SPSC = 0, 1
MODES = {"mpmc": MODE_MPMC, "spsc": MODE_SPSC}
OFF_TAIL = 64
OFF_PRODUCER_LOCK = 72
OFF_TAIL_AT_LOCK = 80
OFF_FREES_AT_LOCK = 88
OFF_PRODUCER_PID = 92
OFF_HEAD = 128
OFF_CONSUMER_LOCK = 136
OFF_HEAD_AT_LOCK = 144
OFF_ITEMS_AT_LOCK = 152
OFF_CONSUMER_PID = 156
OFF_CONSUMER_WAITING = 192
OFF_PRODUCER_WAITING = 196
# indices into the header viewed as u8 words (counters) and as u4 words (pids, flags, repair counts)
I_TAIL, I_HEAD = OFF_TAIL // 8, OFF_HEAD // 8
I_TAIL_AT_LOCK, I_HEAD_AT_LOCK = OFF_TAIL_AT_LOCK // 8, OFF_HEAD_AT_LOCK // 8
I_FREES_AT_LOCK, I_ITEMS_AT_LOCK = OFF_FREES_AT_LOCK // 4, OFF_ITEMS_AT_LOCK // 4
I_PRODUCER_PID, I_PRODUCER_WAITING = OFF_PRODUCER_PID // 4, OFF_PRODUCER_WAITING // 4
I_CONSUMER_PID, I_CONSUMER_WAITING = OFF_CONSUMER_PID // 4, OFF_CONSUMER_WAITING // 4
LEN = struct.Struct("<I")  # slot payload length prefix

SEM_SUFFIXES = ("_it", "_fr", "_pm", "_cm", "_rp")
DEFAULT_LOCK_TIMEOUT_S = 1.0
RECHECK_S = 1.0  # a waiter re-checks (dead mutex holder; spsc: a commit whose post never came) this often
# a spsc get_many stops adding frames once it holds this many payload bytes: a batch of large frames stays in
# L2 until it is decoded (copying a batch of frames first and decoding them after was slower)
GET_MANY_BYTES = 256 * 1024
DEFAULT_SPIN_S = 50e-6  # a spsc waiter re-reads the counter this long before it sleeps (cheaper than a wake-up)
ORJSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY
_dumps, _loads = orjson.dumps, orjson.loads
SPSC_SUPPORTED = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")

_PRODUCER, _CONSUMER = "producer", "consumer"


class QueueLockTimeoutError(ShmLockTimeoutError, QueueFullError):
    """A queue mutex stayed held by a live (stopped/hung) process; is-a QueueFullError for put() callers.

    Defined here until ``pdserve/errors.py`` takes it.
    """


# ---------------------------------------------------------------------------------------- per-process state
# A spsc role belongs to a process: every ShmQueue instance of one queue in this process shares one
# in-process mutex per side (threads take turns) and one claim count (the role is given up when the last
# instance that claimed it closes). A forked child starts with none of it (it must claim for itself).

_process_lock = threading.Lock()
_side_mutexes: dict[tuple[str, str], threading.Lock] = {}
_claims: dict[tuple[str, str], int] = {}
_instances: "weakref.WeakSet[ShmQueue]" = weakref.WeakSet()


def _side_mutex(name: str, side: str) -> threading.Lock:
    with _process_lock:
        return _side_mutexes.setdefault((name, side), threading.Lock())


def _after_fork_in_child() -> None:
    global _process_lock
    _process_lock = threading.Lock()
    _side_mutexes.clear()
    _claims.clear()
    for q in list(_instances):
        q._forget_process_state()


os.register_at_fork(after_in_child=_after_fork_in_child)


class ShmQueue(_shm.ShmSegment):
    """Bounded queue of orjson-encoded messages in a POSIX shm ring (layout and modes in the module docstring).

    Create it once in the owner (``create``), hand it to other processes by pickling (only the name travels;
    unpickling attaches) or by name (``attach``). mpmc: put/get are safe from any number of processes and
    threads. spsc: one producer process and one consumer process (they may be the same process), any
    number of threads in each; ``close`` must not race them. Segment plumbing (create/attach/close/unlink):
    ``ipc._shm.ShmSegment``.
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
        self.mode = "mpmc"
        self.spin_s = DEFAULT_SPIN_S
        self._views: list[memoryview] = []
        self._q8 = self._q4 = None
        self._items = self._free = self._pm_sem = self._cm_sem = self._repair = None
        self._plock: RobustLock | None = None
        self._clock: RobustLock | None = None
        self._is_producer = self._is_consumer = False
        self._put_mutex = self._get_mutex = None
        self._fence_lock = threading.Lock()
        self._bind_paths()

    @classmethod
    def create(cls, name: str, *, num_slots: int = 256, slot_bytes: int = 65536,
               lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S, mode: str = "mpmc") -> "ShmQueue":
        """Create (O_CREX, mode 0600) and own the queue ``name``: ``num_slots`` slots of ``slot_bytes`` bytes.

        ``mode`` is ``"mpmc"`` (several producers or consumers) or ``"spsc"`` (one of each; faster). A message
        may be at most ``slot_bytes - 4`` bytes once encoded. The owner alone calls ``unlink``.
        Raises ValueError for sizes out of range, an unknown mode, or ``"spsc"`` on a CPU without total store
        order (``SPSC_SUPPORTED``); FileExistsError if ``name`` (or a semaphore of it) exists.
        """
        if not 1 <= num_slots <= 1 << 24:
            raise ValueError(f"num_slots={num_slots} must be in 1..{1 << 24}")
        if not 8 <= slot_bytes <= 1 << 30:
            raise ValueError(f"slot_bytes={slot_bytes} must be in 8..{1 << 30}")
        if not 0.001 <= lock_timeout_s <= 3600:
            raise ValueError(f"lock_timeout_s={lock_timeout_s} must be in 0.001..3600 seconds")
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} must be one of {sorted(MODES)}")
        if mode == "spsc" and not SPSC_SUPPORTED:
            raise ValueError(f"mode='spsc' needs an x86 CPU (total store order); this is "
                             f"{platform.machine()!r}: use mode='mpmc'")

        def init(mm) -> None:
            HEADER.pack_into(mm, 0, b"\0\0\0\0", VERSION, num_slots, slot_bytes, HEADER_BYTES,
                             int(lock_timeout_s * 1000), MODES[mode])

        # spsc: _it and _fr only wake sleepers (start at 0); mpmc: they count items and free slots
        return cls._create(name, HEADER_BYTES + num_slots * slot_bytes, init,
                           sem_values=(0, num_slots if mode == "mpmc" else 0, 1, 1, 1))

    @classmethod
    def attach(cls, name: str) -> "ShmQueue":
        """Attach to the existing queue ``name`` (sizes and mode come from its header).

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
        _, _, num_slots, slot_bytes, _, lock_ms, mode = HEADER.unpack_from(mm, 0)
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.max_message_bytes = slot_bytes - LEN.size
        self.lock_timeout_s = lock_ms / 1000.0
        self.mode = "spsc" if mode == MODE_SPSC else "mpmc"
        header = memoryview(mm)[:HEADER_BYTES]
        self._q8, self._q4 = header.cast("Q"), header.cast("I")  # native = little endian on every CPU we run on
        self._views = [self._q8, self._q4, header]
        self._items, self._free, self._pm_sem, self._cm_sem, self._repair = self._sems
        self._plock = RobustLock(self._pm_sem, self._repair, mm, OFF_PRODUCER_LOCK,
                                 f"producer mutex of queue {self.name!r}", self.lock_timeout_s)
        self._clock = RobustLock(self._cm_sem, self._repair, mm, OFF_CONSUMER_LOCK,
                                 f"consumer mutex of queue {self.name!r}", self.lock_timeout_s)
        self._forget_process_state()
        _instances.add(self)

    def _teardown(self) -> None:
        """Give up the spsc roles this instance holds (the last instance of this process frees the pid), then
        drop the views: the mapping closes after this."""
        if self._is_producer:
            self._unclaim(_PRODUCER, I_PRODUCER_PID)
        if self._is_consumer:
            self._unclaim(_CONSUMER, I_CONSUMER_PID)
        self._is_producer = self._is_consumer = False
        _instances.discard(self)
        self._bind_paths()  # closed: drops the fast paths' closures (they hold the views)
        self._items = self._free = self._pm_sem = self._cm_sem = self._repair = None
        self._plock = self._clock = None
        self._q8 = self._q4 = None
        for view in self._views:
            view.release()
        self._views = []

    def _forget_process_state(self) -> None:
        self._is_producer = self._is_consumer = False
        self._put_mutex = _side_mutex(self.name, _PRODUCER)
        self._get_mutex = _side_mutex(self.name, _CONSUMER)
        self._fence_lock = threading.Lock()
        self._bind_paths()

    def _bind_paths(self) -> None:
        """Point the per-call paths ``_put_one(frame, timeout_s)``, ``_put_frames(frames, timeout_s)``,
        ``_take_one(timeout_s) -> frame | None`` and ``_take(max_items, timeout_s) -> frames`` at what this
        instance's state needs: closed (they raise QueueClosedError), mpmc, spsc with a role this process has
        not claimed (claim, then go on), or a claimed spsc role (the fast closures). Re-run on every change."""
        if self._closed:
            self._put_one = self._put_frames = self._take_one = self._take = self._raise_closed
        elif self.mode == "mpmc":
            self._put_one, self._put_frames = self._mpmc_put_one, self._mpmc_put
            self._take_one, self._take = self._mpmc_take_one, self._mpmc_take
        else:
            self._put_one, self._put_frames = ((self._spsc_put_one_path(), self._spsc_put) if self._is_producer
                                               else (self._claim_put_one, self._claim_put))
            self._take_one, self._take = ((self._spsc_take_one_path(), self._spsc_take) if self._is_consumer
                                          else (self._claim_take_one, self._claim_take))

    def _raise_closed(self, *_args) -> Any:
        raise QueueClosedError(f"queue {self.name!r} is closed in this process")

    def _repr_fields(self) -> str:
        return f", mode={self.mode}, num_slots={self.num_slots}, slot_bytes={self.slot_bytes}"

    # ------------------------------------------------------------------ producer side

    def put(self, obj: Any, timeout_s: float | None = 5.0) -> None:
        """Encode ``obj`` with orjson (dicts, lists, str, int, float, bool, None, dataclasses, numpy) and
        enqueue it, waiting at most ``timeout_s`` seconds for a free slot (None = forever).

        Raises MessageTooLargeError if the encoding exceeds ``slot_bytes - 4`` bytes; QueueFullError if no
        slot frees up in time (QueueLockTimeoutError, a subclass, if a live process holds the producer mutex
        past ``lock_timeout_s``); QueueRoleError if this is a spsc queue whose producer role another live
        process holds; TypeError (orjson.JSONEncodeError) if ``obj`` is not serializable; QueueClosedError
        after ``close()``.
        """
        self._put_one(_dumps(obj, option=ORJSON_OPTIONS), timeout_s)

    def put_bytes(self, data: bytes, timeout_s: float | None = 5.0) -> None:
        """Enqueue one raw frame ``data`` (bytes-like, at most ``slot_bytes - 4`` bytes). Errors: as put."""
        self._put_one(data, timeout_s)

    def put_many(self, objs: Iterable[Any], timeout_s: float | None = 5.0) -> None:
        """Encode and enqueue every object of ``objs`` in order, committed at once: all or none of them.

        Waits at most ``timeout_s`` for room for all of them. Raises ValueError for more objects than
        ``num_slots``; the other errors as ``put`` (nothing is enqueued when it raises).
        """
        self.put_many_bytes([_dumps(o, option=ORJSON_OPTIONS) for o in objs], timeout_s)

    def put_many_bytes(self, frames: Iterable[bytes], timeout_s: float | None = 5.0) -> None:
        """Raw-frame variant of ``put_many``."""
        self._check_open()
        if not isinstance(frames, (list, tuple)):
            frames = list(frames)
        if len(frames) > self.num_slots:
            raise ValueError(f"put_many of {len(frames)} frames into queue {self.name!r} of "
                             f"{self.num_slots} slots: send them in batches of at most num_slots")
        limit = self.max_message_bytes
        for data in frames:
            if len(data) > limit:
                raise self._too_large(len(data))
        if frames:
            self._put_frames(frames, timeout_s)

    def _too_large(self, n: int) -> MessageTooLargeError:
        return MessageTooLargeError(f"message of {n} bytes does not fit a slot of queue {self.name!r} "
                                    f"(max {self.max_message_bytes} bytes): raise slot_bytes or send less")

    def _full_error(self, timeout_s: float | None) -> QueueFullError:
        return QueueFullError(f"queue {self.name!r} stayed full ({self.num_slots} slots) for "
                              f"{timeout_s} s: its consumer is slow, hung or dead")

    def _write_slots(self, tail: int, frames) -> int:
        mm, num_slots, slot_bytes = self._mm, self.num_slots, self.slot_bytes
        for data in frames:
            off = HEADER_BYTES + (tail % num_slots) * slot_bytes
            n = len(data)
            LEN.pack_into(mm, off, n)
            mm[off + 4:off + 4 + n] = data
            tail += 1
        return tail

    # mpmc ----------------------------------------------------------------

    def _mpmc_put_one(self, data, timeout_s: float | None) -> None:
        if len(data) > self.max_message_bytes:
            raise self._too_large(len(data))
        self._mpmc_put((data,), timeout_s)

    def _mpmc_put(self, frames, timeout_s: float | None) -> None:
        k = len(frames)
        if k == 1:
            if not _shm.sem_wait(self._free, timeout_s):
                raise self._full_error(timeout_s)
        else:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            for got in range(k):
                wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not _shm.sem_wait(self._free, wait_s):
                    for _ in range(got):
                        self._free.release()
                    raise self._full_error(timeout_s)

        def stamp() -> None:
            self._stamp_producer(k)

        try:
            if self._plock.acquire(stamp):
                self._repair_producer()
                stamp()
        except ShmLockTimeoutError as exc:
            for _ in range(k):
                self._free.release()
            raise QueueLockTimeoutError(str(exc)) from exc
        try:
            q8 = self._q8
            q8[I_TAIL] = self._write_slots(q8[I_TAIL], frames)
            for _ in range(k):
                self._items.release()
        finally:
            self._plock.release()

    def _stamp_producer(self, k: int = 1) -> None:
        self._q8[I_TAIL_AT_LOCK] = self._q8[I_TAIL]
        self._q4[I_FREES_AT_LOCK] = k

    def _repair_producer(self) -> None:
        """We took the producer mutex over from a dead producer; it held "free" tokens."""
        if self._q8[I_TAIL] == self._q8[I_TAIL_AT_LOCK]:
            for _ in range(self._q4[I_FREES_AT_LOCK]):
                self._free.release()  # it never committed: give its slots back
        # else it committed (and posted "items" right after, bar a window of a few calls)

    # spsc ----------------------------------------------------------------

    def _claim_put_one(self, data, timeout_s: float | None) -> None:
        if len(data) > self.max_message_bytes:
            raise self._too_large(len(data))
        self._claim(_PRODUCER)  # rebinds _put_one to the fast path
        self._put_one(data, timeout_s)

    def _claim_put(self, frames, timeout_s: float | None) -> None:
        self._claim(_PRODUCER)
        self._spsc_put(frames, timeout_s)

    def _spsc_put_one_path(self):
        """The claimed spsc producer's put of one frame, a closure over the views, sizes and bound methods:
        with the in-process side mutex free and room in the ring it is one length store, one memcpy and the
        tail store (the commit), then the flag check; otherwise (another thread inside, a full ring) it goes
        through ``_spsc_put``. Raises MessageTooLargeError, and what ``_spsc_put`` raises."""
        mm, q8, q4, limit = self._mm, self._q8, self._q4, self.max_message_bytes
        num_slots, slot_bytes = self.num_slots, self.slot_bytes
        acquire, release = self._put_mutex.acquire, self._put_mutex.release
        pack_len, wake, put_frames, too_large = LEN.pack_into, self._items.release, self._spsc_put, self._too_large
        head_seen = q8[I_HEAD]  # a lower bound of head (it only grows): re-read from shm only when it says full

        def put_one(data, timeout_s: float | None) -> None:
            nonlocal head_seen
            n = len(data)
            if n > limit:
                raise too_large(n)
            if acquire(False):
                try:
                    tail = q8[I_TAIL]
                    room = tail - head_seen < num_slots or tail - (head_seen := q8[I_HEAD]) < num_slots
                    if room:
                        off = HEADER_BYTES + tail % num_slots * slot_bytes
                        pack_len(mm, off, n)
                        mm[off + 4:off + 4 + n] = data
                        q8[I_TAIL] = tail + 1  # the commit: payload first, then the tail
                finally:
                    release()  # a locked instruction: the commit is visible before we read the flag
                if room:
                    if q4[I_CONSUMER_WAITING]:
                        q4[I_CONSUMER_WAITING] = 0
                        wake()
                    return
            put_frames((data,), timeout_s)

        return put_one

    def _spsc_put(self, frames, timeout_s: float | None) -> None:
        k = len(frames)
        mutex = self._put_mutex
        if not mutex.acquire(False) and not mutex.acquire(timeout=-1 if timeout_s is None else max(0.0, timeout_s)):
            raise self._full_error(timeout_s)
        try:
            q8, num_slots = self._q8, self.num_slots
            tail = q8[I_TAIL]
            if num_slots - (tail - q8[I_HEAD]) < k and not self._spsc_wait(
                    lambda: num_slots - (tail - q8[I_HEAD]) >= k, I_PRODUCER_WAITING, self._free, timeout_s):
                raise self._full_error(timeout_s)
            q8[I_TAIL] = self._write_slots(tail, frames)  # the commit: payloads first, then the tail
        finally:
            mutex.release()  # a locked instruction: the commit is visible before we read the flag
        q4 = self._q4
        if q4[I_CONSUMER_WAITING]:
            q4[I_CONSUMER_WAITING] = 0
            self._items.release()

    def _spsc_wait(self, ready, flag: int, sem, timeout_s: float | None) -> bool:
        """Wait until ``ready()`` (a re-read of the other side's counter) is true, at most ``timeout_s``
        seconds (None = forever): spin ``spin_s``, then announce the sleep in header word ``flag`` and sleep
        on ``sem`` (the other side posts it when it sees the flag), re-checking at least every RECHECK_S."""
        if timeout_s is not None and timeout_s <= 0:
            return ready()
        perf = time.perf_counter
        start = perf()
        spin_s = self.spin_s if timeout_s is None else min(self.spin_s, timeout_s)
        while perf() - start < spin_s:
            if ready():
                return True
            os.sched_yield()  # on a loaded host the other side may be queued on our core: let it run
        q4 = self._q4
        deadline = None if timeout_s is None else start + timeout_s
        while True:
            q4[flag] = 1
            self._fence_lock.acquire()  # full barrier: the flag is visible before we re-read the counter
            self._fence_lock.release()
            if ready():
                q4[flag] = 0
                return True
            step = RECHECK_S if deadline is None else min(RECHECK_S, deadline - perf())
            if step > 0:
                _shm.sem_wait(sem, step)
            q4[flag] = 0
            if ready():
                return True
            if deadline is not None and perf() >= deadline:
                return False

    def _claim(self, side: str) -> None:
        """Take the spsc ``side`` role for this process: refused (QueueRoleError) while another live process
        holds it; a dead holder's role (a killed actor's) is taken over."""
        lock, index = (self._plock, I_PRODUCER_PID) if side == _PRODUCER else (self._clock, I_CONSUMER_PID)
        me = os.getpid()
        try:
            lock.acquire()  # a take-over from a claimer that died here needs no repair: the pid is one store
        except ShmLockTimeoutError as exc:
            raise (QueueLockTimeoutError(str(exc)) if side == _PRODUCER else exc) from exc
        try:
            if self._is_producer if side == _PRODUCER else self._is_consumer:
                return  # another thread of this process claimed it for this instance meanwhile
            holder = self._q4[index]
            if holder not in (0, me) and _shm.pid_alive(holder):
                raise QueueRoleError(
                    f"queue {self.name!r} is single-producer/single-consumer and its {side} is pid {holder}, "
                    f"which is alive; pid {me} may not be a second {side} (it would corrupt the queue): "
                    f"create the queue with mode='mpmc' if it has several {side}s, or stop pid {holder} first")
            self._q4[index] = me
            with _process_lock:
                _claims[(self.name, side)] = _claims.get((self.name, side), 0) + 1
            if side == _PRODUCER:
                self._is_producer = True
            else:
                self._is_consumer = True
            self._bind_paths()
        finally:
            lock.release()

    def _unclaim(self, side: str, index: int) -> None:
        key = (self.name, side)
        with _process_lock:
            left = _claims.get(key, 1) - 1
            if left > 0:
                _claims[key] = left
                return
            _claims.pop(key, None)
        if self._q4[index] == os.getpid():
            self._q4[index] = 0

    # ------------------------------------------------------------------ consumer side

    def get(self, timeout_s: float | None) -> Any | None:
        """Dequeue one message and decode it; None if nothing arrived within ``timeout_s`` seconds.

        ``timeout_s`` is required: ``0`` polls without blocking; ``None`` blocks until a message arrives (the
        only way to block forever; an actor loop should pass its heartbeat period instead).
        Raises ShmLockTimeoutError if a live process holds the consumer mutex past ``lock_timeout_s``,
        QueueRoleError if this is a spsc queue whose consumer role another live process holds,
        QueueClosedError after ``close()``, orjson.JSONDecodeError on a corrupt frame.
        """
        data = self._take_one(timeout_s)
        return None if data is None else _loads(data)

    def get_bytes(self, timeout_s: float | None) -> bytes | None:
        """Dequeue one raw frame; None on timeout. Semantics and errors as ``get``."""
        return self._take_one(timeout_s)

    def get_many(self, max_items: int, timeout_s: float | None) -> list[Any]:
        """Up to ``max_items`` decoded messages: waits at most ``timeout_s`` for the first, then takes what is
        already there without waiting (spsc: and stops once the batch holds ``GET_MANY_BYTES``). Returns [] on
        timeout. Errors as ``get``. (Actors batch with this.)"""
        return [_loads(b) for b in self.get_many_bytes(max_items, timeout_s)]

    def get_many_bytes(self, max_items: int, timeout_s: float | None) -> list[bytes]:
        """Raw-frame variant of ``get_many``."""
        self._check_open()
        if max_items < 1:
            raise ValueError(f"max_items={max_items} must be >= 1")
        return self._take(max_items, timeout_s)

    def _read_slots(self, head: int, k: int, max_bytes: int | None = None) -> list[bytes]:
        """Copies of the ``k`` frames from message ``head`` on (a corrupt length reads as an empty frame); with
        ``max_bytes``, fewer: it stops after the frame that brings the payload total to ``max_bytes``."""
        mm, num_slots, slot_bytes, limit = self._mm, self.num_slots, self.slot_bytes, self.max_message_bytes
        unpack_len = LEN.unpack_from
        budget = k * slot_bytes if max_bytes is None else max_bytes  # k payloads never fill k slots
        out = []
        append = out.append
        for i in range(head, head + k):
            off = HEADER_BYTES + i % num_slots * slot_bytes
            n = unpack_len(mm, off)[0]
            if n > limit:
                n = 0
            append(mm[off + 4:off + 4 + n])
            budget -= n
            if budget <= 0:
                break
        return out

    # spsc ----------------------------------------------------------------

    def _claim_take_one(self, timeout_s: float | None) -> bytes | None:
        self._claim(_CONSUMER)  # rebinds _take_one to the fast path
        return self._take_one(timeout_s)

    def _claim_take(self, max_items: int, timeout_s: float | None) -> list[bytes]:
        self._claim(_CONSUMER)
        return self._spsc_take(max_items, timeout_s)

    def _spsc_take_one_path(self):
        """The claimed spsc consumer's take of one frame (bytes, or None on timeout), a closure like
        ``_spsc_put_one_path``'s: with the side mutex free and a message committed, one length load, one
        slice copy and the head store, then the flag check; otherwise through ``_spsc_take``."""
        mm, q8, q4, limit = self._mm, self._q8, self._q4, self.max_message_bytes
        num_slots, slot_bytes = self.num_slots, self.slot_bytes
        acquire, release = self._get_mutex.acquire, self._get_mutex.release
        unpack_len, wake, take = LEN.unpack_from, self._free.release, self._spsc_take
        tail_seen = q8[I_TAIL]  # a lower bound of tail: re-read from shm only when it says empty

        def take_one(timeout_s: float | None) -> bytes | None:
            nonlocal tail_seen
            if acquire(False):
                try:
                    head = q8[I_HEAD]
                    ready = head < tail_seen or head < (tail_seen := q8[I_TAIL])
                    if ready:
                        off = HEADER_BYTES + head % num_slots * slot_bytes
                        n = unpack_len(mm, off)[0]
                        data = mm[off + 4:off + 4 + (n if n <= limit else 0)]  # a corrupt length: empty
                        q8[I_HEAD] = head + 1
                finally:
                    release()  # a locked instruction: the new head is visible before we read the flag
                if ready:
                    if q4[I_PRODUCER_WAITING]:
                        q4[I_PRODUCER_WAITING] = 0
                        wake()
                    return data
            out = take(1, timeout_s)
            return out[0] if out else None

        return take_one

    def _spsc_take(self, max_items: int, timeout_s: float | None) -> list[bytes]:
        mutex = self._get_mutex
        if not mutex.acquire(False) and not mutex.acquire(timeout=-1 if timeout_s is None else max(0.0, timeout_s)):
            return []
        try:
            q8 = self._q8
            head = q8[I_HEAD]
            avail = q8[I_TAIL] - head
            if avail <= 0:
                if not self._spsc_wait(lambda: q8[I_TAIL] != head, I_CONSUMER_WAITING, self._items, timeout_s):
                    return []
                avail = q8[I_TAIL] - head
            out = self._read_slots(head, min(max_items, avail), GET_MANY_BYTES)
            q8[I_HEAD] = head + len(out)
        finally:
            mutex.release()  # a locked instruction: the new head is visible before we read the flag
        q4 = self._q4
        if q4[I_PRODUCER_WAITING]:
            q4[I_PRODUCER_WAITING] = 0
            self._free.release()
        return out

    # mpmc ----------------------------------------------------------------

    def _mpmc_take_one(self, timeout_s: float | None) -> bytes | None:
        out = self._mpmc_take(1, timeout_s)
        return out[0] if out else None

    def _mpmc_take(self, max_items: int, timeout_s: float | None) -> list[bytes]:
        if not self._wait_items(timeout_s):
            return []
        k = 1
        while k < max_items and _shm.sem_wait(self._items, 0):
            k += 1
        return self._take_items(k)

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

    def _take_items(self, k: int) -> list[bytes]:
        """Read ``k`` messages; the caller already holds ``k`` "items" tokens."""
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
            q8 = self._q8
            head = q8[I_HEAD]
            out = self._read_slots(head, k)
            for _ in range(k):
                head += 1
                q8[I_HEAD] = head
                self._free.release()
            return out
        finally:
            self._clock.release()

    def _stamp_consumer(self, k: int) -> None:
        self._q8[I_HEAD_AT_LOCK] = self._q8[I_HEAD]
        self._q4[I_ITEMS_AT_LOCK] = k

    def _repair_consumer(self) -> None:
        """We took the consumer mutex over from a dead consumer; give back the items it had not taken."""
        taken = self._q8[I_HEAD] - self._q8[I_HEAD_AT_LOCK]
        held = self._q4[I_ITEMS_AT_LOCK]
        for _ in range(max(0, held - taken)):
            self._items.release()

    # ------------------------------------------------------------------ status and lifetime

    def qsize(self) -> int:
        """Messages committed and not yet taken (a racy snapshot; 0 after close())."""
        if self._closed:
            return 0
        return max(0, self._q8[I_TAIL] - self._q8[I_HEAD])

    def empty(self) -> bool:
        return self.qsize() == 0

    def role_pids(self) -> tuple[int, int]:
        """spsc: (producer pid, consumer pid) holding the roles, 0 = unclaimed; (0, 0) for mpmc or closed."""
        if self._closed or self.mode != "spsc":
            return 0, 0
        return self._q4[I_PRODUCER_PID], self._q4[I_CONSUMER_PID]

    def _check_open(self):
        if self._closed:
            raise QueueClosedError(f"queue {self.name!r} is closed in this process")
        return self._mm
