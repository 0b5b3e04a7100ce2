"""The router's decisions: which prefill actor and which decode actor take a request (plain code over a snapshot of
the actors' loads; the API process gathers the snapshot and carries out the choice).

Prefill: the longest cached prompt prefix first (as the actors' cache summaries report it, ipc/cache_summary.py),
then the fewest queued prompt tokens, then the lowest index; but only among the actors whose queued prompt tokens
exceed the least-queued one's by at most ``max_imbalance_tokens`` (config ``cache_routing_max_imbalance_tokens``),
so one hot prefix cannot pile every request onto the actor that caches it while another idles. Decode: the most
free KV blocks, less those the requests routed there but not yet prefilled will reserve (``with_routed``; an actor
whose pool cannot fit prompt + max_tokens now keeps the request in BOOTSTRAP until its batch makes room, so the most
free blocks is also the shortest wait), then the fewest running requests, then the lowest index. An actor that is
not serving (hung, dead, restarting, draining, or drained by the monitor: actors/ejection.py) gets no new work.
With no eligible actor of a role the request is refused with a retryable 503 (``EngineOverloadedError``), never
queued on a sick actor.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from pdserve.errors import EngineOverloadedError


@dataclass(frozen=True)
class ActorLoad:
    """One actor's load as the router sees it. ``cached_prefix_tokens`` maps a prompt to the tokens of it the
    actor's prefix cache holds (None: the actor has no cache; api/admission.py ``PrefixLookup`` reads the
    summaries)."""

    index: int
    name: str
    serving: bool
    queued_prompt_tokens: int = 0
    running: int = 0
    kv_blocks_free: int = 0
    block_tokens: int = 16
    cached_prefix_tokens: Callable[[Sequence[int]], int] | None = None


@dataclass(frozen=True)
class Routed:
    """A request the API routed and still waits on: the actor indices it went to (-1 or another node's: none
    here), its prompt length, the decode blocks it will reserve (prompt + max_tokens) and whether its first token
    came (its prompt left the prefill queue and its decode actor reserved its blocks)."""

    prefill: int
    decode: int
    prompt_tokens: int
    reserve_blocks: int
    prefilled: bool


def with_routed(actors: Sequence[ActorLoad], routed: Iterable[Routed]) -> list[ActorLoad]:
    """``actors`` (as their table rows report them) plus what the requests routed to them add before the actors
    see it: a request not yet prefilled counts its prompt tokens on its prefill actor's queue and its reservation
    off its decode actor's free blocks (the actor's own count does not show blocks it has not reserved yet, so
    a burst would all go to the pool that looked emptiest); every routed request counts as running on its decode
    actor."""
    queued: dict[int, int] = {}
    pending: dict[int, int] = {}
    running: dict[int, int] = {}
    for r in routed:
        if not r.prefilled:
            queued[r.prefill] = queued.get(r.prefill, 0) + r.prompt_tokens
            pending[r.decode] = pending.get(r.decode, 0) + r.reserve_blocks
        running[r.decode] = running.get(r.decode, 0) + 1
    return [dataclasses.replace(a, queued_prompt_tokens=a.queued_prompt_tokens + queued.get(a.index, 0),
                                kv_blocks_free=a.kv_blocks_free - pending.get(a.index, 0),
                                running=a.running + running.get(a.index, 0)) for a in actors]


@dataclass(frozen=True)
class Route:
    prefill: int | None   # actor index; None in colocated mode (the decode actor prefills)
    decode: int


def pick_prefill(actors: Sequence[ActorLoad], prompt_ids: Sequence[int],
                 max_imbalance_tokens: int | None = None) -> ActorLoad:
    """The prefill actor for a prompt: among the serving actors whose queued prompt tokens are within
    ``max_imbalance_tokens`` of the least-queued one's (None: all serving ones), the longest cached prefix, then
    the fewest queued prompt tokens, then the lowest index. Raises EngineOverloadedError when none is serving."""
    eligible = [a for a in actors if a.serving]
    if not eligible:
        raise EngineOverloadedError("no prefill actor is serving (hung, dead, restarting or drained); retry the "
                                    "request")
    if max_imbalance_tokens is not None:
        least = min(a.queued_prompt_tokens for a in eligible)
        eligible = [a for a in eligible if a.queued_prompt_tokens - least <= max_imbalance_tokens]
    if len(eligible) == 1:   # no choice: no prompt hashing
        return eligible[0]

    def key(actor: ActorLoad):
        cached = actor.cached_prefix_tokens(prompt_ids) if actor.cached_prefix_tokens else 0
        return (-cached, actor.queued_prompt_tokens, actor.index)
    return min(eligible, key=key)


def pick_decode(actors: Sequence[ActorLoad], prompt_tokens: int, max_tokens: int) -> ActorLoad:
    """The decode actor for a request of ``prompt_tokens + max_tokens`` (what it will reserve). Raises
    EngineOverloadedError when none is serving."""
    serving = [a for a in actors if a.serving]
    if not serving:
        raise EngineOverloadedError("no decode actor is serving (hung, dead, restarting or drained); retry the request")
    return min(serving, key=lambda a: (-a.kv_blocks_free, a.running, a.index))


def route(prefill: Sequence[ActorLoad], decode: Sequence[ActorLoad], prompt_ids: Sequence[int],
          max_tokens: int, max_imbalance_tokens: int | None = None) -> Route:
    """Both choices for one request; ``prefill`` empty = colocated mode. Raises EngineOverloadedError."""
    chosen_decode = pick_decode(decode, len(prompt_ids), max_tokens)
    chosen_prefill = pick_prefill(prefill, prompt_ids, max_imbalance_tokens).index if prefill else None
    return Route(chosen_prefill, chosen_decode.index)
