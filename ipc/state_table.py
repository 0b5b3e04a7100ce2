"""The request state table in POSIX shm: one transition function over the lifecycle of ``ipc/lifecycle.py``.

Lifecycle (``ipc.lifecycle.ALLOWED``; every transition goes through ``StateTable.transition``)::

    QUEUED -> PREFILLING -> BOOTSTRAP -> TRANSFERRING -> DECODE_WAITING -> DECODING -> FINISHED
    every non-final state -> ABORTED | TIMED_OUT | FAILED           (final states are terminal)
    final -> FREE only through StateTable.release (the API, once the client has its answer)
    FREE -> QUEUED only through StateTable.allocate

Shared-memory layout of segment ``name``::

    offset  size  field
    0       4     magic            b"PDST"
    4       4     version          u4 = 2
    8       4     num_rows         u4
    12      4     row_bytes        u4 = ROW_DTYPE.itemsize (128)
    16      8     rows_offset      u8 = HEADER_BYTES
    24      4     lock_timeout_ms  u4
    28      4     alloc_cursor     u4  next row allocate() tries first (spreads reuse over the table)
    64      8     lock record      (ipc._shm.LOCK_RECORD: holder pid i4, reserved u4)
    72      4     writing_slot     i4  row the lock holder is writing, -1 none (for repair after a crash)
    256     ...   num_rows rows of ROW_DTYPE

Row (``ROW_DTYPE``, 128 bytes, 8-byte fields aligned so a concurrent reader never sees half of one)::

    offset  field             type  meaning
    0       state_since_ns    i8    time.monotonic_ns() of the last transition (or allocation)
    8       created_ns        i8    monotonic ns at allocate()
    16      deadline_ns       i8    absolute monotonic per-request deadline, 0 = none
    24      last_progress_ns  i8    last decode token / transfer lease renewal (transitions stamp it too)
    32      prompt_tokens     i4
    36      output_tokens     i4
    40      prefill_blocks    i4    KV blocks held on the prefill side
    44      decode_blocks     i4    KV blocks held on the decode side
    48      generation        u4    +1 at every allocate(); messages carry (slot, generation)
    52      n_transfers       u4    times the request went through the prefill inflight queue / handoff
    56      seq               u4    seqlock: odd while a writer is mid-row; readers retry (internal)
    60      error_code        u2    0 = none
    62      state             u1    RequestState
    63      final_stage       u1    the non-final state the row was in when it became final (FREE = none)
    64      owner             i1    actor index responsible now, -1 none (kept when the row goes final)
    65      request_id        S40   the API's id, ascii (longer ids are stored truncated to 40 bytes)
    105     prefill_actor     i1    actor index of the prefill actor the router chose, -1 none (colocated)
    106     decode_actor      i1    actor index of the decode actor the router chose, -1 none
    107     (reserved to 128)

``prefill_actor`` and ``decode_actor`` are written once, by the API at ``allocate``; the monitor fails a row
held by a dead or hung actor only when the row names that actor.

``allocate``, ``transition`` and ``release`` also append an event to the process's flight recorder
(ipc/recorder.py; a no-op where none is installed), after the lock is released.

Writers (allocate/transition/update/release) take one table-wide lock (posix_ipc semaphore ``name + "_lock"``,
waited for at most ``lock_timeout_s``; a holder that died is taken over, see ``ipc._shm``). Readers never
lock: ``row``/``read`` use the per-row seqlock for a consistent row; ``snapshot``/``count_by_state``/
``live_slots`` are vectorized reads of the whole table, consistent per field, not across rows (fine for
gauges).
"""
from __future__ import annotations

import struct
import time
from typing import Iterable

import numpy as np

from ipc import _shm, recorder
from ipc._shm import RobustLock, set_lock_wait_hook  # noqa: F401 - public here: actors/base.py waits locks out
from ipc.lifecycle import (ALLOCATE_STATES, ALLOWED, FINAL_STATES, LIVE_STATES, RequestState,  # noqa: F401
                           check_mover, check_transition)
from ipc.recorder import EventKind
from pdserve.errors import StateTableFullError


_IS_FINAL = np.zeros(256, dtype=bool)
_IS_FINAL[[int(s) for s in FINAL_STATES]] = True
_IS_LIVE = np.zeros(256, dtype=bool)
_IS_LIVE[[int(s) for s in LIVE_STATES]] = True


def is_final(state: int) -> bool:
    """True for FINISHED, ABORTED, TIMED_OUT and FAILED."""
    return bool(_IS_FINAL[int(state)]) if 0 <= int(state) < 256 else False


ROW_FIELDS = [  # (name, dtype, offset)
    ("state_since_ns", "<i8", 0), ("created_ns", "<i8", 8), ("deadline_ns", "<i8", 16),
    ("last_progress_ns", "<i8", 24), ("prompt_tokens", "<i4", 32), ("output_tokens", "<i4", 36),
    ("prefill_blocks", "<i4", 40), ("decode_blocks", "<i4", 44), ("generation", "<u4", 48),
    ("n_transfers", "<u4", 52), ("seq", "<u4", 56), ("error_code", "<u2", 60), ("state", "u1", 62),
    ("final_stage", "u1", 63), ("owner", "i1", 64), ("request_id", "S40", 65),
    ("prefill_actor", "i1", 105), ("decode_actor", "i1", 106),
]
ROW_DTYPE = np.dtype({"names": [f[0] for f in ROW_FIELDS], "formats": [f[1] for f in ROW_FIELDS],
                      "offsets": [f[2] for f in ROW_FIELDS], "itemsize": 128})
REQUEST_ID_BYTES = 40

MAGIC = b"PDST"
VERSION = 2
HEADER_BYTES = 256
HEADER = struct.Struct("<4sIIIQII")  # magic, version, num_rows, row_bytes, rows_offset, lock_ms, cursor
OFF_CURSOR = 28
OFF_LOCK = 64
OFF_WRITING = 72
I4 = struct.Struct("<i")
U4 = struct.Struct("<I")
LOCK_SUFFIX = "_lock"
REPAIR_SUFFIX = "_lkrp"
DEFAULT_LOCK_TIMEOUT_S = 1.0

UPDATABLE_FIELDS = frozenset({"output_tokens", "prefill_blocks", "decode_blocks", "last_progress_ns",
                              "n_transfers", "owner", "error_code", "deadline_ns"})
_RANGES = {k: (int(np.iinfo(ROW_DTYPE[k]).min), int(np.iinfo(ROW_DTYPE[k]).max)) for k in UPDATABLE_FIELDS}
_SEQLOCK_TRIES = 10_000


def _state_set(expect) -> frozenset[int] | None:
    if expect is None:
        return None
    if isinstance(expect, (int, RequestState)):
        return frozenset({int(RequestState(expect))})
    return frozenset(int(RequestState(s)) for s in expect)


class StateTable(_shm.ShmSegment):
    """Fixed-size table of request rows in POSIX shm (layout in the module docstring).

    The creator owns the segment and alone unlinks it. Other processes ``attach`` (or receive it pickled: only
    the name travels). ``attach(readonly=True)`` maps PROT_READ for inspect tools: reads work, writes raise
    PermissionError (and the raw arrays are read-only numpy arrays). Segment plumbing: ``ipc._shm.ShmSegment``.
    """

    MAGIC = MAGIC
    VERSION = VERSION
    KIND = "state table"
    SEM_SUFFIXES = (LOCK_SUFFIX, REPAIR_SUFFIX)

    def __init__(self) -> None:  # use create() / attach()
        super().__init__()
        self.num_rows = 0
        self.lock_timeout_s = DEFAULT_LOCK_TIMEOUT_S
        self._rows: np.ndarray | None = None
        self._c: dict[str, np.ndarray] = {}
        self._lock: RobustLock | None = None

    @classmethod
    def create(cls, name: str, num_rows: int, *,
               lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S) -> "StateTable":
        """Create (O_CREX, mode 0600) and own a table of ``num_rows`` FREE rows.

        Raises ValueError for a size out of range, FileExistsError if ``name`` or its lock exists.
        """
        if not 1 <= num_rows <= 1 << 24:
            raise ValueError(f"num_rows={num_rows} must be in 1..{1 << 24}")
        if not 0.001 <= lock_timeout_s <= 3600:
            raise ValueError(f"lock_timeout_s={lock_timeout_s} must be in 0.001..3600 seconds")

        def init(mm) -> None:
            HEADER.pack_into(mm, 0, b"\0\0\0\0", VERSION, num_rows, ROW_DTYPE.itemsize, HEADER_BYTES,
                             int(lock_timeout_s * 1000), 0)
            I4.pack_into(mm, OFF_WRITING, -1)
            rows = _shm.shm_array(mm, ROW_DTYPE, num_rows, HEADER_BYTES)
            rows["owner"] = rows["prefill_actor"] = rows["decode_actor"] = -1

        return cls._create(name, HEADER_BYTES + num_rows * ROW_DTYPE.itemsize, init, sem_values=(1, 1))

    def _check_layout(self, name: str, mm) -> None:
        row_bytes = HEADER.unpack_from(mm, 0)[3] if len(mm) >= HEADER_BYTES else 0
        if row_bytes != ROW_DTYPE.itemsize:
            raise ValueError(f"state table {name!r} has rows of {row_bytes} B; this code expects "
                             f"{ROW_DTYPE.itemsize} B")

    def _setup(self, mm) -> None:
        _, _, num_rows, _, rows_offset, lock_ms, _ = HEADER.unpack_from(mm, 0)
        self.num_rows = num_rows
        self.lock_timeout_s = lock_ms / 1000.0
        self._rows = _shm.shm_array(mm, ROW_DTYPE, num_rows, rows_offset)
        self._c = {f: self._rows[f] for f in ROW_DTYPE.names}
        if self._sems:
            sem, repair = self._sems
            self._lock = RobustLock(sem, repair, mm, OFF_LOCK, f"lock of state table {self.name!r}",
                                    self.lock_timeout_s)

    def _teardown(self) -> None:
        self._lock = None
        self._rows = None
        self._c = {}

    def _repr_fields(self) -> str:
        return f", num_rows={self.num_rows}"

    # ------------------------------------------------------------------ locking and the row seqlock

    def _writable(self) -> None:
        if self._closed:
            raise ValueError(f"state table {self.name!r} is closed in this process")
        if self.readonly:
            raise PermissionError(f"state table {self.name!r} is attached read-only; attach without readonly "
                                  f"to change it")

    def _acquire(self) -> None:
        if self._lock.acquire():
            self._repair_after_dead_writer()

    def _release(self) -> None:
        self._lock.release()

    def _repair_after_dead_writer(self) -> None:
        slot = I4.unpack_from(self._mm, OFF_WRITING)[0]
        if 0 <= slot < self.num_rows and self._c["seq"][slot] % 2 == 1:
            self._c["seq"][slot] += 1  # the dead writer's row: fields written state-last, so it is usable
        I4.pack_into(self._mm, OFF_WRITING, -1)

    def _begin_write(self, slot: int) -> None:
        I4.pack_into(self._mm, OFF_WRITING, slot)
        self._c["seq"][slot] += 1

    def _end_write(self, slot: int) -> None:
        self._c["seq"][slot] += 1
        I4.pack_into(self._mm, OFF_WRITING, -1)

    def _check_slot(self, slot: int) -> int:
        slot = int(slot)
        if not 0 <= slot < self.num_rows:
            raise IndexError(f"slot {slot} outside state table {self.name!r} of {self.num_rows} rows")
        return slot

    # ------------------------------------------------------------------ writers

    def allocate(self, request_id: str, *, prompt_tokens: int, deadline_ns: int = 0, prefill_actor: int = -1,
                 decode_actor: int = -1, state: RequestState = RequestState.QUEUED) -> tuple[int, int]:
        """Take a FREE row for ``request_id`` in ``state`` (QUEUED; BOOTSTRAP for a decode node admitting a
        request prefilled on another node: ``ipc.lifecycle.ALLOCATE_STATES``); returns ``(slot, generation)``.

        ``prefill_actor`` / ``decode_actor``: the actor indices the router chose (-1 = none), kept for the row's
        life.
        ``deadline_ns`` is an absolute ``time.monotonic_ns()`` deadline (0 = none). Stamps created_ns,
        state_since_ns and last_progress_ns. An id longer than 40 bytes is stored truncated.
        Raises StateTableFullError if every row is in use, ValueError for a non-ascii id,
        PermissionError if read-only, ShmLockTimeoutError if the lock is held by a live process too long.
        """
        self._writable()
        if state not in ALLOCATE_STATES:
            raise ValueError(f"a row cannot start in {RequestState(state).name}; allocate() starts one in "
                             f"{', '.join(sorted(s.name for s in ALLOCATE_STATES))}")
        rid = request_id.encode("ascii")[:REQUEST_ID_BYTES]  # UnicodeEncodeError is a ValueError
        c = self._c
        self._acquire()
        try:
            cursor = U4.unpack_from(self._mm, OFF_CURSOR)[0] % self.num_rows
            free = np.flatnonzero(c["state"][cursor:] == 0)
            if free.size:
                slot = cursor + int(free[0])
            else:
                free = np.flatnonzero(c["state"][:cursor] == 0)
                if not free.size:
                    raise StateTableFullError(
                        f"all {self.num_rows} rows of state table {self.name!r} are in use: admission must "
                        f"wait (or the API is not releasing final rows)")
                slot = int(free[0])
            gen = (int(c["generation"][slot]) + 1) & 0xFFFFFFFF or 1
            now = time.monotonic_ns()
            self._begin_write(slot)
            try:
                rec = self._rows[slot]
                rec["state_since_ns"] = now
                rec["created_ns"] = now
                rec["deadline_ns"] = deadline_ns
                rec["last_progress_ns"] = now
                rec["prompt_tokens"] = prompt_tokens
                rec["output_tokens"] = 0
                rec["prefill_blocks"] = 0
                rec["decode_blocks"] = 0
                rec["n_transfers"] = 0
                rec["error_code"] = 0
                rec["final_stage"] = 0
                rec["owner"] = -1
                rec["prefill_actor"] = prefill_actor
                rec["decode_actor"] = decode_actor
                rec["request_id"] = rid
                rec["generation"] = gen
                rec["state"] = state  # last: a crash before this leaves the row FREE
            finally:
                self._end_write(slot)
            U4.pack_into(self._mm, OFF_CURSOR, (slot + 1) % self.num_rows)
        finally:
            self._release()
        recorder.record_request(EventKind.ALLOCATE, rid, slot, gen, new=int(state), a=deadline_ns, b=prompt_tokens)
        return slot, gen

    def transition(self, slot: int, generation: int, new_state: RequestState, *, owner: int | None = None,
                   expect: RequestState | Iterable[RequestState] | None = None,
                   error_code: int | None = None, by: str | None = None) -> bool:
        """Move row ``slot`` to ``new_state``: the ONLY way a request's state changes.

        Under the table lock: returns False and changes nothing if ``generation`` is stale, the row is FREE or
        already final, or ``expect`` (a state or a set of states) is given and the current state is not in it.
        Raises ValueError if the move is not in ``ALLOWED`` from the current (non-final) state. On success
        stamps state_since_ns and last_progress_ns (monotonic ns), sets ``owner`` / ``error_code`` if given,
        and when ``new_state`` is final records the state it left in final_stage. A monitor's TIMED_OUT and an
        actor's FINISHED race here: exactly one returns True.
        Raises PermissionError if read-only, ShmLockTimeoutError if a live process holds the lock too long.
        """
        self._writable()
        slot = self._check_slot(slot)
        new = RequestState(new_state)
        check_mover(new, by)   # ``by``: the moving role, checked against the lifecycle's "moved by" (ValueError)
        want = _state_set(expect)
        c = self._c
        self._acquire()
        try:
            if int(c["generation"][slot]) != generation:
                return False
            cur = int(c["state"][slot])
            if cur == RequestState.FREE or _IS_FINAL[cur]:
                return False
            if want is not None and cur not in want:
                return False
            check_transition(cur, new)
            now = time.monotonic_ns()
            self._begin_write(slot)
            try:
                if owner is not None:
                    c["owner"][slot] = owner
                if error_code is not None:
                    c["error_code"][slot] = error_code
                if new in FINAL_STATES:
                    c["final_stage"][slot] = cur
                c["state_since_ns"][slot] = now
                c["last_progress_ns"][slot] = now
                c["state"][slot] = new
            finally:
                self._end_write(slot)
            rid, deadline_ns, code = c["request_id"][slot], int(c["deadline_ns"][slot]), int(c["error_code"][slot])
        finally:
            self._release()
        # the flight recorder (ipc/recorder.py): every transition, recorded here so no call site can forget it
        recorder.record_request(EventKind.TRANSITION, rid, slot, generation, old=cur, new=int(new), a=deadline_ns,
                                c=code, t_ns=now)
        return True

    def update(self, slot: int, generation: int, **fields) -> bool:
        """Set counters/gauges of a row: any of ``UPDATABLE_FIELDS`` (output_tokens, prefill_blocks,
        decode_blocks, last_progress_ns, n_transfers, owner, error_code, deadline_ns).

        Returns False (no change) if ``generation`` is stale or the row is FREE; final rows accept updates.
        Raises ValueError for another field (``state`` changes only through ``transition``), OverflowError
        for a value outside the field's type, PermissionError if read-only.
        """
        return self.update_many([(slot, generation, fields)]) == 1

    def update_many(self, updates: Iterable[tuple[int, int, dict]]) -> int:
        """``update`` for many rows under one lock round trip (a decode step's token counts and renewals):
        ``updates`` holds ``(slot, generation, fields)``. Returns how many rows were changed (stale or FREE rows
        are skipped). Raises as ``update`` does, before changing anything."""
        self._writable()
        checked = []
        for slot, generation, fields in updates:
            bad = set(fields) - UPDATABLE_FIELDS
            if bad:
                raise ValueError(f"update() cannot set {sorted(bad)}; it sets {sorted(UPDATABLE_FIELDS)} "
                                 f"(state changes only through transition())")
            for k, v in fields.items():  # range-check before touching any row
                lo, hi = _RANGES[k]
                if not lo <= int(v) <= hi:
                    raise OverflowError(f"{k}={v} outside {ROW_DTYPE[k]} range [{lo}, {hi}]")
            checked.append((self._check_slot(slot), generation, fields))
        if not checked:
            return 0
        c = self._c
        changed = 0
        self._acquire()
        try:
            for slot, generation, fields in checked:
                if int(c["generation"][slot]) != generation or c["state"][slot] == RequestState.FREE:
                    continue
                self._begin_write(slot)
                try:
                    for k, v in fields.items():
                        c[k][slot] = v
                finally:
                    self._end_write(slot)
                changed += 1
            return changed
        finally:
            self._release()

    def release(self, slot: int, generation: int) -> bool:
        """Return a final row to FREE (the API, once the client has been answered).

        Returns False if ``generation`` is stale or the row is not final (live rows must first be moved to a
        final state with ``transition``; FREE rows are already released). The row's other fields are kept for
        post-mortem reading until the next allocate. Raises PermissionError if read-only.
        """
        self._writable()
        slot = self._check_slot(slot)
        c = self._c
        self._acquire()
        try:
            if int(c["generation"][slot]) != generation or not _IS_FINAL[c["state"][slot]]:
                return False
            self._begin_write(slot)
            try:
                c["state_since_ns"][slot] = time.monotonic_ns()
                final = int(c["state"][slot])
                c["state"][slot] = RequestState.FREE
            finally:
                self._end_write(slot)
            rid = c["request_id"][slot]
        finally:
            self._release()
        recorder.record_request(EventKind.RELEASE, rid, slot, generation, old=final)
        return True

    # ------------------------------------------------------------------ readers (no lock)

    def _consistent_row(self, slot: int) -> np.void:
        seq = self._c["seq"]
        rec = None
        for _ in range(_SEQLOCK_TRIES):
            s1 = int(seq[slot])
            if s1 & 1:
                continue
            rec = self._rows[slot].copy()
            if int(seq[slot]) == s1:
                return rec
        return rec if rec is not None else self._rows[slot].copy()  # a writer died mid-row: best effort

    def consistent_rows(self, slots) -> np.ndarray:
        """Rows ``slots`` (a sequence of slot numbers), each read consistently through its seqlock, as a
        structured array of ROW_DTYPE. ``snapshot()`` is consistent per field only: a row being written can
        show its new state with its old timestamp; re-read a row this way before acting on it."""
        out = np.zeros(len(slots), dtype=ROW_DTYPE)
        for i, slot in enumerate(slots):
            out[i] = self._consistent_row(self._check_slot(int(slot)))
        return out

    def row(self, slot: int) -> dict:
        """A consistent snapshot of row ``slot`` as a dict (states as RequestState, request_id as str, plus
        ``slot``). Raises IndexError for a slot outside the table."""
        slot = self._check_slot(slot)
        return _row_dict(self._consistent_row(slot), slot)

    def read(self, slot: int, generation: int) -> dict | None:
        """``row(slot)`` if the row still belongs to ``generation`` and is not FREE, else None."""
        slot = self._check_slot(slot)
        rec = self._consistent_row(slot)
        if int(rec["generation"]) != generation or int(rec["state"]) == RequestState.FREE:
            return None
        return _row_dict(rec, slot)

    def snapshot(self) -> np.ndarray:
        """A copy of every row (structured array of ``ROW_DTYPE``; rows may be mutually inconsistent, a row
        with an odd ``seq`` was mid-write)."""
        return self._rows.copy()

    def live_slots(self) -> list[int]:
        """Slots of rows that are neither FREE nor final."""
        return np.flatnonzero(_IS_LIVE[self._c["state"]]).tolist()

    def live_keys(self) -> set[tuple[int, int]]:
        """``(slot, generation)`` of the rows that are neither FREE nor final, in one vectorized read (state and
        generation columns read apart: a row moving meanwhile may read either way)."""
        slots = np.flatnonzero(_IS_LIVE[self._c["state"]])
        return set(zip(slots.tolist(), self._c["generation"][slots].tolist()))

    def count_by_state(self) -> dict[RequestState, int]:
        """Rows per state, every state present (vectorized: tens of microseconds for 10,000 rows)."""
        counts = np.bincount(self._c["state"], minlength=256)
        return {s: int(counts[s]) for s in RequestState}

    def find(self, request_id: str) -> list[tuple[int, int]]:
        """(slot, generation) of the non-FREE rows holding ``request_id`` (for abort and inspect)."""
        rid = request_id.encode("ascii", "replace")[:REQUEST_ID_BYTES]
        hits = np.flatnonzero((self._c["request_id"] == rid) & (self._c["state"] != 0))
        return [(int(s), int(self._c["generation"][s])) for s in hits]

    @property
    def rows(self) -> np.ndarray:
        """The live structured array over shm (read-only when attached read-only). Prefer the methods."""
        return self._rows


def _row_dict(rec: np.void, slot: int) -> dict:
    d = {name: rec[name].item() for name in ROW_DTYPE.names if name != "seq"}
    d["request_id"] = d["request_id"].decode("ascii", "replace")
    d["state"] = RequestState(d["state"]) if d["state"] in RequestState._value2member_map_ else d["state"]
    fs = d["final_stage"]
    d["final_stage"] = RequestState(fs) if fs in RequestState._value2member_map_ else fs
    d["slot"] = slot
    return d
