"""The ``mooncake`` KV transport between two real processes over TCP on loopback, each with its own KV pool.

An optional extra: skipped (with the reason) where the Mooncake Transfer Engine or the shared libraries it
loads are missing (``make test-mooncake`` installs both); where it imports, these tests run.
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

try:   # an optional extra: the one place a missing library is a skip, with the import error as the reason
    import ipc.mooncake_transport  # noqa: F401
except ImportError as exc:
    pytest.skip(f"{exc} (make test-mooncake installs both)", allow_module_level=True)

import ipc_children as kids  # noqa: E402
from ipc.kv_pool import KVPool  # noqa: E402
from ipc.kv_transport import KVTransport, TransferStatus, make_transport  # noqa: E402
from ipc.mooncake_transport import MooncakeTransport  # noqa: E402

pytestmark = pytest.mark.timeout(120)

GEOMETRY = dict(num_layers=3, num_blocks=16, block_tokens=4, num_kv_heads=2, head_dim=8)
DEADLINE_S = 20.0


def expected(shape, seed: int, dtype) -> torch.Tensor:
    """What ``kids.kv_mooncake_source`` wrote into its pool."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).to(dtype)


def settle(xfer: KVTransport, handle: int, timeout_s: float = DEADLINE_S) -> TransferStatus:
    """Poll ``handle`` until it leaves IN_PROGRESS; AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = xfer.poll(handle)
        if status is not TransferStatus.IN_PROGRESS:
            return status
        time.sleep(0.005)
    raise AssertionError(f"transfer {handle} still IN_PROGRESS after {timeout_s} s")


@pytest.fixture
def source(name, ctx):
    """A prefill-like process owning a filled pool published through Mooncake: yields (pool name, process)."""
    started = []

    def start(geometry=GEOMETRY, seed=11):
        ready, done = ctx.Event(), ctx.Event()
        pool_name = name(f"kvp{len(started)}")
        p = ctx.Process(target=kids.kv_mooncake_source, args=(pool_name, geometry, seed, ready, done))
        p.start()
        started.append((p, done))
        assert ready.wait(60), "the source process did not publish its pool"
        return pool_name, p

    yield start
    for p, done in started:
        if p.is_alive():   # (a killed waiter would never acknowledge the Event: set() would block)
            os.kill(p.pid, signal.SIGCONT)
            done.set()
    kids.join_all([p for p, _ in started])


@pytest.fixture
def dst_pool(name):
    pools = []

    def make(**overrides):
        pool = KVPool.create(name(f"kvd{len(pools)}"), **{**GEOMETRY, **overrides})
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()
        pool.unlink()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_pulls_scattered_and_consecutive_blocks_byte_exact(source, dst_pool, dtype):
    peer_name, _ = source(dict(GEOMETRY, dtype=dtype))
    dst = dst_pool(dtype=dtype)
    xfer = make_transport("mooncake", dst)
    assert isinstance(xfer, MooncakeTransport)
    xfer.open_peer(peer_name)
    want = expected(dst.shape, 11, dtype)
    scattered_src, scattered_dst = [13, 2, 7, 0, 9], [5, 11, 0, 15, 3]
    h = xfer.start_copy(scattered_src, scattered_dst, num_tokens=18)
    assert settle(xfer, h) is TransferStatus.DONE, xfer.error(h)
    got = dst.tensor()
    for s, d in zip(scattered_src, scattered_dst):
        assert torch.equal(got[:, :, d], want[:, :, s])
    runs_src, runs_dst = [4, 5, 6, 10, 11], [6, 7, 8, 12, 13]   # two runs of consecutive blocks
    h2 = xfer.start_copy(runs_src, runs_dst, num_tokens=20)
    assert settle(xfer, h2) is TransferStatus.DONE, xfer.error(h2)
    assert torch.equal(got[:, :, runs_dst], want[:, :, runs_src])
    untouched = sorted(set(range(16)) - set(scattered_dst) - set(runs_dst))
    assert not got[:, :, untouched].float().any()
    assert xfer.bytes_moved_total == 10 * dst.block_bytes
    empty = xfer.start_copy([], [], num_tokens=0)
    assert xfer.poll(empty) is TransferStatus.DONE
    for handle in (h, h2, empty):
        xfer.release(handle)
        xfer.release(handle)   # idempotent
        with pytest.raises(KeyError):
            xfer.poll(handle)
    xfer.close()
    xfer.close()


def test_bad_copies_and_unpublished_or_mismatched_peers(source, dst_pool, name):
    peer_name, _ = source()
    dst = dst_pool()
    xfer = MooncakeTransport(dst)
    with pytest.raises(RuntimeError, match="open_peer"):
        xfer.start_copy([0], [0], num_tokens=1)
    with pytest.raises(ValueError, match="head_dim"):
        MooncakeTransport(dst_pool(head_dim=16)).open_peer(peer_name)
    xfer.open_peer(peer_name)
    for args, kw in [(([0, 1], [0]), {"num_tokens": 4}), (([0], [0]), {"num_tokens": 5}),
                     (([16], [0]), {"num_tokens": 1}), (([0, 1], [3, 3]), {"num_tokens": 8})]:
        with pytest.raises(ValueError):
            xfer.start_copy(*args, **kw)
    xfer.close()
    # a peer that has not published yet: open_peer defers, the copy FAILS naming the missing descriptor
    late = MooncakeTransport(dst)
    late.open_peer(name("never_published"))
    h = late.start_copy([0], [0], num_tokens=1)
    assert late.poll(h) is TransferStatus.FAILED
    assert "never_published" in late.error(h)
    late.close()


def test_a_killed_peer_fails_the_transfer_in_flight_and_the_next_one(source, dst_pool):
    peer_name, proc = source()
    dst = dst_pool()
    xfer = MooncakeTransport(dst)
    xfer.open_peer(peer_name)
    assert settle(xfer, xfer.start_copy([1], [1], num_tokens=4)) is TransferStatus.DONE   # connected
    os.kill(proc.pid, signal.SIGSTOP)   # the peer stops answering: the read stays in flight
    h = xfer.start_copy([2, 3], [2, 3], num_tokens=8)
    assert xfer.poll(h) is TransferStatus.IN_PROGRESS
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    t0 = time.monotonic()
    assert settle(xfer, h) is TransferStatus.FAILED
    assert "returned" in xfer.error(h)
    h2 = xfer.start_copy([4], [4], num_tokens=4)
    assert settle(xfer, h2) is TransferStatus.FAILED
    assert time.monotonic() - t0 < DEADLINE_S
    xfer.close(timeout_s=DEADLINE_S)


def test_a_released_in_flight_transfer_lands_before_the_next_one_into_the_same_blocks(source, dst_pool):
    peer_name, proc = source()
    dst = dst_pool()
    xfer = MooncakeTransport(dst)
    xfer.open_peer(peer_name)
    assert settle(xfer, xfer.start_copy([0], [0], num_tokens=4)) is TransferStatus.DONE   # connected
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        aborted = xfer.start_copy([5, 6, 7], [8, 9, 10], num_tokens=12)
        assert xfer.poll(aborted) is TransferStatus.IN_PROGRESS
        xfer.release(aborted)   # the decode side gave up on it (deadline, abort) and reuses blocks 8-10
        with pytest.raises(KeyError):
            xfer.poll(aborted)
        assert xfer.in_flight == 1
        reuse = xfer.start_copy([12, 13, 14], [8, 9, 10], num_tokens=12)
        assert xfer.poll(reuse) is TransferStatus.IN_PROGRESS
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert settle(xfer, reuse) is TransferStatus.DONE, xfer.error(reuse)
    assert xfer.in_flight == 0
    want = expected(dst.shape, 11, dst.tensor().dtype)
    assert torch.equal(dst.tensor()[:, :, [8, 9, 10]], want[:, :, [12, 13, 14]])
    assert xfer.bytes_moved_total == 4 * dst.block_bytes   # the released transfer counts for nothing
    xfer.close(timeout_s=DEADLINE_S)


def test_a_republished_descriptor_is_read_whole_and_a_half_written_one_not_at_all(name):
    from ipc import _shm
    from ipc.mooncake_transport import MooncakeSource, read_descriptor

    pool = KVPool.create(name("kvs"), **GEOMETRY)
    first = second = None
    try:
        first = MooncakeSource(pool)   # a prefill actor's start
        mm = _shm.attach_segment(first.name)
        seq1, desc1 = read_descriptor(mm, first.name)
        assert desc1 == first.descriptor and desc1.epoch == pool.epoch and seq1 % 2 == 0
        first.close()
        pool.reset()   # what a restarted prefill actor does before it publishes again
        second = MooncakeSource(pool)
        seq2, desc2 = read_descriptor(mm, first.name)
        assert seq2 == seq1 + 2 and desc2.epoch == desc1.epoch + 1
        mm[8:16] = (seq2 + 1).to_bytes(8, "little")   # as if a publisher were mid-write (or died there)
        with pytest.raises(FileNotFoundError, match="not published"):
            read_descriptor(mm, first.name)
        _shm.close_mapping(mm)
    finally:
        for source in (first, second):
            if source is not None:
                source.close(unlink=True)
        pool.close()
        pool.unlink()
