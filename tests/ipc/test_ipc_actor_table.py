from __future__ import annotations

import time

import pytest

import ipc_children as kids
from ipc.actor_table import ROW_DTYPE, ActorRole, ActorStatus, ActorTable

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def actors(name):
    t = ActorTable.create(name("actors"), 3)
    try:
        yield t
    finally:
        t.close()
        t.unlink()


def test_rows_start_empty_and_take_settings(actors):
    assert ROW_DTYPE.itemsize == 128
    assert [r["status"] for r in actors.rows()] == [ActorStatus.EMPTY] * 3
    actors.set(1, name="prefill0", role=ActorRole.PREFILL, device="cpu", pid=4242, status=ActorStatus.READY,
               started_ns=time.monotonic_ns(), kv_blocks_total=64, kv_blocks_free=60)
    row = actors.row(1)
    assert (row["name"], row["role"], row["device"], row["pid"], row["status"], row["kv_blocks_free"]) == (
        "prefill0", ActorRole.PREFILL, "cpu", 4242, ActorStatus.READY, 60)
    assert actors.find("prefill0") == 1 and actors.find("nobody") is None
    with pytest.raises(ValueError, match="unknown"):
        actors.set(1, colour="red")
    with pytest.raises(ValueError, match="16"):
        actors.set(1, name="x" * 17)
    with pytest.raises(IndexError):
        actors.beat(3)


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
            ro.set(2, pid=1)
        with pytest.raises(ValueError):
            ro.beat(2)
    finally:
        ro.close()
