"""ipc/arrivals.py's ArrivalIndex in real shm: entries found by key oldest first, the ring wrapping (oldest
overwritten, ``wrapped`` and ``since_ns`` saying so) with each entry's time split, a read-only reader in another
process, and inspect's sentences for an id found (with where its time went), never seen, or past both the index and
the ring."""
from __future__ import annotations

import multiprocessing
import uuid

import pytest

from ipc.arrivals import ArrivalIndex
from ipc.recorder import request_key
from tools.timelines import not_found_text, split_text

NONE = 0xFFFFFFFF


def short(found: dict) -> list[tuple[int, int]]:
    return [(e["t_ns"], e["status"]) for e in found["arrivals"]]


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
    found = index.find(a)
    assert short(found) == [(100, 200), (300, 400)] and (found["since_ns"], found["wrapped"]) == (100, False)
    assert found["arrivals"][0] | found["arrivals"][1] == {"t_ns": 300, "status": 400, "before_us": NONE,
                                                           "admitted_us": NONE, "done_us": NONE, "end_us": NONE}
    assert index.find(request_key("req-c"))["arrivals"] == []
    index.note(b, 400, 200)   # the fourth: the ring is full
    index.note(b, 500, 200)   # the first is overwritten
    assert short(index.find(a)) == [(300, 400)] and index.find(a)["since_ns"] == 200 and index.find(a)["wrapped"]
    index.note(b, 600, 200)
    index.note(b, 700, 200)
    assert index.find(a) == {"arrivals": [], "since_ns": 400, "wrapped": True}
    assert short(index.find(b)) == [(400, 200), (500, 200), (600, 200), (700, 200)]


def test_an_entry_keeps_its_split_whole(index):
    """Each split field in its own bits (a status or a time written into its neighbour's would show)."""
    key = request_key("chatcmpl-split")
    index.note(key, 7, 599, (NONE - 1, 1, 2_000_000, 3))
    assert index.find(key)["arrivals"] == [{"t_ns": 7, "status": 599, "before_us": NONE - 1, "admitted_us": 1,
                                            "done_us": 2_000_000, "end_us": 3}]


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
        assert short(out.get(timeout=60)) == [(5_000, 200)]
    finally:
        child.join(timeout=30)
    assert child.exitcode == 0


def test_inspect_says_reached_never_reached_or_unknown_from_the_index_and_the_ring():
    s = 10**9
    entry = {"t_ns": 2 * s, "status": 200, "before_us": NONE, "admitted_us": NONE, "done_us": NONE, "end_us": NONE}
    found = {"arrivals": [entry], "since_ns": 1 * s, "wrapped": True}
    assert "reached this server 8.0 s ago (answered 200); its events were overwritten" in \
        not_found_text("x", 5 * s, 10 * s, found)
    deeper = {"arrivals": [], "since_ns": 1 * s, "wrapped": True}   # the index reaches before the ring's horizon
    assert "never reached this server: the arrival index holds every request id answered of the last 9.0 s" in \
        not_found_text("x", 5 * s, 10 * s, deeper)
    shallower = {"arrivals": [], "since_ns": 7 * s, "wrapped": True}
    assert "it never reached this server, or it came before the ring's horizon" in \
        not_found_text("x", 5 * s, 10 * s, shallower)
    assert "since the engine started" in not_found_text("x", 5 * s, 10 * s, {**shallower, "wrapped": False})


def test_the_split_says_what_the_engine_took_and_what_lay_outside():
    """A proxy's 2 s queue, 0.5 s to admission, the engine done 1.5 s later, the last byte 30 s after that."""
    entry = {"t_ns": 100 * 10**9, "status": 200, "before_us": 2_000_000, "admitted_us": 500_000,
             "done_us": 2_000_000, "end_us": 32_000_000}
    text = split_text(entry, 140 * 10**9)
    assert "reached this server 40.0 s ago (answered 200), 2.000 s after the proxy's X-Request-Start" in text
    assert "admitted to the engine at +0.500 s" in text and "engine done at +2.000 s (1.500 s in the engine)" in text
    assert "last byte handed to the connection at +32.000 s" in text
    assert "outside the engine: 32.500 s of 34.000 s the client waited" in text
    bare = split_text({**entry, "before_us": NONE, "admitted_us": NONE, "done_us": NONE, "status": 0}, 140 * 10**9)
    assert "no X-Request-Start" in bare and "never admitted to the engine" in bare and "no answer began" in bare
