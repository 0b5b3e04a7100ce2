"""The decode scheduler core: plain synchronous code over ports (actors/ports.py), no queue, torch or fault
code, and no clock of its own (time comes in as ``now_ns``); its one shm write is the flight recorder's
events (ipc/recorder.py, which stamps them). The shell (actors/decode.py) feeds it KVReady messages, runs the
decode step over ``batch()`` and publishes its counts.

Rows it moves, each collection named after the state its entries are in:
    bootstrap       KVReady received (BOOTSTRAP): reserve blocks for prompt + the output's reserved tokens
                    (``Sampling.reserved_output_tokens``: max_tokens, or fewer for a request without one, which
                    then takes a block at a time as its answer grows), in arrival order
    transferring    TRANSFERRING: pulling the prompt's KV; blocks arriving renew the stage deadline
    decode_waiting  DECODE_WAITING: copy done (TransferDone sent to prefill, which frees its own blocks)
    decoding        DECODING: the running batch, one token per step -> FINISHED (EOS, stop token, max_tokens,
                    or no free block for a growing answer: "length")
A row that turns final elsewhere (client abort, stop string, monitor timeout) is dropped by ``reap`` and its
blocks freed once. Per step, the table writes of the whole batch (token counts, renewals) go in one
``update_many`` (one lock round trip); a row joining the batch writes and sends its first tokens in one more, before the
step.
The children of an ``n > 1`` request hold the prompt's full blocks once (``SharedPrompt``, keyed by
``prompt_key``): the first to be reserved pulls them, each child owns its partial last block and its generation
blocks, and the last holder to leave frees them (docs/architecture.md, "`n` > 1: children share one prefill").

Cross-turn reuse (``hand_back``): a request this role finished (stop or length; not one that ended elsewhere) hands
the blocks holding its prompt + answer KV back to the prefill actor that served it (KVHandBack, sent without
waiting: a full queue drops it, counted in ``hand_backs_dropped``). Colocated, the blocks go to the local prefill
core at once; else they wait here under HANDBACK_OWNER (``lingering``) until HandBackDone, ``linger_s``, or a
reservation that finds the pool short, whichever comes first (docs/architecture.md, "Cross-turn reuse").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from actors.messages import HandBackDone, KVHandBack, KVReady, RequestError, TokenBatch, TransferDone
from actors.ports import AllocatorPort, Clock, OutboxPort, TablePort, TransfersPort
from actors.prefix_cache import HANDBACK_OWNER
from actors.topology import API, LOCAL_DECODE, LOCAL_PREFILL, is_remote
from ipc.lifecycle import LIVE_STATES, TransferStatus
from ipc.lifecycle import RequestState as S
from ipc.recorder import EventKind, Renewal, record_request
from pdserve.errors import OutOfKVBlocksError
from pdserve.kv_budget import blocks_for

Key = tuple[int, int]


def prompt_key(ready: KVReady, block_tokens: int) -> tuple | None:
    """What identifies the prompt KV ``ready`` points at, for sharing its full blocks in the decode pool: the
    prefill actor (or remote pool) holding it, the request's first row on the prefill side (``prompt_row``: unique
    among live requests, as its generation changes at every reuse of the row), its source block ids and token count.
    None when there is nothing to share (a prompt shorter than one block, or no ``prompt_row``)."""
    if len(ready.prompt_row) != 2 or ready.num_tokens < block_tokens:
        return None
    return (ready.prefill_actor, *ready.prompt_row, tuple(ready.src_block_ids), ready.num_tokens)


@dataclass(eq=False)
class SharedPrompt:
    """The full blocks of one prompt's KV in the decode pool (``num_tokens // block_tokens`` of them), held once by
    every child of the request (reference count: ``holders``). Written only by ``pull``, before any holder leaves
    TRANSFERRING; read-only after. Freed (under ``owner_slot``, the first holder's) when the last holder leaves."""

    key: tuple
    blocks: list[int]
    owner_slot: int
    holders: set = field(default_factory=set)   # keys of the entries holding the blocks
    pull: int | None = None      # transfer handle filling them, and the first holder's partial last block
    puller: Key | None = None    # the entry that started ``pull``
    done: bool = False           # ``pull`` finished: the blocks hold the prompt's KV
    failure: str = ""            # ``pull`` failed (why): every holder fails
    received: int = 0            # blocks ``pull`` reported so far
    parked: list[int] = field(default_factory=list)   # the puller's partial block after it left, until ``pull`` ends


@dataclass
class DecodeEntry:
    """A request held by the decode role."""

    ready: KVReady
    blocks: list[int] = field(default_factory=list)   # block table: ``shared.blocks`` first, then its own blocks
    shared: SharedPrompt | None = None
    pulled_blocks: int = 0            # blocks its transfers moved (the shared ones only for the puller)
    position: int = 0          # position of ``last_token``, whose KV is not in the pool yet
    last_token: int = 0
    output_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)   # generated so far (penalties count them)
    transfer_handle: int | None = None
    transfer_start_ns: int = 0
    blocks_received: int = 0
    timings: dict | None = None       # stage timings, sent with the first token
    runtime: Any = None               # the shell's per-request sampling state; opaque here
    grammar_done: bool = False        # set by the shell: the request's grammar is complete (only EOS could follow)

    @property
    def key(self) -> Key:
        return (self.ready.slot, self.ready.generation)


class DecodeCore:
    """Reservation, KV pull, joining the batch, token bookkeeping and clean-up of one decode role.

    ``block_bytes``: bytes of one KV block across layers, K and V (for the transfer timings).
    ``hand_back``: hand finished requests' KV back to prefill; then ``allocator`` also has ``reassign`` and
    ``generations`` (a KVPool's), and ``outbox`` has ``try_send(dest, message) -> bool`` (never waits).
    ``linger_s``: longest a handed-back block waits here for HandBackDone.
    """

    def __init__(self, table: TablePort, allocator: AllocatorPort, transfers: TransfersPort, outbox: OutboxPort,
                 clock: Clock, *, actor_index: int, eos_ids, max_num_seqs: int, block_bytes: int,
                 renew_interval_s: float = 1.0, hand_back: bool = False, linger_s: float = 2.0,
                 address: str = LOCAL_DECODE):
        self.table, self.allocator, self.transfers, self.outbox, self.clock = table, allocator, transfers, outbox, clock
        self.actor_index, self.address = actor_index, address
        self.eos_ids = frozenset(eos_ids)
        self.max_num_seqs = max_num_seqs
        self.block_bytes = block_bytes
        self.renew_interval_ns = int(renew_interval_s * 1e9)
        self.bootstrap: list[DecodeEntry] = []
        self.transferring: list[DecodeEntry] = []
        self.decode_waiting: list[DecodeEntry] = []
        self.decoding: list[DecodeEntry] = []
        self.prompts: dict[tuple, SharedPrompt] = {}   # by prompt_key: prompt blocks held by at least one entry
        self.renewed_ns = 0
        self.finished = 0   # rows it moved to FINISHED (a per-actor work counter)
        self.hand_back, self.linger_ns = hand_back, int(linger_s * 1e9)
        self.lingering: dict[Key, tuple[list[int], int]] = {}   # handed back: (blocks, deadline ns), oldest first
        self.hand_backs_dropped = 0   # hand-backs not sent (the prefill actor's queue was full)
        self._items: list[list[Any]] = []                 # this step's TokenBatch rows
        self._updates: list[tuple[int, int, dict]] = []   # this step's table writes

    # ---- events -------------------------------------------------------------------------------------
    def on_message(self, message: Any) -> bool:
        """A KVReady (the request is in BOOTSTRAP) or HandBackDone; returns False for any other message."""
        if isinstance(message, HandBackDone):
            self._unlinger((message.slot, message.generation))
            return True
        if not isinstance(message, KVReady):
            return False
        self.bootstrap.append(DecodeEntry(ready=message))
        return True

    def reject(self, ready: KVReady, http_status: int, error_type: str, message: str) -> bool:
        """Refuse a KVReady at intake (before it holds anything here: an unusable peer descriptor, the
        ``decode_reject`` fault): its row FAILS and the API gets ``RequestError(http_status, error_type,
        message)``. Returns False (nothing sent) if the row had ended already."""
        if not self.table.transition(ready.slot, ready.generation, S.FAILED, owner=self.actor_index, by="decode"):
            return False
        self.outbox.send(API, RequestError(ready.slot, ready.generation, http_status, error_type, message),
                         ready.request_id)
        return True

    def has_work(self) -> bool:
        """True when the next iteration has something to run at once (a step, a row joining the batch)."""
        return bool(self.decoding) or (bool(self.decode_waiting) and len(self.decoding) < self.max_num_seqs)

    def wait_s(self, idle_wait_s: float) -> float:
        """How long the shell may block on its inbox: not at all with work to run; briefly while an
        asynchronous transfer runs (a synchronous one is finished when started: only a stuck one is left, and
        its deadline needs no polling); else ``idle_wait_s``."""
        if self.has_work():
            return 0.0
        if self.transferring and not self.transfers.synchronous:
            return 0.001
        return idle_wait_s

    def reap(self) -> None:
        """Drop every entry whose row turned final elsewhere and free what it held; free handed-back blocks
        whose ``linger_s`` ran out."""
        if self.lingering:
            now_ns = self.clock()
            for key in [k for k, (_, deadline_ns) in self.lingering.items() if deadline_ns <= now_ns]:
                self._unlinger(key)
        for name in ("bootstrap", "transferring", "decode_waiting", "decoding"):
            entries, keep = getattr(self, name), []
            for entry in entries:   # one read per row: a row turning final between two reads must not be kept
                if self._live(entry.key):
                    keep.append(entry)
                else:
                    self._release(entry)
            if len(keep) != len(entries):
                setattr(self, name, keep)

    def start_transfers(self) -> None:
        """Reserve blocks for prompt + reserved output tokens in arrival order (the head waits in BOOTSTRAP while the
        pool is full; a child whose prompt blocks another child holds reserves only its own) and start pulling each
        request's KV (TRANSFERRING)."""
        bt = self.allocator.block_tokens
        while self.bootstrap:
            entry = self.bootstrap[0]
            ready = entry.ready
            key = prompt_key(ready, bt)
            shared = self.prompts.get(key) if key is not None else None
            needed = blocks_for(ready.num_tokens, ready.sampling.reserved_output_tokens, bt) - (
                len(shared.blocks) if shared else 0)
            try:
                own = self._allocate(needed, ready.slot)
            except OutOfKVBlocksError:
                return
            self.bootstrap.pop(0)
            row = self.table.read(*entry.key)
            if row is None or not self.table.transition(*entry.key, S.TRANSFERRING, owner=self.actor_index,
                                                        by="decode"):
                self.allocator.free(own, ready.slot)
                continue
            if key is not None and shared is None:   # the first holder: the prompt's full blocks come off its own
                full = ready.num_tokens // bt
                shared = self.prompts[key] = SharedPrompt(key, own[:full], ready.slot)
                own = own[full:]
            entry.shared = shared
            entry.blocks = (shared.blocks if shared is not None else []) + own
            if shared is not None:
                shared.holders.add(entry.key)
            handoffs = int(row["n_transfers"]) + (0 if self.transfers.local else 1)   # a copy inside one pool is none
            self.table.update(*entry.key, decode_blocks=len(entry.blocks), n_transfers=handoffs)
            entry.transfer_start_ns = self.clock()
            self._start_pull(entry)
            self.transferring.append(entry)

    def _start_pull(self, entry: DecodeEntry) -> None:
        """Start the transfer of every prompt block (unshared, or the first holder of a shared prompt: one transfer
        that fills the shared blocks and its own partial one), else of its partial last block alone (none when the
        prompt ends on a block boundary): the shared blocks are being pulled, or are in, already."""
        ready, shared = entry.ready, entry.shared
        src = list(ready.src_block_ids)
        if shared is None or (shared.pull is None and not shared.done):
            handle = self.transfers.start(ready.request_id, src, entry.blocks[:len(src)], ready.num_tokens,
                                          peer=ready.prefill_actor)
            if shared is None:
                entry.transfer_handle = handle
            else:
                shared.pull, shared.puller = handle, entry.key
            entry.pulled_blocks = len(src)
            return
        full = len(shared.blocks)
        if len(src) > full:
            entry.transfer_handle = self.transfers.start(
                ready.request_id, src[full:], entry.blocks[full:len(src)],
                ready.num_tokens - full * self.allocator.block_tokens, peer=ready.prefill_actor)
        entry.pulled_blocks = len(src) - full

    def poll_transfers(self) -> None:
        """Finished pulls move on to DECODE_WAITING (this role moves its own rows) and tell prefill; failed ones
        fail the request (503, retryable), a failed shared pull every holder of the prompt; blocks arriving renew
        the transfer deadline (a shared pull's, of every holder)."""
        pulling = {id(e.shared): e.shared for e in self.transferring if e.shared is not None}
        for shared in pulling.values():
            if shared.pull is not None:
                self._poll_shared(shared)
        keep = []
        for entry in self.transferring:
            shared = entry.shared
            failure = shared.failure if shared is not None else ""
            if not failure and entry.transfer_handle is not None:
                status, received = self.transfers.poll(entry.transfer_handle)
                if status == TransferStatus.IN_PROGRESS:
                    if received > entry.blocks_received:
                        entry.blocks_received = received
                        self._updates.append((*entry.key, {"last_progress_ns": self.clock()}))
                        record_request(EventKind.RENEWAL, entry.ready.request_id, *entry.key, aux=Renewal.BLOCKS,
                                       a=received)
                    keep.append(entry)
                    continue
                self.transfers.release(entry.transfer_handle)
                entry.transfer_handle = None
                if status != TransferStatus.DONE:
                    failure = _transfer_failure(status)
            if failure:
                self._fail(entry, 503, "engine_error", f"KV transfer (stage transfer) {failure}; retry the request")
            elif shared is not None and not shared.done:
                keep.append(entry)   # its own part is in; the shared prompt blocks are still arriving
            else:
                self._transfer_done(entry)
        self.transferring = keep

    def _poll_shared(self, shared: SharedPrompt) -> None:
        status, received = self.transfers.poll(shared.pull)
        if status == TransferStatus.IN_PROGRESS:
            if received > shared.received:
                shared.received = received
                now_ns = self.clock()
                self._updates.extend((*key, {"last_progress_ns": now_ns}) for key in shared.holders)
            return
        self.transfers.release(shared.pull)
        shared.pull = None
        if shared.parked:   # no transfer writes the departed puller's partial block any more
            self.allocator.free(shared.parked, shared.owner_slot)
            shared.parked = []
        if status == TransferStatus.DONE:
            shared.done = True
        else:
            shared.failure = _transfer_failure(status)

    def join_batch(self) -> list[DecodeEntry]:
        """Move waiting requests into the running batch (between steps) and emit their first token (sampled by
        prefill) at once: ``flush`` sends them before the shell runs the next decode step, which would hold them
        for a whole step (`python -m bench.colocated` times them). Returns the entries that joined the batch (the
        shell prepares their sampling state)."""
        joined = []
        while self.decode_waiting and len(self.decoding) < self.max_num_seqs:
            entry = self.decode_waiting.pop(0)
            if not self.table.transition(*entry.key, S.DECODING, owner=self.actor_index, by="decode"):
                self._release(entry)
                continue
            entry.position = entry.ready.num_tokens
            if not self._emit(entry, entry.ready.first_token, entry.ready.first_logprobs):
                self.decoding.append(entry)
                joined.append(entry)
        if self._items:
            self.flush()
        return joined

    def step_done(self, batch: list[DecodeEntry], tokens: list[int], logprobs: list) -> None:
        """The decode step over ``batch`` (``batch()`` of this iteration) sampled ``tokens`` (one per entry;
        ``logprobs`` the wire log-probabilities or None per entry)."""
        finished = set()
        for entry, token, lp in zip(batch, tokens, logprobs):
            entry.position += 1
            if self._emit(entry, int(token), lp):
                finished.add(id(entry))
        self.decoding = [e for e in self.decoding if id(e) not in finished]

    def batch(self) -> list[DecodeEntry]:
        """The running batch for one decode step: each entry's ``last_token`` at ``position`` over ``blocks``."""
        return list(self.decoding)

    def flush(self) -> None:
        """End of an iteration: write this step's table updates in one round trip, renew the rows waiting behind
        a batch that produced tokens, and send the step's tokens to the API."""
        if self._items:
            self._renew_waiting()
        if self._updates:
            self.table.update_many(self._updates)
            self._updates = []
        if self._items:
            self.outbox.send(API, TokenBatch(self._items))
            self._items = []

    def own_gauges(self) -> dict[str, int]:
        return {"running": len(self.decoding), "decode_transfer": len(self.transferring)}

    def stop(self) -> None:
        for entry in self.bootstrap + self.transferring + self.decode_waiting + self.decoding:
            self._release(entry)
        self.bootstrap, self.transferring, self.decode_waiting, self.decoding = [], [], [], []
        for key in list(self.lingering):
            self._unlinger(key)

    # ---- cross-turn reuse ---------------------------------------------------------------------------
    def _allocate(self, n: int, owner_slot: int) -> list[int]:
        """``allocator.allocate``, first freeing handed-back blocks (oldest first) if the pool is short."""
        while self.lingering and self.allocator.num_free < n:
            self._unlinger(next(iter(self.lingering)))
        return self.allocator.allocate(n, owner_slot)

    def _unlinger(self, key: Key) -> None:
        held = self.lingering.pop(key, None)
        if held is not None:
            self.allocator.free(held[0], HANDBACK_OWNER)

    def _try_hand_back(self, entry: DecodeEntry) -> bool:
        """``entry`` finished here: hand its prompt + answer KV back to its prefill actor. True if its blocks
        went (to the local prefill core, or lingering here for HandBackDone); False: ``_release`` it as usual."""
        ready, shared = entry.ready, entry.shared
        colocated = self.transfers.local
        if not self.hand_back or is_remote(ready.prefill_actor) or (ready.prefill_actor == LOCAL_PREFILL) != colocated:
            return False   # a remote prefill node's pool: out of reach
        if entry.transfer_handle is not None or (shared is not None and (
                shared.holders != {entry.key} or shared.owner_slot != ready.slot or not shared.done
                or shared.pull is not None or shared.parked)):
            return False   # a child of an ``n > 1`` request (its siblings hold the prompt, or one of them owns
            # its blocks: the last child to finish is not always the first), or a pull running
        bt = self.allocator.block_tokens
        kv_tokens = ready.num_tokens + entry.output_tokens - 1   # the last token emitted has no KV
        keep = -(-kv_tokens // bt)
        if kv_tokens < bt or keep > len(entry.blocks):
            return False
        blocks, rest = entry.blocks[:keep], entry.blocks[keep:]
        message = KVHandBack(ready.slot, ready.generation, LOCAL_DECODE if colocated else self.address,
                             entry.output_ids[:-1], blocks, self.allocator.generations(blocks))
        dest = ready.prefill_actor
        self.allocator.reassign(blocks, ready.slot, HANDBACK_OWNER)
        if not colocated:
            self.lingering[entry.key] = (blocks, self.clock() + self.linger_ns)
        if not self.outbox.try_send(dest, message):
            self.hand_backs_dropped += 1
            if colocated:
                self.allocator.free(blocks, HANDBACK_OWNER)
            else:
                self._unlinger(entry.key)
        if rest:
            self.allocator.free(rest, ready.slot)
        if shared is not None:
            shared.blocks, shared.holders = [], set()
            if self.prompts.get(shared.key) is shared:
                del self.prompts[shared.key]
        entry.shared, entry.blocks = None, []
        self._updates.append((*entry.key, {"decode_blocks": 0}))
        return True

    # ---- helpers ------------------------------------------------------------------------------------
    def _live(self, key: Key) -> bool:
        row = self.table.read(*key)
        return row is not None and int(row["state"]) in LIVE_STATES

    def _release(self, entry: DecodeEntry) -> None:
        """Free what ``entry`` holds, once: its transfer, its own blocks, its reference to a shared prompt (the
        last holder frees the prompt's blocks; the puller's partial block waits for a shared pull still running)."""
        if entry.transfer_handle is not None:
            self.transfers.release(entry.transfer_handle)
            entry.transfer_handle = None
        shared, entry.shared = entry.shared, None
        if entry.blocks:
            own = entry.blocks[len(shared.blocks):] if shared is not None else entry.blocks
            if shared is not None and shared.pull is not None and shared.puller == entry.key:
                cut = len(entry.ready.src_block_ids) - len(shared.blocks)
                shared.parked, own = own[:cut], own[cut:]
            if own:
                self.allocator.free(own, entry.ready.slot)
            entry.blocks = []
            self.table.update(*entry.key, decode_blocks=0)
        if shared is not None:
            shared.holders.discard(entry.key)
            if not shared.holders:
                self._drop(shared)

    def _drop(self, shared: SharedPrompt) -> None:
        """The last holder left: stop the pull if it still runs and free the prompt's blocks."""
        if shared.pull is not None:
            self.transfers.release(shared.pull)
            shared.pull = None
        self.allocator.free(shared.blocks + shared.parked, shared.owner_slot)
        shared.blocks, shared.parked = [], []
        if self.prompts.get(shared.key) is shared:
            del self.prompts[shared.key]

    def _fail(self, entry: DecodeEntry, http_status: int, error_type: str, message: str) -> None:
        if self.table.transition(*entry.key, S.FAILED, owner=self.actor_index, by="decode"):
            self.outbox.send(API, RequestError(*entry.key, http_status, error_type, message))
        self._release(entry)

    def _transfer_done(self, entry: DecodeEntry) -> None:
        ready = entry.ready
        entry.timings = {"queue_s": ready.queue_s, "prefill_s": ready.prefill_s,
                         "transfer_s": (self.clock() - entry.transfer_start_ns) / 1e9,
                         "transfer_bytes": 0 if self.transfers.local else entry.pulled_blocks * self.block_bytes,
                         "cached_tokens": ready.cached_tokens}
        record_request(EventKind.KV_HANDOFF, ready.request_id, *entry.key, a=int(entry.timings["transfer_bytes"]),
                       b=int(entry.timings["transfer_s"] * 1e9), c=len(ready.src_block_ids),
                       aux=int(self.transfers.local))
        self.outbox.send(ready.prefill_actor, TransferDone(*entry.key), ready.request_id)
        if self.table.transition(*entry.key, S.DECODE_WAITING, owner=self.actor_index, by="decode"):
            self.decode_waiting.append(entry)
        else:
            self._release(entry)

    def _finish_reason(self, entry: DecodeEntry, token: int) -> str | None:
        sampling = entry.ready.sampling
        if not sampling.ignore_eos and token in self.eos_ids:
            return "stop"
        if token in sampling.stop_token_ids or entry.grammar_done:
            return "stop"
        if entry.output_tokens >= sampling.max_tokens:
            return "length"
        if not self._room_for_next(entry):
            return "length"   # an answer without max_tokens reached what the pool can hold
        return None

    def _room_for_next(self, entry: DecodeEntry) -> bool:
        """Whether the next decode step can write ``entry``'s KV at ``position``: always when its blocks were
        reserved for all of max_tokens; else (a growing answer) after taking one more block when it needs one,
        False when the pool has none free."""
        bt = self.allocator.block_tokens
        if entry.position < len(entry.blocks) * bt:
            return True
        try:
            entry.blocks.extend(self._allocate(1, entry.ready.slot))
        except OutOfKVBlocksError:
            return False
        self._updates.append((*entry.key, {"decode_blocks": len(entry.blocks)}))
        return True

    def _emit(self, entry: DecodeEntry, token: int, logprobs: list | None) -> bool:
        """Record one generated token; returns True if the request ended (finished, or final elsewhere)."""
        entry.output_tokens += 1
        entry.output_ids.append(token)
        entry.last_token = token
        reason = self._finish_reason(entry, token)
        slot, generation = entry.key
        if reason is not None:
            if not self.table.transition(slot, generation, S.FINISHED, owner=self.actor_index, by="decode"):
                self._release(entry)
                return True
            self._updates.append((slot, generation, {"output_tokens": entry.output_tokens}))
            self.finished += 1
            if not self._try_hand_back(entry):
                self._release(entry)
        else:   # a token is progress: it renews the decode-stall deadline
            self._updates.append((slot, generation, {"output_tokens": entry.output_tokens,
                                                     "last_progress_ns": self.clock()}))
        item: list[Any] = [slot, generation, token, reason]
        extras = {}
        if entry.output_tokens == 1 and entry.timings is not None:
            extras["timings"] = entry.timings
        if logprobs is not None:
            extras["logprobs"] = logprobs
        if extras:
            item.append(extras)
        self._items.append(item)
        return reason is not None

    def _renew_waiting(self) -> None:
        """Tokens flowed, so the batch will free KV room and slots: renew the rows waiting for them (BOOTSTRAP:
        no room to reserve yet; DECODE_WAITING: no batch slot yet), at most once per renew interval."""
        now_ns = self.clock()
        if now_ns - self.renewed_ns < self.renew_interval_ns:
            return
        self.renewed_ns = now_ns
        self._updates.extend((*e.key, {"last_progress_ns": now_ns}) for e in self.bootstrap + self.decode_waiting)
        for e in self.bootstrap + self.decode_waiting:   # the flight recorder: what renewed them
            record_request(EventKind.RENEWAL, e.ready.request_id, *e.key, aux=Renewal.QUEUE, t_ns=now_ns)


def _transfer_failure(status: int) -> str:
    """How a transfer that ended other than DONE is named in the request's error."""
    return "failed" if status in TransferStatus.__members__.values() else f"reported the unknown status {status!r}"
