"""The connection ledger segment (ipc/ledger.py): rows written by one process, read whole by others."""
from __future__ import annotations

import os
import time

import pytest

from ipc.ledger import CLOSE_REASONS, DETECTIONS, ConnectionLedger, row_state


@pytest.fixture
def ledger(name):
    led = ConnectionLedger.create(name("conns"), num_live=4, num_closed=3)
    try:
        yield led
    finally:
        led.close()
        led.unlink()


def test_a_connection_is_recorded_from_open_to_close_and_a_read_only_reader_sees_every_field(ledger):
    now = time.monotonic_ns()
    i = ledger.open("10.0.0.7", 51234, now)
    ledger.note_protocol(i, "h2", forwarded="203.0.113.9")
    ledger.note_protocol(i, "h2", forwarded="198.51.100.1")   # the first one seen stays
    ledger.note_in(i, 300, now + 1)
    j = ledger.request_start(i, "req-a", now + 2)
    ledger.request_engine(i, j, slot=5, generation=9, request_id="chatcmpl-1", now_ns=now + 3)
    ledger.request_responding(i, j, now + 4)
    ledger.note_out(i, 1000, buffered_bytes=700, now_ns=now + 5)
    ledger.note_blocked(i, now + 6, socket_bytes=70000, flow_bytes=32768)
    reader = ConnectionLedger.attach(ledger.name, readonly=True)
    try:
        (row,) = reader.live_rows()
        assert row["conn_id"] == 1 and row["peer"] == b"10.0.0.7" and row["peer_port"] == 51234
        assert row["forwarded"] == b"203.0.113.9" and row["bytes_in"] == 300 and row["bytes_out"] == 1000
        assert (row["req_slot"][j], row["req_generation"][j], row["req_id"][j]) == (5, 9, b"chatcmpl-1")
        assert row["socket_buffered_bytes"] == 70000 and row["flow_buffered_bytes"] == 32768
        assert row_state(row, now) == "write-blocked" and not row["torn"]
        ledger.note_blocked(i, 0)
        assert row_state(reader.live_rows()[0], now) == "responding"
        ledger.request_end(i, j, served=True)
        assert row_state(reader.live_rows()[0], now) == "idle"
        ledger.close_connection(i, "client_fin", now + 7)
        assert len(reader.live_rows()) == 0
        (closed,) = reader.closed_rows()
        assert closed["conn_id"] == 1 and CLOSE_REASONS[closed["close_reason"]] == "client_fin"
        assert closed["requests_served"] == 1 and closed["closed_ns"] == now + 7
        assert reader.counters()["closes"]["client_fin"] == 1
    finally:
        reader.close()


def test_a_reason_the_server_gave_when_it_began_closing_wins_over_what_the_socket_saw_last(ledger):
    i = ledger.open("::1", 1, 1)
    ledger.note_server_close(i, 10, "idle_close", goaway_code=0)
    ledger.note_in(i, 5, 11, late=True)
    ledger.close_connection(i, "client_fin", 12)
    (closed,) = ledger.closed_rows()
    assert CLOSE_REASONS[closed["close_reason"]] == "idle_close" and closed["goaway_code"] == 0
    assert closed["late_bytes_in"] == 5 and closed["server_close_ns"] == 10


def test_the_closed_ring_keeps_the_newest_and_a_full_ledger_counts_what_it_drops(ledger):
    rows = [ledger.open("p", k, k + 1) for k in range(4)]
    assert ledger.open("p", 99, 1) == -1 and ledger.counters()["dropped"] == 1
    for k, i in enumerate(rows):
        ledger.close_connection(i, "client_rst" if k % 2 else "server_close", 100 + k)
    assert [int(r["peer_port"]) for r in ledger.closed_rows()] == [3, 2, 1]   # 3 kept, newest first
    assert ledger.counters()["closes"] == {**dict.fromkeys(CLOSE_REASONS[1:], 0), "client_rst": 2,
                                           "server_close": 2}
    i = ledger.open("again", 7, 200)   # a freed row is reused under a new id
    assert i >= 0 and ledger.live_rows()[0]["conn_id"] == 5


def test_more_requests_than_entries_still_count_as_open_streams(ledger):
    i = ledger.open("p", 1, 1)
    entries = [ledger.request_start(i, f"r{k}", 2) for k in range(5)]
    assert entries == [0, 1, 2, 3, -1] and ledger.live_rows()[0]["streams_open"] == 5
    for j in entries:
        ledger.request_end(i, j, served=True)
    row = ledger.live_rows()[0]
    assert row["streams_open"] == 0 and row["requests_served"] == 5 and not row["req_phase"].any()


def test_a_row_whose_writer_stopped_mid_write_is_returned_flagged_not_waited_for(ledger):
    i = ledger.open("p", 1, 1)
    ledger._begin(i)   # what a SIGSTOP between the two seq bumps leaves
    started = time.monotonic()
    (row,) = ledger.live_rows()
    assert row["torn"] and time.monotonic() - started < 1.0
    ledger._end(i)
    assert not ledger.live_rows()[0]["torn"]


def test_the_monitor_flags_a_row_for_its_connection_only(ledger):
    i = ledger.open("p", 1, 1)
    ledger.set_flags(i, 1, 0b10)
    ledger.count_detection("write_blocked")
    assert ledger.live_rows()[0]["flag_reasons"] == 0b10
    assert ledger.counters()["detections"] == {**dict.fromkeys(DETECTIONS, 0), "write_blocked": 1}
    ledger.close_connection(i, "client_fin", 2)
    j = ledger.open("q", 2, 3)   # the same row, a new connection: the old flags do not apply to it
    assert j == i and ledger.live_rows()[0]["flag_reasons"] == 0


def write_forever(name: str, stop) -> None:
    """Child: rewrite one row every 20 us (busy-waiting between writes, faster than any API writes a row),
    keeping bytes_in == bytes_out == 10 * requests_served. With no gap at all a reader's copy only fits between
    two writes by luck, and a loaded machine made it give up (flagged torn) within its 50 ms."""
    led = ConnectionLedger.attach(name)
    i = led.open("writer", 1, 1)
    n = 0
    while not stop.is_set():
        gap_end_ns = time.perf_counter_ns() + 20_000
        while time.perf_counter_ns() < gap_end_ns:
            pass
        n += 1
        led._begin(i)
        row = led.rows[i]
        row["bytes_in"] = 10 * n
        row["requests_served"] = n
        row["bytes_out"] = 10 * n
        led._end(i)
    led.close()


def test_a_reader_in_another_process_never_takes_a_torn_row_for_a_whole_one(ledger, ctx):
    stop = ctx.Event()
    child = ctx.Process(target=write_forever, args=(ledger.name, stop))
    child.start()
    try:
        deadline = time.monotonic() + 30
        while not len(ledger.live_rows()) or ledger.live_rows()[0]["requests_served"] < 100:
            assert time.monotonic() < deadline, "the writer never started"
            time.sleep(0.01)
        seen, torn = set(), 0
        for _ in range(3000):
            (row,) = ledger.live_rows()
            if row["torn"]:
                torn += 1   # the writer was descheduled mid-write past the reader's patience: flagged, not misread
                continue
            assert row["bytes_in"] == row["bytes_out"] == 10 * row["requests_served"]
            seen.add(int(row["requests_served"]))
        assert len(seen) > 10   # the writer really was writing while we read
        assert torn <= 30, f"{torn} of 3000 reads gave up on the row"
    finally:
        stop.set()
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join(5)


def die_with_connections_open(name: str) -> None:
    """Child: an API process that dies (``os._exit``) with two connections open, one of them mid-write."""
    led = ConnectionLedger.attach(name)
    i = led.open("10.0.0.1", 1, 1)
    j = led.request_start(i, "orphan-a", 2)
    led.request_engine(i, j, slot=3, generation=7, request_id="orphan-a", now_ns=3)
    k = led.open("10.0.0.2", 2, 4)
    led._begin(k)   # killed between the two seq bumps of a write
    free = led.open("10.0.0.3", 3, 5)
    led.close_connection(free, "client_fin", 6)   # a closed connection: its row free, one closed-ring entry
    led._begin(free)                              # killed inside the next write of that free row ...
    led.closed_ring["seq"][1] += 1                # ... and of the closed ring's next entry
    os._exit(0)


def test_a_new_writer_closes_the_rows_a_dead_writer_left_open_and_can_use_every_row(ledger, ctx):
    child = ctx.Process(target=die_with_connections_open, args=(ledger.name,))
    child.start()
    child.join(60)
    assert child.exitcode == 0 and len(ledger.live_rows()) == 2
    writer = ConnectionLedger.attach(ledger.name)   # the restarted API process
    try:
        assert writer.close_orphans(100) == 2
        assert len(ledger.live_rows()) == 0
        closed = ledger.closed_rows()
        assert sorted(int(r["conn_id"]) for r in closed) == [1, 2, 3] and not closed["torn"].any()
        closed = closed[closed["conn_id"] != 3]
        assert {CLOSE_REASONS[r] for r in closed["close_reason"]} == {"error"} and set(closed["closed_ns"]) == {100}
        assert writer.close_orphans(101) == 0
        rows = [writer.open("new", n, 200) for n in range(ledger.num_live)]   # every row is free and whole
        assert sorted(rows) == list(range(ledger.num_live)) and writer.open("more", 9, 201) == -1
        live = ledger.live_rows()
        assert sorted(int(c) for c in live["conn_id"]) == [4, 5, 6, 7] and not live["torn"].any()
    finally:
        writer.close()
