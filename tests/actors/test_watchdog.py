"""The watchdog's decisions over state-table snapshots: deadlines per stage, bad timestamps, stuck gauges,
dead versus hung actors. Plain synchronous code: no processes needed."""
from __future__ import annotations

import numpy as np

from actors.watchdog import StuckGaugeTracker, classify_actor, find_expired
from ipc.actor_table import ActorHealth
from ipc.state_table import ROW_DTYPE, RequestState as S
from pdserve.config import load_config

S_NS = 1_000_000_000
CONFIG = load_config(None, {"PDSERVE_INFLIGHT_TIMEOUT_S": "2", "PDSERVE_DECODE_STALL_TIMEOUT_S": "5",
                            "PDSERVE_REQUEST_TIMEOUT_S": "100"}).config


def rows(*specs) -> np.ndarray:
    table = np.zeros(len(specs) + 2, dtype=ROW_DTYPE)
    for slot, (state, since_s, extra) in enumerate(specs):
        table[slot]["state"] = int(state)
        table[slot]["state_since_ns"] = int(since_s * S_NS)
        table[slot]["created_ns"] = int(since_s * S_NS)
        table[slot]["generation"] = 7
        table[slot]["request_id"] = f"req-{slot}".encode()
        for key, value in extra.items():
            table[slot][key] = value
    return table


def test_a_transfer_past_inflight_timeout_expires_naming_the_stage():
    table = rows((S.TRANSFERRING, 10.0, {}), (S.TRANSFERRING, 11.5, {}))
    expired = find_expired(table, int(12.1 * S_NS), CONFIG)
    assert [(e.slot, e.stage, e.reason) for e in expired] == [(0, S.TRANSFERRING, "stage_deadline")]
    assert "stage transfer" in expired[0].message() and "inflight_timeout_s=2" in expired[0].message()
    assert abs(expired[0].age_s - 2.1) < 1e-6


def test_final_and_free_rows_never_expire():
    table = rows((S.FINISHED, 1.0, {}), (S.TIMED_OUT, 1.0, {}), (S.FREE, 0.0, {}))
    assert find_expired(table, 1000 * S_NS, CONFIG) == []


def test_decoding_deadline_counts_from_the_last_token():
    table = rows((S.DECODING, 10.0, {"last_progress_ns": 14 * S_NS}))
    assert find_expired(table, int(18 * S_NS), CONFIG) == []
    assert [e.reason for e in find_expired(table, int(19.5 * S_NS), CONFIG)] == ["stage_deadline"]


def test_every_live_stage_counts_from_its_last_renewal_and_an_unrenewed_one_from_entering_it():
    bootstrap_s, waiting_s = CONFIG.bootstrap_timeout_s, CONFIG.decode_waiting_timeout_s
    queue_s = CONFIG.queue_timeout_s
    renewed = 100.0
    table = rows((S.BOOTSTRAP, 10.0, {"last_progress_ns": int(renewed * S_NS)}),
                 (S.DECODE_WAITING, 10.0, {"last_progress_ns": int(renewed * S_NS)}),
                 (S.QUEUED, 10.0, {"last_progress_ns": int(renewed * S_NS)}),
                 (S.TRANSFERRING, 10.0, {"last_progress_ns": int(renewed * S_NS)}),   # blocks arrived at 100
                 (S.PREFILLING, 10.0, {"last_progress_ns": int(renewed * S_NS)}),     # a chunk finished at 100
                 (S.TRANSFERRING, 10.0, {"last_progress_ns": 10 * S_NS}),             # never moved
                 (S.PREFILLING, 10.0, {"last_progress_ns": 10 * S_NS}))
    soon = int((renewed + 0.5 * min(bootstrap_s, waiting_s, queue_s, CONFIG.inflight_timeout_s)) * S_NS)
    # renewed rows are inside their stage deadline; the rows that made no progress count from entering the state
    assert [(e.slot, e.stage) for e in find_expired(table, soon, CONFIG)] == [(5, S.TRANSFERRING), (6, S.PREFILLING)]
    late = int((renewed + max(bootstrap_s, waiting_s, queue_s, CONFIG.inflight_timeout_s,
                              CONFIG.prefill_timeout_s) + 1) * S_NS)
    assert {e.slot for e in find_expired(table, late, CONFIG)} == {0, 1, 2, 3, 4, 5, 6}
    stale = rows((S.BOOTSTRAP, 50.0, {"last_progress_ns": 10 * S_NS}))   # a renewal older than the state counts not
    assert [e.slot for e in find_expired(stale, int((50 + bootstrap_s + 0.1) * S_NS), CONFIG)] == [0]


def test_zero_or_future_timestamps_are_reported_never_fresh():
    table = rows((S.QUEUED, 0.0, {}), (S.PREFILLING, 50.0, {}))
    expired = find_expired(table, 20 * S_NS, CONFIG)
    assert [(e.slot, e.reason) for e in expired] == [(0, "bad_timestamp"), (1, "bad_timestamp")]


def test_the_request_deadline_applies_in_every_stage():
    table = rows((S.QUEUED, 10.0, {"deadline_ns": 11 * S_NS}))
    assert [e.reason for e in find_expired(table, 12 * S_NS, CONFIG)] == ["request_deadline"]


def test_vectorized_scan_of_ten_thousand_rows_finds_exactly_the_expired_ones():
    table = np.zeros(10_000, dtype=ROW_DTYPE)
    table["state"] = int(S.DECODING)
    table["state_since_ns"] = 100 * S_NS
    table["last_progress_ns"] = 100 * S_NS
    table["state"][::1000] = int(S.TRANSFERRING)
    table["state_since_ns"][::1000] = 95 * S_NS
    table["last_progress_ns"][::1000] = 95 * S_NS   # transitions stamp both; no block arrived since
    expired = find_expired(table, 101 * S_NS, CONFIG)
    assert [(e.slot, e.stage, e.reason) for e in expired] == [(slot, S.TRANSFERRING, "stage_deadline")
                                                              for slot in range(0, 10_000, 1000)]


def test_a_gauge_is_stuck_only_while_nothing_leaves_its_stage():
    tracker = StuckGaugeTracker(stuck_gauge_s=3)
    table = rows((S.TRANSFERRING, 1.0, {}))
    assert not tracker.update(table, 1 * S_NS)["prefill_inflight"].stuck
    assert not tracker.update(table, 3 * S_NS)["prefill_inflight"].stuck
    assert tracker.update(table, 4 * S_NS)["prefill_inflight"].stuck
    assert tracker.oldest(table, "prefill_inflight") == (0, 1 * S_NS)
    moved = rows((S.DECODE_WAITING, 4.0, {}), (S.TRANSFERRING, 4.0, {}))
    assert not tracker.update(moved, 5 * S_NS)["prefill_inflight"].stuck  # slot 0 left the stage
    assert not tracker.update(rows(), 6 * S_NS)["prefill_inflight"].stuck


def test_running_gauge_is_not_stuck_while_tokens_flow():
    tracker = StuckGaugeTracker(stuck_gauge_s=1)
    for t in range(1, 6):
        table = rows((S.DECODING, 0.5, {"output_tokens": t}))
        assert not tracker.update(table, t * S_NS)["running"].stuck


def test_running_gauge_is_not_stuck_while_a_long_prompt_finishes_chunks_and_is_when_they_stop():
    """A 7,000-token prompt prefills for ~40 s on this machine: each finished chunk stamps last_progress_ns, which
    is movement; a forward pass that never returns stamps nothing and the gauge turns stuck."""
    tracker = StuckGaugeTracker(stuck_gauge_s=3)
    for t in range(1, 10):   # a chunk every 2 s
        table = rows((S.PREFILLING, 0.5, {"last_progress_ns": (t - t % 2) * S_NS}))
        assert not tracker.update(table, t * S_NS)["running"].stuck, t
    stalled = rows((S.PREFILLING, 0.5, {"last_progress_ns": 8 * S_NS}))
    assert not tracker.update(stalled, 10 * S_NS)["running"].stuck
    assert tracker.update(stalled, 11 * S_NS)["running"].stuck
    # a QUEUED row's renewals (the queue moving) are not its own progress: the queued gauge still turns stuck
    tracker = StuckGaugeTracker(stuck_gauge_s=3)
    for t in range(1, 6):
        queued = rows((S.QUEUED, 0.5, {"last_progress_ns": t * S_NS}))
        stuck = tracker.update(queued, t * S_NS)["queued"].stuck
    assert stuck


def test_dead_versus_hung_actors():
    now = 100 * S_NS
    assert classify_actor(123, False, True, now, now, 5) == ActorHealth.DEAD
    assert classify_actor(123, True, True, now - 6 * S_NS, now, 5) == ActorHealth.HUNG
    assert classify_actor(123, True, False, now - 60 * S_NS, now, 5) == ActorHealth.OK  # still loading
    assert classify_actor(123, True, True, now - 1 * S_NS, now, 5) == ActorHealth.OK
    assert classify_actor(0, False, False, 0, now, 5) == ActorHealth.UNKNOWN


# ---- N x M: a dead actor's rows are the ones naming it ------------------------------------------------------
def test_a_dead_decode_actor_holds_only_the_rows_that_name_it():
    from actors.topology import Topology
    from actors.monitor import held_mask

    topo = Topology(2, 2)   # prefill0=0, prefill1=1, decode0=2, decode1=3, api=4
    table = rows((S.DECODING, 1.0, {"prefill_actor": 0, "decode_actor": 2}),
                 (S.DECODING, 1.0, {"prefill_actor": 0, "decode_actor": 3}),
                 (S.BOOTSTRAP, 1.0, {"prefill_actor": 1, "decode_actor": 3}),
                 (S.QUEUED, 1.0, {"prefill_actor": 1, "decode_actor": 3}),
                 (S.FINISHED, 1.0, {"prefill_actor": 1, "decode_actor": 3}))
    # decode1 also answers for the QUEUED row routed to it: its KVReady would wait for decode1's restart
    assert np.flatnonzero(held_mask(table, topo, 3)).tolist() == [1, 2, 3]
    assert np.flatnonzero(held_mask(table, topo, 2)).tolist() == [0]
    assert np.flatnonzero(held_mask(table, topo, 1)).tolist() == [2, 3]   # BOOTSTRAP: prefill1 holds the KV
    assert np.flatnonzero(held_mask(table, topo, 0)).tolist() == []       # DECODING rows left prefill0 behind
    assert np.flatnonzero(held_mask(table, topo, 4)).tolist() == [0, 1, 2, 3]   # the API holds every live row


def test_a_colocated_decode_actor_holds_its_own_queued_rows():
    from actors.topology import Topology
    from actors.monitor import held_mask

    table = rows((S.QUEUED, 1.0, {"decode_actor": 0}), (S.PREFILLING, 1.0, {"decode_actor": 1}))
    assert np.flatnonzero(held_mask(table, Topology(0, 2), 0)).tolist() == [0]


def test_the_table_counts_every_unreleased_row_on_both_of_its_actors():
    from actors.monitor import table_counts_by_actor

    table = rows((S.DECODING, 1.0, {"prefill_actor": 0, "decode_actor": 2}),
                 (S.FINISHED, 1.0, {"prefill_actor": 1, "decode_actor": 2}),   # final, not yet released
                 (S.FREE, 1.0, {"prefill_actor": 1, "decode_actor": 3}))
    assert table_counts_by_actor(table, (0, 1, 2, 3)) == {0: 1, 1: 1, 2: 2, 3: 0}
    # an API restarted at 1.5 s: the FINISHED row its dead predecessor allocated at 1.0 s is nobody's count now
    table = rows((S.FINISHED, 1.0, {"prefill_actor": 0, "decode_actor": 2}),
                 (S.DECODING, 2.0, {"prefill_actor": 0, "decode_actor": 2}))
    assert table_counts_by_actor(table, (0, 2), since_ns=int(1.5 * S_NS)) == {0: 1, 2: 1}


def test_blocks_owned_while_their_actor_holds_no_request_are_named_on_the_second_check_once():
    from actors.prefix_cache import CACHE_OWNER, HANDBACK_OWNER
    from actors.watchdog import BlockConservation

    check = BlockConservation(checks=2)
    owners = np.array([-1, 5, CACHE_OWNER, HANDBACK_OWNER, 5, -1], dtype=np.int32)
    assert check.check(0, owners, holds_rows=lambda: True) == []        # a live request: its blocks are its own
    assert check.check(0, owners, holds_rows=lambda: False) == []       # first sight: it may free them on its next loop
    assert check.check(0, owners, holds_rows=lambda: False) == [(1, 5), (4, 5)]   # still there: leaked (cache, hand-back: not)
    assert check.check(0, owners, holds_rows=lambda: False) == []       # reported once
    assert check.check(0, owners, holds_rows=lambda: True) == []        # busy again, then idle: the same leak, not again
    assert check.check(0, owners, holds_rows=lambda: False) == [] and check.check(0, owners, holds_rows=lambda: False) == []
    more = owners.copy()
    more[5] = 9
    assert check.check(0, more, holds_rows=lambda: False) == []
    assert check.check(0, more, holds_rows=lambda: False) == [(1, 5), (4, 5), (5, 9)]   # a block added: reported anew
    assert check.check(1, more, holds_rows=lambda: False) == []         # per actor
    assert check.check(0, np.full(6, -1, dtype=np.int32), holds_rows=lambda: False) == []
    passing = BlockConservation(checks=2)   # a block freed between two checks is never reported
    assert passing.check(0, owners, holds_rows=lambda: False) == []
    assert passing.check(0, np.full(6, -1, dtype=np.int32), holds_rows=lambda: False) == []
    assert passing.check(0, owners, holds_rows=lambda: False) == []


def test_a_drill_row_in_the_stage_it_drills_has_the_drill_deadline_and_the_ordinary_ones_elsewhere():
    """api/drill.py: drill-<stage>-<n> times out after drill_timeout_s in that stage only; not a drill without
    drills on (drill_limit_ns 0); a client row's deadlines never change."""
    table = rows((S.TRANSFERRING, 10.0, {}), (S.QUEUED, 10.0, {}), (S.TRANSFERRING, 10.0, {}))
    table[0]["request_id"] = b"drill-transfer-1"
    table[1]["request_id"] = b"drill-transfer-2"   # not yet in the stage it drills
    now = int(11.5 * S_NS)   # 1.5 s in: past a 1 s drill deadline, inside inflight_timeout_s=2 and the queue's
    expired = find_expired(table, now, CONFIG, drill_limit_ns=S_NS)
    assert [(e.slot, e.drill, e.drill_deadline) for e in expired] == [(0, True, True)]
    assert "drill_timeout_s=1" in expired[0].message() and "stage transfer" in expired[0].message()
    assert find_expired(table, now, CONFIG) == []
    later = find_expired(table, int(12.5 * S_NS), CONFIG, drill_limit_ns=S_NS)
    assert [(e.slot, e.drill, e.drill_deadline) for e in later] == [(0, True, True), (2, False, False)]


def test_a_stage_deadlines_message_names_its_stage_for_the_router_and_a_request_deadlines_does_not():
    from actors.watchdog import timed_out_stage

    stage = find_expired(rows((S.TRANSFERRING, 10.0, {})), int(12.1 * S_NS), CONFIG)[0]
    assert timed_out_stage("decode node: " + stage.message()) == "transfer"
    whole = find_expired(rows((S.QUEUED, 10.0, {"deadline_ns": 11 * S_NS})), 12 * S_NS, CONFIG)[0]
    assert whole.reason == "request_deadline" and timed_out_stage(whole.message()) is None
    # a deadline shorter than request_timeout_s is the body's ``timeout``, and the message names that
    assert whole.message().endswith("(timeout=1)") and whole.limit_s == 1.0
    server = int((10 + CONFIG.request_timeout_s) * S_NS)
    decoding = {"deadline_ns": server, "last_progress_ns": server}   # its stage renewed: only the deadline is late
    default = find_expired(rows((S.DECODING, 10.0, decoding)), server + S_NS, CONFIG)[0]
    assert default.message().endswith(f"(request_timeout_s={CONFIG.request_timeout_s:g})")
    assert timed_out_stage(default.message()) is None
    assert timed_out_stage("the pool is full") is None
    assert timed_out_stage("request x timed out in stage nowhere after 1.00 s (x_s=1)") is None
