"""The router's flight: one choice of a request on its way through a prefill node and a decode node, as a declared
table and a pure object that returns effects; api/router_client.py carries the effects out over HTTP.

| name      | what                                                                                  |
|-----------|---------------------------------------------------------------------------------------|
| `Stage`   | prefill -> decode -> done                                                              |
| `RULES`   | (stage, event) -> next stage and the effects it owes, each guarded by what is known   |
| `Effect`  | one thing to carry out: count, open/close the stream, tell or abort a node, error     |
| `Flight`  | the per-choice object: ``prefilled``, ``decode_row``, ``transfer_done``, ``last_token``, ``end``, ``fail`` |

Who holds what: in ``prefill`` the prefill node works on rows the router does not know yet (an ending there aborts
them when its answer arrives); in ``decode`` the decode node streams and the prefill node holds the KV until the
decode node's ``transfer_done`` (an ending before it aborts both rows, after it the decode row only); ``done`` owes
nothing except aborting a prefill answer that arrives late. A node marked dead is told nothing.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple


class Stage(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


class Effect(NamedTuple):
    """``action`` on ``node`` ("prefill" / "decode"): ``in_flight`` (add ``value`` to the router's count there),
    ``open_stream`` / ``close_stream`` (the decode call), ``cancel_prefill`` (the request's shared prefill call,
    once every choice ended), ``transfer_done`` / ``abort`` (POST to the node for ``row``), ``error`` (``value``
    to the client)."""

    action: str
    node: str = ""
    row: tuple[int, int] | None = None
    value: Any = None


@dataclass(frozen=True)
class Rule:
    stage: Stage
    event: str
    next: Stage
    effects: tuple[str, ...]   # "action node" (enter / leave: the in_flight count), guarded in Flight._carry
    meaning: str


P, D, X = Stage.PREFILL, Stage.DECODE, Stage.DONE
RULES: tuple[Rule, ...] = (
    Rule(P, "prefilled", D, ("enter decode", "open_stream decode"),
         "the prefill node answered with the rows and their KVReady; the decode stream starts"),
    Rule(P, "end", X, ("leave prefill", "cancel_prefill prefill"),
         "ended before the prefill answer: its rows there are aborted when it arrives"),
    Rule(D, "decode_row", D, (), "the decode node named its row"),
    Rule(D, "transfer_done", D, ("leave prefill", "transfer_done prefill"),
         "the decode node holds the KV: the prefill node frees its copy"),
    Rule(D, "last_token", D, (), "the decode node ended its row itself (a finish reason)"),
    Rule(D, "end", X, ("leave prefill", "leave decode", "abort decode", "close_stream decode",
                       "abort prefill"),
         "ended while decoding: the decode row (if open) and the prefill row (before transfer_done) are aborted"),
    Rule(X, "prefilled", X, ("abort prefill",), "the prefill answer came after the end: free its rows there"),
    Rule(X, "decode_row", X, (), "late"),
    Rule(X, "transfer_done", X, (), "late: the prefill row was aborted already"),
    Rule(X, "last_token", X, (), "late"),
    Rule(X, "end", X, (), "a second ending is a no-op"),
)
RULE: dict[tuple[Stage, str], Rule] = {(r.stage, r.event): r for r in RULES}


class Flight:
    """One choice's flight (no I/O). Every event method returns the effects to carry out, in order; an event the
    table has no rule for in the current stage raises ValueError. ``dead``: the roles ("prefill", "decode") whose
    node is marked dead (told nothing)."""

    def __init__(self) -> None:
        self.stage = Stage.PREFILL
        self.prefill_row: tuple[int, int] | None = None   # the prefill node's row, once it answered
        self.decode_row: tuple[int, int] | None = None    # the decode node's row while its stream has one open
        self.prefill_told = False   # the prefill node was told transfer_done or abort (or needs neither)
        self.counted = {"prefill": True, "decode": False}   # counted in that node's in_flight

    @property
    def ended(self) -> bool:
        return self.stage is Stage.DONE

    def prefilled(self, row: Iterable[int], dead: Iterable[str] = ()) -> list[Effect]:
        self.prefill_row = tuple(row)
        return self._apply("prefilled", dead)

    def opened(self, row: Iterable[int]) -> list[Effect]:
        """The decode stream named its row."""
        effects = self._apply("decode_row", ())
        if not self.ended:
            self.decode_row = tuple(row)
        return effects

    def transfer_done(self) -> list[Effect]:
        return self._apply("transfer_done", ())

    def last_token(self) -> list[Effect]:
        effects = self._apply("last_token", ())
        self.decode_row = None
        return effects

    def end(self, dead: Iterable[str] = ()) -> list[Effect]:
        """The client has its answer or left, a stop string matched, or the router stops."""
        return self._apply("end", dead)

    def fail(self, error: Any, dead: Iterable[str] = ()) -> list[Effect]:
        """A node failed the flight (its error, or it died: ``dead``): the client gets ``error`` unless the flight
        already ended, then it ends."""
        head = [] if self.ended else [Effect("error", value=error)]
        return head + self.end(dead)

    def _apply(self, event: str, dead: Iterable[str]) -> list[Effect]:
        rule = RULE.get((self.stage, event))
        if rule is None:
            raise ValueError(f"flight in stage {self.stage.value} has no rule for {event!r}")
        self.stage = rule.next
        dead = frozenset(dead)
        return [e for spec in rule.effects for e in self._carry(*spec.split(), dead)]

    def _carry(self, action: str, node: str, dead: frozenset[str]) -> list[Effect]:
        """The effect ``action node`` if what it needs holds (and the bookkeeping that it was owed once)."""
        if action in ("enter", "leave"):   # the router's in_flight count on the node: once in, once out
            if self.counted[node] == (action == "enter"):
                return []
            self.counted[node] = action == "enter"
            return [Effect("in_flight", node, value=1 if action == "enter" else -1)]
        if action == "abort" and node == "decode":
            if self.decode_row is None or node in dead:
                return []
            row, self.decode_row = self.decode_row, None
            return [Effect("abort", node, row)]
        if action in ("abort", "transfer_done") and node == "prefill":
            if self.prefill_told or self.prefill_row is None or (action == "abort" and node in dead):
                return []
            self.prefill_told = True
            return [Effect(action, node, self.prefill_row)]
        return [Effect(action, node)]
