"""tools/inspect's flight-recorder views (ipc/recorder.py, ipc/timeline.py): a request's timeline by id, the recent,
failed or slowest ones, and a Chrome/Perfetto trace of a window. Reads the engine's shm read-only, so it answers
with the API process stopped and after the request's row was reused.

    python -m tools.inspect --request ID              # client id or completion id (one string in pdserve)
    python -m tools.inspect --recent 20 | --failed | --slowest 10 [--json]
    python -m tools.inspect --trace-out trace.json [--window-s 60]   # open in ui.perfetto.dev or chrome://tracing
"""
from __future__ import annotations

import sys
import time
from typing import Any

import orjson


def read_events(manifest: dict[str, Any]):
    """Every whole event of the engine's recorder (read-only). Raises FileNotFoundError when the engine runs
    without one (recorder_events=0) or is gone."""
    from ipc.recorder import Recorder

    name = manifest["segments"].get("recorder")
    if name is None:
        raise FileNotFoundError("this engine runs without a flight recorder (recorder_events=0)")
    with Recorder.attach(name, readonly=True) as ring:
        return ring.events()


def wants_timelines(args) -> bool:
    return bool(args.request or args.recent or args.failed or args.slowest or args.trace_out)


def main_timelines(args, manifest: dict[str, Any]) -> int:
    """--request / --recent / --failed / --slowest / --trace-out. Exit 0; 1 when --request finds nothing; 2 when
    there is no recorder to read."""
    from ipc.timeline import render_text, requests_report, trace_events

    try:
        events = read_events(manifest)
    except (FileNotFoundError, ValueError) as exc:
        print(f"cannot read the flight recorder: {exc}", file=sys.stderr)
        return 2
    now_ns = time.monotonic_ns()
    names = tuple(manifest.get("actors", ()))
    report = requests_report(events, now_ns, manifest.get("config", {}), names, args.request, failed=args.failed,
                             slowest=args.slowest or 0, recent=args.recent or 0)
    if args.trace_out:
        window = [t for t in report["timelines"] if args.request or args.window_s is None
                  or t["started_ago_s"] <= args.window_s]
        with open(args.trace_out, "wb") as f:
            f.write(orjson.dumps(trace_events(window, now_ns)))
        print(f"wrote {len(window)} request timelines to {args.trace_out} (Trace Event Format: open it in "
              "ui.perfetto.dev or chrome://tracing)")
        return 0
    if args.json:
        sys.stdout.write(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() + "\n")
    elif not report["timelines"]:
        print(f"no events of request {args.request!r} in the flight recorder (wrong id, or older than its ring)"
              if args.request else "no request timelines in the flight recorder")
    for timeline in [] if args.json else report["timelines"]:
        print("\n".join(render_text(timeline)))
    return 1 if args.request and not report["timelines"] else 0
