"""api/blame.py: X-Request-Start in the forms proxies write it, one request's split from its real handles, the
slow-peer decision, and the per-peer histogram and alarm through a real prometheus registry."""
from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, generate_latest

from api.admission import RequestHandle
from api.blame import (NONE_US, SLOW_OUTSIDE_S, SLOW_PEER_REQUESTS, SLOW_PEER_WINDOW_S, PeerBlame, SlowPeers,
                       outside_and_engine_s, proxy_wait_ns, split_of)

NOW_S = 1_800_000_000
NOW_NS = NOW_S * 10**9


def test_x_request_start_in_seconds_milliseconds_microseconds_and_nanoseconds():
    two_s = 2 * 10**9
    for value in (f"t={NOW_S - 2}.000", f"t={(NOW_S - 2) * 1000}", f"t={(NOW_S - 2) * 10**6}",
                  f"{(NOW_S - 2) * 10**9}", f"t={NOW_S - 2}"):
        assert proxy_wait_ns(value, NOW_NS) == two_s, value
    assert proxy_wait_ns(f"t={NOW_S}.5", NOW_NS) == 0        # half a second ahead: clock skew, no wait
    assert proxy_wait_ns(f"t={NOW_S + 5}", NOW_NS) is None     # far ahead: not this clock
    assert proxy_wait_ns(f"t={NOW_S - 7200}", NOW_NS) is None  # two hours: not a queue
    for junk in (None, "", "t=", "t=abc", "t=-5", "t=nan", "t=0"):
        assert proxy_wait_ns(junk, NOW_NS) is None, junk


def handle(admitted_ns: int, ended_ns: int = 0) -> RequestHandle:
    h = RequestHandle(None, 0, 1, admitted_ns=admitted_ns)
    if ended_ns:
        h.ended_ns = ended_ns
    return h


def test_a_handle_stamps_when_it_ended_once():
    h = handle(5)
    assert not h.ended and h.ended_ns == 0
    h.ended = True
    first = h.ended_ns
    h.ended = True
    assert h.ended and h.ended_ns == first > 0


def test_the_split_runs_from_the_first_admission_to_the_last_choice_s_end():
    ms = 10**6
    split = split_of(1000 * ms, 9000 * ms, [handle(1500 * ms, 3000 * ms), handle(1600 * ms, 4000 * ms)], 250 * ms)
    assert split == (250_000, 500_000, 3_000_000, 8_000_000)
    assert outside_and_engine_s(split) == (8.25 - 2.5, 2.5)
    running = split_of(0, 5 * ms, [handle(1 * ms, 2 * ms), handle(1 * ms)], None)   # one choice never ended
    assert running == (NONE_US, 1000, NONE_US, 5000) and outside_and_engine_s(running) == (0.005, 0.0)
    assert split_of(0, 5 * ms, [], None) == (NONE_US, NONE_US, NONE_US, 5000)      # never admitted


def test_a_peer_is_alarmed_once_per_window_when_its_requests_are_slow_outside_a_fast_engine():
    peers = SlowPeers()
    slow = SLOW_OUTSIDE_S + 1
    assert peers.observe("10.0.0.1", slow, slow, 0.0) is None        # slow in the engine too: not the peer's
    assert peers.observe("10.0.0.1", SLOW_OUTSIDE_S / 2, 0.0, 0.0) is None   # fast enough
    alarms = [peers.observe("10.0.0.1", slow, 0.1, float(t)) for t in range(SLOW_PEER_REQUESTS)]
    assert alarms[:-1] == [None] * (SLOW_PEER_REQUESTS - 1) and "peer 10.0.0.1" in alarms[-1]
    assert peers.observe("10.0.0.1", slow, 0.1, 10.0) is None        # once per window
    assert peers.observe("10.0.0.2", slow, 0.1, 10.0) is None        # another peer counts alone
    late = SLOW_PEER_WINDOW_S * 3
    assert [peers.observe("10.0.0.1", slow, 0.1, late + t) for t in range(SLOW_PEER_REQUESTS)][-1]
    spread = SlowPeers()   # slow requests further apart than the window never add up
    assert all(spread.observe("p", slow, 0.1, i * (SLOW_PEER_WINDOW_S + 1)) is None for i in range(10))


def test_peer_blame_exports_the_outside_time_per_peer_and_counts_the_alarm(caplog):
    registry = CollectorRegistry()
    blame = PeerBlame(registry)
    us = 10**6
    with caplog.at_level(logging.WARNING, logger="pdserve.api"):
        for _ in range(SLOW_PEER_REQUESTS):
            blame.observe("192.0.2.7", (NONE_US, 0, 100_000, int((SLOW_OUTSIDE_S + 2) * us)))
    text = generate_latest(registry).decode()
    assert 'pdserve_request_outside_engine_seconds_count{peer="192.0.2.7"} 3.0' in text
    assert 'pdserve_slow_peer_alarms_total{peer="192.0.2.7"} 1.0' in text
    assert [r.message for r in caplog.records if "peer 192.0.2.7" in r.message]


def test_peers_past_max_peers_share_the_other_label():
    from api.blame import MAX_PEERS

    registry = CollectorRegistry()
    blame = PeerBlame(registry)
    for i in range(MAX_PEERS + 3):
        blame.observe(f"10.1.0.{i}", (NONE_US, 0, 1000, 2000))
    blame.observe("10.1.0.0", (NONE_US, 0, 1000, 2000))   # a labelled peer keeps its own label
    text = generate_latest(registry).decode()
    counts = [line for line in text.splitlines() if line.startswith("pdserve_request_outside_engine_seconds_count")]
    assert len(counts) == MAX_PEERS + 1 and 'peer="other"} 3.0' in text and 'peer="10.1.0.0"} 2.0' in text
