"""Timelines from recorder events (ipc/timeline.py): plain functions over EVENT_DTYPE arrays."""
from __future__ import annotations

import numpy as np

from ipc.recorder import EVENT_DTYPE, EventKind, TimeoutReason, request_key
from ipc.state_table import RequestState as S
from ipc.timeline import all_timelines, render_text, requests_report, select, timelines_of, trace_events

NAMES = ("prefill0", "decode0", "api", "monitor")
CONFIG = {"queue_timeout_s": {"value": 60.0, "source": "default"}, "prefill_timeout_s": 60.0,
          "bootstrap_timeout_s": 30.0, "inflight_timeout_s": 2.0, "request_timeout_s": 600.0}
S_NS = 1_000_000_000


def events_of(rows) -> np.ndarray:
    """rows: (t_s, kind, rid, slot, gen, actor, fields)."""
    out = np.zeros(len(rows), EVENT_DTYPE)
    for i, (t_s, kind, rid, slot, gen, actor, fields) in enumerate(rows):
        out[i]["t_ns"], out[i]["kind"], out[i]["key"] = int(t_s * S_NS), kind, request_key(rid)
        out[i]["slot"], out[i]["generation"], out[i]["actor"] = slot, gen, actor
        out[i]["head"] = out[i]["tail"] = i + 1
        for k, v in fields.items():
            out[i][k] = v
    return out[np.argsort(out["t_ns"], kind="stable")]


def life(rid, slot, gen, t0, states, timeout_after_s=None, dt=1.0):
    """A row life through ``states`` (one per dt), ended TIMED_OUT by the monitor if ``timeout_after_s``."""
    deadline = int((t0 + 600) * S_NS)
    rows = [(t0, EventKind.ALLOCATE, rid, slot, gen, 2, {"new": int(states[0]), "a": deadline})]
    rows.append((t0, EventKind.HTTP_HEADERS, rid, slot, gen, 2, {"a": 99}))
    t, prev = t0, states[0]
    for st in states[1:]:
        t += dt
        rows.append((t, EventKind.TRANSITION, rid, slot, gen, 1, {"old": int(prev), "new": int(st), "a": deadline}))
        prev = st
    if timeout_after_s is not None:
        t += timeout_after_s
        rows.append((t, EventKind.TRANSITION, rid, slot, gen, 3, {"old": int(prev), "new": int(S.TIMED_OUT)}))
        rows.append((t, EventKind.TIMEOUT, rid, slot, gen, 3, {"old": int(prev), "a": int(timeout_after_s * S_NS),
                                                              "b": 2 * S_NS, "aux": TimeoutReason.STAGE_DEADLINE}))
        rows.append((t + 0.01, EventKind.RELEASE, rid, slot, gen, 2, {"old": int(S.TIMED_OUT)}))
    return rows


def test_a_timed_out_request_after_its_row_was_reused():
    path = [S.QUEUED, S.PREFILLING, S.BOOTSTRAP, S.TRANSFERRING]
    rows = life("round-7", 0, 7, 10.0, path, timeout_after_s=2.05)
    for i in range(50):   # the same row, reused by 50 later requests
        rows += life(f"later-{i}", 0, 8 + i, 20.0 + i, [S.QUEUED, S.PREFILLING], dt=0.1)
    events = events_of(rows)
    found = timelines_of(events, "round-7", now_ns=200 * S_NS, config={"inflight_timeout_s": 2.0},
                         actor_names=NAMES)
    assert len(found) == 1
    t = found[0]
    assert t["path"] == ["QUEUED", "PREFILLING", "BOOTSTRAP", "TRANSFERRING", "TIMED_OUT"]
    assert [round(s["age_s"], 3) for s in t["stages"]] == [1.0, 1.0, 1.0, 2.05, 0.0]
    assert t["stages"][3]["deadline_field"] == "inflight_timeout_s" and t["stages"][3]["deadline_s"] == 2.0
    assert t["stages"][3]["by"] == "decode0" and t["stages"][4]["by"] == "monitor"
    assert round(t["timeout"]["age_s"], 3) == 2.05
    assert {k: v for k, v in t["timeout"].items() if k != "age_s"} == {
        "stage": "transfer", "reason": "stage_deadline", "limit_s": 2.0, "deadline_field": "inflight_timeout_s"}
    assert t["final"] == "TIMED_OUT" and t["released"] and (t["slot"], t["generation"]) == (0, 7)
    text = "\n".join(render_text(t))
    assert "QUEUED -> PREFILLING -> BOOTSTRAP -> TRANSFERRING -> TIMED_OUT" in text
    assert "inflight_timeout_s=2 s fired after 2.050 s" in text


def test_a_live_stage_ages_to_now_and_an_unknown_id_has_no_timeline():
    events = events_of(life("live", 3, 1, 5.0, [S.QUEUED, S.PREFILLING]))
    t = timelines_of(events, "live", now_ns=10 * S_NS)[0]
    assert t["stages"][-1]["age_s"] == 4.0 and t["final"] is None and not t["released"]
    assert t["stages"][0]["request_deadline_left_s"] == 600.0
    assert timelines_of(events, "other", now_ns=10 * S_NS) == []


def test_a_reused_client_id_gives_one_timeline_per_row_life():
    events = events_of(life("same", 1, 1, 1.0, [S.QUEUED]) + life("same", 2, 5, 3.0, [S.QUEUED, S.PREFILLING]))
    found = timelines_of(events, "same", now_ns=9 * S_NS)
    assert [(t["slot"], t["generation"]) for t in found] == [(1, 1), (2, 5)]


def test_select_failed_slowest_recent_and_the_report():
    rows = life("ok", 0, 1, 1.0, [S.QUEUED, S.PREFILLING], dt=0.5) + \
        life("bad", 1, 1, 2.0, [S.QUEUED, S.PREFILLING, S.BOOTSTRAP, S.TRANSFERRING], timeout_after_s=3.0) + \
        life("new", 2, 1, 9.0, [S.QUEUED])
    events = events_of(rows)
    everything = all_timelines(events, now_ns=10 * S_NS)
    assert len(everything) == 3
    assert [t["slot"] for t in select(everything, failed=True)] == [1]
    assert [t["slot"] for t in select(everything, slowest=2)] == [1, 0]
    assert [t["slot"] for t in select(everything, recent=1)] == [2]
    report = requests_report(events, 10 * S_NS, CONFIG, NAMES, "bad")
    assert report["schema"] == 1 and report["timelines"][0]["stages"][0]["deadline_s"] == 60.0


def test_trace_event_format():
    events = events_of(life("bad", 1, 1, 2.0, [S.QUEUED, S.PREFILLING], timeout_after_s=3.0))
    trace = trace_events(all_timelines(events, now_ns=10 * S_NS), 10 * S_NS)
    stages = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in stages] == ["queued", "prefill", "timed_out"]
    assert stages[1]["ts"] == 1e6 and stages[1]["dur"] == 3e6
    assert any(e["ph"] == "i" and e["name"] == "timeout" for e in trace["traceEvents"])
    assert all(e["pid"] == 1 for e in trace["traceEvents"])


def test_diverging_ids_name_what_each_side_holds_that_the_other_does_not():
    from ipc.state_table import ROW_DTYPE
    from ipc.timeline import diverging_ids

    rows = [(1.0, EventKind.ALLOCATE, "a", 0, 1, 2, {"new": int(S.QUEUED)}),
            (1.1, EventKind.ALLOCATE, "b", 1, 1, 2, {"new": int(S.QUEUED)}),
            (1.2, EventKind.ALLOCATE, "c", 2, 1, 2, {"new": int(S.QUEUED)}),
            (1.3, EventKind.RELEASE, "c", 2, 1, 2, {"old": int(S.FINISHED)}),
            (1.4, EventKind.RELEASE, "b", 1, 1, 3, {"old": int(S.FAILED)})]   # the monitor reclaimed b's row
    table = np.zeros(6, ROW_DTYPE)
    for slot, rid, state, created_s in ((0, b"a", S.DECODING, 1.0), (3, b"d", S.QUEUED, 2.0),
                                        (4, b"old", S.DECODING, 0.5)):
        table[slot]["request_id"], table[slot]["state"] = rid, int(state)
        table[slot]["generation"], table[slot]["created_ns"] = 1, int(created_s * S_NS)
    diff = diverging_ids(events_of(rows), table, api_actor=2)
    assert [(e["slot"], e["generation"]) for e in diff["api_only"]] == [(1, 1)]
    assert diff["api_only"][0]["key"] == f"{request_key('b'):016x}"
    assert [(e["slot"], e["request_id"]) for e in diff["table_only"]] == [(3, "d")]   # "old": before the ring
    assert diverging_ids(events_of(rows[:1]), table[:1], api_actor=2) == {"api_only": [], "table_only": []}


def test_failed_and_timed_out_lives_are_both_selected_as_failed():
    """A life that ended FAILED (a dead actor's request) is as much a failure as a timed-out one: --failed and the
    incident bundle's failed.json both select through ``select(failed=True)``."""
    rows = life("ok", 0, 1, 1.0, [S.QUEUED, S.PREFILLING, S.DECODING, S.FINISHED], dt=0.5) + \
        life("late", 1, 1, 2.0, [S.QUEUED, S.PREFILLING], timeout_after_s=3.0) + \
        life("dead", 2, 1, 3.0, [S.QUEUED, S.PREFILLING, S.FAILED])
    everything = all_timelines(events_of(rows), now_ns=10 * S_NS)
    assert sorted(t["final"] for t in select(everything, failed=True)) == ["FAILED", "TIMED_OUT"]
    report = requests_report(events_of(rows), 10 * S_NS, CONFIG, NAMES, failed=True)
    assert sorted(t["slot"] for t in report["timelines"]) == [1, 2]


def test_a_whole_life_is_not_partial_when_the_apis_headers_come_before_its_allocate():
    rows = life("whole", 2, 1, 5.0, [S.QUEUED, S.PREFILLING, S.FINISHED])
    rows[1] = (4.9, *rows[1][1:])   # the API records the headers it read before the row exists
    (t,) = timelines_of(events_of(rows), "whole", now_ns=20 * S_NS)
    assert (t["partial"], t["live"], t["final"]) == (None, False, "FINISHED")


def test_a_life_whose_start_the_ring_overwrote_reads_as_partial_and_finished():
    rows = life("wrapped", 4, 2, 5.0, [S.QUEUED, S.PREFILLING, S.BOOTSTRAP, S.TRANSFERRING, S.DECODE_WAITING,
                                       S.DECODING, S.FINISHED])
    events = events_of(rows)
    events = events[events["t_ns"] >= 7 * S_NS]   # QUEUED .. PREFILLING overwritten: the path starts at BOOTSTRAP
    (t,) = timelines_of(events, "wrapped", now_ns=20 * S_NS, horizon_ns=7 * S_NS)
    assert t["path"][0] == "BOOTSTRAP" and t["final"] == "FINISHED"
    assert (t["partial"], t["live"]) == ("start evicted", False)
    assert "PARTIAL: its first events were overwritten" in "\n".join(render_text(t))


def test_a_life_whose_end_the_ring_overwrote_is_never_shown_live():
    """The seed's confusion: a finished request read as stuck in bootstrap because the sub-ring holding its end
    had wrapped. Past the horizon, or with its row gone from the state table, it is partial and not live."""
    rows = life("ended", 4, 2, 5.0, [S.QUEUED, S.PREFILLING, S.BOOTSTRAP, S.TRANSFERRING, S.FINISHED])
    events = events_of(rows)
    events = events[events["t_ns"] < 7.5 * S_NS]   # what decode wrote (TRANSFERRING, FINISHED) was overwritten
    (t,) = timelines_of(events, "ended", now_ns=100 * S_NS, horizon_ns=8 * S_NS)
    assert t["path"][-1] == "BOOTSTRAP" and t["final"] is None
    assert (t["partial"], t["live"]) == ("end evicted", False)
    assert t["stages"][-1]["age_s"] is None   # not 93 s "in bootstrap"
    text = "\n".join(render_text(t))
    assert "PARTIAL: it ended" in text and "age        ?s" in text
    trace = trace_events([t], 100 * S_NS)
    assert any("partial: end evicted" in e["args"].get("name", "") for e in trace["traceEvents"] if e["ph"] == "M")
    # the state table decides when it was read: its row was reused (not live) or still holds it (live)
    (gone,) = timelines_of(events, "ended", now_ns=100 * S_NS, horizon_ns=0, live_rows={(4, 3)})
    assert (gone["partial"], gone["live"]) == ("end evicted", False)
    (held,) = timelines_of(events, "ended", now_ns=100 * S_NS, horizon_ns=8 * S_NS, live_rows={(4, 2)})
    assert (held["partial"], held["live"]) == ("events evicted", True) and held["stages"][-1]["age_s"] > 90


def test_a_live_life_after_the_horizon_is_whole_and_an_old_finished_one_may_have_gaps():
    fresh = life("fresh", 1, 1, 9.0, [S.QUEUED, S.PREFILLING])
    old = life("old", 2, 1, 1.0, [S.QUEUED, S.PREFILLING, S.FINISHED])
    events = events_of(fresh + old)
    (t,) = timelines_of(events, "fresh", now_ns=12 * S_NS, horizon_ns=5 * S_NS)
    assert (t["partial"], t["live"], t["stages"][-1]["age_s"]) == (None, True, 2.0)
    (o,) = timelines_of(events, "old", now_ns=12 * S_NS, horizon_ns=5 * S_NS)
    assert (o["partial"], o["live"], o["final"]) == ("events evicted", False, "FINISHED")


def test_a_drills_timeline_says_so_with_its_verdict_and_the_drill_deadline():
    """api/drill.py records a DRILL event (stage, verdict) on its row before releasing it."""
    from ipc.timeline import stage_deadlines

    rows = life("drill-transfer-3", 0, 7, 10.0, [S.QUEUED, S.PREFILLING, S.BOOTSTRAP, S.TRANSFERRING],
                timeout_after_s=1.2)
    rows.append((16.0, EventKind.DRILL, "drill-transfer-3", 0, 7, 2, {"old": int(S.TRANSFERRING), "aux": 0}))
    [t] = timelines_of(events_of(rows), "drill-transfer-3", now_ns=20 * S_NS,
                       config=stage_deadlines({**CONFIG, "drill_timeout_s": 1.0}), actor_names=NAMES)
    assert t["drill"] == {"stage": "transfer", "passed": True, "failure": None}
    assert t["timeout"]["deadline_field"] == "drill_timeout_s" and t["stages"][3]["deadline_s"] == 1.0
    assert t["stages"][2]["deadline_field"] == "bootstrap_timeout_s"   # the stages before it: the ordinary ones
    assert "WATCHDOG DRILL of stage transfer: passed" in render_text(t)[1]
    rows[-1] = (16.0, EventKind.DRILL, "drill-transfer-3", 0, 7, 2, {"old": int(S.TRANSFERRING), "aux": 1})
    [failed] = timelines_of(events_of(rows), "drill-transfer-3", now_ns=20 * S_NS, actor_names=NAMES)
    assert "FAILED (the stage deadline did not fire" in render_text(failed)[1]
    [client] = timelines_of(events_of(life("c-1", 1, 1, 10.0, [S.QUEUED])), "c-1", now_ns=20 * S_NS)
    assert client["drill"] is None
