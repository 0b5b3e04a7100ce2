"""The flight recorder: a fixed-size ring of request events in POSIX shm, one sub-ring per writer process.

Shared-memory layout of segment ``name``::

    offset  size  field
    0       4     magic              b"PDFR"
    4       4     version            u4 = 1
    8       4     num_writers        u4  one sub-ring each: actor-table indices 0..num_actors-1, then the supervisor
    12      4     event_bytes        u4 = EVENT_DTYPE.itemsize (64)
    16      8     events_per_writer  u8  capacity of each sub-ring
    24      8     rings_offset       u8  = HEADER_BYTES + num_writers * CURSOR_BYTES
    256     ...   num_writers cursors of CURSOR_BYTES (64: one cache line each)
                    0  written  u8  events this sub-ring's writers appended so far (all incarnations)
                    8  pid      i4  the process that last opened it for writing
    rings_offset  num_writers sub-rings of events_per_writer events of EVENT_DTYPE

Event (``EVENT_DTYPE``, 64 bytes; every field aligned to its size)::

    offset  field       type  meaning
    0       head        u8    the event's sequence number in its sub-ring (1, 2, ...), written FIRST
    8       t_ns        i8    time.monotonic_ns() when it happened
    16      key         u8    request key: ``request_key`` of the request id (the state table's first 40 bytes)
    24      slot        i4    state-table row, -1 none
    28      generation  u4    the row's generation
    32      a           i8    kind-specific (``KIND_FIELDS``)
    40      b           i8    kind-specific
    48      kind        u2    EventKind
    50      old         u1    state before (transitions), else 0
    51      new         u1    state after (transitions, allocate), else 0
    52      actor       i1    actor-table index of the writer (the supervisor: -1)
    53      aux         u1    kind-specific small value
    54      c           u2    kind-specific
    56      tail        u8    = head, written LAST

Writers: a process opens its own sub-ring (``install``); appends take no cross-process lock (a thread lock inside
the process only) and never wait: the ring overwrites its oldest events. A restarted actor continues its
predecessor's count. Readers map the segment read-only and never block a writer: they copy the tails, then the
events, then the heads, and keep an event only if its head read after equals its tail read before (a seqlock per
entry). An entry being overwritten, or left half-written by a SIGKILLed writer, has head != tail and is skipped.

Every ``head``, ``tail`` and ``written`` word is stored and loaded as one aligned 8-byte access (a ``memoryview``
cast to "Q", numpy on the reading side), never through ``struct``: CPython's struct packs and unpacks "<Q" one byte
at a time, so a reader racing a writer could see a count half-way through a carry (0x1FF -> 0x100 -> 0x200: lower
than both) and an incremental reader went back and returned events twice. The seqlock relies on stores becoming
visible in program order (x86-64's TSO; the engine's shm queues assume the same).
"""
from __future__ import annotations

import enum
import hashlib
import os
import struct
import threading
import time

import numpy as np

from ipc import _shm

MAGIC = b"PDFR"
VERSION = 1
HEADER_BYTES = 256
CURSOR_BYTES = 64
HEADER = struct.Struct("<4sIIIQQ")  # magic, version, num_writers, event_bytes, events_per_writer, rings_offset
U8 = struct.Struct("<Q")
BODY = struct.Struct("<qQiIqqHBBbBH")  # t_ns .. c: bytes 8..56 of an event
SUPERVISOR_ACTOR = -1

EVENT_FIELDS = [  # (name, dtype, offset)
    ("head", "<u8", 0), ("t_ns", "<i8", 8), ("key", "<u8", 16), ("slot", "<i4", 24), ("generation", "<u4", 28),
    ("a", "<i8", 32), ("b", "<i8", 40), ("kind", "<u2", 48), ("old", "u1", 50), ("new", "u1", 51),
    ("actor", "i1", 52), ("aux", "u1", 53), ("c", "<u2", 54), ("tail", "<u8", 56),
]
EVENT_DTYPE = np.dtype({"names": [f[0] for f in EVENT_FIELDS], "formats": [f[1] for f in EVENT_FIELDS],
                        "offsets": [f[2] for f in EVENT_FIELDS], "itemsize": 64})
assert BODY.size == 48


class EventKind(enum.IntEnum):
    ALLOCATE = 1        # new = first state; a = request deadline_ns; b = prompt tokens
    TRANSITION = 2      # old -> new; a = request deadline_ns in force; c = error_code
    RELEASE = 3         # old = the final state released
    TIMEOUT = 4         # the monitor's verdict: old = stage; a = age_ns; b = limit_ns; aux = TimeoutReason
    PREFILL_CHUNK = 5   # a = tokens in the chunk; b = prompt tokens done after it
    CACHE_HIT = 6       # a = prompt tokens found in the prefix cache
    KV_HANDOFF = 7      # a = bytes moved; b = duration_ns; c = blocks; aux = 1 a copy inside one pool (colocated)
    HTTP_HEADERS = 8    # the API read the request's headers (a = body bytes)
    ADMITTED = 9        # the API admitted it (rows allocated, sent to the prefill actor)
    FIRST_BYTE = 10     # the first response byte was handed to the server
    LAST_BYTE = 11      # the last response byte was handed to the server; a = HTTP status
    CLOSED = 12         # the exchange ended; aux = ClosedBy; a = HTTP status
    RENEWAL = 13        # a deadline renewal; aux = Renewal (what renewed it); BLOCKS: a = blocks received so far
    HTTP_PROBLEM = 14   # a connection detection (ipc/ledger.DETECTIONS[aux - 1]); a = connection id; b = age_ns
    DRILL = 15          # a watchdog drill's verdict (api/drill.py): old = the stage drilled; aux = 0 passed, else
    #                     1 + its index in ipc.engine_status.DRILL_FAILURES


class ClosedBy(enum.IntEnum):
    SERVER = 1
    CLIENT = 2


class Renewal(enum.IntEnum):
    """What renewed a deadline (a finished prefill chunk is its own PREFILL_CHUNK event; tokens are not
    recorded one by one)."""
    CHUNK = 1      # a prefill chunk finished (recorded as PREFILL_CHUNK)
    BLOCKS = 2     # KV blocks arrived
    QUEUE = 3      # the queue ahead moved (at most once per renew interval)
    TOKEN = 4      # a decoded token (not recorded)


class TimeoutReason(enum.IntEnum):
    STAGE_DEADLINE = 1
    REQUEST_DEADLINE = 2
    BAD_TIMESTAMP = 3


def request_key(request_id: str | bytes) -> int:
    """The u8 key of a request id in the recorder: blake2b-64 of its first 40 ascii bytes (what the state table
    keeps), never 0. A client id and the completion id it became are the same string in pdserve."""
    raw = request_id.encode("ascii", "replace") if isinstance(request_id, str) else bytes(request_id)
    raw = raw[:40].rstrip(b"\0")
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") or 1


class Recorder(_shm.ShmSegment):
    """The event ring in shm (layout in the module docstring). The supervisor creates and unlinks it; writers
    ``open_writer``; readers ``attach(readonly=True)`` and call ``events``."""

    MAGIC = MAGIC
    VERSION = VERSION
    KIND = "flight recorder"

    def __init__(self) -> None:
        super().__init__()
        self.num_writers = 0
        self.events_per_writer = 0
        self._rings: np.ndarray | None = None
        self._bytes: memoryview | None = None
        self._words: memoryview | None = None   # the segment as aligned u8 words: atomic head/tail/cursor access

    @classmethod
    def create(cls, name: str, num_writers: int, events_per_writer: int) -> "Recorder":
        """Create and own a recorder of ``num_writers`` sub-rings of ``events_per_writer`` events (64 B each).
        Raises ValueError for sizes out of range, FileExistsError if ``name`` exists."""
        if not 1 <= num_writers <= 255:
            raise ValueError(f"num_writers={num_writers} must be in 1..255")
        if not 16 <= events_per_writer <= 1 << 26:
            raise ValueError(f"events_per_writer={events_per_writer} must be in 16..{1 << 26}")
        rings_offset = HEADER_BYTES + num_writers * CURSOR_BYTES

        def init(mm) -> None:
            HEADER.pack_into(mm, 0, b"\0\0\0\0", VERSION, num_writers, EVENT_DTYPE.itemsize, events_per_writer,
                             rings_offset)

        return cls._create(name, rings_offset + num_writers * events_per_writer * EVENT_DTYPE.itemsize, init)

    @staticmethod
    def size_bytes(num_writers: int, events_per_writer: int) -> int:
        """Bytes of shm a recorder of this shape takes."""
        return HEADER_BYTES + num_writers * (CURSOR_BYTES + events_per_writer * EVENT_DTYPE.itemsize)

    def _check_layout(self, name: str, mm) -> None:
        event_bytes = HEADER.unpack_from(mm, 0)[3] if len(mm) >= HEADER_BYTES else 0
        if event_bytes != EVENT_DTYPE.itemsize:
            raise ValueError(f"flight recorder {name!r} has events of {event_bytes} B; this code expects "
                             f"{EVENT_DTYPE.itemsize} B")

    def _setup(self, mm) -> None:
        _, _, self.num_writers, _, self.events_per_writer, rings_offset = HEADER.unpack_from(mm, 0)
        self._rings = _shm.shm_array(mm, EVENT_DTYPE, (self.num_writers, self.events_per_writer), rings_offset)
        self._bytes = memoryview(mm)
        self._words = self._bytes[:len(mm) // 8 * 8].cast("Q")

    def _teardown(self) -> None:
        self._rings = None
        if self._words is not None:
            self._words.release()
            self._bytes.release()
        self._words = self._bytes = None

    def _repr_fields(self) -> str:
        return f", num_writers={self.num_writers}, events_per_writer={self.events_per_writer}"

    # ---- writing ---------------------------------------------------------------------------------------
    def open_writer(self, writer: int, actor: int) -> "RingWriter":
        """This process's writer of sub-ring ``writer``, stamping ``actor`` on its events. Raises IndexError for a
        sub-ring outside the recorder, PermissionError if attached read-only."""
        if self.readonly:
            raise PermissionError(f"flight recorder {self.name!r} is attached read-only")
        if not 0 <= writer < self.num_writers:
            raise IndexError(f"writer {writer} outside flight recorder {self.name!r} of {self.num_writers}")
        return RingWriter(self, writer, actor)

    def written(self, writer: int) -> int:
        """Events sub-ring ``writer`` has had appended so far (all time); one atomic load."""
        return self._words[(HEADER_BYTES + writer * CURSOR_BYTES) >> 3]

    # ---- reading -----------------------------------------------------------------------------------------
    def events(self) -> np.ndarray:
        """Every whole event in the ring (EVENT_DTYPE), sorted by time; torn entries (being overwritten, or left
        half-written by a killed writer) are skipped. Takes no lock and never waits."""
        out = []
        for w in range(self.num_writers):
            ring = self._rings[w]
            tails = ring["tail"].copy()
            data = ring.copy()
            heads = ring["head"].copy()
            ok = (heads == tails) & (tails != 0) & (data["head"] == heads) & (data["tail"] == tails)
            out.append(data[ok])
        events = np.concatenate(out) if out else np.zeros(0, EVENT_DTYPE)
        return events[np.argsort(events["t_ns"], kind="stable")]

    def horizon_ns(self) -> int:
        """The newest time before which some sub-ring's events were overwritten: the oldest whole event of each
        sub-ring that has wrapped (appended more than it holds), the latest of those; 0 when none has wrapped.
        A row life that began before it may have lost events (its middle, or its end) to the ring."""
        horizon = 0
        for w in range(self.num_writers):
            if self.written(w) <= self.events_per_writer:
                continue
            ring = self._rings[w]
            heads, tails, t_ns = ring["head"].copy(), ring["tail"].copy(), ring["t_ns"].copy()
            ok = (heads == tails) & (tails != 0)
            if ok.any():
                horizon = max(horizon, int(t_ns[ok].min()))
        return horizon

    def events_since(self, seen: list[int] | None) -> tuple[np.ndarray, list[int], int]:
        """The whole events appended after ``seen`` (each sub-ring's ``written`` count at the previous call; None:
        from the oldest still in the ring), sorted by time; the counts to pass next time; and how many events
        after ``seen`` were lost because the writers lapped this reader (overwritten before the call, or while
        it copied them). Costs in proportion to the new events (``events`` copies the whole ring); returns each
        whole event once across calls; torn ones (a killed writer's) are skipped and counted as lost. Takes no
        lock and never waits."""
        fresh = seen is None
        seen = [0] * self.num_writers if fresh else list(seen)
        out, lost = [], 0
        for w in range(self.num_writers):
            written = self.written(w)
            if fresh:
                seen[w] = max(0, written - self.events_per_writer)
            if written <= seen[w]:      # nothing new (a count never goes back: the words are read atomically)
                continue
            first = max(seen[w], written - self.events_per_writer)   # older ones are overwritten
            lost += first - seen[w]
            seen[w] = written
            seqs = np.arange(first + 1, written + 1, dtype=np.uint64)
            idx = ((seqs - np.uint64(1)) % np.uint64(self.events_per_writer)).astype(np.int64)
            ring = self._rings[w]
            tails = ring["tail"][idx]
            data = ring[idx]
            heads = ring["head"][idx]
            ok = (heads == seqs) & (tails == seqs) & (data["head"] == seqs) & (data["tail"] == seqs)
            lost += int(len(ok) - np.count_nonzero(ok))
            out.append(data[ok])
        events = np.concatenate(out) if out else np.zeros(0, EVENT_DTYPE)
        return events[np.argsort(events["t_ns"], kind="stable")], seen, lost


class RingWriter:
    """Appends events to one sub-ring. Thread-safe within the process (a thread lock); nothing crosses
    processes. ``append`` takes about 1 us."""

    def __init__(self, recorder: Recorder, writer: int, actor: int):
        self.recorder = recorder
        self.writer = writer
        self.actor = actor
        self._mm = recorder._mm
        self._words = recorder._words
        self._cursor_at = HEADER_BYTES + writer * CURSOR_BYTES
        rings_offset = HEADER.unpack_from(self._mm, 0)[5]
        self._cap = recorder.events_per_writer
        self._base = rings_offset + writer * self._cap * EVENT_DTYPE.itemsize
        self._lock = threading.Lock()
        self._written = recorder.written(writer)
        struct.pack_into("<i", self._mm, self._cursor_at + 8, os.getpid())

    def append(self, kind: int, slot: int = -1, generation: int = 0, key: int = 0, a: int = 0, b: int = 0,
               old: int = 0, new: int = 0, aux: int = 0, c: int = 0, t_ns: int | None = None) -> None:
        t_ns = time.monotonic_ns() if t_ns is None else t_ns
        mm, words = self._mm, self._words
        with self._lock:
            seq = self._written + 1
            at = self._base + ((seq - 1) % self._cap) * 64
            words[at >> 3] = seq                          # head first: readers see the entry as torn from here
            BODY.pack_into(mm, at + 8, t_ns, key, slot, generation & 0xFFFFFFFF, a, b, kind, old, new,
                           self.actor, aux & 0xFF, c & 0xFFFF)
            words[(at >> 3) + 7] = seq                    # tail last: whole again
            self._written = seq
            words[self._cursor_at >> 3] = seq             # one 8-byte store: readers never see it mid-carry


# ---- the process's writer (every writer process installs one; the state table records through it) ----------

_writer: RingWriter | None = None


def install(recorder: Recorder | None, writer: int, actor: int) -> RingWriter | None:
    """Make sub-ring ``writer`` this process's recorder (``record`` and the state table's hooks write there);
    ``recorder`` None uninstalls. Returns the writer."""
    global _writer
    _writer = recorder.open_writer(writer, actor) if recorder is not None else None
    return _writer


def installed() -> RingWriter | None:
    return _writer


def record(kind: int, slot: int = -1, generation: int = 0, key: int = 0, **fields) -> None:
    """Append one event to this process's sub-ring; a no-op when none is installed (recorder off, a test's
    table). Never raises for a closed recorder (the engine is stopping)."""
    w = _writer
    if w is None:
        return
    try:
        w.append(kind, slot, generation, key, **fields)
    except (ValueError, TypeError, struct.error):   # a closed mapping while stopping
        pass


def record_request(kind: int, request_id: str, slot: int = -1, generation: int = 0, **fields) -> None:
    """``record`` keyed by ``request_id`` (hashed only when a recorder is installed)."""
    if _writer is not None:
        record(kind, slot, generation, request_key(request_id), **fields)
