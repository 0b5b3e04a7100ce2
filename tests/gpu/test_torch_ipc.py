"""The torch-ipc KV transport (gpu/cuda_ipc.py's CPU twin of cuda-ipc) between real processes: a pool exported
in one process and opened in another through torch's ``reduce_tensor``/rebuild path, a write seen by the reader,
the epoch change after the exporter is SIGKILLed and restarted, decode's TransferDone only after the copy is
DONE, and no torch shm file left once the processes are gone. GPU-only versions: tests/gpu/test_cuda_ipc.py."""
from __future__ import annotations

import gc
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import threading

import pytest
import torch

from gpu.cuda_ipc import (TorchIpcExport, TorchIpcTransport, allocate_device_pool, export_name,
                          open_export_segment, read_export, unlink_exported_files)
from ipc import naming
from tests.conftest import wait_until
from tests.gpu.conftest import IPC_GEOMETRY, finished
from ipc.kv_pool import KVPool
from ipc.kv_transport import TransferStatus, make_transport

pytestmark = pytest.mark.timeout(120)

GEOMETRY = IPC_GEOMETRY


def pool_data(seed: int, shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def torch_files(pids) -> list[str]:
    """/dev/shm files torch's file_system sharing made in processes ``pids`` (``torch_<pid>_...``)."""
    return sorted(e for e in os.listdir("/dev/shm") if any(e.startswith(f"torch_{p}_") for p in pids))


def producer(pool_name: str, seed: int, reset: bool, ready, go, done, late_seed: int) -> None:
    """The prefill side: its pool (``reset``: as a restarted actor takes it) as a CPU tensor filled from ``seed``,
    exported; on ``go``, block 3 rewritten with ``late_seed`` data and ``record_written``; on ``done``, exit."""
    pool = KVPool.attach(pool_name)
    if reset:
        pool.reset()
    kv = allocate_device_pool(pool, "cpu")
    kv.copy_(pool_data(seed, pool.shape))
    export = TorchIpcExport.publish(pool, kv)
    ready.set()
    if go is not None and go.wait(60):
        kv[:, :, 3].copy_(pool_data(late_seed, kv[:, :, 3].shape))
        export.record_written()
        ready.clear()
    done.wait(60)
    export.close()
    import gpu.cuda_ipc as cuda_ipc

    cuda_ipc._DEVICE_POOLS.clear()   # this pool's last reference here: torch unlinks its file after the reader's
    del kv, export
    gc.collect()
    pool.close()


def start(ctx, *args):
    p = ctx.Process(target=producer, args=args)
    p.start()
    return p


def join_all(processes) -> None:
    for p in processes:
        p.join(30)
        if p.is_alive():
            p.kill()
            p.join(10)


@pytest.fixture
def pools(engine_id):
    src = KVPool.create(naming.segment_name(engine_id, "kvp"), **GEOMETRY)
    dst = KVPool.create(naming.segment_name(engine_id, "kvd"), **GEOMETRY)
    try:
        yield src, dst
    finally:
        for pool in (src, dst):
            pool.close()
            pool.unlink()


def test_decode_pulls_scattered_blocks_from_a_prefill_cpu_pool_in_another_process_and_sees_its_writes(pools):
    src_pool, dst_pool = pools
    ctx = mp.get_context("spawn")
    ready, go, done = ctx.Event(), ctx.Event(), ctx.Event()
    p = start(ctx, src_pool.name, 11, False, ready, go, done, 99)
    try:
        assert ready.wait(60), "the producer did not publish"
        record = read_export(open_export_segment(export_name(src_pool.name, ".tipc"), create=False))
        assert (record.pid, record.device, record.pool_epoch) == (p.pid, -1, src_pool.epoch)
        allocate_device_pool(dst_pool, "cpu")
        xfer = make_transport("torch-ipc", dst_pool)
        assert isinstance(xfer, TorchIpcTransport) and xfer.copy_backend == "torch"
        xfer.open_peer(src_pool.name)
        src_ids, dst_ids = [13, 2, 7, 0, 9], [5, 11, 0, 15, 3]
        h = xfer.start_copy(src_ids, dst_ids, num_tokens=18)
        assert finished(xfer, h) == TransferStatus.DONE, xfer.error(h)
        want = pool_data(11, dst_pool.shape)
        for s, d in zip(src_ids, dst_ids):
            assert torch.equal(xfer._dst[:, :, d], want[:, :, s])
        untouched = sorted(set(range(16)) - set(dst_ids))
        assert float(xfer._dst[:, :, untouched].abs().sum()) == 0.0
        assert xfer.bytes_moved_total == 5 * dst_pool.block_bytes
        # the producer writes block 3 after the export: the reader maps the same memory, no re-export
        go.set()
        wait_until(lambda: not ready.is_set(), 30, message="the producer to rewrite block 3")
        h2 = xfer.start_copy([3], [1], num_tokens=4)
        assert finished(xfer, h2) == TransferStatus.DONE
        assert torch.equal(xfer._dst[:, :, 1], pool_data(99, want[:, :, 3].shape))
        xfer.close()
        # a second reader (another decode actor, a restarted one) opens the same export: the payload is not
        # used up by the first (a file-descriptor payload would be)
        again = make_transport("torch-ipc", dst_pool)
        again.open_peer(src_pool.name)
        h3 = again.start_copy([3], [2], num_tokens=1)
        assert finished(again, h3) == TransferStatus.DONE
        assert torch.equal(again._dst[:, :, 2], pool_data(99, want[:, :, 3].shape))
        again.close()
    finally:
        done.set()
        join_all([p])
    assert p.exitcode == 0
    gc.collect()
    wait_until(lambda: not torch_files([p.pid]), 30, message="the exported pool's shm file to be unlinked")


def decode_side(pool_name: str, peer_name: str, steps, results) -> None:
    """The decode side in its own process (so that, once it exits, torch's shm manager may unlink what a killed
    producer left): opens the peer, then for each ``steps`` item waits for the parent's event and copies blocks
    0 and 3 into 0 and 1, putting ``(status, error, dst block 0, dst block 1)`` on ``results``."""
    pool = KVPool.attach(pool_name)
    allocate_device_pool(pool, "cpu")
    xfer = make_transport("torch-ipc", pool)
    xfer.open_peer(peer_name)
    for event in steps:
        if not event.wait(60):
            break
        h = xfer.start_copy([0, 3], [0, 1], num_tokens=8)
        status = finished(xfer, h)
        # numpy copies: a tensor on a queue would be shared through this process's fd server, gone once it exits
        results.put((int(status), xfer.error(h), xfer._dst[:, :, 0].numpy().copy(), xfer._dst[:, :, 1].numpy().copy()))
        xfer.release(h)
    xfer.close()
    pool.close()


def test_a_restarted_exporter_bumps_the_epoch_and_the_reader_reopens_its_new_pool(pools):
    src_pool, dst_pool = pools
    ctx = mp.get_context("spawn")
    # the killed producer dies waiting on its own event: set, that event would wait for a sleeper that is gone
    ready1, ready2, killed_done, done = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Event()
    steps = [ctx.Event() for _ in range(3)]
    results = ctx.Queue()
    first = start(ctx, src_pool.name, 1, False, ready1, None, killed_done, 0)
    processes = [first]
    try:
        assert ready1.wait(60), "the first producer did not publish"
        reader = ctx.Process(target=decode_side, args=(dst_pool.name, src_pool.name, steps, results))
        reader.start()
        processes.append(reader)
        steps[0].set()
        status, error, b0, b1 = results.get(timeout=60)
        assert status == TransferStatus.DONE, error
        assert torch.equal(torch.from_numpy(b0), pool_data(1, src_pool.shape)[:, :, 0])
        os.kill(first.pid, signal.SIGKILL)   # the prefill actor dies without a word
        # its sentinel says so at once, as the supervisor waits on it (torch's shm manager, started by the export
        # and alive while the reader maps its file, must not hold the sentinel pipe open)
        assert mp.connection.wait([first.sentinel], timeout=10) == [first.sentinel], "the death went unseen"
        first.join(10)
        src_pool.reset()   # what the restarted actor does first: the epoch goes up before it re-publishes
        steps[1].set()
        status, error, _, _ = results.get(timeout=60)
        assert status == TransferStatus.FAILED and "has not published yet" in error
        second = start(ctx, src_pool.name, 2, False, ready2, None, done, 0)
        processes.append(second)
        assert ready2.wait(60), "the restarted producer did not publish"
        steps[2].set()
        status, error, b0, b1 = results.get(timeout=60)
        assert status == TransferStatus.DONE, error
        new = pool_data(2, src_pool.shape)
        assert torch.equal(torch.from_numpy(b0), new[:, :, 0]) and torch.equal(torch.from_numpy(b1), new[:, :, 3])
    finally:
        done.set()
        for event in steps:
            event.set()
        join_all(processes)
        results.close()
        results.join_thread()
    assert [p.exitcode for p in processes] == [-signal.SIGKILL, 0, 0]
    # the export's history lists both incarnations' files: what the supervisor unlinks at stop, whoever is gone
    name = export_name(src_pool.name, ".tipc")
    mm = open_export_segment(name, create=False)
    files = read_export(mm).files
    mm.close()
    pids = [first.pid, processes[2].pid]
    assert [f.split("_")[1] for f in files] == [str(pid) for pid in pids]
    unlink_exported_files(name)
    assert not torch_files(pids)


def test_decode_sends_transfer_done_only_after_the_copy_is_done(pools):
    """The decode core over the real transport: a copy queued behind a gate on its host stream (the CPU twin
    of a slow kernel) stays IN_PROGRESS, and no TransferDone leaves until it is DONE."""
    from actors.decode_core import DecodeCore
    from actors.messages import KVReady, TransferDone
    from actors.ports import TransportTransfers
    from actors.prefill_core import PrefillCore
    from actors.topology import LOCAL_DECODE, LOCAL_PREFILL
    from ipc.lifecycle import RequestState as S
    from tests.actors.fakes import FakeAllocator, FakeClock, FakeTable, Outbox, prefill_request

    src_pool, dst_pool = pools
    ctx = mp.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    p = start(ctx, src_pool.name, 7, False, ready, None, done, 0)
    gate = threading.Event()
    try:
        assert ready.wait(60), "the producer did not publish"
        allocate_device_pool(dst_pool, "cpu")
        xfer = make_transport("torch-ipc", dst_pool)
        xfer.open_peer(src_pool.name)
        clock = FakeClock()
        table = FakeTable(clock)
        to_decode, to_prefill = Outbox(), Outbox()
        prefill = PrefillCore(table, FakeAllocator(16, block_tokens=4), to_decode, clock, actor_index=0)
        decode = DecodeCore(table, FakeAllocator(16, block_tokens=4), TransportTransfers(xfer, synchronous=False),
                            to_prefill, clock, actor_index=1, eos_ids=[0], max_num_seqs=4,
                            block_bytes=dst_pool.block_bytes)
        request = prefill_request(table, "r", prompt_tokens=10, max_tokens=3)
        key = (request.slot, request.generation)
        prefill.on_message(request)
        for work in prefill.batch_done(prefill.next_batch()):
            prefill.finish(work, [(5, None)])
        [kv_ready] = to_decode.take(LOCAL_DECODE, KVReady)
        decode.on_message(kv_ready)
        xfer._stream.submit(gate.wait, 60)   # the copy queues behind this
        decode.start_transfers()
        for _ in range(3):
            decode.poll_transfers()
            decode.flush()
            assert not to_prefill.take(LOCAL_PREFILL, TransferDone), "TransferDone before the copy was DONE"
            assert table.state(key) == S.TRANSFERRING
        gate.set()

        def transfer_done():
            decode.poll_transfers()
            decode.flush()
            return to_prefill.take(LOCAL_PREFILL, TransferDone)

        assert wait_until(transfer_done, 30, message="TransferDone") == [TransferDone(*key)]
        want = pool_data(7, src_pool.shape)
        dst = decode.decode_waiting[0].blocks[:len(kv_ready.src_block_ids)]
        assert torch.equal(xfer._dst[:, :, dst], want[:, :, kv_ready.src_block_ids])
        xfer.close()
    finally:
        gate.set()
        done.set()
        join_all([p])
    assert p.exitcode == 0


def test_a_reader_that_starts_before_the_exporter_published_opens_it_on_its_first_copy(pools):
    """Actors start together: decode may open the prefill pool before prefill published it. The open succeeds;
    a copy asked for before the export exists FAILS naming why; the first copy after it opens the export."""
    src_pool, dst_pool = pools
    allocate_device_pool(dst_pool, "cpu")
    xfer = make_transport("torch-ipc", dst_pool)
    xfer.open_peer(src_pool.name)
    h = xfer.start_copy([1], [2], num_tokens=4)
    assert xfer.poll(h) == TransferStatus.FAILED and "has not published" in xfer.error(h)
    kv = allocate_device_pool(src_pool, "cpu")
    kv.copy_(pool_data(4, src_pool.shape))
    export = TorchIpcExport.publish(src_pool, kv)
    try:
        h = xfer.start_copy([1], [2], num_tokens=4)
        assert finished(xfer, h) == TransferStatus.DONE, xfer.error(h)
        assert torch.equal(xfer._dst[:, :, 2], kv[:, :, 1])
    finally:
        xfer.close()
        export.close(unlink=True)
