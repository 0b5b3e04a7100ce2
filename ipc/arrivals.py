"""The arrival index: every request id the API answered lately, with when it arrived, its status and where its time
went (api/blame.py), in POSIX shm, so ``tools/inspect --request ID`` can tell "never reached this server" from "its
events were overwritten", and split a request's time between the engine and what lies in front of it.

The flight recorder (ipc/recorder.py) keeps about 5-15 events per request and wraps in minutes under load; an
entry here is one per HTTP request, so the same bytes cover far longer. One segment per engine
(``/pdserve_<id>_arrivals``), created and unlinked by the supervisor, written by the API process only (one writer,
a thread lock inside it), read by anyone with no lock.

Layout (little endian)::

    offset  size  field
    0       4     magic      b"PDAI"
    4       4     version    u4 = 2
    8       8     capacity   u8  entries in the ring
    16      8     written    u8  entries appended so far (entry k is at k % capacity)
    64      ...   capacity entries of ENTRY_DTYPE (56 bytes)

Entry::

    offset  field        type  meaning
    0       head         u8    k + 1 for the k-th entry appended, written FIRST
    8       key          u8    ``ipc.recorder.request_key`` of the request id (the ``x-request-id`` it was answered with)
    16      t_ns         i8    time.monotonic_ns() when its headers arrived
    24      status       i4    the HTTP status it was answered with (0: no answer began: the client left first)
    28      before_us    u4    a proxy's wait before the headers (``X-Request-Start``), microseconds
    32      admitted_us  u4    headers to its first admission to the engine
    36      done_us      u4    headers to the engine's last event (of every choice) reaching the API
    40      end_us       u4    headers to the response's end (its last byte handed to the connection)
    44      (pad)        u4
    48      tail         u8    = head, written LAST

The ``*_us`` fields are api/blame.py ``split_of``'s (0xFFFFFFFF: does not apply). An entry is appended when the
response ends. A reader copies ``written``, the tails, the entries, then the heads again, and keeps an entry only if
its tail before equals its head after (a seqlock per entry: the head changes first when it is overwritten).
"""
from __future__ import annotations

import struct
import threading

import numpy as np

from ipc import _shm

MAGIC = b"PDAI"
VERSION = 2
HEADER = struct.Struct("<4sIQ")   # magic, version, capacity
HEADER_BYTES = 64
OFF_WRITTEN = 16
SPLIT_FIELDS = ("before_us", "admitted_us", "done_us", "end_us")
ENTRY_DTYPE = np.dtype([("head", "<u8"), ("key", "<u8"), ("t_ns", "<i8"), ("status", "<i4")]
                       + [(name, "<u4") for name in SPLIT_FIELDS] + [("pad", "<u4"), ("tail", "<u8")])
ENTRY_BYTES = ENTRY_DTYPE.itemsize   # 56


class ArrivalIndex(_shm.ShmSegment):
    """The ring in shm (layout in the module docstring): ``create`` (supervisor), ``attach`` (the API writes
    with ``note``; readers ``attach(readonly=True)`` and call ``find``)."""

    MAGIC = MAGIC
    VERSION = VERSION
    KIND = "arrival index"

    @classmethod
    def create(cls, name: str, capacity: int) -> "ArrivalIndex":
        """A ring of ``capacity`` entries (``capacity * 56`` bytes). Raises ValueError for capacity < 1,
        FileExistsError if ``name`` exists."""
        if not 1 <= capacity < 1 << 32:
            raise ValueError(f"ArrivalIndex capacity={capacity!r} must be in 1..2**32-1")

        def init(mm) -> None:
            HEADER.pack_into(mm, 0, b"\0\0\0\0", VERSION, capacity)

        return cls._create(name, HEADER_BYTES + capacity * ENTRY_BYTES, init)

    def _setup(self, mm) -> None:
        self.capacity = HEADER.unpack_from(mm, 0)[2]
        self._written = _shm.shm_array(mm, "<u8", 1, OFF_WRITTEN)
        self._entries = _shm.shm_array(mm, ENTRY_DTYPE, self.capacity, HEADER_BYTES)
        self._words = memoryview(mm).cast("B")[HEADER_BYTES:].cast("Q") if not self.readonly else None
        self._lock = threading.Lock()

    def _teardown(self) -> None:
        if self._words is not None:
            self._words.release()
        self._written = self._entries = self._words = None

    def note(self, key: int, t_ns: int, status: int, split: tuple[int, int, int, int] = (0xFFFFFFFF,) * 4) -> None:
        """Append one answered request (the API process only): ``key`` (``ipc.recorder.request_key``), its
        headers' time, the status it was answered with and its ``split`` (api/blame.py ``split_of``)."""
        before, admitted, done, end = (int(v) & 0xFFFFFFFF for v in split)
        with self._lock:
            k = int(self._written[0])
            base = (k % self.capacity) * (ENTRY_BYTES // 8)
            words = self._words
            words[base] = k + 1          # head first: a reader racing this sees head != tail
            words[base + 1] = key
            words[base + 2] = t_ns & (1 << 64) - 1
            words[base + 3] = (status & 0xFFFFFFFF) | before << 32
            words[base + 4] = admitted | done << 32
            words[base + 5] = end
            words[base + 6] = k + 1      # tail last
            self._written[0] = k + 1

    def find(self, key: int) -> dict:
        """``{"arrivals": [{"t_ns", "status", "before_us", "admitted_us", "done_us", "end_us"}, ...] oldest first,
        "since_ns": the oldest entry's arrival (0: nothing kept), "wrapped": whether older entries were
        overwritten}``: every kept arrival of ``key``."""
        written = int(self._written[0])
        tails = self._entries["tail"].copy()
        entries = self._entries.copy()
        heads = self._entries["head"].copy()
        ok = entries[(heads == tails) & (tails > 0)]
        mine = np.sort(ok[ok["key"] == key], order="head")
        return {"arrivals": [{name: int(e[name]) for name in ("t_ns", "status") + SPLIT_FIELDS} for e in mine],
                "since_ns": int(ok["t_ns"].min()) if len(ok) else 0, "wrapped": written > self.capacity}


_installed: ArrivalIndex | None = None


def install(index: ArrivalIndex | None) -> None:
    """Make ``index`` this process's (the API process: api/middleware.py notes each answered request)."""
    global _installed
    _installed = index


def installed() -> ArrivalIndex | None:
    return _installed


def note_arrival(request_id: str, t_ns: int, status: int, split: tuple[int, int, int, int] = (0xFFFFFFFF,) * 4,
                 ) -> None:
    """Note one answered request in the installed index (nothing without one)."""
    index = _installed
    if index is not None and request_id:
        from ipc.recorder import request_key

        index.note(request_key(request_id), t_ns, status, split)
