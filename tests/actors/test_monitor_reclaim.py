"""The monitor's reclaim of final rows nobody released (their API process died), on a real state table and, for
the rows a live API still writes out to a slow client, a real connection ledger."""
from __future__ import annotations

import time

import pytest

from actors import monitor
from actors.monitor import HeartbeatMonitor
from actors.topology import Topology
from ipc import naming
from ipc.actor_table import ActorHealth
from ipc.ledger import ConnectionLedger
from ipc.state_table import RequestState as S
from ipc.state_table import StateTable


class _Monitor:
    """What ``HeartbeatMonitor.reclaim_final_rows`` reads of its actor: the table."""

    def __init__(self, table):
        self.table = table


def test_a_final_row_nobody_released_is_freed_after_the_reclaim_delay_and_a_live_or_young_one_is_not():
    table = StateTable.create(naming.segment_name(naming.new_engine_id(), "reclaim"), 8)
    try:
        done, done_gen = table.allocate("done", prompt_tokens=4)
        table.transition(done, done_gen, S.FAILED, by="monitor")
        live, live_gen = table.allocate("live", prompt_tokens=4)
        time.sleep(0.01)   # not synchronisation: the next row turns final 10 ms later than the first
        young, young_gen = table.allocate("young", prompt_tokens=4)
        table.transition(young, young_gen, S.FAILED, by="monitor")
        limit_ns = int(monitor.FINAL_ROW_RECLAIM_S * 1e9)
        now_ns = int(table.row(young)["state_since_ns"]) + limit_ns - 1_000_000   # done is past the delay, young not
        HeartbeatMonitor.reclaim_final_rows(_Monitor(table), table.snapshot(), now_ns)
        assert int(table.row(done)["state"]) == S.FREE
        assert int(table.row(live)["state"]) == S.QUEUED and int(table.row(young)["state"]) == S.FAILED
    finally:
        table.close()
        table.unlink()


class _LedgerMonitor:
    """What ``HeartbeatMonitor.held_by_live_api`` reads of its actor: the topology."""

    def __init__(self):
        self.topology = Topology(1, 1)


@pytest.mark.parametrize("api_health", [ActorHealth.OK, ActorHealth.HUNG, ActorHealth.DEAD, ActorHealth.UNKNOWN])
def test_a_final_row_a_live_api_still_writes_to_a_slow_client_is_not_reclaimed_unless_the_api_is_not_ok(api_health):
    engine_id = naming.new_engine_id()
    table = StateTable.create(naming.segment_name(engine_id, "reclaim"), 8)
    ledger = ConnectionLedger.create(naming.segment_name(engine_id, "conns"), num_live=4, num_closed=2)
    try:
        slow, slow_gen = table.allocate("slow-client", prompt_tokens=4)
        table.transition(slow, slow_gen, S.FAILED, by="monitor")
        sibling, sibling_gen = table.allocate("slow-client", prompt_tokens=4)   # choice 2 of n=2: not in the ledger
        table.transition(sibling, sibling_gen, S.FAILED, by="monitor")
        orphan, orphan_gen = table.allocate("api-died", prompt_tokens=4)
        table.transition(orphan, orphan_gen, S.FAILED, by="monitor")
        i = ledger.open("127.0.0.1", 4000, 0)   # the slow client's connection: its response is still being written
        j = ledger.request_start(i, "slow-client", 1)
        ledger.request_engine(i, j, slow, slow_gen, "slow-client", 2)
        ledger.request_responding(i, j, 3)
        stub = _LedgerMonitor()
        actor_rows = [{"health": ActorHealth.OK}] * 2 + [{"health": api_health}, {"health": ActorHealth.OK}]
        held = HeartbeatMonitor.held_by_live_api(stub, actor_rows, table.snapshot(), ledger.live_rows())
        now_ns = int(table.row(orphan)["state_since_ns"]) + int(monitor.FINAL_ROW_RECLAIM_S * 1e9) + 1
        HeartbeatMonitor.reclaim_final_rows(_Monitor(table), table.snapshot(), now_ns, lambda: held)
        assert int(table.row(orphan)["state"]) == S.FREE
        kept = S.FAILED if api_health == ActorHealth.OK else S.FREE
        assert int(table.row(slow)["state"]) == kept and int(table.row(sibling)["state"]) == kept
    finally:
        ledger.close()
        ledger.unlink()
        table.close()
        table.unlink()
