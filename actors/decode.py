"""DecodeActor: owns one device; pulls prompts' KV from the prefill pool and decodes with continuous batching.

Per request: KVReady arrives (row BOOTSTRAP) -> reserve blocks for prompt + max_tokens -> TRANSFERRING
(pull through the KVTransport) -> DONE: TransferDone to prefill, which frees its blocks and moves the row
to DECODE_WAITING (the request leaves the prefill inflight queue only then) -> admitted into the running
batch (DECODING) between steps -> one token per step -> FINISHED (EOS, stop token, max_tokens).
Requests join and leave the batch between steps. A row that turns final elsewhere (client abort, stop
string seen by the API, monitor timeout) is noticed on the next iteration and its blocks freed once.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from actors.base import DECODE_INDEX, Actor
from actors.messages import KVReady, PrefillRequest, RequestError, TokenBatch, TransferDone, parse_frames, to_wire
from actors.prefill import (apply_actor_faults, child_sampling, chunked_prefill, first_tokens, logprobs_to_wire,
                            request_rows, sampling_params, send_prompt_logprobs)
from pdserve.faults import FaultPlan
from ipc.state_table import LIVE_STATES

log = logging.getLogger("pdserve.decode")

RENEW_INTERVAL_S = 1.0   # how often rows waiting behind a progressing batch get their stage deadline renewed


@dataclass
class DecodeEntry:
    """A request held by the decode actor."""

    ready: KVReady
    blocks: list[int] = field(default_factory=list)
    position: int = 0          # position of ``last_token``, whose KV is not in the pool yet
    last_token: int = 0
    output_tokens: int = 0
    params: Any = None
    generator: Any = None
    transfer_handle: int | None = None
    stuck_status: int | None = None   # fault injection: the status the transport is made to report
    transfer_start_ns: int = 0
    timings: dict | None = None       # stage timings, sent with the first token
    output_ids: list[int] = field(default_factory=list)   # generated so far (penalties count them)

    @property
    def key(self) -> tuple[int, int]:
        return (self.ready.slot, self.ready.generation)


class DecodeActor(Actor):
    role = "decode"

    def __init__(self, layout, index: int = DECODE_INDEX):
        super().__init__(layout, index)

    def on_start(self) -> None:
        from gpu.model import LlamaModel
        from gpu.sampling import Sampler
        from ipc.kv_pool import KVPool
        from ipc.kv_transport import make_transport
        from ipc.shm_queue import ShmQueue
        from ipc.state_table import RequestState, StateTable

        import torch

        torch.set_num_threads(self.config.torch_threads)
        self.S = RequestState
        self.model = LlamaModel.from_path(self.layout.model_path or None, device=self.config.device,
                                          progress=False)
        self.eos_ids = set(self.model.config.eos_token_ids)
        self.pool = KVPool.attach(self.layout.segment("kv_decode"))
        self.pool.reset()
        self.kv = self.pool.tensor()
        self.transport = make_transport(self.config.kv_transport, self.pool)
        if not self.config.colocated:  # colocated: this actor prefills into its own pool, nothing to pull
            self.transport.open_peer(self.layout.segment("kv_prefill"))
        self.block_bytes = self.kv[:, :, 0].numel() * self.kv.element_size()  # K and V, all layers
        self.inbox = ShmQueue.attach(self.layout.segment("q_decode"))
        self.to_prefill = ShmQueue.attach(self.layout.segment("q_prefill"))
        self.to_api = ShmQueue.attach(self.layout.segment("q_api"))
        self.table = StateTable.attach(self.layout.segment("state"))
        self.sampler = Sampler()
        self.faults = FaultPlan(self.config.faults, self.name)
        self.prefill_waiting: list[PrefillRequest] = []   # colocated mode only
        self.prefill_blocked = False
        self.bootstrapping: list[DecodeEntry] = []
        self.transferring: list[DecodeEntry] = []
        self.handed_off: list[DecodeEntry] = []      # TransferDone sent; waiting for DECODE_WAITING
        self.delayed_done: list[tuple[float, DecodeEntry]] = []  # fault: TransferDone sent later
        self.waiting: list[DecodeEntry] = []
        self.running: list[DecodeEntry] = []
        self.renewed_ns = 0   # last renew_queued()
        self._publish_pool()

    def _publish_pool(self) -> None:
        self.actors.set(self.index, kv_blocks_total=self.pool.num_blocks, kv_blocks_free=self.pool.num_free)

    def _wait_s(self) -> float:
        """How long to block on the inbox: not at all with a batch to run, briefly while transfers are
        pending, else the idle wait. Never 0 without work, so a stuck transfer does not spin a core."""
        if self.running or (self.waiting and len(self.running) < self.config.max_num_seqs):
            return 0.0
        if self.prefill_waiting and not self.prefill_blocked:
            return 0.0
        if self.transferring or self.handed_off or self.delayed_done:
            return 0.005
        return self.idle_wait_s

    # ---- loop ---------------------------------------------------------------------------------------
    def run_once(self) -> None:
        for message in parse_frames(self.inbox.get_many(64, self._wait_s()), log):
            if isinstance(message, KVReady):
                self.receive(message)
            elif isinstance(message, PrefillRequest) and self.config.colocated:
                self.prefill_waiting.append(message)
            else:
                log.warning("decode: unexpected message %r dropped", message)
        self.reap_final()
        if self.prefill_waiting:
            self.prefill_here()
        self.bootstrap()
        self.poll_transfers()
        self.send_delayed_done()
        self.collect_handed_off()
        items: list[list[Any]] = []
        self.admit(items)
        self.step(items)
        if items:
            self.to_api.put(to_wire(TokenBatch(items)))
            self.renew_queued()
        self.status.set_own_gauges(self.index, running=len(self.running),
                                   decode_transfer=len(self.transferring) + len(self.handed_off)
                                   + len(self.delayed_done))

    def renew_queued(self) -> None:
        """Tokens flowed this iteration, so the running batch will free KV room and batch slots: renew the rows
        waiting for them (BOOTSTRAP: no room to reserve yet; DECODE_WAITING: no batch slot yet), at most once
        per RENEW_INTERVAL_S. Their stage deadline then measures "nobody is making room", not plain queueing
        under load (actors/watchdog.py)."""
        now_ns = time.monotonic_ns()
        if now_ns - self.renewed_ns < RENEW_INTERVAL_S * 1e9:
            return
        self.renewed_ns = now_ns
        for entry in self.bootstrapping + self.waiting:
            self.table.update(*entry.key, last_progress_ns=now_ns)
        for request in self.prefill_waiting:   # colocated mode: QUEUED rows waiting for this actor's pool
            for key in request_rows(request):
                self.table.update(*key, last_progress_ns=now_ns)

    def receive(self, ready: KVReady) -> None:
        rid = ready.request_id
        apply_actor_faults(self.faults, self.name, rid)
        if self.faults.fires("bootstrap_silent", rid):
            log.warning("fault bootstrap_silent: ignoring KVReady for slot %d", ready.slot)
            return
        if self.faults.fires("decode_reject", rid):
            log.warning("fault decode_reject: dropping slot %d", ready.slot)
            if self.table.transition(ready.slot, ready.generation, self.S.FAILED, owner=self.index):
                self.to_api.put(to_wire(RequestError(ready.slot, ready.generation, 503, "engine_error",
                                                     "the decode actor dropped the request; retry it")))
            return
        self.bootstrapping.append(DecodeEntry(ready=ready))

    def _row_live(self, slot: int, generation: int) -> bool:
        row = self.table.read(slot, generation)
        return row is not None and int(row["state"]) in LIVE_STATES

    def _is_live(self, entry: DecodeEntry) -> bool:
        return self._row_live(*entry.key)

    def _release(self, entry: DecodeEntry) -> None:
        if entry.transfer_handle is not None:
            self.transport.release(entry.transfer_handle)
            entry.transfer_handle = None
        if entry.blocks:
            self.pool.free(entry.blocks, entry.ready.slot)
            entry.blocks = []
            self.table.update(*entry.key, decode_blocks=0)
            self._publish_pool()

    def prefill_here(self) -> None:
        """Colocated mode: prefill the oldest queued request straight into this actor's pool; the request then
        passes BOOTSTRAP, TRANSFERRING and DECODE_WAITING at once (there is no handoff) and waits for a batch slot.
        The children of an ``n > 1`` request each get blocks for prompt + max_tokens; the prompt runs once and its
        KV blocks are copied to the other children."""
        import torch

        from pdserve.errors import OutOfKVBlocksError

        request = self.prefill_waiting[0]
        needed = math.ceil((len(request.prompt_ids) + request.sampling.max_tokens) / self.pool.block_tokens)
        rows: list[tuple[int, tuple[int, int], list[int]]] = []   # (child index, key, blocks)
        try:
            for index, key in enumerate(request_rows(request)):
                rows.append((index, key, self.pool.allocate(needed, key[0])))
        except OutOfKVBlocksError:
            for _, key, blocks in rows:
                self.pool.free(blocks, key[0])
            self.prefill_blocked = True  # waits for running requests to finish
            return
        self.prefill_blocked = False
        self.prefill_waiting.pop(0)
        live = []
        for index, key, blocks in rows:
            if self.table.transition(*key, self.S.PREFILLING, owner=self.index):
                self.table.update(*key, decode_blocks=len(blocks))
                live.append((index, key, blocks))
            else:
                self.pool.free(blocks, key[0])
        self._publish_pool()
        if not live:
            return
        start_ns = time.monotonic_ns()
        first_blocks = live[0][2]
        top_n = request.sampling.prompt_logprobs
        prompt_entries = [] if top_n is not None else None
        logits = chunked_prefill(self.model, self.kv, request.prompt_ids, first_blocks,
                                 self.config.prefill_chunk_tokens, lambda: any(self._row_live(*k) for _, k, _ in live),
                                 lambda: self.actors.beat(self.index, iterations_delta=0), top_n, prompt_entries)
        prefill_s = (time.monotonic_ns() - start_ns) / 1e9
        row = self.table.read(*live[0][1])
        if logits is None or row is None:
            for _, key, blocks in live:
                self.pool.free(blocks, key[0])
                self.table.update(*key, decode_blocks=0)
            self._publish_pool()
            return
        prompt_blocks = math.ceil(len(request.prompt_ids) / self.pool.block_tokens)
        src = torch.tensor(first_blocks[:prompt_blocks], dtype=torch.long)
        for _, _, blocks in live[1:]:   # the other children start from the same prompt KV
            self.kv[:, :, blocks[:prompt_blocks]] = self.kv.index_select(2, src)
        samplings = [child_sampling(request.sampling, index) for index, _, _ in live]
        firsts = first_tokens(self.sampler, logits, request.prompt_ids, samplings)
        if prompt_entries is not None:
            send_prompt_logprobs(self.to_api, *live[0][1], prompt_entries, top_n)
        queue_s = (start_ns - int(row["created_ns"])) / 1e9
        for (_, key, blocks), sampling, (token, logprobs) in zip(live, samplings, firsts):
            history = request.prompt_ids if sampling.repetition_penalty != 1.0 else []
            entry = DecodeEntry(ready=KVReady(key[0], key[1], request.request_id, [], len(request.prompt_ids), token,
                                              sampling, queue_s, prefill_s, logprobs, history), blocks=blocks)
            entry.timings = {"queue_s": queue_s, "prefill_s": prefill_s, "transfer_s": 0.0, "transfer_bytes": 0}
            if all(self.table.transition(*key, state, owner=self.index)
                   for state in (self.S.BOOTSTRAP, self.S.TRANSFERRING, self.S.DECODE_WAITING)):
                self.waiting.append(entry)
            else:
                self._release(entry)

    def reap_final(self) -> None:
        if self.prefill_waiting:
            self.prefill_waiting = [r for r in self.prefill_waiting
                                    if any(self._row_live(*key) for key in request_rows(r))]
        keep_delayed = []
        for due_s, entry in self.delayed_done:
            if self._is_live(entry):
                keep_delayed.append((due_s, entry))
            else:
                self._release(entry)
        self.delayed_done = keep_delayed
        for name in ("bootstrapping", "transferring", "handed_off", "waiting", "running"):
            entries = getattr(self, name)
            keep = []
            for entry in entries:
                if self._is_live(entry):
                    keep.append(entry)
                else:
                    self._release(entry)
            setattr(self, name, keep)

    def bootstrap(self) -> None:
        """Reserve blocks for prompt + max_tokens, in arrival order, and start pulling the KV."""
        from ipc.kv_transport import TransferStatus
        from pdserve.errors import OutOfKVBlocksError

        while self.bootstrapping:
            entry = self.bootstrapping[0]
            ready = entry.ready
            needed = math.ceil((ready.num_tokens + ready.sampling.max_tokens) / self.pool.block_tokens)
            try:
                entry.blocks = self.pool.allocate(needed, ready.slot)
            except OutOfKVBlocksError:
                return  # stays in BOOTSTRAP until running requests finish
            self.bootstrapping.pop(0)
            if not self.table.transition(ready.slot, ready.generation, self.S.TRANSFERRING, owner=self.index):
                self._release(entry)
                continue
            row = self.table.read(*entry.key)
            self.table.update(*entry.key, decode_blocks=len(entry.blocks),
                              n_transfers=int(row["n_transfers"]) + 1 if row else 1)
            self._publish_pool()
            src = list(ready.src_block_ids)
            entry.transfer_start_ns = time.monotonic_ns()
            entry.transfer_handle = self.transport.start_copy(src, entry.blocks[:len(src)],
                                                              num_tokens=ready.num_tokens)
            if self.faults.fires("transfer_stuck", ready.request_id):
                entry.stuck_status = int(TransferStatus.IN_PROGRESS)
            elif self.faults.fires("transfer_unknown_status", ready.request_id):
                entry.stuck_status = 7  # a value TransferStatus does not define
            self.transferring.append(entry)

    def poll_transfers(self) -> None:
        from ipc.kv_transport import TransferStatus

        keep = []
        for entry in self.transferring:
            status = self.transport.poll(entry.transfer_handle)
            if entry.stuck_status is not None:
                status = entry.stuck_status
            if status == TransferStatus.IN_PROGRESS:
                keep.append(entry)
                continue
            self.transport.release(entry.transfer_handle)
            entry.transfer_handle = None
            slot, generation = entry.key
            if status == TransferStatus.DONE:
                entry.timings = {"queue_s": entry.ready.queue_s, "prefill_s": entry.ready.prefill_s,
                                 "transfer_s": (time.monotonic_ns() - entry.transfer_start_ns) / 1e9,
                                 "transfer_bytes": len(entry.ready.src_block_ids) * self.block_bytes}
                self.complete_transfer(entry)
                continue
            known = status in TransferStatus.__members__.values()
            reason = "failed" if known else f"reported the unknown status {status!r}"
            log.error("KV transfer for slot %d %s", slot, reason)
            if self.table.transition(slot, generation, self.S.FAILED, owner=self.index):
                self.to_api.put(to_wire(RequestError(slot, generation, 503, "engine_error",
                                                     f"KV transfer (stage transfer) {reason}; retry the request")))
            self._release(entry)
        self.transferring = keep

    def complete_transfer(self, entry: DecodeEntry) -> None:
        """Tell prefill the KV is here; the row moves on when prefill has freed its blocks."""
        self.handed_off.append(entry)
        if self.faults.fires("drop_transfer_done", entry.ready.request_id):
            log.warning("fault drop_transfer_done: TransferDone for slot %d dropped", entry.ready.slot)
            return
        fault = self.faults.fires("delay_transfer_done", entry.ready.request_id)
        if fault is not None:
            self.handed_off.remove(entry)
            self.delayed_done.append((time.monotonic() + fault.number("seconds"), entry))
            return
        self.to_prefill.put(to_wire(TransferDone(*entry.key)))

    def send_delayed_done(self) -> None:
        now = time.monotonic()
        due = [(t, e) for t, e in self.delayed_done if t <= now]
        if due:
            self.delayed_done = [(t, e) for t, e in self.delayed_done if t > now]
            for _, entry in due:
                self.handed_off.append(entry)
                self.to_prefill.put(to_wire(TransferDone(*entry.key)))

    def collect_handed_off(self) -> None:
        """Requests whose row prefill moved to DECODE_WAITING join the admission queue."""
        keep = []
        for entry in self.handed_off:
            row = self.table.read(*entry.key)
            if row is not None and int(row["state"]) == self.S.DECODE_WAITING:
                self.waiting.append(entry)
            else:
                keep.append(entry)
        self.handed_off = keep

    def _finish_reason(self, entry: DecodeEntry, token: int) -> str | None:
        params = entry.params
        if not params.ignore_eos and token in self.eos_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if entry.output_tokens >= params.max_tokens:
            return "length"
        return None

    def _emit(self, entry: DecodeEntry, token: int, items: list[list[Any]], logprobs: list | None = None) -> bool:
        """Record one generated token (``logprobs``: its wire log-probabilities, if asked for); returns True if
        the request finished (and was released)."""
        entry.output_tokens += 1
        entry.output_ids.append(token)
        entry.last_token = token
        reason = self._finish_reason(entry, token)
        slot, generation = entry.key
        if reason is not None:
            if not self.table.transition(slot, generation, self.S.FINISHED, owner=self.index):
                self._release(entry)
                return True
            self.table.update(slot, generation, output_tokens=entry.output_tokens)
            self._release(entry)
        else:  # a token is progress: it renews the decode-stall deadline
            self.table.update(slot, generation, output_tokens=entry.output_tokens, last_progress_ns=time.monotonic_ns())
        item = [slot, generation, token, reason]
        extras = {}
        if entry.output_tokens == 1 and entry.timings is not None:
            extras["timings"] = entry.timings
        if logprobs is not None:
            extras["logprobs"] = logprobs
        if extras:
            item.append(extras)
        items.append(item)
        return reason is not None

    def admit(self, items: list[list[Any]]) -> None:
        """Move waiting requests into the running batch (between steps) and emit their first token."""
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            entry = self.waiting.pop(0)
            ready = entry.ready
            if not self.table.transition(ready.slot, ready.generation, self.S.DECODING, owner=self.index):
                self._release(entry)
                continue
            entry.params = sampling_params(ready.sampling)
            if entry.params.seed is not None:
                from gpu.sampling import make_generator

                entry.generator = make_generator((entry.params.seed + 1) % 2**63)  # prefill used `seed`
            entry.position = ready.num_tokens
            if not self._emit(entry, ready.first_token, items, ready.first_logprobs):
                self.running.append(entry)

    def step(self, items: list[list[Any]]) -> None:
        """One batched decode step over every running request."""
        from gpu.sampling import token_logprobs

        if not self.running:
            return
        batch = self.running
        logits = self.model.decode(self.kv, [e.last_token for e in batch], [e.position for e in batch],
                                   [e.blocks for e in batch])
        params = [e.params for e in batch]
        histories = [(e.ready.prompt_ids, e.output_ids) if p.has_penalties else None for e, p in zip(batch, params)]
        tokens = self.sampler.sample(logits, params, [e.generator for e in batch], histories)
        if any(p.logprobs is not None for p in params):
            logprobs = [logprobs_to_wire(lp) for lp in token_logprobs(logits, tokens, [p.logprobs for p in params])]
        else:
            logprobs = [None] * len(batch)
        keep = []
        for entry, token, lp in zip(batch, tokens, logprobs):
            entry.position += 1
            if not self._emit(entry, int(token), items, lp):
                keep.append(entry)
        self.running = keep

    def on_stop(self) -> None:
        delayed = [e for _, e in self.delayed_done]
        for entry in self.bootstrapping + self.transferring + self.handed_off + delayed + self.waiting + self.running:
            self._release(entry)
