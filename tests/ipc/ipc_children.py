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


def at_beater(table_name: str, index: int, beats: int) -> None:
    from ipc.actor_table import ActorTable
    t = ActorTable.attach(table_name)
    for _ in range(beats):
        t.beat(index, iterations_delta=2)
    t.set(index, kv_blocks_free=beats)
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
