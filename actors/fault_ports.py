"""Fault injection around the cores' ports (faults named in pdserve/faults.py, selected by ``PDSERVE_FAULTS``):
decorators of the transfers port and the outbox, the checks a shell makes when it takes a request, and the holds
(``HeldRequests``: the requests of a core a shell's loop leaves alone; the watchdog drills' faults, api/drill.py).
The cores themselves know nothing of faults.
"""
from __future__ import annotations

import logging
import os
import signal
import time

from actors.messages import TransferDone
from actors.topology import LOCAL_PREFILL
from ipc.lifecycle import TransferStatus

log = logging.getLogger("pdserve.faults")

UNKNOWN_TRANSFER_STATUS = 7   # a value TransferStatus does not define


def level(request_id: str) -> int:
    """A fault's log level: WARNING, DEBUG for a watchdog drill's request (api/drill.py: routine, every interval)."""
    from pdserve.faults import DRILL_PREFIX

    return logging.DEBUG if request_id.startswith(DRILL_PREFIX) else logging.WARNING


def apply_actor_faults(faults, actor_name: str, request_id: str, table=None) -> None:
    """Checked when an actor takes a request: ``stall`` blocks the loop (a hang the monitor must detect),
    ``crash`` ends the process abruptly (a dead actor the supervisor restarts), ``stop_holding_lock`` stops it
    holding ``table``'s lock (the actor's StateTable; a stuck holder every other writer waits on)."""
    stall = faults.fires("stall", request_id)
    if stall is not None:
        log.warning("fault stall: %s blocks for %.1f s", actor_name, stall.number("seconds"))
        time.sleep(stall.number("seconds"))
    if faults.fires("crash", request_id):
        log.warning("fault crash: %s exits now", actor_name)
        os._exit(70)
    if table is not None and faults.fires("stop_holding_lock", request_id):
        log.warning("fault stop_holding_lock: %s takes the state table lock and stops (SIGSTOP)", actor_name)
        stop_holding_lock(table)


def stop_holding_lock(table) -> None:
    """Take the state table's lock and SIGSTOP this process; releases it only if continued (SIGCONT).
    Reaches into the table's private lock on purpose: no real code path holds it outside one row write."""
    table._acquire()
    try:
        os.kill(os.getpid(), signal.SIGSTOP)
    finally:
        table._release()


def prefill_chunk_faults(faults, request_id: str, first_chunk: bool, is_live, beat) -> None:
    """Between two prompt chunks: ``slow_prefill`` makes every chunk S seconds slower (the row keeps making
    progress), ``stall_prefill`` stops progress after the first chunk for S seconds or until the row turns final.
    The actor heartbeats throughout: an actor that is alive but not moving one request, which only that stage's
    deadline can catch."""
    fault = faults.fires("slow_prefill", request_id)
    if fault is None and first_chunk:
        fault = faults.fires("stall_prefill", request_id)
    if fault is None:
        return
    until_ns = time.monotonic_ns() + int(fault.number("seconds") * 1e9)
    while time.monotonic_ns() < until_ns and is_live():
        beat()
        time.sleep(0.02)


def accept_kv_ready(faults, ready, core) -> bool:
    """Decode-side faults on a KVReady: ``bootstrap_silent`` ignores it (the row stays in BOOTSTRAP),
    ``decode_reject`` has the decode core (actors/decode_core.py ``reject``) fail it with a retryable 503.
    Returns False if the message must not reach the core."""
    if faults.fires("bootstrap_silent", ready.request_id):
        log.log(level(ready.request_id), "fault bootstrap_silent: ignoring KVReady for slot %d (%s)", ready.slot,
                ready.request_id)
        return False
    if faults.fires("decode_reject", ready.request_id):
        log.warning("fault decode_reject: dropping slot %d", ready.slot)
        core.reject(ready, 503, "engine_error", "the decode actor dropped the request; retry it")
        return False
    return True


class LeakyPool:
    """KVPool decorator (the prefill actor's, under its prefix cache): ``leak_blocks`` skips every free of a
    request's blocks (``request_id_of(owner slot)``), so they stay owned by its slot after it ends."""

    def __init__(self, pool, faults, request_id_of):
        self._pool, self._faults, self._request_id_of = pool, faults, request_id_of

    def __getattr__(self, name):
        return getattr(self._pool, name)

    def free(self, block_ids, owner_slot: int, *args, **kwargs):
        if self._faults.fires("leak_blocks", self._request_id_of(owner_slot)):
            log.warning("fault leak_blocks: blocks %s of slot %d are not freed", list(block_ids), owner_slot)
            return None
        return self._pool.free(block_ids, owner_slot, *args, **kwargs)


def leaky_pool(pool, faults, table):
    """``pool`` wrapped in :class:`LeakyPool` when a ``leak_blocks`` fault is set (else ``pool`` itself);
    ``table``: the state table, for a slot's request id."""
    if not any(f.name == "leak_blocks" for f in getattr(faults, "faults", ())):
        return pool
    return LeakyPool(pool, faults, lambda slot: table.snapshot()["request_id"][slot].decode(errors="replace"))


class FaultyTransfers:
    """TransfersPort decorator: ``transfer_stuck`` makes a transfer report IN_PROGRESS forever (no block ever
    arrives), ``transfer_unknown_status`` makes it report a status value the code does not know."""

    def __init__(self, inner, faults):
        self.inner, self.faults = inner, faults
        self.synchronous, self.local = inner.synchronous, inner.local
        self._forced: dict[int, int] = {}

    def start(self, request_id, src_block_ids, dst_block_ids, num_tokens, peer: str = LOCAL_PREFILL) -> int:
        handle = self.inner.start(request_id, src_block_ids, dst_block_ids, num_tokens, peer=peer)
        if self.faults.fires("transfer_stuck", request_id):
            self._forced[handle] = int(TransferStatus.IN_PROGRESS)
        elif self.faults.fires("transfer_unknown_status", request_id):
            self._forced[handle] = UNKNOWN_TRANSFER_STATUS
        return handle

    def poll(self, handle: int) -> tuple[int, int]:
        status, received = self.inner.poll(handle)
        if handle in self._forced:
            return self._forced[handle], 0
        return status, received

    def release(self, handle: int) -> None:
        self._forced.pop(handle, None)
        self.inner.release(handle)


class FaultyOutbox:
    """OutboxPort decorator: ``drop_transfer_done`` never sends a request's TransferDone,
    ``delay_transfer_done:seconds=S`` sends it S seconds late, whatever became of the request meanwhile (so the
    receiver's handling of a late message is exercised). ``flush`` (every loop iteration) sends what is due, then
    flushes the inner outbox (its held frames)."""

    def __init__(self, inner, faults, clock=time.monotonic_ns):
        self.inner, self.faults, self.clock = inner, faults, clock
        self.delayed: list[tuple[int, str, object, str]] = []   # (due ns, dest, message, request id)

    def send(self, dest: str, message, request_id: str = "") -> None:
        if isinstance(message, TransferDone):
            if self.faults.fires("drop_transfer_done", request_id):
                log.warning("fault drop_transfer_done: TransferDone for slot %d dropped", message.slot)
                return
            delay = self.faults.fires("delay_transfer_done", request_id)
            if delay is not None:
                due_ns = self.clock() + int(delay.number("seconds") * 1e9)
                self.delayed.append((due_ns, dest, message, request_id))
                return
        self.inner.send(dest, message, request_id)

    def try_send(self, dest: str, message, request_id: str = "") -> bool:
        return self.inner.try_send(dest, message, request_id)

    def flush(self) -> None:
        if self.delayed:
            now_ns = self.clock()
            due = [d for d in self.delayed if d[0] <= now_ns]
            self.delayed = [d for d in self.delayed if d[0] > now_ns]
            for _, dest, message, request_id in due:
                self.inner.send(dest, message, request_id)
        self.inner.flush()


class HeldRequests:
    """The shell's side of the hold faults (``hold_prefill``, ``hold_decode_waiting``, ``hold_decode``): which of a
    core's requests its loop leaves alone. Each request is judged once per fault (the first time it is asked about;
    ``fires`` consumes a count) and remembered by its row key; ``forget`` drops keys no longer live."""

    def __init__(self, faults):
        self.faults = faults
        self.judged: dict[tuple[str, tuple[int, int]], bool] = {}

    def held(self, fault: str, key: tuple[int, int], request_id: str) -> bool:
        if not self.faults:
            return False
        verdict = self.judged.get((fault, key))
        if verdict is None:
            verdict = self.judged[(fault, key)] = self.faults.fires(fault, request_id) is not None
            if verdict:
                log.log(level(request_id), "fault %s: holding slot %d (%s)", fault, key[0], request_id)
        return verdict

    def prefill_chunks(self, chunks: list) -> list:
        """The chunks of a planned prefill pass that are computed: those of ``hold_prefill`` requests are left
        out, so their prompts stay PREFILLING with no progress (the core plans them again next pass)."""
        return [c for c in chunks if not self.held("hold_prefill", c.work.rows[0][1], c.work.request.request_id)]

    def forget(self, live_keys) -> None:
        """Drop the verdicts of rows not in ``live_keys`` (a set of row keys), so the dict stays small."""
        if self.judged:
            self.judged = {k: v for k, v in self.judged.items() if k[1] in live_keys}


def drop_prefill_request(faults, message) -> bool:
    """``drop_prefill_request``: True if this PrefillRequest is dropped on arrival (its row stays QUEUED, held by
    nobody: only the queue deadline ends it)."""
    from actors.messages import PrefillRequest

    if isinstance(message, PrefillRequest) and faults and faults.fires("drop_prefill_request", message.request_id):
        log.log(level(message.request_id), "fault drop_prefill_request: dropping slot %d (%s)", message.slot,
                message.request_id)
        return True
    return False
