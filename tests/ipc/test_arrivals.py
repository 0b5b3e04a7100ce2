"""ipc/arrivals.py's ArrivalIndex in real shm: entries found by key oldest first, the ring wrapping (oldest
overwritten, ``wrapped`` and ``since_ns`` saying so), a read-only reader in another process, and inspect's
sentence for an id found, never seen, or past both the index and the ring."""
from __future__ import annotations

import multiprocessing
import uuid

import pytest

from ipc.arrivals import ArrivalIndex
from ipc.recorder import request_key
from tools.timelines import not_found_text


@pytest.fixture
def index():
    ring = ArrivalIndex.create(f"/pdserve_test_arrivals_{uuid.uuid4().hex[:8]}", capacity=4)
    yield ring
    ring.close()
    ring.unlink()


def test_arrivals_are_found_by_key_oldest_first_and_the_ring_overwrites_the_oldest(index):
    a, b = request_key("req-a"), request_key("req-b")
    index.note(a, 100, 200)
    index.note(b, 200, 503)
    index.note(a, 300, 400)
    assert index.find(a) == {"arrivals": [(100, 200), (300, 400)], "since_ns": 100, "wrapped": False}
    assert index.find(request_key("req-c"))["arrivals"] == []
    index.note(b, 400, 200)   # the fourth: the ring is full
    index.note(b, 500, 200)   # the first is overwritten
    assert index.find(a) == {"arrivals": [(300, 400)], "since_ns": 200, "wrapped": True}
    index.note(b, 600, 200)
    index.note(b, 700, 200)
    assert index.find(a) == {"arrivals": [], "since_ns": 400, "wrapped": True}
    assert index.find(b)["arrivals"] == [(400, 200), (500, 200), (600, 200), (700, 200)]


def read_in_child(name: str, key: int, out) -> None:
    with ArrivalIndex.attach(name, readonly=True) as ring:
        out.put(ring.find(key))


def test_a_read_only_reader_in_another_process_sees_the_entries(index):
    index.note(request_key("chatcmpl-1"), 5_000, 200)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=read_in_child, args=(index.name, request_key("chatcmpl-1"), out))
    child.start()
    try:
        assert out.get(timeout=60)["arrivals"] == [(5_000, 200)]
    finally:
        child.join(timeout=30)
    assert child.exitcode == 0


def test_inspect_says_reached_never_reached_or_unknown_from_the_index_and_the_ring():
    s = 10**9
    found = {"arrivals": [(2 * s, 200)], "since_ns": 1 * s, "wrapped": True}
    assert "reached this server 8.0 s ago (answered 200); its events were overwritten" in \
        not_found_text("x", 5 * s, 10 * s, found)
    deeper = {"arrivals": [], "since_ns": 1 * s, "wrapped": True}   # the index reaches before the ring's horizon
    assert "never reached this server: the arrival index holds every request id answered of the last 9.0 s" in \
        not_found_text("x", 5 * s, 10 * s, deeper)
    shallower = {"arrivals": [], "since_ns": 7 * s, "wrapped": True}
    assert "it never reached this server, or it came before the ring's horizon" in \
        not_found_text("x", 5 * s, 10 * s, shallower)
    assert "since the engine started" in not_found_text("x", 5 * s, 10 * s, {**shallower, "wrapped": False})
