"""The connection ledger in POSIX shm: one row per live HTTP connection of the API process, and the last closed ones.

One segment per engine (``/pdserve_<id>_conns``), created and unlinked by the supervisor. The API process is the
only writer of the rows and of ``closes``; the monitor is the only writer of ``detections`` and of the ``flags``
array; tools/inspect, /metrics and the monitor read. A row is written under a per-row sequence number (a seqlock:
odd while the API writes it), so a reader never takes a torn row for a whole one; a reader never blocks the writer
and needs nothing from the API process (it reads with the API SIGSTOPped; a row the writer was stopped in the
middle of is returned marked ``torn``).

Layout (little endian)::

    offset  size  field
    0       4     magic          b"PDCL"
    4       4     version        u4 = 1
    8       4     num_live       u4  rows for open connections
    12      4     num_closed     u4  ring of the last closed connections
    16      4     row_bytes      u4  = ROW_DTYPE.itemsize
    24      8     closed_total   u8  API    connections closed (the ring's head: next index = closed_total % num_closed)
    32      8     next_conn_id   u8  API    the last connection id given (ids start at 1; 0 = free row)
    40      8     dropped        u8  API    connections not recorded: every live row was taken
    64      64    closes         u8[CLOSE_REASONS]     API      connections closed, by close reason
    128     64    detections     u8[DETECTIONS]        monitor  problems detected, by reason (counted once each)
    192     ...   live rows      ROW_DTYPE[num_live]
    ...     ...   closed rows    ROW_DTYPE[num_closed]
    ...     ...   flags          FLAG_DTYPE[num_live]  monitor  per live row: the detections standing on it

Row (``ROW_DTYPE``; times are CLOCK_MONOTONIC ns, 0 = never; ``R`` = REQUESTS_PER_ROW request entries)::

    field                type     meaning
    seq                  u8       seqlock: odd while the API writes the row
    conn_id              u8       connection id, unique per engine run (0 = free row)
    opened_ns            i8       accepted at
    closed_ns            i8       closed at (closed rows)
    server_close_ns      i8       the server began closing it (idle close, drain, Connection: close, GOAWAY)
    last_in_ns, bytes_in i8, u8   last bytes received, and the total
    last_out_ns, bytes_out i8, u8 last bytes handed to the socket, and the total
    late_bytes_in        u8       bytes the client sent after the server began closing
    blocked_since_ns     i8       a write is waiting for the socket or for HTTP/2 flow control since (0 = none)
    socket_buffered_bytes u8      bytes in the transport's write buffer (not yet accepted by the kernel)
    flow_buffered_bytes  u8       HTTP/2: response bytes waiting for the client's flow-control window
    requests_served      u4       requests whose response ended
    streams_open         u2       requests in progress (HTTP/1.1: 0 or 1)
    protocol             u1       PROTOCOLS index: unknown, h1, h2c, h2 (TLS), h1 (TLS)
    close_reason         u1       CLOSE_REASONS index (closed rows; "open" while live)
    goaway_code          i4       HTTP/2 GOAWAY error code received or sent at close (-1 = none)
    peer_port            u2
    peer                 S48      peer address
    forwarded            S64      the first Forwarded / X-Forwarded-For header seen on the connection
    req_slot             i4[R]    state-table slot of each request in progress (-1 = not admitted yet)
    req_generation       u4[R]    and its generation
    req_phase            u1[R]    PHASES index (0 = entry free)
    req_headers_ns       i8[R]    request headers received at
    req_since_ns         i8[R]    entered its phase at
    req_id               S40[R]   the request id (x-request-id)

Flags (``FLAG_DTYPE``, the monitor's): ``conn_id`` u8 (the row's connection the flags are about), ``reasons`` u4
(bit i = DETECTIONS[i] stands). docs/architecture.md, "The connection ledger", says what is detected and when.
"""
from __future__ import annotations

import os
import struct
import time

import numpy as np

from ipc import _shm

MAGIC = b"PDCL"
VERSION = 1
HEADER = struct.Struct("<4sIIII")   # magic, version, num_live, num_closed, row_bytes
COUNTERS_OFFSET = 24                # closed_total, next_conn_id, dropped (u8 each)
CLOSES_OFFSET = 64
DETECTIONS_OFFSET = 128
ROWS_OFFSET = 192

REQUESTS_PER_ROW = 4
PROTOCOLS = ("unknown", "h1", "h2c", "h2", "h1-tls")
PHASES = ("free", "reading", "engine", "responding")   # reading the request; waiting on the engine; writing
CLOSE_REASONS = ("open", "client_fin", "client_rst", "idle_close", "client_goaway", "server_close", "drain",
                 "error")
DETECTIONS = ("done_not_written", "write_blocked", "no_response", "wrote_after_close")
_R = REQUESTS_PER_ROW

ROW_DTYPE = np.dtype([
    ("seq", "<u8"), ("conn_id", "<u8"),
    ("opened_ns", "<i8"), ("closed_ns", "<i8"), ("server_close_ns", "<i8"),
    ("last_in_ns", "<i8"), ("bytes_in", "<u8"), ("last_out_ns", "<i8"), ("bytes_out", "<u8"),
    ("late_bytes_in", "<u8"), ("blocked_since_ns", "<i8"),
    ("socket_buffered_bytes", "<u8"), ("flow_buffered_bytes", "<u8"),
    ("requests_served", "<u4"), ("streams_open", "<u2"), ("protocol", "u1"), ("close_reason", "u1"),
    ("goaway_code", "<i4"), ("peer_port", "<u2"),
    ("peer", "S48"), ("forwarded", "S64"),
    ("req_slot", "<i4", (_R,)), ("req_generation", "<u4", (_R,)), ("req_phase", "u1", (_R,)),
    ("req_headers_ns", "<i8", (_R,)), ("req_since_ns", "<i8", (_R,)), ("req_id", "S40", (_R,)),
], align=True)
FLAG_DTYPE = np.dtype([("conn_id", "<u8"), ("reasons", "<u4")], align=True)


def segment_bytes(num_live: int, num_closed: int) -> int:
    return ROWS_OFFSET + (num_live + num_closed) * ROW_DTYPE.itemsize + num_live * FLAG_DTYPE.itemsize


def _text(value: str, limit: int) -> bytes:
    return value.encode("utf-8", "replace")[:limit]


class ConnectionLedger(_shm.ShmSegment):
    """The ledger segment. Writer methods (the API process): ``open``, ``note_*``, ``request_*``, ``close_connection``.
    Reader methods (anyone): ``live_rows``, ``closed_rows``, ``counters``. Monitor methods: ``set_flags``,
    ``count_detection``. Row indices returned by ``open`` are the writer's handles (``-1`` = not recorded)."""

    MAGIC = MAGIC
    VERSION = VERSION
    KIND = "connection ledger"

    def __init__(self) -> None:  # use create() / attach()
        super().__init__()
        self.rows = self.closed_ring = self.flags = None
        self.num_live = self.num_closed = 0
        self._free: list[int] = []
        self._counters = self.closes = self.detections = None

    @classmethod
    def create(cls, name: str, num_live: int, num_closed: int) -> "ConnectionLedger":
        """Create (O_CREX, mode 0600) and own an empty ledger of ``num_live`` + ``num_closed`` rows.

        Raises ValueError if ``num_live`` < 1 or ``num_closed`` < 1; FileExistsError if ``name`` exists."""
        if num_live < 1 or num_closed < 1:
            raise ValueError(f"a connection ledger needs >= 1 live and closed rows (got {num_live}, {num_closed})")

        def init(mm) -> None:
            HEADER.pack_into(mm, 0, b"\0\0\0\0", VERSION, num_live, num_closed, ROW_DTYPE.itemsize)

        return cls._create(name, segment_bytes(num_live, num_closed), init)

    def _check_layout(self, name: str, mm) -> None:
        _, _, live, closed, row_bytes = HEADER.unpack_from(mm, 0)
        if row_bytes != ROW_DTYPE.itemsize or len(mm) < segment_bytes(live, closed):
            raise ValueError(f"connection ledger {name!r} has {row_bytes} B rows; this code expects "
                             f"{ROW_DTYPE.itemsize} B")

    def _setup(self, mm) -> None:
        _, _, self.num_live, self.num_closed, _ = HEADER.unpack_from(mm, 0)
        self._counters = _shm.shm_array(mm, "<u8", 3, COUNTERS_OFFSET)
        self.closes = _shm.shm_array(mm, "<u8", len(CLOSE_REASONS), CLOSES_OFFSET)
        self.detections = _shm.shm_array(mm, "<u8", len(DETECTIONS), DETECTIONS_OFFSET)
        self.rows = _shm.shm_array(mm, ROW_DTYPE, self.num_live, ROWS_OFFSET)
        self.closed_ring = _shm.shm_array(mm, ROW_DTYPE, self.num_closed,
                                          ROWS_OFFSET + self.num_live * ROW_DTYPE.itemsize)
        self.flags = _shm.shm_array(mm, FLAG_DTYPE, self.num_live,
                                    ROWS_OFFSET + (self.num_live + self.num_closed) * ROW_DTYPE.itemsize)
        # the writer's own bookkeeping (only meaningful in the one writing process)
        self._free = [i for i in range(self.num_live - 1, -1, -1) if int(self.rows["conn_id"][i]) == 0]
        self._seq = self.rows["seq"]
        self._last_out, self._bytes_out = self.rows["last_out_ns"], self.rows["bytes_out"]
        self._sock_buffered = self.rows["socket_buffered_bytes"]

    def _teardown(self) -> None:
        self.rows = self.closed_ring = self.flags = self._seq = None
        self._last_out = self._bytes_out = self._sock_buffered = None
        self._counters = self.closes = self.detections = None

    # ---- writer (the API process) -----------------------------------------------------------------------

    def _begin(self, i: int) -> None:
        self._seq[i] += 1

    _end = _begin

    def open(self, peer: str, port: int, now_ns: int) -> int:
        """Record a new connection; returns its row (the writer's handle), or -1 if every live row is taken
        (``dropped`` counts those)."""
        if not self._free:
            self._counters[2] += 1
            return -1
        i = self._free.pop()
        self._counters[1] += 1
        self._begin(i)
        seq = int(self._seq[i])
        self.rows[i] = np.zeros((), ROW_DTYPE)
        self._seq[i] = seq
        row = self.rows[i]
        row["conn_id"] = self._counters[1]
        row["opened_ns"] = row["last_in_ns"] = now_ns
        row["goaway_code"] = -1
        row["peer"] = _text(peer, 48)
        row["peer_port"] = port
        row["req_slot"] = -1
        self._end(i)
        return i

    def note_in(self, i: int, nbytes: int, now_ns: int, late: bool = False) -> None:
        """Bytes received (``late``: after the server began closing)."""
        self._begin(i)
        row = self.rows[i]
        row["last_in_ns"] = now_ns
        row["bytes_in"] += nbytes
        if late:
            row["late_bytes_in"] += nbytes
        self._end(i)

    def note_out(self, i: int, nbytes: int, buffered_bytes: int, now_ns: int) -> None:
        """Bytes handed to the transport; ``buffered_bytes``: its write buffer after that. (The hot path: one call
        per socket write, through per-field views.)"""
        seq = self._seq
        seq[i] += 1
        self._last_out[i] = now_ns
        self._bytes_out[i] += nbytes
        self._sock_buffered[i] = buffered_bytes
        seq[i] += 1

    def note_blocked(self, i: int, since_ns: int, socket_bytes: int = -1, flow_bytes: int = -1) -> None:
        """A write waits (``since_ns``) or no longer does (0); the buffered byte counts when given (>= 0)."""
        self._begin(i)
        row = self.rows[i]
        row["blocked_since_ns"] = since_ns
        if socket_bytes >= 0:
            row["socket_buffered_bytes"] = socket_bytes
        if flow_bytes >= 0:
            row["flow_buffered_bytes"] = flow_bytes
        self._end(i)

    def note_protocol(self, i: int, protocol: str, forwarded: str = "") -> None:
        """The connection's protocol (a PROTOCOLS name) and, if none is recorded yet, a forwarded-for value."""
        self._begin(i)
        row = self.rows[i]
        row["protocol"] = PROTOCOLS.index(protocol)
        if forwarded and not row["forwarded"]:
            row["forwarded"] = _text(forwarded, 64)
        self._end(i)

    def note_server_close(self, i: int, now_ns: int, reason: str = "", goaway_code: int = -1) -> None:
        """The server began closing (the first call sets the time; ``reason`` a CLOSE_REASONS name, kept if set)."""
        self._begin(i)
        row = self.rows[i]
        if not row["server_close_ns"]:
            row["server_close_ns"] = now_ns
        if reason and not row["close_reason"]:
            row["close_reason"] = CLOSE_REASONS.index(reason)
        if goaway_code >= 0:
            row["goaway_code"] = goaway_code
        self._end(i)

    def request_start(self, i: int, request_id: str, now_ns: int) -> int:
        """A request's headers arrived; returns its entry (0..R-1) or -1 when R are in progress already (it
        still counts in ``streams_open``)."""
        self._begin(i)
        row = self.rows[i]
        row["streams_open"] += 1
        free = np.flatnonzero(row["req_phase"] == 0)
        j = int(free[0]) if free.size else -1
        if j >= 0:
            row["req_phase"][j] = 1
            row["req_headers_ns"][j] = row["req_since_ns"][j] = now_ns
            row["req_slot"][j] = -1
            row["req_generation"][j] = 0
            row["req_id"][j] = _text(request_id, 40)
        self._end(i)
        return j

    def request_engine(self, i: int, j: int, slot: int, generation: int, request_id: str, now_ns: int) -> None:
        """Entry ``j`` was admitted: it waits on the engine's state-table row (``slot``, ``generation``)."""
        self._begin(i)
        row = self.rows[i]
        row["req_phase"][j] = 2
        row["req_since_ns"][j] = now_ns
        row["req_slot"][j] = slot
        row["req_generation"][j] = generation
        if request_id:
            row["req_id"][j] = _text(request_id, 40)
        self._end(i)

    def request_rewait(self, i: int, j: int, slot: int, generation: int, request_id: str) -> None:
        """Entry ``j`` now waits on another engine row (the first one it named ended before its response did: one
        of several choices or prompts); its phase and times stay."""
        self._begin(i)
        row = self.rows[i]
        row["req_slot"][j] = slot
        row["req_generation"][j] = generation
        if request_id:
            row["req_id"][j] = _text(request_id, 40)
        self._end(i)

    def request_responding(self, i: int, j: int, now_ns: int) -> None:
        """Entry ``j``'s response started."""
        self._begin(i)
        row = self.rows[i]
        row["req_phase"][j] = 3
        row["req_since_ns"][j] = now_ns
        self._end(i)

    def request_end(self, i: int, j: int, served: bool) -> None:
        """A request in progress ended (entry ``j``, or -1 if it had none); ``served``: its response ended."""
        self._begin(i)
        row = self.rows[i]
        row["streams_open"] = max(int(row["streams_open"]) - 1, 0)
        if served:
            row["requests_served"] += 1
        if j >= 0:
            row["req_phase"][j] = 0
            row["req_slot"][j] = -1
        self._end(i)

    def close_connection(self, i: int, reason: str, now_ns: int, goaway_code: int = -1) -> None:
        """The connection is gone: its row goes to the closed ring with ``reason`` (a CLOSE_REASONS name; one
        set earlier by ``note_server_close`` wins) and the live row is freed."""
        self._begin(i)
        row = self.rows[i]
        if not row["close_reason"]:
            row["close_reason"] = CLOSE_REASONS.index(reason)
        if goaway_code >= 0 and row["goaway_code"] < 0:
            row["goaway_code"] = goaway_code
        row["closed_ns"] = now_ns
        row["streams_open"] = 0
        row["blocked_since_ns"] = 0
        self.closes[int(row["close_reason"])] += 1
        k = int(self._counters[0] % self.num_closed)
        cseq = self.closed_ring["seq"]
        cseq[k] += 1
        seq = int(cseq[k])
        self.closed_ring[k] = row
        self.closed_ring["seq"][k] = seq + 1
        self._counters[0] += 1
        row["conn_id"] = 0
        row["req_phase"] = 0
        self._end(i)
        self._free.append(i)

    def close_orphans(self, now_ns: int) -> int:
        """Close, with reason ``error``, every live row an earlier writer left (an API process that died: its
        connections died with it, yet their rows would stay taken, shown by tools/inspect and named by the
        monitor forever), and end any write it was killed in the middle of (an odd sequence number, live row or
        closed ring: read as torn for good otherwise). Call in a writer process before its first ``open`` (on a
        fresh ledger it does nothing). Returns how many rows it closed."""
        for seq in (self._seq, self.closed_ring["seq"]):
            odd = np.flatnonzero(seq & 1)
            seq[odd] += 1
        orphans = np.flatnonzero(self.rows["conn_id"] != 0).tolist()
        for i in orphans:
            self.close_connection(i, "error", now_ns)
        return len(orphans)

    # ---- readers --------------------------------------------------------------------------------------

    @staticmethod
    def _consistent(rows: np.ndarray, patience_s: float = 0.05) -> np.ndarray:
        """A copy of ``rows`` (shm) in which each row was read whole; a row still being written after
        ``patience_s`` of retries (its writer stopped, or descheduled, mid-write) is returned as last read,
        flagged in the ``torn`` field."""
        out = np.zeros(len(rows), dtype=LEDGER_VIEW_DTYPE)
        copy = rows.copy()
        again = np.flatnonzero((copy["seq"] != rows["seq"]) | (copy["seq"] & 1).astype(bool))
        for i in again.tolist():
            deadline = time.monotonic() + patience_s
            tries = 0
            while True:
                before = int(rows["seq"][i])
                copy[i] = rows[i]
                if before == int(rows["seq"][i]) and not before & 1:
                    break
                tries += 1
                if tries % 64 == 0:
                    if time.monotonic() > deadline:
                        out["torn"][i] = 1
                        break
                    time.sleep(0)   # let a descheduled writer finish its row
        for name in ROW_DTYPE.names:
            out[name] = copy[name]
        return out

    def live_rows(self) -> np.ndarray:
        """Consistent copies of the rows of open connections (``LEDGER_VIEW_DTYPE``: ROW_DTYPE plus ``index``,
        ``torn`` and the monitor's ``flag_reasons``)."""
        self._require_open()
        out = self._consistent(self.rows)
        out["index"] = np.arange(self.num_live)
        flags = self.flags.copy()
        out["flag_reasons"] = np.where(flags["conn_id"] == out["conn_id"], flags["reasons"], 0)
        return out[out["conn_id"] != 0]

    def closed_rows(self) -> np.ndarray:
        """Consistent copies of the closed ring's rows, newest first."""
        self._require_open()
        total = int(self._counters[0])
        n = min(total, self.num_closed)
        order = [(total - 1 - k) % self.num_closed for k in range(n)]
        out = self._consistent(self.closed_ring)[order] if n else np.zeros(0, LEDGER_VIEW_DTYPE)
        out["index"] = -1
        return out

    def counters(self) -> dict:
        """``closed_total``, ``last_conn_id`` (the header's next_conn_id: the last id given), ``dropped``,
        ``closes`` {reason: n}, ``detections`` {reason: n}."""
        self._require_open()
        c = self._counters.tolist()
        return {"closed_total": c[0], "last_conn_id": c[1], "dropped": c[2],
                "closes": dict(zip(CLOSE_REASONS[1:], self.closes.tolist()[1:])),
                "detections": dict(zip(DETECTIONS, self.detections.tolist()))}

    # ---- the monitor ------------------------------------------------------------------------------------

    def set_flags(self, index: int, conn_id: int, reasons: int) -> None:
        """The detections standing on live row ``index`` (connection ``conn_id``), a DETECTIONS bit mask."""
        self.flags["reasons"][index] = 0
        self.flags["conn_id"][index] = conn_id
        self.flags["reasons"][index] = reasons

    def count_detection(self, reason: str) -> None:
        self.detections[DETECTIONS.index(reason)] += 1

    def _repr_fields(self) -> str:
        return f", num_live={self.num_live}, num_closed={self.num_closed}, writer_pid={os.getpid()}"


LEDGER_VIEW_DTYPE = np.dtype(ROW_DTYPE.descr + [("index", "<i4"), ("torn", "u1"), ("flag_reasons", "<u4")])


def row_state(row, now_ns: int) -> str:
    """What a (copied) ledger row is doing: ``closed``, ``write-blocked``, ``responding``, ``engine`` (waiting on the
    engine), ``reading`` (a request's headers or body) or ``idle``."""
    if row["closed_ns"]:
        return "closed"
    if row["blocked_since_ns"]:
        return "write-blocked"
    phases = [int(p) for p in row["req_phase"]]
    for phase in (3, 2, 1):
        if phase in phases:
            return PHASES[phase]
    return "reading" if row["streams_open"] else "idle"
