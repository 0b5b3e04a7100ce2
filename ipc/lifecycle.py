"""The request lifecycle, declared once: every per-state fact lives in ``LIFECYCLE`` and is derived from it.

``ALLOWED``, ``LIVE_STATES``/``FINAL_STATES``, stage names (metrics labels, 504 messages, tools/inspect and
docs/architecture.md alike), stage deadlines, renewal rules, gauge membership and which role holds or moves a
row are all read from the one table below; nothing else re-declares them (tests/core/test_structure.py checks
docs/architecture.md's state table against it).

Renewal (``renewal``) says what extends a stage deadline through the row's ``last_progress_ns``:
    None     hard: the deadline runs from entering the state, whatever happens (a stuck transfer is not saved
             by traffic elsewhere)
    "own"    the row's own progress: a prefill chunk, KV blocks received, a decoded token
    "queue"  progress on the requests ahead of it by the role holding it (it waits in a moving queue)
Roles: "api", "prefill", "decode", "monitor", "supervisor".
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class RequestState(enum.IntEnum):
    FREE = 0  # row unused
    QUEUED = 1
    PREFILLING = 2
    BOOTSTRAP = 3  # decode reserves blocks; prefill holds the KV (prefill inflight queue)
    TRANSFERRING = 4  # decode pulls the KV; prefill still holds it (prefill inflight queue)
    DECODE_WAITING = 5
    DECODING = 6
    FINISHED = 7
    ABORTED = 8
    TIMED_OUT = 9
    FAILED = 10


S = RequestState
_ENDINGS = (S.ABORTED, S.TIMED_OUT, S.FAILED)


@dataclass(frozen=True)
class StateSpec:
    """One row of the lifecycle table (see the module docstring for ``renewal`` and the roles)."""

    state: RequestState
    stage: str | None            # the one name of the stage; None for FREE and final states
    timeout_field: str | None    # EngineConfig field holding the stage deadline in seconds
    renewal: str | None          # None (hard), "own" or "queue"
    gauges: tuple[str, ...]      # queue gauges (ipc.engine_status.GAUGES) the state counts toward
    held_by: tuple[str, ...]     # roles holding the request's data here: if one dies or hangs, the row fails
    moved_by: tuple[str, ...]    # roles that move a row into this state
    next: tuple[RequestState, ...]
    meaning: str


LIFECYCLE: tuple[StateSpec, ...] = (
    StateSpec(S.FREE, None, None, None, (), (), ("api", "monitor"), (),
              "row unused (only allocate() leaves FREE; release() returns final rows here)"),
    StateSpec(S.QUEUED, "queued", "queue_timeout_s", "queue", ("queued",), ("prefill",), ("api",),
              (S.PREFILLING,) + _ENDINGS, "admitted; waiting for the prefill actor or for free prefill blocks"),
    StateSpec(S.PREFILLING, "prefill", "prefill_timeout_s", "own", ("running",), ("prefill",), ("prefill",),
              (S.BOOTSTRAP, S.FINISHED) + _ENDINGS,
              "prompt forward pass running; each finished chunk renews the deadline"),
    StateSpec(S.BOOTSTRAP, "bootstrap", "bootstrap_timeout_s", "queue", ("prefill_inflight",),
              ("prefill", "decode"), ("prefill", "api"), (S.TRANSFERRING, S.FINISHED) + _ENDINGS,
              "prefill holds the KV and sent KVReady; decode reserves blocks for prompt + max_tokens"),
    StateSpec(S.TRANSFERRING, "transfer", "inflight_timeout_s", "own", ("prefill_inflight", "decode_transfer"),
              ("prefill", "decode"), ("decode",), (S.DECODE_WAITING,) + _ENDINGS,
              "decode pulls the KV blocks; blocks arriving renew the deadline, a stuck transfer does not"),
    StateSpec(S.DECODE_WAITING, "decode_waiting", "decode_waiting_timeout_s", "queue", (), ("decode",),
              ("decode",), (S.DECODING,) + _ENDINGS,
              "decode holds its copy of the KV (prefill frees its own blocks); waiting for a batch slot"),
    StateSpec(S.DECODING, "decode", "decode_stall_timeout_s", "own", ("running",), ("decode",), ("decode",),
              (S.FINISHED,) + _ENDINGS, "in the running batch; each token renews the deadline"),
    StateSpec(S.FINISHED, None, None, None, (), (), ("prefill", "decode", "api"), (),
              "EOS, stop token or max_tokens; on a prefill node: the decode node holds its copy of the KV; an "
              "embedding: prefill pooled it (no decode)"),
    StateSpec(S.ABORTED, None, None, None, (), (), ("api", "supervisor"), (),
              "the client left, a stop string ended it, or the engine stopped"),
    StateSpec(S.TIMED_OUT, None, None, None, (), (), ("monitor",), (), "a stage or request deadline passed (504)"),
    StateSpec(S.FAILED, None, None, None, (), (), ("prefill", "decode", "monitor", "supervisor"), (),
              "an actor failed it, or its actor died or hung (503)"),
)

# the states allocate() may start a row in: QUEUED (a new request) and BOOTSTRAP (a decode node admits a request a
# prefill node has prefilled: its KVReady arrived with it)
ALLOCATE_STATES: frozenset[RequestState] = frozenset({S.QUEUED, S.BOOTSTRAP})
SPEC: dict[RequestState, StateSpec] = {spec.state: spec for spec in LIFECYCLE}
ALLOWED: dict[RequestState, frozenset[RequestState]] = {spec.state: frozenset(spec.next) for spec in LIFECYCLE}
FINAL_STATES: frozenset[RequestState] = frozenset(s.state for s in LIFECYCLE if s.state is not S.FREE and not s.next)
LIVE_STATES: frozenset[RequestState] = frozenset(s.state for s in LIFECYCLE if s.next)
STAGE_NAME: dict[RequestState, str] = {s.state: s.stage for s in LIFECYCLE if s.stage}
STAGE_TIMEOUT_FIELD: dict[RequestState, str] = {s.state: s.timeout_field for s in LIFECYCLE if s.timeout_field}
RENEWABLE_STATES: frozenset[RequestState] = frozenset(s.state for s in LIFECYCLE if s.renewal)
GAUGE_STATES: dict[str, tuple[RequestState, ...]] = {}
for _spec in LIFECYCLE:
    for _gauge in _spec.gauges:
        GAUGE_STATES.setdefault(_gauge, ())
        GAUGE_STATES[_gauge] += (_spec.state,)
del _spec, _gauge


class TransferStatus(enum.IntEnum):
    """What a KV transport reports for one transfer (ipc/kv_transport.py); any other value is a bug the decode
    role fails the request for."""

    IN_PROGRESS = 0
    DONE = 1
    FAILED = 2


def held_by(role: str) -> frozenset[RequestState]:
    """States in which ``role`` holds a request (a message it consumed, KV blocks, a batch slot)."""
    return frozenset(s.state for s in LIFECYCLE if role in s.held_by)


def stage_of(state: int) -> str:
    """The stage name of a live state (``"transfer"`` for TRANSFERRING); the lower-case state name otherwise."""
    state = RequestState(state)
    return STAGE_NAME.get(state, state.name.lower())


def check_mover(new: int, by: str | None) -> None:
    """Raise ValueError unless role ``by`` may move a row into ``new`` (the lifecycle's "moved by" column);
    ``by`` None checks nothing (tools and tests moving rows by hand)."""
    if by is not None and by not in SPEC[RequestState(new)].moved_by:
        raise ValueError(f"role {by!r} may not move a row to {RequestState(new).name}; the lifecycle lets "
                         f"{', '.join(SPEC[RequestState(new)].moved_by)} do that")


def check_transition(current: int, new: int) -> None:
    """Raise ValueError unless ``current -> new`` is in ``ALLOWED`` (pure; used by ``StateTable.transition``)."""
    cur, nxt = RequestState(current), RequestState(new)
    if nxt not in ALLOWED[cur]:
        allowed = ", ".join(s.name for s in sorted(ALLOWED[cur])) or "nothing (terminal)"
        raise ValueError(f"request state transition {cur.name} -> {nxt.name} is not allowed; "
                         f"from {cur.name} the lifecycle allows: {allowed}")
