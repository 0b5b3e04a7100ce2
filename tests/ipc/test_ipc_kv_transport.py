from __future__ import annotations

import tracemalloc

import pytest
import torch

import ipc_children as kids
from ipc.kv_pool import KVPool
from ipc.kv_transport import (CpuShmTransport, KVTransport, TransferStatus, known_transports, make_transport,
                              publish_source)

pytestmark = pytest.mark.timeout(60)

GEOMETRY = dict(num_layers=3, num_blocks=16, block_tokens=4, num_kv_heads=2, head_dim=8)


def test_a_decode_pool_pulls_scattered_blocks_from_a_prefill_pool_in_another_process(name, ctx):
    ready, done = ctx.Event(), ctx.Event()
    src_name = name("kvp")
    p = ctx.Process(target=kids.kv_fill_owner, args=(src_name, GEOMETRY, 11, ready, done))
    p.start()
    dst = KVPool.create(name("kvd"), **GEOMETRY)
    try:
        assert ready.wait(30)
        xfer = make_transport("cpu-shm", dst)
        assert isinstance(xfer, KVTransport)
        xfer.open_peer(src_name)
        src_ids, dst_ids = [13, 2, 7, 0, 9], [5, 11, 0, 15, 3]
        h = xfer.start_copy(src_ids, dst_ids, num_tokens=18)
        assert xfer.poll(h) is TransferStatus.DONE
        want = torch.randn(dst.shape, generator=torch.Generator().manual_seed(11), dtype=torch.float32)
        got = dst.tensor()
        for s, d in zip(src_ids, dst_ids):
            assert torch.equal(got[:, :, d], want[:, :, s])
        untouched = sorted(set(range(16)) - set(dst_ids))
        assert float(got[:, :, untouched].abs().sum()) == 0.0
        assert xfer.bytes_moved_total == 5 * dst.block_bytes
        xfer.release(h)
        xfer.release(h)  # idempotent
        with pytest.raises(KeyError):
            xfer.poll(h)
        xfer.close()
    finally:
        done.set()
        assert kids.join_all([p]) == [0]
        dst.close()
        dst.unlink()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_by_block_copies_are_exact_for_every_dtype(name, dtype):
    src = KVPool.create(name("s"), dtype=dtype, **GEOMETRY)
    dst = KVPool.create(name("d"), dtype=dtype, **GEOMETRY)
    try:
        src.tensor().copy_(torch.randn(src.shape).to(dtype))
        xfer = CpuShmTransport(dst)
        xfer.open_peer(src.name)
        perm = torch.randperm(16).tolist()
        h = xfer.start_copy(list(range(16)), perm, num_tokens=64)
        assert xfer.poll(h) == TransferStatus.DONE
        assert torch.equal(dst.tensor()[:, :, perm], src.tensor())
        empty = xfer.start_copy([], [], num_tokens=0)
        assert xfer.poll(empty) == TransferStatus.DONE
        xfer.close()
    finally:
        for p in (src, dst):
            p.close()
            p.unlink()


def test_bad_copies_are_refused_before_touching_data(name):
    src = KVPool.create(name("s"), **GEOMETRY)
    dst = KVPool.create(name("d"), **GEOMETRY)
    odd = KVPool.create(name("o"), **{**GEOMETRY, "head_dim": 16})
    try:
        xfer = CpuShmTransport(dst)
        with pytest.raises(RuntimeError, match="open_peer"):
            xfer.start_copy([0], [0], num_tokens=1)
        with pytest.raises(ValueError, match="head_dim"):
            xfer.open_peer(odd.name)
        xfer.open_peer(src.name)
        for args, kw in [(([0, 1], [0]), {"num_tokens": 4}), (([0], [0]), {"num_tokens": 5}),
                         (([16], [0]), {"num_tokens": 1}), (([0], [-1]), {"num_tokens": 1}),
                         (([0, 1], [3, 3]), {"num_tokens": 8})]:
            with pytest.raises(ValueError):
                xfer.start_copy(*args, **kw)
        assert xfer.bytes_moved_total == 0
        with pytest.raises(FileNotFoundError):
            CpuShmTransport(dst).open_peer(name("missing"))
        with pytest.raises(ValueError, match="cpu-shm"):
            make_transport("carrier-pigeon", dst)
        xfer.close()
        xfer.close()
    finally:
        for p in (src, dst, odd):
            p.close()
            p.unlink()


@pytest.mark.parametrize("head_dim, streaming", [(8, True), (3, False)])  # pieces of 256 B / 96 B (unaligned)
def test_runs_and_scattered_ids_are_copied_exactly_with_and_without_streaming_stores(name, head_dim, streaming):
    geometry = {**GEOMETRY, "head_dim": head_dim}
    src = KVPool.create(name("s"), **geometry)
    dst = KVPool.create(name("d"), **geometry)
    try:
        src.tensor().copy_(torch.randn(src.shape))
        xfer = CpuShmTransport(dst)
        xfer.open_peer(src.name)
        assert xfer.streaming is streaming
        src_ids = [9, 10, 11, 12, 0, 1, 2, 3, 4, 5, 14]   # runs on the source side, given out of order
        dst_ids = [0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 13]    # and on the destination side
        h = xfer.start_copy(src_ids, dst_ids, num_tokens=len(src_ids) * geometry["block_tokens"])
        assert xfer.poll(h) == TransferStatus.DONE
        assert torch.equal(dst.tensor()[:, :, dst_ids], src.tensor()[:, :, src_ids])
        untouched = [b for b in range(geometry["num_blocks"]) if b not in dst_ids]
        assert not dst.tensor()[:, :, untouched].any()
        xfer.close()
    finally:
        for p in (src, dst):
            p.close()
            p.unlink()


@pytest.mark.parametrize("layout", ["scattered", "consecutive"])
def test_copies_allocate_no_temporary_of_the_blocks(name, layout):
    geometry = {**GEOMETRY, "num_layers": 8, "block_tokens": 16, "head_dim": 64}  # 128 KiB blocks
    src = KVPool.create(name("s"), **geometry)
    dst = KVPool.create(name("d"), **geometry)
    try:
        src.tensor().copy_(torch.randn(src.shape))
        xfer = CpuShmTransport(dst)
        xfer.open_peer(src.name)
        src_ids = [13, 2, 7, 0, 9, 4, 11, 1] if layout == "scattered" else list(range(2, 10))
        dst_ids = [5, 11, 0, 15, 3, 8, 1, 6] if layout == "scattered" else list(range(6, 14))
        xfer.release(xfer.start_copy(src_ids, dst_ids, num_tokens=8 * 16))  # warm-up (lazy imports, caches)
        tracemalloc.start()
        try:
            h = xfer.start_copy(src_ids, dst_ids, num_tokens=8 * 16)
            peak_bytes = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        xfer.release(h)
        # torch's CPU allocator is invisible to tracemalloc: its profiler's memory events count those bytes (a run
        # of its own: the profiler's own Python objects would fill tracemalloc's count)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            h = xfer.start_copy(src_ids, dst_ids, num_tokens=8 * 16)
        torch_bytes = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)
        assert xfer.poll(h) == TransferStatus.DONE
        assert torch.equal(dst.tensor()[:, :, dst_ids], src.tensor()[:, :, src_ids])
        # numpy reports its buffers to tracemalloc: a gather would allocate the 8 blocks (1 MiB) at once
        assert peak_bytes < dst.block_bytes // 4, f"start_copy allocated {peak_bytes} bytes (numpy)"
        assert torch_bytes < dst.block_bytes // 4, f"start_copy allocated {torch_bytes} bytes (torch)"
        xfer.close()
    finally:
        for p in (src, dst):
            p.close()
            p.unlink()


def test_a_source_side_start_up_only_for_transports_that_declare_one(name):
    pool = KVPool.create(name("s"), **GEOMETRY)
    try:
        assert publish_source("cpu-shm", pool) is None   # the decode side attaches the shm pool by name
        assert "mooncake" in known_transports()
        with pytest.raises(ValueError, match="known: cpu-shm"):
            publish_source("carrier-pigeon", pool)
    finally:
        pool.close()
        pool.unlink()
