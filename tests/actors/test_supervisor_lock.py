"""A process stopped (SIGSTOP) while holding the state table lock: the supervisor's restart step holds back
(ShmLockTimeoutError handled, nothing spawned, the supervisor lives) and completes once the holder is killed
(the lock is taken over from the dead holder). Real processes and shm; docs/architecture.md, "Shared memory"."""
from __future__ import annotations

import multiprocessing
import os
import threading
import time

import psutil
import pytest

from actors.topology import Topology
from actors.messages import RequestError, from_wire
from actors.monitor import held_mask
from actors.supervisor import Supervisor, fail_held_for_restart, monitor_is_hung
from ipc import naming
from ipc.actor_table import ActorStatus, ActorTable
from ipc.engine_status import EngineStatus
from ipc.shm_queue import ShmQueue
from ipc.state_table import RequestState as S
from ipc.state_table import StateTable
from pdserve.config import load_config
from pdserve.errors import ShmLockTimeoutError
from tests.conftest import wait_until
from tests.ipc import ipc_children as kids

LOCK_TIMEOUT_S = 0.2
DECODE0 = 1   # Topology(1, 1): prefill0, decode0, api, monitor


@pytest.fixture
def engine_shm(engine_id):
    """A supervisor's segments for one prefill and one decode actor (no actor processes)."""
    owned = []

    def create(kind, what, *args, **kwargs):
        segment = kind.create(naming.segment_name(engine_id, what), *args, **kwargs)
        owned.append(segment)
        return segment
    topo = Topology(1, 1)
    shm = {"state": create(StateTable, "state", 8, lock_timeout_s=LOCK_TIMEOUT_S),
           "status": create(EngineStatus, "status"),
           "q_api": create(ShmQueue, "q_api", num_slots=8, slot_bytes=1024, lock_timeout_s=LOCK_TIMEOUT_S,
                           mode="mpmc"),
           "actors": create(ActorTable, "actors", len(topo.names))}
    for index, name in enumerate(topo.names):
        shm["actors"].register(index, name, "")
    try:
        yield topo, shm
    finally:
        for segment in reversed(owned):
            segment.close()
            segment.unlink()


def test_a_stopped_lock_holder_holds_a_restart_back_until_it_is_killed(engine_shm):
    topo, shm = engine_shm
    state = shm["state"]
    slot, generation = state.allocate("held-1", prompt_tokens=4, prefill_actor=0, decode_actor=DECODE0)
    assert held_mask(state.snapshot(), topo, DECODE0)[slot]
    supervisor = Supervisor(load_config(None, {}))
    supervisor.topology, supervisor.state, supervisor.status = topo, state, shm["status"]
    supervisor.actors, supervisor.queues = shm["actors"], {"q_api": shm["q_api"]}
    ctx = multiprocessing.get_context("spawn")
    holder = ctx.Process(target=kids.st_stop_holding_lock, args=(state.name,))
    dead = ctx.Process(target=kids.join_all, args=([],))   # stands for decode0's process: exited
    holder.start()
    dead.start()
    try:
        wait_until(lambda: psutil.Process(holder.pid).status() == psutil.STATUS_STOPPED, 60, 0.02,
                   "the holder to stop with the lock")
        dead.join(30)
        supervisor.processes, supervisor.started_at = {DECODE0: dead}, {DECODE0: time.monotonic()}
        for attempt in range(2):   # held back each pass, without raising and without spawning
            supervisor._restart(DECODE0)
            assert supervisor.processes[DECODE0] is dead
            assert shm["actors"].row(DECODE0)["status"] != ActorStatus.RESTARTING
        assert DECODE0 in supervisor.lock_stuck_since and DECODE0 in supervisor.lock_stuck_logged
        assert state.row(slot)["state"] == S.QUEUED
        with pytest.raises(ShmLockTimeoutError, match="alive"):
            fail_held_for_restart(state, shm["status"], shm["q_api"], topo, DECODE0, -9)

        holder.kill()   # what the supervisor's hung-actor kill does; the lock is taken over from the dead pid
        holder.join(10)
        assert fail_held_for_restart(state, shm["status"], shm["q_api"], topo, DECODE0, -9) == 1
        row = state.row(slot)
        assert row["state"] == S.FAILED and row["generation"] == generation
        (frame,) = shm["q_api"].get_many(8, 5.0)
        error = from_wire(frame)
        assert isinstance(error, RequestError) and (error.slot, error.http_status) == (slot, 503)
        assert "decode0 is dead" in error.message
        assert state.transition(slot, generation, S.FAILED) is False   # the lock works normally again
    finally:
        for process in (holder, dead):
            if process.is_alive():
                process.kill()
            process.join(10)


def test_the_supervisor_judges_the_monitor_hung_after_the_hang_timeout_plus_slack():
    config = load_config(None, {"PDSERVE_ACTOR_HANG_TIMEOUT_S": "2", "PDSERVE_MONITOR_TICK_S": "0.5"}).config
    s_ns = 1_000_000_000
    row = {"pid": 123, "status": int(ActorStatus.READY), "heartbeat_ns": 10 * s_ns}
    assert not monitor_is_hung(row, True, 10 * s_ns + 7 * s_ns, config)    # 2 + 0.5 + 5 s not yet past
    assert monitor_is_hung(row, True, 10 * s_ns + 8 * s_ns, config)
    assert not monitor_is_hung(row, False, 10 * s_ns + 8 * s_ns, config)   # dead, not hung: a restart
    assert not monitor_is_hung({**row, "status": int(ActorStatus.STARTING)}, True, 100 * s_ns, config)


def test_a_stuck_api_inbox_lock_costs_one_lock_wait_not_one_per_failed_request(engine_shm, caplog):
    """The API inbox's producer lock held by a live process: every held row still fails, and only the first
    notification waits for the lock (the API's own deadline answers the others)."""
    topo, shm = engine_shm
    state = shm["state"]
    slots = [state.allocate(f"held-{i}", prompt_tokens=4, prefill_actor=0, decode_actor=DECODE0)[0] for i in range(3)]
    ctx = multiprocessing.get_context("spawn")
    holding, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=kids.q_hold_producer_lock, args=(shm["q_api"].name, holding, release))
    holder.start()
    try:
        assert holding.wait(60), "the holder never took the API inbox's lock"
        with caplog.at_level("WARNING", logger="pdserve.monitor"):
            assert fail_held_for_restart(state, shm["status"], shm["q_api"], topo, DECODE0, -9) == 3
        assert all(state.row(slot)["state"] == S.FAILED for slot in slots)
        notices = [r for r in caplog.records if "could not notify the API" in r.getMessage()]
        assert len(notices) == 1 and "held for more than" in notices[0].getMessage()
    finally:
        release.set()
        holder.join(10)
        if holder.is_alive():
            holder.kill()
            holder.join(10)


def test_a_decode_actor_waits_out_a_state_table_lock_its_stopped_neighbour_holds_beating_until_it_is_killed(
        engine_shm):
    """decode0 stopped inside a table write (as SIGSTOP can land): decode1's next write must not raise (that
    killed decode1 in a CI run of tests/e2e/test_nxm.py) but wait, beating its heartbeat so that the monitor
    does not call it hung too, and go on once the supervisor kills the holder. While the engine stops it
    raises instead of waiting."""
    from actors.base import Actor
    from ipc.state_table import set_lock_wait_hook

    topo, shm = engine_shm
    state = shm["state"]
    slot, generation = state.allocate("neighbour-1", prompt_tokens=4, prefill_actor=0, decode_actor=DECODE0)
    actor = Actor.__new__(Actor)   # the shell's own fields only: no layout, no process of its own
    actor.role, actor.name, actor.index, actor.actors, actor.status = "decode", "decode0", DECODE0, \
        shm["actors"], shm["status"]
    ctx = multiprocessing.get_context("spawn")
    holder = ctx.Process(target=kids.st_stop_holding_lock, args=(state.name,))
    holder.start()
    try:
        wait_until(lambda: psutil.Process(holder.pid).status() == psutil.STATUS_STOPPED, 60, 0.02,
                   "the holder to stop with the lock")
        beats_before = shm["actors"].row(DECODE0)["heartbeat_count"]
        actor.wait_out_stuck_locks(os.getppid())
        beating = []

        def kill_after_three_beats() -> None:   # kills the holder whatever happens: the write would wait forever
            try:
                beating.append(wait_until(lambda: shm["actors"].row(DECODE0)["heartbeat_count"] >= beats_before + 3,
                                          30, 0.02, "three beats while waiting"))
            finally:
                holder.kill()
        killer = threading.Thread(target=kill_after_three_beats)
        killer.start()
        try:   # the write waits (3 lock timeouts, beating) until the holder is killed, then takes the lock over
            assert state.transition(slot, generation, S.PREFILLING) is True
        finally:
            killer.join(40)
        assert beating == [True], "the waiting actor did not beat its heartbeat"
        assert state.row(slot)["state"] == S.PREFILLING

        holder2 = ctx.Process(target=kids.st_stop_holding_lock, args=(state.name,))
        holder2.start()
        try:
            wait_until(lambda: psutil.Process(holder2.pid).status() == psutil.STATUS_STOPPED, 60, 0.02,
                       "the second holder to stop with the lock")
            shm["status"].rec["stopping"] = 1   # the engine stops: no waiting, the error as before
            with pytest.raises(ShmLockTimeoutError, match="alive"):
                state.transition(slot, generation, S.FAILED)
        finally:
            holder2.kill()
            holder2.join(10)
    finally:
        set_lock_wait_hook(None)
        if holder.is_alive():
            holder.kill()
        holder.join(10)
