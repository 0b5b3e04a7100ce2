"""tools/inspect --connections (tools/connections_view.py) over a real ledger segment, read through a read-only
attach as the tool does: worst first, every documented field, the closed ring."""
from __future__ import annotations

import orjson
from rich.console import Console

from ipc.ledger import DETECTIONS, ConnectionLedger
from tools import connections_view

S_NS = 1_000_000_000


def test_connections_are_listed_worst_first_with_their_requests_and_the_closed_ones_say_who_closed(engine_id):
    from ipc import naming

    ledger = ConnectionLedger.create(naming.segment_name(engine_id, "conns"), num_live=8, num_closed=4)
    reader = ConnectionLedger.attach(ledger.name, readonly=True)
    try:
        idle = ledger.open("10.0.0.1", 1001, 1 * S_NS)
        ledger.note_protocol(idle, "h1")
        blocked = ledger.open("10.0.0.2", 1002, 1 * S_NS)
        ledger.note_protocol(blocked, "h2", forwarded="198.51.100.7")
        j = ledger.request_start(blocked, "chatcmpl-blocked", 2 * S_NS)
        ledger.request_engine(blocked, j, 4, 1, "chatcmpl-blocked", 2 * S_NS)
        ledger.request_responding(blocked, j, 3 * S_NS)
        ledger.note_blocked(blocked, 5 * S_NS, socket_bytes=1000, flow_bytes=65535)
        flagged = ledger.open("10.0.0.3", 1003, 1 * S_NS)
        k = ledger.request_start(flagged, "cmpl-done", 2 * S_NS)
        ledger.request_engine(flagged, k, 9, 2, "cmpl-done", 2 * S_NS)
        ledger.set_flags(flagged, 3, 1 << DETECTIONS.index("done_not_written"))
        gone = ledger.open("10.0.0.4", 1004, 1 * S_NS)
        ledger.note_server_close(gone, 6 * S_NS, "idle_close", goaway_code=0)
        ledger.close_connection(gone, "client_fin", 7 * S_NS)

        snap = connections_view.snapshot(reader, now_ns=20 * S_NS)
        assert [c["conn_id"] for c in snap["connections"]] == [3, 2, 1]   # flagged, write-blocked, idle
        first, second, third = snap["connections"]
        assert first["problems"] == ["done_not_written"] and first["state"] == "engine"
        assert first["requests"] == [{"request_id": "cmpl-done", "slot": 9, "phase": "engine", "for_s": 18.0,
                                      "headers_ago_s": 18.0}]
        assert second["state"] == "write-blocked" and second["blocked_for_s"] == 15.0
        assert (second["protocol"], second["forwarded"], second["flow_buffered_bytes"]) == ("h2", "198.51.100.7",
                                                                                            65535)
        assert third["state"] == "idle" and third["peer"] == "10.0.0.1:1001"
        (closed,) = snap["closed"]
        assert (closed["close_reason"], closed["goaway_code"], closed["closed_ago_s"]) == ("idle_close", 0, 13.0)
        assert snap["counters"]["closes"]["idle_close"] == 1
        orjson.dumps(snap)   # the --json output

        console = Console(record=True, width=250)
        console.print(connections_view.render(snap))
        text = console.export_text()
        assert text.index("cmpl-done") < text.index("chatcmpl-blocked") < text.index("10.0.0.1:1001")
        assert "write-blocked" in text and "done_not_written" in text and "idle_close" in text
    finally:
        reader.close()
        ledger.close()
        ledger.unlink()
