"""The cuda-ipc KV transport (gpu/cuda_ipc.py): its pure logic on CPU, and real CUDA IPC between two processes
on a GPU (marker ``gpu``, skipped without one)."""
from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch

from ipc import naming
from tests.conftest import wait_until
from tests.gpu.conftest import IPC_GEOMETRY, finished
from gpu.cuda_ipc import (EXPORT_BYTES, CudaIpcExport, CudaIpcTransport, allocate_device_pool, export_name,
                          open_export_segment, read_export, write_export)
from ipc.kv_pool import KVPool
from ipc.kv_transport import CpuShmTransport, TransferStatus, known_transports, make_transport, validate_copy

pytestmark = pytest.mark.timeout(120)

GEOMETRY = IPC_GEOMETRY
CUDA = torch.cuda.is_available()


def pool_data(seed: int, shape, dtype) -> torch.Tensor:
    """The deterministic content a producer fills its pool with (recomputable by the consumer)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# -------------------------------------------------------------------------------------------- CPU: pure logic

def test_importing_the_module_registers_the_cuda_ipc_kind():
    assert "cuda-ipc" in known_transports()


@pytest.mark.skipif(CUDA, reason="checks the message given without CUDA")
def test_without_cuda_making_the_transport_says_to_use_cpu_shm(engine_id):
    pool = KVPool.create(naming.segment_name(engine_id, "kvd"), **GEOMETRY)
    try:
        with pytest.raises(RuntimeError, match="cpu-shm"):
            make_transport("cuda-ipc", pool)
    finally:
        pool.close()
        pool.unlink()


@pytest.mark.parametrize("src,dst,tokens", [
    ([1, 2], [3], 4),          # lengths differ
    ([1], [3], 5),             # more tokens than one block holds
    ([1], [3], -1),
    ([16], [3], 4),            # src out of range
    ([1], [-1], 4),            # dst out of range
    ([1, 2], [3, 3], 8),       # repeated dst
])
def test_copy_arguments_are_refused_exactly_as_the_cpu_transport_refuses_them(engine_id, src, dst, tokens):
    a = KVPool.create(naming.segment_name(engine_id, "a"), **GEOMETRY)
    b = KVPool.create(naming.segment_name(engine_id, "b"), **GEOMETRY)
    try:
        cpu = CpuShmTransport(b)
        cpu.open_peer(a.name)
        with pytest.raises(ValueError) as cpu_error:
            cpu.start_copy(src, dst, num_tokens=tokens)
        with pytest.raises(ValueError) as ours:
            validate_copy(src, dst, tokens, block_tokens=4, src_blocks=16, dst_blocks=16)
        assert str(ours.value) == str(cpu_error.value)
        cpu.close()
    finally:
        for p in (a, b):
            p.close()
            p.unlink()


def test_valid_copy_arguments_come_back_as_int64_arrays():
    s, d = validate_copy([5, 0], (2, 9), 7, block_tokens=4, src_blocks=6, dst_blocks=10)
    assert s.dtype == d.dtype == np.int64 and s.tolist() == [5, 0] and d.tolist() == [2, 9]
    s, d = validate_copy([], [], 0, block_tokens=4, src_blocks=1, dst_blocks=1)
    assert s.size == d.size == 0


def test_the_export_segment_round_trips_and_a_restart_is_visible_through_an_old_mapping(engine_id):
    name = export_name(naming.segment_name(engine_id, "kv_prefill"))
    assert naming.engine_id_of(name) == engine_id  # swept with the engine's other segments
    with pytest.raises(FileNotFoundError, match="has not published"):
        open_export_segment(name, create=False)
    writer = open_export_segment(name, create=True)
    reader = open_export_segment(name, create=False)
    assert len(reader) == EXPORT_BYTES
    with pytest.raises(ValueError, match="not an initialised"):
        read_export(reader)
    seq = write_export(writer, b"first", pool_epoch=1, pid=123, device=0)
    rec = read_export(reader)
    assert (rec.seq, rec.pool_epoch, rec.pid, rec.device, rec.payload) == (seq, 1, 123, 0, b"first")
    # a restarted exporter re-opens the same name and publishes again: the old mapping sees it
    writer.close()
    writer = open_export_segment(name, create=True)
    seq2 = write_export(writer, b"second, longer", pool_epoch=2, pid=456, device=1, files=["/f2", "/f1"])
    assert seq2 == seq + 2
    rec = read_export(reader)
    assert (rec.pool_epoch, rec.pid, rec.device, rec.payload) == (2, 456, 1, b"second, longer")
    write_export(writer, b"third", pool_epoch=3, pid=789, device=-1, files=["/f1", "/f3"])
    assert read_export(reader).files == ("/f2", "/f1", "/f3")   # the history keeps every file once
    with pytest.raises(ValueError, match="exceeds"):
        write_export(writer, b"x" * EXPORT_BYTES, pool_epoch=3, pid=1, device=0)
    writer.close()
    reader.close()
    assert any(e.endswith("kv_prefill.cuda") for e in naming.unlink_all(engine_id))


def test_a_reader_does_not_accept_a_half_written_export(engine_id):
    name = export_name(naming.segment_name(engine_id, "kvp"))
    mm = open_export_segment(name, create=True)
    try:
        write_export(mm, b"ok", pool_epoch=1, pid=1, device=0)
        mm[8:16] = (7).to_bytes(8, "little")  # seq odd: a writer died mid-publish
        with pytest.raises(TimeoutError, match="mid-publish"):
            read_export(mm, timeout_s=0.05)
    finally:
        mm.close()


# ----------------------------------------------------------------------------------------- CPU: the transport
# logic (handles, polling, release of in-flight copies, restart) over CPU tensors, with torch.cuda's streams
# and events replaced by stand-ins. The real IPC/stream semantics are the GPU tests' business, below.

class FakeEvent:
    instances: list["FakeEvent"] = []
    complete = True  # what query() answers for events recorded from now on

    def __init__(self, *args, **kwargs):
        self.recorded = 0
        self.done = True
        FakeEvent.instances.append(self)

    def record(self, stream=None):
        self.recorded += 1
        self.done = FakeEvent.complete

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True

    def ipc_handle(self):
        return b"fake-event-handle"


class FakeStream:
    def __init__(self, *args, **kwargs):
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)

    def synchronize(self):
        for e in FakeEvent.instances:
            e.done = True


@pytest.fixture
def fake_cuda(monkeypatch):
    import contextlib

    import gpu.cuda_ipc as cuda_ipc
    import torch.multiprocessing.reductions as reductions

    FakeEvent.instances = []
    FakeEvent.complete = True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(reductions, "reduce_tensor", lambda t: (torch.zeros, (1,)))
    monkeypatch.setattr(cuda_ipc, "_on_gpu", lambda t: True)
    yield


def test_the_transport_logic_over_stand_in_streams(engine_id, fake_cuda):
    src_pool = KVPool.create(naming.segment_name(engine_id, "kvp"), **GEOMETRY)
    dst_pool = KVPool.create(naming.segment_name(engine_id, "kvd"), **GEOMETRY)
    try:
        kv = allocate_device_pool(src_pool, "cpu")
        kv.copy_(pool_data(3, src_pool.shape, torch.float32))
        export = CudaIpcExport.publish(src_pool, kv)
        assert read_export(open_export_segment(export.name, create=False)).pool_epoch == src_pool.epoch
        xfer = CudaIpcTransport(dst_pool, device_kv=allocate_device_pool(dst_pool, "cpu"),
                                copy_backend="torch")
        with pytest.raises(RuntimeError, match="before open_peer"):
            xfer.start_copy([0], [0], num_tokens=1)
        xfer.open_peer(src_pool.name)
        xfer.open_peer(src_pool.name)  # idempotent for the same peer
        with pytest.raises(ValueError, match="already attached"):
            xfer.open_peer(dst_pool.name)

        h = xfer.start_copy([6, 1], [2, 9], num_tokens=6)
        assert xfer.poll(h) == TransferStatus.DONE and xfer.bytes_moved_total == 2 * dst_pool.block_bytes
        assert torch.equal(xfer._dst[:, :, [2, 9]], kv[:, :, [6, 1]])
        assert xfer._stream.waited and xfer._stream.waited[-1] is export.event  # waited for prefill's writes
        export.record_written()
        assert export.event.recorded == 2

        FakeEvent.complete = False  # a copy still running on the device
        h2 = xfer.start_copy([0], [0], num_tokens=4)
        assert xfer.poll(h2) == TransferStatus.IN_PROGRESS
        assert xfer.bytes_moved_total == 2 * dst_pool.block_bytes  # counted once DONE
        xfer.release(h2)  # released in flight: kept until done, handle forgotten
        assert len(xfer._orphans) == 1
        with pytest.raises(KeyError):
            xfer.poll(h2)
        FakeEvent.complete = True
        h3 = xfer.start_copy([], [], num_tokens=0)
        assert xfer.poll(h3) == TransferStatus.DONE

        # prefill restarts: pool reset (epoch + 1). Until it re-publishes, copies fail with the reason...
        src_pool.reset()
        h4 = xfer.start_copy([0], [1], num_tokens=1)
        assert xfer.poll(h4) == TransferStatus.FAILED and "has not published yet" in xfer.error(h4)
        # ...and once it has, the next copy reopens the export and reads the new tensor
        kv2 = allocate_device_pool(src_pool, "cpu")
        kv2.fill_(5.0)
        export.close()
        export = CudaIpcExport.publish(src_pool, kv2)
        h5 = xfer.start_copy([0], [1], num_tokens=1)
        assert xfer.poll(h5) == TransferStatus.DONE and float(xfer._dst[:, :, 1].min()) == 5.0
        xfer.close()
        xfer.close()  # idempotent
        export.close(unlink=True)
    finally:
        for pool in (src_pool, dst_pool):
            pool.close()
            pool.unlink()


def test_a_device_tensor_of_the_wrong_shape_is_refused(engine_id, fake_cuda):
    pool = KVPool.create(naming.segment_name(engine_id, "kvd"), **GEOMETRY)
    try:
        with pytest.raises(ValueError, match="does not match KV pool"):
            CudaIpcTransport(pool, device_kv=torch.zeros(3, 2, 15, 4, 2, 8))
        with pytest.raises(RuntimeError, match="allocate_device_pool"):
            CudaIpcTransport(pool)  # no device tensor registered for this pool
    finally:
        pool.close()
        pool.unlink()


# ---------------------------------------------------------------------------------------------- GPU: real IPC

def producer(pool_name: str, seed: int, dtype, ready, go, done, late_seed) -> None:
    """The prefill side, in its own process: device pool filled from ``seed``, exported; on ``go``, a slow
    kernel then an overwrite of block 3 with ``late_seed`` data, recorded with ``record_written``."""
    torch.cuda.init()
    pool = KVPool.attach(pool_name)
    kv = allocate_device_pool(pool, "cuda:0")
    kv.copy_(pool_data(seed, pool.shape, dtype).cuda())
    export = CudaIpcExport.publish(pool, kv)
    torch.cuda.synchronize()
    ready.set()
    if go.wait(60):
        late = pool_data(late_seed, kv[:, :, 3].shape, dtype).cuda()  # uploaded (synchronously) first
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued ahead of the write, on this stream
        kv[:, :, 3].copy_(late)  # a device-side write: still queued when the consumer is told
        export.record_written()
        ready.clear()  # tells the consumer: KVReady would be sent now (the write has not run yet)
    done.wait(60)
    export.close()
    pool.close()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("copy_backend", ["numba", "torch"])
def test_decode_pulls_scattered_blocks_from_a_prefill_gpu_pool_in_another_process(engine_id, dtype,
                                                                                  copy_backend):
    ctx = mp.get_context("spawn")
    ready, go, done = ctx.Event(), ctx.Event(), ctx.Event()
    src_pool = KVPool.create(naming.segment_name(engine_id, "kvp"), dtype=dtype, **GEOMETRY)
    dst_pool = KVPool.create(naming.segment_name(engine_id, "kvd"), dtype=dtype, **GEOMETRY)
    p = ctx.Process(target=producer, args=(src_pool.name, 11, dtype, ready, go, done, 99))
    p.start()
    try:
        assert ready.wait(60), "producer did not publish"
        allocate_device_pool(dst_pool, "cuda:0")
        xfer = make_transport("cuda-ipc", dst_pool)
        assert isinstance(xfer, CudaIpcTransport)
        xfer.copy_backend = copy_backend
        xfer.open_peer(src_pool.name)
        src_ids, dst_ids = [13, 2, 7, 0, 9], [5, 11, 0, 15, 3]
        h = xfer.start_copy(src_ids, dst_ids, num_tokens=18)
        assert finished(xfer, h) == TransferStatus.DONE, xfer.error(h)
        want = pool_data(11, dst_pool.shape, dtype)
        got = xfer._dst.cpu()
        for s, d in zip(src_ids, dst_ids):
            assert torch.equal(got[:, :, d], want[:, :, s])
        untouched = sorted(set(range(16)) - set(dst_ids))
        assert float(got[:, :, untouched].float().abs().sum()) == 0.0
        assert xfer.bytes_moved_total == 5 * dst_pool.block_bytes
        # ordering: the producer's write of block 3 sits behind a slow kernel; the copy must wait for it
        go.set()
        wait_until(lambda: not ready.is_set(), 30, message="the producer to record its write")
        h2 = xfer.start_copy([3], [1], num_tokens=4)
        assert finished(xfer, h2) == TransferStatus.DONE
        assert torch.equal(xfer._dst[:, :, 1].cpu(), pool_data(99, want[:, :, 3].shape, dtype))
        xfer.release(h)
        xfer.release(h2)
        with pytest.raises(KeyError):
            xfer.poll(h)
        xfer.close()
    finally:
        done.set()
        p.join(60)
        if p.is_alive():
            p.kill()
            p.join(10)
        for pool in (src_pool, dst_pool):
            pool.close()
            pool.unlink()
    assert p.exitcode == 0


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_a_pool_exported_and_opened_in_one_process_needs_no_ipc_open(engine_id):
    src_pool = KVPool.create(naming.segment_name(engine_id, "kvp"), **GEOMETRY)
    dst_pool = KVPool.create(naming.segment_name(engine_id, "kvd"), **GEOMETRY)
    try:
        kv = allocate_device_pool(src_pool, "cuda")
        kv.copy_(pool_data(5, src_pool.shape, torch.float32).cuda())
        export = CudaIpcExport.publish(src_pool, kv)
        allocate_device_pool(dst_pool, "cuda")
        xfer = make_transport("cuda-ipc", dst_pool)
        xfer.open_peer(src_pool.name)
        h = xfer.start_copy([4, 8], [0, 1], num_tokens=5)
        assert finished(xfer, h) == TransferStatus.DONE
        assert torch.equal(xfer._dst[:, :, [0, 1]], kv[:, :, [4, 8]])
        # a "restart": the pool is reset (epoch + 1) and re-exported; the next copy reopens the export
        src_pool.reset()
        kv2 = allocate_device_pool(src_pool, "cuda")
        kv2.fill_(7.0)
        export.close()
        export = CudaIpcExport.publish(src_pool, kv2)
        h = xfer.start_copy([2], [2], num_tokens=1)
        assert finished(xfer, h) == TransferStatus.DONE
        assert float(xfer._dst[:, :, 2].min()) == 7.0
        xfer.close()
        export.close(unlink=True)
    finally:
        for pool in (src_pool, dst_pool):
            pool.close()
            pool.unlink()
