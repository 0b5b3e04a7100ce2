"""PrefillActor: the shell around the prefill core (actors/prefill_core.py) on one device.

It wires the real ports (state table, its KV pool, the queues to decode and the API, the clock, the fault
decorators), drains its inbox, runs the forward passes the core asks for (actors/model_runner.py) and
publishes the core's counts. Every scheduling decision is the core's.
"""
from __future__ import annotations

import functools
import logging
import os
import time

from actors.base import Actor
from actors.topology import API, PREFILL_INDEX, REMOTE
from actors.messages import parse_frames
from actors.shell import prefill_threads

log = logging.getLogger("pdserve.prefill")


class PrefillActor(Actor):
    role = "prefill"

    def __init__(self, layout, index: int = PREFILL_INDEX):
        super().__init__(layout, index)

    def on_start(self) -> None:
        from actors.fault_ports import FaultyOutbox, HeldRequests, leaky_pool
        from actors.model_runner import PrefillRunner, copy_block_rows
        from actors.ports import QueueOutbox
        from actors.prefill_core import PrefillCore
        from actors.prefix_cache import CachingAllocator
        from actors.shell import GaugePublisher, load_model, load_sampling, publish_tensor_pool
        from ipc.kv_transport import publish_source, set_transport_host
        from ipc.shm_queue import ShmQueue
        from ipc.state_table import StateTable
        from pdserve.faults import FaultPlan

        topo = self.topology
        # no decode steps but prompts' last tokens; kv: the pool's data, or a tensor on this actor's device
        self.model, self.pool, self.kv = load_model(self, decode=False)
        self.kv_export = publish_tensor_pool(self.config.kv_transport, self.pool, self.kv)
        self.faults = FaultPlan(self.config.faults, self.name, drills=self.config.drill_interval_s > 0)
        self.held = HeldRequests(self.faults)   # hold_prefill: prompts it begins but never computes
        self.only_held = False   # the last pass planned only held prompts: block on the inbox, do not spin
        table = StateTable.attach(self.layout.segment("state"))
        # created after the reset: warm-up's block and a predecessor's cache are never served from it
        self.allocator = CachingAllocator(leaky_pool(self.pool, self.faults, table), enabled=self.config.prefix_cache,
                                          copy_rows=functools.partial(copy_block_rows, self.kv))
        self.summary = None
        if "cachesum" in self.layout.segments:   # what the cache holds, for the router: empty until it fills
            from ipc.cache_summary import CacheSummary

            self.summary = CacheSummary.attach(self.layout.segment("cachesum"))
            self.allocator.cache.listener = self.summary.writer(self.index)
            self.allocator.cache.listener.clear()
        # mooncake: register the pool with this process's transfer engine, publish where it lives (else None)
        set_transport_host(self.config.kv_transport, self.config.kv_transfer_host)
        self.kv_source = publish_source(self.config.kv_transport, self.pool)
        self.inbox = ShmQueue.attach(self.layout.segment(topo.segment("q", self.index)))
        queues = {topo.address(j): ShmQueue.attach(self.layout.segment(topo.segment("q", j))) for j in topo.decode}
        queues[API] = ShmQueue.attach(self.layout.segment("q_api"))
        queues[REMOTE] = queues[API]   # a prefill node: KVReady for a decode node goes through the API
        self.outbox = FaultyOutbox(QueueOutbox(queues, self.queue_put_timeout_s), self.faults)
        self.sampler, self.grammars = load_sampling(self)
        self.decode_pools = {}   # decode actor address -> a cpu-shm transport from its pool (hand-backs), on first use
        hand_back = self.config.prefix_cache and self.config.kv_hand_back and self.config.kv_transport == "cpu-shm"
        self.core = PrefillCore(table, self.allocator, self.outbox,
                                time.monotonic_ns, actor_index=self.index, handoff_from=topo.address(self.index),
                                on_late=lambda: self.actors.count_late_message(self.index),
                                batch_tokens=self.config.max_prefill_batch_tokens,
                                chunk_tokens=self.config.prefill_chunk_tokens,
                                hand_back_copy=self._copy_from_decode if hand_back else None)
        self.runner = PrefillRunner(self.model, self.kv, self.sampler, self.outbox, self.grammars)
        self.cpus = len(os.sched_getaffinity(0))
        self.gauges = GaugePublisher(self.actors, self.index, self.pool, self.allocator)
        self._publish()

    def on_ready(self) -> None:
        self.grammars.warm_up()   # its tokenizer view in a thread, after start-up (a request waits for it)

    def run_once(self) -> None:
        """One packed forward pass (if any work): the loop beats its heartbeat and reads the inbox between
        two, so a long prompt or a large batch never blocks it for longer than one pass."""
        from actors.fault_ports import apply_actor_faults

        busy = self.core.has_work() and not self.only_held
        self._take(self.inbox.get_many(64, 0.0 if busy else self.idle_wait_s))
        self.core.reap()
        planned = self.core.next_batch()
        chunks = self.held.prefill_chunks(planned)
        self.only_held = bool(planned) and not chunks
        self.held.forget({key for work in self.core.prefilling for _, key in work.rows})
        if chunks:
            self._publish()
            for chunk in chunks:
                if chunk.work.chunks_done == 0:   # the actor takes this request now
                    apply_actor_faults(self.faults, self.name, chunk.work.request.request_id)
            # a request in the inflight queue is about to decode here, though no decode actor may say so yet (on a
            # prefill node the decode actors are other hosts': its CPUs are all the prefill actors')
            handed_off = bool(self.topology.decode) and self.core.own_gauges()["prefill_inflight"] > 0
            self.runner.threads = prefill_threads(self.config, self.topology.num_prefill,
                                                  self.actors.busy(self.topology.decode) + handed_off, self.cpus)
            self.runner.run(self.core, chunks, self._after_forward)
        self.outbox.flush()
        self._publish()

    def _take(self, frames) -> None:
        from actors.fault_ports import drop_prefill_request

        for message in parse_frames(frames, log):
            if drop_prefill_request(self.faults, message):
                continue
            if not self.core.on_message(message):
                log.warning("prefill: unexpected message %r dropped", message)

    def _copy_from_decode(self, decode_actor: str, src: list[int], generations: list[int], dst: list[int]) -> bool:
        """Copy blocks ``src`` of the pool of the decode actor at address ``decode_actor`` into ``dst`` of this
        pool (a KVHandBack): False if that pool cannot be read or a source block is no longer the handed-back one
        of that generation (checked before and after the copy: a block reallocated meanwhile may have been
        written)."""
        from actors.prefix_cache import HANDBACK_OWNER
        from ipc.kv_transport import TransferStatus, make_transport

        transport = self.decode_pools.get(decode_actor)
        if transport is None:
            try:
                index = self.topology.index(decode_actor)
            except ValueError:
                return False
            if index not in self.topology.decode:
                return False
            transport = make_transport("cpu-shm", self.pool)
            try:
                transport.open_peer(self.layout.segment(self.topology.segment("kv", index)))
            except (OSError, ValueError) as exc:
                log.warning("prefill: the pool of decode actor %s cannot be read for hand-backs: %s",
                            decode_actor, exc)
                return False
            self.decode_pools[decode_actor] = transport
        peer = transport.peer
        if not peer.is_current(src, generations, HANDBACK_OWNER):
            return False
        handle = transport.start_copy(src, dst, num_tokens=len(src) * self.pool.block_tokens)
        try:
            done = transport.poll(handle) == TransferStatus.DONE
        finally:
            transport.release(handle)
        return done and peer.is_current(src, generations, HANDBACK_OWNER)

    def _after_forward(self, chunks) -> None:
        """After a forward pass, before its rows are renewed: the tensor pool's 'KV written' mark (cuda-ipc: the
        event decode's copies wait on), then the injected prefill faults of each chunk's request (slow_prefill,
        stall_prefill), which beat the heartbeat while they hold the loop."""
        from actors.fault_ports import prefill_chunk_faults

        if self.kv_export is not None:   # before core.finish sends these chunks' KVReady
            self.kv_export.record_written()
        if not self.faults:
            return
        for chunk in chunks:
            work = chunk.work
            prefill_chunk_faults(self.faults, work.request.request_id, work.chunks_done == 0,
                                 lambda: self.core.any_live(work),
                                 lambda: self.actors.beat(self.index, iterations_delta=0))

    def _publish(self) -> None:
        self.gauges.publish(self.core.own_gauges(), self.core.handed_off, self.core.hand_backs_dropped)

    def on_stop(self) -> None:
        self.core.stop()
        for transport in self.decode_pools.values():
            transport.close()
        if self.kv_export is not None:   # the segment stays for a restarted actor to rewrite; the supervisor unlinks it
            self.kv_export.close()
