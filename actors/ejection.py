"""Stage-aware ejection: which engine actor to drain (no new work) because its requests keep timing out in one
stage, and when to take it back, as plain synchronous code (no I/O, no clock of its own). The HeartbeatMonitor
(actors/monitor.py) feeds it its actors' timeouts; `pdserve router` (api/router_client.py) its nodes' (indices of
its node list, named "decode node URL").

| name            | what                                                                                 |
|-----------------|--------------------------------------------------------------------------------------|
| `stage_actor`   | the actor a row's stage blames: queued/prefill its prefill actor, later its decode one |
| `drain_reason`  | the one reason text: "decode1 drained: 3 transfer timeouts in 60 s"                  |
| `Drain`         | one decision: drain this actor for this stage, with the timeouts that made it       |
| `Ejection`      | the counter: timeouts and stuck gauges per (actor, stage) in a sliding window, and readmission |
| `readmit_stage` | the stage a readmission drill on a drained actor runs (api/drill.py)                |
| `row_drain`     | an actor-table row's drain reason, or None (/debug/state, tools/inspect)            |
| `drain_problems`| one problem per drained actor (/health, /debug/state)                               |

An actor is drained after ``eject_timeouts`` timeouts of the same stage within ``eject_window_s`` (a stuck gauge
counts as one timeout of its oldest request's stage). Never the last serving actor of its role: the engine must
still answer; that is logged once per window and the actor keeps serving. A watchdog drill's timeout
(``DRILL_PREFIX``) never counts: it is the drill's success.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Iterable

from actors.topology import NO_ACTOR
from ipc.lifecycle import STAGE_NAME
from ipc.lifecycle import RequestState as S
from pdserve.faults import DRILL_PREFIX

_PREFILL_STAGES = frozenset({S.QUEUED, S.PREFILLING})


def stage_actor(state: int, prefill_actor: int, decode_actor: int) -> int:
    """The actor blamed for a request stuck in ``state``: its prefill actor while queued or prefilling (colocated:
    its decode actor, which prefills), its decode actor from bootstrap on (decode reserves, pulls and decodes).
    A negative value (``NO_ACTOR``, ``REMOTE_ACTOR``): no actor of this engine."""
    if state in _PREFILL_STAGES and prefill_actor != NO_ACTOR:
        return prefill_actor
    return decode_actor


def drain_reason(name: str, stage: str, timeouts: int, window_s: float) -> str:
    """``"decode1 drained: 3 transfer timeouts in 60 s"``: the text every view shows."""
    return f"{name} drained: {timeouts} {stage} timeout{'s' if timeouts != 1 else ''} in {window_s:g} s"


def row_drain(row: dict, window_s: float) -> str | None:
    """The drain reason of an actor-table row (``ActorTable.rows()``: ``drained``, ``drain_timeouts``), None while
    it serves. ``window_s``: the config's ``eject_window_s``."""
    if not row.get("drained"):
        return None
    stage = STAGE_NAME.get(int(row["drained"]), f"state {int(row['drained'])}")   # IntEnum keys match ints
    return drain_reason(row["name"], stage, int(row["drain_timeouts"]), window_s)


def drain_problems(actor_rows, window_s: float) -> list[str]:
    """One /health and /debug/state problem per drained actor: its reason (``row_drain``)."""
    return [reason for reason in (row_drain(r, window_s) for r in actor_rows if r["name"]) if reason]


def readmit_stage(stage: S, stages: tuple[S, ...]) -> S:
    """The drill stage that tests a drained stage: the next drillable one after ``stage`` (a drill held there has
    come through ``stage`` on the actor, so it proves that stage completes again), or ``stage`` itself when it is
    the last (the drill then proves the actor still takes the request there and frees it). ``stages``: the
    engine's drill stages in lifecycle order (api/drill.py ``drill_stages``). Raises ValueError when empty."""
    if not stages:
        raise ValueError("no drill stages on this engine: no readmission drill")
    later = [s for s in stages if s > stage]
    return later[0] if later else stages[-1]


@dataclass(frozen=True)
class Drain:
    """Drain actor ``actor`` (its ``name``) for ``stage`` (RequestState): ``timeouts`` in the window made it."""

    actor: int
    name: str
    stage: S
    timeouts: int
    window_s: float
    since_ns: int = 0   # when it was drained (monotonic ns)

    @property
    def reason(self) -> str:
        return drain_reason(self.name, STAGE_NAME[self.stage], self.timeouts, self.window_s)


class Ejection:
    """Timeouts per (actor, stage) over the last ``window_s`` seconds; ``record`` answers with a ``Drain`` when one
    reaches ``timeouts``. ``names``: actor index -> name; ``roles``: actor index -> "prefill" / "decode" (only
    these actors are judged). ``drained``: actor index -> its Drain while it is drained (``readmit`` ends it)."""

    def __init__(self, names, roles: dict[int, str], timeouts: int, window_s: float):
        self.names, self.roles = list(names), dict(roles)
        self.limit, self.window_ns, self.window_s = timeouts, int(window_s * 1e9), window_s
        self.seen: dict[tuple[int, S], collections.deque[int]] = collections.defaultdict(collections.deque)
        self.drained: dict[int, Drain] = {}
        self.kept: dict[tuple[int, S], int] = {}   # (actor, stage) -> when "kept: the last one" was last said

    def record(self, actor: int, stage: int, now_ns: int, request_id: str, serving: Iterable[int]
               ) -> tuple[Drain | None, str | None]:
        """One timeout (or stuck gauge) of ``request_id`` in ``stage`` blamed on ``actor`` at ``now_ns``
        (monotonic ns). ``serving``: the actors that take new work now (READY, not hung, dead or drained).
        Returns ``(drain, note)``: the Drain to carry out (None: not now) and a line to log when the actor would
        be drained but is the last serving one of its role (None otherwise; said once per window)."""
        if request_id.startswith(DRILL_PREFIX) or actor not in self.roles or actor in self.drained:
            return None, None
        stage = S(stage)
        times = self.seen[(actor, stage)]
        times.append(now_ns)
        while times and now_ns - times[0] > self.window_ns:
            times.popleft()
        if len(times) < self.limit:
            return None, None
        drain = Drain(actor, self.names[actor], stage, len(times), self.window_s, now_ns)
        role = self.roles[actor]
        if not any(self.roles.get(i) == role and i != actor for i in serving):
            said = self.kept.get((actor, stage))
            if said is not None and now_ns - said <= self.window_ns:
                return None, None
            self.kept[(actor, stage)] = now_ns
            return None, (f"{drain.reason} is due, but it is the last serving {role} actor: it keeps serving so "
                          "requests can still be answered")
        times.clear()
        self.kept.pop((actor, stage), None)
        self.drained[actor] = drain
        return drain, None

    def readmit_due(self, actor: int, drill_passed: bool, now_ns: int, cool_down_s: float | None) -> str | None:
        """Why drained actor ``actor`` is readmitted now, or None (it stays drained, or is not drained): its
        readmission drill passed (``drill_passed``), or, with no drills to run (``cool_down_s`` not None:
        ``eject_readmit_s``), it has been drained that long."""
        drain = self.drained.get(actor)
        if drain is None:
            return None
        if drill_passed:
            return "a passing readmission drill"
        if cool_down_s is not None and now_ns - drain.since_ns >= cool_down_s * 1e9:
            return f"eject_readmit_s={cool_down_s:g} drained (no drills run here)"
        return None

    def readmit(self, actor: int) -> Drain | None:
        """Actor ``actor`` takes new work again (its readmission drill passed); its counts start over. Returns the
        Drain it ends (None: it was not drained)."""
        for key in [k for k in self.seen if k[0] == actor]:
            del self.seen[key]
        return self.drained.pop(actor, None)
