from __future__ import annotations

import pickle
import time

import numpy as np
import pytest

import ipc_children as kids
from ipc import naming
from ipc.state_table import (ALLOWED, FINAL_STATES, LIVE_STATES, ROW_DTYPE, RequestState, StateTable,
                             check_transition, is_final)
from pdserve.errors import StateTableFullError

pytestmark = pytest.mark.timeout(60)

S = RequestState
HAPPY_PATH = [S.QUEUED, S.PREFILLING, S.BOOTSTRAP, S.TRANSFERRING, S.DECODE_WAITING, S.DECODING, S.FINISHED]


@pytest.fixture
def table(name):
    t = StateTable.create(name("req"), 16)
    try:
        yield t
    finally:
        t.close()
        t.unlink()


def walk_to(table: StateTable, state: RequestState, rid: str = "chatcmpl-x") -> tuple[int, int]:
    """A fresh row moved along the happy path up to ``state`` (or to QUEUED's ending ``state``)."""
    slot, gen = table.allocate(rid, prompt_tokens=10)
    if state in (S.ABORTED, S.TIMED_OUT, S.FAILED):
        assert table.transition(slot, gen, state)
        return slot, gen
    for nxt in HAPPY_PATH[1:HAPPY_PATH.index(state) + 1]:
        assert table.transition(slot, gen, nxt)
    return slot, gen


def test_the_lifecycle_map_matches_the_design():
    assert FINAL_STATES == {S.FINISHED, S.ABORTED, S.TIMED_OUT, S.FAILED}
    assert LIVE_STATES == set(HAPPY_PATH[:-1])
    for a, b in zip(HAPPY_PATH, HAPPY_PATH[1:]):
        assert b in ALLOWED[a]
    # one way forward; BOOTSTRAP also ends FINISHED on a prefill node (handed across), PREFILLING for an embedding
    for s in LIVE_STATES:
        assert {S.ABORTED, S.TIMED_OUT, S.FAILED} <= ALLOWED[s]
        assert len(ALLOWED[s]) == 4 + (s in (S.BOOTSTRAP, S.PREFILLING))
    assert S.FINISHED in ALLOWED[S.BOOTSTRAP] and S.FINISHED in ALLOWED[S.PREFILLING]
    for s in FINAL_STATES | {S.FREE}:
        assert ALLOWED[s] == frozenset()
    assert [is_final(s) for s in S] == [s in FINAL_STATES for s in S]


def test_a_row_starts_queued_or_at_bootstrap_and_nowhere_else(table):
    slot, gen = table.allocate("remote-1", prompt_tokens=5, state=S.BOOTSTRAP, decode_actor=1)
    assert table.row(slot)["state"] == S.BOOTSTRAP and table.transition(slot, gen, S.TRANSFERRING)
    for state in (S.FREE, S.PREFILLING, S.DECODING, S.FINISHED):
        with pytest.raises(ValueError, match="cannot start in"):
            table.allocate("nope", prompt_tokens=1, state=state)


def test_a_request_walks_the_happy_path_with_fresh_stamps(table):
    slot, gen = table.allocate("chatcmpl-abc", prompt_tokens=12, deadline_ns=123)
    row = table.row(slot)
    got = (row["state"], row["generation"], row["request_id"], row["prompt_tokens"])
    assert got == (S.QUEUED, gen, "chatcmpl-abc", 12)
    assert row["deadline_ns"] == 123 and row["owner"] == -1 and row["created_ns"] == row["state_since_ns"] > 0
    last = row["state_since_ns"]
    for nxt in HAPPY_PATH[1:]:
        assert table.transition(slot, gen, nxt, owner=3)
        row = table.row(slot)
        assert row["state"] == nxt and row["owner"] == 3
        assert row["state_since_ns"] >= last and row["last_progress_ns"] == row["state_since_ns"]
        assert row["state_since_ns"] <= time.monotonic_ns()
        last = row["state_since_ns"]
    assert row["final_stage"] == S.DECODING


def test_every_transition_outside_the_map_raises_value_error(table):
    for cur in sorted(LIVE_STATES):
        for new in S:
            if new in ALLOWED[cur]:
                continue
            slot, gen = walk_to(table, cur)
            with pytest.raises(ValueError, match=f"{cur.name} -> {new.name} is not allowed"):
                table.transition(slot, gen, new)
            assert table.row(slot)["state"] == cur  # unchanged
            table.transition(slot, gen, S.ABORTED)
            table.release(slot, gen)
    with pytest.raises(ValueError):
        check_transition(S.QUEUED, S.DECODING)


def test_a_final_state_is_terminal(table):
    for final in sorted(FINAL_STATES):
        slot, gen = walk_to(table, final)
        stamp = table.row(slot)["state_since_ns"]
        for new in S:
            assert table.transition(slot, gen, new) is False  # dropped, never raises
        row = table.row(slot)
        assert row["state"] == final and row["state_since_ns"] == stamp


def test_a_move_by_a_role_the_lifecycle_does_not_name_raises_and_changes_nothing(table):
    slot, gen = walk_to(table, RequestState.DECODE_WAITING)
    with pytest.raises(ValueError, match="may not move"):
        table.transition(slot, gen, RequestState.DECODING, by="api")
    assert table.row(slot)["state"] == RequestState.DECODE_WAITING
    assert table.transition(slot, gen, RequestState.DECODING, by="decode")
    assert table.transition(slot, gen, RequestState.FINISHED, by="api")   # a stop string


def test_timeouts_record_the_stage_they_interrupted(table):
    slot, gen = walk_to(table, S.TRANSFERRING)
    assert table.transition(slot, gen, S.TIMED_OUT, error_code=504)
    row = table.row(slot)
    assert (row["state"], row["final_stage"], row["error_code"]) == (S.TIMED_OUT, S.TRANSFERRING, 504)


def test_a_stale_generation_is_rejected_everywhere(name):
    t = StateTable.create(name("one"), 1)
    try:
        slot, old = t.allocate("first", prompt_tokens=1)
        assert t.transition(slot, old, S.ABORTED) and t.release(slot, old)
        slot2, new = t.allocate("second", prompt_tokens=1)
        assert (slot2, new) == (slot, old + 1)
        assert t.transition(slot, old, S.PREFILLING) is False
        assert t.update(slot, old, output_tokens=5) is False
        assert t.release(slot, old) is False
        assert t.read(slot, old) is None
        assert t.read(slot, new)["request_id"] == "second"
        assert t.row(slot)["state"] == S.QUEUED and t.row(slot)["output_tokens"] == 0
    finally:
        t.close()
        t.unlink()


def test_expect_guards_a_transition(table):
    slot, gen = walk_to(table, S.PREFILLING)
    assert table.transition(slot, gen, S.TIMED_OUT, expect=S.QUEUED) is False
    assert table.transition(slot, gen, S.TIMED_OUT, expect={S.QUEUED, S.BOOTSTRAP}) is False
    assert table.transition(slot, gen, S.TIMED_OUT, expect=frozenset({S.PREFILLING}))


def test_update_sets_counters_only_on_a_current_row(table):
    slot, gen = walk_to(table, S.DECODING)
    assert table.update(slot, gen, output_tokens=7, decode_blocks=2, prefill_blocks=3, n_transfers=1,
                        last_progress_ns=99, owner=4)
    row = table.row(slot)
    assert (row["output_tokens"], row["decode_blocks"], row["prefill_blocks"], row["n_transfers"],
            row["last_progress_ns"], row["owner"], row["state"]) == (7, 2, 3, 1, 99, 4, S.DECODING)
    with pytest.raises(ValueError, match="transition"):
        table.update(slot, gen, state=S.FINISHED)
    with pytest.raises(OverflowError):
        table.update(slot, gen, owner=200)
    assert table.row(slot)["owner"] == 4
    table.transition(slot, gen, S.FINISHED)
    assert table.update(slot, gen, output_tokens=8)  # final rows still take counters
    table.release(slot, gen)
    assert table.update(slot, gen, output_tokens=9) is False  # FREE


def test_release_frees_only_final_rows(table):
    slot, gen = walk_to(table, S.DECODING)
    assert table.release(slot, gen) is False
    assert table.transition(slot, gen, S.FAILED)
    assert table.release(slot, gen) is True
    assert table.release(slot, gen) is False
    assert table.row(slot)["state"] == S.FREE


def test_a_full_table_raises_state_table_full(table):
    rows = [table.allocate(f"r{i}", prompt_tokens=1) for i in range(16)]
    assert len({s for s, _ in rows}) == 16
    with pytest.raises(StateTableFullError):
        table.allocate("one too many", prompt_tokens=1)
    table.transition(*rows[5], S.ABORTED)
    table.release(*rows[5])
    assert table.allocate("fits", prompt_tokens=1)[0] == rows[5][0]


def test_counts_and_live_slots_match_the_rows(table):
    expected = {s: 0 for s in S}
    live = []
    for i, target in enumerate([S.QUEUED, S.PREFILLING, S.DECODING, S.DECODING, S.FINISHED, S.TIMED_OUT,
                                S.BOOTSTRAP, S.FAILED]):
        slot, _ = walk_to(table, target, rid=f"r{i}")
        expected[target] += 1
        if target in LIVE_STATES:
            live.append(slot)
    expected[S.FREE] = 16 - 8
    assert table.count_by_state() == expected
    assert table.live_slots() == sorted(live)
    assert table.find("r2") == [(2, 1)]
    assert table.snapshot().dtype == ROW_DTYPE and ROW_DTYPE.itemsize == 128


def test_count_by_state_and_live_slots_over_10000_rows_match_the_rows(name):
    """Correctness at the monitor's scale; the timings are printed, not asserted (speed claims live in
    bench/ipc, measured against a baseline in the same run)."""
    t = StateTable.create(name("big"), 10_000)
    try:
        rng = np.random.default_rng(0)
        states = rng.integers(0, len(S), size=10_000).astype(np.uint8)
        t.rows["state"][:] = states  # direct fill: the test is about reading
        best = min(_timed(t.count_by_state) for _ in range(20))
        print(f"\ncount_by_state over 10,000 rows: {best * 1e6:.0f} us (best of 20)")
        assert t.count_by_state() == {s: int((states == s).sum()) for s in S}
        best_live = min(_timed(t.live_slots) for _ in range(20))
        print(f"live_slots over 10,000 rows: {best_live * 1e6:.0f} us (best of 20)")
        live = np.isin(states, [int(s) for s in LIVE_STATES])
        assert t.live_slots() == np.flatnonzero(live).tolist() and 0 < live.sum() < 10_000
    finally:
        t.close()
        t.unlink()


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_a_readonly_attach_reads_but_cannot_write(table):
    slot, gen = walk_to(table, S.DECODING)
    ro = StateTable.attach(table.name, readonly=True)
    try:
        assert ro.row(slot)["state"] == S.DECODING and ro.read(slot, gen) is not None
        assert ro.count_by_state()[S.DECODING] == 1
        with pytest.raises(ValueError, match="read-only"):
            ro.rows["state"][slot] = S.FINISHED
        with pytest.raises(PermissionError):
            ro.transition(slot, gen, S.FINISHED)
        with pytest.raises(PermissionError):
            ro.allocate("x", prompt_tokens=1)
        with pytest.raises(PermissionError):
            ro.update(slot, gen, output_tokens=1)
        assert pickle.loads(pickle.dumps(ro)).readonly is True
        assert table.row(slot)["state"] == S.DECODING
    finally:
        ro.close()


def test_racing_timeout_and_completion_have_exactly_one_winner_per_row(name, ctx):
    """Two processes, both ready before the start, walk the same 1000 DECODING rows from opposite ends (one
    times them out, one finishes them): they meet in the middle, so each wins some rows, and every row has
    exactly one winner whose state it holds."""
    t = StateTable.create(name("race"), 1000)
    results, start = ctx.Queue(), ctx.Event()
    procs = []
    try:
        rows = [walk_to(t, S.DECODING, rid=f"r{i}") for i in range(1000)]
        orders = {S.TIMED_OUT: rows, S.FINISHED: rows[::-1]}
        readies = [ctx.Event() for _ in orders]
        procs = [ctx.Process(target=kids.st_racer, args=(t, order, int(state), ready, start, results))
                 for (state, order), ready in zip(orders.items(), readies)]
        for p in procs:
            p.start()
        assert all(ready.wait(kids.JOIN_TIMEOUT_S) for ready in readies), "a racer never got ready"
        start.set()
        won = dict(results.get(timeout=20) for _ in procs)
        assert kids.join_all(procs) == [0, 0]
        timed_out, finished = set(won[int(S.TIMED_OUT)]), set(won[int(S.FINISHED)])
        print(f"\nrace over 1000 rows: TIMED_OUT won {len(timed_out)}, FINISHED won {len(finished)}")
        assert timed_out and finished, "one side won every row: the children did not race"
        assert len(won[int(S.TIMED_OUT)]) + len(won[int(S.FINISHED)]) == 1000, "a row had two winners"
        assert not timed_out & finished
        assert timed_out | finished == {slot for slot, _ in rows}
        for slot, _ in rows:
            row = t.row(slot)
            assert row["state"] == (S.TIMED_OUT if slot in timed_out else S.FINISHED)
            assert row["final_stage"] == S.DECODING
    finally:
        kids.join_all(procs, 5)
        t.close()
        t.unlink()


def test_a_writer_killed_holding_the_lock_does_not_wedge_the_table(name, ctx):
    t = StateTable.create(name("dead"), 4, lock_timeout_s=0.2)
    try:
        slot, gen = t.allocate("r", prompt_tokens=1)
        p = ctx.Process(target=kids.st_die_holding_lock, args=(t.name,))
        p.start()
        assert kids.join_all([p]) == [0]
        t0 = time.monotonic()
        assert t.transition(slot, gen, S.PREFILLING)
        assert time.monotonic() - t0 < 1.0
        assert t.transition(slot, gen, S.BOOTSTRAP)  # and the lock works normally afterwards
    finally:
        t.close()
        t.unlink()


def test_unlink_removes_the_table_and_its_lock(name, engine_id):
    t = StateTable.create(name("gone"), 4)
    assert len(naming.list_engine_segments(engine_id)) == 3
    with pytest.raises(PermissionError):
        StateTable.attach(t.name).unlink()
    t.close()
    t.unlink()
    t.unlink()
    assert naming.list_engine_segments(engine_id) == []
    with pytest.raises(FileNotFoundError):
        StateTable.attach(t.name)


def test_consistent_rows_returns_whole_rows_for_the_slots_asked(table):
    slot, gen = table.allocate("req-consistent", prompt_tokens=3)
    assert table.transition(slot, gen, RequestState.PREFILLING, owner=0)
    rows = table.consistent_rows([slot])
    assert rows.shape == (1,) and int(rows[0]["state"]) == RequestState.PREFILLING
    assert int(rows[0]["generation"]) == gen and rows[0]["state_since_ns"] > 0
    assert rows[0]["request_id"] == b"req-consistent"


def test_live_keys_names_each_live_row_with_its_generation_and_no_final_or_free_one(table):
    live = table.allocate("a", prompt_tokens=3)
    done = table.allocate("b", prompt_tokens=3)
    freed = table.allocate("c", prompt_tokens=3)
    for slot, generation in (done, freed):
        assert table.transition(slot, generation, RequestState.ABORTED)
    assert table.release(*freed)
    assert table.live_keys() == {live}
    again = table.allocate("d", prompt_tokens=3)   # the freed slot comes back with another generation
    assert table.live_keys() == {live, again} and again != freed
