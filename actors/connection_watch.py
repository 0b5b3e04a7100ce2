"""The monitor's connection detectors, as plain synchronous code over ledger and state-table copies (no I/O, no
clocks of their own): what is wrong between the engine and the client (docs/architecture.md, "The connection
ledger").

``find_problems`` says which connections of a connection-ledger copy (ipc/ledger.py) show one of DETECTIONS:

- ``done_not_written``: a request's engine row is final (``state_since_ns``) ``stall_s`` ago, yet the HTTP request
  waiting on it is still in progress: the engine is done, the bytes are not out (a stopped or wedged API process,
  a response stuck behind a full socket);
- ``write_blocked``: a write on the connection has waited for the socket or for HTTP/2 flow control for
  ``stall_s`` (a client or proxy that does not read);
- ``no_response``: a request's headers arrived ``stall_s`` ago, no response has started, and the engine holds no
  live row for it (it never reached the engine, or the engine let go of it and nobody answered);
- ``wrote_after_close``: the client sent bytes after the server began closing the connection (a pool reusing a
  connection the server was retiring: its next request got a reset or a 502).

``ConnectionWatch`` turns the findings of successive ticks into the ones to log and count (each once, while it
stands) and the per-row flag masks the monitor writes for tools/inspect.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ipc.ledger import DETECTIONS, PHASES
from ipc.lifecycle import FINAL_STATES, LIVE_STATES

_FINAL = frozenset(int(s) for s in FINAL_STATES)
_LIVE = frozenset(int(s) for s in LIVE_STATES)
_RESPONDING = PHASES.index("responding")


@dataclass(frozen=True)
class Finding:
    """One detection on one connection. ``row``: its live ledger row (-1: a closed connection); ``age_s``: how long
    the condition has held (seconds); ``request_id``/``slot``: the request it is about ("" / -1: the connection)."""

    reason: str
    conn_id: int
    row: int
    peer: str
    request_id: str
    slot: int
    age_s: float
    requests: tuple = ()   # (slot, generation, request id) of each request it is about, for the flight recorder
    client_blocked: bool = False   # done_not_written: the connection's writes wait on the client meanwhile

    @property
    def key(self) -> tuple:
        return (self.reason, self.conn_id, self.request_id, self.slot)

    def message(self) -> str:
        where = f"connection {self.conn_id} ({self.peer})"
        request = f"request {self.request_id or '?'} (slot {self.slot}) on " if self.slot >= 0 or self.request_id \
            else ""
        if self.reason == "done_not_written":
            why = (": its writes wait on the client, see write_blocked" if self.client_blocked
                   else " (is the API process stopped or wedged?)")
            return (f"http done_not_written: {request}{where}: the engine finished it {self.age_s:.1f} s ago and "
                    f"the response is not written{why}")
        if self.reason == "write_blocked":
            return (f"http write_blocked: {where}{' serving ' + self.request_id if self.request_id else ''}: a write "
                    f"has waited {self.age_s:.1f} s for the client (socket buffer full or HTTP/2 window 0): the "
                    f"client or a proxy is not reading")
        if self.reason == "no_response":
            return (f"http no_response: {request}{where}: headers received {self.age_s:.1f} s ago, no response "
                    f"started and the engine holds no live row for it")
        return (f"http wrote_after_close: {where}: the client sent bytes after the server began closing the "
                f"connection (a pool reused a connection the server was retiring; raise keep_alive_timeout_s above "
                f"the client's pool idle timeout)")


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, (bytes, np.bytes_)) else str(value)


def find_problems(live: np.ndarray, closed: np.ndarray, engine_rows: dict[int, tuple[int, int, int]], now_ns: int,
                  stall_s: float) -> list[Finding]:
    """The detections standing now.

    Args:
        live, closed: ``ConnectionLedger.live_rows()`` / ``closed_rows()`` copies.
        engine_rows: ``{slot: (state, generation, state_since_ns)}`` read consistently from the state table, for
            (at least) every slot a live ledger entry names.
        now_ns: CLOCK_MONOTONIC now, read after both copies.
        stall_s: the bound (config ``http_stall_s``).
    """
    limit_ns = int(stall_s * 1e9)
    out: list[Finding] = []
    for row in live:
        conn_id, index, peer = int(row["conn_id"]), int(row["index"]), f"{_text(row['peer'])}:{int(row['peer_port'])}"
        blocked = int(row["blocked_since_ns"])
        if blocked and now_ns - blocked >= limit_ns:
            responding = [(int(s), int(g), _text(r)) for s, g, r, p in zip(row["req_slot"], row["req_generation"],
                                                                           row["req_id"], row["req_phase"])
                          if p == _RESPONDING]
            out.append(Finding("write_blocked", conn_id, index, peer, ",".join(r for _, _, r in responding), -1,
                               (now_ns - blocked) / 1e9, tuple(responding)))
        for j in np.flatnonzero(row["req_phase"]).tolist():
            slot, generation = int(row["req_slot"][j]), int(row["req_generation"][j])
            rid = _text(row["req_id"][j])
            state, row_generation, since_ns = engine_rows.get(slot, (-1, -1, 0)) if slot >= 0 else (-1, -1, 0)
            mine = row_generation == generation
            if mine and state in _FINAL and now_ns - since_ns >= limit_ns:
                out.append(Finding("done_not_written", conn_id, index, peer, rid, slot, (now_ns - since_ns) / 1e9,
                                   ((slot, generation, rid),), client_blocked=bool(blocked)))
                continue
            headers_ns = int(row["req_headers_ns"][j])
            waiting = int(row["req_phase"][j]) != _RESPONDING
            if waiting and not (mine and state in _LIVE | _FINAL) and now_ns - headers_ns >= limit_ns:
                out.append(Finding("no_response", conn_id, index, peer, rid, slot, (now_ns - headers_ns) / 1e9,
                                   ((slot, generation, rid),)))
    for row in (*live, *closed):
        if int(row["late_bytes_in"]):
            close_ns = int(row["server_close_ns"])
            out.append(Finding("wrote_after_close", int(row["conn_id"]), int(row["index"]),
                               f"{_text(row['peer'])}:{int(row['peer_port'])}", "", -1,
                               (now_ns - close_ns) / 1e9 if close_ns else 0.0))
    return out


def held_by_connections(live: np.ndarray) -> frozenset[tuple[int, int]]:
    """``(slot, generation)`` of every state-table row a request in progress on a live connection of
    ``live`` (``ConnectionLedger.live_rows()``) waits on or is still writing out: rows the API will release when
    that response ends, however long a slow client takes (the monitor does not reclaim them while the API is
    alive)."""
    held = set()
    for row in live:
        for j in np.flatnonzero(row["req_phase"]).tolist():
            if int(row["req_slot"][j]) >= 0:
                held.add((int(row["req_slot"][j]), int(row["req_generation"][j])))
    return frozenset(held)


class ConnectionWatch:
    """Which findings are new (log and count them once) and which flags each live ledger row should carry."""

    def __init__(self) -> None:
        self.standing: set[tuple] = set()

    def update(self, findings: list[Finding]) -> tuple[list[Finding], dict[int, int]]:
        """Returns (findings not standing on the previous call, ``{live row: DETECTIONS bit mask}``). A finding
        that stops standing and comes back later (a new incident) is new again."""
        keys = {f.key for f in findings}
        new = [f for f in findings if f.key not in self.standing]
        self.standing = keys
        masks: dict[int, int] = {}
        for f in findings:
            if f.row >= 0:
                masks[f.row] = masks.get(f.row, 0) | (1 << DETECTIONS.index(f.reason))
        return new, masks
