"""The actor table: one row per actor in POSIX shm, with its heartbeat, status and KV gauges.

Shared-memory layout of segment ``name``::

    offset  size  field
    0       4     magic        b"PDAT"
    4       4     version      u4 = 1
    8       4     num_actors   u4
    12      4     row_bytes    u4 = ROW_DTYPE.itemsize (128)
    16      8     rows_offset  u8 = HEADER_BYTES
    128     ...   num_actors rows of ROW_DTYPE

Row (``ROW_DTYPE``, 128 bytes: two cache lines, so actors beating in their own rows do not share a line;
8-byte fields aligned, so a reader never sees half of one)::

    offset  field            type  written by        meaning
    0       heartbeat_count  u8    the actor         beats so far
    8       heartbeat_ns     i8    the actor         time.monotonic_ns() of the last beat
    16      loop_iterations  u8    the actor         actor loop iterations so far (idle ones included)
    24      started_ns       i8    the supervisor    monotonic ns when the current process was started
    32      pid              i4    the supervisor    current process id, 0 = none
    36      restarts         u4    the supervisor
    40      kv_blocks_total  i4    the actor         its KV pool size in blocks (0 = no pool)
    44      kv_blocks_free   i4    the actor         free blocks at the last report
    48      role             u1    the supervisor    ActorRole
    49      status           u1    both              ActorStatus (actor: READY/STOPPING; supervisor: the rest)
    50      name             S16   the supervisor    e.g. "prefill0" (ascii)
    66      device           S16   the supervisor    e.g. "cpu", "cuda:1" (ascii)
    82      (reserved to 128)

No lock: each field has one writer (table above). ``beat`` is a few numpy scalar stores (about a microsecond)
so actors call it on every loop iteration, idle ones included. Readers (monitor, /metrics, inspect) read
without locking; an 8-byte aligned field is read whole.
"""
from __future__ import annotations

import enum
import struct
import time

import numpy as np

from ipc import _shm


class ActorRole(enum.IntEnum):
    NONE = 0
    API = 1
    PREFILL = 2
    DECODE = 3
    MONITOR = 4
    SUPERVISOR = 5


class ActorStatus(enum.IntEnum):
    EMPTY = 0  # row never set
    STARTING = 1
    READY = 2
    STOPPING = 3
    STOPPED = 4
    DEAD = 5  # process gone
    HUNG = 6  # process there, heartbeat stale
    RESTARTING = 7


ROW_FIELDS = [  # (name, dtype, offset)
    ("heartbeat_count", "<u8", 0), ("heartbeat_ns", "<i8", 8), ("loop_iterations", "<u8", 16),
    ("started_ns", "<i8", 24), ("pid", "<i4", 32), ("restarts", "<u4", 36), ("kv_blocks_total", "<i4", 40),
    ("kv_blocks_free", "<i4", 44), ("role", "u1", 48), ("status", "u1", 49), ("name", "S16", 50),
    ("device", "S16", 66),
]
ROW_DTYPE = np.dtype({"names": [f[0] for f in ROW_FIELDS], "formats": [f[1] for f in ROW_FIELDS],
                      "offsets": [f[2] for f in ROW_FIELDS], "itemsize": 128})
SETTABLE_FIELDS = frozenset(ROW_DTYPE.names)
_STR_FIELDS = {"name": 16, "device": 16}

MAGIC = b"PDAT"
VERSION = 1
HEADER_BYTES = 128
HEADER = struct.Struct("<4sIIIQ")  # magic, version, num_actors, row_bytes, rows_offset


class ActorTable:
    """One row per actor in POSIX shm (layout in the module docstring). The creator (the supervisor) owns
    and unlinks it; actors attach (or receive it pickled: only the name travels)."""

    def __init__(self) -> None:  # use create() / attach()
        self.name = ""
        self.num_actors = 0
        self.readonly = False
        self._owner = False
        self._closed = True
        self._unlinked = False
        self._mm = None
        self._rows: np.ndarray | None = None
        self._hb_count = self._hb_ns = self._iters = None

    @classmethod
    def create(cls, name: str, num_actors: int) -> "ActorTable":
        """Create (O_CREX, mode 0600) and own a table of ``num_actors`` EMPTY rows.

        Raises ValueError for a size out of range, FileExistsError if ``name`` exists.
        """
        if not 1 <= num_actors <= 4096:
            raise ValueError(f"num_actors={num_actors} must be in 1..4096")
        mm = _shm.create_segment(name, HEADER_BYTES + num_actors * ROW_DTYPE.itemsize)
        HEADER.pack_into(mm, 0, MAGIC, VERSION, num_actors, ROW_DTYPE.itemsize, HEADER_BYTES)
        t = cls()
        t._setup(name, mm, readonly=False, owner=True)
        return t

    @classmethod
    def attach(cls, name: str, readonly: bool = False) -> "ActorTable":
        """Attach to the existing table ``name`` (``readonly``: PROT_READ, writes raise).

        Raises FileNotFoundError if it does not exist, ValueError if it is not an actor table of this version.
        """
        t = cls()
        t._attach_into(name, readonly)
        return t

    def _attach_into(self, name: str, readonly: bool) -> None:
        self.__init__()
        mm = _shm.attach_segment(name, readonly=readonly)
        magic, version, _, row_bytes, _ = HEADER.unpack_from(mm, 0)
        if magic != MAGIC or version != VERSION or row_bytes != ROW_DTYPE.itemsize:
            _shm.close_mapping(mm)
            raise ValueError(f"segment {name!r} is not an actor table of layout version {VERSION}")
        self._setup(name, mm, readonly=readonly, owner=False)

    def _setup(self, name: str, mm, *, readonly: bool, owner: bool) -> None:
        _, _, num_actors, _, rows_offset = HEADER.unpack_from(mm, 0)
        self.name = name
        self.num_actors = num_actors
        self.readonly = readonly
        self._owner = owner
        self._closed = False
        self._mm = mm
        self._rows = _shm.shm_array(mm, ROW_DTYPE, num_actors, rows_offset)
        self._hb_count = self._rows["heartbeat_count"]
        self._hb_ns = self._rows["heartbeat_ns"]
        self._iters = self._rows["loop_iterations"]

    def __getstate__(self):
        if not self.name:
            raise ValueError("cannot pickle an ActorTable that was never created/attached")
        return (self.name, True) if self.readonly else self.name

    def __setstate__(self, state) -> None:
        name, readonly = (state, False) if isinstance(state, str) else state
        self._attach_into(name, readonly)

    def __repr__(self) -> str:
        return f"ActorTable({self.name!r}, num_actors={self.num_actors}, readonly={self.readonly})"

    def _check(self, index: int) -> int:
        if self._closed:
            raise ValueError(f"actor table {self.name!r} is closed in this process")
        index = int(index)
        if not 0 <= index < self.num_actors:
            raise IndexError(f"actor index {index} outside actor table of {self.num_actors} rows")
        return index

    # ------------------------------------------------------------------ writers

    def beat(self, index: int, *, iterations_delta: int = 1) -> None:
        """Record a heartbeat of actor ``index`` now (monotonic ns) and add ``iterations_delta`` loop
        iterations. Cheap; call it every loop iteration. Raises ValueError (numpy) if attached read-only,
        IndexError for an index outside the table."""
        if self._hb_ns is None or not 0 <= index < self.num_actors:
            self._check(index)
        self._hb_ns[index] = time.monotonic_ns()
        self._hb_count[index] += 1
        if iterations_delta:
            self._iters[index] += iterations_delta

    def set(self, index: int, **fields) -> None:
        """Set fields of row ``index`` (any ``ROW_DTYPE`` field; name/device as str, role/status as enums or
        ints). Raises ValueError for an unknown field or a string over 16 ascii bytes, PermissionError if
        attached read-only."""
        index = self._check(index)
        if self.readonly:
            raise PermissionError(f"actor table {self.name!r} is attached read-only")
        bad = set(fields) - SETTABLE_FIELDS
        if bad:
            raise ValueError(f"unknown actor table field(s) {sorted(bad)}; known: {sorted(SETTABLE_FIELDS)}")
        values = {}
        for k, v in fields.items():
            if k in _STR_FIELDS:
                b = v.encode("ascii") if isinstance(v, str) else bytes(v)
                if len(b) > _STR_FIELDS[k]:
                    raise ValueError(f"{k}={v!r} is longer than {_STR_FIELDS[k]} ascii bytes")
                values[k] = b
            else:
                values[k] = int(v)
        rec = self._rows[index]
        for k, v in values.items():
            rec[k] = v

    # ------------------------------------------------------------------ readers

    def row(self, index: int) -> dict:
        """Row ``index`` as a dict (role/status as enums, name/device as str, plus ``index``)."""
        index = self._check(index)
        return _row_dict(self._rows[index].copy(), index)

    def rows(self) -> list[dict]:
        """Every row as a dict (see ``row``)."""
        snap = self._rows.copy()
        return [_row_dict(snap[i], i) for i in range(self.num_actors)]

    def snapshot(self) -> np.ndarray:
        """A copy of the whole table (structured array of ``ROW_DTYPE``)."""
        return self._rows.copy()

    def heartbeat_age_s(self, index: int, now_ns: int | None = None) -> float | None:
        """Seconds since actor ``index`` last beat; None if it never did. A negative age (a heartbeat from
        the future) is returned as is: the monitor reports it as a bug, never as fresh."""
        index = self._check(index)
        hb = int(self._hb_ns[index])
        if hb == 0:
            return None
        return ((time.monotonic_ns() if now_ns is None else now_ns) - hb) / 1e9

    def find(self, name: str) -> int | None:
        """Index of the row called ``name``, else None."""
        hits = np.flatnonzero(self._rows["name"] == name.encode("ascii"))
        return int(hits[0]) if hits.size else None

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Detach this process (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._rows = self._hb_count = self._hb_ns = self._iters = None
        _shm.close_mapping(self._mm)
        self._mm = None

    def unlink(self) -> None:
        """Remove the segment (owner only; idempotent; tolerates already gone). Raises PermissionError on an
        instance that did not create it."""
        if not self._owner:
            raise PermissionError(f"only the creator of actor table {self.name!r} unlinks it")
        if not self._unlinked:
            self._unlinked = True
            _shm.unlink_segment_quiet(self.name)


def _row_dict(rec: np.void, index: int) -> dict:
    d = {name: rec[name].item() for name in ROW_DTYPE.names}
    d["name"] = d["name"].decode("ascii", "replace")
    d["device"] = d["device"].decode("ascii", "replace")
    d["role"] = ActorRole(d["role"]) if d["role"] in ActorRole._value2member_map_ else d["role"]
    d["status"] = ActorStatus(d["status"]) if d["status"] in ActorStatus._value2member_map_ else d["status"]
    d["index"] = index
    return d
