from __future__ import annotations

import time

import pytest

import ipc_children as kids
from ipc.actor_table import ROW_DTYPE, ActorHealth, ActorStatus, ActorTable

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def actors(name):
    t = ActorTable.create(name("actors"), 3)
    try:
        yield t
    finally:
        t.close()
        t.unlink()


def test_rows_start_empty_and_take_what_their_writers_set(actors):
    assert ROW_DTYPE.itemsize == 192
    assert [r["status"] for r in actors.rows()] == [ActorStatus.EMPTY] * 3
    actors.register(1, "prefill0", "cpu")                # the supervisor
    actors.spawned(1, 4242)
    actors.starting(1, 4242)                              # the actor
    actors.set_status(1, ActorStatus.READY)
    actors.set_kv_blocks(1, total=64, free=60)
    actors.set_health(1, ActorHealth.OK)                  # the monitor
    row = actors.row(1)
    assert (row["name"], row["device"], row["pid"], row["status"], row["kv_blocks_free"], row["health"]) == (
        "prefill0", "cpu", 4242, ActorStatus.READY, 60, ActorHealth.OK)
    assert 0 < row["started_ns"] <= time.monotonic_ns()
    assert (row["prefix_cached_blocks"], row["prefix_query_tokens"]) == (-1, 0)   # no prefix cache published
    actors.set_prefix_cache(1, cached_blocks=12, in_use=3)
    actors.count_prefix_cache(1, query_tokens=100, hit_tokens=64, evicted_blocks=2)
    actors.count_prefix_cache(1, query_tokens=50, hit_tokens=32, evicted_blocks=0)
    row = actors.row(1)
    assert (row["prefix_cached_blocks"], row["prefix_cached_in_use"], row["prefix_query_tokens"],
            row["prefix_hit_tokens"], row["prefix_evicted_blocks"]) == (12, 3, 150, 96, 2)
    assert actors.find("prefill0") == 1 and actors.find("nobody") is None
    with pytest.raises(ValueError, match="unknown"):
        actors.set_own_gauges(1, colour=1)
    with pytest.raises(ValueError, match="16"):
        actors.register(1, "x" * 17)
    with pytest.raises(ValueError, match="RESTARTING"):
        actors.set_status(1, ActorStatus.RESTARTING)
    with pytest.raises(IndexError):
        actors.beat(3)
    with pytest.raises(IndexError):
        actors.set_kv_blocks(3, total=1, free=1)


def test_a_restarted_actor_row_shows_no_figures_of_its_dead_predecessor(actors):
    """The supervisor never rewrites the actor's fields: until the new process starts, the row reads as
    RESTARTING with every block free and no own counts; counters run on across the restart."""
    actors.register(0, "decode0")
    actors.spawned(0, 100)
    actors.starting(0, 100)
    actors.set_status(0, ActorStatus.READY)
    actors.set_kv_blocks(0, total=64, free=10)
    actors.set_own_gauges(0, running=3)
    actors.set_health(0, ActorHealth.DEAD)
    actors.count_late_message(0)
    actors.beat(0)
    actors.restarting(0)
    for row in (actors.row(0), actors.rows()[0]):
        assert (row["status"], row["health"], row["pid"], row["restarts"]) == (
            ActorStatus.RESTARTING, ActorHealth.UNKNOWN, 0, 1)
        assert (row["kv_blocks_free"], row["own_gauges"][0], row["heartbeat_count"]) == (64, -1, 1)
    assert actors.own_gauges()[0] == -1
    actors.spawned(0, 200)
    assert actors.row(0)["status"] == ActorStatus.RESTARTING  # spawned, not started yet
    actors.starting(0, 200)
    actors.count_late_message(0)
    row = actors.row(0)
    assert (row["status"], row["kv_blocks_free"], row["own_gauges"][0], row["late_messages"]) == (
        ActorStatus.STARTING, 64, -1, 2)


def test_own_gauges_sum_over_the_actors_that_keep_them(actors):
    assert actors.own_gauges() == [-1, -1, -1, -1]
    actors.set_own_gauges(0, running=2, queued=1)
    actors.set_own_gauges(1, running=3)
    assert actors.own_gauges() == [5, 1, -1, -1]
    actors.set_active_requests(2, 7)
    assert [r["active_requests"] for r in actors.rows()] == [-1, -1, 7]


def test_busy_counts_the_actors_with_requests_queued_or_running_of_their_own(actors):
    assert actors.busy([0, 1]) == 0 and actors.busy([]) == 0   # -1: no counts kept
    actors.set_own_gauges(0, queued=0, running=0, prefill_inflight=4)   # waiting on transfers only: idle
    actors.set_own_gauges(1, queued=2, running=0)
    assert actors.busy([0, 1]) == 1
    actors.set_own_gauges(0, running=1)
    assert actors.busy([0, 1]) == 2 and actors.busy([0]) == 1 and actors.busy([2]) == 0


def test_a_beat_advances_count_time_and_iterations(actors):
    assert actors.heartbeat_age_s(0) is None
    actors.beat(0)
    first = actors.row(0)
    actors.beat(0, iterations_delta=5)
    row = actors.row(0)
    assert row["heartbeat_count"] == 2 and row["loop_iterations"] == 6
    assert row["heartbeat_ns"] >= first["heartbeat_ns"] > 0
    assert 0 <= actors.heartbeat_age_s(0) < 5


def test_a_child_actor_beats_into_the_shared_row(actors, ctx):
    p = ctx.Process(target=kids.at_beater, args=(actors.name, 2, 1000))
    p.start()
    assert kids.join_all([p]) == [0]
    row = actors.row(2)
    assert (row["heartbeat_count"], row["loop_iterations"], row["kv_blocks_free"]) == (1000, 2000, 1000)
    ro = ActorTable.attach(actors.name, readonly=True)
    try:
        assert ro.row(2)["heartbeat_count"] == 1000
        with pytest.raises(PermissionError):
            ro.spawned(2, 1)
        with pytest.raises(ValueError):
            ro.beat(2)
    finally:
        ro.close()


def test_a_drain_is_numbered_and_a_readmission_names_the_drain_it_ends(actors):
    """The monitor drains and undrains (``drained``, ``drains``, ``drain_timeouts``); the API's passing readmission
    drill names the drain it ends (``readmit_drain``); the drain survives a restart of the actor's process."""
    actors.register(2, "decode1")
    actors.spawned(2, 300)
    actors.starting(2, 300)
    assert actors.drain(2, 4, timeouts=3) == 1
    row = actors.row(2)
    assert (row["drained"], row["drains"], row["drain_timeouts"], row["readmit_drain"]) == (4, 1, 3, 0)
    actors.restarting(2)
    assert actors.row(2)["drained"] == 4
    actors.readmit(2, 1)
    actors.undrain(2)
    assert (actors.row(2)["drained"], actors.row(2)["readmit_drain"]) == (0, 1)
    assert actors.drain(2, 6, timeouts=4) == 2
    with pytest.raises(ValueError, match="live RequestState"):
        actors.drain(2, 0, timeouts=1)
