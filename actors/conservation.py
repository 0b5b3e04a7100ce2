"""Conservation by identity (issue 42 item 4), as plain synchronous code over snapshots (no I/O, no clocks).

| name | what |
|---|---|
| ``IdFinding`` | a row life held twice in a layer, or held by the state table with no API handle above it |
| ``find_id_violations`` | the API's handles, the table's live rows and the ledger's waits, compared by row life |
| ``InFlightFinding`` | a connection whose ledger count of requests in progress is not the API's |
| ``find_inflight_mismatches`` | per connection, the API's requests in progress against the ledger row's count |
| ``Persisting`` | reports a finding once it was seen on ``checks`` consecutive checks, and once only |

A request's identity in the engine is its row life, ``(slot, generation)``; its id (``X-Request-Id``) is not unique
(a client may reuse one; the ``n`` choices of one request share it), so ids are compared as counts: an id whose
live rows outnumber the API's handles for it is held twice in the table. The KV-block part of conservation is
``actors/watchdog.BlockConservation`` (in the monitor); these run in the API process (api/conservation.py), which
alone knows its handles and its connections' requests.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np

from ipc.lifecycle import RequestState as S

ID_BYTES = 40            # ipc/state_table.py: request_id S40
ENGINE_PHASES = (2, 3)   # ipc/ledger.py PHASES: "engine", "responding" (an entry naming a row life)


@dataclass(frozen=True)
class IdFinding:
    """``kind``: "id_twice" (a row life held twice in ``layer``, or an id with more live rows than handles) or
    "id_orphan" (live rows of an id no API handle holds); ``layer``: "api", "table" or "connection";
    ``lives``: the row lives ``(slot, generation)`` at fault (the extra rows, the doubly held life)."""

    kind: str
    layer: str
    request_id: str
    lives: tuple[tuple[int, int], ...]
    handles: int = 0          # the API's handles for the id
    rows: int = 0             # the table's live rows with the id

    def message(self) -> str:
        lives = ", ".join(f"slot {s} gen {g}" for s, g in self.lives)
        if self.kind == "id_orphan":
            return (f"request {self.request_id} is live in the state table ({lives}) with no API handle "
                    f"(a row nobody answers; its timeline: tools/inspect --reconcile)")
        if self.layer == "table":
            return (f"request {self.request_id} is held twice in the state table: {self.rows} live rows, "
                    f"{self.handles} API handles (rows no handle holds: {lives})")
        return f"request {self.request_id} is held twice in the {self.layer} layer ({lives})"


def find_id_violations(handles, rows: np.ndarray, since_ns: int = 0, waits=()) -> list[IdFinding]:
    """Row lives held twice within a layer, or in the table with no handle above.

    Args:
        handles: ``(slot, generation, request_id)`` of each of the API's handles (one per admitted sequence).
        rows: a state-table snapshot (``ipc.state_table.ROW_DTYPE``); its rows not FREE, created at or after
            ``since_ns`` (monotonic ns: this API process's start; a predecessor's rows are the monitor's), are
            the table's holdings.
        waits: ``(conn_id, slot, generation)`` of each ledger entry waiting on or writing out a row life.
    Returns findings in the order api, table, connection. Cost: vectorized over the table; Python work only for
    the ids in disagreement.
    """
    out: list[IdFinding] = []
    held: dict[tuple[int, int], str] = {}
    for slot, generation, rid in handles:
        key = (int(slot), int(generation))
        if key in held:
            out.append(IdFinding("id_twice", "api", rid, (key,)))
        held[key] = rid
    live = np.flatnonzero((rows["state"] != int(S.FREE)) & (rows["created_ns"] >= since_ns))
    lives = (live.astype(np.int64) << 32) | rows["generation"][live].astype(np.int64)
    known = np.fromiter(((s << 32) | g for s, g in held), dtype=np.int64, count=len(held))
    unheld = live[~np.isin(lives, known)]
    if unheld.size:
        per_id: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for slot in unheld.tolist():
            rid = rows["request_id"][slot]
            per_id[rid.decode("ascii", "replace") if isinstance(rid, bytes) else str(rid)].append(
                (slot, int(rows["generation"][slot])))
        by_handle = Counter(rid[:ID_BYTES] for rid in held.values())   # the table keeps an id's first 40 bytes
        ids = rows["request_id"][live]
        for rid, extra in per_id.items():
            n_rows = int(np.count_nonzero(ids == rid.encode("ascii", "replace")))
            n_handles = by_handle.get(rid, 0)
            kind = "id_twice" if n_handles else "id_orphan"
            out.append(IdFinding(kind, "table", rid, tuple(extra), n_handles, n_rows))
    waits = np.asarray(waits, dtype=np.int64).reshape(-1, 3)
    if len(waits) > 1:
        keys = (waits[:, 1] << 32) | waits[:, 2]
        uniq, counts = np.unique(keys, return_counts=True)
        for key in uniq[counts > 1].tolist():   # two HTTP requests (on one connection or two) wait on one row life
            life = (key >> 32, key & 0xFFFFFFFF)
            out.append(IdFinding("id_twice", "connection", held.get(life, f"slot {life[0]} gen {life[1]}"), (life,)))
    return out


def ledger_waits(live: np.ndarray) -> np.ndarray:
    """``(conn_id, slot, generation)`` rows (int64, shape (N, 3)) of each entry of the ledger's live rows
    (``ConnectionLedger.live_rows()``) that waits on or writes out an engine row (phase engine or responding)."""
    phase, slot = live["req_phase"], live["req_slot"]
    r, j = np.nonzero(np.isin(phase, ENGINE_PHASES) & (slot >= 0))
    return np.stack([live["conn_id"][r].astype(np.int64), slot[r, j].astype(np.int64),
                     live["req_generation"][r, j].astype(np.int64)], axis=1)


@dataclass(frozen=True)
class InFlightFinding:
    """Connection ``conn_id`` (row ``index``, from ``peer``) has ``api`` requests in progress by the API's count
    (their ids ``api_ids``) and ``ledger`` by its ledger row's (``ledger_ids``: the ids its entries name)."""

    index: int
    conn_id: int
    peer: str
    api: int
    ledger: int
    api_ids: tuple[str, ...] = ()
    ledger_ids: tuple[str, ...] = ()

    def message(self) -> str:
        return (f"connection {self.conn_id} from {self.peer}: the API has {self.api} requests in progress on it "
                f"({', '.join(self.api_ids) or 'none'}), its ledger row counts {self.ledger} "
                f"({', '.join(self.ledger_ids) or 'no id'})")


def find_inflight_mismatches(api, live: np.ndarray) -> list[InFlightFinding]:
    """Connections whose ledger count of requests in progress (``streams_open``) is not the API's.

    Args:
        api: ``{row index: (conn_id, peer, [request ids in progress])}`` from the API's own connection objects.
        live: the ledger's live rows (``ConnectionLedger.live_rows()``).
    A connection the API knows and the ledger row names another connection (closed and reused meanwhile) is
    skipped; a ledger row the API has no connection for is the ledger's orphan (``close_orphans``), not judged.
    """
    out = []
    at = {i: k for k, i in enumerate(live["index"].tolist())}
    conn_ids, counts, torn = live["conn_id"].tolist(), live["streams_open"].tolist(), live["torn"].tolist()
    for index, (conn_id, peer, ids) in api.items():
        k = at.get(index)
        if k is None or conn_ids[k] != conn_id or torn[k] or counts[k] == len(ids):
            continue
        row = live[k]
        named = tuple(r.decode("ascii", "replace") for r, p in zip(row["req_id"], row["req_phase"]) if p)
        out.append(InFlightFinding(index, conn_id, peer, len(ids), counts[k], tuple(ids), named))
    return out


class Persisting:
    """Reports a finding seen on ``checks`` consecutive checks (a request starting or ending between two reads
    is seen once), once: again only after it was absent from a check. ``update(keys)``: ``{key: finding}`` of
    this check; returns the findings to report now."""

    def __init__(self, checks: int = 2):
        self.checks = checks
        self.seen: dict = {}          # key -> consecutive checks seen
        self.reported: set = set()

    def update(self, found: dict) -> list:
        self.seen = {k: self.seen.get(k, 0) + 1 for k in found}
        self.reported &= found.keys()
        due = [k for k, n in self.seen.items() if n >= self.checks and k not in self.reported]
        self.reported.update(due)
        return [found[k] for k in due]
