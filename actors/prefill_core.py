"""The prefill scheduler core: plain synchronous code over ports (actors/ports.py), no queue, torch or fault
code, and no clock of its own (time comes in as ``now_ns``); its one shm write is the flight recorder's
events (ipc/recorder.py, which stamps them). The shell (actors/prefill.py, or actors/decode.py in colocated
mode) feeds it messages, runs the forward pass it asks for and publishes its counts.

Batched prefill: each forward pass packs chunks of several prompts (``next_batch``), FIFO, up to
``batch_tokens`` prompt tokens and at most ``chunk_tokens`` of any one prompt, so a long prompt advances a chunk per
forward beside short ones and the shell beats its heartbeat and reads its inbox between forwards.

Rows it moves: QUEUED -> PREFILLING (blocks allocated, first chunk packed) -> BOOTSTRAP (KVReady sent; the row is
in the *prefill inflight queue*, its blocks held here). Decode moves the row on (TRANSFERRING, DECODE_WAITING).
An embedding (EmbedRequest) is queued, packed and chunked as any prompt and ends PREFILLING -> FINISHED with its
Embedding sent to the API (``finish_embedding``): no decode, its blocks released at once (into the prefix cache,
which may keep its KV), its deadlines and gauges those of a prompt.
Prefill frees its blocks once decode holds a copy: on TransferDone, or on seeing the row past TRANSFERRING (so
a lost TransferDone costs one loop iteration, not a pinned request), or when the row turns final; it records
the fact in the row (``prefill_blocks = 0``). Every path frees each block exactly once.

Prompt blocks go through the allocator's prefix cache (actors/prefix_cache.py ``CachingAllocator``): a request
reuses the cached blocks of its longest cached prefix (to the token: a hit ending mid-block is copied into its own
block inside ``acquire``) and prefills only the tokens after it; its blocks are cached once its forward pass is
done; "freeing" drops its references to cached blocks (kept until evicted). A watchdog drill's request (id
prefix ``DRILL_PREFIX``, api/drill.py) neither looks the cache up nor adds to it.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable

import numpy as np

from actors.messages import EmbedRequest, Embedding, HandBackDone, KVHandBack, KVReady, PrefillRequest, TransferDone
from actors.ports import AllocatorPort, Clock, OutboxPort, TablePort
from actors.prefix_cache import HANDBACK_OWNER, CachingAllocator, PromptBlocks
from actors.topology import API, LOCAL_DECODE, LOCAL_PREFILL
from ipc.lifecycle import LIVE_STATES, held_by
from ipc.lifecycle import RequestState as S
from ipc.recorder import EventKind, Renewal, record_request
from pdserve.errors import OutOfKVBlocksError
from pdserve.faults import DRILL_PREFIX   # the id prefix of watchdog drills (a naming rule, no fault code)

Key = tuple[int, int]   # (state-table slot, generation)
PREFILL_HELD = held_by("prefill")   # states in which prefill still holds a row's prompt KV (ipc/lifecycle.py)


def request_rows(request: PrefillRequest | EmbedRequest) -> list[Key]:
    """Every state-table row the request stands for: itself, then its ``n > 1`` children."""
    return [(request.slot, request.generation)] + [(int(s), int(g)) for s, g in request.children]


def child_sampling(sampling, index: int):
    """The sampling settings of child ``index`` of an ``n > 1`` request: a seeded request's children get the
    seeds ``seed, seed + 1, ...`` (as vLLM does), so each choice is reproducible and they differ."""
    if sampling.seed is None or index == 0:
        return sampling
    return dataclasses.replace(sampling, seed=(sampling.seed + index) % 2**63)


@dataclasses.dataclass
class SharedBlocks:
    """Prefill blocks that one or more rows (an ``n > 1`` request's children) hold together; released when the
    last holder leaves the inflight queue."""

    prompt: PromptBlocks
    holders: set

    @property
    def blocks(self) -> list[int]:
        return self.prompt.blocks


@dataclasses.dataclass(eq=False)   # identity: the core keeps and removes these by object
class PrefillWork:
    """One request being prefilled: ``request.prompt_ids`` into ``blocks`` (prompt KV) over one or more
    forward passes, then one first token sampled per entry of ``rows`` (``(child index, key)``, the rows still
    live when it started). ``done_tokens``: prompt tokens whose KV is written; it starts at ``cached_tokens``
    (that prefix's KV is in the blocks already, from the prefix cache). ``cache_tokens``: how many leading prompt
    tokens' KV the prefix cache may keep once it is complete (None: all; the shell sets one less when the prompt's
    last token ran as a decode step, whose KV a prefill of a longer prompt would not compute bit for bit)."""

    request: PrefillRequest | EmbedRequest
    prompt: PromptBlocks
    rows: list[tuple[int, Key]]
    start_ns: int
    created_ns: int
    chunks_done: int = 0
    done_tokens: int = 0
    cache_tokens: int | None = None
    uncached: bool = False   # a watchdog drill (api/drill.py): neither looked up in nor added to the prefix cache

    @property
    def blocks(self) -> list[int]:
        return self.prompt.blocks

    @property
    def cached_tokens(self) -> int:
        return self.prompt.cached_tokens

    @property
    def samplings(self) -> list:
        return [child_sampling(self.request.sampling, index) for index, _ in self.rows]

    @property
    def embedding(self) -> bool:
        """An EmbedRequest: pooled into an embedding by ``finish_embedding``, no first token, no decode."""
        return isinstance(self.request, EmbedRequest)


@dataclasses.dataclass
class PrefillChunk:
    """Prompt tokens ``start:end`` of ``work`` in the next forward pass; ``last``: the prompt ends with it (the
    shell samples the first tokens)."""

    work: PrefillWork
    start: int
    end: int

    @property
    def last(self) -> bool:
        return self.end == len(self.work.request.prompt_ids)


class PrefillCore:
    """Queue, block allocation, handoff and clean-up of one prefill role.

    ``on_late`` is called for a message about a request already cleaned up (counted by the shell).
    ``handoff_from``: the address KVReady names as the holder of the blocks (a decode actor pulls from that
    actor's pool and sends it TransferDone): this actor's name, or LOCAL_PREFILL in colocated mode. KVReady goes
    to the request's ``decode_actor`` address (actors/topology.py). ``batch_tokens``: most prompt tokens one forward
    pass packs; ``chunk_tokens``: most tokens of one prompt in it. ``allocator``: a CachingAllocator (its prefix
    cache on or off), or a plain allocator, which gets one with the cache off.
    ``hand_back_copy(decode_actor, src_ids, src_generations, dst_ids) -> bool``: copy blocks of that decode actor's
    pool into this pool, False if a source block's generation is not the one given (reallocated since); None:
    KVHandBacks from another pool are dropped. ``recent_prompts``: how many handed-off prompts it remembers.
    """

    def __init__(self, table: TablePort, allocator: AllocatorPort, outbox: OutboxPort, clock: Clock, *,
                 actor_index: int, renew_interval_s: float = 1.0, on_late: Callable[[], None] = lambda: None,
                 handoff_from: str = LOCAL_PREFILL, batch_tokens: int = 512, chunk_tokens: int = 128,
                 hand_back_copy: Callable[[int, list, list, list], bool] | None = None, recent_prompts: int = 256):
        if not isinstance(allocator, CachingAllocator):
            allocator = CachingAllocator(allocator, enabled=False)
        self.table, self.allocator, self.outbox, self.clock = table, allocator, outbox, clock
        self.actor_index = actor_index
        self.handoff_from = handoff_from
        self.renew_interval_ns = int(renew_interval_s * 1e9)
        self.on_late = on_late
        self.batch_tokens, self.chunk_tokens = batch_tokens, chunk_tokens
        self.queued: collections.deque[PrefillRequest] = collections.deque()
        self.prefilling: list[PrefillWork] = []   # begun (PREFILLING), prompt not yet done; in that order
        self.inflight: dict[Key, SharedBlocks] = {}   # rows whose prompt KV is held here (BOOTSTRAP/TRANSFERRING)
        self.blocked = False   # the head request waits for free blocks: do not spin on it
        self.handed_off = 0    # rows whose KVReady (or Embedding) it sent (a per-actor work counter)
        self.renewed_ns = 0
        self.hand_back_copy = hand_back_copy
        self.recent_prompts = recent_prompts
        self.recent: collections.OrderedDict[Key, np.ndarray] = collections.OrderedDict()   # handed off, oldest first
        self.hand_backs_dropped = 0   # KVHandBacks it could not cache (counted, never an error)

    # ---- events -------------------------------------------------------------------------------------
    def on_message(self, message: Any) -> bool:
        """A PrefillRequest, EmbedRequest, TransferDone or KVHandBack; returns False for any other message (the
        shell logs it)."""
        if isinstance(message, (PrefillRequest, EmbedRequest)):
            self.queued.append(message)
        elif isinstance(message, KVHandBack):
            self._hand_back(message)
        elif isinstance(message, TransferDone):
            key = (message.slot, message.generation)
            if key in self.inflight:
                self._free(key)
            else:   # the row turned final or moved on, and its blocks were freed already
                self.on_late()
        else:
            return False
        return True

    def has_work(self) -> bool:
        return bool(self.prefilling) or (bool(self.queued) and not self.blocked)

    def reap(self) -> None:
        """Drop queued requests whose rows all turned final, and prompts being prefilled whose rows all did
        (their blocks freed: the next forward pass leaves them out); free the blocks of inflight rows that
        turned final or that decode already moved past TRANSFERRING (it holds its own copy)."""
        if self.queued:
            self.queued = collections.deque(r for r in self.queued if any(self._live(k) for k in request_rows(r)))
        for work in [w for w in self.prefilling if not self.any_live(w)]:
            self.abandon(work)
        prefilling = {key for work in self.prefilling for _, key in work.rows}
        for key in list(self.inflight):
            if key in prefilling:
                continue
            row = self.table.read(*key)
            if row is None or int(row["state"]) not in PREFILL_HELD:   # final, or decode holds its own copy
                self._free(key)

    def next_batch(self) -> list[PrefillChunk]:
        """Plan the next forward pass: first the next chunk of every prompt being prefilled, then the queued
        requests in arrival order, each begun (blocks allocated, live rows PREFILLING) while the token budget
        lasts. A request that finds no free blocks stays QUEUED, and so do those behind it (FIFO) until inflight
        requests free blocks. Empty if there is nothing to do."""
        budget, chunks = self.batch_tokens, []
        for work in self.prefilling:
            if budget <= 0:
                break
            chunks.append(self._chunk(work, budget))
            budget -= chunks[-1].end - chunks[-1].start
        while budget > 0 and self.queued:
            work = self._begin(self.queued[0])
            if self.blocked:
                break
            self.queued.popleft()
            if work is not None:
                self.prefilling.append(work)
                chunks.append(self._chunk(work, budget))
                budget -= chunks[-1].end - chunks[-1].start
        return chunks

    def batch_done(self, chunks: list[PrefillChunk]) -> list[PrefillWork]:
        """A forward pass wrote ``chunks``' KV: renew their PREFILLING rows (the deadline measures a prefill that
        stopped moving, not a long prompt) and the QUEUED rows behind them (``renew_queued``: a prompt that takes
        longer than the queue deadline must not fail the queue), drop (and free) prompts whose rows all turned
        final meanwhile. Returns the prompts now complete: the shell samples their first tokens and calls
        ``finish``."""
        now_ns = self.clock()
        self.table.update_many([(*key, {"last_progress_ns": now_ns}) for c in chunks for _, key in c.work.rows])
        complete = []
        for chunk in chunks:
            work = chunk.work
            work.done_tokens, work.chunks_done = chunk.end, work.chunks_done + 1
            for _, key in work.rows:   # the flight recorder: the chunk, which renewed the row's deadline
                record_request(EventKind.PREFILL_CHUNK, work.request.request_id, *key, a=chunk.end - chunk.start,
                               b=chunk.end, t_ns=now_ns)
            if not self.any_live(work):
                self.abandon(work)
            elif chunk.last:
                complete.append(work)
        if chunks:
            self.renew_queued()
        return complete

    def _chunk(self, work: PrefillWork, budget: int) -> PrefillChunk:
        left = len(work.request.prompt_ids) - work.done_tokens
        return PrefillChunk(work, work.done_tokens, work.done_tokens + min(left, self.chunk_tokens, budget))

    def _begin(self, request: PrefillRequest | EmbedRequest) -> PrefillWork | None:
        """Allocate ``request``'s prompt blocks and move its live rows to PREFILLING. None (and ``blocked``) if
        no blocks are free; None if no row is live any more."""
        # echo with logprobs needs every prompt position's logits, an embedding every position's hidden state (and
        # the same numbers whatever was cached before): no cached prefix
        fresh = isinstance(request, EmbedRequest) or request.sampling.prompt_logprobs is not None
        drill = request.request_id.startswith(DRILL_PREFIX)   # the engine's own test request: leaves no trace
        fresh = fresh or drill
        try:
            prompt = self.allocator.acquire(request.prompt_ids, request.slot, use_cache=not fresh)
        except OutOfKVBlocksError:
            self.blocked = True
            return None
        self.blocked = False
        shared = SharedBlocks(prompt, set())
        blocks = prompt.blocks
        rows = []
        for index, key in enumerate(request_rows(request)):
            if self.table.transition(*key, S.PREFILLING, owner=self.actor_index, by="prefill"):
                rows.append((index, key))
                shared.holders.add(key)
                self.inflight[key] = shared
                self.table.update(*key, prefill_blocks=len(blocks))
        if not rows:
            self.allocator.release(prompt)
            return None
        row = self.table.read(*rows[0][1])
        now_ns = self.clock()
        if prompt.cached_tokens:
            for _, key in rows:
                record_request(EventKind.CACHE_HIT, request.request_id, *key, a=prompt.cached_tokens)
        return PrefillWork(request, prompt, rows, now_ns, int(row["created_ns"]) if row else now_ns,
                           done_tokens=prompt.cached_tokens, uncached=drill)

    def any_live(self, work: PrefillWork) -> bool:
        return any(self._live(key) for _, key in work.rows)

    def finish(self, work: PrefillWork, firsts: list[tuple[int, list | None]]) -> None:
        """The forward pass ended with each row's first token (``(token_id, wire logprobs or None)`` per entry
        of ``work.rows``): move each live row to BOOTSTRAP and send decode its KVReady."""
        self.prefilling.remove(work)
        if not work.uncached:   # its KV is complete: later prompts may reuse it
            self.allocator.commit(work.prompt, work.cache_tokens)
        request = work.request
        now_ns = self.clock()
        queue_s, prefill_s = (work.start_ns - work.created_ns) / 1e9, (now_ns - work.start_ns) / 1e9
        for (_, key), sampling, (token, logprobs) in zip(work.rows, work.samplings, firsts):
            if not self.table.transition(*key, S.BOOTSTRAP, owner=self.actor_index, by="prefill"):
                self._free(key)
                continue
            history = request.prompt_ids if sampling.repetition_penalty != 1.0 else []
            self.outbox.send(request.decode_actor, KVReady(key[0], key[1], request.request_id, work.blocks,
                                           len(request.prompt_ids), token, sampling, queue_s, prefill_s,
                                           logprobs, history, self.handoff_from, work.cached_tokens,
                                           prompt_row=[request.slot, request.generation]),
                             request.request_id)
            self.handed_off += 1
            if self.allocator.enabled and not request.children:   # its KVHandBack may come: remember the prompt
                self.recent[key] = np.asarray(request.prompt_ids, dtype=np.int32)   # 4 bytes a token
                if len(self.recent) > self.recent_prompts:
                    self.recent.popitem(last=False)
        self.renew_queued()

    def finish_embedding(self, work: PrefillWork, data: str) -> None:
        """An embedding's forward passes are done and pooled (``data``: actors.messages.Embedding's base64): its
        blocks go (``commit`` first: the prefix cache may keep the prompt's KV; every token of it was prefilled),
        its live row moves PREFILLING -> FINISHED and the API gets the Embedding. A row that turned final meanwhile
        (deadline, client gone) gets nothing; whoever ended it told the API."""
        self.prefilling.remove(work)
        self.allocator.commit(work.prompt, work.cache_tokens)
        for _, key in work.rows:
            finished = self.table.transition(*key, S.FINISHED, owner=self.actor_index, by="prefill")
            self._free(key)
            if finished:
                self.outbox.send(API, Embedding(key[0], key[1], data), work.request.request_id)
                self.handed_off += 1
        self.renew_queued()

    def _hand_back(self, message: KVHandBack) -> None:
        """Cache a finished request's prompt + answer KV (``message``), or drop it (counted); blocks of this very
        pool (colocated: ``decode_actor`` LOCAL_DECODE, held by HANDBACK_OWNER) are cached or freed here, another pool's
        are copied and that decode actor gets HandBackDone either way."""
        local = message.decode_actor == LOCAL_DECODE
        prompt = self.recent.pop((message.slot, message.generation), None)
        added = None
        bt = self.allocator.block_tokens
        if prompt is not None:
            tokens = prompt.tolist() + list(message.output_ids)
            if len(message.block_ids) == -(-len(tokens) // bt) == len(message.block_generations):
                if local:
                    added = self.allocator.adopt(tokens, message.block_ids, HANDBACK_OWNER)
                elif self.hand_back_copy is not None:
                    generation = dict(zip(message.block_ids, message.block_generations))
                    added = self.allocator.adopt(
                        tokens, message.block_ids, message.slot,
                        copy=lambda src, dst: self.hand_back_copy(message.decode_actor, src,
                                                                  [generation[b] for b in src], dst))
        if added is None:
            self.hand_backs_dropped += 1
            if local:
                self.allocator.free(message.block_ids, HANDBACK_OWNER)
        if not local:
            self.outbox.send(message.decode_actor, HandBackDone(message.slot, message.generation))

    def abandon(self, work: PrefillWork) -> None:
        """Stop prefilling ``work`` (every row turned final between chunks): free its blocks."""
        if work in self.prefilling:
            self.prefilling.remove(work)
        for _, key in work.rows:
            self._free(key)

    def renew_queued(self) -> None:
        """The queue moves (a forward pass of prefill ran, or in colocated mode tokens flowed): renew the QUEUED
        rows waiting here, at most once per renew interval, so their queue deadline measures an actor that stopped
        taking requests, not a long queue under load."""
        now_ns = self.clock()
        if not self.queued or now_ns - self.renewed_ns < self.renew_interval_ns:
            return
        self.renewed_ns = now_ns
        self.table.update_many([(*key, {"last_progress_ns": now_ns})
                                for request in self.queued for key in request_rows(request)])
        for request in self.queued:   # the flight recorder: what renewed them
            for key in request_rows(request):
                record_request(EventKind.RENEWAL, request.request_id, *key, aux=Renewal.QUEUE, t_ns=now_ns)

    def own_gauges(self) -> dict[str, int]:
        """This role's own counts, cross-checked by the monitor against the table: QUEUED rows, rows in the
        inflight queue (held blocks, minus the rows being prefilled now) and PREFILLING rows."""
        prefilling = sum(len(work.rows) for work in self.prefilling)
        return {"queued": sum(1 + len(r.children) for r in self.queued),
                "prefill_inflight": len(self.inflight) - prefilling, "running": prefilling}

    def stop(self) -> None:
        """Free everything held (the actor stops; queued requests are failed by the supervisor)."""
        self.prefilling = []
        for key in list(self.inflight):
            self._free(key)

    # ---- helpers ------------------------------------------------------------------------------------
    def _live(self, key: Key) -> bool:
        row = self.table.read(*key)
        return row is not None and int(row["state"]) in LIVE_STATES

    def _free(self, key: Key) -> None:
        shared = self.inflight.pop(key, None)
        if shared is None:
            return
        self.table.update(*key, prefill_blocks=0)
        shared.holders.discard(key)
        if not shared.holders:   # the last row holding the prompt's KV has left the inflight queue
            self.allocator.release(shared.prompt)
