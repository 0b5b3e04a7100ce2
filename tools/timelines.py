"""tools/inspect's flight-recorder views (ipc/recorder.py, ipc/timeline.py): a request's timeline by id, the recent,
failed or slowest ones, and a Chrome/Perfetto trace of a window. Reads the engine's shm read-only, so it answers
with the API process stopped and after the request's row was reused.

    python -m tools.inspect --request ID              # client id or completion id (one string in pdserve)
    python -m tools.inspect --recent 20 | --failed | --slowest 10 [--json]
    python -m tools.inspect --trace-out trace.json [--window-s 60]   # open in ui.perfetto.dev or chrome://tracing
    python -m tools.inspect --reconcile     # ids the API holds that the table does not, and the reverse
"""
from __future__ import annotations

import sys
import time
from typing import Any

import orjson


def read_ring(manifest: dict[str, Any]) -> dict[str, Any]:
    """``{"events", "horizon_ns", "live_rows"}`` (``requests_report``'s ring arguments): the recorder's whole
    events, its horizon, and the state table's live rows (None when the table cannot be read). Read-only.
    Raises FileNotFoundError when the engine runs without a recorder (recorder_events=0) or is gone."""
    from ipc.recorder import Recorder
    from ipc.state_table import StateTable
    from ipc.timeline import live_rows_of

    name = manifest["segments"].get("recorder")
    if name is None:
        raise FileNotFoundError("this engine runs without a flight recorder (recorder_events=0)")
    with Recorder.attach(name, readonly=True) as ring:
        events, horizon_ns = ring.events(), ring.horizon_ns()
    try:
        with StateTable.attach(manifest["segments"]["state"], readonly=True) as table:
            live_rows = live_rows_of(table.snapshot())
    except (FileNotFoundError, KeyError, ValueError):
        live_rows = None
    return {"events": events, "horizon_ns": horizon_ns, "live_rows": live_rows}


def wants_timelines(args) -> bool:
    return bool(args.request or args.recent or args.failed or args.slowest or args.trace_out or args.reconcile)


def reconcile(manifest: dict[str, Any], events, now_ns: int) -> dict[str, Any]:
    """``{"api_only": [...], "table_only": [...]}`` (ipc/timeline.py's ``diverging_ids``), each entry with its
    ``timeline`` (or null)."""
    from ipc.state_table import StateTable
    from ipc.timeline import all_timelines, diverging_ids, stage_deadlines

    names = tuple(manifest.get("actors", ()))
    with StateTable.attach(manifest["segments"]["state"], readonly=True) as table:
        rows = table.snapshot()
    diff = diverging_ids(events, rows, names.index("api") if "api" in names else -2)
    timelines = {(t["slot"], t["generation"], t["key"]): t
                 for t in all_timelines(events, now_ns, stage_deadlines(manifest.get("config", {})), names)}
    for side in diff.values():
        for e in side:
            e["timeline"] = timelines.get((e["slot"], e["generation"], e["key"]))
    return diff


def main_timelines(args, manifest: dict[str, Any]) -> int:
    """--request / --recent / --failed / --slowest / --trace-out. Exit 0; 1 when --request finds nothing; 2 when
    there is no recorder to read."""
    from ipc.timeline import render_text, requests_report, trace_events

    try:
        ring = read_ring(manifest)
    except (FileNotFoundError, ValueError) as exc:
        print(f"cannot read the flight recorder: {exc}", file=sys.stderr)
        return 2
    events = ring.pop("events")
    now_ns = time.monotonic_ns()
    names = tuple(manifest.get("actors", ()))
    if args.reconcile:
        return print_reconcile(reconcile(manifest, events, now_ns), args.json)
    report = requests_report(events, now_ns, manifest.get("config", {}), names, args.request, failed=args.failed,
                             slowest=args.slowest or 0, recent=args.recent or 0, **ring)
    if args.trace_out:
        window = [t for t in report["timelines"] if args.request or args.window_s is None
                  or t["started_ago_s"] <= args.window_s]
        with open(args.trace_out, "wb") as f:
            f.write(orjson.dumps(trace_events(window, now_ns)))
        print(f"wrote {len(window)} request timelines to {args.trace_out} (Trace Event Format: open it in "
              "ui.perfetto.dev or chrome://tracing)")
        return 0
    arrivals = read_arrivals(manifest, args.request) if args.request else None
    if args.json:
        report["arrivals"] = arrivals["arrivals"] if arrivals else []
        sys.stdout.write(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() + "\n")
    elif not report["timelines"]:
        print(not_found_text(args.request, ring["horizon_ns"], now_ns, arrivals)
              if args.request else "no request timelines in the flight recorder")
    for timeline in [] if args.json else report["timelines"]:
        print("\n".join(render_text(timeline)))
    if not args.json and report["timelines"] and arrivals and arrivals["arrivals"]:
        print("where its time went (the arrival index):\n  " + split_text(arrivals["arrivals"][-1], now_ns))
    return 1 if args.request and not report["timelines"] else 0


def read_arrivals(manifest: dict[str, Any], request_id: str) -> dict[str, Any] | None:
    """The arrival index's entries for ``request_id`` (ipc/arrivals.py ``ArrivalIndex.find``), None when the
    engine keeps none (arrival_index_entries=0) or it cannot be read."""
    from ipc.arrivals import ArrivalIndex
    from ipc.recorder import request_key

    name = manifest["segments"].get("arrivals")
    try:
        with ArrivalIndex.attach(name, readonly=True) as index:
            return index.find(request_key(request_id))
    except (FileNotFoundError, ValueError, TypeError):
        return None


def split_text(entry: dict[str, int], now_ns: int) -> str:
    """Where one answered request's time went, from its arrival-index entry (ipc/arrivals.py, api/blame.py's
    split): a first line (when it reached this server, its status, the proxy's wait), then the engine's part and the
    rest, indented."""
    from api.blame import NONE_US, outside_and_engine_s

    def at(field: str) -> str:
        return f"+{entry[field] / 1e6:.3f} s"

    status = f"answered {entry['status']}" if entry["status"] else "no answer began: the client left first"
    first = f"reached this server {(now_ns - entry['t_ns']) / 1e9:.1f} s ago ({status})"
    if entry["before_us"] != NONE_US:
        first += f", {entry['before_us'] / 1e6:.3f} s after the proxy's X-Request-Start"
    split = (entry["before_us"], entry["admitted_us"], entry["done_us"], entry["end_us"])
    outside_s, engine_s = outside_and_engine_s(split)
    if entry["admitted_us"] == NONE_US:
        engine = "never admitted to the engine"
    elif entry["done_us"] == NONE_US:
        engine = f"admitted to the engine at {at('admitted_us')}; the engine never finished it"
    else:
        engine = (f"admitted to the engine at {at('admitted_us')}; engine done at {at('done_us')} "
                  f"({engine_s:.3f} s in the engine)")
    visible_s = (entry["end_us"] + (entry["before_us"] if entry["before_us"] != NONE_US else 0)) / 1e6
    proxy = "" if entry["before_us"] != NONE_US else " (no X-Request-Start: a proxy's queue is not counted)"
    return (f"{first}\n  {engine}; last byte handed to the connection at {at('end_us')} after the headers\n"
            f"  outside the engine: {outside_s:.3f} s of {visible_s:.3f} s the client waited{proxy}: the proxy, the "
            f"body, admission's queue, writing")


def not_found_text(request_id: str, horizon_ns: int, now_ns: int, arrivals: dict[str, Any] | None = None) -> str:
    """Why ``request_id`` has no timeline. The arrival index (``arrivals``: ``ArrivalIndex.find``'s answer) knows
    it: it reached this server, its events are older than the ring's horizon. Else, with a ring that never wrapped
    (it holds every event since the start) or an index that reaches further back than the ring, it never reached
    this server; else it did not, or it came before both."""
    if arrivals and arrivals["arrivals"]:
        first, _, rest = split_text(arrivals["arrivals"][-1], now_ns).partition("\n")
        return (f"request {request_id!r} {first}; its events were overwritten in the flight recorder (its horizon "
                f"is {(now_ns - horizon_ns) / 1e9:.1f} s ago)\n{rest}")
    if not horizon_ns:
        return (f"request {request_id!r} never reached this server: the flight recorder holds every event since "
                f"the engine started and none of them names it")
    if arrivals and arrivals["since_ns"] and (not arrivals["wrapped"] or arrivals["since_ns"] <= horizon_ns):
        reach = "since the engine started" if not arrivals["wrapped"] else \
            f"of the last {(now_ns - arrivals['since_ns']) / 1e9:.1f} s"
        return (f"request {request_id!r} never reached this server: the arrival index holds every request id "
                f"answered {reach}")
    return (f"no events of request {request_id!r} in the flight recorder: it never reached this server, or it "
            f"came before the ring's horizon ({(now_ns - horizon_ns) / 1e9:.1f} s ago; older events were overwritten)")


def print_reconcile(diff: dict[str, Any], as_json: bool) -> int:
    """Print the diverging ids (and their timelines); exit 1 if any."""
    from ipc.timeline import render_text

    if as_json:
        sys.stdout.write(orjson.dumps(diff, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        for side, title in (("api_only", "held by the API, not in the table"),
                            ("table_only", "in the table, not held by the API")):
            print(f"{title}: {len(diff[side])}")
            for e in diff[side]:
                print(f"  {e['request_id'] or e['key']} slot {e['slot']} generation {e['generation']}")
                if e["timeline"] is not None:
                    print("\n".join("    " + line for line in render_text(e["timeline"])))
    return 1 if diff["api_only"] or diff["table_only"] else 0
