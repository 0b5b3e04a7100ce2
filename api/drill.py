"""The watchdog fire drill: every ``drill_interval_s`` the API process sends the engine a tiny request per stage,
held in that stage by a fault (``pdserve.faults.DRILL_HOLDS``), and checks that the monitor's deadline fires there
within ``drill_timeout_s`` + one tick and that everything the request held is freed.

| name            | what                                                                                   |
|-----------------|----------------------------------------------------------------------------------------|
| `drill_stages`  | the stages this engine can drill (plain)                                               |
| `DrillSchedule` | which stage is due, one round per interval, one drill at a time, none while busy (plain) |
| `Watch`         | what the driver saw of a drill's row: did it reach the stage, when its deadline started (plain) |
| `judge`         | the verdict: 0 passed, else 1 + an index of ``ipc.engine_status.DRILL_FAILURES`` (plain) |
| `blocks_held`, `gauges_held` | what a drill left behind: KV blocks of its slot, actors' own counts (plain) |
| `drill_holders` | the actor holding a drill's row, whose stacks a failed drill's incident bundle takes (plain) |
| `Drills`        | the driver, an asyncio task of the API process: admit, watch the row, check, record    |
| `Readmissions`  | which drained actor (actors/ejection.py) gets a readmission drill now (plain)          |

A drill is a request like a client's (the API's admission, the actors' queues, the monitor's deadlines), told apart
by its id, ``drill-<stage>-<n>``: the faults aim at it, the monitor gives it ``drill_timeout_s`` and leaves it out
of ``pdserve_request_timeouts_total`` and incidents, tools/inspect marks it. Its prompt is shorter than one KV block,
so it has no full block to look up in or add to a prefix cache; it never finishes, so nothing is handed back.
Results go to the status record (ipc/engine_status.py ``drill_*``): /metrics, /health and tools/inspect read them;
a failed drill is also an ERROR line and, with ``incident_dir``, an incident bundle of kind "drill".

Readmission: an actor the monitor drained (actor table ``drained``) gets, once the engine is idle and then every
``drill_interval_s`` until one passes, a drill pinned to it (it takes no client work meanwhile) in the stage after
the one it was drained for (actors/ejection.py ``readmit_stage``: the drill came through that stage on it); a pass
sets its ``readmit_drain`` and the monitor readmits it. A readmission drill that never reached its stage or ended
elsewhere says the actor is still sick (logged; it stays drained), not that the watchdog failed: only the
watchdog's own failures (not fired, early, not freed) are recorded as drill failures.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from ipc.lifecycle import FINAL_STATES, RENEWABLE_STATES, STAGE_NAME
from ipc.lifecycle import RequestState as S
from ipc.recorder import EventKind, record_request
from pdserve.faults import DRILL_PREFIX

log = logging.getLogger("pdserve.drill")

NOT_FIRED, EARLY, NEVER_REACHED, NOT_FREED, OTHER_END = 1, 2, 3, 4, 5   # 1 + index in DRILL_FAILURES
SLACK_S = 0.25        # scheduling slack on a loaded host, beyond limit + one tick
POLL_S = 0.02         # how often the driver reads its drill's row
REACH_S = 60.0        # longest a drill may take to reach its stage (the earlier ones have their own deadlines)
PROMPT_IDS = [1, 2, 3]   # shorter than any KV block: no full block to cache


def drill_stages(role: str, colocated: bool) -> tuple[S, ...]:
    """The stages an engine drills, in lifecycle order: none on a node of one side (``role`` prefill or decode: its
    requests come through `pdserve router`); colocated, no bootstrap (the decode actor's own prefill core hands
    its KVReady over in memory, past the intake where ``bootstrap_silent`` holds one)."""
    if role != "both":
        return ()
    return tuple(s for s in STAGE_NAME if not (colocated and s == S.BOOTSTRAP))


def drill_id(stage: S, n: int) -> str:
    return f"{DRILL_PREFIX}{STAGE_NAME[stage]}-{n}"


class DrillSchedule:
    """One round per ``interval_s``: each stage of ``stages`` in turn, one drill at a time; a stage due while the
    engine is busy waits (the round goes on once it is idle), and so does one whose drill was not admitted (the
    caller then does not call ``done``). The first round starts one interval after ``start_ns``."""

    def __init__(self, stages, interval_s: float, start_ns: int):
        self.stages = tuple(stages)
        self.interval_ns = int(interval_s * 1e9)
        self.round_ns = start_ns + self.interval_ns   # when the next round starts
        self.pending: list[S] = []

    def next(self, now_ns: int, busy: bool) -> S | None:
        """The stage to drill now, or None (not due, or busy). The caller runs it to its end, then calls ``done``
        (unless it could not start it), before asking again."""
        if not self.stages or not self.interval_ns:
            return None
        if not self.pending and now_ns >= self.round_ns:
            self.pending = list(self.stages)
        if not self.pending or busy:
            return None
        return self.pending[0]

    def done(self, stage: S, now_ns: int) -> None:
        """``stage`` was drilled (passed or failed); the round's last: the next round is due an interval later."""
        if self.pending and self.pending[0] == stage:
            self.pending.pop(0)
            if not self.pending:
                self.round_ns = now_ns + self.interval_ns


@dataclass
class Watch:
    """The drill's row as the driver saw it, one read per ``see``."""

    stage: S
    reached: bool = False
    start_ns: int = 0       # the stage deadline's start at the last read in the stage (renewals included)
    final: dict | None = None   # the row once it turned final
    timings: tuple = (0.0, 0.0)   # the driver's: seconds from admission to the verdict, then to the frees
    last: dict | None = None    # the row at the last read that found it

    def see(self, row: dict | None) -> None:
        if row is None or self.final is not None:
            return
        self.last = row
        state = row["state"]
        if state == self.stage:
            self.reached = True
            since = int(row["state_since_ns"])
            self.start_ns = max(since, int(row["last_progress_ns"])) if state in RENEWABLE_STATES else since
        elif state in FINAL_STATES:
            self.final = row

    def give_up_ns(self, limit_s: float, tick_s: float) -> int:
        """After this the deadline should have fired (0 while the stage is not reached)."""
        return self.start_ns + int((limit_s + tick_s + SLACK_S) * 1e9) if self.reached else 0


def judge(watch: Watch, limit_s: float, tick_s: float) -> int:
    """0 if the drill's row was timed out in its stage within ``limit_s`` (the drill deadline) and ``limit_s`` +
    ``tick_s`` + ``SLACK_S`` of the deadline's start; else the failure (module constants)."""
    final = watch.final
    if not watch.reached:
        return NEVER_REACHED if final is None or final["final_stage"] != watch.stage else OTHER_END
    if final is None:
        return NOT_FIRED
    if final["state"] != S.TIMED_OUT or final["final_stage"] != watch.stage:
        return OTHER_END
    elapsed_ns = int(final["state_since_ns"]) - watch.start_ns
    if elapsed_ns < int(limit_s * 1e9):
        return EARLY
    if elapsed_ns > int((limit_s + tick_s + SLACK_S) * 1e9):
        return NOT_FIRED
    return 0


def blocks_held(owner_slots, slot: int) -> int:
    """KV blocks owned by ``slot`` over every pool (``owner_slots``: each pool's per-block owner array)."""
    return sum(int((owners == slot).sum()) for owners in owner_slots)


def drill_holders(row: dict | None, engine_actors) -> list[int]:
    """The actor holding a drill's row (``row``: its last read; ``engine_actors``: the prefill and decode actor
    indices): its owner when that is an engine actor, else the actor it is due at (its prefill actor, then its
    decode actor; a QUEUED row is owned by the API); [] without a row."""
    if row is None:
        return []
    found = [int(row[f]) for f in ("owner", "prefill_actor", "decode_actor") if int(row[f]) in engine_actors]
    return found[:1]


def gauges_held(actor_rows) -> list[str]:
    """``actor gauge=value`` for each actor's own queue count above 0 (``ActorTable.rows()``; -1: keeps none)."""
    from ipc.engine_status import GAUGES

    return [f"{r['name']} {g}={v}" for r in actor_rows if r["name"] for g, v in zip(GAUGES, r["own_gauges"]) if v > 0]


class Readmissions:
    """When each drained actor's readmission drill is due: at once for a new drain, then every ``interval_s``
    until the monitor readmits it (one drill at a time: the caller runs it, then calls ``tried``)."""

    def __init__(self, interval_s: float):
        self.interval_ns = int(interval_s * 1e9)
        self.tried_ns: dict[tuple[int, int], int] = {}   # (actor, drain number) -> last try

    def due(self, actor_rows, now_ns: int) -> tuple[int, int, S] | None:
        """``(actor index, drain number, drained stage)`` of a drained actor whose drill is due, else None
        (``actor_rows``: ``ActorTable.rows()``)."""
        drained = {(r["index"], int(r["drains"])): S(r["drained"]) for r in actor_rows
                   if r["drained"] and int(r["readmit_drain"]) != int(r["drains"])}
        self.tried_ns = {k: v for k, v in self.tried_ns.items() if k in drained}
        for (index, drain), stage in sorted(drained.items()):
            last = self.tried_ns.get((index, drain))
            if last is None or now_ns - last >= self.interval_ns:
                return index, drain, stage
        return None

    def tried(self, index: int, drain: int, now_ns: int) -> None:
        self.tried_ns[(index, drain)] = now_ns


class Drills:
    """The driver in the API process (``start`` an asyncio task; ``stop`` cancels it). ``client``: the EngineClient
    (its admission, tables and status record); ``incidents``: the process's IncidentWriter or None (a failed
    drill's incident bundle, kind "drill": its stage, id, verdict and the holder's stacks)."""

    def __init__(self, client, model: str, incidents=None):
        self.client, self.model = client, model
        self.incidents = incidents   # a failed drill's bundle (actors/incidents.py)
        config = client.config
        self.limit_s, self.tick_s = config.drill_timeout_s, config.monitor_tick_s
        self.free_bound_s = config.idle_wait_s + 2 * config.monitor_tick_s + 1.0   # actors free on their next loop
        self.schedule = DrillSchedule(drill_stages(config.role, config.colocated), config.drill_interval_s,
                                      time.monotonic_ns())
        self.readmissions = Readmissions(config.drill_interval_s)
        self.count = 0
        self.pools = []
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        from ipc.kv_pool import KVPool

        if not self.schedule.stages or not self.schedule.interval_ns:
            if self.client.config.drill_interval_s > 0:
                log.info("watchdog drills are off on a %s node (they run on an engine of both sides)",
                         self.client.config.role)
            return
        layout, topo = self.client.layout, self.client.topology
        self.pools = [KVPool.attach(layout.segment(topo.segment("kv", i)), readonly=True)
                      for i in topo.prefill + topo.decode if topo.segment("kv", i) in layout.segments]
        self.task = asyncio.get_running_loop().create_task(self.run(), name="watchdog-drills")

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
        for pool in self.pools:
            pool.close()
        self.pools = []

    def busy(self) -> bool:
        """Any request in flight besides drills: the API holds one, or the table has a live row."""
        return bool(self.client.handles) or bool(self.client.table.live_keys())

    async def run(self) -> None:
        while True:
            await asyncio.sleep(min(self.tick_s, 1.0))
            if not self.busy():
                await self.readmit()
            stage = self.schedule.next(time.monotonic_ns(), self.busy())
            if stage is None:
                continue
            try:
                verdict = await self.drill(stage)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a drill's own bug must not end the drills (nor repeat every tick)
                log.exception("watchdog drill of stage %s failed to run", STAGE_NAME[stage])
                verdict = OTHER_END
            if verdict is not None:   # None: not admitted (starting, draining): the stage is tried again
                self.schedule.done(stage, time.monotonic_ns())

    async def readmit(self) -> None:
        """The readmission drill that is due (``Readmissions``), if any: pinned to the drained actor in the stage
        after its drained one; a pass tells the monitor to readmit it (``ActorTable.readmit``)."""
        from actors.ejection import readmit_stage

        due = self.readmissions.due(self.client.actors.rows(), time.monotonic_ns())
        if due is None:
            return
        index, drain, drained = due
        stage = readmit_stage(drained, self.schedule.stages)
        try:
            verdict = await self.drill(stage, pin=index)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - as in run: the next try comes an interval later
            log.exception("readmission drill of %s failed to run", self.client.topology.names[index])
            verdict = OTHER_END
        if verdict is None:   # not admitted (the actor is not healthy now): tried again once it is
            return
        self.readmissions.tried(index, drain, time.monotonic_ns())
        name = self.client.topology.names[index]
        if verdict == 0:
            self.client.actors.readmit(index, drain)
            log.warning("readmission drill of %s (drained for %s) passed in stage %s: the monitor readmits it",
                        name, STAGE_NAME[drained], STAGE_NAME[stage])
        else:
            from ipc.engine_status import DRILL_FAILURES

            log.warning("readmission drill of %s (drained for %s) in stage %s did not pass (%s): it stays drained, "
                        "the next try in drill_interval_s", name, STAGE_NAME[drained], STAGE_NAME[stage],
                        DRILL_FAILURES[verdict - 1])

    async def drill(self, stage: S, pin: int | None = None) -> int | None:
        """Run one drill of ``stage`` (``pin``: on that actor, a readmission drill); record and return its verdict
        (None: not admitted, nothing recorded). A readmission drill that never reached its stage or ended in
        another is the actor's failure, not the watchdog's: returned, not recorded."""
        from api.protocol import GenerationRequest
        from pdserve.errors import PdserveError
        from pdserve.sampling import Sampling

        request = GenerationRequest("completion", drill_id(stage, self.count + 1), self.model, list(PROMPT_IDS),
                                    Sampling(temperature=0.0, max_tokens=2, ignore_eos=True))
        try:
            handle = self.client.submit(request, pin=pin)[0]
        except PdserveError as exc:   # starting, draining, no actor serving, full: not the watchdog's failure
            log.debug("watchdog drill %s not admitted (tried again later): %s", request.request_id, exc.message)
            return None
        self.count += 1
        watch = Watch(stage)
        started = time.monotonic()
        verdict = None
        try:
            while watch.final is None:
                watch.see(self.client.table.read(handle.slot, handle.generation))
                give_up = watch.give_up_ns(self.limit_s, self.tick_s)
                if watch.final is None and ((give_up and time.monotonic_ns() > give_up) or (
                        not watch.reached and time.monotonic() - started > REACH_S)):
                    break
                await asyncio.sleep(POLL_S)
            verdict = judge(watch, self.limit_s, self.tick_s)
            judged = time.monotonic()
            if verdict == 0 and not await self.freed(handle.slot):
                verdict = NOT_FREED
            watch.timings = (judged - started, time.monotonic() - judged)
        finally:
            while not handle.events.empty():   # its first token, the monitor's 504: nobody else reads them
                handle.events.get_nowait()
            if verdict is not None:   # the flight recorder: this row life was a drill, and how it went
                record_request(EventKind.DRILL, request.request_id, handle.slot, handle.generation, old=int(stage),
                               aux=verdict)
            self.client.finish(handle)   # aborts it if the watchdog never fired, then releases the row
        if pin is None or verdict not in (NEVER_REACHED, OTHER_END):
            self.record(stage, verdict, request.request_id, watch)
        return verdict

    async def freed(self, slot: int) -> bool:
        """Whether, within ``free_bound_s``, every pool's blocks owned by ``slot`` are freed (the row is final and
        still ours: no other request owns that slot meanwhile) and, while no other request is live, every actor's
        own queue counts read 0."""
        deadline = time.monotonic() + self.free_bound_s
        while (blocks_held([p.owner_slots() for p in self.pools], slot)
               or (len(self.client.handles) == 1 and not self.client.table.live_keys()
                   and gauges_held(self.client.actors.rows()))):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(POLL_S)
        return True

    def record(self, stage: S, verdict: int, request_id: str, watch: Watch) -> None:
        from ipc.engine_status import DRILL_FAILURES

        rec, i = self.client.status.rec, int(stage)
        rec["drill_runs"][i] += 1
        if verdict == 0:
            rec["drill_last_success_s"][i] = time.time()
            if rec["drill_failing"][i]:
                log.warning("watchdog drill of stage %s passed again (%s)", STAGE_NAME[stage], request_id)
            rec["drill_failing"][i] = 0
            log.debug("watchdog drill %s passed: %.2f s to the verdict, %.2f s for the frees", request_id,
                     *watch.timings)
            return
        rec["drill_failures"][i] += 1
        rec["drill_failing"][i] = verdict
        final = watch.final
        self.incident(stage, verdict, request_id, watch)
        log.error("watchdog drill %s FAILED: %s (reached the stage: %s; ended %s); /health names it until a drill "
                  "of that stage passes", request_id, DRILL_FAILURES[verdict - 1], watch.reached,
                  "not at all" if final is None else f"{getattr(final['state'], 'name', final['state'])} in "
                  f"{getattr(final['final_stage'], 'name', final['final_stage'])}")

    def incident(self, stage: S, verdict: int, request_id: str, watch: Watch) -> None:
        """Hand a failed drill to the incident writer (rate-limited there; a no-op without one): its stage, its id,
        the verdict, and the stacks and loop counters of the actor holding its row (``drill_holders``)."""
        if self.incidents is None:
            return
        from actors.incidents import Incident
        from api.conservation import engine_url
        from ipc.engine_status import DRILL_FAILURES

        topo = self.client.topology
        detail = (f"watchdog drill {request_id} of stage {STAGE_NAME[stage]} failed: {DRILL_FAILURES[verdict - 1]} "
                  f"(reached the stage: {watch.reached})")
        holders = drill_holders(watch.last, topo.prefill + topo.decode)
        self.incidents.report(Incident("drill", detail, [request_id], STAGE_NAME[stage], "drill_timeout_s",
                                       engine_url(self.client), holders=holders))
