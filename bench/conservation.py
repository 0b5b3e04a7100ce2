"""The API's conservation checks per tick (api/conservation.py), in one process: real shm, no engine.

A state table's rows (a numpy array of its ROW_DTYPE, copied per tick as ``StateTable.snapshot`` copies its shm)
with 256 live rows, each with its API handle, and a real shm connection ledger with 256 open connections, each
with one HTTP request waiting on one of those rows (a loaded engine at ``max_queued_requests`` 256); times
``ConservationChecks``' work per tick (the table snapshot, the ledger read, both comparisons; nothing to report) and
each plain check alone; prints medians and p90 over 200 ticks.

    python -m bench.conservation
"""
from __future__ import annotations

import statistics
import time
import types

import numpy as np

LIVE = 256


def timed(fn, reps: int = 200) -> tuple[float, float]:
    """(median, p90) of ``fn``'s wall time in us."""
    costs = []
    for _ in range(reps):
        start = time.perf_counter_ns()
        fn()
        costs.append(time.perf_counter_ns() - start)
    return statistics.median(costs) / 1e3, float(np.percentile(costs, 90)) / 1e3


def main() -> int:
    from actors.conservation import find_id_violations, find_inflight_mismatches, ledger_waits
    from api import http_edges
    from api.conservation import ConservationChecks
    from ipc import naming
    from ipc.ledger import ConnectionLedger
    from ipc.state_table import ROW_DTYPE, RequestState

    eid = naming.new_engine_id()
    table_rows = np.zeros(2 * LIVE + 16, dtype=ROW_DTYPE)   # the table a 256-request engine sizes
    table = types.SimpleNamespace(snapshot=table_rows.copy)
    ledger = ConnectionLedger.create(f"/pdserve_{eid}_conns", LIVE, 64)
    try:
        handles = {}
        for i in range(LIVE):
            rid = f"chatcmpl-{i:08x}"
            slot, generation = 2 * i, 1
            for field, value in (("state", int(RequestState.DECODING)), ("generation", generation),
                                 ("request_id", rid.encode()), ("created_ns", time.monotonic_ns())):
                table_rows[field][slot] = value
            handles[(slot, generation)] = types.SimpleNamespace(slot=slot, generation=generation,
                                                                request=types.SimpleNamespace(request_id=rid))
            index = ledger.open("127.0.0.1", 40000 + i, time.monotonic_ns())
            conn = http_edges._LedgerConn(ledger, index, ("127.0.0.1", 40000 + i))
            http_edges._BY_PEER[conn.key] = conn
            entry = http_edges._RequestEntry(conn, ledger.request_start(index, rid, time.monotonic_ns()), rid)
            entry.engine(slot, generation, rid)
        config = types.SimpleNamespace(monitor_tick_s=0.5, host="127.0.0.1")
        client = types.SimpleNamespace(handles=handles, table=table, config=config,
                                       layout=types.SimpleNamespace(http_port=0))
        checks = ConservationChecks(client, ledger)
        checks.since_ns = 0
        rows, live = table.snapshot(), ledger.live_rows()
        lives = [(h.slot, h.generation, h.request.request_id) for h in handles.values()]
        api = http_edges.in_flight_by_connection()
        assert not find_id_violations(lives, rows, 0, ledger_waits(live)) and not find_inflight_mismatches(api, live)
        for name, fn in (("ConservationChecks, one tick (reads included)", checks._check),
                         ("  the table snapshot's copy", table.snapshot), ("  ledger.live_rows()", ledger.live_rows),
                         ("  find_id_violations (with ledger_waits)",
                          lambda: find_id_violations(lives, rows, 0, ledger_waits(live))),
                         ("  find_inflight_mismatches", lambda: find_inflight_mismatches(api, live))):
            p50, p90 = timed(fn)
            print(f"{name:48s} p50 {p50:7.0f} us   p90 {p90:7.0f} us")
    finally:
        http_edges._BY_PEER.clear()
        ledger.close()
        ledger.unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
