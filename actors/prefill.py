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
import logging
import math
import os
import time

from actors.base import PREFILL_INDEX, Actor
from actors.messages import KVReady, PrefillRequest, TransferDone, parse_frames, to_wire
from pdserve.faults import FaultPlan
from ipc.state_table import LIVE_STATES

log = logging.getLogger("pdserve.prefill")


def chunked_prefill(model, kv, ids: list[int], blocks: list[int], chunk_tokens: int, is_live, beat):
    """Run a prompt through ``model.prefill`` in chunks of ``chunk_tokens``, writing its KV at ``blocks``;
    between chunks call ``beat()`` and stop early (return None) once ``is_live()`` is False (aborted or timed
    out meanwhile). Returns the last position's logits ``[vocab]``."""
    logits = None
    for start in range(0, len(ids), chunk_tokens):
        if start and not is_live():
            return None
        logits = model.prefill(kv, ids[start:start + chunk_tokens], blocks, start_pos=start)
        beat()
    return logits


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
                          stop_token_ids=tuple(sampling.stop_token_ids), ignore_eos=sampling.ignore_eos)


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
        self.table = StateTable.attach(self.layout.segment("state"))
        self.sampler = Sampler()
        self.faults = FaultPlan(self.config.faults, self.name)
        self.blocked = False  # the head request waits for free blocks: do not spin on it
        self.waiting: collections.deque[PrefillRequest] = collections.deque()
        self.inflight: dict[tuple[int, int], list[int]] = {}  # (slot, generation) -> our block ids
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
        self.status.set_own_gauges(self.index, queued=len(self.waiting), prefill_inflight=len(self.inflight),
                                   running=0)

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
        blocks = self.inflight.pop(key, None)
        if blocks is None:  # late or duplicate completion for a request already cleaned up
            return
        self.pool.free(blocks, key[0])
        self.table.update(key[0], key[1], prefill_blocks=0)
        self._publish_pool()

    def reap_final(self) -> None:
        """Drop waiting requests and free the blocks of inflight requests whose rows turned final."""
        if self.waiting:
            self.waiting = collections.deque(r for r in self.waiting if self._is_live(r.slot, r.generation))
        for key in [k for k in self.inflight if not self._is_live(*k)]:
            self._free_inflight(key)

    def prefill_next(self) -> None:
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
        key = (request.slot, request.generation)
        if not self.table.transition(request.slot, request.generation, self.S.PREFILLING, owner=self.index):
            self.pool.free(blocks, request.slot)
            return
        self.inflight[key] = blocks
        self.table.update(request.slot, request.generation, prefill_blocks=len(blocks))
        self._publish_pool()
        apply_actor_faults(self.faults, self.name, request.request_id)
        self.status.set_own_gauges(self.index, running=1)
        start_ns = time.monotonic_ns()
        logits = self._chunked_prefill(request, blocks)
        if logits is None:  # aborted (or timed out) between two chunks: stop working on it now
            self.status.set_own_gauges(self.index, running=0)
            self._free_inflight(key)
            return
        prefill_s = (time.monotonic_ns() - start_ns) / 1e9
        self.status.set_own_gauges(self.index, running=0)
        row = self.table.read(request.slot, request.generation)
        queue_s = (start_ns - int(row["created_ns"])) / 1e9 if row else 0.0
        params = sampling_params(request.sampling)
        from gpu.sampling import make_generator

        generator = make_generator(params.seed)
        first_token = self.sampler.sample(logits[None, :], [params], [generator])[0]
        if not self.table.transition(request.slot, request.generation, self.S.BOOTSTRAP, owner=self.index):
            self._free_inflight(key)
            return
        self.to_decode.put(to_wire(KVReady(request.slot, request.generation, request.request_id, blocks,
                                           len(request.prompt_ids), int(first_token), request.sampling,
                                           queue_s, prefill_s)))

    def _chunked_prefill(self, request: PrefillRequest, blocks: list[int]):
        """Run the prompt in chunks of ``prefill_chunk_tokens``; between chunks beat the heartbeat and stop early
        (return None) if the request's row turned final. Returns the last position's logits ``[vocab]``."""
        return chunked_prefill(self.model, self.kv, request.prompt_ids, blocks, self.config.prefill_chunk_tokens,
                               lambda: self._is_live(request.slot, request.generation),
                               lambda: self.actors.beat(self.index, iterations_delta=0))

    def on_stop(self) -> None:
        for key in list(self.inflight):
            self._free_inflight(key)
