"""Holder forensics (actors/forensics.py) with real processes: an armed process answers SIGUSR1 with its threads'
stacks, even inside a sleep; a stopped one and an unarmed one are reported as such, without waiting; the folder goes
with the engine's segments (ipc/naming.unlink_all)."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest

from actors.forensics import process_state, dump_stacks, loop_position, stacks_path
from ipc.naming import forensics_dir, unlink_all
from tests.actors.forensics_children import stuck_in_a_call
from tests.conftest import wait_until


@pytest.fixture
def child(engine_id):
    ctx = mp.get_context("spawn")
    started = []

    def start(armed: bool = True):
        ready = ctx.Event()
        proc = ctx.Process(target=stuck_in_a_call, args=(engine_id, "prefill0", ready, armed), daemon=True)
        proc.start()
        started.append(proc)
        assert ready.wait(30), "the child never armed"
        return proc
    yield start
    for proc in started:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.join(10)
    unlink_all(engine_id)


def test_an_armed_process_answers_with_the_stack_of_the_call_it_is_stuck_in(child, engine_id):
    proc = child()
    path = stacks_path(engine_id, "prefill0")
    def in_the_call():   # the child may still be leaving Event.set() after saying it is ready: dump until it is not
        stacks, _ = dump_stacks(proc.pid, path)
        return stacks if stacks and loop_position(stacks).endswith("in waiting_on_a_transfer_that_never_ends") else None
    stacks = wait_until(in_the_call, 10, 0.1, "the child inside its call")
    assert loop_position(stacks).endswith("in waiting_on_a_transfer_that_never_ends"), stacks
    again, _ = dump_stacks(proc.pid, path)   # a second dump: only what this one appended
    assert again.count("waiting_on_a_transfer_that_never_ends") == stacks.count("waiting_on_a_transfer_that_never_ends")
    assert proc.is_alive()   # the signal dumped, it did not stop it
    unlink_all(engine_id)
    assert not os.path.exists(forensics_dir(engine_id))


def test_a_stopped_or_unarmed_process_is_named_as_such_at_once(child, engine_id):
    stopped = child()
    os.kill(stopped.pid, signal.SIGSTOP)
    wait_until(lambda: process_state(stopped.pid) in ("T", "t"), 10, 0.02, "the child stopped")
    stacks, why = dump_stacks(stopped.pid, stacks_path(engine_id, "prefill0"))
    assert stacks is None and "is stopped" in why
    os.kill(stopped.pid, signal.SIGCONT)
    plain = child(armed=False)
    stacks, why = dump_stacks(plain.pid, stacks_path(engine_id, "decode0"))
    assert stacks is None and "was not armed" in why
    assert loop_position("") == ""
