"""DecodeActor: the shell around the decode core (actors/decode_core.py) on one device.

It wires the real ports (state table, its KV pool, the KV transport pulling from the prefill pool, the queues,
the clock, the fault decorators), drains its inbox, runs the batched decode step (actors/model_runner.py) and
publishes the core's counts. In colocated mode (``--colocated true``) it also hosts the same prefill core over
its own pool: prefill's KVReady and decode's TransferDone go between the two cores directly, and the "transfer"
is a copy inside the pool (the same transport opened on its own pool).
"""
from __future__ import annotations

import functools
import logging
import os
import time

from actors.base import Actor
from actors.shell import decode_threads
from actors.topology import API, DECODE_INDEX, LOCAL_DECODE, LOCAL_PREFILL, REMOTE, peer_address
from actors.messages import HandBackDone, KVReady, parse_frames

log = logging.getLogger("pdserve.decode")


class DecodeActor(Actor):
    role = "decode"

    def __init__(self, layout, index: int = DECODE_INDEX):
        super().__init__(layout, index)

    def on_start(self) -> None:
        from actors.decode_core import DecodeCore
        from actors.fault_ports import FaultyOutbox, FaultyTransfers, HeldRequests
        from actors.model_runner import DecodeRunner, PrefillRunner, copy_block_rows
        from actors.ports import PeerTransfers, QueueOutbox, TransportTransfers
        from actors.prefill_core import PrefillCore
        from actors.prefix_cache import CachingAllocator
        from actors.shell import GaugePublisher, load_model, load_sampling, publish_tensor_pool
        from ipc.kv_transport import make_transport, set_transport_host
        from ipc.shm_queue import ShmQueue
        from ipc.state_table import StateTable
        from pdserve.faults import FaultPlan

        topo = self.topology
        self.model, self.pool, self.kv = load_model(self, decode=True)   # kv: a device tensor on cuda-ipc/torch-ipc
        colocated = self.config.colocated
        # colocated over a tensor transport: the "transfer" copies inside this pool, which it exports to itself
        self.kv_export = publish_tensor_pool(self.config.kv_transport, self.pool, self.kv) if colocated else None
        set_transport_host(self.config.kv_transport, self.config.kv_transfer_host)
        # one transport per source pool (each prefill actor's; colocated: its own pool, KVReady naming no peer)
        self.transports = {}
        for peer in (self.index,) if colocated else topo.prefill:
            transport = make_transport(self.config.kv_transport, self.pool)
            transport.open_peer(self.layout.segment(topo.segment("kv", peer)))
            self.transports[LOCAL_PREFILL if colocated else topo.address(peer)] = transport
        self.inbox = ShmQueue.attach(self.layout.segment(topo.segment("q", self.index)))
        self.faults = FaultPlan(self.config.faults, self.name, drills=self.config.drill_interval_s > 0)
        self.held = HeldRequests(self.faults)   # hold_prefill, hold_decode_waiting, hold_decode
        self.only_held = False   # the last iteration had nothing to run but held requests: block on the inbox
        self.queues = {topo.address(i): ShmQueue.attach(self.layout.segment(topo.segment("q", i)))
                       for i in topo.prefill}
        self.queues[API] = ShmQueue.attach(self.layout.segment("q_api"))
        self.queue_outbox = QueueOutbox(self.queues, self.queue_put_timeout_s)
        self.outbox = FaultyOutbox(self.queue_outbox, self.faults)
        self.table = StateTable.attach(self.layout.segment("state"))
        self.sampler, self.grammars = load_sampling(self)
        synchronous = self.config.kv_transport == "cpu-shm"   # its copy is done when start_copy returns
        self.peer_transfers = PeerTransfers(
            {peer: TransportTransfers(t, synchronous, local=colocated) for peer, t in self.transports.items()},
            synchronous, local=colocated)
        self.remote_peers: dict[str, str] = {}   # a prefill node's pool (descriptor JSON) -> its peer_address
        transfers = FaultyTransfers(self.peer_transfers, self.faults)
        # colocated: both cores allocate through the prefill core's prefix cache (decode's allocations evict it)
        self.allocator = CachingAllocator(self.pool, enabled=colocated and self.config.prefix_cache,
                                          copy_rows=functools.partial(copy_block_rows, self.kv))
        hand_back = self.config.prefix_cache and self.config.kv_hand_back and (
            colocated or self.config.kv_transport == "cpu-shm")   # the prefill pool reads this one (or is it)
        self.core = DecodeCore(self.table, self.allocator, transfers, self.outbox, time.monotonic_ns,
                               actor_index=self.index, eos_ids=self.model.config.eos_token_ids,
                               max_num_seqs=self.config.max_num_seqs, block_bytes=self.pool.block_bytes,
                               hand_back=hand_back,
                               address=LOCAL_DECODE if colocated else topo.address(self.index))
        self.runner = DecodeRunner(self.model, self.kv, self.sampler, self.grammars)
        self.cpus = len(os.sched_getaffinity(0))
        self.prefill_core = None
        if colocated:   # the local cores talk directly; only the API stays behind a queue
            self.prefill_core = PrefillCore(self.table, self.allocator, self.outbox, time.monotonic_ns,
                                            actor_index=self.index,
                                            on_late=lambda: self.actors.count_late_message(self.index),
                                            batch_tokens=self.config.max_prefill_batch_tokens,
                                            chunk_tokens=self.config.prefill_chunk_tokens)
            self.prefill_runner = PrefillRunner(self.model, self.kv, self.sampler, self.outbox, self.grammars)
            self.queue_outbox.add_local(LOCAL_PREFILL, self.prefill_core)
            self.queue_outbox.add_local(LOCAL_DECODE, self.core)
        self.gauges = GaugePublisher(self.actors, self.index, self.pool, self.allocator)
        self._publish()

    def on_ready(self) -> None:
        self.grammars.warm_up()   # its tokenizer view in a thread, after start-up (a request waits for it)

    def run_once(self) -> None:
        wait_s = self.core.wait_s(self.idle_wait_s)
        if self.prefill_core is not None and self.prefill_core.has_work():
            wait_s = 0.0
        if self.only_held and not self.core.transferring:
            wait_s = self.idle_wait_s
        self._take(self.inbox.get_many(64, wait_s))
        prefilled = self._prefill_here() if self.prefill_core is not None else False
        core = self.core
        core.reap()
        core.start_transfers()
        core.poll_transfers()
        joined = self._join_batch()
        for entry in joined:
            self.runner.prepare(entry)
        batch = [e for e in core.batch() if not self.held.held("hold_decode", e.key, e.ready.request_id)]
        self.only_held = not (prefilled or joined or batch)
        self.held.forget({e.key for e in core.decode_waiting + core.decoding} | (
            {key for work in self.prefill_core.prefilling for _, key in work.rows} if self.prefill_core else set()))
        if batch:
            self._publish()   # the rows just admitted are DECODING in the table: say so before a long step
            self.runner.threads = decode_threads(self.config, self.topology.num_decode,
                                                 self.actors.busy(self.topology.prefill), self.cpus, len(batch))
            core.step_done(batch, *self.runner.step(batch))
            if self.prefill_core is not None:   # the batch frees room: the queue in front of it moves
                self.prefill_core.renew_queued()
        core.flush()
        self.outbox.flush()
        self._publish()

    def _join_batch(self) -> list:
        """``core.join_batch()``, the ``hold_decode_waiting`` requests left out of it (they stay DECODE_WAITING, in
        their place)."""
        waiting = self.core.decode_waiting
        held = {id(e) for e in waiting if self.held.held("hold_decode_waiting", e.key, e.ready.request_id)}
        if not held:
            return self.core.join_batch()
        self.core.decode_waiting = [e for e in waiting if id(e) not in held]
        try:
            return self.core.join_batch()
        finally:
            self.core.decode_waiting = [e for e in waiting if id(e) in held] + self.core.decode_waiting

    def _take(self, frames) -> None:
        from actors.fault_ports import accept_kv_ready, apply_actor_faults, drop_prefill_request

        for message in parse_frames(frames, log):
            if drop_prefill_request(self.faults, message):
                continue
            if isinstance(message, KVReady) and message.prefill_actor == REMOTE:
                message = self._remote_ready(message)
                if message is None:
                    continue
            if isinstance(message, KVReady):
                apply_actor_faults(self.faults, self.name, message.request_id, self.table)
                if accept_kv_ready(self.faults, message, self.core):
                    self.core.on_message(message)
            elif isinstance(message, HandBackDone):
                self.core.on_message(message)
            elif self.prefill_core is None or not self.prefill_core.on_message(message):
                log.warning("decode: unexpected message %r dropped", message)

    def _remote_ready(self, ready: KVReady) -> KVReady | None:
        """A KVReady from a prefill node (its API relayed it): pull from the pool its ``peer`` descriptor names,
        through one transport per remote pool (opened on first use, kept; a republished pool is a new peer), and
        send TransferDone back through this node's API. A descriptor that cannot feed this pool fails the request
        (502) and returns None."""
        from dataclasses import replace

        from actors.ports import TransportTransfers
        from ipc.kv_transport import make_transport
        from ipc.mooncake_transport import PeerDescriptor

        key = self.remote_peers.get(ready.peer)
        if key is None:
            try:
                transport = make_transport(self.config.kv_transport, self.pool)
                transport.open_remote(PeerDescriptor.from_json(ready.peer))
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                log.error("request %s: unusable prefill peer: %s", ready.request_id, exc)
                self.core.reject(ready, 502, "bad_gateway", f"the prefill node's KV pool cannot feed {self.name}: "
                                                            f"{exc}")
                return None
            key = peer_address(len(self.remote_peers))
            self.remote_peers[ready.peer] = key
            self.transports[key] = transport
            self.peer_transfers.add_peer(key, TransportTransfers(transport, synchronous=False))
            self.queue_outbox.add_queue(key, self.queues[API])   # its TransferDone: through the API
        return replace(ready, prefill_actor=key)

    def _prefill_here(self) -> bool:
        """Colocated mode: the prefill core's next packed forward pass (one per loop iteration, between decode
        steps), into this actor's own pool (``hold_prefill`` prompts left out). Whether a pass ran."""
        self.prefill_core.reap()
        chunks = self.held.prefill_chunks(self.prefill_core.next_batch())
        if chunks:
            self.prefill_runner.run(self.prefill_core, chunks, self._after_prefill)
        return bool(chunks)

    def _after_prefill(self, chunks) -> None:
        if self.kv_export is not None:   # before the prefill core's KVReady reaches the decode core
            self.kv_export.record_written()

    def _publish(self) -> None:
        gauges = self.core.own_gauges()
        dropped = self.core.hand_backs_dropped
        if self.prefill_core is not None:
            prefill = self.prefill_core.own_gauges()
            gauges = {**prefill, **gauges, "running": gauges["running"] + prefill["running"]}
            dropped += self.prefill_core.hand_backs_dropped
        self.gauges.publish(gauges, self.core.finished, dropped)

    def on_stop(self) -> None:
        if self.prefill_core is not None:
            self.prefill_core.stop()
        self.core.stop()
        if self.kv_export is not None:
            self.kv_export.close()
