"""The scheduler cores' flight-recorder events (ipc/recorder.py) through a real recorder in shm: prefill chunks,
queue renewals and the KV handoff, each keyed by its request (the fake table records no transitions:
tests/ipc/test_ipc_recorder.py covers those)."""
from __future__ import annotations

from ipc.recorder import EventKind, Renewal, request_key
from tests.actors.fakes import prefill_request
from tests.actors.test_scheduler_cores import Pair


def kinds_of(ring, request_id: str) -> list[tuple[int, int]]:
    events = ring.events()
    mine = events[events["key"] == request_key(request_id)]
    return [(int(e["kind"]), int(e["aux"])) for e in mine]


def test_chunks_queue_renewals_and_the_handoff_are_recorded(ring):
    pair = Pair(decode_blocks=4)
    big = prefill_request(pair.table, "big", prompt_tokens=20, max_tokens=40)   # 4 blocks: the whole decode pool
    small = prefill_request(pair.table, "small", prompt_tokens=10, max_tokens=2)
    pair.prefill.on_message(big)
    pair.prefill.on_message(small)
    pair.run(2)
    pair.clock.advance(2.0)
    pair.run(1)   # the big one's tokens renew the small one, waiting in BOOTSTRAP for room
    big_kinds, small_kinds = kinds_of(ring, "big"), kinds_of(ring, "small")
    assert (EventKind.PREFILL_CHUNK, 0) in big_kinds and (EventKind.KV_HANDOFF, 0) in big_kinds
    assert (EventKind.RENEWAL, Renewal.QUEUE) in small_kinds
    assert (EventKind.KV_HANDOFF, 0) not in small_kinds
