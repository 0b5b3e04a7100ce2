"""The watchdog's decisions, as plain synchronous code over snapshots (no I/O, no clocks of its own).

``find_expired`` says which live rows passed a deadline; ``StuckGaugeTracker`` says which queue gauges are
stuck; ``BlockConservation`` names KV blocks an actor owns while it holds no request; ``classify_actor`` tells a
dead actor from a hung one; ``timed_out_stage`` reads the stage back from a timeout's message (`pdserve router`).
The HeartbeatMonitor actor (actors/monitor.py) calls these every tick with ``time.monotonic_ns()`` and acts on the
answers.

Deadlines: each live state has one (``ipc/lifecycle.py``: ``timeout_field``, in seconds, from the config),
plus the request's own absolute ``deadline_ns`` (``request_timeout_s``). A renewable state's deadline runs from
the later of entering the state and the row's ``last_progress_ns``; a hard one (none today) from entering it.
"own" renewals are the row's own progress (a prefill chunk, KV blocks received, a token); "queue" renewals mean
"the actor holding it is alive and working through the requests ahead of it" (the prefill actor renews its
QUEUED rows after each forward pass, a chunk of a long prompt too; decode its BOOTSTRAP and DECODE_WAITING rows
while its batch produces tokens). So healthy queueing and long prompts under load are not failed, while a request
nobody makes progress on (a pool that never frees, a transfer that never moves, an actor that dropped it) still
fails at its stage deadline.

Watchdog drills (api/drill.py): a live row whose request id is ``drill-<stage>-<n>`` has the deadline
``drill_timeout_s`` (``drill_limit_ns``) in that stage, so a drill ends in about a second, not the stage's minutes;
in the stages before it, the ordinary ones (a slow first pass after start-up is not the drill's failure).

A zero or future ``state_since_ns`` is a bug; such a row is expired at once and counted, never "fresh".
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from ipc.actor_table import ActorHealth
from ipc.engine_status import GAUGES
from ipc.lifecycle import GAUGE_STATES, LIVE_STATES, RENEWABLE_STATES, STAGE_NAME, STAGE_TIMEOUT_FIELD
from ipc.lifecycle import RequestState as S



def state_mask(states) -> np.ndarray:
    """A 256-entry lookup table: ``mask[s]`` is True for each state in ``states``, so ``mask[rows["state"]]`` (a
    u1 column) is ``np.isin``'s answer in one gather, at a fraction of its cost (the monitor does this each tick)."""
    mask = np.zeros(256, dtype=bool)
    mask[[int(s) for s in states]] = True
    return mask


_LIVE = state_mask(LIVE_STATES)
_RENEWABLE = state_mask(RENEWABLE_STATES)
_STAGE_OF = {int(s): name for s, name in STAGE_NAME.items()}
_STAGES = frozenset(STAGE_NAME.values())


@dataclass(frozen=True)
class Expired:
    """A live row past a deadline. ``age_s`` is the time spent in ``stage`` (seconds)."""

    slot: int
    generation: int
    stage: S
    age_s: float
    limit_s: float
    reason: str          # "stage_deadline", "request_deadline" or "bad_timestamp"
    owner: int
    request_id: str
    drill: bool = False  # a watchdog drill's row (api/drill.py)
    drill_deadline: bool = False   # ... timed out in the stage it drills, whose deadline is drill_timeout_s
    own_timeout: bool = False      # a request deadline shorter than request_timeout_s: the body's ``timeout``

    @property
    def field(self) -> str:
        """The setting (or the body's ``timeout``) whose deadline passed; "" for a bad timestamp."""
        if self.reason == "request_deadline":
            return "timeout" if self.own_timeout else "request_timeout_s"
        if self.reason == "bad_timestamp":
            return ""
        return "drill_timeout_s" if self.drill_deadline else STAGE_TIMEOUT_FIELD[self.stage]

    def message(self) -> str:
        name = STAGE_NAME[self.stage]
        if self.reason == "bad_timestamp":
            return (f"request {self.request_id} failed in stage {name}: its state timestamp is zero or in the "
                    f"future (an engine bug, reported by the watchdog)")
        return (f"request {self.request_id} timed out in stage {name} after {self.age_s:.2f} s "
                f"({self.field}={self.limit_s:g})")


REQUEST_DEADLINE_FIELDS = ("request_timeout_s", "timeout")   # what a request deadline's message names
_TIMEOUT_TEXT = re.compile(r"timed out in stage (\w+) after [0-9.]+ s \((\w+)=")


def timed_out_stage(message: str) -> str | None:
    """The stage whose deadline a 504's message (``Expired.message``) names, or None: not such a message, or the
    request's own deadline (``request_timeout_s``, or the body's ``timeout``). `pdserve router` reads its nodes' timeouts with it (the
    message is all a node's error line carries)."""
    match = _TIMEOUT_TEXT.search(message)
    if match is None or match.group(2) in REQUEST_DEADLINE_FIELDS or match.group(1) not in _STAGES:
        return None
    return match.group(1)


def stage_limits_ns(config) -> np.ndarray:
    """Per-state deadline in ns, indexed by RequestState value (0 for states without one)."""
    limits = np.zeros(max(int(s) for s in S) + 1, dtype=np.int64)
    for state, name in STAGE_TIMEOUT_FIELD.items():
        limits[int(state)] = int(getattr(config, name) * 1e9)
    return limits


def drill_rows(rows: np.ndarray, candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Which of ``candidates`` (a bool mask over ``rows``) are watchdog drills' rows (request id starting with
    ``DRILL_PREFIX``: one comparison of the ids' first bytes, over the candidates only), and which of those are in
    the stage they drill (``drill-<stage>-<n>``). Two bool masks over ``rows``."""
    from pdserve.faults import DRILL_PREFIX

    prefix = np.frombuffer(DRILL_PREFIX.encode(), dtype=np.uint8)
    drill = np.zeros(len(rows), dtype=bool)
    idx = np.flatnonzero(candidates)
    if idx.size:
        ids = np.ascontiguousarray(rows["request_id"][idx])
        head = ids.view(np.uint8).reshape(idx.size, ids.dtype.itemsize)[:, :prefix.size]
        drill[idx] = (head == prefix).all(axis=1)
    targeted = np.zeros(len(rows), dtype=bool)
    for slot in np.flatnonzero(drill):   # at most one drill runs at a time
        stage = rows["request_id"][slot].decode(errors="replace")[len(DRILL_PREFIX):].rpartition("-")[0]
        state = int(rows["state"][slot])
        targeted[slot] = state in _STAGE_OF and _STAGE_OF[state] == stage
    return drill, targeted


def find_expired(rows: np.ndarray, now_ns: int, config, limits_ns: np.ndarray | None = None,
                 drill_limit_ns: int = 0) -> list[Expired]:
    """Live rows of a state-table snapshot that passed a deadline (vectorized over all rows).

    Args:
        rows: structured array with the state table's ROW_DTYPE (a snapshot copy).
        now_ns: CLOCK_MONOTONIC now, in ns.
        config: EngineConfig (the *_timeout_s fields).
        drill_limit_ns: the stage deadline of drill rows (``drill_rows``); 0: drills are off, no row is one.
    """
    limits_ns = stage_limits_ns(config) if limits_ns is None else limits_ns
    live = _LIVE[rows["state"]]
    if not live.any():
        return []
    state = rows["state"].astype(np.int64)
    since = rows["state_since_ns"].astype(np.int64)
    renewable = _RENEWABLE[rows["state"]]
    progress = np.where(renewable, np.maximum(since, rows["last_progress_ns"].astype(np.int64)), since)
    limit = limits_ns[state]
    no = np.zeros(len(rows), dtype=bool)
    drill, targeted = drill_rows(rows, live) if drill_limit_ns else (no, no)
    if drill_limit_ns:
        limit = np.where(targeted, drill_limit_ns, limit)
    bad = live & ((since <= 0) | (since > now_ns))
    stage_late = live & ~bad & (now_ns - progress > limit)
    deadline = rows["deadline_ns"].astype(np.int64)
    request_late = live & ~bad & ~stage_late & (deadline > 0) & (now_ns > deadline)
    out = []
    for slot in np.flatnonzero(bad | stage_late | request_late):
        row = rows[slot]
        st = S(int(row["state"]))
        if bad[slot]:
            reason, age, lim = "bad_timestamp", 0.0, 0.0
        elif stage_late[slot]:
            reason, age, lim = "stage_deadline", (now_ns - int(progress[slot])) / 1e9, limit[slot] / 1e9
        else:
            reason = "request_deadline"
            created = int(row["created_ns"])
            # the deadline is admission's clock + the timeout, the row's creation a moment later: to the ms
            age, lim = (now_ns - created) / 1e9, round((int(deadline[slot]) - created) / 1e9, 3)
        rid = row["request_id"]
        out.append(Expired(int(slot), int(row["generation"]), st, age, lim, reason, int(row["owner"]),
                           rid.decode(errors="replace") if isinstance(rid, bytes) else str(rid), bool(drill[slot]),
                           bool(targeted[slot]) and reason == "stage_deadline",
                           reason == "request_deadline" and lim < config.request_timeout_s - 1e-3))
    return out


@dataclass
class GaugeState:
    """One gauge's members at the last tick, as parallel numpy arrays sorted by key.

    ``keys`` = slot << 32 | generation (int64), ``markers`` = output_tokens (progress within the stage).
    """

    keys: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    markers: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    nonzero_since_ns: int = 0
    moved_ns: int = 0
    stuck: bool = False

    @property
    def value(self) -> int:
        return int(self.keys.size)


class BlockConservation:
    """KV blocks owned by no live request: an actor that holds no live row (``held_mask``) owns no block but its
    prefix cache's (``CACHE_OWNER``) and those kept for a hand-back (``HANDBACK_OWNER``). A block still owned by a
    request slot is a leak once it stays so over ``checks`` consecutive checks (the actor frees a finished
    request's blocks on its next loop; a hung actor is reported by the heartbeat check as well). Each distinct set
    of leaked blocks is reported once (again only if blocks are added to it)."""

    def __init__(self, checks: int = 2):
        self.checks = checks
        self.seen: dict[int, dict[tuple[int, int], int]] = {}   # actor -> (block, slot) -> consecutive idle checks
        self.reported: dict[int, frozenset] = {}

    def check(self, actor: int, owners: np.ndarray, holds_rows) -> list[tuple[int, int]]:
        """``owners``: the actor's pool's owner slot per block (-1 free); ``holds_rows()``: any live row is the
        actor's (asked only when it owns a block: an idle pool costs one pass over ``owners``). Returns the leaked
        ``(block, owner slot)`` pairs to report now (empty: nothing new)."""
        from actors.prefix_cache import CACHE_OWNER, HANDBACK_OWNER

        owned = np.flatnonzero((owners >= 0) & (owners != CACHE_OWNER) & (owners != HANDBACK_OWNER))
        if owned.size and holds_rows():   # judged again once it is idle; what was reported stays reported
            self.seen.pop(actor, None)
            return []
        before = self.seen.get(actor, {})
        now = {(int(b), int(owners[b])): before.get((int(b), int(owners[b])), 0) + 1 for b in owned}
        self.seen[actor] = now
        leaked = frozenset(k for k, n in now.items() if n >= self.checks)
        if not now:
            self.reported.pop(actor, None)
        if not leaked or leaked <= self.reported.get(actor, frozenset()):
            return []
        self.reported[actor] = leaked
        return sorted(leaked)


class StuckGaugeTracker:
    """Flags a queue gauge that stays > 0 while nothing leaves its stage for ``stuck_gauge_s``.

    "Leaving" = a request in the stage at the previous tick is no longer in it, or (running gauge) it
    produced a token or, while PREFILLING, finished a chunk of its prompt (the prefill actor stamps the row's
    ``last_progress_ns`` after each forward pass): a long prompt in progress is slow, not stuck, while a prefill
    whose forward pass never returns still is. A gauge that drops to 0 clears its flag at once. Vectorized: no
    Python loop over rows.
    """

    def __init__(self, stuck_gauge_s: float):
        self.stuck_ns = int(stuck_gauge_s * 1e9)
        self.gauges = {g: GaugeState() for g in GAUGES}
        self.masks = {g: state_mask(states) for g, states in GAUGE_STATES.items()}

    def update(self, rows: np.ndarray, now_ns: int) -> dict[str, GaugeState]:
        state = rows["state"]
        all_keys = (np.arange(len(rows), dtype=np.int64) << 32) | rows["generation"].astype(np.int64)
        for gauge, mask in self.masks.items():
            g = self.gauges[gauge]
            idx = np.flatnonzero(mask[state])
            keys = all_keys[idx]   # ascend with idx
            markers = np.where(state[idx] == int(S.PREFILLING), rows["last_progress_ns"][idx].astype(np.int64),
                               rows["output_tokens"][idx].astype(np.int64))
            if keys.size == 0:
                g.keys, g.markers, g.nonzero_since_ns, g.moved_ns, g.stuck = keys, markers, 0, now_ns, False
                continue
            if g.nonzero_since_ns == 0:
                g.nonzero_since_ns = g.moved_ns = now_ns
            if g.keys.size:
                pos = np.minimum(np.searchsorted(keys, g.keys), keys.size - 1)
                found = keys[pos] == g.keys
                if not found.all() or (markers[pos[found]] != g.markers[found]).any():
                    g.moved_ns = now_ns
            g.keys, g.markers = keys, markers
            g.stuck = now_ns - g.moved_ns >= self.stuck_ns
        return self.gauges

    def oldest(self, rows: np.ndarray, gauge: str) -> tuple[int, int] | None:
        """(slot, state_since_ns) of the oldest request in a gauge's stage, or None."""
        keys = self.gauges[gauge].keys
        if keys.size == 0:
            return None
        slots = (keys >> 32).astype(np.int64)
        slot = int(slots[np.argmin(rows["state_since_ns"][slots])])
        return slot, int(rows["state_since_ns"][slot])


def classify_actor(pid: int, alive: bool, status_ready: bool, heartbeat_ns: int, now_ns: int,
                   hang_timeout_s: float) -> ActorHealth:
    """DEAD = its process is gone (or a zombie); HUNG = alive and READY but no heartbeat for the timeout."""
    if pid <= 0:
        return ActorHealth.UNKNOWN
    if not alive:
        return ActorHealth.DEAD
    if status_ready and heartbeat_ns > 0 and now_ns - heartbeat_ns > hang_timeout_s * 1e9:
        return ActorHealth.HUNG
    return ActorHealth.OK


def actor_state(row: dict, health: int, now_ns: int, monitor_tick_s: float) -> str:
    """One word for an actor, the same in /health, /metrics and tools/inspect: "ok", "dead", "hung", or its
    lifecycle status while not serving ("starting", "restarting", "stopping", ...).

    ``row`` is an ActorTable row dict, ``health`` the monitor's ActorHealth for it. The monitor does not judge
    itself: its own heartbeat age (more than 3 ticks + 1 s) says whether it is hung.
    """
    from ipc.actor_table import ActorStatus

    status = row["status"]
    status_word = getattr(status, "name", str(status)).lower()
    if row["name"] == "monitor":
        hb_ns = int(row["heartbeat_ns"])
        if row["pid"] and (not hb_ns or (now_ns - hb_ns) / 1e9 > 3 * monitor_tick_s + 1):
            return "hung"
    elif health in (ActorHealth.DEAD, ActorHealth.HUNG):
        return ActorHealth(health).name.lower()
    return "ok" if status == ActorStatus.READY else status_word
