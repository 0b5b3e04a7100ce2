"""Quick throughput figures for the ipc layer (not a test; run ``python tests/ipc/bench_ipc.py``).

1. Messages/s, one producer process -> one consumer process, 1 KiB messages: ShmQueue (raw frames and
   orjson dicts) vs multiprocessing.Queue.
2. KV handoff: CpuShmTransport.start_copy bytes/s vs a plain contiguous numpy copy of the same bytes.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import numpy as np  # noqa: E402

from ipc import naming  # noqa: E402
from ipc.shm_queue import ShmQueue  # noqa: E402

N = 50_000
PAYLOAD = b"x" * 1024


def _shm_producer(qname: str, n: int, as_obj: bool, start) -> None:
    q = ShmQueue.attach(qname)
    start.wait()
    if as_obj:
        msg = {"slot": 1, "gen": 2, "text": "x" * 990}  # ~1 KiB once encoded
        for _ in range(n):
            q.put(msg, timeout_s=30)
    else:
        for _ in range(n):
            q.put_bytes(PAYLOAD, timeout_s=30)
    q.close()


def _mp_producer(q, n: int, start) -> None:
    start.wait()
    for _ in range(n):
        q.put(PAYLOAD)


def _run_shm(ctx, eid: str, as_obj: bool, batched: bool) -> float:
    q = ShmQueue.create(naming.segment_name(eid, naming.new_engine_id()), num_slots=1024, slot_bytes=2048)
    try:
        start = ctx.Event()
        p = ctx.Process(target=_shm_producer, args=(q.name, N, as_obj, start))
        p.start()
        time.sleep(1.0)  # let the child import; only the transfer is timed
        start.set()
        t0 = time.perf_counter()
        got = 0
        while got < N:
            if batched:
                got += len(q.get_many(256, timeout_s=10) if as_obj else q.get_many_bytes(256, timeout_s=10))
            else:
                assert (q.get(timeout_s=10) if as_obj else q.get_bytes(timeout_s=10)) is not None
                got += 1
        dt = time.perf_counter() - t0
        p.join(30)
        return N / dt
    finally:
        q.close()
        q.unlink()


def _run_mp(ctx) -> float:
    mq = ctx.Queue(maxsize=1024)
    start = ctx.Event()
    p = ctx.Process(target=_mp_producer, args=(mq, N, start))
    p.start()
    time.sleep(1.0)
    start.set()
    t0 = time.perf_counter()
    for _ in range(N):
        mq.get(timeout=10)
    dt = time.perf_counter() - t0
    p.join(30)
    return N / dt


def bench_queues() -> None:
    ctx = mp.get_context("spawn")
    eid = naming.new_engine_id()
    try:
        for label, fn in [
            ("ShmQueue put_bytes -> get_bytes", lambda: _run_shm(ctx, eid, False, False)),
            ("ShmQueue put_bytes -> get_many_bytes(256)", lambda: _run_shm(ctx, eid, False, True)),
            ("ShmQueue put(dict) -> get (orjson)", lambda: _run_shm(ctx, eid, True, False)),
            ("ShmQueue put(dict) -> get_many(256)", lambda: _run_shm(ctx, eid, True, True)),
            ("multiprocessing.Queue put(bytes) -> get", lambda: _run_mp(ctx)),
        ]:
            rates = [fn() for _ in range(2)]
            print(f"{label:44s} {max(rates):>10,.0f} msg/s (best of 2; 1 KiB, 1 producer -> 1 consumer)")
    finally:
        naming.unlink_all(eid)


def bench_copy() -> None:
    from ipc.kv_pool import KVPool
    from ipc.kv_transport import CpuShmTransport

    eid = naming.new_engine_id()
    geometry = dict(num_layers=24, num_blocks=1024, block_tokens=16, num_kv_heads=4, head_dim=64)
    try:
        src = KVPool.create(naming.segment_name(eid, "src"), **geometry)
        dst = KVPool.create(naming.segment_name(eid, "dst"), **geometry)
        src.array()[:] = 1.0
        dst.array()[:] = 0.0
        xfer = CpuShmTransport(dst)
        xfer.open_peer(src.name)
        rng = np.random.default_rng(0)
        print(f"block = {src.block_bytes / 1024:.0f} KiB (24 layers x K,V x 16 tokens x 4 heads x 64 x fp32)")
        for n in (4, 32, 128, 512):
            s_ids = rng.choice(1024, n, replace=False).tolist()
            d_ids = rng.choice(1024, n, replace=False).tolist()
            nbytes = n * src.block_bytes

            def copy():
                xfer.release(xfer.start_copy(s_ids, d_ids, num_tokens=n * 16))

            a = np.ones(nbytes // 4, np.float32)
            b = np.empty_like(a)
            t_x = _best(copy)
            t_np = _best(lambda: np.copyto(b, a))
            print(f"{n:4d} blocks ({nbytes / 2**20:6.1f} MiB): transport {nbytes / t_x / 1e9:6.2f} GB/s, "
                  f"numpy contiguous copy {nbytes / t_np / 1e9:6.2f} GB/s, ratio {t_np / t_x:.2f}")
        xfer.close()
        src.close()
        dst.close()
    finally:
        naming.unlink_all(eid)


def _best(fn, reps: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


if __name__ == "__main__":
    print(f"host: {os.cpu_count()} CPUs")
    bench_queues()
    bench_copy()
