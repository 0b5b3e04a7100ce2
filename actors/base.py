"""Process-actor base: constructor in the parent (picklable), ``on_start`` in the child, a thin loop.

Lifecycle of one actor process (spawn start method):
    parent: Actor(layout, index)  -> pickled into the child
    child:  _child_main -> on_start() (heavy imports, shm attach, model load)
            -> actor table status READY -> on_ready() -> loop: run_once(); heartbeat  (until the status record's
               stop flag)
            -> on_stop() -> status STOPPED
The heartbeat (count, CLOCK_MONOTONIC ns, loop iterations) is written to the shm actor table on every
loop iteration, idle ones included, so the heartbeat monitor can tell a hung actor from an idle one.
Modelled on pykka's actor hooks; the loop itself stays thin and delegates to plain synchronous code.

Signals: only the supervisor decides that the engine stops. A child ignores SIGTERM, SIGINT and SIGHUP (each
logged), so a signal sent to one child, or to the whole process group as systemd and Ctrl-C do, never stops the
engine behind the supervisor's back: the supervisor gets the same signal and drains. SIGKILL an actor to have it
restarted. A child learns that the supervisor died from PARENT_DEATH_SIGNAL (Linux PR_SET_PDEATHSIG, checked
against the parent pid, so a stray one is ignored) and from its loop's parent-pid check, never from SIGTERM.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
from dataclasses import dataclass, field
from typing import Any, Callable

from actors.topology import topology
from pdserve.config import EngineConfig

log = logging.getLogger("pdserve.actors")

@dataclass(frozen=True)
class ModelShape:
    """What the supervisor reads from the model's metadata to size the KV pools (no weights loaded)."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    context_length: int
    family: str = "llama"   # gpu/families.py; the API picks its output parsers by it (api/formats.py)


@dataclass(frozen=True)
class EngineLayout:
    """Names of every shared segment of one engine, plus its config: all an actor needs to attach.

    ``config`` holds the values as given (``max_model_len`` 0 = fit, ``port`` 0 = any free one); the resolved
    values have their own names here: ``max_context_tokens`` and ``http_port``.
    """

    engine_id: str
    config: EngineConfig
    model_path: str
    served_model_name: str
    shape: ModelShape
    max_context_tokens: int   # longest prompt + output in tokens: config.max_model_len, or the fit if that is 0
    http_port: int            # config.port, or the free port picked if that is 0
    kv_blocks_per_pool: int
    kv_dtype: str = "float32"   # the KV pools' element type: config.kv_cache_dtype resolved (pdserve.config)
    kv_pool_note: str = ""      # how the pools' size was chosen (kv_pool_tokens given, or auto and why)
    segments: dict[str, str] = field(default_factory=dict)
    config_sources: dict[str, str] = field(default_factory=dict)

    def effective_config(self) -> dict[str, dict[str, Any]]:
        """``{field: {"value": v, "source": "default"|"env"|"flag"}}`` for tools/inspect (secrets hidden); a field
        the engine resolves at start-up (``max_model_len``, ``port``, ``kv_cache_dtype``, ``kv_pool_tokens``) also
        carries ``"resolved"``: what this engine runs with (``kv_pool_tokens``: with ``"why"``, the start-up line's
        reason)."""
        from pdserve.config import redacted

        values = redacted(self.config)
        out = {k: {"value": v, "source": self.config_sources.get(k, "default")} for k, v in values.items()}
        resolved = {"max_model_len": self.max_context_tokens, "port": self.http_port, "kv_cache_dtype": self.kv_dtype,
                    "kv_pool_tokens": self.kv_blocks_per_pool * self.config.kv_block_tokens}
        for name, value in resolved.items():
            if name in out:
                out[name]["resolved"] = value
        if "kv_pool_tokens" in out and self.kv_pool_note:
            out["kv_pool_tokens"]["why"] = self.kv_pool_note
        return out

    def segment(self, what: str) -> str:
        return self.segments[what]


ENGINE_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)   # the supervisor's alone to act on
PARENT_DEATH_SIGNAL = signal.SIGUSR2   # what Linux sends a child when the supervisor dies (PR_SET_PDEATHSIG)
_PR_SET_PDEATHSIG = 1


def supervisor_pid() -> int:
    """The pid of the process that spawned this one (multiprocessing's record, which stays right after the
    parent died and the child was re-parented; os.getppid() outside multiprocessing)."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    return parent.pid if parent is not None and parent.pid else os.getppid()


def parent_is_gone(parent_pid: int) -> bool:
    return os.getppid() != parent_pid


def leave_signals_to_the_supervisor(name: str, on_parent_death: Callable[[], None]) -> int:
    """Signal policy of every child process; call first thing in the child. Returns the supervisor's pid.

    SIGTERM, SIGINT and SIGHUP are ignored with a log line (a Python handler, not SIG_IGN, so processes this one
    starts get the default actions back). ``on_parent_death()`` is called from a signal handler when the
    supervisor dies (PARENT_DEATH_SIGNAL, ignored while the supervisor is alive), and at once if it died
    before the request was registered. The supervisor starts children with ENGINE_STOP_SIGNALS blocked
    (``Supervisor._spawn``; a blocked mask survives fork and exec): a signal that arrives before this runs stays
    pending and is ignored here, instead of killing the half-started child with the default action.
    """
    parent = supervisor_pid()

    def ignore(signum, _frame) -> None:
        log.warning("%s (pid %d) ignores %s: only the supervisor stops the engine (signal the supervisor, pid %d); "
                    "SIGKILL restarts this process", name, os.getpid(), signal.Signals(signum).name, parent)

    def parent_death(_signum, _frame) -> None:
        if parent_is_gone(parent):
            on_parent_death()

    for sig in ENGINE_STOP_SIGNALS:
        signal.signal(sig, ignore)
    signal.signal(PARENT_DEATH_SIGNAL, parent_death)
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL))
    except OSError:  # not Linux: the loops' parent-pid checks still end us
        pass
    signal.pthread_sigmask(signal.SIG_UNBLOCK, ENGINE_STOP_SIGNALS)
    if parent_is_gone(parent):   # it died before PR_SET_PDEATHSIG was in place: no signal will come
        on_parent_death()
    return parent


def exit_now() -> None:
    """End a child that has stopped cleanly at once: run multiprocessing's exit finalizers, flush the logs and std
    streams, then ``os._exit(0)``.

    The interpreter's own teardown takes seconds once torch is imported (2-7 s measured on a loaded 2-core
    machine), long enough for the supervisor's stop to hit STOP_JOIN_TIMEOUT_S and SIGKILL the child. The
    finalizers are what multiprocessing's own child bootstrap runs before its ``os._exit``: they unlink the named
    semaphores a library made here (tqdm's lock in the model loader), which the resource tracker otherwise
    reports as leaked at shutdown.
    """
    import multiprocessing.util
    import sys

    multiprocessing.util._exit_function()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


class ParentGone(SystemExit):
    """Raised in an actor (from the parent-death signal handler) when the supervisor died: unwinds the loop so
    ``on_stop`` still runs."""


def run_actor(class_path: str, layout: EngineLayout, index: int, env: dict[str, str] | None = None) -> None:
    """Child process entry: set ``env`` (``CUDA_VISIBLE_DEVICES``: actors/placement.py) before anything imports
    torch, then import ``class_path`` ("module:Class"), build the actor and run its loop."""
    import importlib

    import sys

    os.environ.update(env or {})
    torch = sys.modules.get("torch")
    if env and "CUDA_VISIBLE_DEVICES" in env and torch is not None and torch.cuda.is_initialized():
        raise RuntimeError(f"{class_path}: CUDA was initialised before CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} "
                           f"was set; this actor would not be on its own GPU")
    module, _, name = class_path.partition(":")
    getattr(importlib.import_module(module), name)(layout, index).child_main()


def open_recorder(layout: EngineLayout, index: int):
    """Attach the flight recorder (ipc/recorder.py) and install sub-ring ``index`` as this process's; None when
    the engine runs without one (recorder_events=0)."""
    from ipc import recorder

    if "recorder" not in layout.segments:
        return None
    ring = recorder.Recorder.attach(layout.segment("recorder"))
    recorder.install(ring, index, index)
    return ring


class Actor:
    """Base class. Subclasses implement ``on_start``, ``run_once()`` and optionally ``on_stop``.

    ``idle_wait_s`` (config) is the longest a loop iteration may block on the inbox when there is no work;
    ``queue_put_timeout_s`` (config) the longest a put may block on a full queue.
    """

    role = "actor"

    def __init__(self, layout: EngineLayout, index: int):
        self.layout = layout
        self.config = layout.config
        self.index = index
        self.topology = topology(layout.config)
        self.name = self.topology.names[index]
        self.idle_wait_s = layout.config.idle_wait_s
        self.queue_put_timeout_s = layout.config.queue_put_timeout_s

    # ---- hooks ------------------------------------------------------------------------------------
    def on_start(self) -> None:
        """Runs in the child before READY: attach shm, load the model. Raise to fail start-up."""

    def run_once(self) -> None:
        """One loop iteration; must return within about ``idle_wait_s`` when there is nothing to do."""
        raise NotImplementedError

    def on_ready(self) -> None:
        """Runs in the child once its status reads READY, before the loop: work no request needs at once (a
        background warm-up), kept out of the engine's start-up."""

    def on_stop(self) -> None:
        """Runs in the child after the loop ends; answer or fail what is still queued."""

    # ---- child process entry ----------------------------------------------------------------------
    def engine_stopping(self) -> bool:
        """Whether the supervisor has stopped the engine (ipc/engine_status.py's ``stopping``; only it sets it)."""
        return bool(self.status.rec["stopping"])

    def enter_child(self, on_parent_death: Callable[[], None], status_readonly: bool = False) -> int:
        """What every child does first (the API's own entry too): logging, signals left to the supervisor
        (``on_parent_death`` runs when it dies), the engine status attached (``engine_stopping`` reads it), its
        actor-table row marked starting, its flight recorder. Returns the supervisor's pid (for
        ``parent_is_gone``)."""
        logging.basicConfig(level=self.config.log_level.upper(),
                            format=f"%(asctime)s {self.name} %(levelname)s %(message)s")
        parent = leave_signals_to_the_supervisor(self.name, on_parent_death)
        from ipc.actor_table import ActorTable
        from ipc.engine_status import EngineStatus

        self.actors = ActorTable.attach(self.layout.segment("actors"))
        self.status = EngineStatus.attach(self.layout.segment("status"), readonly=status_readonly)
        self.actors.starting(self.index, os.getpid())
        self.recorder = open_recorder(self.layout, self.index)
        from actors.forensics import arm

        arm(self.layout.engine_id, self.name)   # SIGUSR1: its threads' stacks, for an incident's holder report
        return parent

    def wait_out_stuck_locks(self, parent: int) -> None:
        """A shm lock (state table, queue mutex) that another live process holds past its timeout, a stopped or
        hung neighbour, is waited out here, heartbeat beating, until the supervisor kills the holder and the lock
        is taken over, instead of the ShmLockTimeoutError killing this healthy actor and what it holds mid-step
        (``ipc.state_table.set_lock_wait_hook``). Not while the engine stops or after the supervisor died: then
        the error is raised. Logged once per lock and holder."""
        from ipc.state_table import set_lock_wait_hook

        logged: set[tuple[str, str]] = set()

        def wait_on(what: str, who: str) -> bool:
            if self.engine_stopping() or parent_is_gone(parent):
                return False
            if (what, who) not in logged:
                if len(logged) > 64:
                    logged.clear()
                logged.add((what, who))
                log.warning("%s waits: the %s is held by %s; the supervisor kills a hung holder", self.name,
                            what, who)
            self.actors.beat(self.index, iterations_delta=0)
            return True

        set_lock_wait_hook(wait_on)

    def child_main(self) -> None:
        """The child's entry; the loop runs until the supervisor sets the stop flag (``engine_stopping``) or
        dies."""
        def parent_died() -> None:
            raise ParentGone(f"{self.name}: the supervisor is gone; exiting")

        parent = self.enter_child(parent_died)
        from ipc.actor_table import ActorStatus

        if self.role in ("prefill", "decode"):
            self.wait_out_stuck_locks(parent)
        self.on_start()
        self.actors.set_status(self.index, ActorStatus.READY)
        self.actors.beat(self.index)
        log.info("%s ready (pid %d)", self.name, os.getpid())
        self.on_ready()
        try:
            while not self.engine_stopping() and not parent_is_gone(parent):
                self.run_once()
                self.actors.beat(self.index)
        finally:
            self.actors.set_status(self.index, ActorStatus.STOPPING)
            try:
                self.on_stop()
            finally:
                self.actors.set_status(self.index, ActorStatus.STOPPED)
        exit_now()   # the loop ended normally (stop flag or parent gone); an exception takes the usual way out
