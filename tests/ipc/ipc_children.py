"""Code run in spawned child processes by the ipc tests (importable, light: torch only where needed)."""
from __future__ import annotations

import os
import time

JOIN_TIMEOUT_S = 20.0


def join_all(procs, timeout_s: float = JOIN_TIMEOUT_S) -> list[int]:
    """Join every process within ``timeout_s`` in total; kill stragglers; return exit codes."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    codes = []
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
        codes.append(p.exitcode)
    return codes


# ---------------------------------------------------------------------------------------------- queues

def q_producer(qname: str, producer_id: int, count: int, start) -> None:
    from ipc.shm_queue import ShmQueue
    q = ShmQueue.attach(qname)
    assert start.wait(JOIN_TIMEOUT_S)
    for i in range(count):
        q.put({"p": producer_id, "i": i}, timeout_s=10.0)
    q.close()


def q_echo(q_in, q_out) -> None:
    """Receives queues pickled by name; echoes one message back with the child's pid."""
    msg = q_in.get(timeout_s=10.0)
    q_out.put({"echo": msg, "pid": os.getpid(), "owner": q_in.is_owner})
    q_in.close()
    q_out.close()


def q_idle_cpu(qname: str, wait_s: float, results) -> None:
    from ipc.shm_queue import ShmQueue
    q = ShmQueue.attach(qname)
    cpu0, t0 = time.process_time(), time.monotonic()
    got = q.get(timeout_s=wait_s)
    results.put((got, time.process_time() - cpu0, time.monotonic() - t0))
    q.close()


def q_die_in_put(qname: str) -> None:
    """Take a free slot and the producer mutex the way put() does, then die without releasing either."""
    from ipc.shm_queue import ShmQueue
    q = ShmQueue.attach(qname)
    assert q._free.acquire(5) is None
    q._plock.acquire(q._stamp_producer)
    os._exit(0)


def q_die_in_get(qname: str) -> None:
    """Take one item and the consumer mutex the way get() does, then die before reading."""
    from ipc.shm_queue import ShmQueue
    q = ShmQueue.attach(qname)
    q._items.acquire(5)
    q._clock.acquire(lambda: q._stamp_consumer(1))
    os._exit(0)


def q_hold_producer_lock(qname: str, holding, release) -> None:
    """Hold the producer mutex (alive) until ``release`` is set."""
    from ipc.shm_queue import ShmQueue
    q = ShmQueue.attach(qname)
    q._plock.acquire(q._stamp_producer)
    holding.set()
    release.wait(JOIN_TIMEOUT_S)
    q._plock.release()
    q.close()


def q_claim_and_hold(qname: str, side: str, holding, release_conn) -> None:
    """Take the producer (one put) or consumer (one get) role of a spsc queue, then stay alive until
    something arrives on ``release_conn`` (a pipe end: unlike an Event, safe to SIGKILL a waiter of)."""
    from ipc.shm_queue import ShmQueue
    q = ShmQueue.attach(qname)
    if side == "producer":
        q.put("claim", timeout_s=5.0)
    else:
        q.get(timeout_s=0)
    holding.set()
    release_conn.poll(JOIN_TIMEOUT_S)
    q.close()


def q_try_role(qname: str, side: str, results) -> None:
    """Try one put (producer) or one get (consumer); report ("ok", None) or (error class name, message)."""
    from ipc.shm_queue import ShmQueue
    from pdserve.errors import PdserveError
    q = ShmQueue.attach(qname)
    try:
        if side == "producer":
            q.put({"from": os.getpid()}, timeout_s=1.0)
        else:
            q.get(timeout_s=0)
        results.put(("ok", None))
    except PdserveError as exc:
        results.put((type(exc).__name__, str(exc)))
    q.close()


def q_put_inherited(q, results) -> None:
    """Put through a ShmQueue instance inherited by fork; report ("ok", None) or (error class name, message)."""
    from pdserve.errors import PdserveError
    try:
        q.put("from the forked child", timeout_s=1.0)
        results.put(("ok", None))
    except PdserveError as exc:
        results.put((type(exc).__name__, str(exc)))


def torn_frame(producer: int, seq: int, n: int) -> bytes:
    """A frame whose every byte depends on (producer, seq): a mix of two frames cannot pass ``check_frame``."""
    import struct
    return struct.pack("<IQI", producer, seq, n) + bytes([(producer * 31 + seq) % 251]) * n


def check_frame(data: bytes) -> tuple[int, int]:
    """(producer, seq) of a frame made by ``torn_frame``; AssertionError if it is torn or corrupt."""
    import struct
    producer, seq, n = struct.unpack_from("<IQI", data)
    assert len(data) == 16 + n, f"frame ({producer}, {seq}) has {len(data)} bytes, header says {16 + n}"
    assert data[16:] == bytes([(producer * 31 + seq) % 251]) * n, f"frame ({producer}, {seq}) is torn"
    return producer, seq


def q_frame_writer(qname: str, producer: int, max_bytes: int, started) -> None:
    """Put frames of random sizes (up to ``max_bytes``) as fast as possible until killed."""
    import random
    from ipc.shm_queue import ShmQueue
    q = ShmQueue.attach(qname)
    rng = random.Random(producer)
    seq = 0
    started.set()
    while True:
        n = rng.randrange(0, max_bytes - 16)
        if rng.random() < 0.2:  # sometimes a batch
            q.put_many_bytes([torn_frame(producer, seq + i, n) for i in range(3)], timeout_s=None)
            seq += 3
        else:
            q.put_bytes(torn_frame(producer, seq, n), timeout_s=None)
            seq += 1


def q_counting_consumer(qname: str, taken, started) -> None:
    """Take messages one by one until killed, publishing how many it has taken in ``taken`` (a shared int)."""
    from ipc.shm_queue import ShmQueue
    q = ShmQueue.attach(qname)
    started.set()
    while True:
        if q.get(timeout_s=5.0) is not None:
            taken.value += 1


def q_ping_echo(in_name: str, out_name: str, count: int, spin_s: float | None = None) -> None:
    """Echo ``count`` messages from one queue to another (each side sleeps between messages; ``spin_s`` 0: no
    spinning before a sleep, so every wait is woken by the other side's post)."""
    from ipc.shm_queue import ShmQueue
    qi, qo = ShmQueue.attach(in_name), ShmQueue.attach(out_name)
    if spin_s is not None:
        qi.spin_s = qo.spin_s = spin_s
    for _ in range(count):
        qo.put(qi.get(timeout_s=JOIN_TIMEOUT_S), timeout_s=JOIN_TIMEOUT_S)
    qi.close()
    qo.close()


def q_batch_consumer(qname: str, count: int, started, results, spin_s: float | None = None) -> None:
    """Take ``count`` messages a few at a time (a tiny queue keeps its producer waiting for room); report them."""
    from ipc.shm_queue import ShmQueue
    q = ShmQueue.attach(qname)
    if spin_s is not None:
        q.spin_s = spin_s
    started.set()
    got = []
    while len(got) < count:
        got.extend(q.get_many(3, timeout_s=JOIN_TIMEOUT_S))
    results.put(got)
    q.close()


# ---------------------------------------------------------------------------------------------- state table

def st_racer(table, rows, new_state: int, ready, start, results) -> None:
    """Try to move every (slot, generation) in ``rows``, in that order, to ``new_state``; report the slots we
    won. Sets ``ready`` once imported and attached, then waits for ``start`` (so both racers really race)."""
    ready.set()
    assert start.wait(JOIN_TIMEOUT_S)
    won = [slot for slot, gen in rows if table.transition(slot, gen, new_state)]
    results.put((int(new_state), won))
    table.close()


def st_die_holding_lock(table_name: str) -> None:
    from ipc.state_table import StateTable
    t = StateTable.attach(table_name)
    t._lock.acquire()
    os._exit(0)


def st_stop_holding_lock(table_name: str) -> None:
    """The ``stop_holding_lock`` fault in a child: take the table's lock and SIGSTOP (killed by the test)."""
    from actors.fault_ports import stop_holding_lock
    from ipc.state_table import StateTable
    stop_holding_lock(StateTable.attach(table_name))


def at_beater(table_name: str, index: int, beats: int) -> None:
    from ipc.actor_table import ActorTable
    t = ActorTable.attach(table_name)
    for _ in range(beats):
        t.beat(index, iterations_delta=2)
    t.set_kv_blocks(index, total=beats, free=beats)
    t.close()


# ---------------------------------------------------------------------------------------------- kv pools

def kv_fill_owner(pool_name: str, geometry: dict, seed: int, ready, done) -> None:
    """Create a pool, fill it with seeded random data, hold 3 blocks, signal, keep it until ``done``."""
    import torch

    from ipc.kv_pool import KVPool
    pool = KVPool.create(pool_name, **geometry)
    try:
        g = torch.Generator().manual_seed(seed)
        t = pool.tensor()
        t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype))
        pool.allocate(3, owner_slot=7)
        ready.set()
        done.wait(JOIN_TIMEOUT_S)
    finally:
        pool.close()
        pool.unlink()


def kv_read_peer(pool, block_ids, results) -> None:
    """Receives a pool pickled by name (attaches read-only); reports block sums, owners and free count."""
    t = pool.tensor()
    sums = [float(t[:, :, b].double().sum()) for b in block_ids]
    writable = pool.array().flags.writeable
    results.put((sums, pool.owner_slots().tolist(), pool.num_free, pool.readonly, writable))
    pool.close()


def kv_mooncake_source(pool_name: str, geometry: dict, seed: int, ready, done) -> None:
    """Create a pool, fill it with seeded random data, publish it through Mooncake (``MooncakeSource``),
    signal, keep serving reads until ``done``."""
    import torch

    from ipc.kv_pool import KVPool
    from ipc.mooncake_transport import MooncakeSource
    pool = KVPool.create(pool_name, **geometry)
    source = None
    try:
        g = torch.Generator().manual_seed(seed)
        t = pool.tensor()
        t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype))
        source = MooncakeSource(pool)
        ready.set()
        done.wait(JOIN_TIMEOUT_S * 3)
    finally:
        if source is not None:
            source.close(unlink=True)
        pool.close()
        pool.unlink()


# ---------------------------------------------------------------------------------------------- cache summary

def cs_prefill_actor(name: str, index: int, prompts: list, block_tokens: int, done) -> None:
    """A prefill actor's start and work as its cache summary sees it: clear its region, then cache every full
    block of ``prompts`` (one pool block each, numbered from 0) through a PrefixCache whose listener writes it."""
    from actors.prefix_cache import PrefixCache, block_keys
    from ipc.cache_summary import CacheSummary

    summary = CacheSummary.attach(name)
    writer = summary.writer(index)
    writer.clear()
    cache = PrefixCache(listener=writer)
    block = 0
    for prompt in prompts:
        for key in block_keys(prompt, block_tokens):
            if cache.insert(key, block):
                block += 1
    done.set()
    summary.close()
