"""Engines whose supervisor is gone (SIGKILL leaves every segment and semaphore in /dev/shm): ipc.manifest finds
them by the manifest's pid (and its start time, for a reused pid) and reclaims their objects; live engines and
engines still starting are left alone."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import posix_ipc
import pytest

from ipc import naming
from ipc.manifest import NO_MANIFEST_GRACE_S, reclaim_stale_engines, stale_engines, write_manifest
from ipc.state_table import StateTable

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def engines():
    """Fresh engine ids, every object named with them unlinked after the test."""
    made: list[str] = []

    def new() -> str:
        made.append(naming.new_engine_id())
        return made[-1]
    yield new
    for eid in made:
        naming.unlink_all(eid)


def a_dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def leave_engine(eid: str, pid: int, created_unix_s: float) -> None:
    """What a SIGKILLed supervisor leaves: its manifest, a table and a named semaphore (objects closed here,
    never unlinked)."""
    write_manifest(eid, {"engine_id": eid, "pid": pid, "created_unix_s": created_unix_s}).close()
    StateTable.create(naming.segment_name(eid, "state"), num_rows=64).close()
    posix_ipc.Semaphore(naming.segment_name(eid, "x_lock"), posix_ipc.O_CREX, initial_value=1).close()


def test_an_engine_whose_supervisor_is_gone_is_reclaimed_and_logged_and_a_live_one_is_kept(engines, caplog):
    dead, live, reused = engines(), engines(), engines()
    leave_engine(dead, a_dead_pid(), time.time())
    leave_engine(live, os.getpid(), time.time())
    leave_engine(reused, os.getpid(), time.time() - 10 * 24 * 3600)   # our pid, but the engine is older than us
    ours = {dead, live, reused}
    assert set(stale_engines(only=ours)) == {dead, reused}
    left = naming.list_engine_segments(dead)
    sizes = sum(os.stat(os.path.join(naming.SHM_DIR, e)).st_size for e in left)
    semaphores = sum(e.startswith("sem.") for e in left)
    assert semaphores >= 1 and len(left) - semaphores == 2   # the manifest and the table
    with caplog.at_level(logging.WARNING, logger="pdserve.manifest"):
        reclaimed = {r["engine_id"]: r for r in reclaim_stale_engines(only=ours)}
    assert set(reclaimed) == {dead, reused}
    gone = reclaimed[dead]
    assert (gone["segments"], gone["semaphores"], gone["bytes"]) == (2, semaphores, sizes)
    assert naming.list_engine_segments(dead) == [] and naming.list_engine_segments(reused) == []
    assert len(naming.list_engine_segments(live)) == len(left)
    assert f"reclaimed engine {dead}" in caplog.text and f"{sizes} bytes" in caplog.text


def test_a_live_supervisor_is_told_by_its_start_ticks_whatever_the_wall_clock_says(engines):
    """A wall-clock step (a VM resumed after a pause, an NTP step) moves /proc/stat's btime, so a start time in
    Unix seconds moves too: an engine whose manifest was written 30 s "before" its supervisor started was reclaimed
    alive. The manifest's start_ticks (ticks after boot) say who the pid is, whatever the clock."""
    from ipc.manifest import process_start_ticks

    live, reused, gone = engines(), engines(), engines()
    ticks = process_start_ticks(os.getpid())
    for eid, pid, start in ((live, os.getpid(), ticks), (reused, os.getpid(), ticks - 1), (gone, a_dead_pid(), 0)):
        write_manifest(eid, {"engine_id": eid, "pid": pid, "created_unix_s": time.time() - 30.0,
                             "start_ticks": start}).close()
    assert process_start_ticks(os.getpid()) == ticks and process_start_ticks(a_dead_pid()) is None
    stale = stale_engines(time.time() + 60, only={live, reused, gone})
    assert set(stale) == {reused, gone} and "another process" in stale[reused]


def test_objects_without_a_manifest_are_reclaimed_only_after_a_grace_period(engines):
    """An engine writes its manifest first; objects without one are a start-up cut short (or an engine still
    creating its manifest): left alone while young."""
    eid = engines()
    StateTable.create(naming.segment_name(eid, "state"), num_rows=4).close()
    assert stale_engines(only={eid}) == {}
    assert reclaim_stale_engines(now_unix_s=time.time() + NO_MANIFEST_GRACE_S + 1, only={eid})[0]["segments"] == 1
    assert naming.list_engine_segments(eid) == []
