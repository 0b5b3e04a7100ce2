"""actors/shell.py: the GaugePublisher over a recording actor table (own gauges every call, the done counter and
the free blocks and prefix-cache counters as deltas, only when they changed); the decode step's thread count."""
from __future__ import annotations

from actors.prefix_cache import CachingAllocator
from actors.shell import GaugePublisher, decode_threads, prefill_threads
from pdserve.config import EngineConfig
from tests.actors.fakes import FakeAllocator


class RecordingActors:
    def __init__(self):
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))

    def take(self, name: str) -> list[tuple]:
        mine = [c for c in self.calls if c[0] == name]
        self.calls = [c for c in self.calls if c[0] != name]
        return mine


def test_the_publisher_writes_changes_only_as_deltas():
    pool = FakeAllocator(8)
    allocator = CachingAllocator(pool, enabled=True)
    actors = RecordingActors()
    gauges = GaugePublisher(actors, 3, pool, allocator)
    gauges.publish({"running": 1}, done=0)
    assert actors.take("set_own_gauges") == [("set_own_gauges", (3,), {"running": 1})]
    assert actors.take("set_kv_blocks") == [("set_kv_blocks", (3,), {"total": 8, "free": 8})]
    assert actors.take("count_requests_done") == []
    gauges.publish({"running": 0}, done=2)
    gauges.publish({"running": 0}, done=5)
    assert [c[1] for c in actors.take("count_requests_done")] == [(3, 2), (3, 3)]
    assert actors.take("set_kv_blocks") == []   # unchanged
    allocator.allocate(3, owner_slot=1)
    gauges.publish({"running": 1}, done=5)
    assert actors.take("set_kv_blocks") == [("set_kv_blocks", (3,), {"total": 8, "free": 5})]
    assert actors.take("count_requests_done") == [] and actors.take("count_prefix_cache") == []
    assert len(actors.take("set_prefix_cache")) == 4   # the cache's gauges: every call while it is on


def test_decode_threads_auto_shares_the_cpus_among_decode_actors_and_leaves_busy_prefill_actors_theirs():
    auto = EngineConfig()
    assert auto.decode_threads == 0
    assert decode_threads(auto, 1, busy_prefill=0, cpus=2) == 2   # the prefill actor idle: its core decodes
    assert decode_threads(auto, 1, busy_prefill=1, cpus=2) == 1
    assert decode_threads(auto, 2, busy_prefill=0, cpus=2) == 1
    assert decode_threads(auto, 2, busy_prefill=2, cpus=16) == 7
    assert decode_threads(EngineConfig(torch_threads=2), 2, busy_prefill=2, cpus=16) == 6
    assert decode_threads(auto, 4, busy_prefill=4, cpus=2) == 1   # never below one
    assert decode_threads(auto, 1) >= 1                          # this process's CPUs
    assert decode_threads(auto, 1, cpus=2, rows=3) == 1 and decode_threads(auto, 1, cpus=2, rows=4) == 2
    assert decode_threads(EngineConfig(decode_threads=3), 1, busy_prefill=1, cpus=2, rows=1) == 3   # as configured


def test_prefill_threads_auto_takes_the_idle_decode_actors_cores_and_keeps_torch_threads_beside_a_busy_one():
    auto = EngineConfig()
    assert auto.prefill_threads == 0
    assert prefill_threads(auto, 1, busy_decode=0, cpus=2) == 2   # nothing decoding: its core prefills
    assert prefill_threads(auto, 1, busy_decode=1, cpus=2) == 1
    assert prefill_threads(auto, 2, busy_decode=0, cpus=2) == 1
    assert prefill_threads(auto, 2, busy_decode=0, cpus=16) == 8
    assert prefill_threads(EngineConfig(torch_threads=3), 2, busy_decode=1, cpus=16) == 3
    assert prefill_threads(EngineConfig(torch_threads=3), 4, busy_decode=0, cpus=4) == 3   # never below it
    assert prefill_threads(auto, 1) >= 1                                                    # this process's CPUs
    assert prefill_threads(EngineConfig(prefill_threads=3), 1, busy_decode=1, cpus=2) == 3   # as configured
