"""HeartbeatMonitor: its own process on its own timer (``monitor_tick_s``), never driven by request traffic.

Each tick it reads the shm state table and the actor table and:
1. times out every live request past a deadline (actors/watchdog.py): TIMED_OUT(stage) in the table,
   a 504 RequestError to the API, ``timeouts[stage] += 1``, one log line. The actors see the final row on
   their next loop iteration and free the request's KV blocks, each its own side, exactly once (a watchdog
   drill's row, api/drill.py: its stage deadline is ``drill_timeout_s``; not counted, no incident, a DEBUG line);
2. classifies each actor as ok / hung / dead and fails the requests a dead or hung actor holds (503,
   retryable); the supervisor restarts the actor (killing a hung one first);
3. tracks stuck queue gauges and cross-checks the actors' own counts against the table;
4. releases final rows nobody released for ``FINAL_ROW_RECLAIM_S`` (the API died before answering); a row a
   request on a live connection still writes out (connection ledger) is the API's while it is alive;
5. with a connection ledger, runs the connection detectors (actors/connection_watch.py) over it;
6. drains an engine actor whose requests keep timing out in one stage (actors/ejection.py: the actor table's
   ``drained``, which the API's router reads) and readmits it when the API's readmission drill on it passed
   (``readmit_drain``), or, with no drills to run, after ``eject_readmit_s``.
It blocks on nothing but its timer: every put is non-blocking and every lock wait is bounded, so it
keeps ticking while every other actor is stopped, hung or dead. A lock held past its timeout by a stopped or hung
process (ShmLockTimeoutError) ends that tick only: every actor's health was written before the first lock wait,
so the holder is still marked hung (and killed by the supervisor), and the next tick retries.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from actors.base import Actor
from actors.topology import MONITOR_INDEX, Topology
from actors.messages import RequestError, to_wire
from actors.watchdog import state_mask
from ipc.lifecycle import FINAL_STATES, LIVE_STATES, held_by
from ipc.lifecycle import RequestState as S
from pdserve.errors import ShmLockTimeoutError

log = logging.getLogger("pdserve.monitor")

# The states in which an actor of a role holds a request in its own memory (a message it consumed, KV blocks, a
# batch slot): if the actor dies or hangs, these requests cannot progress and are failed at once.
HELD_STATES = {"prefill": held_by("prefill"), "decode": held_by("decode"), "api": LIVE_STATES}


def held_mask(rows: np.ndarray, topology: Topology, index: int) -> np.ndarray:
    """Rows (a state-table snapshot) that actor ``index`` holds or is due to take: in a state its role holds a
    request in, and naming it as the row's actor of that role (``prefill_actor`` / ``decode_actor``; the API
    holds every live row). A decode actor also answers for its rows still at prefill: in colocated mode it
    prefills them itself; otherwise their KVReady would wait in its dead inbox until its restart or the
    bootstrap deadline (the router chose it at admission and cannot move them). Shape (num_rows,)."""
    role = topology.role(index)
    states = rows["state"]

    def held(states_of_role) -> np.ndarray:
        return state_mask(states_of_role)[states]
    if role == "api":
        return held(LIVE_STATES)
    if role == "prefill":
        return held(HELD_STATES["prefill"]) & (rows["prefill_actor"] == index)
    if role == "decode":
        return held(HELD_STATES["decode"] | HELD_STATES["prefill"]) & (rows["decode_actor"] == index)
    return np.zeros(len(rows), dtype=bool)


def fail_requests_held_by(table, status, to_api, topology: Topology, index: int, message: str, *, by: int,
                          rows: np.ndarray | None = None, role: str = "monitor",
                          counter: str = "actor_failures") -> int:
    """Fail (503, retryable) every live request that actor ``index`` holds (``held_mask``); returns how many.

    Used by the monitor for dead or hung actors and by the supervisor the moment it sees an actor's process
    exit (before restarting it, so a fast restart cannot hide the death from the monitor's next tick). Every
    put is non-blocking; after one put timed out on the API inbox's lock (a stopped producer holds it) the rest
    are skipped, so a call waits at most one lock timeout there (the API's own deadline answers those clients).
    ``counter``: the status field this caller writes (each has one writer: the supervisor passes
    ``"exit_failures"``).

    Raises:
        ShmLockTimeoutError: a live process holds the state table lock past its timeout (the rows not yet
            failed stay as they are; call again later).
    """
    rows = table.snapshot() if rows is None else rows
    failed = 0
    api_lock_stuck = False
    for slot in np.flatnonzero(held_mask(rows, topology, index)):
        slot, generation = int(slot), int(rows["generation"][slot])
        stage = int(rows["state"][slot])
        if table.transition(slot, generation, S.FAILED, owner=by, by=role):
            failed += 1
            status.rec[counter][stage] += 1
            if api_lock_stuck:
                continue
            try:
                to_api.put(to_wire(RequestError(slot, generation, 503, "engine_error", message)), timeout_s=0)
            except Exception as exc:  # noqa: BLE001 - API inbox full or gone: the API's own deadline answers
                api_lock_stuck = isinstance(exc, ShmLockTimeoutError)
                log.warning("could not notify the API about slot %d: %s", slot, exc)
    return failed


def record_http_problem(finding) -> None:
    """The flight recorder's HTTP_PROBLEM event in the timeline of each request a connection finding is about
    (actors/connection_watch.py; ipc/recorder.py)."""
    from ipc.ledger import DETECTIONS
    from ipc.recorder import EventKind, record_request

    for slot, generation, request_id in finding.requests:
        record_request(EventKind.HTTP_PROBLEM, request_id, slot, generation, a=finding.conn_id,
                       b=int(finding.age_s * 1e9), aux=DETECTIONS.index(finding.reason) + 1)


def record_timeout(expired) -> None:
    """The flight recorder's TIMEOUT event: which deadline fired, at what age (ipc/recorder.py)."""
    from ipc.recorder import EventKind, TimeoutReason, record_request

    record_request(EventKind.TIMEOUT, expired.request_id, expired.slot, expired.generation, old=int(expired.stage),
                   a=int(expired.age_s * 1e9), b=int(expired.limit_s * 1e9),
                   aux=int(TimeoutReason[expired.reason.upper()]))


def diverging_text(rows: np.ndarray, api_actor: int) -> tuple[str, list[str]]:
    """Which ids the API holds that the table does not and the reverse, from the flight recorder
    (ipc/timeline.py's ``diverging_ids``), for the mismatch log line; and those ids (for the incident bundle)."""
    from ipc.recorder import installed
    from ipc.timeline import diverging_ids

    writer = installed()
    if writer is None:
        return "no flight recorder to name the ids (recorder_events=0)", []
    diff = diverging_ids(writer.recorder.events(), rows, api_actor)
    named = [e["request_id"] for e in diff["api_only"] + diff["table_only"] if e["request_id"]]

    def ids(entries) -> str:
        return ", ".join(e["request_id"] or f"slot {e['slot']} gen {e['generation']} key {e['key']}"
                         for e in entries[:10]) or "none"
    return (f"ids the API holds and the table does not: {ids(diff['api_only'])}; the table holds and the API does "
            f"not: {ids(diff['table_only'])} (their timelines: tools/inspect --reconcile)"), named


def table_counts_by_actor(rows: np.ndarray, indices, since_ns: int = 0) -> dict[int, int]:
    """Per engine actor index, the rows (a state-table snapshot) not FREE, allocated at or after ``since_ns``
    (monotonic ns), that name it as their prefill or decode actor: what the router's ``routed_requests`` for that
    actor should equal (the API holds a row from admission until it releases it)."""
    used = (rows["state"] != int(S.FREE)) & (rows["created_ns"] >= since_ns)
    return {i: int(np.count_nonzero(used & ((rows["prefill_actor"] == i) | (rows["decode_actor"] == i))))
            for i in indices}


# the API publishes its counts at every admission and release (and every idle_wait_s), so they lag the table by a
# moment only: a disagreement seen on this many consecutive ticks is flagged (the second tick that sees it)
ROUTER_MISMATCH_TICKS = 2


FINAL_ROW_RECLAIM_S = 30.0
_FINAL = state_mask(FINAL_STATES)
LOCK_STUCK_LOG_INTERVAL_S = 30.0   # ticks cut short by one stuck lock are logged once, then this often
MISMATCH_MIN_S = 5.0  # a disagreement must persist this long (counts race by a loop iteration or a message)


class HeartbeatMonitor(Actor):
    role = "monitor"

    def __init__(self, layout, index: int = MONITOR_INDEX):
        super().__init__(layout, index)

    def on_start(self) -> None:
        from actors.watchdog import StuckGaugeTracker, stage_limits_ns
        from ipc.engine_status import GAUGES
        from ipc.shm_queue import ShmQueue
        from ipc.state_table import RequestState, StateTable

        self.S = RequestState
        self.table = StateTable.attach(self.layout.segment("state"))
        self.to_api = ShmQueue.attach(self.layout.segment("q_api"))
        self.limits_ns = stage_limits_ns(self.config)
        self.drill_limit_ns = int(self.config.drill_timeout_s * 1e9) if self.config.drill_interval_s > 0 else 0
        from actors.fault_ports import HeldRequests
        from pdserve.faults import FaultPlan

        self.blind = HeldRequests(FaultPlan(self.config.faults, "monitor"))   # the monitor_blind fault
        self.gauges = StuckGaugeTracker(self.config.stuck_gauge_s)
        self.tick_ns = int(self.config.monitor_tick_s * 1e9)
        self.next_tick_ns = time.monotonic_ns()
        self.mismatch_since_ns = [0] * len(GAUGES)
        self.topology_engine = self.topology.prefill + self.topology.decode
        self.router_mismatch_ticks = {i: 0 for i in self.topology_engine}
        # our last verdict per actor: the table's health reads UNKNOWN until a new process calls ``starting``,
        # so comparing with it would log the same verdict every tick while an actor starts
        self.logged_health: dict[int, int] = {}
        self.lock_stuck_since_ns = 0      # first tick of the current run of ticks cut short by a stuck lock
        self.lock_stuck_logged_ns = 0
        self.conn_watch = None            # the connection detectors (actors/connection_watch.py), with a ledger
        if "conns" in self.layout.segments:
            from actors.connection_watch import ConnectionWatch
            from ipc.ledger import ConnectionLedger

            self.ledger = ConnectionLedger.attach(self.layout.segment("conns"))
            self.conn_watch, self.conn_flags = ConnectionWatch(), {}
        self.start_ejection()
        from actors.watchdog import BlockConservation
        from ipc.kv_pool import KVPool

        self.conservation = BlockConservation()   # KV blocks owned while their actor holds no request
        self.pools = {i: KVPool.attach(self.layout.segment(self.topology.segment("kv", i)), readonly=True)
                      for i in self.topology_engine if self.topology.segment("kv", i) in self.layout.segments}
        self.incidents = None             # incident bundles (actors/incidents.py), with an incident_dir
        if self.config.incident_dir:
            from actors.incidents import IncidentWriter, LogTail

            self.log_tail = LogTail()
            logging.getLogger().addHandler(self.log_tail)
            self.incidents = IncidentWriter(self.layout.engine_id, self.config.incident_dir,
                                            self.config.incident_min_interval_s, self.config.incident_dir_max_bytes,
                                            self.log_tail)

    def start_ejection(self) -> None:
        """The ejection counter (None: ``eject_timeouts`` 0), its drains as the table has them (a restarted
        monitor goes on with them), and how a drained actor comes back: a drill (the API runs them on an engine
        of both sides with ``drill_interval_s`` > 0) or ``eject_readmit_s``."""
        from actors.ejection import Drain, Ejection

        topo = self.topology
        self.ejection = None
        if not self.config.eject_timeouts:
            return
        self.ejection = Ejection(topo.names, {i: topo.role(i) for i in self.topology_engine},
                                 self.config.eject_timeouts, self.config.eject_window_s)
        self.readmit_by_drill = self.config.drill_interval_s > 0 and self.config.role == "both"
        for row in self.actors.rows():
            if row["index"] in self.topology_engine and row["drained"]:
                self.ejection.drained[row["index"]] = Drain(row["index"], row["name"], S(row["drained"]),
                                                            int(row["drain_timeouts"]), self.config.eject_window_s,
                                                            time.monotonic_ns())

    def on_stop(self) -> None:
        if self.incidents is not None:
            self.incidents.close()

    def incident(self, kind: str, detail: str, request_ids=(), expired=None, holders=()) -> None:
        """Hand an incident to the bundle writer (never blocks; rate-limited there); a no-op without one.
        ``holders``: actor indices whose stacks the bundle takes (a timeout's: the row's owner)."""
        if self.incidents is None:
            return
        from actors.incidents import Incident, timeout_incident

        base_url = f"http://{self.config.host}:{self.layout.http_port}"
        self.incidents.report(timeout_incident(expired, base_url) if expired is not None else
                              Incident(kind, detail, [r for r in request_ids if r], base_url=base_url,
                                       holders=list(holders)))

    def run_once(self) -> None:
        delay_ns = self.next_tick_ns - time.monotonic_ns()
        if delay_ns > 0:
            time.sleep(delay_ns / 1e9)  # the monitor's own timer; nothing else wakes it
        self.next_tick_ns = max(self.next_tick_ns + self.tick_ns, time.monotonic_ns())
        cpu_start = time.thread_time_ns()
        try:
            self.tick()
            self.lock_freed()
        except ShmLockTimeoutError as exc:
            self.lock_stuck(exc)
        except Exception:  # noqa: BLE001 - the watchdog must survive its own bugs and keep ticking
            log.exception("watchdog tick failed")
        rec = self.status.rec
        rec["watchdog_tick_cpu_ns"] = time.thread_time_ns() - cpu_start
        rec["watchdog_ticks"] += 1
        rec["watchdog_last_tick_ns"] = time.monotonic_ns()
        rec["watchdog_last_tick_s"] = time.time()

    def lock_stuck(self, exc: ShmLockTimeoutError) -> None:
        """A tick ended on a lock a live process holds past its timeout: log once per incident (then every
        LOCK_STUCK_LOG_INTERVAL_S), retry on the next tick."""
        now_ns = time.monotonic_ns()
        self.lock_stuck_since_ns = self.lock_stuck_since_ns or now_ns
        if not self.lock_stuck_logged_ns or now_ns - self.lock_stuck_logged_ns >= LOCK_STUCK_LOG_INTERVAL_S * 1e9:
            self.lock_stuck_logged_ns = now_ns
            log.error("watchdog tick cut short, retried every tick until the lock frees: %s", exc)

    def lock_freed(self) -> None:
        if self.lock_stuck_since_ns:
            log.warning("watchdog ticks complete again after %.1f s of a stuck lock",
                        (time.monotonic_ns() - self.lock_stuck_since_ns) / 1e9)
            self.lock_stuck_since_ns = self.lock_stuck_logged_ns = 0

    # ---- one tick -----------------------------------------------------------------------------------
    def tick(self) -> None:
        from actors.watchdog import find_expired

        # "now" is read AFTER each read of the table: every stamp a row can hold is then <= now (one
        # CLOCK_MONOTONIC for all processes), so a row moving on between "now" and the read is never mistaken
        # for one with a timestamp from the future (a false "engine bug" 500)
        rows = self.table.snapshot()
        now_ns = time.monotonic_ns()
        if not self.engine_stopping():   # once the supervisor stops the engine, actors exiting are not deaths
            self.check_actors(rows, now_ns)
        candidates = find_expired(rows, now_ns, self.config, self.limits_ns, self.drill_limit_ns)
        self.blind.forget({(c.slot, c.generation) for c in candidates})
        candidates = [c for c in candidates
                      if not self.blind.held("monitor_blind", (c.slot, c.generation), c.request_id)]
        if candidates:  # the snapshot is consistent per field only: decide again on rows read consistently
            slots = [c.slot for c in candidates]
            fresh = self.table.consistent_rows(slots)
            again = find_expired(fresh, time.monotonic_ns(), self.config, self.limits_ns, self.drill_limit_ns)
            for confirmed in again:
                if self.expire(dataclasses.replace(confirmed, slot=slots[confirmed.slot])) \
                        and confirmed.reason == "stage_deadline":
                    self.blame(fresh[confirmed.slot], confirmed.request_id)
        rows = self.table.snapshot()
        now_ns = time.monotonic_ns()
        actor_rows = self.actors.rows()   # read once for both checks below
        self.check_gauges(rows, now_ns, actor_rows)
        self.check_router_counts(rows, actor_rows)
        live = self.ledger.live_rows() if self.conn_watch is not None else None   # one read for both below
        self.reclaim_final_rows(rows, now_ns, lambda: self.held_by_live_api(actor_rows, rows, live))
        if live is not None:
            self.check_connections(live)
        self.check_blocks(rows, actor_rows)
        self.check_drained(actor_rows, now_ns)

    def check_blocks(self, rows, actor_rows) -> None:
        """Conservation of KV blocks: a block a READY actor owns while it holds no live request (two checks
        running) is named, with the request its owner slot last held, in an ERROR line and an incident. An actor
        starting (its warm-up borrows a block) is not judged."""
        from ipc.actor_table import ActorStatus
        from ipc.engine_status import CONSERVATION_KINDS

        for index, pool in self.pools.items():
            ready = int(actor_rows[index]["status"]) == int(ActorStatus.READY)
            leaked = self.conservation.check(index, pool.owner_slots(), lambda i=index, r=ready: not r or bool(
                held_mask(rows, self.topology, i).any()))
            if not leaked:
                continue
            ids = sorted({rows["request_id"][slot].decode(errors="replace") for _, slot in leaked
                          if 0 <= slot < len(rows)} - {""})
            detail = (f"KV blocks leaked on {self.topology.names[index]}: {len(leaked)} blocks owned by no live "
                      f"request (block:slot {', '.join(f'{b}:{s}' for b, s in leaked[:10])}; slots last held "
                      f"{', '.join(ids) or 'no id'})")
            log.error("conservation: %s", detail)
            self.status.rec["conservation"][CONSERVATION_KINDS.index("blocks")] += 1
            self.incident("conservation", detail, ids, holders=[index])

    def _notify(self, slot: int, generation: int, status: int, error_type: str, message: str) -> None:
        try:
            self.to_api.put(to_wire(RequestError(slot, generation, status, error_type, message)), timeout_s=0)
        except Exception as exc:  # noqa: BLE001 - API inbox full or gone: the API's own deadline answers
            log.warning("could not notify the API about slot %d: %s", slot, exc)

    def blame(self, row, request_id: str) -> None:
        """A stage deadline fired (or a gauge stuck) on ``row`` (a state-table row, as read before): one timeout
        of its stage for the actor the stage blames (actors/ejection.py ``stage_actor``), which may drain it."""
        from actors.ejection import stage_actor
        from ipc.actor_table import ActorHealth, ActorStatus

        if self.ejection is None:
            return
        state = int(row["state"])
        actor = stage_actor(state, int(row["prefill_actor"]), int(row["decode_actor"]))
        rows = self.actors.rows()
        serving = [r["index"] for r in rows if r["status"] == ActorStatus.READY and not r["drained"]
                   and r["health"] not in (ActorHealth.HUNG, ActorHealth.DEAD)]
        drain, note = self.ejection.record(actor, state, time.monotonic_ns(), request_id, serving)
        if note:
            log.warning("ejection: %s", note)
        if drain is not None:
            number = self.actors.drain(drain.actor, int(drain.stage), drain.timeouts)
            after = ("a readmission drill on it passes" if self.readmit_by_drill else
                     f"eject_readmit_s={self.config.eject_readmit_s:g} passed (no drills run here)")
            log.error("ejection: %s (the last: request %s); it takes no new work until %s, its running requests "
                      "go on (drain %d)", drain.reason, request_id, after, number)

    def check_drained(self, actor_rows: list[dict], now_ns: int) -> None:
        """Readmit each drained actor whose readmission drill passed (the API set its ``readmit_drain`` to this
        drain's number) or, with no drills, that has been drained ``eject_readmit_s``."""
        if self.ejection is None or not self.ejection.drained:
            return
        cool_down_s = None if self.readmit_by_drill else self.config.eject_readmit_s
        for index in list(self.ejection.drained):
            row = actor_rows[index]
            why = self.ejection.readmit_due(index, int(row["readmit_drain"]) == int(row["drains"]), now_ns,
                                            cool_down_s)
            if why is None:
                continue
            drain = self.ejection.readmit(index)
            self.actors.undrain(index)
            log.warning("ejection: %s readmitted after %s (it was %s)", row["name"], why, drain.reason)

    def expire(self, expired) -> bool:
        """Time ``expired`` out (FAILED for a bad timestamp); False if the row moved on since (it was not stuck)."""
        final = self.S.FAILED if expired.reason == "bad_timestamp" else self.S.TIMED_OUT
        if not self.table.transition(expired.slot, expired.generation, final, owner=self.index, by="monitor"):
            return False  # it finished (or was aborted) since the snapshot: it was not stuck
        record_timeout(expired)
        rec = self.status.rec
        if expired.reason == "bad_timestamp":
            self._notify(expired.slot, expired.generation, 500, "internal_error", expired.message())
        else:
            if not expired.drill:   # a drill's timeout is the drill's success (api/drill.py), not a client's 504
                rec["timeouts"][int(expired.stage)] += 1
            self._notify(expired.slot, expired.generation, 504, "timeout_error", expired.message())
        names = self.topology.names
        owner = names[expired.owner] if 0 <= expired.owner < len(names) else "none"
        log.log(logging.DEBUG if expired.drill else logging.WARNING,   # a drill's verdict is the API's to log
                "timeout: request=%s stage=%s age_s=%.3f owner=%s reason=%s", expired.request_id,
                expired.stage.name.lower(), expired.age_s, owner, expired.reason)
        if not expired.drill:
            self.incident("timeout", expired.message(), expired=expired)
        return True

    def check_actors(self, rows: np.ndarray, now_ns: int) -> None:
        from actors.watchdog import classify_actor
        from ipc.actor_table import ActorHealth, ActorStatus, pid_alive

        actor_rows = self.actors.rows()
        verdicts = {}
        for index in range(len(self.topology.names)):   # every verdict first: failing requests may wait on a lock
            if index == self.topology.monitor:
                continue
            row = actor_rows[index]
            pid = int(row["pid"])
            health = classify_actor(pid, pid > 0 and pid_alive(pid), int(row["status"]) == ActorStatus.READY,
                                    int(row["heartbeat_ns"]), now_ns, self.config.actor_hang_timeout_s)
            if health != self.logged_health.get(index):
                self.logged_health[index] = health
                level = logging.INFO if health in (ActorHealth.OK, ActorHealth.UNKNOWN) else logging.ERROR
                log.log(level, "actor %s (pid %d) is %s", self.topology.names[index], pid, health.name.lower())
                if health in (ActorHealth.DEAD, ActorHealth.HUNG):
                    held = np.flatnonzero(held_mask(rows, self.topology, index))
                    self.incident("actor", f"actor {self.topology.names[index]} (pid {pid}) is "
                                  f"{health.name.lower()}", [rows["request_id"][s].decode(errors="replace")
                                                             for s in held[:20]], holders=[index])
            self.actors.set_health(index, health)
            verdicts[index] = (health, (now_ns - int(row["heartbeat_ns"])) / 1e9)
        for index, (health, age_s) in verdicts.items():
            if health in (ActorHealth.DEAD, ActorHealth.HUNG):
                why = ("dead (its process exited)" if health == ActorHealth.DEAD
                       else f"hung (no heartbeat for {age_s:.1f} s)")
                self.fail_held(rows, index, f"actor {self.topology.names[index]} is {why}; the request was dropped, "
                                            "retry it")

    def fail_held(self, rows: np.ndarray, index: int, message: str) -> None:
        fail_requests_held_by(self.table, self.status, self.to_api, self.topology, index, message,
                              by=self.index, rows=rows)

    def check_gauges(self, rows: np.ndarray, now_ns: int, actor_rows: list[dict]) -> None:
        """Stuck gauges from ``rows`` (a state-table snapshot), and the table's counts against the actors' own
        (``actor_rows``: ``ActorTable.rows()``)."""
        from ipc.actor_table import sum_own_gauges
        from ipc.engine_status import GAUGES

        rec = self.status.rec
        tracked = self.gauges.update(rows, now_ns)
        for i, name in enumerate(GAUGES):
            g = tracked[name]
            if g.stuck and not rec["stuck"][i]:
                oldest = self.gauges.oldest(rows, name)
                rid = rows["request_id"][oldest[0]].decode(errors="replace") if oldest else "?"
                age = (now_ns - oldest[1]) / 1e9 if oldest else 0.0
                log.error("stuck gauge %s=%d: nothing left the stage for %.1f s; oldest request %s (%.1f s)",
                          name, g.value, (now_ns - g.moved_ns) / 1e9, rid, age)
                self.incident("stuck_gauge", f"stuck gauge {name}={g.value}: nothing left the stage for "
                              f"{(now_ns - g.moved_ns) / 1e9:.1f} s; oldest request {rid} ({age:.1f} s)",
                              [rid] if oldest else [])
                if oldest:   # one timeout of its stage for the actor holding the oldest request
                    self.blame(rows[oldest[0]], rid)
            rec["stuck"][i] = int(g.stuck)
            rec["gauge_nonzero_since_ns"][i] = g.nonzero_since_ns
            rec["gauge_moved_ns"][i] = g.moved_ns
        own = sum_own_gauges(actor_rows)
        for i, name in enumerate(GAUGES):
            if own[i] < 0:
                continue
            if own[i] == tracked[name].value:
                self.mismatch_since_ns[i] = 0
            elif not self.mismatch_since_ns[i]:
                self.mismatch_since_ns[i] = now_ns
            flag = bool(self.mismatch_since_ns[i]) and now_ns - self.mismatch_since_ns[i] >= MISMATCH_MIN_S * 1e9
            if flag and not rec["mismatch"][i]:
                log.error("gauge mismatch %s: actors count %d, the state table %d (the table wins)", name,
                          own[i], tracked[name].value)
                self.incident("gauge_mismatch", f"gauge mismatch {name}: actors count {own[i]}, the state table "
                              f"{tracked[name].value}")
            rec["mismatch"][i] = int(flag)

    def check_router_counts(self, rows: np.ndarray, actor_rows: list[dict]) -> None:
        """Compare the router's per-actor count (actor table, written by the API) with the table's rows the
        current API process allocated (a dead predecessor's wait, final, for the reclaim: nobody counts them); a
        disagreement on more than ROUTER_MISMATCH_TICKS consecutive ticks is flagged (logged once, counted). Not
        while the API is not READY: a (re)starting API has not published its counts yet (a dead one's are left)."""
        from ipc.actor_table import ActorStatus

        if actor_rows[self.topology.api]["status"] != ActorStatus.READY:
            self.router_mismatch_ticks = dict.fromkeys(self.router_mismatch_ticks, 0)
            return
        table_counts = table_counts_by_actor(rows, self.topology_engine,
                                             since_ns=int(actor_rows[self.topology.api]["started_ns"]))
        for row in actor_rows:
            index = row["index"]
            if index not in table_counts or row["routed_requests"] < 0:
                continue
            routed = int(row["routed_requests"])
            agree = routed == table_counts[index]
            self.router_mismatch_ticks[index] = 0 if agree else self.router_mismatch_ticks[index] + 1
            flag = self.router_mismatch_ticks[index] >= ROUTER_MISMATCH_TICKS
            if flag and not row["router_mismatch"]:
                text, ids = diverging_text(rows, self.topology.api)
                log.error("router count mismatch for actor %s: the router counts %d requests on it, the state "
                          "table %d (the table wins); %s", row["name"], routed, table_counts[index], text)
                self.incident("router_mismatch", f"router count mismatch for actor {row['name']}: the router "
                              f"counts {routed}, the state table {table_counts[index]}", ids)
            if flag != bool(row["router_mismatch"]):
                self.actors.set_router_mismatch(index, flag)

    def check_connections(self, live: np.ndarray) -> None:
        """The connection detectors over the ledger (``live``: its ``live_rows()`` this tick): each new finding
        counted and logged once (with its connection and request ids), the standing ones flagged on their rows for
        tools/inspect."""
        from actors.connection_watch import find_problems

        closed = self.ledger.closed_rows()
        slots = sorted({int(s) for s in live["req_slot"].ravel().tolist() if s >= 0})
        fresh = self.table.consistent_rows(slots) if slots else ()
        engine = {slot: (int(r["state"]), int(r["generation"]), int(r["state_since_ns"]))
                  for slot, r in zip(slots, fresh)}
        findings = find_problems(live, closed, engine, time.monotonic_ns(), self.config.http_stall_s)
        new, masks = self.conn_watch.update(findings)
        for finding in new:
            self.ledger.count_detection(finding.reason)
            log.warning("%s", finding.message())
            record_http_problem(finding)
        for row in live:
            index, flag = int(row["index"]), (int(row["conn_id"]), masks.get(int(row["index"]), 0))
            if self.conn_flags.get(index, (0, 0)) != flag:
                self.conn_flags[index] = flag
                self.ledger.set_flags(index, *flag)

    def held_by_live_api(self, actor_rows: list[dict], rows: np.ndarray, live: np.ndarray | None
                         ) -> frozenset[tuple[int, int]]:
        """``(slot, generation)`` of the rows (``rows``: a state-table snapshot) that requests on open connections
        (``live``: the ledger's live rows; None without a ledger) wait on or still write out, while the API process
        is OK: it releases them when their responses end, however
        slow the client. The ledger names one row per HTTP request (``held_by_connections``); the other choices of
        an ``n`` > 1 request are its rows with the same request id. Empty without a ledger or with the API dead,
        hung or restarting."""
        from actors.connection_watch import held_by_connections
        from ipc.actor_table import ActorHealth

        if live is None or actor_rows[self.topology.api]["health"] != ActorHealth.OK:
            return frozenset()
        named = [(s, g) for s, g in held_by_connections(live)
                 if 0 <= s < len(rows) and int(rows["generation"][s]) == g]
        if not named:
            return frozenset()
        ids = rows["request_id"][[s for s, _ in named]]
        same = np.flatnonzero(np.isin(rows["request_id"], ids) & (rows["state"] != int(S.FREE)))
        return frozenset(named) | {(int(s), int(rows["generation"][s])) for s in same}

    def reclaim_final_rows(self, rows: np.ndarray, now_ns: int, held=frozenset) -> None:
        """Release rows final for FINAL_ROW_RECLAIM_S that nobody released (their API process died), except
        those ``held()`` returns (``(slot, generation)``: a live API still writing their responses; asked only
        when some row is that old)."""
        limit_ns = int(FINAL_ROW_RECLAIM_S * 1e9)
        old = np.flatnonzero(_FINAL[rows["state"]] & (now_ns - rows["state_since_ns"] > limit_ns))
        if not old.size:
            return
        held = held()
        fresh = self.table.consistent_rows(old.tolist())  # the snapshot may mix a row's old and new fields
        for slot, row in zip(old.tolist(), fresh):
            if (slot, int(row["generation"])) in held:
                continue
            if _FINAL[int(row["state"])] and now_ns - int(row["state_since_ns"]) > limit_ns:
                if self.table.release(slot, int(row["generation"])):
                    log.warning("released the final row of request %s nobody released in %.0f s (did the API "
                                "process die?)", row["request_id"].decode(errors="replace"), FINAL_ROW_RECLAIM_S)
