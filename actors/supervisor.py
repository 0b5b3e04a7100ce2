"""Supervisor: creates every shared segment, spawns the actors, waits for their readiness, watches their
process sentinels, and on exit stops them and unlinks every segment it created.

Modelled on Hypercorn's ``run.py``: spawn context, one shutdown event, readiness acknowledgements (the
actor table's READY status), waits on process sentinels, reports exit codes.
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import threading
import time
from typing import Any

from actors.base import ENGINE_STOP_SIGNALS, EngineLayout, ModelShape, run_actor
from actors.topology import topology
from pdserve.config import LoadedConfig, kv_cache_dtype
from pdserve.kv_budget import ELEM_BYTES, auto_pool_tokens, memory_available, shm_free, token_bytes
from pdserve.errors import ConfigError, PdserveError, ShmLockTimeoutError

log = logging.getLogger("pdserve.supervisor")

STOP_JOIN_TIMEOUT_S = 5.0
RESTART_MIN_INTERVAL_S = 1.0   # an actor that keeps dying is restarted at most this often
LOCK_STUCK_LOG_INTERVAL_S = 30.0   # a restart held back by a stuck shm lock is logged once, then this often
# the monitor does not judge itself; the supervisor kills it after actor_hang_timeout_s plus this without a
# heartbeat (one tick may wait a lock timeout before it gives up: docs/architecture.md, "Shared memory")
MONITOR_HANG_SLACK_S = 5.0
# how often the idle supervisor looks for actors the monitor marked hung; an actor's exit and a stop request wake
# it at once (process sentinels, the stop pipe), so this bounds only its idle CPU and how soon a hung actor is killed
SUPERVISE_PERIOD_S = 1.0

# Who puts into each engine queue (each has one consumer: the actor or api named by the queue). A queue with
# one producer gets the mutex-free single-producer/single-consumer ring; the others the MPMC one.
def queue_producers(queue: str, topo, colocated: bool) -> tuple[str, ...]:
    """The actors that put into ``queue`` (a segment key: ``q_api``, ``q_prefill0``, ``q_decode1``, ...)."""
    if queue == "q_api":   # tokens and errors
        return ("prefill", "decode", "monitor", "supervisor")
    if queue.startswith("q_prefill"):   # the api's PrefillRequest; every decode actor's TransferDone
        return ("api",) + tuple(topo.names[i] for i in topo.decode)
    # a decode inbox: KVReady from every prefill actor (colocated: the api's PrefillRequest; a decode node: the
    # api's KVReady from a prefill node)
    return ("api",) if colocated or not topo.prefill else tuple(topo.names[i] for i in topo.prefill)


def queue_mode(producers: tuple[str, ...]) -> str:
    """``"spsc"`` for a queue with one producer (on CPUs that support it), else ``"mpmc"``."""
    from ipc.shm_queue import SPSC_SUPPORTED

    return "spsc" if len(producers) == 1 and SPSC_SUPPORTED else "mpmc"


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_device(device: str) -> None:
    """Raise ConfigError unless this host can run the engine on ``device``: ``cpu`` always; ``cuda`` when torch
    sees a CUDA device (each actor then sees its own GPU: actors/placement.py). Checked in the supervisor before
    any actor starts, so a missing GPU is a start-up error, not an actor that dies loading its model."""
    if device == "cpu":
        return
    if device != "cuda":
        raise ConfigError(f"config field device={device!r}: the engine runs on cpu or cuda", param="device")
    import torch

    if not torch.cuda.is_available():
        why = ("torch is built without CUDA" if torch.version.cuda is None
               else "no NVIDIA driver/GPU visible (CUDA_VISIBLE_DEVICES="
                    f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r})")
        raise ConfigError(f"config field device='cuda': torch.cuda.is_available() is False on this host ({why}); "
                          f"the engine needs a CUDA GPU for device=cuda. Use device=cpu, or run where a GPU is "
                          f"visible", param="device")


def unlink_torch_files(engine_id: str) -> list[str]:
    """The shm files the torch-ipc exports of engine ``engine_id`` list (gpu/cuda_ipc.py: every pool a prefill
    actor shared, a killed incarnation's too), unlinked once the actors have exited; returns them."""
    from ipc.naming import list_engine_segments, posix_name_of

    gone: list[str] = []
    for entry in list_engine_segments(engine_id):
        if entry.endswith(".tipc"):
            from gpu.cuda_ipc import unlink_exported_files

            gone += unlink_exported_files(posix_name_of(entry)[0])
    return gone


def check_chat_template(path: str) -> None:
    """Raises ConfigError (field chat_template) unless the file reads and compiles as a chat template."""
    from gpu.tokenizer import compile_chat_template
    from pdserve.errors import ModelLoadError

    try:
        with open(path, encoding="utf-8") as f:
            compile_chat_template(f.read())
    except (OSError, ModelLoadError) as exc:
        raise ConfigError(f"config field chat_template={path!r}: {exc}", param="chat_template") from None


def actor_device_map(config, topo) -> dict[int, str]:
    """Actor index -> device label (actors/placement.py) for every engine actor; the API and monitor have none."""
    from actors.placement import actor_devices

    prefill, decode = actor_devices(config)
    return {**dict(zip(topo.prefill, prefill)), **dict(zip(topo.decode, decode))}


def served_names(configured: str, model_path: str) -> str:
    """The served model names (comma-separated, the first reported): ``configured``, or the model file's name
    when it is empty or names only ``*`` (any name accepted: the file's name is then reported)."""
    from gpu.model_files import model_file_name

    if any(n.strip() not in ("", "*") for n in configured.split(",")):
        return configured
    return ",".join([model_file_name(model_path)] + (["*"] if "*" in configured else []))


def plan_layout(loaded: LoadedConfig, engine_id: str) -> EngineLayout:
    """Read the model's metadata (no weights) and size the pools, queues and tables.

    Raises:
        ConfigError: a refused actor placement (actors/placement.py); a device the engine is not wired for;
            max_model_len larger than the model's context or
            the KV pool.
        ModelLoadError: the model cannot be read.
    """
    from gpu.loader import load_config as read_model_config
    from gpu.model_files import model_cache_dir
    from ipc.naming import segment_name

    config = loaded.config
    topo = topology(config)   # refuses a bad placement (actors/placement.py) before the device check
    if config.chat_template:
        check_chat_template(config.chat_template)
    check_device(config.device)
    model_path = config.model or ""
    # the GGUF header from the model cache (3-4 s to parse the file; saved there on the first start)
    model_config = read_model_config(model_path or None, model_cache_dir(config.model_cache_dir))
    shape = ModelShape(model_config.name, model_config.num_layers, model_config.num_kv_heads,
                       model_config.head_dim, model_config.max_position_embeddings, model_config.family)
    kv_dtype = kv_cache_dtype(config)
    per_token = token_bytes(shape.num_layers, shape.num_kv_heads, shape.head_dim, ELEM_BYTES[kv_dtype])
    pools = len(topo.prefill) + len(topo.decode)
    pool_note = f"kv_pool_tokens={config.kv_pool_tokens}"
    pool_tokens = config.kv_pool_tokens
    if not pool_tokens:
        pool_tokens, why = auto_pool_tokens(shape.context_length, per_token, max(1, pools), memory_available(),
                                            config.kv_block_tokens, gpu=config.device == "cuda")
        pool_note = f"kv_pool_tokens=0 (auto): {why}"
    blocks = pool_tokens // config.kv_block_tokens
    if blocks < 1:
        raise ConfigError(f"config field kv_pool_tokens={config.kv_pool_tokens}: must hold at least one block "
                          f"of kv_block_tokens={config.kv_block_tokens}", param="kv_pool_tokens")
    pool_tokens = blocks * config.kv_block_tokens
    check_pools_fit(config, kv_dtype, pools, pools * blocks * config.kv_block_tokens * per_token)
    limit = min(shape.context_length, pool_tokens)
    max_context_tokens = config.max_model_len or limit
    if max_context_tokens > limit:
        raise ConfigError(f"config field max_model_len={config.max_model_len}: must be <= {limit} (the model's "
                          f"context {shape.context_length} and the KV pool's {pool_tokens} tokens)",
                          param="max_model_len")
    engine_actors = topo.prefill + topo.decode
    recorder = ("recorder",) if config.recorder_events else ()   # the flight recorder (ipc/recorder.py)
    recorder += ("arrivals",) if config.arrival_index_entries else ()   # the arrival index (ipc/arrivals.py)
    names = ("state", "actors", "status", "q_api") + recorder + tuple(topo.segment(what, i) for i in engine_actors
                                                                      for what in ("q", "kv"))
    names += ("conns",) if config.connection_ledger_rows else ()   # the connection ledger (ipc/ledger.py)
    # the prefill actors' prefix-cache summaries, read by the router (ipc/cache_summary.py)
    names += ("cachesum",) if config.prefix_cache and topo.prefill else ()
    return EngineLayout(engine_id=engine_id, config=config, model_path=model_path,
                        served_model_name=served_names(config.served_model_name, model_path), shape=shape,
                        max_context_tokens=max_context_tokens, http_port=config.port or free_port(config.host),
                        kv_blocks_per_pool=blocks, kv_dtype=kv_dtype, kv_pool_note=pool_note,
                        segments={n: segment_name(engine_id, n) for n in names},
                        config_sources=dict(loaded.sources))


def kv_cache_line(lay: EngineLayout) -> tuple[int, str]:
    """(level, text) of the start-up line that says how big the KV pools are and why: INFO, or WARNING when the
    default size was capped by memory below the model's context (the engine then serves shorter contexts than the
    model's: a container's small /dev/shm, 64 MiB under docker by default, gives a few hundred tokens)."""
    sh, cfg = lay.shape, lay.config
    pool_tokens = lay.kv_blocks_per_pool * cfg.kv_block_tokens
    per_token = token_bytes(sh.num_layers, sh.num_kv_heads, sh.head_dim, ELEM_BYTES[lay.kv_dtype])
    text = (f"KV cache: {pool_tokens} tokens per actor pool ({lay.kv_pool_note}), {lay.kv_dtype} (kv_cache_dtype="
            f"{cfg.kv_cache_dtype}): {per_token / 1024:.1f} KiB a token, {pool_tokens * per_token / 2**20:.0f} MiB a "
            f"pool")
    if cfg.kv_pool_tokens or pool_tokens >= sh.context_length:
        return logging.INFO, text
    return logging.WARNING, (f"{text}; requests are limited to {lay.max_context_tokens} tokens, below the model's "
                             f"{sh.context_length}: free memory, grow /dev/shm (containers: --shm-size) or give "
                             f"kv_pool_tokens")


def check_pools_fit(config, kv_dtype: str, pools: int, need: int) -> None:
    """Raises ConfigError naming ``kv_pool_tokens`` when the node's ``pools`` shm pools, ``need`` bytes in all,
    would not fit in /dev/shm's free space (a size given by hand: the default fits by construction): the segments'
    posix_fallocate would fail part-way through start-up. The tensor transports keep the data elsewhere."""
    from ipc.kv_transport import TENSOR_POOL_TRANSPORTS

    free = shm_free()
    if free is None or config.kv_transport in TENSOR_POOL_TRANSPORTS:
        return
    if need > free:
        raise ConfigError(f"config field kv_pool_tokens={config.kv_pool_tokens}: the node's {pools} KV pools "
                          f"({kv_dtype}) need {need / 2**30:.1f} GiB of shared memory and /dev/shm has "
                          f"{free / 2**30:.1f} GiB free; give fewer tokens, or 0 to size them to this machine "
                          f"(containers: --shm-size)", param="kv_pool_tokens")


def fail_held_for_restart(state, status, to_api, topo, index: int, exitcode) -> int:
    """Fail (503) the requests the dead actor ``index`` holds before it is restarted; returns how many.

    Raises:
        ShmLockTimeoutError: a live process (stopped or hung) holds the state table lock or the API inbox's
            producer lock; nothing is restarted until it frees (the caller retries on its next pass).
    """
    from actors.monitor import fail_requests_held_by

    name = topo.names[index]
    return fail_requests_held_by(state, status, to_api, topo, index,
                                 f"actor {name} is dead (its process exited with code {exitcode}); "
                                 "the request was dropped, retry it", by=-1, role="supervisor",
                                 counter="exit_failures")


def monitor_is_hung(row, alive: bool, now_ns: int, config) -> bool:
    """The supervisor's verdict on the monitor (which nobody else judges): alive and READY but no heartbeat for
    ``actor_hang_timeout_s + monitor_tick_s + MONITOR_HANG_SLACK_S``. ``row`` is its ActorTable row."""
    from actors.watchdog import classify_actor
    from ipc.actor_table import ActorHealth, ActorStatus

    pid = int(row["pid"])
    limit_s = config.actor_hang_timeout_s + config.monitor_tick_s + MONITOR_HANG_SLACK_S
    return classify_actor(pid, alive, int(row["status"]) == ActorStatus.READY, int(row["heartbeat_ns"]), now_ns,
                          limit_s) == ActorHealth.HUNG


class Supervisor:
    """Owns the engine's segments and processes. ``start()``, then ``run()`` until ``request_stop()``."""

    def __init__(self, loaded: LoadedConfig, engine_id: str | None = None):
        from ipc.naming import new_engine_id

        self.loaded = loaded
        self.engine_id = engine_id or new_engine_id()
        self.layout: EngineLayout | None = None
        self.topology = None
        self.devices: dict[int, str] = {}
        # processes only: the engine creates no multiprocessing semaphore (ipc/engine_status.py, the stop flag)
        self.ctx = multiprocessing.get_context("spawn")
        self.shutdown = threading.Event()
        self._stop_r, self._stop_w = os.pipe()   # request_stop writes a byte: run()'s wait wakes at once
        os.set_blocking(self._stop_w, False)
        self.processes: dict[int, Any] = {}
        self.started_at: dict[int, float] = {}
        self.queues: dict[str, Any] = {}
        self._owned: list[Any] = []
        # actor index -> when its restart was last logged as held back by a stuck shm lock (rate-limits the log)
        self.lock_stuck_logged: dict[int, float] = {}
        self.lock_stuck_since: dict[int, float] = {}

    # ---- segments -----------------------------------------------------------------------------------
    def _create_segments(self) -> None:
        from ipc.actor_table import ActorTable
        from ipc.engine_status import EngineStatus
        from ipc.kv_pool import KVPool
        from ipc.manifest import process_start_ticks, write_manifest
        from ipc.shm_queue import ShmQueue
        from ipc.state_table import StateTable

        lay, cfg = self.layout, self.layout.config
        topo = self.topology
        # the manifest first: its pid tells another engine starting (ipc.manifest.reclaim_stale_engines) that
        # this one's objects are in use from the moment they exist
        self._owned.append(write_manifest(self.engine_id, {
            "engine_id": self.engine_id, "pid": os.getpid(), "pid_start_ticks": process_start_ticks(os.getpid()),
            "created_unix_s": time.time(),
            "model": lay.model_path or "(embedded default)", "served_model_name": lay.served_model_name,
            "max_context_tokens": lay.max_context_tokens, "kv_blocks_per_pool": lay.kv_blocks_per_pool,
            "url": f"http://{cfg.host}:{lay.http_port}", "segments": lay.segments, "actors": list(topo.names),
            "config": lay.effective_config()}))
        self.state = StateTable.create(lay.segment("state"), num_rows=cfg.max_queued_requests * 2 + 16)
        self._owned.append(self.state)
        self.actors = ActorTable.create(lay.segment("actors"), num_actors=len(topo.names))
        self._owned.append(self.actors)
        engine_actors = topo.prefill + topo.decode
        for index, name in enumerate(topo.names):
            self.actors.register(index, name, self.devices.get(index, ""))
        self.status = EngineStatus.create(lay.segment("status"))
        self._owned.append(self.status)
        self._create_recorder()
        for q in ("q_api",) + tuple(topo.segment("q", i) for i in engine_actors):
            self.queues[q] = ShmQueue.create(lay.segment(q), num_slots=cfg.queue_slots, slot_bytes=cfg.queue_slot_bytes,
                                             mode=queue_mode(queue_producers(q, topo, cfg.colocated)))
            self._owned.append(self.queues[q])
        if "conns" in lay.segments:
            from ipc.ledger import ConnectionLedger

            self._owned.append(ConnectionLedger.create(lay.segment("conns"), cfg.connection_ledger_rows,
                                                       cfg.connection_ledger_closed_rows))
        if "cachesum" in lay.segments:
            from ipc.cache_summary import CacheSummary

            self._owned.append(CacheSummary.create(lay.segment("cachesum"), num_actors=len(topo.prefill),
                                                   slots=lay.kv_blocks_per_pool))
        from ipc.kv_transport import TENSOR_POOL_TRANSPORTS

        for pool in (topo.segment("kv", i) for i in engine_actors):   # a tensor transport's data is in its actor

            self._owned.append(KVPool.create(lay.segment(pool), num_layers=lay.shape.num_layers,
                                             num_blocks=lay.kv_blocks_per_pool, block_tokens=cfg.kv_block_tokens,
                                             num_kv_heads=lay.shape.num_kv_heads, head_dim=lay.shape.head_dim,
                                             dtype=lay.kv_dtype,
                                             data=cfg.kv_transport not in TENSOR_POOL_TRANSPORTS))

    def _create_recorder(self) -> None:
        """The flight recorder (ipc/recorder.py): one sub-ring per actor, then the supervisor's own (installed
        here, so its transitions are recorded too); the arrival index (ipc/arrivals.py) beside it."""
        from ipc import recorder

        cfg, writers = self.layout.config, len(self.topology.names) + 1
        if "arrivals" in self.layout.segments:
            from ipc.arrivals import ArrivalIndex

            self._owned.append(ArrivalIndex.create(self.layout.segment("arrivals"), cfg.arrival_index_entries))
        if not cfg.recorder_events:
            return
        ring = recorder.Recorder.create(self.layout.segment("recorder"), num_writers=writers,
                                        events_per_writer=max(16, cfg.recorder_events // writers))
        self._owned.append(ring)
        recorder.install(ring, writers - 1, recorder.SUPERVISOR_ACTOR)

    def _prepare_model(self) -> None:
        """Build the prepared-model file once (gpu/prepared.py) so the actors only memory-map it. On a warm cache
        the file is only named (``prepared_file``, no torch in this process: its import would delay every actor's
        spawn by ~2 s); the actors check its key as they map it, and one that finds it damaged rebuilds it."""
        from gpu.prepared import ensure_prepared, prepared_file

        cfg = self.layout.config
        started = time.monotonic()
        args = (self.layout.model_path or None, cfg.weights, cfg.device, cfg.model_cache_dir or None)
        path = prepared_file(*args)
        if path is None:
            path = ensure_prepared(*args)
        log.info("prepared model %s (%.1f s)", path or "cache off", time.monotonic() - started)

    def _unlink_segments(self) -> None:
        from ipc import recorder
        from ipc.naming import unlink_all

        if recorder.installed() is not None and any(s is recorder.installed().recorder for s in self._owned):
            recorder.install(None, 0, 0)
        for segment in reversed(self._owned):
            try:
                segment.close()
                segment.unlink()
            except Exception:  # noqa: BLE001 - best effort; unlink_all below sweeps what is left
                log.exception("unlinking %r failed", segment)
        self._owned.clear()
        unlink_torch_files(self.engine_id)
        unlink_all(self.engine_id)
        log.info("engine %s: every shared-memory segment unlinked", self.engine_id)

    # ---- processes ----------------------------------------------------------------------------------
    def _spawn(self, index: int) -> None:
        from actors.placement import child_environment

        process = self.ctx.Process(target=run_actor, args=(self.topology.class_path(index), self.layout, index,
                                                           child_environment(self.devices.get(index, ""))),
                                   name=f"pdserve-{self.engine_id}-{self.topology.names[index]}", daemon=False)
        # the child inherits the blocked mask through fork and exec, so a SIGTERM to the process group while it
        # starts waits for its own handler (which ignores it) instead of killing it; ours runs once unblocked
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, ENGINE_STOP_SIGNALS)
        try:
            process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        self.actors.spawned(index, process.pid)
        self.processes[index] = process
        self.started_at[index] = time.monotonic()

    def _wait_ready(self, indices: list[int]) -> None:
        from ipc.actor_table import ActorStatus

        deadline = time.monotonic() + self.layout.config.actor_ready_timeout_s
        pending = set(indices)
        while pending:
            for index in list(pending):
                if self.actors.row(index)["status"] == ActorStatus.READY:
                    pending.discard(index)
                elif not self.processes[index].is_alive():
                    raise PdserveError(f"actor {self.topology.names[index]} exited during start-up with code "
                                       f"{self.processes[index].exitcode}; see its log above")
            if not pending:
                return
            if time.monotonic() > deadline or self.shutdown.is_set():
                raise PdserveError(f"actors {[self.topology.names[i] for i in pending]} not ready within "
                                   f"actor_ready_timeout_s={self.layout.config.actor_ready_timeout_s}")
            multiprocessing.connection.wait([self.processes[i].sentinel for i in pending], timeout=0.05)

    def start(self) -> EngineLayout:
        """Create segments, spawn and await every actor. On failure everything is torn down and re-raised."""
        self.layout = plan_layout(self.loaded, self.engine_id)
        self.topology = topology(self.layout.config)
        self.devices = actor_device_map(self.layout.config, self.topology)
        try:
            self._prepare_model()
            self._create_segments()
            topo = self.topology
            # the API starts alongside the engine actors (its tokenizer and grammar set-up overlap their model
            # loads); its /health stays 503 and its router refuses work until every actor reads READY
            every_actor = [topo.monitor, *topo.prefill, *topo.decode, topo.api]
            log.log(*kv_cache_line(self.layout))
            log.info("engine %s: starting %s; the prefill and decode actors map the prepared model %s and warm up "
                     "(up to actor_ready_timeout_s=%.0f s)", self.engine_id,
                     ", ".join(topo.names[i] for i in every_actor), self.layout.model_path or "(embedded default)",
                     self.layout.config.actor_ready_timeout_s)
            for index in every_actor:
                self._spawn(index)
            self._wait_ready(every_actor)
        except BaseException:
            self.stop()
            raise
        return self.layout

    def request_stop(self) -> None:
        """Ask ``run()`` to drain and return; safe from a signal handler."""
        self.shutdown.set()
        if self._stop_w >= 0:
            try:
                os.write(self._stop_w, b"s")
            except BlockingIOError:   # the pipe is full: a stop is pending anyway
                pass

    def run(self) -> int:
        """Watch the actors until a stop is requested, restarting dead ones and killing hung ones (the
        monitor says which; the supervisor judges the monitor itself); then drain. Returns the exit status (0
        after a clean stop). A stuck shm lock (ShmLockTimeoutError) holds a restart back, never stops the loop."""
        while not self.shutdown.is_set():
            sentinels = {p.sentinel: i for i, p in self.processes.items()}
            for sentinel in multiprocessing.connection.wait([*sentinels, self._stop_r], timeout=SUPERVISE_PERIOD_S):
                if sentinel == self._stop_r:
                    continue   # the loop's condition sees the stop
                index = sentinels[sentinel]
                self.processes[index].join(timeout=1)  # reap it, so its exit code is known
                if index not in self.lock_stuck_since:   # a held-back restart was logged already
                    log.error("actor %s is dead (exit code %s); restarting it", self.topology.names[index],
                              self.processes[index].exitcode)
                self._restart(index)
            self._kill_hung()
        log.info("stop requested: draining (new requests get 503; running ones have drain_timeout_s=%.0f s)",
                 self.layout.config.drain_timeout_s)
        self.drain()
        return 0

    def _kill_hung(self) -> None:
        """SIGKILL every live actor the monitor marked HUNG (and the monitor if its own heartbeat stopped); the
        next pass restarts it. A kill also frees any shm lock it held (the next waiter takes it over)."""
        from ipc.actor_table import ActorHealth

        for index, process in list(self.processes.items()):
            if not process.is_alive() or time.monotonic() - self.started_at[index] \
                    <= self.layout.config.actor_hang_timeout_s:
                continue
            row = self.actors.row(index)
            if index == self.topology.monitor:
                hung = monitor_is_hung(row, True, time.monotonic_ns(), self.layout.config)
            else:
                hung = row["health"] == ActorHealth.HUNG
            if hung:
                log.error("actor %s (pid %d) is hung; killing it to restart it", self.topology.names[index],
                          process.pid)
                process.kill()

    def _restart(self, index: int) -> None:
        process = self.processes[index]
        process.join(timeout=1)
        name = self.topology.names[index]
        if index != self.topology.monitor:
            try:
                failed = fail_held_for_restart(self.state, self.status, self.queues["q_api"], self.topology,
                                               index, process.exitcode)
            except ShmLockTimeoutError as exc:
                # the dead process's sentinel stays ready: the next pass retries, after _kill_hung
                now = time.monotonic()
                self.lock_stuck_since.setdefault(index, now)
                if now - self.lock_stuck_logged.get(index, -LOCK_STUCK_LOG_INTERVAL_S) >= LOCK_STUCK_LOG_INTERVAL_S:
                    self.lock_stuck_logged[index] = now
                    log.error("actor %s is dead (exit code %s) but its requests cannot be failed yet: %s; its "
                              "restart waits until the lock frees (the monitor marks a stuck holder hung, the "
                              "supervisor kills it)", name, process.exitcode, exc)
                return
            if failed:
                log.error("failed %d requests held by the dead actor %s", failed, name)
        since = self.lock_stuck_since.pop(index, None)
        self.lock_stuck_logged.pop(index, None)
        if since is not None:
            log.warning("the lock is free again; restarting actor %s after %.1f s", name, time.monotonic() - since)
        wait_s = self.started_at[index] + RESTART_MIN_INTERVAL_S - time.monotonic()
        if wait_s > 0 and self.shutdown.wait(wait_s):
            return
        self.actors.restarting(index)  # the row shows none of the dead process's figures from here on
        self._spawn(index)

    def drain(self) -> None:
        """Stop admission, let live requests finish for drain_timeout_s, then abort the rest with a clear
        error (answered by the API) before the actors stop."""
        from actors.messages import RequestError, to_wire
        from ipc.state_table import RequestState

        self.status.rec["draining"] = 1
        deadline = time.monotonic() + self.layout.config.drain_timeout_s
        while self.state.live_slots() and time.monotonic() < deadline:
            time.sleep(0.05)
        live = self.state.live_slots()
        if not live:
            return
        for slot in live:
            row = self.state.row(slot)
            try:
                aborted = self.state.transition(slot, int(row["generation"]), RequestState.ABORTED, by="supervisor")
            except ShmLockTimeoutError as exc:   # a stopped or hung holder: stop() kills every actor next
                log.error("drain: cannot abort the %d live requests: %s", len(live), exc)
                return
            if aborted:
                try:
                    self.queues["q_api"].put(to_wire(RequestError(
                        slot, int(row["generation"]), 503, "engine_error",
                        "the engine is shutting down; retry on another replica")), timeout_s=0)
                except PdserveError:
                    pass
        answered = time.monotonic() + 1.0  # give the API a moment to answer those clients
        while time.monotonic() < answered and any(
                int(self.state.row(slot)["state"]) == RequestState.ABORTED for slot in live):
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop every actor (the status record's stop flag, then SIGKILL after STOP_JOIN_TIMEOUT_S: the children
        ignore SIGTERM), join them, unlink every segment."""
        status = getattr(self, "status", None)   # absent: start-up failed before the segments existed
        if status is not None and not status.closed:
            status.rec["stopping"] = 1
        deadline = time.monotonic() + STOP_JOIN_TIMEOUT_S
        for process in self.processes.values():
            process.join(timeout=max(deadline - time.monotonic(), 0.1))
        for index, process in self.processes.items():
            if process.is_alive():
                log.error("actor %s (pid %d) did not stop within %.0f s; killing it", self.topology.names[index],
                          process.pid, STOP_JOIN_TIMEOUT_S)
                process.kill()
                process.join(timeout=2)
        for index, process in self.processes.items():
            log.info("actor %s exited with code %s", self.topology.names[index], process.exitcode)
        self._unlink_segments()
        if self._stop_w >= 0:   # the stop pipe: a later request_stop (a late signal) writes nothing
            stop_w, self._stop_w = self._stop_w, -1
            os.close(stop_w)
            os.close(self._stop_r)


def serve(loaded: LoadedConfig) -> int:
    """Run the engine in the foreground until SIGTERM or SIGINT (to this process alone or to its whole process
    group: the children ignore both and leave the decision here), then drain; returns the exit status."""
    from ipc.manifest import reclaim_stale_engines

    reclaim_stale_engines()   # what SIGKILLed engines left in /dev/shm (logged per engine)
    supervisor = Supervisor(loaded)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: supervisor.request_stop())
    try:
        layout = supervisor.start()
    except PdserveError as exc:
        log.error("start-up failed: %s", exc)
        return 1
    cfg = layout.config
    address = f"{cfg.host}:{layout.http_port}"
    where = (f"https://{address} (HTTP/2 via ALPN and HTTP/1.1 over TLS)" if cfg.ssl_certfile
             else f"http://{address} (HTTP/1.1 and h2c)")
    print(f"pdserve engine {layout.engine_id} serving '{layout.served_model_name}' on {where}", flush=True)
    try:
        return supervisor.run()
    finally:
        supervisor.stop()
