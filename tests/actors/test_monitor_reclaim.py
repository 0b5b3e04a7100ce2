"""The monitor's reclaim of final rows nobody released (their API process died), on a real state table."""
from __future__ import annotations

import time

from actors import monitor
from actors.monitor import HeartbeatMonitor
from ipc import naming
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
