"""Writer processes for tests/ipc/test_ipc_recorder.py (spawned: importable and light)."""
from __future__ import annotations

import os
import signal

# an event's payload is a function of its sequence number, so a reader can tell a whole event from a torn one
def payload(seq: int) -> dict:
    return {"slot": seq % 1000, "generation": seq, "key": seq * 31 + 7, "a": seq * 7, "b": -seq * 7}


def write_events(name: str, writer: int, count: int, started) -> None:
    """Append ``count`` events (payload(seq)) to sub-ring ``writer`` as fast as it can."""
    from ipc.recorder import Recorder

    ring = Recorder.attach(name)
    w = ring.open_writer(writer, actor=writer)
    started.set()
    for _ in range(count):
        seq = w._written + 1
        w.append(2, **payload(seq))
    ring.close()


def write_then_die_mid_event(name: str, writer: int, count: int) -> None:
    """Append ``count`` whole events, start one more (its head written, its body half, no tail), then SIGKILL
    itself: the state a writer killed inside ``append`` leaves."""
    from ipc.recorder import BODY, U8, Recorder

    ring = Recorder.attach(name)
    w = ring.open_writer(writer, actor=writer)
    for _ in range(count):
        w.append(2, **payload(w._written + 1))
    seq = w._written + 1
    at = w._base + ((seq - 1) % w._cap) * 64
    U8.pack_into(w._mm, at, seq)
    BODY.pack_into(w._mm, at + 8, 1, 2, 3, 4, 5, 6, 2, 0, 0, 0, 0, 0)   # a body that is not payload(seq)
    os.kill(os.getpid(), signal.SIGKILL)


def read_forever(name: str, started) -> None:
    """A reader that reads the ring in a loop (the test stops it with SIGSTOP)."""
    from ipc.recorder import Recorder

    ring = Recorder.attach(name, readonly=True)
    started.set()
    while True:
        ring.events()
