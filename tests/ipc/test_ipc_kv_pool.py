from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

import ipc_children as kids
from ipc.kv_pool import KVPool
from pdserve.errors import KVBlockStateError, OutOfKVBlocksError

pytestmark = pytest.mark.timeout(60)

GEOMETRY = dict(num_layers=2, num_blocks=8, block_tokens=4, num_kv_heads=2, head_dim=8)


@pytest.fixture
def pool(name):
    p = KVPool.create(name("kv"), **GEOMETRY)
    try:
        yield p
    finally:
        p.close()
        p.unlink()


def test_the_tensor_views_the_shm_data_with_the_documented_shape(pool):
    t = pool.tensor()
    assert t.shape == (2, 2, 8, 4, 2, 8) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % 64 == 0 and pool.data_offset % 64 == 0
    assert pool.block_bytes == 2 * 2 * 4 * 2 * 8 * 4
    assert float(t.abs().sum()) == 0.0
    t[1, 0, 3] = 2.5
    assert float(pool.array()[1, 0, 3, 0, 0, 0]) == 2.5  # same bytes
    assert pool.tensor() is t


def test_a_pool_without_data_is_the_kv_table_alone(name):
    p = KVPool.create(name("kvt"), data=False, **GEOMETRY)
    try:
        peer = KVPool.attach(p.name, readonly=True)
        assert p.data_bytes == peer.data_bytes == 0 and peer.shape == (2, 2, 8, 4, 2, 8)
        assert peer.block_bytes == 2 * 2 * 4 * 2 * 8 * 4   # the geometry a transport checks and counts with
        ids = p.allocate(3, 5)
        assert peer.generations(ids) == p.generations(ids) and peer.epoch == 1
        with pytest.raises(ValueError, match="no data section"):
            p.tensor()
        with pytest.raises(ValueError, match="no data section"):
            peer.array()
        peer.close()
    finally:
        p.close()
        p.unlink()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_pools_keep_their_dtype(name, dtype):
    p = KVPool.create(name("kvh"), dtype=dtype, **GEOMETRY)
    try:
        t = p.tensor()
        assert t.dtype == dtype and t.element_size() == 2
        t[0, 1, 2] = 1.5
        peer = KVPool.attach(p.name, readonly=True)
        assert peer.tensor().dtype == dtype and float(peer.tensor()[0, 1, 2, 0, 0, 0]) == 1.5
        peer.close()
    finally:
        p.close()
        p.unlink()


def test_allocate_and_free_track_owner_and_generation(pool):
    assert (pool.num_blocks, pool.num_free, pool.usage_ratio) == (8, 8, 0.0)
    ids = pool.allocate(3, owner_slot=5)
    assert ids == [0, 1, 2] and pool.num_free == 5 and pool.usage_ratio == 3 / 8
    assert pool.blocks_of(5) == ids and pool.generations(ids) == [1, 1, 1]
    assert pool.is_current(ids, [1, 1, 1], owner_slot=5) and not pool.is_current(ids, [1, 1, 1], owner_slot=4)
    assert pool.free(ids, owner_slot=5) == 3 and pool.num_free == 8
    again = pool.allocate(8, owner_slot=1)
    assert pool.generations(ids) == [2, 2, 2]  # bumped on every allocate
    assert not pool.is_current(ids, [1, 1, 1])
    assert sorted(again) == list(range(8))
    pool.audit()


def test_a_block_is_freed_exactly_once(pool):
    ids = pool.allocate(2, owner_slot=1)
    pool.free(ids[:1], owner_slot=1)
    with pytest.raises(KVBlockStateError, match="already free") as info:
        pool.free(ids, owner_slot=1)  # ids[0] twice: error, but ids[1] is still freed
    assert [b for b, _ in info.value.bad_blocks] == [ids[0]]
    assert pool.num_free == 8
    pool.audit()


def test_a_non_owner_cannot_free_and_bad_ids_are_named(pool):
    mine = pool.allocate(2, owner_slot=1)
    with pytest.raises(KVBlockStateError, match="held by slot 1"):
        pool.free(mine, owner_slot=2)
    assert pool.blocks_of(1) == mine
    with pytest.raises(KVBlockStateError, match="listed twice"):
        pool.free([mine[0], mine[0]], owner_slot=1)
    with pytest.raises(KVBlockStateError, match="outside"):
        pool.free([99], owner_slot=1)
    with pytest.raises(KVBlockStateError, match="stale generation"):
        pool.free([mine[1]], owner_slot=1, generations=[0])
    assert pool.blocks_of(1) == [mine[1]]
    pool.free([mine[1]], owner_slot=1, generations=pool.generations([mine[1]]))
    pool.audit()


def test_allocation_is_all_or_nothing(pool):
    pool.allocate(6, owner_slot=1)
    with pytest.raises(OutOfKVBlocksError, match="2 of 8 free"):
        pool.allocate(3, owner_slot=2)
    assert pool.num_free == 2 and pool.blocks_of(2) == []
    assert pool.allocate(0, owner_slot=2) == []
    with pytest.raises(ValueError):
        pool.allocate(1, owner_slot=-1)


def test_free_owned_by_returns_every_block_of_a_slot(pool):
    a = pool.allocate(3, owner_slot=1)
    b = pool.allocate(2, owner_slot=2)
    assert pool.free_owned_by(1) == 3 and pool.free_owned_by(1) == 0
    assert pool.blocks_of(2) == b and pool.num_free == 6
    assert set(pool.allocate(6, owner_slot=3)) == set(range(8)) - set(b)
    pool.audit()
    del a


def test_reassign_hands_blocks_over_unchanged_all_or_nothing(pool):
    ids = pool.allocate(3, owner_slot=4)
    gens = pool.generations(ids)
    pool.reassign(ids[:2], 4, 2**31 - 1)   # the prefix cache's owner (actors/prefix_cache.CACHE_OWNER)
    assert pool.blocks_of(2**31 - 1) == sorted(ids[:2]) and pool.blocks_of(4) == [ids[2]]
    assert pool.generations(ids) == gens and pool.num_free == 8 - 3
    with pytest.raises(KVBlockStateError):
        pool.reassign(ids, 4, 5)   # two of them are not slot 4's any more: nothing changes
    assert pool.blocks_of(4) == [ids[2]] and pool.blocks_of(5) == []
    assert pool.free(ids[:2], 2**31 - 1) == 2
    pool.audit()


def test_reset_frees_everything_and_bumps_the_epoch(pool):
    pool.allocate(5, owner_slot=1)
    assert pool.epoch == 1
    pool.reset()
    assert pool.num_free == 8 and pool.epoch == 2 and pool.blocks_of(1) == []
    pool.audit()


def test_a_restarted_owner_reattaches_with_the_allocations_in_shm(pool):
    held = pool.allocate(3, owner_slot=4)
    again = KVPool.attach(pool.name)  # what a restarted actor does (the old process is gone)
    try:
        assert again.num_free == 5 and again.blocks_of(4) == held
        assert not set(again.allocate(5, owner_slot=6)) & set(held)
        again.reset()
        assert again.num_free == 8
    finally:
        again.close()


def test_a_readonly_peer_cannot_allocate_or_write_through_numpy(pool):
    pool.allocate(2, owner_slot=3)
    peer = KVPool.attach(pool.name, readonly=True)
    try:
        assert peer.readonly and peer.num_free == 6 and peer.blocks_of(3) == [0, 1]
        with pytest.raises(PermissionError):
            peer.allocate(1, owner_slot=1)
        with pytest.raises(PermissionError):
            peer.free([0], owner_slot=3)
        assert not peer.array().flags.writeable
        with pytest.raises(PermissionError):
            peer.unlink()
    finally:
        peer.close()


def test_a_peer_process_sees_what_the_owner_wrote(pool, ctx):
    t = pool.tensor()
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).reshape(t.shape))
    pool.allocate(2, owner_slot=9)
    expect = [float(t[:, :, b].double().sum()) for b in (0, 5, 7)]
    results = ctx.Queue()
    p = ctx.Process(target=kids.kv_read_peer, args=(pool, [0, 5, 7], results))  # pickled by name
    p.start()
    sums, owners, num_free, readonly, writable = results.get(timeout=30)
    assert kids.join_all([p]) == [0]
    assert sums == expect
    assert owners == [9, 9, -1, -1, -1, -1, -1, -1] and num_free == 6
    assert readonly is True and writable is False


def test_the_owner_can_live_in_another_process(name, ctx):
    ready, done = ctx.Event(), ctx.Event()
    p = ctx.Process(target=kids.kv_fill_owner, args=(name("kvo"), GEOMETRY, 3, ready, done))
    p.start()
    try:
        assert ready.wait(30)
        peer = KVPool.attach(name("kvo"), readonly=True)
        g = torch.Generator().manual_seed(3)
        want = torch.randn(peer.shape, generator=g, dtype=torch.float32)
        assert torch.equal(peer.tensor(), want)
        assert peer.blocks_of(7) == [0, 1, 2] and pickle.loads(pickle.dumps(peer)).readonly
        peer.close()
    finally:
        done.set()
        assert kids.join_all([p]) == [0]


def test_close_keeps_outstanding_tensors_valid(name):
    p = KVPool.create(name("kvc"), **GEOMETRY)
    t = p.tensor()
    t.fill_(1.0)
    p.close()
    p.close()
    assert float(t.sum()) == t.numel()  # the tensor pinned the mapping: no dangling pointer
    p.unlink()
    with pytest.raises(ValueError):
        p.tensor()
    del t
    np.testing.assert_equal(p.num_blocks, 8)
