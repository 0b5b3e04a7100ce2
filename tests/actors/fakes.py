"""In-memory ports for the scheduler cores (actors/ports.py) and the API's admission core (api/admission.py): a
state table that enforces the real lifecycle (ipc/lifecycle.py) and its size, a block allocator that refuses
double frees, scripted transfers, a recording outbox that can refuse a destination, an actor table and a manual
clock. Plain Python: the core tests run in microseconds, no process, no shm."""
from __future__ import annotations

from actors.messages import PrefillRequest, Sampling
from actors.topology import LOCAL_PREFILL, NO_ACTOR
from ipc.actor_table import ActorHealth, ActorStatus
from ipc.lifecycle import ALLOCATE_STATES, FINAL_STATES, RequestState, TransferStatus, check_mover, check_transition
from ipc.state_table import UPDATABLE_FIELDS
from pdserve.errors import OutOfKVBlocksError, StateTableFullError


class FakeClock:
    def __init__(self, now_ns: int = 1_000_000_000):
        self.now_ns = now_ns

    def __call__(self) -> int:
        return self.now_ns

    def advance(self, seconds: float) -> None:
        self.now_ns += int(seconds * 1e9)


class FakeTable:
    """Rows keyed by slot; ``transition`` applies the real ALLOWED rules and refuses stale generations and final
    rows, as StateTable does; ``allocate`` raises StateTableFullError past ``num_rows`` live rows, ``release``
    frees a final row only (``released`` lists the keys released)."""

    def __init__(self, clock: FakeClock, num_rows: int = 1 << 30):
        self.clock = clock
        self.num_rows = num_rows
        self.rows: dict[int, dict] = {}
        self.released: list[tuple[int, int]] = []
        self.next_slot = 0

    def allocate(self, request_id: str, prompt_tokens: int = 0, *, deadline_ns: int = 0,
                 prefill_actor: int = NO_ACTOR, decode_actor: int = NO_ACTOR, state: RequestState = RequestState.QUEUED) -> tuple[int, int]:
        if state not in ALLOCATE_STATES:
            raise ValueError(f"a row cannot start in {RequestState(state).name}")
        if len(self.rows) >= self.num_rows:
            raise StateTableFullError(f"all {self.num_rows} rows in use")
        slot = self.next_slot
        self.next_slot += 1
        now = self.clock()
        self.rows[slot] = {"slot": slot, "generation": 1, "state": RequestState(state), "request_id": request_id,
                           "created_ns": now, "state_since_ns": now, "last_progress_ns": now, "owner": -1,
                           "prompt_tokens": prompt_tokens, "output_tokens": 0, "prefill_blocks": 0,
                           "decode_blocks": 0, "n_transfers": 0, "deadline_ns": deadline_ns,
                           "prefill_actor": prefill_actor, "decode_actor": decode_actor}
        return slot, 1

    def release(self, slot: int, generation: int) -> bool:
        row = self.rows.get(slot)
        if row is None or row["generation"] != generation or row["state"] not in FINAL_STATES:
            return False
        del self.rows[slot]
        self.released.append((slot, generation))
        return True

    def read(self, slot: int, generation: int) -> dict | None:
        row = self.rows.get(slot)
        return dict(row) if row is not None and row["generation"] == generation else None

    def live_keys(self) -> set[tuple[int, int]]:
        return {(s, r["generation"]) for s, r in self.rows.items() if r["state"] not in FINAL_STATES}

    def state(self, key) -> RequestState:
        return self.rows[key[0]]["state"]

    def transition(self, slot, generation, new_state, *, owner=None, by=None) -> bool:
        check_mover(new_state, by)
        row = self.rows.get(slot)
        if row is None or row["generation"] != generation or row["state"] in FINAL_STATES:
            return False
        check_transition(row["state"], new_state)
        row["state"] = RequestState(new_state)
        row["state_since_ns"] = row["last_progress_ns"] = self.clock()
        if owner is not None:
            row["owner"] = owner
        return True

    def update(self, slot, generation, **fields) -> bool:
        if not fields.keys() <= UPDATABLE_FIELDS:   # as StateTable: a state moves only through transition()
            raise ValueError(f"update() cannot set {sorted(fields.keys() - UPDATABLE_FIELDS)}")
        row = self.rows.get(slot)
        if row is None or row["generation"] != generation:
            return False
        row.update(fields)
        return True

    def update_many(self, updates) -> int:
        return sum(self.update(slot, generation, **fields) for slot, generation, fields in updates)


class FakeAllocator:
    """All-or-nothing allocation; ``free`` raises on a block that is free or held by another slot."""

    def __init__(self, num_blocks: int, block_tokens: int = 16):
        self.block_tokens = block_tokens
        self.num_blocks = num_blocks
        self.owner = {b: None for b in range(num_blocks)}
        self.generation: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return sum(1 for o in self.owner.values() if o is None)

    def allocate(self, n: int, owner_slot: int) -> list[int]:
        free = [b for b, o in self.owner.items() if o is None]
        if len(free) < n:
            raise OutOfKVBlocksError(f"need {n}, {len(free)} free")
        for b in free[:n]:
            self.owner[b] = owner_slot
            self.generation[b] = self.generation.get(b, 0) + 1
        return free[:n]

    def free(self, block_ids, owner_slot: int) -> int:
        block_ids = list(block_ids)
        for b in block_ids:
            assert self.owner[b] == owner_slot, f"block {b} freed by slot {owner_slot} but held by {self.owner[b]}"
            self.owner[b] = None
        return len(block_ids)

    def reassign(self, block_ids, owner_slot: int, new_owner_slot: int) -> None:
        for b in block_ids:
            assert self.owner[b] == owner_slot, f"block {b} reassigned by {owner_slot} but held by {self.owner[b]}"
            self.owner[b] = new_owner_slot

    def generations(self, block_ids) -> list[int]:
        """Each block's allocation count (a KVPool's generation)."""
        return [self.generation.get(b, 0) for b in block_ids]


class FakeTransfers:
    """Transfers that finish at once (``synchronous``), unless ``by_handle[handle]`` or ``script[request_id]``
    names a status to report (the children of an ``n > 1`` request share one request id: script them by handle)."""

    def __init__(self, local: bool = False):
        self.synchronous = True
        self.local = local
        self.script: dict[str, int] = {}
        self.by_handle: dict[int, int] = {}
        self.started: dict[int, tuple] = {}
        self.released: list[int] = []
        self.next_handle = 1

    def start(self, request_id, src, dst, num_tokens, peer: str = LOCAL_PREFILL) -> int:
        handle = self.next_handle
        self.next_handle += 1
        self.started[handle] = (request_id, list(src), list(dst), num_tokens)
        return handle

    def poll(self, handle: int) -> tuple[int, int]:
        request_id, src, _, _ = self.started[handle]
        status = self.by_handle.get(handle, self.script.get(request_id, int(TransferStatus.DONE)))
        return status, len(src) if status == TransferStatus.DONE else 0

    def release(self, handle: int) -> None:
        self.released.append(handle)


class Outbox:
    """Records every message; ``take(dest)`` hands them over and forgets them; ``refuse[dest] = exc`` makes every
    send there raise ``exc`` (a full or too-small queue)."""

    def __init__(self):
        self.sent: list[tuple[str, object]] = []
        self.refuse: dict = {}

    def send(self, dest: str, message, request_id: str = "") -> None:
        if dest in self.refuse:
            raise self.refuse[dest]
        self.sent.append((dest, message))

    def try_send(self, dest: str, message, request_id: str = "") -> bool:
        if dest in self.refuse:
            return False
        self.sent.append((dest, message))
        return True

    def take(self, dest: str, kind=object) -> list:
        mine = [m for d, m in self.sent if d == dest and isinstance(m, kind)]
        self.sent = [(d, m) for d, m in self.sent if not (d == dest and isinstance(m, kind))]
        return mine


def prefill_request(table: FakeTable, request_id: str, prompt_tokens: int = 20, max_tokens: int = 4, n: int = 1,
                    **sampling) -> PrefillRequest:
    """Allocate ``n`` rows for one request (as the API does) and build its PrefillRequest."""
    rows = [table.allocate(request_id, prompt_tokens) for _ in range(n)]
    return PrefillRequest(rows[0][0], rows[0][1], request_id, list(range(1, prompt_tokens + 1)),
                          Sampling(max_tokens=max_tokens, **sampling), [list(k) for k in rows[1:]])


class FakeActors:
    """The actor table as the API reads it: ``rows()`` (name, status, health, kv_blocks_free per index) and the
    ``routed`` counts the API publishes."""

    def __init__(self, names: list[str], kv_blocks_free: int = 100):
        self.table = [{"index": i, "name": name, "status": ActorStatus.READY, "health": ActorHealth.OK,
                       "kv_blocks_free": kv_blocks_free} for i, name in enumerate(names)]
        self.routed: dict[int, int] = {}

    def rows(self) -> list[dict]:
        return [dict(r) for r in self.table]

    def set_routed_requests(self, index: int, count: int) -> None:
        self.routed[index] = count
