from __future__ import annotations

import pytest

from ipc import naming
from ipc.shm_queue import ShmQueue
from ipc.state_table import StateTable

pytestmark = pytest.mark.timeout(60)


def test_engine_ids_are_short_unique_hex():
    ids = {naming.new_engine_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(len(i) == 8 and int(i, 16) >= 0 for i in ids)


def test_segment_names_carry_the_engine_id_and_stay_short():
    assert naming.segment_name("1a2b3c4d", "q_prefill0") == "/pdserve_1a2b3c4d_q_prefill0"
    assert len(naming.segment_name("1a2b3c4d", "kv_decode0")) <= 30
    assert naming.engine_id_of("sem.pdserve_1a2b3c4d_q_it") == "1a2b3c4d"
    bad = [("", "q"), ("a_b", "q"), ("ab/c", "q"), ("ab", ""), ("ab", "x/y"), ("ab", "a" * 300)]
    for bad_id, what in bad:
        with pytest.raises(ValueError):
            naming.segment_name(bad_id, what)


def test_unlink_all_removes_one_engine_and_spares_the_others():
    mine, other = naming.new_engine_id(), naming.new_engine_id()
    made = []
    try:
        made = [ShmQueue.create(naming.segment_name(mine, "q"), num_slots=2, slot_bytes=64),
                StateTable.create(naming.segment_name(mine, "req"), 4),
                ShmQueue.create(naming.segment_name(other, "q"), num_slots=2, slot_bytes=64)]
        listed = naming.list_engine_segments(mine)
        assert "pdserve_%s_q" % mine in listed and "sem.pdserve_%s_req_lock" % mine in listed
        assert len(listed) == 9  # queue: 1 + 5 semaphores; table: 1 + 2
        assert set(listed) <= set(naming.list_engine_segments())
        assert sorted(naming.unlink_all(mine)) == listed
        assert naming.list_engine_segments(mine) == []
        assert len(naming.list_engine_segments(other)) == 6
        assert naming.unlink_all(mine) == []  # already gone: fine
        with pytest.raises(ValueError):
            naming.unlink_all("")
    finally:
        for obj in made:
            obj.close()
        naming.unlink_all(mine)
        naming.unlink_all(other)
