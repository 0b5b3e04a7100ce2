"""Engines whose supervisor is gone (SIGKILL leaves every segment and semaphore in /dev/shm): ipc.manifest finds
them by the manifest's pid (and its start in ticks since boot, for a reused pid) and reclaims their objects; live
engines, engines still starting, and live engines after a step of the wall clock are left alone."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import posix_ipc
import pytest

from ipc import naming
from ipc.manifest import (NO_MANIFEST_GRACE_S, process_start_ticks, reclaim_stale_engines, stale_engines,
                          write_manifest)
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


def leave_engine(eid: str, pid: int, created_unix_s: float, ticks: int | None = None) -> None:
    """What a SIGKILLed supervisor leaves: its manifest (``ticks``: its pid_start_ticks; None: a manifest of an
    older pdserve without them), a table and a named semaphore (objects closed here, never unlinked)."""
    identity = {} if ticks is None else {"pid_start_ticks": ticks}
    write_manifest(eid, {"engine_id": eid, "pid": pid, "created_unix_s": created_unix_s, **identity}).close()
    StateTable.create(naming.segment_name(eid, "state"), num_rows=64).close()
    posix_ipc.Semaphore(naming.segment_name(eid, "x_lock"), posix_ipc.O_CREX, initial_value=1).close()


def test_an_engine_whose_supervisor_is_gone_is_reclaimed_and_logged_and_a_live_one_is_kept(engines, caplog):
    dead, live, reused, stepped, legacy = engines(), engines(), engines(), engines(), engines()
    ticks = process_start_ticks(os.getpid())
    leave_engine(dead, a_dead_pid(), time.time(), ticks)
    leave_engine(live, os.getpid(), time.time(), ticks)
    leave_engine(reused, os.getpid(), time.time(), ticks - 1)   # our pid, but another process wrote it
    # ours, and the wall clock stepped forward 10 days since it was written (NTP, a paused VM set right): the
    # boot time /proc/stat gives moved with it, so our start read in Unix seconds is long after created_unix_s
    leave_engine(stepped, os.getpid(), time.time() - 10 * 24 * 3600, ticks)
    leave_engine(legacy, os.getpid(), time.time() - 10 * 24 * 3600)   # no ticks: the wall-clock rule
    ours = {dead, live, reused, stepped, legacy}
    assert set(stale_engines(only=ours)) == {dead, reused, legacy}
    left = naming.list_engine_segments(dead)
    sizes = sum(os.stat(os.path.join(naming.SHM_DIR, e)).st_size for e in left)
    semaphores = sum(e.startswith("sem.") for e in left)
    assert semaphores >= 1 and len(left) - semaphores == 2   # the manifest and the table
    with caplog.at_level(logging.WARNING, logger="pdserve.manifest"):
        reclaimed = {r["engine_id"]: r for r in reclaim_stale_engines(only=ours)}
    assert set(reclaimed) == {dead, reused, legacy}
    gone = reclaimed[dead]
    assert (gone["segments"], gone["semaphores"], gone["bytes"]) == (2, semaphores, sizes)
    assert naming.list_engine_segments(dead) == [] and naming.list_engine_segments(reused) == []
    assert len(naming.list_engine_segments(live)) == len(naming.list_engine_segments(stepped)) == len(left)
    assert f"reclaimed engine {dead}" in caplog.text and f"{sizes} bytes" in caplog.text


def test_objects_without_a_manifest_are_reclaimed_only_after_a_grace_period(engines):
    """An engine writes its manifest first; objects without one are a start-up cut short (or an engine still
    creating its manifest): left alone while young."""
    eid = engines()
    StateTable.create(naming.segment_name(eid, "state"), num_rows=4).close()
    assert stale_engines(only={eid}) == {}
    assert reclaim_stale_engines(now_unix_s=time.time() + NO_MANIFEST_GRACE_S + 1, only={eid})[0]["segments"] == 1
    assert naming.list_engine_segments(eid) == []
