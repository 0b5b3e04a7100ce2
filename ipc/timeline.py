"""Request timelines built from the flight recorder's events (ipc/recorder.py): plain functions, no I/O.

A timeline is one row's life, keyed by ``(slot, generation, key)``: the stages it went through with their ages and
the deadlines in force, the events between (chunks, cache hits, the KV handoff, the API's socket events), and
the deadline that fired when the monitor timed it out. JSON shape (``timeline_json``; times in seconds, ``t_s``
relative to the first event, ``null`` = unknown)::

    {"key": "16 hex digits", "request_id": str|null (the id asked for), "slot", "generation",
     "started_ago_s": float, "duration_s": float, "final": "FINISHED"|"ABORTED"|"TIMED_OUT"|"FAILED"|null,
     "released": bool, "live": bool, "partial": null | "start evicted" | "end evicted" | "events evicted",
     "path": ["QUEUED", "PREFILLING", ...],
     "stages": [{"state", "stage", "t_s", "age_s": time in it (to the next transition, to now if live, null if
                 its end was evicted),
                 "by": actor, "deadline_field": str|null, "deadline_s": float|null,
                 "request_deadline_left_s": float|null (at entry)}],
     "timeout": null | {"stage", "reason": "stage_deadline"|"request_deadline"|"bad_timestamp", "age_s",
                        "limit_s", "deadline_field"},
     "drill": null | {"stage", "passed": bool, "failure": str|null} (a watchdog drill's row, api/drill.py: its
              stage deadlines are drill_timeout_s),
     "events": [{"t_s", "kind", "actor", ...kind's fields}]}

``/debug/requests/{id}`` answers ``{"schema": 1, "request_id": id, "timelines": [...]}`` (the newest last);
tools/inspect --request prints the same.

When the ring wraps, a life can lose events (``Recorder.horizon_ns``: before it, some sub-ring was overwritten).
``partial`` says what is missing: "start evicted" (the row's ALLOCATE is not among its events), "end evicted" (not
final, but events after its last one may be gone: its row is no longer live in the state table, or, without the
table, the horizon is past its last event), "events evicted" (it began before the horizon: events between may be
gone; final, or live in the table). A life
whose end was evicted is never shown as live: ``live`` is false and its last stage's age is null.
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from ipc.ledger import DETECTIONS
from ipc.lifecycle import FINAL_STATES, LIVE_STATES, STAGE_NAME, STAGE_TIMEOUT_FIELD
from ipc.lifecycle import RequestState as S
from ipc.recorder import ClosedBy, EventKind, Renewal, TimeoutReason, request_key

SCHEMA_VERSION = 1
_FINAL = {int(s) for s in FINAL_STATES}
PARTIAL_TEXT = {
    "start evicted": "its first events were overwritten in the flight recorder's ring (the path starts late)",
    "end evicted": "it ended, but its last events were overwritten in the flight recorder's ring (not live)",
    "events evicted": "it began before the ring's horizon: events between may have been overwritten",
}


def _state_name(value: int) -> str:
    return S(value).name if value in S._value2member_map_ else str(value)


def _actor_name(index: int, actor_names: tuple[str, ...]) -> str:
    if index == -1:
        return "supervisor"
    return actor_names[index] if 0 <= index < len(actor_names) else f"actor{index}"


def group_events(events: np.ndarray) -> dict[tuple[int, int, int], np.ndarray]:
    """Events (EVENT_DTYPE, time-sorted) of each row life ``(slot, generation, key)``; events without a row
    (slot -1) are left out."""
    events = events[events["slot"] >= 0]
    if not events.size:
        return {}
    ids = np.stack([events["slot"].astype(np.int64), events["generation"].astype(np.int64),
                    events["key"].astype(np.uint64).view(np.int64)], axis=1)
    uniq, inverse = np.unique(ids, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    return {(int(s), int(g), int(k) & 0xFFFFFFFFFFFFFFFF): events[inverse == i]
            for i, (s, g, k) in enumerate(uniq)}


def _event_fields(ev, actor_names: tuple[str, ...]) -> dict[str, Any]:
    kind = int(ev["kind"])
    name = EventKind(kind).name.lower() if kind in EventKind._value2member_map_ else str(kind)
    out: dict[str, Any] = {"kind": name, "actor": _actor_name(int(ev["actor"]), actor_names)}
    a, b = int(ev["a"]), int(ev["b"])
    if kind in (EventKind.TRANSITION, EventKind.ALLOCATE):
        out.update({"from": _state_name(int(ev["old"])) if kind == EventKind.TRANSITION else None,
                    "to": _state_name(int(ev["new"]))})
        if int(ev["c"]):
            out["error_code"] = int(ev["c"])
    elif kind == EventKind.RELEASE:
        out["final"] = _state_name(int(ev["old"]))
    elif kind == EventKind.TIMEOUT:
        out.update({"stage": STAGE_NAME.get(S(int(ev["old"])), _state_name(int(ev["old"]))),
                    "age_s": a / 1e9, "limit_s": b / 1e9,
                    "reason": TimeoutReason(int(ev["aux"])).name.lower()
                    if int(ev["aux"]) in TimeoutReason._value2member_map_ else str(int(ev["aux"]))})
    elif kind == EventKind.PREFILL_CHUNK:
        out.update({"tokens": a, "done_tokens": b})
    elif kind == EventKind.CACHE_HIT:
        out["cached_tokens"] = a
    elif kind == EventKind.KV_HANDOFF:
        out.update({"bytes": a, "duration_s": b / 1e9, "blocks": int(ev["c"]), "local_copy": bool(ev["aux"])})
    elif kind == EventKind.HTTP_HEADERS:
        out["body_bytes"] = a
    elif kind in (EventKind.LAST_BYTE, EventKind.CLOSED):
        out["status"] = a
        if kind == EventKind.CLOSED:
            out["by"] = ClosedBy(int(ev["aux"])).name.lower() if int(ev["aux"]) in ClosedBy._value2member_map_ \
                else "unknown"
    elif kind == EventKind.HTTP_PROBLEM:
        reason = int(ev["aux"]) - 1
        out.update({"reason": DETECTIONS[reason] if 0 <= reason < len(DETECTIONS) else str(reason + 1),
                    "connection": a, "age_s": b / 1e9})
    elif kind == EventKind.DRILL:
        from ipc.engine_status import DRILL_FAILURES

        verdict = int(ev["aux"])
        out.update({"stage": STAGE_NAME.get(S(int(ev["old"])), _state_name(int(ev["old"]))), "passed": not verdict,
                    "failure": DRILL_FAILURES[verdict - 1] if 0 < verdict <= len(DRILL_FAILURES) else None})
    elif kind == EventKind.RENEWAL:
        out["what"] = Renewal(int(ev["aux"])).name.lower() if int(ev["aux"]) in Renewal._value2member_map_ \
            else str(int(ev["aux"]))
    return out


def build_timeline(events: np.ndarray, now_ns: int, config: dict[str, float] | None = None,
                   actor_names: tuple[str, ...] = (), request_id: str | None = None, *, horizon_ns: int = 0,
                   live_rows: set[tuple[int, int]] | None = None) -> dict[str, Any]:
    """The timeline (JSON shape in the module docstring) of one row life's events (time-sorted EVENT_DTYPE).

    ``config``: the stage deadline fields (``STAGE_TIMEOUT_FIELD``'s names -> seconds) to show the deadline in
    force at each stage; ``now_ns``: time.monotonic_ns() now, for a live stage's age; ``horizon_ns``: the ring's
    ``Recorder.horizon_ns`` (0: nothing overwritten); ``live_rows``: the ``(slot, generation)`` of the state
    table's live rows, None when the table was not read."""
    config = config or {}
    t0 = int(events["t_ns"][0])
    stages: list[dict[str, Any]] = []
    path: list[str] = []
    out_events = []
    timeout = None
    drill = None
    final = None
    released = False
    for ev in events:
        kind, t_ns = int(ev["kind"]), int(ev["t_ns"])
        fields = _event_fields(ev, actor_names)
        out_events.append({"t_s": (t_ns - t0) / 1e9, **fields})
        if kind in (EventKind.ALLOCATE, EventKind.TRANSITION):
            state = S(int(ev["new"]))
            if stages and stages[-1]["age_s"] is None:
                stages[-1]["age_s"] = (t_ns - t0) / 1e9 - stages[-1]["t_s"]
            path.append(state.name)
            deadline_ns = int(ev["a"])
            field = STAGE_TIMEOUT_FIELD.get(state)
            stages.append({"state": state.name, "stage": STAGE_NAME.get(state), "t_s": (t_ns - t0) / 1e9,
                           "age_s": 0.0 if int(state) in _FINAL else None, "by": fields["actor"],
                           "deadline_field": field, "deadline_s": config.get(field) if field else None,
                           "request_deadline_left_s": (deadline_ns - t_ns) / 1e9 if deadline_ns > 0 else None})
            if int(state) in _FINAL:
                final = state.name
        elif kind == EventKind.TIMEOUT:
            stage_state = S(int(ev["old"]))
            reason = fields["reason"]
            timeout = {"stage": fields["stage"], "reason": reason, "age_s": fields["age_s"],
                       "limit_s": fields["limit_s"],
                       "deadline_field": "request_timeout_s" if reason == "request_deadline"
                       else STAGE_TIMEOUT_FIELD.get(stage_state)}
        elif kind == EventKind.RELEASE:
            released = True
        elif kind == EventKind.DRILL:
            drill = {k: fields[k] for k in ("stage", "passed", "failure")}
    if drill is not None:   # in the stage it drills, its deadline is drill_timeout_s (actors/watchdog.py)
        for st in stages:
            if st["stage"] == drill["stage"]:
                st["deadline_field"], st["deadline_s"] = "drill_timeout_s", config.get("drill_timeout_s")
        if timeout is not None and timeout["reason"] == "stage_deadline":
            timeout["deadline_field"] = "drill_timeout_s"
    slot, generation = int(events["slot"][0]), int(events["generation"][0])
    live, partial = _completeness(events, final is not None or released, horizon_ns,
                                  None if live_rows is None else (slot, generation) in live_rows)
    if live and stages and stages[-1]["age_s"] is None:
        stages[-1]["age_s"] = (now_ns - t0) / 1e9 - stages[-1]["t_s"]
    key = int(events["key"][0])
    return {"key": f"{key:016x}", "request_id": request_id, "slot": slot, "generation": generation,
            "started_ago_s": (now_ns - t0) / 1e9, "duration_s": (int(events["t_ns"][-1]) - t0) / 1e9, "final": final,
            "released": released, "live": live, "partial": partial, "path": path, "stages": stages,
            "timeout": timeout, "drill": drill, "events": out_events}


def _completeness(events: np.ndarray, ended: bool, horizon_ns: int, in_table: bool | None) -> tuple[bool, str | None]:
    """``(live, partial)`` of a row life (see the module docstring): ``ended`` when a final state or the row's
    release is among its events; ``in_table``: its row is live in the state table (None: not read)."""
    if ended:
        live = False
    elif in_table is not None:
        live = in_table
    else:   # no sub-ring lost anything after its last event: nothing happened to it since
        live = horizon_ns <= int(events["t_ns"][-1])
    if not (events["kind"] == EventKind.ALLOCATE).any():   # the row's birth (the API's headers may come first)
        return live, "start evicted"
    if not ended and not live:
        return live, "end evicted"
    return live, "events evicted" if horizon_ns > int(events["t_ns"][0]) else None


def timelines_of(events: np.ndarray, request_id: str, now_ns: int, config: dict[str, float] | None = None,
                 actor_names: tuple[str, ...] = (), **ring) -> list[dict[str, Any]]:
    """Every timeline of ``request_id`` (a client id or completion id: pdserve uses one string for both) in
    ``events``, oldest first (a client may reuse an id; ``n`` > 1 choices each have a row). ``ring``:
    ``horizon_ns`` and ``live_rows`` (:func:`build_timeline`)."""
    key = request_key(request_id)
    mine = events[events["key"] == np.uint64(key)]
    groups = group_events(mine)
    found = [build_timeline(evs, now_ns, config, actor_names, request_id, **ring) for evs in groups.values()]
    return sorted(found, key=lambda t: -t["started_ago_s"])


def all_timelines(events: np.ndarray, now_ns: int, config: dict[str, float] | None = None,
                  actor_names: tuple[str, ...] = (), **ring) -> list[dict[str, Any]]:
    """Every row life in ``events``, oldest first (request ids unknown: the recorder keeps their keys)."""
    found = [build_timeline(evs, now_ns, config, actor_names, **ring) for evs in group_events(events).values()]
    return sorted(found, key=lambda t: -t["started_ago_s"])


def live_rows_of(rows: np.ndarray) -> set[tuple[int, int]]:
    """``(slot, generation)`` of the rows of a state-table snapshot (ROW_DTYPE) in a live state."""
    live = np.isin(rows["state"], [int(s) for s in LIVE_STATES])
    return {(int(slot), int(rows["generation"][slot])) for slot in np.flatnonzero(live)}


def select(timelines: list[dict[str, Any]], *, failed: bool = False, slowest: int = 0,
           recent: int = 0) -> list[dict[str, Any]]:
    """``failed``: those that ended TIMED_OUT or FAILED (or ABORTED by the engine); ``slowest``: the N longest;
    ``recent``: the N newest. Applied in that order."""
    out = list(timelines)
    if failed:
        out = [t for t in out if t["final"] in ("TIMED_OUT", "FAILED") or t["timeout"] is not None]
    if slowest:
        out = sorted(out, key=lambda t: -t["duration_s"])[:slowest]
    if recent:
        out = sorted(out, key=lambda t: t["started_ago_s"])[:recent]
    return out


def stage_deadlines(config_values: dict[str, Any]) -> dict[str, float]:
    """The stage deadline fields of an effective config (``{field: value}`` or the manifest's ``{field:
    {"value": v, "source": s}}``) -> seconds."""
    out = {}
    for name in list(STAGE_TIMEOUT_FIELD.values()) + ["request_timeout_s", "drill_timeout_s"]:
        v = config_values.get(name)
        if isinstance(v, dict):
            v = v.get("value")
        if v is not None:
            out[name] = float(v)
    return out


def render_text(timeline: dict[str, Any]) -> list[str]:
    """Lines of text for one timeline: a header, one line per stage (age, deadline), the deadline that fired,
    then every event."""
    who = timeline["request_id"] or f"key {timeline['key']}"
    head = (f"request {who}  slot {timeline['slot']} generation {timeline['generation']}  "
            f"{' -> '.join(timeline['path'])}  ({timeline['duration_s']:.3f} s, started "
            f"{timeline['started_ago_s']:.1f} s ago{', row released' if timeline['released'] else ''})")
    lines = [head]
    drill = timeline.get("drill")
    if drill is not None:
        lines.append(f"  WATCHDOG DRILL of stage {drill['stage']}: "
                     + ("passed" if drill["passed"] else f"FAILED ({drill['failure']})"))
    if timeline.get("partial"):
        lines.append(f"  PARTIAL: {PARTIAL_TEXT[timeline['partial']]}")
    for st in timeline["stages"]:
        deadline = ""
        if st["deadline_field"]:
            limit = "?" if st["deadline_s"] is None else f"{st['deadline_s']:g} s"
            deadline = f"deadline {st['deadline_field']}={limit}"
        if st["request_deadline_left_s"] is not None and st["state"] not in ("FINISHED", "ABORTED", "TIMED_OUT",
                                                                               "FAILED"):
            deadline += f"{', ' if deadline else 'deadline '}request {st['request_deadline_left_s']:.1f} s left"
        age = "       ?" if st["age_s"] is None else f"{st['age_s']:8.3f}"
        lines.append(f"  +{st['t_s']:8.3f}s  {st['state']:<15} age {age}s  by {st['by']:<10} {deadline}")
    to = timeline["timeout"]
    if to is not None:
        lines.append(f"  TIMED OUT in stage {to['stage']}: {to['deadline_field']}={to['limit_s']:g} s fired after "
                     f"{to['age_s']:.3f} s ({to['reason']})")
    lines.append("  events:")
    for ev in timeline["events"]:
        extra = " ".join(f"{k}={v}" for k, v in ev.items() if k not in ("t_s", "kind", "actor") and v is not None)
        lines.append(f"    +{ev['t_s']:8.3f}s  {ev['kind']:<13} {ev['actor']:<10} {extra}")
    return lines


def trace_events(timelines: Iterable[dict[str, Any]], now_ns: int) -> dict[str, Any]:
    """Chrome/Perfetto trace JSON (the Trace Event Format) of ``timelines``: one track (tid) per row life, a
    complete event ("X") per stage, an instant event ("i") per other event; ``ts`` in microseconds since the
    oldest timeline's start."""
    timelines = list(timelines)
    if not timelines:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    origin_s = max(t["started_ago_s"] for t in timelines)
    out: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "pdserve requests"}}]
    for tid, t in enumerate(timelines, start=1):
        start_us = (origin_s - t["started_ago_s"]) * 1e6
        label = t["request_id"] or t["key"]
        partial = f", partial: {t['partial']}" if t.get("partial") else ""
        out.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid,
                    "args": {"name": f"{label} (slot {t['slot']} gen {t['generation']}{partial})"}})
        for st in t["stages"]:
            out.append({"name": st["stage"] or st["state"].lower(), "cat": "stage", "ph": "X", "pid": 1, "tid": tid,
                        "ts": start_us + st["t_s"] * 1e6, "dur": max(st["age_s"] or 0.0, 0.0) * 1e6,
                        "args": {"state": st["state"], "by": st["by"], "deadline_field": st["deadline_field"],
                                 "deadline_s": st["deadline_s"]}})
        for ev in t["events"]:
            if ev["kind"] in ("transition", "allocate"):
                continue
            out.append({"name": ev["kind"], "cat": "event", "ph": "i", "s": "t", "pid": 1, "tid": tid,
                        "ts": start_us + ev["t_s"] * 1e6,
                        "args": {k: v for k, v in ev.items() if k not in ("t_s", "kind")}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def requests_report(events: np.ndarray, now_ns: int, config: dict[str, Any], actor_names: tuple[str, ...],
                    request_id: str | None = None, *, failed: bool = False, slowest: int = 0,
                    recent: int = 0, horizon_ns: int = 0,
                    live_rows: set[tuple[int, int]] | None = None) -> dict[str, Any]:
    """The document /debug/requests/{id} answers and tools/inspect --request/--recent/--failed/--slowest prints:
    ``{"schema": 1, "request_id": id|null, "timelines": [...]}``. ``config``: the effective config (values or
    the manifest's ``{"value", "source"}`` entries); ``horizon_ns``, ``live_rows``: see :func:`build_timeline`."""
    limits = stage_deadlines(config)
    ring = {"horizon_ns": horizon_ns, "live_rows": live_rows}
    if request_id is not None:
        found = timelines_of(events, request_id, now_ns, limits, actor_names, **ring)
    else:
        found = select(all_timelines(events, now_ns, limits, actor_names, **ring), failed=failed, slowest=slowest,
                       recent=recent or (0 if failed or slowest else 20))
    return {"schema": SCHEMA_VERSION, "request_id": request_id, "timelines": found}


def diverging_ids(events: np.ndarray, rows: np.ndarray, api_actor: int) -> dict[str, list[dict[str, Any]]]:
    """Id-level reconciliation of the API's holdings with the state table's rows.

    The API's side, from the recorder: row lives it allocated and has not released (ALLOCATE / RELEASE events
    written by actor ``api_actor``); the table's side: its rows not FREE (``rows``, a snapshot of ROW_DTYPE). Only
    rows created after the recorder's oldest API event are judged (older ones fell off the ring). Returns
    ``{"api_only": [...], "table_only": [...]}``, each entry ``{"slot", "generation", "key", "request_id"}``
    (request_id from the table row, else null)."""
    api = events[events["actor"] == api_actor]
    if not api.size:
        return {"api_only": [], "table_only": []}
    oldest_ns = int(api["t_ns"].min())
    held: dict[tuple[int, int], int] = {}
    for ev in api[np.isin(api["kind"], [EventKind.ALLOCATE, EventKind.RELEASE])]:
        life = (int(ev["slot"]), int(ev["generation"]))
        if int(ev["kind"]) == EventKind.ALLOCATE:
            held[life] = int(ev["key"])
        else:
            held.pop(life, None)
    table: dict[tuple[int, int], str] = {}
    for slot in np.flatnonzero((rows["state"] != int(S.FREE)) & (rows["created_ns"] >= oldest_ns)):
        rid = rows["request_id"][slot]
        table[(int(slot), int(rows["generation"][slot]))] = rid.decode("ascii", "replace") \
            if isinstance(rid, bytes) else str(rid)

    def entry(life, key, rid):
        return {"slot": life[0], "generation": life[1], "key": f"{key:016x}", "request_id": rid}
    return {"api_only": [entry(life, key, None) for life, key in sorted(held.items()) if life not in table],
            "table_only": [entry(life, request_key(rid), rid) for life, rid in sorted(table.items())
                           if life not in held]}
