"""tools/inspect --connections: the connection ledger (ipc/ledger.py) as plain data and as a table, worst first.

``snapshot(ledger)`` reads the ledger (a read-only attach does: it never needs the API process) into JSON-ready
dicts; ``render(snapshot)`` draws them. Schema (``--connections --json``; times in seconds)::

    {"connections": [{"conn_id", "protocol", "peer", "forwarded", "state", "problems": [DETECTIONS names the
                      monitor flags], "open_for_s", "requests_served", "streams_open", "last_in_ago_s",
                      "last_out_ago_s", "bytes_in", "bytes_out", "blocked_for_s": float|null,
                      "socket_buffered_bytes", "flow_buffered_bytes", "torn": bool,
                      "requests": [{"request_id", "slot", "phase", "for_s", "headers_ago_s"}]}],
     "closed": [{"conn_id", "protocol", "peer", "forwarded", "close_reason", "goaway_code": int|null,
                 "closed_ago_s", "open_for_s", "requests_served", "bytes_in", "bytes_out", "late_bytes_in"}],
     "counters": {"closed_total", "last_conn_id", "dropped", "closes": {reason: n}, "detections": {reason: n}}}

Order: connections with a problem the monitor flagged first, then write-blocked ones, then the rest by how long
their oldest request has waited; closed connections newest first.
"""
from __future__ import annotations

import time
from typing import Any

from ipc.ledger import CLOSE_REASONS, DETECTIONS, PHASES, PROTOCOLS, row_state

_STATE_RANK = {"write-blocked": 0, "engine": 1, "reading": 2, "responding": 3, "idle": 4}


def _text(value) -> str:
    return bytes(value).decode("utf-8", "replace")


def _ago(now_ns: int, then_ns: int) -> float | None:
    return None if not then_ns else round((now_ns - int(then_ns)) / 1e9, 3)


def _live(row, now_ns: int) -> dict[str, Any]:
    requests = [{"request_id": _text(row["req_id"][j]), "slot": int(row["req_slot"][j]),
                 "phase": PHASES[int(row["req_phase"][j])], "for_s": _ago(now_ns, row["req_since_ns"][j]),
                 "headers_ago_s": _ago(now_ns, row["req_headers_ns"][j])}
                for j in range(len(row["req_phase"])) if row["req_phase"][j]]
    return {"conn_id": int(row["conn_id"]), "protocol": PROTOCOLS[int(row["protocol"])],
            "peer": f"{_text(row['peer'])}:{int(row['peer_port'])}", "forwarded": _text(row["forwarded"]),
            "state": row_state(row, now_ns),
            "problems": [d for i, d in enumerate(DETECTIONS) if int(row["flag_reasons"]) >> i & 1],
            "open_for_s": _ago(now_ns, row["opened_ns"]), "requests_served": int(row["requests_served"]),
            "streams_open": int(row["streams_open"]), "last_in_ago_s": _ago(now_ns, row["last_in_ns"]),
            "last_out_ago_s": _ago(now_ns, row["last_out_ns"]), "bytes_in": int(row["bytes_in"]),
            "bytes_out": int(row["bytes_out"]), "blocked_for_s": _ago(now_ns, row["blocked_since_ns"]),
            "socket_buffered_bytes": int(row["socket_buffered_bytes"]),
            "flow_buffered_bytes": int(row["flow_buffered_bytes"]), "torn": bool(row["torn"]), "requests": requests}


def _closed(row, now_ns: int) -> dict[str, Any]:
    goaway = int(row["goaway_code"])
    return {"conn_id": int(row["conn_id"]), "protocol": PROTOCOLS[int(row["protocol"])],
            "peer": f"{_text(row['peer'])}:{int(row['peer_port'])}", "forwarded": _text(row["forwarded"]),
            "close_reason": CLOSE_REASONS[int(row["close_reason"])], "goaway_code": goaway if goaway >= 0 else None,
            "closed_ago_s": _ago(now_ns, row["closed_ns"]),
            "open_for_s": round((int(row["closed_ns"]) - int(row["opened_ns"])) / 1e9, 3),
            "requests_served": int(row["requests_served"]), "bytes_in": int(row["bytes_in"]),
            "bytes_out": int(row["bytes_out"]), "late_bytes_in": int(row["late_bytes_in"])}


def _worst_first(conn: dict[str, Any]) -> tuple:
    oldest = max((r["headers_ago_s"] or 0.0 for r in conn["requests"]), default=0.0)
    return (-len(conn["problems"]), _STATE_RANK.get(conn["state"], 5), -(conn["blocked_for_s"] or 0.0), -oldest,
            conn["conn_id"])


def snapshot(ledger, now_ns: int | None = None) -> dict[str, Any]:
    """The ledger as the documented dicts (module docstring), live connections worst first."""
    live, closed = ledger.live_rows(), ledger.closed_rows()
    now_ns = time.monotonic_ns() if now_ns is None else now_ns
    return {"connections": sorted((_live(r, now_ns) for r in live), key=_worst_first),
            "closed": [_closed(r, now_ns) for r in closed], "counters": ledger.counters()}


def _secs(value) -> str:
    return "-" if value is None else f"{value:.1f}s"


def render(snap: dict[str, Any], closed_rows: int = 10):
    """A rich renderable: open connections (worst first), the newest ``closed_rows`` closed ones, the counters."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    live = Table(title=f"connections ({len(snap['connections'])} open)", title_justify="left")
    for column in ("conn", "proto", "peer", "forwarded", "state", "problems", "open", "served", "streams",
                   "last in/out", "blocked", "buffered sock/h2", "requests"):
        live.add_column(column)
    for c in snap["connections"]:
        requests = " ".join(f"{r['request_id'] or '?'}[{r['phase']} {_secs(r['for_s'])}]" for r in c["requests"])
        live.add_row(str(c["conn_id"]), c["protocol"], c["peer"], c["forwarded"] or "-",
                     c["state"] + (" (torn)" if c["torn"] else ""), ",".join(c["problems"]) or "-",
                     _secs(c["open_for_s"]), str(c["requests_served"]), str(c["streams_open"]),
                     f"{_secs(c['last_in_ago_s'])}/{_secs(c['last_out_ago_s'])}", _secs(c["blocked_for_s"]),
                     f"{c['socket_buffered_bytes']}/{c['flow_buffered_bytes']}", requests or "-",
                     style="bold red" if c["problems"] else "red" if c["state"] == "write-blocked" else "")
    closed = Table(title=f"closed connections (newest {min(closed_rows, len(snap['closed']))})", title_justify="left")
    for column in ("conn", "proto", "peer", "closed", "reason", "goaway", "open for", "served", "late bytes in"):
        closed.add_column(column)
    for c in snap["closed"][:closed_rows]:
        closed.add_row(str(c["conn_id"]), c["protocol"], c["peer"], _secs(c["closed_ago_s"]) + " ago",
                       c["close_reason"], "-" if c["goaway_code"] is None else str(c["goaway_code"]),
                       _secs(c["open_for_s"]), str(c["requests_served"]), str(c["late_bytes_in"]),
                       style="red" if c["late_bytes_in"] else "")
    counters = snap["counters"]
    closes = ", ".join(f"{k}={v}" for k, v in counters["closes"].items() if v) or "none"
    found = ", ".join(f"{k}={v}" for k, v in counters["detections"].items() if v) or "none"
    summary = Text(f"closed: {closes}; problems found: {found}; unrecorded (ledger full): {counters['dropped']}")
    return Group(live, closed, summary)
