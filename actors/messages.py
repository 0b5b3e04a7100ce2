"""Messages between actors: small frozen dataclasses, grouped by recipient, carrying ids and numbers only.

On the wire a message is an orjson-encoded list ``[kind, WIRE_VERSION, field1, field2, ...]`` (positional, so
frames stay small; a frame of another version is refused, not misread). Every message about a request carries ``(slot, generation)`` of its state-table row: a
message whose generation no longer matches the row is stale and is counted and dropped by the receiver.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from actors.topology import LOCAL_DECODE, LOCAL_PREFILL
from pdserve.sampling import Sampling

# 2: PrefillRequest.decode_actor and KVReady.prefill_actor are addresses (actors/topology.py), no longer indices
WIRE_VERSION = 2


# ---- to the prefill actor ---------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefillRequest:
    """API -> prefill: a new admitted request; its row is QUEUED."""

    kind: ClassVar[str] = "prefill_request"
    slot: int
    generation: int
    request_id: str
    prompt_ids: list[int]
    sampling: Sampling
    # further rows of an ``n > 1`` request: ``[[slot, generation], ...]``; they share this one prefill (one KV
    # computation, one set of prefill blocks) and each gets its own first token and its own decode sequence
    children: list[list[int]] = dataclasses.field(default_factory=list)
    # the address of the decode actor the router chose ("decode1"); LOCAL_DECODE colocated; REMOTE a decode node
    # elsewhere (KVReady to this node's API)
    decode_actor: str = LOCAL_DECODE


@dataclass(frozen=True)
class EmbedRequest:
    """API -> prefill: embed one input (``/v1/embeddings``); its row is QUEUED. Prefill runs ``prompt_ids`` through
    the packed forward passes beside prompts being generated, pools the final hidden state (after the final norm)
    with ``pooling`` (``"last"``: the last token's; ``"mean"``: the mean over every token), L2-normalises it, moves
    the row PREFILLING -> FINISHED and answers Embedding; nothing goes to decode. In colocated mode the decode
    actor's prefill core takes it."""

    kind: ClassVar[str] = "embed_request"
    slot: int
    generation: int
    request_id: str
    prompt_ids: list[int]
    pooling: str = "last"

    @property
    def children(self) -> tuple:
        """No ``n > 1`` rows: an embedding is one row (the cores read ``children`` of every request they queue)."""
        return ()


@dataclass(frozen=True)
class TransferDone:
    """Decode -> prefill: decode holds a full copy of the request's KV; prefill may free its blocks."""

    kind: ClassVar[str] = "transfer_done"
    slot: int
    generation: int


@dataclass(frozen=True)
class KVHandBack:
    """Decode -> prefill, best effort (cross-turn reuse, docs/architecture.md): request ``(slot, generation)``,
    which this prefill actor served, finished; the KV of its prompt followed by ``output_ids`` (the answer but its
    last token, which has no KV) is in ``block_ids`` of the pool of the decode actor at address ``decode_actor``
    (LOCAL_DECODE: the same pool, colocated mode: the blocks are handed over), each of the generation in ``block_generations`` (a block
    reallocated since reads another). Prefill caches what it lacks and answers HandBackDone."""

    kind: ClassVar[str] = "kv_hand_back"
    slot: int
    generation: int
    decode_actor: str
    output_ids: list[int]
    block_ids: list[int]
    block_generations: list[int]


# ---- to the decode actor ----------------------------------------------------------------------------
@dataclass(frozen=True)
class HandBackDone:
    """Prefill -> decode: prefill is done with the blocks of the KVHandBack of row ``(slot, generation)``
    (copied or not); decode may free them."""

    kind: ClassVar[str] = "hand_back_done"
    slot: int
    generation: int


@dataclass(frozen=True)
class KVReady:
    """Prefill -> decode (bootstrap): the prompt's KV sits in prefill's pool at ``src_block_ids``.

    Decode reserves blocks for ``num_tokens + sampling.reserved_output_tokens`` tokens (the full prompt blocks once
    for all KVReadies naming the same ``prompt_row``), pulls the blocks through its KVTransport, answers
    TransferDone, then emits ``first_token`` (sampled by prefill) and decodes.
    """

    kind: ClassVar[str] = "kv_ready"
    slot: int
    generation: int
    request_id: str
    src_block_ids: list[int]
    num_tokens: int
    first_token: int
    sampling: Sampling
    queue_s: float = 0.0      # admission to prefill start
    prefill_s: float = 0.0    # the prompt's forward pass
    first_logprobs: list | None = None   # [logprob, [[token_id, logprob], ...]] when sampling.logprobs is set
    prompt_ids: list[int] = dataclasses.field(default_factory=list)   # sent only for a repetition penalty
    # the address of the prefill actor holding the blocks (its pool, its TransferDone): "prefill0"; LOCAL_PREFILL
    # colocated; REMOTE from a prefill node (the decode actor renames it to the pool's peer_address)
    prefill_actor: str = LOCAL_PREFILL
    cached_tokens: int = 0    # leading prompt tokens whose KV came from prefill's prefix cache (not recomputed)
    # across nodes (prefill_actor REMOTE): the source pool's ipc.mooncake_transport.PeerDescriptor JSON
    peer: str = ""
    # ``[slot, generation]`` of the request's first row on the prefill side: the same in every KVReady of an
    # ``n > 1`` request's children, so decode holds their full prompt blocks once (actors/decode_core.py)
    prompt_row: list[int] = dataclasses.field(default_factory=list)


# ---- to the API -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenBatch:
    """Decode -> API: new tokens of several requests from one decode step.

    ``items`` rows are ``[slot, generation, token_id, finish_reason or None]``, plus a fifth element, a dict,
    when there is more to say about the token: ``"timings"`` (a request's first token: its stage timings
    ``{"queue_s", "prefill_s", "transfer_s", "transfer_bytes"}``) and ``"logprobs"`` (``[logprob,
    [[token_id, logprob], ...]]`` when the request asked for log-probabilities).
    """

    kind: ClassVar[str] = "token_batch"
    items: list[list[Any]]


@dataclass(frozen=True)
class PromptLogprobs:
    """Prefill -> API: log-probabilities of prompt positions ``start ..`` (``entries[i]`` for position
    ``start + i``: ``[logprob, [[token_id, logprob], ...]]``, or None for position 0, which has no context).
    Sent in order, in frames small enough for a queue slot, before the request's KVReady; so they reach the API
    before its first token does."""

    kind: ClassVar[str] = "prompt_logprobs"
    slot: int
    generation: int
    start: int
    entries: list[Any]


@dataclass(frozen=True)
class Embedding:
    """Prefill -> API: the embedding of row ``(slot, generation)`` (an EmbedRequest), sent once its row is FINISHED:
    ``data`` is base64 of its float32 values, little-endian (``hidden_size * 4`` bytes: what OpenAI's
    ``encoding_format: "base64"`` answers, and exact for the float one)."""

    kind: ClassVar[str] = "embedding"
    slot: int
    generation: int
    data: str


@dataclass(frozen=True)
class RequestError:
    """Any actor or the monitor -> API: the request ended in an error the client must be told."""

    kind: ClassVar[str] = "request_error"
    slot: int
    generation: int
    http_status: int
    error_type: str
    message: str


_ALL = (PrefillRequest, EmbedRequest, TransferDone, KVHandBack, HandBackDone, KVReady, TokenBatch, PromptLogprobs,
        Embedding, RequestError)
_BY_KIND = {cls.kind: cls for cls in _ALL}


def to_wire(message: Any) -> list[Any]:
    """Encode a message dataclass as ``[kind, WIRE_VERSION, *fields]`` (nested Sampling becomes a list)."""
    out: list[Any] = [message.kind, WIRE_VERSION]
    for f in dataclasses.fields(message):
        value = getattr(message, f.name)
        if isinstance(value, Sampling):
            value = list(dataclasses.astuple(value))
        out.append(value)
    return out


def from_wire(frame: list[Any]) -> Any:
    """Decode ``[kind, WIRE_VERSION, *fields]``. Raises ValueError for an unknown kind, another wire version or a
    wrong field count."""
    if not isinstance(frame, list) or not frame or frame[0] not in _BY_KIND:
        raise ValueError(f"unknown message frame: {str(frame)[:80]}")
    cls = _BY_KIND[frame[0]]
    if len(frame) < 2 or frame[1] != WIRE_VERSION:
        raise ValueError(f"{cls.__name__} frame of wire version {frame[1] if len(frame) > 1 else None!r}; this "
                         f"engine speaks {WIRE_VERSION}")
    fields = dataclasses.fields(cls)
    if len(frame) - 2 != len(fields):
        raise ValueError(f"{cls.__name__} needs {len(fields)} fields, got {len(frame) - 2}")
    values = {}
    for f, value in zip(fields, frame[2:]):
        if f.name == "sampling":
            value = Sampling(*value)
            value = dataclasses.replace(value, stop_token_ids=tuple(value.stop_token_ids),
                                        logit_bias_ids=tuple(value.logit_bias_ids),
                                        logit_bias_values=tuple(value.logit_bias_values))
        values[f.name] = value
    return cls(**values)


def parse_frames(frames: list[Any], log) -> list[Any]:
    """Decode a batch of frames; a malformed one is logged and dropped, never fatal to the receiving actor."""
    out = []
    for frame in frames:
        try:
            out.append(from_wire(frame))
        except (ValueError, TypeError) as exc:
            log.error("dropped a malformed message: %s", exc)
    return out
