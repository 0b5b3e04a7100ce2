"""PrefillActor: owns one device; computes prompts' KV into its pool and hands it to the decode actor.

Per request: QUEUED -(blocks allocated, forward run)-> PREFILLING -> BOOTSTRAP (KVReady sent; the request
is now in the *prefill inflight queue*, its blocks held here) -> decode reserves room and pulls the blocks
(TRANSFERRING) -> TransferDone -> blocks freed here, row DECODE_WAITING: the request leaves the inflight
queue only when that completion message arrives. Whenever a request's row turns final (timeout, abort,
failure) the actor frees what it holds for it on its next loop iteration, with or without traffic: cleanup
never waits for new requests.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import time

from actors.base import PREFILL_INDEX, Actor
from actors.messages import KVReady, PrefillRequest, PromptLogprobs, TransferDone, parse_frames, to_wire
from pdserve.faults import FaultPlan
from ipc.state_table import LIVE_STATES

log = logging.getLogger("pdserve.prefill")

RENEW_INTERVAL_S = 1.0   # how often QUEUED rows behind a moving prefill queue get their queue deadline renewed


def chunked_prefill(model, kv, ids: list[int], blocks: list[int], chunk_tokens: int, is_live, beat,
                    prompt_top_n: int | None = None, prompt_entries: list | None = None):
    """Run a prompt through ``model.prefill`` in chunks of ``chunk_tokens``, writing its KV at ``blocks``;
    between chunks call ``beat()`` and stop early (return None) once ``is_live()`` is False (aborted or timed
    out meanwhile). Returns the last position's logits ``[vocab]``.

    With ``prompt_entries`` (a list), every chunk's logits ``[T, vocab]`` are kept long enough to append each
    prompt token's wire log-probabilities (``prompt_top_n`` alternatives; None for position 0) to it.
    """
    logits = None
    for start in range(0, len(ids), chunk_tokens):
        if start and not is_live():
            return None
        chunk = ids[start:start + chunk_tokens]
        if prompt_entries is None:
            logits = model.prefill(kv, chunk, blocks, start_pos=start)
        else:
            chunk_logits = model.prefill(kv, chunk, blocks, start_pos=start, all_logits=True)  # [T, vocab]
            prompt_entries.extend(_prompt_logprobs_of_chunk(logits, chunk_logits, chunk, prompt_top_n or 0))
            logits = chunk_logits[-1]
        beat()
    return logits


def _prompt_logprobs_of_chunk(before, chunk_logits, chunk: list[int], top_n: int) -> list:
    """Wire log-probabilities of ``chunk``'s tokens: token ``i`` is scored by the logits of the position before
    it (``before``, the previous chunk's last logits ``[vocab]``, for the chunk's first token; None = the
    prompt's first token, which has no score)."""
    import torch

    from gpu.sampling import token_logprobs

    entries = [] if before is not None else [None]
    rows = chunk_logits[:-1] if before is None else torch.cat([before[None, :], chunk_logits[:-1]])
    targets = chunk[1:] if before is None else chunk
    if targets:
        entries.extend(logprobs_to_wire(lp) for lp in token_logprobs(rows, targets, [top_n] * len(targets)))
    return entries


def send_prompt_logprobs(queue, slot: int, generation: int, entries: list, top_n: int) -> None:
    """Send a prompt's log-probabilities to the API as PromptLogprobs frames of at most ~48 KiB each."""
    per_frame = max(1, 49152 // (32 * (top_n + 1) + 24))
    for start in range(0, len(entries), per_frame):
        queue.put(to_wire(PromptLogprobs(slot, generation, start, entries[start:start + per_frame])))


def apply_actor_faults(faults, actor_name: str, request_id: str) -> None:
    """Injected actor faults, checked when an actor takes a request: ``stall`` blocks the loop (a hang the
    monitor must detect), ``crash`` ends the process abruptly (a dead actor the supervisor restarts)."""
    stall = faults.fires("stall", request_id)
    if stall is not None:
        log.warning("fault stall: %s blocks for %.1f s", actor_name, stall.number("seconds"))
        time.sleep(stall.number("seconds"))
    if faults.fires("crash", request_id):
        log.warning("fault crash: %s exits now", actor_name)
        os._exit(70)


def sampling_params(sampling):
    """Convert a wire Sampling into gpu.sampling.SamplingParams."""
    from gpu.sampling import SamplingParams

    return SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                          min_p=sampling.min_p, seed=sampling.seed, max_tokens=sampling.max_tokens,
                          stop_token_ids=tuple(sampling.stop_token_ids), ignore_eos=sampling.ignore_eos,
                          presence_penalty=sampling.presence_penalty, frequency_penalty=sampling.frequency_penalty,
                          repetition_penalty=sampling.repetition_penalty, logprobs=sampling.logprobs)


def request_rows(request: PrefillRequest) -> list[tuple[int, int]]:
    """Every state-table row the request stands for: itself, then its ``n > 1`` children."""
    return [(request.slot, request.generation)] + [(int(s), int(g)) for s, g in request.children]


def child_sampling(sampling, index: int):
    """The sampling settings of child ``index`` of an ``n > 1`` request: a seeded request's children get the
    seeds ``seed, seed + 1, ...`` (as vLLM does), so each choice is reproducible and they differ."""
    if sampling.seed is None or index == 0:
        return sampling
    return dataclasses.replace(sampling, seed=(sampling.seed + index) % 2**63)


def first_tokens(sampler, logits, prompt_ids: list[int], samplings: list) -> list[tuple[int, list | None]]:
    """Sample each row's first token from the prompt's last logits ``[vocab]``.

    Returns ``(token_id, logprobs or None)`` per entry of ``samplings``; logprobs on the wire form
    ``[logprob, [[token_id, logprob], ...]]`` (raw model log-probabilities, before penalties and temperature).
    """
    from gpu.sampling import make_generator, token_logprobs

    params = [sampling_params(s) for s in samplings]
    batch = logits[None, :].expand(len(params), -1)
    histories = [(prompt_ids, ()) if p.has_penalties else None for p in params]
    tokens = sampler.sample(batch, params, [make_generator(p.seed) for p in params], histories)
    return [(int(t), logprobs_to_wire(lp))
            for t, lp in zip(tokens, token_logprobs(batch, tokens, [p.logprobs for p in params]))]


def logprobs_to_wire(lp) -> list | None:
    """gpu.sampling.TokenLogprob -> ``[logprob, [[token_id, logprob], ...]]`` (None stays None)."""
    if lp is None:
        return None
    return [float(lp.logprob), [[int(t), float(v)] for t, v in lp.top]]


@dataclasses.dataclass
class SharedBlocks:
    """Prefill blocks that one or more rows (an ``n > 1`` request's children) hold together; they are freed when
    the last holder leaves the inflight queue (transfer done, or its row turned final)."""

    owner_slot: int
    blocks: list[int]
    holders: set


class PrefillActor(Actor):
    role = "prefill"

    def __init__(self, layout, index: int = PREFILL_INDEX):
        super().__init__(layout, index)

    def on_start(self) -> None:
        from gpu.model import LlamaModel
        from gpu.sampling import Sampler
        from ipc.kv_pool import KVPool
        from ipc.shm_queue import ShmQueue
        from ipc.state_table import RequestState, StateTable

        import torch

        torch.set_num_threads(self.config.torch_threads)
        self.S = RequestState
        self.model = LlamaModel.from_path(self.layout.model_path or None, device=self.config.device,
                                          progress=False)
        self.pool = KVPool.attach(self.layout.segment("kv_prefill"))
        self.pool.reset()  # a restarted actor starts from an empty pool; its old requests were failed
        self.kv = self.pool.tensor()
        self.inbox = ShmQueue.attach(self.layout.segment("q_prefill"))
        self.to_decode = ShmQueue.attach(self.layout.segment("q_decode"))
        self.to_api = ShmQueue.attach(self.layout.segment("q_api"))
        self.table = StateTable.attach(self.layout.segment("state"))
        self.sampler = Sampler()
        self.faults = FaultPlan(self.config.faults, self.name)
        self.blocked = False  # the head request waits for free blocks: do not spin on it
        self.prefilling_rows = 0  # rows of the request whose forward pass runs now (PREFILLING)
        self.renewed_ns = 0   # last renew_queued()
        self.waiting: collections.deque[PrefillRequest] = collections.deque()
        # (slot, generation) -> the prefill blocks the row holds (shared by the children of an n > 1 request)
        self.inflight: dict[tuple[int, int], SharedBlocks] = {}
        self._publish_pool()

    def _publish_pool(self) -> None:
        self.actors.set(self.index, kv_blocks_total=self.pool.num_blocks, kv_blocks_free=self.pool.num_free)

    # ---- loop ---------------------------------------------------------------------------------------
    def run_once(self) -> None:
        timeout_s = 0.0 if self.waiting and not self.blocked else self.idle_wait_s
        for message in parse_frames(self.inbox.get_many(64, timeout_s), log):
            self.handle(message)
        self.reap_final()
        if self.waiting:
            self.prefill_next()
        self._publish_gauges()

    def renew_queued(self) -> None:
        """A prefill completed, so the queue moves: renew the QUEUED rows still waiting here (at most once per
        RENEW_INTERVAL_S), so their queue deadline measures a prefill actor that stopped taking requests, not a
        long queue under load (actors/watchdog.py)."""
        now_ns = time.monotonic_ns()
        if now_ns - self.renewed_ns < RENEW_INTERVAL_S * 1e9:
            return
        self.renewed_ns = now_ns
        for request in self.waiting:
            for key in request_rows(request):
                self.table.update(*key, last_progress_ns=now_ns)

    def _publish_gauges(self) -> None:
        """This actor's own counts, cross-checked by the monitor against the table: QUEUED rows, rows in the
        inflight queue (BOOTSTRAP/TRANSFERRING: held blocks, minus the rows being prefilled now) and PREFILLING."""
        queued_rows = sum(1 + len(r.children) for r in self.waiting)  # the table counts rows, n per request
        self.status.set_own_gauges(self.index, queued=queued_rows,
                                   prefill_inflight=len(self.inflight) - self.prefilling_rows,
                                   running=self.prefilling_rows)

    def _between_chunks(self) -> None:
        """Between two chunks of a long prefill: beat, take new messages (a TransferDone must not wait for the
        whole prompt, or the finished handoff it acknowledges would sit in the inflight queue and could pass
        ``inflight_timeout_s``), and refresh the gauges so they never go stale for a whole prompt."""
        self.actors.beat(self.index, iterations_delta=0)
        for message in parse_frames(self.inbox.get_many(64, 0.0), log):
            self.handle(message)
        self._publish_gauges()

    def handle(self, message) -> None:
        if isinstance(message, PrefillRequest):
            self.waiting.append(message)
        elif isinstance(message, TransferDone):
            self.transfer_done(message)
        else:
            log.warning("prefill: unexpected message %r dropped", message)

    def transfer_done(self, message: TransferDone) -> None:
        """Decode holds the KV: free our blocks; the request leaves the inflight queue (DECODE_WAITING)."""
        key = (message.slot, message.generation)
        if key not in self.inflight:
            self.status.count_late_message(self.index)  # for a request already timed out or aborted
            return
        self._free_inflight(key)
        self.table.transition(message.slot, message.generation, self.S.DECODE_WAITING)

    def _is_live(self, slot: int, generation: int) -> bool:
        row = self.table.read(slot, generation)
        return row is not None and int(row["state"]) in LIVE_STATES

    def _free_inflight(self, key: tuple[int, int]) -> None:
        shared = self.inflight.pop(key, None)
        if shared is None:  # late or duplicate completion for a request already cleaned up
            return
        self.table.update(key[0], key[1], prefill_blocks=0)
        shared.holders.discard(key)
        if not shared.holders:  # the last row holding the prompt's KV has left the inflight queue
            self.pool.free(shared.blocks, shared.owner_slot)
            self._publish_pool()

    def reap_final(self) -> None:
        """Drop waiting requests and free the blocks of inflight requests whose rows turned final."""
        if self.waiting:
            self.waiting = collections.deque(r for r in self.waiting
                                             if any(self._is_live(*key) for key in request_rows(r)))
        for key in [k for k in self.inflight if not self._is_live(*k)]:
            self._free_inflight(key)

    def prefill_next(self) -> None:
        """Prefill the head request once, for all its rows (an ``n > 1`` request's children share the prompt's
        KV blocks here), sample each row's first token and hand every row to decode (KVReady each)."""
        from pdserve.errors import OutOfKVBlocksError

        request = self.waiting[0]
        needed = math.ceil(len(request.prompt_ids) / self.pool.block_tokens)
        try:
            blocks = self.pool.allocate(needed, request.slot)
        except OutOfKVBlocksError:
            self.blocked = True  # stays QUEUED until inflight requests free blocks
            return
        self.blocked = False
        self.waiting.popleft()
        shared = SharedBlocks(request.slot, blocks, set())
        rows = []  # (child index, key) of the rows still live
        for index, key in enumerate(request_rows(request)):
            if self.table.transition(*key, self.S.PREFILLING, owner=self.index):
                rows.append((index, key))
                shared.holders.add(key)
                self.inflight[key] = shared
                self.table.update(*key, prefill_blocks=len(blocks))
        if not rows:
            self.pool.free(blocks, request.slot)
            return
        self._publish_pool()
        apply_actor_faults(self.faults, self.name, request.request_id)
        self.prefilling_rows = len(rows)
        self._publish_gauges()
        start_ns = time.monotonic_ns()
        top_n = request.sampling.prompt_logprobs
        prompt_entries = [] if top_n is not None else None
        logits = chunked_prefill(self.model, self.kv, request.prompt_ids, blocks, self.config.prefill_chunk_tokens,
                                 lambda: any(self._is_live(*key) for _, key in rows),
                                 self._between_chunks, top_n, prompt_entries)
        self.prefilling_rows = 0
        if logits is None:  # aborted (or timed out) between two chunks: stop working on it now
            for _, key in rows:
                self._free_inflight(key)
            return
        prefill_s = (time.monotonic_ns() - start_ns) / 1e9
        row = self.table.read(*rows[0][1])
        queue_s = (start_ns - int(row["created_ns"])) / 1e9 if row else 0.0
        samplings = [child_sampling(request.sampling, index) for index, _ in rows]
        firsts = first_tokens(self.sampler, logits, request.prompt_ids, samplings)
        if prompt_entries is not None:   # to the first live row's handle; the API shares them among the choices
            send_prompt_logprobs(self.to_api, *rows[0][1], prompt_entries, top_n)
        for (_, key), sampling, (token, logprobs) in zip(rows, samplings, firsts):
            if not self.table.transition(*key, self.S.BOOTSTRAP, owner=self.index):
                self._free_inflight(key)
                continue
            history = request.prompt_ids if sampling.repetition_penalty != 1.0 else []
            self.to_decode.put(to_wire(KVReady(key[0], key[1], request.request_id, blocks, len(request.prompt_ids),
                                               token, sampling, queue_s, prefill_s, logprobs, history)))
        self.renew_queued()

    def on_stop(self) -> None:
        for key in list(self.inflight):
            self._free_inflight(key)
