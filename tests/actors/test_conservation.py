"""Conservation by identity (actors/conservation.py): row lives held twice or with no handle above, per-connection
counts against the ledger's, findings reported once they persist. Plain synchronous code over snapshots."""
from __future__ import annotations

import time

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.conservation import (InFlightFinding, Persisting, find_id_violations, find_inflight_mismatches,
                                 ledger_waits)
from ipc.ledger import LEDGER_VIEW_DTYPE
from ipc.state_table import ROW_DTYPE, RequestState as S


def table_of(lives, size: int = 16) -> np.ndarray:
    """A snapshot with ``lives``: ``(slot, generation, request_id, state)`` each; the other rows FREE."""
    rows = np.zeros(size, dtype=ROW_DTYPE)
    for slot, generation, rid, state in lives:
        rows[slot]["state"], rows[slot]["generation"] = int(state), generation
        rows[slot]["request_id"], rows[slot]["created_ns"] = rid.encode(), 100
    return rows


# a consistent world: every live row has its handle; ids repeat (a client's reused X-Request-Id, the n choices)
worlds = st.lists(st.tuples(st.sampled_from(["a", "b", "chat-1"]), st.sampled_from([S.QUEUED, S.DECODING,
                                                                                  S.FINISHED])),
                  max_size=12)


@given(worlds)
@settings(max_examples=60, deadline=None)
def test_a_table_whose_every_live_row_has_its_handle_is_conserved_however_ids_repeat(world):
    lives = [(slot, 3 + slot, rid, state) for slot, (rid, state) in enumerate(world)]
    handles = [(slot, generation, rid) for slot, generation, rid, _ in lives]
    assert find_id_violations(handles, table_of(lives), since_ns=0) == []


@given(worlds.filter(bool), st.data())
@settings(max_examples=60, deadline=None)
def test_a_duplicated_row_names_its_id_held_twice_in_the_table_and_its_extra_row(world, data):
    lives = [(slot, 3 + slot, rid, state) for slot, (rid, state) in enumerate(world)]
    handles = [(slot, generation, rid) for slot, generation, rid, _ in lives]
    copied = data.draw(st.sampled_from(lives))
    extra = (15, 9, copied[2], S.QUEUED)   # the same id again, a row no handle holds
    (finding,) = find_id_violations(handles, table_of(lives + [extra]), since_ns=0)
    same = sum(1 for life in lives if life[2] == copied[2])
    assert (finding.kind, finding.layer, finding.request_id, finding.lives) == ("id_twice", "table", copied[2],
                                                                                ((15, 9),))
    assert (finding.rows, finding.handles) == (same + 1, same)
    assert "held twice in the state table" in finding.message() and copied[2] in finding.message()


def test_a_live_row_no_handle_holds_is_an_orphan_and_a_predecessors_row_is_not_judged():
    rows = table_of([(1, 4, "lonely", S.DECODING), (2, 5, "old", S.FINISHED)])
    rows[2]["created_ns"] = 50   # before this API process started (since_ns 80): the monitor's to reclaim
    (finding,) = find_id_violations([], rows, since_ns=80)
    assert (finding.kind, finding.request_id, finding.lives) == ("id_orphan", "lonely", ((1, 4),))
    assert "no API handle" in finding.message()


def test_two_handles_on_one_row_life_and_two_connections_waiting_on_one_are_held_twice():
    rows = table_of([(1, 4, "x", S.DECODING)])
    findings = find_id_violations([(1, 4, "x"), (1, 4, "x")], rows, waits=[(7, 1, 4), (8, 1, 4)])
    assert [(f.kind, f.layer, f.request_id) for f in findings] == [("id_twice", "api", "x"),
                                                                   ("id_twice", "connection", "x")]


def test_an_id_longer_than_the_tables_40_bytes_matches_its_truncated_row():
    rid = "r" * 60
    rows = table_of([(1, 4, rid[:40], S.DECODING)])
    assert find_id_violations([(1, 4, rid)], rows) == []
    rows = table_of([(1, 4, rid[:40], S.DECODING), (2, 1, rid[:40], S.QUEUED)])
    (finding,) = find_id_violations([(1, 4, rid)], rows)
    assert finding.kind == "id_twice" and finding.handles == 1


def ledger_rows(*specs) -> np.ndarray:
    """Live ledger rows: ``(index, conn_id, streams_open, [(phase, slot, generation, request_id)])`` each."""
    out = np.zeros(len(specs), dtype=LEDGER_VIEW_DTYPE)
    for r, (index, conn_id, streams, entries) in enumerate(specs):
        out[r]["index"], out[r]["conn_id"], out[r]["streams_open"] = index, conn_id, streams
        out[r]["req_slot"] = -1
        for j, (phase, slot, generation, rid) in enumerate(entries):
            out[r]["req_phase"][j], out[r]["req_slot"][j] = phase, slot
            out[r]["req_generation"][j], out[r]["req_id"][j] = generation, rid.encode()
    return out


def test_ledger_waits_are_the_entries_naming_an_engine_row():
    live = ledger_rows((0, 11, 2, [(2, 5, 1, "a"), (1, -1, 0, "b")]), (3, 12, 1, [(3, 6, 2, "c")]))
    assert ledger_waits(live).tolist() == [[11, 5, 1], [12, 6, 2]]


def test_a_connection_whose_ledger_count_is_not_the_apis_is_named_with_its_peer_and_ids():
    live = ledger_rows((0, 11, 2, [(2, 5, 1, "a"), (1, -1, 0, "drifted")]), (3, 12, 1, [(3, 6, 2, "c")]))
    api = {0: (11, "127.0.0.1:5000", ["a"]), 3: (12, "127.0.0.1:5001", ["c"])}
    (finding,) = find_inflight_mismatches(api, live)
    assert finding == InFlightFinding(0, 11, "127.0.0.1:5000", 1, 2, ("a",), ("a", "drifted"))
    assert "127.0.0.1:5000" in finding.message() and "drifted" in finding.message()
    reused = {0: (10, "127.0.0.1:4999", [])}   # the row now holds another connection: not judged
    assert find_inflight_mismatches(reused, live) == []
    torn = live.copy()
    torn["torn"][0] = 1
    assert find_inflight_mismatches(api, torn) == []


def test_a_finding_is_reported_on_its_second_consecutive_check_once_and_again_after_it_cleared():
    check = Persisting(2)
    assert check.update({"k": 1}) == []          # a request starting between two reads: seen once
    assert check.update({}) == []
    assert check.update({"k": 1}) == []
    assert check.update({"k": 1, "j": 2}) == [1]
    assert check.update({"k": 1, "j": 2}) == [2]
    assert check.update({"k": 1, "j": 2}) == []   # once while it stands
    assert check.update({"j": 2}) == []
    assert check.update({"k": 1, "j": 2}) == [] and check.update({"k": 1}) == [1]


def test_the_id_check_at_256_live_rows_costs_well_under_a_millisecond():
    """The API runs it every tick: 256 live rows (a loaded engine), every one with its handle and a ledger wait."""
    lives = [(slot, slot + 1, f"chatcmpl-{slot:08x}", S.DECODING) for slot in range(256)]
    rows = table_of(lives, size=512)
    handles = [(s, g, rid) for s, g, rid, _ in lives]
    waits = [(1000 + s, s, g) for s, g, _, _ in lives]
    best = min(_timed(lambda: find_id_violations(handles, rows, 0, waits)) for _ in range(20))
    assert best < 10e-3, f"{best * 1e6:.0f} us"   # measured ~0.3 ms here (docs/performance.md)


def _timed(fn) -> float:
    start = time.perf_counter()
    assert fn() == []
    return time.perf_counter() - start
