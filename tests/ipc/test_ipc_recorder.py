"""The flight recorder's ring (ipc/recorder.py) with real processes: a reader racing a wrapping writer never sees
a torn event, a SIGKILLed writer's half-written event is skipped and its successor continues the count, a stopped
reader never blocks a writer; and the state table records every transition through it."""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from ipc import recorder
from ipc.recorder import EVENT_DTYPE, EventKind, Recorder, request_key
from ipc.state_table import RequestState as S
from ipc.state_table import StateTable
from ipc_children import join_all
from recorder_children import payload, read_forever, write_events, write_then_die_mid_event


def whole(events: np.ndarray) -> np.ndarray:
    """The events whose every field matches payload(head): True per event."""
    head = events["head"].astype(np.int64)
    return ((events["a"] == head * 7) & (events["b"] == -head * 7) & (events["generation"] == head)
            & (events["key"] == (head * 31 + 7).astype(np.uint64)) & (events["slot"] == head % 1000))


def test_a_reader_racing_a_wrapping_writer_sees_only_whole_events(name, ctx):
    ring = Recorder.create(name("rec"), num_writers=2, events_per_writer=64)
    count = 200_000
    started = ctx.Event()
    writer = ctx.Process(target=write_events, args=(ring.name, 1, count, started))
    writer.start()
    try:
        assert started.wait(20)
        reader = Recorder.attach(ring.name, readonly=True)
        reads = seen = 0
        while writer.is_alive() or reads == 0:
            events = reader.events()
            mine = events[events["actor"] == 1]
            assert whole(mine).all(), mine[~whole(mine)]
            assert len(mine) <= 64 and (len(mine) == 0 or np.ptp(mine["head"].astype(np.int64)) < 64)
            reads, seen = reads + 1, seen + len(mine)
        assert join_all([writer]) == [0]
        final = reader.events()
        assert ring.written(1) == count and len(final) == 64 and whole(final).all()
        assert sorted(final["head"].tolist()) == list(range(count - 63, count + 1))
        assert reads > 10 and seen > 0   # the reads overlapped the writing
        reader.close()
    finally:
        join_all([writer])
        ring.close()
        ring.unlink()


def test_incremental_reads_racing_a_writer_get_each_whole_event_once(name, ctx):
    """events_since (the tracer's reader, api/tracing.py): every read returns only whole events newer than the
    previous one, none twice, and counts the ones it was lapped on; whatever the ring still holds at the end comes
    with the last read. (With the counts packed by struct, one byte at a time, a read saw a count mid-carry and
    went back: events came twice in most runs of this many events.)"""
    ring = Recorder.create(name("rec"), num_writers=2, events_per_writer=256)
    count = 400_000
    started = ctx.Event()
    writer = ctx.Process(target=write_events, args=(ring.name, 1, count, started))
    writer.start()
    try:
        assert started.wait(20)
        reader = Recorder.attach(ring.name, readonly=True)
        events, seen, lost = reader.events_since(None)   # from the oldest the ring holds
        start = seen[1] - len(events) - lost
        heads, reads = sorted(events["head"].tolist()), 1
        while writer.is_alive():
            events, seen, lapped = reader.events_since(seen)
            assert whole(events).all(), events[~whole(events)]
            heads += sorted(events["head"].tolist())
            reads, lost = reads + 1, lost + lapped
        assert join_all([writer]) == [0]
        events, seen, lapped = reader.events_since(seen)
        assert whole(events).all()
        heads += sorted(events["head"].tolist())
        lost += lapped
        assert heads == sorted(set(heads)), "an event came twice"
        assert heads[-1] == count and seen == [0, count]
        assert len(heads) + lost == count - start   # every event from the first read on: read once or counted lost
        assert reads > 10 and len(heads) > 256   # the reads overlapped the writing
        none, _, lapped = reader.events_since(seen)
        assert len(none) == 0 and lapped == 0
        w = ring.open_writer(0, actor=0)
        for _ in range(300):   # more than the sub-ring holds between two reads: the newest 256 come back
            w.append(2, **payload(w._written + 1))
        events, seen, lapped = reader.events_since(seen)
        assert sorted(events["head"].tolist()) == list(range(45, 301)) and seen == [300, count] and lapped == 44
        reader.close()
    finally:
        join_all([writer])
        ring.close()
        ring.unlink()


def test_a_count_read_racing_a_writer_never_goes_back(name, ctx):
    """``written`` is one atomic load of a word the writer stores at once: read in a tight loop while a writer
    appends, it never decreases. (Packed and unpacked by struct, byte by byte, it went back hundreds of times
    a second: 0x1FF -> 0x100 -> 0x200.)"""
    ring = Recorder.create(name("rec"), num_writers=2, events_per_writer=64)
    started = ctx.Event()
    writer = ctx.Process(target=write_events, args=(ring.name, 1, 1_000_000, started))
    writer.start()
    try:
        assert started.wait(20)
        reader = Recorder.attach(ring.name, readonly=True)
        last = reads = back = 0
        while writer.is_alive():
            now = reader.written(1)
            back += now < last
            last, reads = max(last, now), reads + 1
        assert join_all([writer]) == [0]
        assert back == 0 and reads > 1000 and reader.written(1) == 1_000_000
        reader.close()
    finally:
        join_all([writer])
        ring.close()
        ring.unlink()


def test_a_sigkilled_writers_half_event_is_skipped_and_its_successor_continues(name, ctx):
    ring = Recorder.create(name("rec"), num_writers=1, events_per_writer=16)
    try:
        child = ctx.Process(target=write_then_die_mid_event, args=(ring.name, 0, 20))
        child.start()
        join_all([child])
        assert child.exitcode == -signal.SIGKILL
        events = ring.events()
        assert whole(events).all() and sorted(events["head"].tolist()) == list(range(6, 21))   # 21 is torn
        assert ring.written(0) == 20
        started = ctx.Event()
        successor = ctx.Process(target=write_events, args=(ring.name, 0, 3, started))   # the restarted actor
        successor.start()
        assert join_all([successor]) == [0]
        events = ring.events()
        assert whole(events).all() and sorted(events["head"].tolist()) == list(range(8, 24))
    finally:
        ring.close()
        ring.unlink()


def test_a_stopped_reader_never_blocks_a_writer(name, ctx):
    ring = Recorder.create(name("rec"), num_writers=1, events_per_writer=32)
    started = ctx.Event()
    reader = ctx.Process(target=read_forever, args=(ring.name, started))
    reader.start()
    try:
        assert started.wait(20)
        os.kill(reader.pid, signal.SIGSTOP)   # stopped wherever it was, mid-read included
        w = ring.open_writer(0, actor=0)
        deadline = time.monotonic() + 10
        for _ in range(10_000):
            w.append(2, **payload(w._written + 1))
        assert time.monotonic() < deadline and ring.written(0) == 10_000 and whole(ring.events()).all()
    finally:
        os.kill(reader.pid, signal.SIGCONT)
        reader.kill()
        join_all([reader])
        ring.close()
        ring.unlink()


def test_the_state_table_records_allocate_transitions_and_release(name):
    ring = Recorder.create(name("rec"), num_writers=3, events_per_writer=64)
    table = StateTable.create(name("state"), num_rows=4)
    try:
        recorder.install(ring, 2, 5)
        slot, gen = table.allocate("client-id-1", prompt_tokens=3, deadline_ns=123)
        assert table.transition(slot, gen, S.PREFILLING)
        assert not table.transition(slot, gen + 1, S.BOOTSTRAP)   # refused: nothing recorded
        assert table.transition(slot, gen, S.FAILED, error_code=7)
        assert table.release(slot, gen)
        events = Recorder.attach(ring.name, readonly=True).events()
        assert events["kind"].tolist() == [EventKind.ALLOCATE, EventKind.TRANSITION, EventKind.TRANSITION,
                                           EventKind.RELEASE]
        assert (events["key"] == request_key("client-id-1")).all() and (events["actor"] == 5).all()
        assert events[["old", "new"]].tolist() == [(0, S.QUEUED), (S.QUEUED, S.PREFILLING),
                                                   (S.PREFILLING, S.FAILED), (S.FAILED, 0)]
        assert events["a"].tolist()[:3] == [123, 123, 123] and events["c"][2] == 7
        assert (events["slot"] == slot).all() and (events["generation"] == gen).all()
    finally:
        recorder.install(None, 0, 0)
        table.close()
        table.unlink()
        ring.close()
        ring.unlink()


def test_layout_and_bad_sizes(name):
    assert EVENT_DTYPE.itemsize == 64 and EVENT_DTYPE.fields["tail"][1] == 56
    with pytest.raises(ValueError):
        Recorder.create(name("rec"), num_writers=0, events_per_writer=64)
    with pytest.raises(ValueError):
        Recorder.create(name("rec"), num_writers=1, events_per_writer=8)
    ring = Recorder.create(name("rec"), num_writers=2, events_per_writer=16)
    try:
        assert Recorder.size_bytes(2, 16) == len(ring._mm)
        ro = Recorder.attach(ring.name, readonly=True)
        with pytest.raises(PermissionError):
            ro.open_writer(0, 0)
        with pytest.raises(IndexError):
            ring.open_writer(2, 0)
        assert len(ro.events()) == 0
        ro.close()
    finally:
        ring.close()
        ring.unlink()


def test_the_ring_size_is_a_setting_on_by_default():
    from pdserve.config import load_config
    from pdserve.errors import ConfigError

    assert load_config(None, {}).config.recorder_events == 262144
    assert load_config({"recorder_events": 0}, {}).config.recorder_events == 0
    loaded = load_config(None, {"PDSERVE_RECORDER_EVENTS": "4096"})
    assert loaded.config.recorder_events == 4096 and loaded.sources["recorder_events"] == "env"
    with pytest.raises(ConfigError, match="recorder_events"):
        load_config({"recorder_events": -1}, {})


def test_a_100_event_ring_that_wrapped_reads_a_finished_request_as_partial_and_finished(name):
    """Three writers of 100 events each, as the api (0), prefill (1) and decode (2) would write one request's life;
    then the api's and prefill's sub-rings wrap on other traffic. The request's start (the api's ALLOCATE) is gone:
    its timeline starts late, says so, and is finished, not live; the horizon is the oldest event the wrapped
    sub-rings still hold."""
    from ipc.timeline import requests_report

    ring = Recorder.create(name("rec"), num_writers=3, events_per_writer=100)
    try:
        api, prefill, decode = (ring.open_writer(w, w) for w in range(3))
        key = request_key("wrapped-1")
        steps = [(api, EventKind.ALLOCATE, 0, S.QUEUED), (prefill, EventKind.TRANSITION, S.QUEUED, S.PREFILLING),
                 (prefill, EventKind.TRANSITION, S.PREFILLING, S.BOOTSTRAP),
                 (decode, EventKind.TRANSITION, S.BOOTSTRAP, S.TRANSFERRING),
                 (decode, EventKind.TRANSITION, S.TRANSFERRING, S.DECODING),
                 (decode, EventKind.TRANSITION, S.DECODING, S.FINISHED), (api, EventKind.RELEASE, S.FINISHED, 0)]
        for t, (writer, kind, old, new) in enumerate(steps, start=1):
            writer.append(kind, slot=3, generation=9, key=key, old=int(old), new=int(new), t_ns=t * 1000)
        assert ring.horizon_ns() == 0   # nothing overwritten yet
        for i in range(150):   # other requests' events wrap the api's sub-ring by 52 and prefill's by 1
            api.append(EventKind.HTTP_HEADERS, slot=5, generation=i, key=i, t_ns=10_000 + i)
            if i < 99:
                prefill.append(EventKind.PREFILL_CHUNK, slot=5, generation=i, key=i, t_ns=10_000 + i)
        assert ring.horizon_ns() == 10_000 + 50   # the api's oldest kept event (prefill's oldest is older)
        (t,) = requests_report(ring.events(), 20_000, {}, ("api", "prefill0", "decode0"), "wrapped-1",
                               horizon_ns=ring.horizon_ns())["timelines"]
        assert t["path"] == ["BOOTSTRAP", "TRANSFERRING", "DECODING", "FINISHED"]  # ALLOCATE and QUEUED's exit gone
        assert (t["partial"], t["final"], t["live"]) == ("start evicted", "FINISHED", False)
    finally:
        ring.close()
        ring.unlink()
