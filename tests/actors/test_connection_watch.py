"""The monitor's connection detectors (actors/connection_watch.py) over a real ledger segment, without processes."""
from __future__ import annotations

import pytest

from actors.connection_watch import ConnectionWatch, find_problems, held_by_connections
from ipc.ledger import DETECTIONS, ConnectionLedger
from ipc.lifecycle import RequestState as S

S_NS = 1_000_000_000
STALL_S = 10.0


@pytest.fixture
def ledger(engine_id):
    from ipc import naming

    led = ConnectionLedger.create(naming.segment_name(engine_id, "conns"), num_live=8, num_closed=4)
    try:
        yield led
    finally:
        led.close()
        led.unlink()


def problems(ledger, engine_rows, now_ns):
    return find_problems(ledger.live_rows(), ledger.closed_rows(), engine_rows, now_ns, STALL_S)


def test_a_write_blocked_past_the_bound_is_found_once_with_its_request_and_cleared_when_it_drains(ledger):
    i = ledger.open("10.1.1.1", 4000, 0)
    j = ledger.request_start(i, "chatcmpl-x", 1 * S_NS)
    ledger.request_engine(i, j, 3, 1, "chatcmpl-x", 1 * S_NS)
    ledger.request_responding(i, j, 2 * S_NS)
    ledger.note_blocked(i, 5 * S_NS, socket_bytes=200_000)
    watch = ConnectionWatch()
    live = {3: (int(S.DECODING), 1, 2 * S_NS)}
    assert problems(ledger, live, 14 * S_NS) == []   # blocked 9 s: under the bound
    (found,) = problems(ledger, live, 15 * S_NS)
    assert (found.reason, found.conn_id, found.request_id, found.row) == ("write_blocked", 1, "chatcmpl-x", i)
    assert "connection 1 (10.1.1.1:4000)" in found.message() and "chatcmpl-x" in found.message()
    new, masks = watch.update([found])
    assert new == [found] and masks == {i: 1 << DETECTIONS.index("write_blocked")}
    assert watch.update(problems(ledger, live, 16 * S_NS))[0] == []   # still standing: not new again
    ledger.note_blocked(i, 0)
    assert watch.update(problems(ledger, live, 17 * S_NS)) == ([], {})


def test_an_engine_row_final_past_the_bound_with_its_http_request_still_open_is_done_not_written(ledger):
    i = ledger.open("::1", 5000, 0)
    j = ledger.request_start(i, "", 1 * S_NS)
    ledger.request_engine(i, j, 7, 4, "cmpl-7", 1 * S_NS)
    finished = {7: (int(S.FINISHED), 4, 20 * S_NS)}
    assert problems(ledger, finished, 29 * S_NS) == []
    (found,) = problems(ledger, finished, 30 * S_NS)
    assert (found.reason, found.request_id, found.slot, found.conn_id) == ("done_not_written", "cmpl-7", 7, 1)
    assert found.age_s == pytest.approx(10.0) and "is the API process stopped or wedged?" in found.message()
    reused = {7: (int(S.FINISHED), 5, 20 * S_NS)}   # the slot now belongs to another request
    assert [f.reason for f in problems(ledger, reused, 30 * S_NS)] == ["no_response"]
    ledger.request_responding(i, j, 21 * S_NS)
    ledger.note_blocked(i, 25 * S_NS, socket_bytes=4_000_000)   # the rest waits on a client that does not read
    (found, _) = sorted(problems(ledger, finished, 35 * S_NS), key=lambda f: f.reason)
    assert found.reason == "done_not_written"
    assert "not written: its writes wait on the client, see write_blocked" in found.message()
    ledger.note_blocked(i, 0)
    ledger.request_end(i, j, served=True)
    assert problems(ledger, finished, 40 * S_NS) == []


def test_headers_without_a_response_are_found_only_when_the_engine_holds_nothing_for_them(ledger):
    i = ledger.open("p", 1, 0)
    j = ledger.request_start(i, "slow-body", 1 * S_NS)          # never admitted (its body never came)
    k = ledger.request_start(i, "long-prefill", 1 * S_NS)
    ledger.request_engine(i, k, 2, 9, "long-prefill", 1 * S_NS)
    engine = {2: (int(S.PREFILLING), 9, 1 * S_NS)}
    (found,) = problems(ledger, engine, 12 * S_NS)
    assert (found.reason, found.request_id, found.slot) == ("no_response", "slow-body", -1)
    ledger.request_responding(i, j, 12 * S_NS)
    assert problems(ledger, engine, 13 * S_NS) == []


def test_a_client_that_wrote_after_the_server_began_closing_is_found_on_the_closed_connection(ledger):
    i = ledger.open("p", 1, 0)
    ledger.note_server_close(i, 5 * S_NS, "idle_close")
    ledger.note_in(i, 120, 5 * S_NS + 1, late=True)
    ledger.close_connection(i, "client_rst", 6 * S_NS)
    (found,) = problems(ledger, {}, 7 * S_NS)
    assert (found.reason, found.conn_id, found.row) == ("wrote_after_close", 1, -1)
    watch = ConnectionWatch()
    new, masks = watch.update([found])
    assert new == [found] and masks == {}   # a closed connection has no live row to flag
    assert watch.update(problems(ledger, {}, 8 * S_NS))[0] == []


def test_a_new_finding_lands_in_the_timeline_of_each_request_it_is_about(ledger, engine_id):
    from actors.monitor import record_http_problem
    from ipc import naming, recorder
    from ipc.recorder import Recorder, request_key
    from ipc.timeline import build_timeline

    ring = Recorder.create(naming.segment_name(engine_id, "rec"), num_writers=1, events_per_writer=64)
    recorder.install(ring, 0, 0)
    try:
        i = ledger.open("10.1.1.1", 4000, 0)
        for rid, slot in (("blocked-a", 3), ("blocked-b", 4)):
            j = ledger.request_start(i, rid, 1 * S_NS)
            ledger.request_engine(i, j, slot, 2, rid, 1 * S_NS)
            ledger.request_responding(i, j, 2 * S_NS)
        ledger.note_blocked(i, 5 * S_NS, socket_bytes=200_000)
        live = {3: (int(S.DECODING), 2, 2 * S_NS), 4: (int(S.DECODING), 2, 2 * S_NS)}
        (found,) = problems(ledger, live, 16 * S_NS)
        assert sorted(found.requests) == [(3, 2, "blocked-a"), (4, 2, "blocked-b")]
        record_http_problem(found)
        events = ring.events()
        for rid, slot in (("blocked-a", 3), ("blocked-b", 4)):
            mine = events[events["key"] == request_key(rid)]
            assert [(int(e["slot"]), int(e["generation"])) for e in mine] == [(slot, 2)]
            (event,) = build_timeline(mine, 17 * S_NS, request_id=rid)["events"]
            assert (event["kind"], event["reason"], event["connection"]) == ("http_problem", "write_blocked", 1)
            assert event["age_s"] == pytest.approx(11.0)
    finally:
        recorder.install(None, 0, 0)
        ring.close()
        ring.unlink()


def test_the_rows_held_by_connections_are_those_their_requests_in_progress_were_admitted_to(ledger):
    i = ledger.open("a", 1, 0)
    waiting = ledger.request_start(i, "not-admitted", 1)          # no row yet
    engine = ledger.request_start(i, "prefilling", 1)
    ledger.request_engine(i, engine, 4, 2, "prefilling", 2)
    k = ledger.open("b", 2, 0)
    writing = ledger.request_start(k, "slow-client", 1)
    ledger.request_engine(k, writing, 9, 6, "slow-client", 2)
    ledger.request_responding(k, writing, 3)
    done = ledger.request_start(k, "answered", 1)
    ledger.request_engine(k, done, 1, 1, "answered", 2)
    ledger.request_end(k, done, served=True)
    assert waiting >= 0 and held_by_connections(ledger.live_rows()) == {(4, 2), (9, 6)}
    ledger.close_connection(k, "client_fin", 4)
    assert held_by_connections(ledger.live_rows()) == {(4, 2)}
