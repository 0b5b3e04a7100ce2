"""Stage-aware ejection's decisions (actors/ejection.py): which actor is drained after repeated timeouts of one
stage, never the last serving one of its role, never for a drill; the blamed actor per stage; the readmission
drill's stage. Plain synchronous code: no processes."""
from __future__ import annotations

import pytest

from actors.ejection import Ejection, drain_problems, readmit_stage, row_drain, stage_actor
from actors.topology import NO_ACTOR, Topology
from api.drill import drill_stages
from ipc.lifecycle import RequestState as S

S_NS = 1_000_000_000
TOPO = Topology(2, 2)   # prefill0 prefill1 decode0 decode1 api monitor
ROLES = {i: TOPO.role(i) for i in TOPO.prefill + TOPO.decode}
DECODE1 = 3
EVERYONE = (0, 1, 2, 3)


def ejection(timeouts: int = 3, window_s: float = 60.0) -> Ejection:
    return Ejection(TOPO.names, ROLES, timeouts, window_s)


def test_three_transfer_timeouts_in_the_window_drain_the_actor_with_its_reason():
    e = ejection()
    assert e.record(DECODE1, S.TRANSFERRING, 1 * S_NS, "a", EVERYONE) == (None, None)
    assert e.record(DECODE1, S.TRANSFERRING, 2 * S_NS, "b", EVERYONE) == (None, None)
    drain, note = e.record(DECODE1, S.TRANSFERRING, 3 * S_NS, "c", EVERYONE)
    assert note is None and (drain.actor, drain.stage, drain.timeouts) == (DECODE1, S.TRANSFERRING, 3)
    assert drain.reason == "decode1 drained: 3 transfer timeouts in 60 s"
    assert e.drained == {DECODE1: drain}
    assert e.record(DECODE1, S.TRANSFERRING, 4 * S_NS, "d", EVERYONE) == (None, None)   # drained already


def test_timeouts_older_than_the_window_or_of_other_stages_or_actors_do_not_add_up():
    e = ejection(window_s=10.0)
    e.record(DECODE1, S.TRANSFERRING, 0, "a", EVERYONE)
    e.record(DECODE1, S.TRANSFERRING, 5 * S_NS, "b", EVERYONE)
    e.record(DECODE1, S.DECODING, 6 * S_NS, "c", EVERYONE)       # another stage
    e.record(2, S.TRANSFERRING, 7 * S_NS, "d", EVERYONE)         # another actor
    assert e.record(DECODE1, S.TRANSFERRING, 11 * S_NS, "e", EVERYONE) == (None, None)   # "a" left the window
    drain, _ = e.record(DECODE1, S.TRANSFERRING, 12 * S_NS, "f", EVERYONE)
    assert drain is not None and drain.reason == "decode1 drained: 3 transfer timeouts in 10 s"


def test_drill_timeouts_and_actors_outside_the_engine_never_count():
    e = ejection(timeouts=1)
    assert e.record(DECODE1, S.TRANSFERRING, S_NS, "drill-transfer-1", EVERYONE) == (None, None)
    assert e.record(TOPO.api, S.QUEUED, S_NS, "x", EVERYONE) == (None, None)
    assert e.record(NO_ACTOR, S.QUEUED, S_NS, "x", EVERYONE) == (None, None)
    assert e.drained == {}


def test_the_last_serving_actor_of_a_role_keeps_serving_and_says_so_once_per_window():
    e = ejection(timeouts=2, window_s=10.0)
    serving = (0, 1, DECODE1)   # decode0 is not serving (hung, dead or drained)
    e.record(DECODE1, S.TRANSFERRING, 1 * S_NS, "a", serving)
    drain, note = e.record(DECODE1, S.TRANSFERRING, 2 * S_NS, "b", serving)
    assert drain is None and "decode1 drained: 2 transfer timeouts in 10 s is due" in note
    assert "last serving decode actor" in note and e.drained == {}
    assert e.record(DECODE1, S.TRANSFERRING, 3 * S_NS, "c", serving) == (None, None)   # said already
    drain, note = e.record(DECODE1, S.TRANSFERRING, 4 * S_NS, "d", EVERYONE)   # decode0 serves again
    assert note is None and drain.timeouts == 4
    # the other role's actors do not count as another serving one
    assert ejection(timeouts=1).record(0, S.PREFILLING, S_NS, "e", (0, 2, 3))[0] is None


def test_readmission_ends_the_drain_and_starts_the_count_over():
    e = ejection(timeouts=2)
    e.record(DECODE1, S.TRANSFERRING, 1 * S_NS, "a", EVERYONE)
    drain, _ = e.record(DECODE1, S.TRANSFERRING, 2 * S_NS, "b", EVERYONE)
    assert e.readmit(DECODE1) == drain and e.drained == {} and e.readmit(DECODE1) is None
    assert e.record(DECODE1, S.TRANSFERRING, 3 * S_NS, "c", EVERYONE) == (None, None)
    assert e.record(DECODE1, S.TRANSFERRING, 4 * S_NS, "d", EVERYONE)[0] is not None


@pytest.mark.parametrize("state, expected", [(S.QUEUED, 1), (S.PREFILLING, 1), (S.BOOTSTRAP, 3),
                                             (S.TRANSFERRING, 3), (S.DECODE_WAITING, 3), (S.DECODING, 3)])
def test_queue_and_prefill_blame_the_prefill_actor_and_later_stages_the_decode_actor(state, expected):
    assert stage_actor(state, 1, 3) == expected
    assert stage_actor(state, NO_ACTOR, 3) == 3   # colocated: the decode actor prefills


def test_a_readmission_drill_runs_in_the_stage_after_the_drained_one_or_in_the_last():
    both = drill_stages("both", colocated=False)
    assert readmit_stage(S.TRANSFERRING, both) == S.DECODE_WAITING
    assert readmit_stage(S.QUEUED, both) == S.PREFILLING
    assert readmit_stage(S.DECODING, both) == S.DECODING
    assert readmit_stage(S.PREFILLING, drill_stages("both", colocated=True)) == S.TRANSFERRING   # no bootstrap
    with pytest.raises(ValueError, match="no drill stages"):
        readmit_stage(S.DECODING, ())


def test_a_drained_rows_reason_is_rebuilt_from_the_actor_table_fields():
    rows = [{"name": "decode0", "drained": 0, "drain_timeouts": 0},
            {"name": "decode1", "drained": int(S.TRANSFERRING), "drain_timeouts": 3}, {"name": "", "drained": 0}]
    assert row_drain(rows[0], 60.0) is None
    assert row_drain(rows[1], 60.0) == "decode1 drained: 3 transfer timeouts in 60 s"
    assert drain_problems(rows, 60.0) == ["decode1 drained: 3 transfer timeouts in 60 s"]


def test_a_drained_actor_is_readmitted_by_its_passing_drill_or_without_drills_after_the_cool_down():
    e = ejection(timeouts=1)
    drain, _ = e.record(DECODE1, S.TRANSFERRING, 10 * S_NS, "a", EVERYONE)
    assert drain.since_ns == 10 * S_NS
    assert e.readmit_due(DECODE1, False, 1000 * S_NS, None) is None         # drills: only a passing one readmits
    assert e.readmit_due(DECODE1, True, 11 * S_NS, None) == "a passing readmission drill"
    assert e.readmit_due(DECODE1, False, 309 * S_NS, 300.0) is None         # no drills: the cool-down
    assert e.readmit_due(DECODE1, False, 310 * S_NS, 300.0) == "eject_readmit_s=300 drained (no drills run here)"
    assert e.readmit_due(2, True, 310 * S_NS, 300.0) is None                # not drained
