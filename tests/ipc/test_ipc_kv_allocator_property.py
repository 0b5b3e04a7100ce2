"""Property: any sequence of allocate/free keeps the allocator's books exact."""
from __future__ import annotations

import pytest

import hypothesis.strategies as st
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ipc import naming
from ipc.kv_pool import KVPool
from pdserve.errors import KVBlockStateError, OutOfKVBlocksError

pytestmark = pytest.mark.timeout(60)

NUM_BLOCKS = 12


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.engine = naming.new_engine_id()
        self.pool = KVPool.create(naming.segment_name(self.engine, "kv"), num_layers=1, num_blocks=NUM_BLOCKS,
                                  block_tokens=1, num_kv_heads=1, head_dim=1)
        self.held: dict[int, int] = {}  # block -> slot (the model)
        self.gens = np.zeros(NUM_BLOCKS, dtype=np.int64)

    @rule(n=st.integers(0, NUM_BLOCKS + 2), slot=st.integers(0, 4))
    def allocate(self, n, slot):
        free_before = self.pool.num_free
        try:
            ids = self.pool.allocate(n, slot)
        except OutOfKVBlocksError:
            assert n > free_before and self.pool.num_free == free_before  # nothing handed out
            return
        assert len(ids) == n == len(set(ids))
        for b in ids:
            assert b not in self.held, f"block {b} handed out while held by slot {self.held[b]}"
            self.held[b] = slot
            self.gens[b] += 1
        assert self.pool.generations(ids) == self.gens[ids].tolist()

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_some(self, data):
        slot = data.draw(st.sampled_from(sorted(set(self.held.values()))))
        mine = sorted(b for b, s in self.held.items() if s == slot)
        ids = data.draw(st.lists(st.sampled_from(mine), min_size=1, unique=True))
        assert self.pool.free(ids, slot) == len(ids)
        for b in ids:
            del self.held[b]

    @rule(block=st.integers(0, NUM_BLOCKS - 1), slot=st.integers(0, 4))
    def wrong_free_is_refused(self, block, slot):
        if self.held.get(block) == slot:
            return
        before = self.pool.owner_slots()
        try:
            self.pool.free([block], slot)
        except KVBlockStateError:
            pass
        else:
            raise AssertionError("freeing a block not held by the slot must raise")
        assert np.array_equal(self.pool.owner_slots(), before)

    @rule(slot=st.integers(0, 4))
    def free_owned_by(self, slot):
        mine = [b for b, s in self.held.items() if s == slot]
        assert self.pool.free_owned_by(slot) == len(mine)
        for b in mine:
            del self.held[b]

    @invariant()
    def books_balance(self):
        assert self.pool.num_free + len(self.held) == NUM_BLOCKS
        owners = self.pool.owner_slots()
        assert {b: int(owners[b]) for b in np.flatnonzero(owners >= 0)} == self.held
        self.pool.audit()

    def teardown(self):
        self.pool.close()
        self.pool.unlink()
        naming.unlink_all(self.engine)


AllocatorMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
test_allocator_books_balance_under_random_allocate_and_free = AllocatorMachine.TestCase
