"""The API process's conservation checks (issue 42 item 4): every ``monitor_tick_s``, from its heartbeat loop.

| name | what |
|---|---|
| `incident_writer` | the API process's incident bundle writer (actors/incidents.py), or None without ``incident_dir`` |
| `engine_url` | the engine's HTTP root, for an incident's replay recipe |
| `ConservationChecks` | reads its handles, the state table and the connection ledger; alarms on what persists |

Plain decisions: actors/conservation.py (ids by row life, per-connection counts, ``Persisting``). A finding seen on
two consecutive checks is an alarm: an ERROR line ``conservation: ...`` naming the request id and the layer (or the
connection, its peer and ids), ``pdserve_conservation_violations_total{kind}`` (the status record's
``conservation``), and an incident bundle of kind ``conservation``. Each finding is reported once while it stands.
The API's loop runs on the event loop that admits and releases, so its handles and the rows it allocates are never
read mid-change; the table's other writers do not allocate or release live rows (the monitor releases only final
rows no handle holds).
"""
from __future__ import annotations

import logging
import time

from actors.conservation import Persisting, find_id_violations, find_inflight_mismatches, ledger_waits
from ipc.engine_status import CONSERVATION_KINDS

log = logging.getLogger("pdserve.conservation")


def incident_writer(layout, config):
    """An IncidentWriter (with a LogTail on the root logger) for this process, or None when ``incident_dir`` is
    empty. The caller closes it."""
    if not config.incident_dir:
        return None
    from actors.incidents import IncidentWriter, LogTail

    tail = LogTail()
    logging.getLogger().addHandler(tail)
    return IncidentWriter(layout.engine_id, config.incident_dir, config.incident_min_interval_s,
                          config.incident_dir_max_bytes, tail)


def engine_url(client) -> str:
    """The engine's HTTP root (``client``: the EngineClient), for an incident's replay command."""
    return f"http://{client.config.host}:{client.layout.http_port}"


class ConservationChecks:
    """``client``: the EngineClient (handles, table, status record); ``ledger``: the ConnectionLedger this process
    writes, or None; ``incidents``: an IncidentWriter or None. ``check()`` is cheap to call often: it runs once per
    ``monitor_tick_s``."""

    def __init__(self, client, ledger=None, incidents=None):
        self.client, self.ledger, self.incidents, self.base_url = client, ledger, incidents, engine_url(client)
        self.since_ns = time.monotonic_ns()   # rows allocated before: a predecessor API's (the monitor's)
        self.tick_ns = int(client.config.monitor_tick_s * 1e9)
        self.next_ns = 0
        self.ids = Persisting(2)
        self.inflight = Persisting(2)

    def check(self, now_ns: int | None = None) -> None:
        """Run the checks if a tick passed since the last run (``now_ns``: monotonic ns). Never raises: a check's
        own bug is logged and must not stop the heartbeat loop calling it."""
        now_ns = time.monotonic_ns() if now_ns is None else now_ns
        if now_ns < self.next_ns:
            return
        self.next_ns = now_ns + self.tick_ns
        try:
            self._check()
        except Exception:  # noqa: BLE001 - logged; the next tick tries again
            log.exception("conservation check failed")

    def _check(self) -> None:
        from api.http_edges import in_flight_by_connection

        handles = [(h.slot, h.generation, h.request.request_id) for h in self.client.handles.values()]
        rows = self.client.table.snapshot()
        live = self.ledger.live_rows() if self.ledger is not None else None
        found = find_id_violations(handles, rows, self.since_ns, ledger_waits(live) if live is not None else ())
        for f in self.ids.update({(f.layer, f.request_id, f.lives): f for f in found}):
            self.alarm(f.kind, f"{f.message()} [layer {f.layer}]", [f.request_id])
        if live is not None:
            mismatches = find_inflight_mismatches(in_flight_by_connection(), live)
            for m in self.inflight.update({(m.conn_id, m.ledger - m.api): m for m in mismatches}):
                self.alarm("inflight", m.message(), list(dict.fromkeys(m.api_ids + m.ledger_ids)))

    def alarm(self, kind: str, detail: str, request_ids: list[str]) -> None:
        log.error("conservation: %s", detail)
        self.client.status.rec["conservation"][CONSERVATION_KINDS.index(kind)] += 1
        if self.incidents is not None:
            from actors.incidents import Incident

            self.incidents.report(Incident("conservation", detail, [r for r in request_ids if r],
                                           base_url=self.base_url))
