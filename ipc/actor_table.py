"""The actor table: one row per actor in POSIX shm holding every per-actor fact: which process runs it, its
heartbeat, status and health, its KV gauges, its own request counts.

Sized by the number of actors (the supervisor creates one row per actor). Engine-wide facts live in
ipc/engine_status.py.

Shared-memory layout of segment ``name``::

    offset  size  field
    0       4     magic        b"PDAT"
    4       4     version      u4 = 5
    8       4     num_actors   u4
    12      4     row_bytes    u4 = ROW_DTYPE.itemsize (192)
    16      8     rows_offset  u8 = HEADER_BYTES
    128     ...   num_actors rows of ROW_DTYPE

Row (``ROW_DTYPE``, 192 bytes: three cache lines, so actors beating in their own rows do not share a line;
fields aligned to their size, so a reader never sees half of one). Each field has exactly one writer, and
writes only through the method named::

    offset  field            type   writer (method)                meaning
    0       heartbeat_count  u8     actor (beat)                   beats so far
    8       heartbeat_ns     i8     actor (beat)                   time.monotonic_ns() of the last beat
    16      loop_iterations  u8     actor (beat)                   actor loop iterations (idle ones included)
    24      late_messages    u8     actor (count_late_message)     messages for final or stale requests, dropped
    32      started_ns       i8     supervisor (spawned)           monotonic ns when it spawned the process
    40      pid              i4     supervisor (spawned,           the process it spawned for the row;
                                    restarting)                    0 = none (never started, or being replaced)
    44      restarts         u4     supervisor (restarting)        restarts so far
    48      actor_pid        i4     actor (starting)               its own pid (see "incarnations")
    52      kv_blocks_total  i4     actor (starting, set_kv_blocks)  its KV pool in blocks (0 = no pool)
    56      kv_blocks_free   i4     actor (starting, set_kv_blocks)  free blocks at the last report
    60      active_requests  i4     actor (starting,               requests it is waiting on (the API);
                                    set_active_requests)           -1 = it keeps no such count
    64      own_gauges       i4[4]  actor (starting,               its own count per queue gauge (GAUGES order),
                                    set_own_gauges)                -1 = keeps none; the monitor cross-checks them
    80      status           u1     actor (starting, set_status)   ActorStatus
    81      health           u1     monitor (set_health)           ActorHealth at the monitor's last tick
    82      name             S16    supervisor (register)          e.g. "prefill0" (ascii)
    98      device           S16    supervisor (register)          e.g. "cpu", "cuda:1" (ascii)
    114     router_mismatch  u1     monitor (set_router_mismatch)  1 = routed_requests disagrees with the table
    115     drained          u1     monitor (drain, readmit)       the stage (RequestState) it is drained for: no
                                                                   new work (actors/ejection.py); 0 = serving
    116     routed_requests  i4     api (set_routed_requests)      the router's count of requests it sent to this
                                                                   actor and still holds; -1 = none published
    120     router_mismatches u4    monitor (set_router_mismatch)  disagreements flagged so far
    124     requests_done    u4     actor (count_requests_done)    requests it finished its part of (prefill:
                                                                   KVReady sent; decode: FINISHED), all incarnations
    128     prefix_query_tokens  u8 actor (count_prefix_cache)     prompt tokens looked up in its prefix cache
    136     prefix_hit_tokens    u8 actor (count_prefix_cache)     of them, tokens whose KV it found cached
    144     prefix_evicted_blocks u8 actor (count_prefix_cache)    cached blocks it evicted to make room
                                                                   (these three: all incarnations)
    152     prefix_cached_blocks i4 actor (starting,               blocks in its prefix cache now; -1 = it has
                                    set_prefix_cache)              no prefix cache
    156     prefix_cached_in_use i4 actor (starting,               of them, blocks requests hold now (the rest
                                    set_prefix_cache)              are evictable and count as free)
    160     hand_back_blocks u8     actor (count_hand_backs)       blocks its prefix cache took from decode's
                                                                   hand-backs of finished requests (cross-turn)
    168     hand_backs_dropped u8   actor (count_hand_backs)       hand-backs it dropped (decode: queue full;
                                                                   prefill: prompt forgotten, no room, reallocated)
    176     drains           u4     monitor (drain)                drains so far (while drained: this drain's number)
    180     drain_timeouts   u4     monitor (drain)                the timeouts in the window that drained it
    184     readmit_drain    u4     api (readmit)                  the drain a passing readmission drill on it ended
                                                                   (api/drill.py); the monitor readmits the actor
                                                                   when it equals ``drains``
    188     (reserved)

Incarnations: the supervisor never rewrites an actor's fields when it restarts one. The actor-written fields
belong to the process the supervisor last spawned only while ``actor_pid == pid``; until the new process
calls ``starting`` they are its dead predecessor's, and ``row``/``rows`` report the row as STARTING (first
start) or RESTARTING, with every block free, no own counts (-1) and health UNKNOWN. ``starting`` resets the
actor's gauges before it sets ``actor_pid``, so the row turns current already showing the new process's
values. The counters (heartbeat_count, loop_iterations, late_messages) run on across incarnations.

No lock: one writer per field. ``beat`` is a few numpy scalar stores (about a microsecond) so actors call it
on every loop iteration, idle ones included. Readers (monitor, /metrics, inspect) read without locking.
"""
from __future__ import annotations

import enum
import struct
import time

import numpy as np

from ipc import _shm
from ipc.engine_status import GAUGES

pid_alive = _shm.pid_alive   # whether a process id names a live process (the monitor's actor verdicts)


class ActorStatus(enum.IntEnum):
    """An actor's own lifecycle (written by the actor), plus RESTARTING, which is never stored: ``row()``
    reports it for a row whose process is being replaced (see "incarnations" in the module docstring)."""

    EMPTY = 0  # row never used
    STARTING = 1
    READY = 2
    STOPPING = 3
    STOPPED = 4
    RESTARTING = 5


class ActorHealth(enum.IntEnum):
    """The monitor's verdict on an actor (actors/watchdog.py ``classify_actor``)."""

    UNKNOWN = 0
    OK = 1
    HUNG = 2
    DEAD = 3


ROW_FIELDS = [  # (name, dtype, offset)
    ("heartbeat_count", "<u8", 0), ("heartbeat_ns", "<i8", 8), ("loop_iterations", "<u8", 16),
    ("late_messages", "<u8", 24), ("started_ns", "<i8", 32), ("pid", "<i4", 40), ("restarts", "<u4", 44),
    ("actor_pid", "<i4", 48), ("kv_blocks_total", "<i4", 52), ("kv_blocks_free", "<i4", 56),
    ("active_requests", "<i4", 60), ("own_gauges", ("<i4", (len(GAUGES),)), 64), ("status", "u1", 80),
    ("health", "u1", 81), ("name", "S16", 82), ("device", "S16", 98), ("router_mismatch", "u1", 114),
    ("routed_requests", "<i4", 116), ("router_mismatches", "<u4", 120), ("requests_done", "<u4", 124),
    ("prefix_query_tokens", "<u8", 128), ("prefix_hit_tokens", "<u8", 136), ("prefix_evicted_blocks", "<u8", 144),
    ("prefix_cached_blocks", "<i4", 152), ("prefix_cached_in_use", "<i4", 156),
    ("hand_back_blocks", "<u8", 160), ("hand_backs_dropped", "<u8", 168), ("drained", "u1", 115),
    ("drains", "<u4", 176), ("drain_timeouts", "<u4", 180), ("readmit_drain", "<u4", 184),
]
ROW_DTYPE = np.dtype({"names": [f[0] for f in ROW_FIELDS], "formats": [f[1] for f in ROW_FIELDS],
                      "offsets": [f[2] for f in ROW_FIELDS], "itemsize": 192})
assert ROW_DTYPE.fields["own_gauges"][0].itemsize <= 16, "own_gauges outgrew its 16 bytes: new layout version"
STR_BYTES = 16

MAGIC = b"PDAT"
VERSION = 5
HEADER_BYTES = 128
HEADER = struct.Struct("<4sIIIQ")  # magic, version, num_actors, row_bytes, rows_offset
MAX_ACTORS = 4096


class ActorTable(_shm.ShmSegment):
    """One row per actor in POSIX shm (layout in the module docstring). The creator (the supervisor) owns
    and unlinks it; actors attach (or receive it pickled: only the name travels). Segment plumbing:
    ``ipc._shm.ShmSegment``.

    Writers raise IndexError for an index outside the table; through a read-only attach, PermissionError
    (``beat``: ValueError from numpy, to keep it cheap).
    """

    MAGIC = MAGIC
    VERSION = VERSION
    KIND = "actor table"

    def __init__(self) -> None:  # use create() / attach()
        super().__init__()
        self.num_actors = 0
        self._rows: np.ndarray | None = None
        self._hb_count = self._hb_ns = self._iters = None

    @classmethod
    def create(cls, name: str, num_actors: int) -> "ActorTable":
        """Create (O_CREX, mode 0600) and own a table of ``num_actors`` EMPTY rows.

        Raises ValueError for a size out of range, FileExistsError if ``name`` exists.
        """
        if not 1 <= num_actors <= MAX_ACTORS:
            raise ValueError(f"num_actors={num_actors} must be in 1..{MAX_ACTORS}")

        def init(mm) -> None:
            HEADER.pack_into(mm, 0, b"\0\0\0\0", VERSION, num_actors, ROW_DTYPE.itemsize, HEADER_BYTES)
            rows = _shm.shm_array(mm, ROW_DTYPE, num_actors, HEADER_BYTES)
            rows["own_gauges"] = -1
            rows["active_requests"] = -1
            rows["routed_requests"] = -1
            rows["prefix_cached_blocks"] = -1
            rows["prefix_cached_in_use"] = -1

        return cls._create(name, HEADER_BYTES + num_actors * ROW_DTYPE.itemsize, init)

    def _check_layout(self, name: str, mm) -> None:
        _, _, num_actors, row_bytes, rows_offset = HEADER.unpack_from(mm, 0) if len(mm) >= HEADER.size \
            else (0, 0, 0, 0, 0)
        if row_bytes != ROW_DTYPE.itemsize or len(mm) < rows_offset + num_actors * row_bytes:
            raise ValueError(f"actor table {name!r} has rows of {row_bytes} B; this code expects "
                             f"{ROW_DTYPE.itemsize} B")

    def _setup(self, mm) -> None:
        _, _, self.num_actors, _, rows_offset = HEADER.unpack_from(mm, 0)
        self._rows = _shm.shm_array(mm, ROW_DTYPE, self.num_actors, rows_offset)
        self._hb_count = self._rows["heartbeat_count"]
        self._hb_ns = self._rows["heartbeat_ns"]
        self._iters = self._rows["loop_iterations"]

    def _teardown(self) -> None:
        self._rows = self._hb_count = self._hb_ns = self._iters = None

    def _repr_fields(self) -> str:
        return f", num_actors={self.num_actors}"

    def _check(self, index: int) -> int:
        if self._closed:
            raise ValueError(f"actor table {self.name!r} is closed in this process")
        index = int(index)
        if not 0 <= index < self.num_actors:
            raise IndexError(f"actor index {index} outside actor table of {self.num_actors} rows")
        return index

    def _row_for_write(self, index: int) -> np.void:
        index = self._check(index)
        if self.readonly:
            raise PermissionError(f"actor table {self.name!r} is attached read-only")
        return self._rows[index]

    # ------------------------------------------------------------------ the supervisor's writers

    def register(self, index: int, name: str, device: str = "") -> None:
        """Name row ``index`` (before its first spawn). Raises ValueError for a name or device that is not
        ascii or longer than 16 bytes."""
        rec = self._row_for_write(index)
        name_b, device_b = _ascii(name, "name"), _ascii(device, "device")
        rec["name"] = name_b
        rec["device"] = device_b

    def spawned(self, index: int, pid: int) -> None:
        """The supervisor started process ``pid`` for row ``index`` (stamps started_ns)."""
        rec = self._row_for_write(index)
        rec["started_ns"] = time.monotonic_ns()
        rec["pid"] = pid

    def restarting(self, index: int) -> None:
        """The supervisor is replacing row ``index``'s dead process: no process until ``spawned``;
        restarts += 1."""
        rec = self._row_for_write(index)
        rec["pid"] = 0
        rec["restarts"] += 1

    # ------------------------------------------------------------------ the actor's writers (its own row)

    def starting(self, index: int, pid: int) -> None:
        """Process ``pid`` takes row ``index`` over: status STARTING, every block free, no own counts; then
        ``actor_pid``, so the row turns current already showing this process's values."""
        rec = self._row_for_write(index)
        rec["status"] = ActorStatus.STARTING
        rec["kv_blocks_free"] = rec["kv_blocks_total"]
        rec["own_gauges"] = -1
        rec["active_requests"] = -1
        rec["prefix_cached_blocks"] = -1
        rec["prefix_cached_in_use"] = -1
        rec["actor_pid"] = pid

    def set_status(self, index: int, status: ActorStatus) -> None:
        """The actor's own lifecycle: READY, STOPPING, STOPPED (STARTING through ``starting``). Raises
        ValueError for EMPTY and RESTARTING, which an actor never is in its own view."""
        status = ActorStatus(status)
        if status in (ActorStatus.EMPTY, ActorStatus.RESTARTING):
            raise ValueError(f"an actor does not set its own status to {status.name}")
        self._row_for_write(index)["status"] = status

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

    def set_kv_blocks(self, index: int, total: int, free: int) -> None:
        """The actor's KV pool: ``total`` blocks, ``free`` of them free now."""
        rec = self._row_for_write(index)
        rec["kv_blocks_total"] = total
        rec["kv_blocks_free"] = free

    def set_own_gauges(self, index: int, **counts: int) -> None:
        """The actor's own count for some queue gauges (keyword per name in GAUGES). Raises ValueError for
        another name."""
        bad = set(counts) - set(GAUGES)
        if bad:
            raise ValueError(f"unknown gauge(s) {sorted(bad)}; known: {list(GAUGES)}")
        gauges = self._row_for_write(index)["own_gauges"]
        for gauge, value in counts.items():
            gauges[GAUGES.index(gauge)] = value

    def set_active_requests(self, index: int, count: int) -> None:
        """Requests this actor is waiting on (the API's own view, compared with the table by inspect)."""
        self._row_for_write(index)["active_requests"] = count

    def count_requests_done(self, index: int, n: int) -> None:
        """Actor ``index`` finished its part of ``n`` more requests."""
        self._row_for_write(index)["requests_done"] += n

    def count_prefix_cache(self, index: int, query_tokens: int, hit_tokens: int, evicted_blocks: int) -> None:
        """Actor ``index``'s prefix cache looked up ``query_tokens`` more prompt tokens, found ``hit_tokens`` of
        them cached, and evicted ``evicted_blocks`` more blocks."""
        rec = self._row_for_write(index)
        rec["prefix_query_tokens"] += query_tokens
        rec["prefix_hit_tokens"] += hit_tokens
        rec["prefix_evicted_blocks"] += evicted_blocks

    def count_hand_backs(self, index: int, blocks: int, dropped: int) -> None:
        """Actor ``index`` cached ``blocks`` more blocks from hand-backs and dropped ``dropped`` more hand-backs."""
        rec = self._row_for_write(index)
        rec["hand_back_blocks"] += blocks
        rec["hand_backs_dropped"] += dropped

    def set_prefix_cache(self, index: int, cached_blocks: int, in_use: int) -> None:
        """Actor ``index``'s prefix cache holds ``cached_blocks`` blocks, ``in_use`` of them held by requests."""
        rec = self._row_for_write(index)
        rec["prefix_cached_blocks"] = cached_blocks
        rec["prefix_cached_in_use"] = in_use

    def count_late_message(self, index: int, n: int = 1) -> None:
        """``n`` more messages for final or stale requests were dropped by actor ``index``."""
        self._row_for_write(index)["late_messages"] += n

    def set_routed_requests(self, index: int, count: int) -> None:
        """The API's router: requests it sent to engine actor ``index`` that it still holds."""
        self._row_for_write(index)["routed_requests"] = count

    # ------------------------------------------------------------------ the monitor's writers

    def set_router_mismatch(self, index: int, flagged: bool) -> None:
        """The monitor's verdict on ``routed_requests`` against the table; a new flag counts one mismatch."""
        rec = self._row_for_write(index)
        if flagged and not rec["router_mismatch"]:
            rec["router_mismatches"] += 1
        rec["router_mismatch"] = int(flagged)

    def set_health(self, index: int, health: ActorHealth) -> None:
        """The monitor's verdict on actor ``index`` at this tick."""
        self._row_for_write(index)["health"] = ActorHealth(health)

    def drain(self, index: int, stage: int, timeouts: int) -> int:
        """The monitor drains actor ``index`` for ``stage`` (a RequestState, > 0): no new work
        (actors/ejection.py); ``timeouts`` made it. Returns this drain's number (``drains``)."""
        rec = self._row_for_write(index)
        if not 0 < int(stage) < 256:
            raise ValueError(f"drain stage {stage} must be a live RequestState (1..255)")
        rec["drains"] += 1
        rec["drain_timeouts"] = timeouts
        rec["drained"] = int(stage)
        return int(rec["drains"])

    def undrain(self, index: int) -> None:
        """The monitor readmits actor ``index``: it takes new work again."""
        self._row_for_write(index)["drained"] = 0

    # ------------------------------------------------------------------ the API's writers (drills)

    def readmit(self, index: int, drain: int) -> None:
        """The API: a readmission drill on actor ``index`` passed while it was drained by drain number ``drain``
        (the monitor then readmits it)."""
        self._row_for_write(index)["readmit_drain"] = drain

    # ------------------------------------------------------------------ readers

    def row(self, index: int) -> dict:
        """Row ``index`` as a dict (status/health as enums, name/device as str, own_gauges as a list, plus
        ``index``), as of its current incarnation (see the module docstring)."""
        index = self._check(index)
        return _row_dict(self._rows[index].copy(), index)

    def rows(self) -> list[dict]:
        """Every row as a dict (see ``row``)."""
        snap = self.snapshot()
        return [_row_dict(snap[i], i) for i in range(self.num_actors)]

    def snapshot(self) -> np.ndarray:
        """A copy of the whole table as stored (structured array of ``ROW_DTYPE``; no incarnation check)."""
        self._require_open()
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

    def busy(self, indices) -> int:
        """How many of the actors at ``indices`` report requests of their own queued or running (their own
        gauges, as last published; -1 = not kept counts as none). One vectorized read (a decode step asks)."""
        if not len(indices):
            return 0
        gauges = self._rows["own_gauges"][list(indices)]
        work = np.maximum(gauges[:, GAUGES.index("queued")], 0) + np.maximum(gauges[:, GAUGES.index("running")], 0)
        return int(np.count_nonzero(work))

    def own_gauges(self) -> list[int]:
        """Per gauge (GAUGES order), the sum of the actors' own counts, or -1 where no actor keeps one."""
        return sum_own_gauges(self.rows())


def sum_own_gauges(rows: list[dict]) -> list[int]:
    """Per gauge (GAUGES order), the sum over ``rows`` (``ActorTable.rows()`` dicts) of the counts the actors
    keep (>= 0), or -1 where none keeps that gauge."""
    out = []
    for i in range(len(GAUGES)):
        kept = [r["own_gauges"][i] for r in rows if r["own_gauges"][i] >= 0]
        out.append(sum(kept) if kept else -1)
    return out


def _ascii(value: str, what: str) -> bytes:
    b = value.encode("ascii")  # UnicodeEncodeError is a ValueError
    if len(b) > STR_BYTES:
        raise ValueError(f"{what}={value!r} is longer than {STR_BYTES} ascii bytes")
    return b


def _row_dict(rec: np.void, index: int) -> dict:
    d = dict(zip(ROW_DTYPE.names, rec.item()))   # one C call (the monitor reads every row each tick)
    d["own_gauges"] = d["own_gauges"].tolist()
    d["name"] = d["name"].decode("ascii", "replace")
    d["device"] = d["device"].decode("ascii", "replace")
    if d["actor_pid"] != d["pid"]:  # the actor-written fields are a dead predecessor's (or nobody's yet)
        d["status"] = ActorStatus.RESTARTING if d["restarts"] else ActorStatus.STARTING
        d["health"] = ActorHealth.UNKNOWN
        d["kv_blocks_free"] = d["kv_blocks_total"]
        d["own_gauges"] = [-1] * len(GAUGES)
        d["active_requests"] = -1
        d["prefix_cached_blocks"] = d["prefix_cached_in_use"] = -1
    d["status"] = ActorStatus(d["status"]) if d["status"] in ActorStatus._value2member_map_ else d["status"]
    d["health"] = ActorHealth(d["health"]) if d["health"] in ActorHealth._value2member_map_ else d["health"]
    d["index"] = index
    return d
