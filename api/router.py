"""The router's decisions: which prefill actor and which decode actor take a request (plain code over a snapshot of
the actors' loads; the API process gathers the snapshot and carries out the choice).

Prefill: the longest cached prompt prefix first (when the actor reports a prefix cache), then the fewest queued
prompt tokens, then the lowest index. Decode: the most free KV blocks (an actor whose pool cannot fit prompt +
max_tokens now keeps the request in BOOTSTRAP until its batch makes room, so the most free blocks is also the
shortest wait), then the fewest running requests, then the lowest index. An actor that is not serving (hung, dead,
restarting, draining) gets no new work. With no eligible actor of a role the request is refused with a retryable
503 (``EngineOverloadedError``), never queued on a sick actor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from pdserve.errors import EngineOverloadedError


@dataclass(frozen=True)
class ActorLoad:
    """One actor's load as the router sees it. ``cached_prefix_tokens`` maps a prompt to the tokens of it the
    actor's prefix cache holds (None: the actor has no cache)."""

    index: int
    name: str
    serving: bool
    queued_prompt_tokens: int = 0
    running: int = 0
    kv_blocks_free: int = 0
    block_tokens: int = 16
    cached_prefix_tokens: Callable[[Sequence[int]], int] | None = None


@dataclass(frozen=True)
class Route:
    prefill: int | None   # actor index; None in colocated mode (the decode actor prefills)
    decode: int


def pick_prefill(actors: Sequence[ActorLoad], prompt_ids: Sequence[int]) -> ActorLoad:
    """The prefill actor for a prompt. Raises EngineOverloadedError when none is serving."""
    eligible = [a for a in actors if a.serving]
    if not eligible:
        raise EngineOverloadedError("no prefill actor is serving (hung, dead or restarting); retry the request")

    def key(actor: ActorLoad):
        cached = actor.cached_prefix_tokens(prompt_ids) if actor.cached_prefix_tokens else 0
        return (-cached, actor.queued_prompt_tokens, actor.index)
    return min(eligible, key=key)


def pick_decode(actors: Sequence[ActorLoad], prompt_tokens: int, max_tokens: int) -> ActorLoad:
    """The decode actor for a request of ``prompt_tokens + max_tokens`` (what it will reserve). Raises
    EngineOverloadedError when none is serving."""
    serving = [a for a in actors if a.serving]
    if not serving:
        raise EngineOverloadedError("no decode actor is serving (hung, dead or restarting); retry the request")
    return min(serving, key=lambda a: (-a.kv_blocks_free, a.running, a.index))


def route(prefill: Sequence[ActorLoad], decode: Sequence[ActorLoad], prompt_ids: Sequence[int],
          max_tokens: int) -> Route:
    """Both choices for one request; ``prefill`` empty = colocated mode. Raises EngineOverloadedError."""
    chosen_decode = pick_decode(decode, len(prompt_ids), max_tokens)
    chosen_prefill = pick_prefill(prefill, prompt_ids).index if prefill else None
    return Route(chosen_prefill, chosen_decode.index)
