"""Where a request's time went: before this server, in the engine, after it; and the peers whose requests are slow
while the engine is not.

=======================  ===========================================================================================
:func:`proxy_wait_ns`    ``X-Request-Start`` (a proxy's receive time: nginx ``t=${msec}``, Heroku, New Relic) as
                         the ns it waited before this server read the headers
:func:`split_of`         one request's split in microseconds: before headers, admitted, engine done, response end
:class:`PeerBlame`       per connection peer: ``pdserve_request_outside_engine_seconds{peer}`` (client-visible
                         minus engine time) and the slow-peer alarm (:class:`SlowPeers`' decision)
:class:`SlowPeers`       the decision, plain: a peer with SLOW_PEER_REQUESTS requests in SLOW_PEER_WINDOW_S whose
                         time outside the engine is SLOW_OUTSIDE_S or more and at least OUTSIDE_RATIO x their engine
                         time
=======================  ===========================================================================================

api/middleware.py's RequestIdMiddleware measures every POST at its response's end and notes the split in the arrival
index (ipc/arrivals.py), where ``tools/inspect --request ID`` reads it. The engine time runs from admission to the
engine's last event reaching the API (``RequestHandle.ended_ns``, the latest of the n choices); "outside" is
everything else the client waited: a proxy's queue (with ``X-Request-Start``), the body read and parse, admission's
queue, and writing the answer (a client or proxy that reads slowly). docs/architecture.md, "Blame split".
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque

log = logging.getLogger("pdserve.api")

NONE_US = 0xFFFFFFFF          # a split field that does not apply (no X-Request-Start; never admitted)
MAX_PROXY_WAIT_S = 3600.0     # an X-Request-Start older than this (or a clock far off) is ignored
MAX_PROXY_AHEAD_S = 1.0       # one ahead of this server's clock by up to this is read as 0 wait (clock skew)
SLOW_OUTSIDE_S = 5.0          # a request is slow outside the engine from this many seconds...
OUTSIDE_RATIO = 4.0           # ...when that is also this many times its engine time
SLOW_PEER_REQUESTS = 3        # this many such requests of one peer...
SLOW_PEER_WINDOW_S = 60.0     # ...within this window raise the peer's alarm (once per window)
MAX_PEERS = 64                # peers with their own histogram label; later ones are "other"
OUTSIDE_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0)


def proxy_wait_ns(value: str | None, now_wall_ns: int) -> int | None:
    """The ns between a proxy's ``X-Request-Start`` (``t=1700000000.123`` seconds, or an integer of seconds,
    milliseconds, microseconds or nanoseconds since the epoch, told apart by magnitude; ``t=`` optional) and
    ``now_wall_ns`` (time.time_ns() when the headers were read). None for a missing or unreadable value, or one
    more than MAX_PROXY_WAIT_S old or MAX_PROXY_AHEAD_S ahead; 0 for one slightly ahead (clock skew)."""
    if not value:
        return None
    text = value.strip()
    if text.startswith("t="):
        text = text[2:]
    try:
        number = float(text)
    except ValueError:
        return None
    if not number > 0:
        return None
    if "." in text or number < 1e11:   # seconds (1e11 s is the year 5138)
        start_ns = number * 1e9
    elif number < 1e14:
        start_ns = number * 1e6    # milliseconds
    elif number < 1e17:
        start_ns = number * 1e3    # microseconds
    else:
        start_ns = number          # nanoseconds
    wait_ns = now_wall_ns - start_ns
    if wait_ns < -MAX_PROXY_AHEAD_S * 1e9 or wait_ns > MAX_PROXY_WAIT_S * 1e9:
        return None
    return max(0, int(wait_ns))


def _us(ns: int | None) -> int:
    if ns is None or ns < 0:
        return NONE_US
    return min(NONE_US - 1, ns // 1000)


def split_of(headers_ns: int, end_ns: int, handles, wait_ns: int | None) -> tuple[int, int, int, int]:
    """``(before_us, admitted_us, engine_done_us, end_us)`` of one request: the proxy's wait before the headers
    (``wait_ns``, from :func:`proxy_wait_ns`), then, counted from ``headers_ns`` (monotonic ns the headers were
    read), the first admission to the engine, the engine's last event of its ``handles``
    (api.admission.RequestHandle; none: NONE_US for both), and the response's end ``end_ns``. Each at most
    NONE_US - 1 (71 minutes)."""
    admitted = min((h.admitted_ns for h in handles), default=None)
    ended = [h.ended_ns for h in handles]
    done = max(ended) if ended and all(ended) else None
    return (_us(wait_ns), _us(None if admitted is None else admitted - headers_ns),
            _us(None if done is None else done - headers_ns), _us(end_ns - headers_ns))


def outside_and_engine_s(split: tuple[int, int, int, int]) -> tuple[float, float]:
    """``(outside_s, engine_s)`` of a :func:`split_of` split: the client-visible time (the proxy's wait when known,
    plus headers to response end) less the engine's (admission to its last event; 0 when never admitted)."""
    before, admitted, done, end = split
    engine_us = done - admitted if NONE_US not in (admitted, done) and done >= admitted else 0
    visible_us = end + (before if before != NONE_US else 0)
    return max(0, visible_us - engine_us) / 1e6, engine_us / 1e6


class SlowPeers:
    """The slow-peer decision: :meth:`observe` each finished request of a peer; it returns an alarm text the first
    time within SLOW_PEER_WINDOW_S that the peer has SLOW_PEER_REQUESTS requests slow outside the engine
    (outside >= SLOW_OUTSIDE_S and >= OUTSIDE_RATIO x engine time). At most ``max_peers`` peers are tracked (the
    least recently seen forgotten)."""

    def __init__(self, max_peers: int = 1024):
        self.max_peers = max_peers
        self._slow: OrderedDict[str, deque] = OrderedDict()   # peer -> times of its slow requests in the window
        self._alarmed: dict[str, float] = {}                   # peer -> when its alarm was raised

    def observe(self, peer: str, outside_s: float, engine_s: float, now_s: float) -> str | None:
        if outside_s < SLOW_OUTSIDE_S or outside_s < OUTSIDE_RATIO * engine_s:
            return None
        times = self._slow.pop(peer, None) or deque()
        self._slow[peer] = times
        while len(self._slow) > self.max_peers:
            forgotten, _ = self._slow.popitem(last=False)
            self._alarmed.pop(forgotten, None)
        times.append(now_s)
        while times and now_s - times[0] > SLOW_PEER_WINDOW_S:
            times.popleft()
        if len(times) < SLOW_PEER_REQUESTS or now_s - self._alarmed.get(peer, -SLOW_PEER_WINDOW_S) < \
                SLOW_PEER_WINDOW_S:
            return None
        self._alarmed[peer] = now_s
        return (f"peer {peer}: {len(times)} requests in {SLOW_PEER_WINDOW_S:.0f} s spent >= {SLOW_OUTSIDE_S:.0f} s "
                f"outside the engine (the last {outside_s:.1f} s outside, {engine_s:.2f} s in the engine): the "
                f"wait is in front of the engine or in writing to this peer (a proxy, the network, a client "
                f"that reads slowly), not in the engine's stages")


class PeerBlame:
    """The split's exports, in one API process: ``pdserve_request_outside_engine_seconds{peer}`` (a histogram in
    ``registry``; MAX_PEERS peer labels, then "other") and ``pdserve_slow_peer_alarms_total{peer}``; an alarm
    is one WARNING line."""

    def __init__(self, registry):
        from prometheus_client import Counter, Histogram

        self.outside = Histogram("pdserve_request_outside_engine_seconds", "client-visible time (with the "
                                 "proxy's X-Request-Start wait when sent) minus engine time, per connection peer",
                                 ["peer"], buckets=OUTSIDE_BUCKETS_S, registry=registry)
        self.alarms = Counter("pdserve_slow_peer_alarms", "a peer's requests slow outside the engine while its "
                              "stages were fast (api/blame.py SlowPeers)", ["peer"], registry=registry)
        self.slow = SlowPeers()
        self._labels: set[str] = set()

    def observe(self, peer: str, split: tuple[int, int, int, int]) -> None:
        outside_s, engine_s = outside_and_engine_s(split)
        if peer not in self._labels and len(self._labels) < MAX_PEERS:
            self._labels.add(peer)
        label = peer if peer in self._labels else "other"
        self.outside.labels(label).observe(outside_s)
        alarm = self.slow.observe(peer, outside_s, engine_s, time.monotonic())
        if alarm:
            self.alarms.labels(label).inc()
            log.warning("%s", alarm)
