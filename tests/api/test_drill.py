"""The watchdog fire drill's decisions (api/drill.py): which stages, when, and the verdict from what the driver saw
of its row. Plain code: no processes (tests/e2e/test_drill.py runs it on a real engine)."""
from __future__ import annotations

import numpy as np
import pytest

from api.drill import (EARLY, NEVER_REACHED, NOT_FIRED, OTHER_END, SLACK_S, DrillSchedule, Readmissions, Watch,
                       blocks_held, drill_holders, drill_id, drill_stages, gauges_held, judge)
from ipc.engine_status import DRILL_FAILURES, drill_problems
from ipc.lifecycle import RequestState as S

S_NS = 1_000_000_000
LIMIT_S, TICK_S = 1.0, 0.5
ALL = (S.QUEUED, S.PREFILLING, S.BOOTSTRAP, S.TRANSFERRING, S.DECODE_WAITING, S.DECODING)


def row(state, since_s: float, progress_s: float = 0.0, final_stage=S.FREE) -> dict:
    return {"state": state, "state_since_ns": int(since_s * S_NS), "last_progress_ns": int(progress_s * S_NS),
            "final_stage": final_stage}


def test_an_engine_of_both_sides_drills_every_stage_colocated_all_but_bootstrap_and_a_node_none():
    assert drill_stages("both", colocated=False) == ALL
    assert drill_stages("both", colocated=True) == tuple(s for s in ALL if s != S.BOOTSTRAP)
    assert drill_stages("prefill", colocated=False) == drill_stages("decode", colocated=False) == ()
    assert drill_id(S.DECODE_WAITING, 3) == "drill-decode_waiting-3"


def test_a_round_starts_one_interval_after_start_drills_each_stage_in_turn_and_the_next_an_interval_after_it():
    schedule = DrillSchedule((S.QUEUED, S.DECODING), interval_s=10, start_ns=0)
    assert schedule.next(9 * S_NS, busy=False) is None
    assert schedule.next(10 * S_NS, busy=False) == S.QUEUED
    assert schedule.next(10 * S_NS, busy=False) == S.QUEUED   # not done yet (e.g. not admitted): asked again
    schedule.done(S.QUEUED, 12 * S_NS)
    assert schedule.next(12 * S_NS, busy=True) is None         # busy: waits, keeps its place
    assert schedule.next(13 * S_NS, busy=False) == S.DECODING
    schedule.done(S.DECODING, 15 * S_NS)
    assert schedule.next(24 * S_NS, busy=False) is None         # the next round: an interval after the last drill
    assert schedule.next(25 * S_NS, busy=False) == S.QUEUED


def test_no_stages_or_a_zero_interval_never_drills():
    assert DrillSchedule((), 10, 0).next(100 * S_NS, False) is None
    assert DrillSchedule(ALL, 0, 0).next(100 * S_NS, False) is None


def watched(stage, *rows) -> Watch:
    watch = Watch(stage)
    for r in rows:
        watch.see(r)
    return watch


def test_a_timeout_in_the_stage_between_the_limit_and_the_limit_plus_a_tick_passes():
    watch = watched(S.TRANSFERRING, row(S.QUEUED, 1.0), row(S.TRANSFERRING, 2.0),
                    row(S.TIMED_OUT, 3.4, final_stage=S.TRANSFERRING))
    assert watch.reached and watch.start_ns == 2 * S_NS and judge(watch, LIMIT_S, TICK_S) == 0
    assert watch.give_up_ns(LIMIT_S, TICK_S) == int((2.0 + LIMIT_S + TICK_S + SLACK_S) * S_NS)


def test_the_deadline_counts_from_the_last_renewal_seen():
    watch = watched(S.DECODE_WAITING, row(S.DECODE_WAITING, 2.0), row(S.DECODE_WAITING, 2.0, progress_s=2.8),
                    row(S.TIMED_OUT, 3.9, final_stage=S.DECODE_WAITING))
    assert watch.start_ns == int(2.8 * S_NS) and judge(watch, LIMIT_S, TICK_S) == 0


@pytest.mark.parametrize("final_s, verdict", [(2.9, EARLY), (2.0 + LIMIT_S + TICK_S + SLACK_S + 0.01, NOT_FIRED)])
def test_a_timeout_before_the_limit_or_after_the_limit_plus_a_tick_fails(final_s, verdict):
    watch = watched(S.PREFILLING, row(S.PREFILLING, 2.0), row(S.TIMED_OUT, final_s, final_stage=S.PREFILLING))
    assert judge(watch, LIMIT_S, TICK_S) == verdict


def test_no_timeout_at_all_is_a_deadline_that_did_not_fire():
    watch = watched(S.QUEUED, row(S.QUEUED, 2.0), row(S.QUEUED, 2.0))
    assert watch.final is None and judge(watch, LIMIT_S, TICK_S) == NOT_FIRED
    assert "did not fire" in DRILL_FAILURES[NOT_FIRED - 1]


def test_a_row_that_never_reached_the_stage_or_ended_otherwise_fails():
    assert judge(watched(S.DECODING, row(S.QUEUED, 1.0)), LIMIT_S, TICK_S) == NEVER_REACHED
    assert judge(watched(S.DECODING, row(S.TIMED_OUT, 5.0, final_stage=S.QUEUED)), LIMIT_S, TICK_S) == NEVER_REACHED
    failed = watched(S.DECODING, row(S.DECODING, 2.0), row(S.FAILED, 2.5, final_stage=S.DECODING))
    assert judge(failed, LIMIT_S, TICK_S) == OTHER_END
    finished = watched(S.DECODING, row(S.DECODING, 2.0), row(S.FINISHED, 3.2, final_stage=S.DECODING))
    assert judge(finished, LIMIT_S, TICK_S) == OTHER_END


def test_what_a_drill_left_behind_its_slots_blocks_over_every_pool_and_any_actors_own_count():
    assert blocks_held([np.array([-1, 3, 3, 5]), np.array([3, -1])], 3) == 3
    assert blocks_held([np.array([-1, 4])], 3) == 0
    rows = [{"name": "prefill0", "own_gauges": [0, 0, 1, -1]}, {"name": "api", "own_gauges": [-1, -1, -1, -1]},
            {"name": "", "own_gauges": [5, 5, 5, 5]}]
    assert gauges_held(rows) == ["prefill0 prefill_inflight=1"]
    rows[0]["own_gauges"] = [0, 0, 0, -1]
    assert gauges_held(rows) == []


def test_a_failed_drills_holder_is_its_rows_engine_owner_else_the_actor_it_waits_at():
    """Actors 1 (prefill0) and 2 (decode0) are the engine's; 0 is the API, which owns a QUEUED row."""
    engine = (1, 2)
    assert drill_holders({"owner": 2, "prefill_actor": 1, "decode_actor": 2}, engine) == [2]
    assert drill_holders({"owner": 0, "prefill_actor": 1, "decode_actor": 2}, engine) == [1]
    assert drill_holders({"owner": 0, "prefill_actor": -1, "decode_actor": 2}, engine) == [2]   # colocated
    assert drill_holders(None, engine) == []   # never read: no stacks to take
    watch = Watch(S.QUEUED)
    watch.see({"state": S.QUEUED, "state_since_ns": 5, "last_progress_ns": 0, "owner": 0})
    assert watch.last["owner"] == 0   # the last read is kept for the holder


def test_a_failed_stage_is_one_problem_naming_the_stage_and_why():
    rec = {"drill_failing": [0] * 16}
    assert drill_problems(rec) == []
    rec["drill_failing"][int(S.TRANSFERRING)] = NOT_FIRED
    assert drill_problems(rec) == ["watchdog drill of stage transfer failed: " + DRILL_FAILURES[NOT_FIRED - 1]]


def test_a_drained_actors_readmission_drill_is_due_at_once_then_every_interval_until_readmitted():
    def actor(index, drained=0, drains=0, readmit_drain=0):
        return {"index": index, "name": f"decode{index}", "drained": drained, "drains": drains,
                "readmit_drain": readmit_drain}
    r = Readmissions(interval_s=10.0)
    assert r.due([actor(2), actor(3)], 0) is None
    drained = [actor(2), actor(3, drained=int(S.TRANSFERRING), drains=1)]
    assert r.due(drained, 5 * S_NS) == (3, 1, S.TRANSFERRING)
    r.tried(3, 1, 5 * S_NS)
    assert r.due(drained, 14 * S_NS) is None
    assert r.due(drained, 15 * S_NS) == (3, 1, S.TRANSFERRING)
    # the drill passed (the API named drain 1): not due again while the monitor readmits it
    assert r.due([actor(2), actor(3, drained=int(S.TRANSFERRING), drains=1, readmit_drain=1)], 30 * S_NS) is None
    # a new drain is due at once, whatever the last one's tries
    redrained = [actor(2), actor(3, drained=int(S.DECODING), drains=2, readmit_drain=1)]
    assert r.due(redrained, 31 * S_NS) == (3, 2, S.DECODING)
