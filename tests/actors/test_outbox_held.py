"""An actor's sends to a queue another live process has wedged (its producer mutex held by a stopped process, or
no free slot): held in order and delivered by a later ``flush``, never raised into the actor's loop (which would
kill a healthy actor for a neighbour's hang). Real processes and shm; actors/ports.py ``QueueOutbox``."""
from __future__ import annotations

import multiprocessing

import pytest

from actors.messages import TokenBatch, TransferDone, from_wire
from actors.ports import QueueOutbox
from ipc import naming
from ipc.shm_queue import ShmQueue
from tests.conftest import wait_until
from tests.ipc import ipc_children as kids

LOCK_TIMEOUT_S = 0.2


@pytest.fixture
def api_queue(engine_id):
    q = ShmQueue.create(naming.segment_name(engine_id, "q_api"), num_slots=4, slot_bytes=1024,
                        lock_timeout_s=LOCK_TIMEOUT_S, mode="mpmc")
    try:
        yield q
    finally:
        q.close()
        q.unlink()


def drain(q: ShmQueue) -> list:
    frames = []
    while (frame := q.get(0)) is not None:
        frames.append(from_wire(frame))
    return frames


def test_a_send_behind_a_producer_mutex_a_live_process_holds_is_held_and_delivered_in_order(api_queue):
    ctx = multiprocessing.get_context("spawn")
    holding, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=kids.q_hold_producer_lock, args=(api_queue.name, holding, release))
    outbox = QueueOutbox({"api": api_queue}, put_timeout_s=0.1)
    holder.start()
    try:
        assert holding.wait(15)
        outbox.send("api", TokenBatch([[1, 1, 7, None]]))   # a decode actor's tokens, while decode0 is stopped
        outbox.send("api", TokenBatch([[1, 1, 8, "stop"]]))
        outbox.flush()   # still held: nothing raised, nothing lost
        assert outbox.held_messages() == 2
        release.set()
        holder.join(15)
        wait_until(lambda: outbox.flush() or outbox.held_messages() == 0, 10, 0.05, "the held messages sent")
        assert drain(api_queue) == [TokenBatch([[1, 1, 7, None]]), TokenBatch([[1, 1, 8, "stop"]])]
    finally:
        release.set()
        holder.join(15)
        if holder.is_alive():
            holder.kill()
            holder.join()


def test_a_full_queue_holds_the_overflow_keeps_later_messages_behind_it_and_bounds_what_it_holds(api_queue):
    outbox = QueueOutbox({"api": api_queue}, put_timeout_s=0.05, max_held=3)
    for i in range(4):   # the consumer is slow: the queue fills
        outbox.send("api", TransferDone(i, 1))
    outbox.send("api", TransferDone(4, 1))   # no room: held
    assert outbox.held_messages() == 1
    assert [m.slot for m in drain(api_queue)] == [0, 1, 2, 3]
    for i in range(5, 9):   # 5..8 queue behind 4 (order kept); past max_held the oldest held one goes
        outbox.send("api", TransferDone(i, 1))
    assert outbox.held_messages() == 3 and outbox.dropped == 2
    outbox.flush()
    assert [m.slot for m in drain(api_queue)] == [6, 7, 8]
    assert outbox.held_messages() == 0


def test_the_apis_outbox_raises_instead_of_holding_so_admission_answers_503(api_queue):
    from pdserve.errors import QueueFullError

    outbox = QueueOutbox({"api": api_queue}, put_timeout_s=0.05, hold=False)
    for i in range(4):
        outbox.send("api", TransferDone(i, 1))
    with pytest.raises(QueueFullError):
        outbox.send("api", TransferDone(4, 1))
    assert outbox.held_messages() == 0
