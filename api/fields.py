"""Which request fields each route takes: honoured, or accepted and ignored (with the reason). Plain data, no I/O.

    FieldTable      one route's table: ``honoured`` names, ``ignored`` {name: why}; ``check(body)`` is the 400
                    naming an unknown field (a typo such as ``max_token`` is never silently ignored)
    UnknownFields   the Responses and Messages routes' unknown fields, input items and tool types: accepted,
                    logged once per name at WARNING and counted (``pdserve_unknown_request_fields_total``), or,
                    with ``--strict-fields``, the 400
    CHAT, COMPLETION  the tables of /v1/chat/completions and /v1/completions (README "OpenAI API" lists them)

The field lists follow the official ``openai`` Python package's ``CompletionCreateParams`` (chat and legacy
completions) plus vLLM's extensions that pdserve honours (``top_k``, ``min_p``, ``ignore_eos``, ...). A field is
"ignored" only where ignoring it cannot change what the client gets back in a way it relies on: hints to OpenAI's
own infrastructure (caching, routing, billing, abuse tracking) and options for features this model does not have
(reasoning, web search, audio input). An ignored field's value is not validated beyond what its handler in
api/protocol.py checks (``audio``/``modalities`` asking for audio output is a 400 there). Other dialects
(Responses, Messages) build their own FieldTable the same way.
"""
from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field

from pdserve.errors import InvalidRequestError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FieldTable:
    """The fields one route takes. ``honoured``: names the parser acts on (some refuse a value they cannot honour,
    naming the field); ``ignored``: {name: why it is safe to ignore}, accepted with any value."""

    route: str
    honoured: frozenset[str]
    ignored: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        both = self.honoured & set(self.ignored)
        if both:
            raise ValueError(f"{self.route}: fields both honoured and ignored: {sorted(both)}")

    @property
    def names(self) -> frozenset[str]:
        return self.honoured | frozenset(self.ignored)

    def check(self, body: dict) -> None:
        """Raises InvalidRequestError (400, code unknown_parameter) naming the first field of ``body`` that is
        neither honoured nor ignored."""
        for name in body:
            if name not in self.honoured and name not in self.ignored:
                raise InvalidRequestError(f"unrecognized request argument '{name}' for {self.route}", param=name,
                                          code="unknown_parameter")

    def ignored_in(self, body: dict) -> list[str]:
        """The ignored fields ``body`` sets (not None), for the debug log."""
        return [name for name in body if name in self.ignored and body[name] is not None]


_HINT = "a hint to OpenAI's own infrastructure; nothing to do here"
_IGNORED_COMMON = {
    "user": "an end-user id for OpenAI's abuse monitoring (validated as a string, not stored)",
}
_IGNORED_CHAT = {
    **_IGNORED_COMMON,
    "store": "OpenAI keeps the completion for its evals and distillation; nothing is stored here",
    "metadata": "tags for stored completions; nothing is stored here (validated as an object)",
    "service_tier": "OpenAI's processing tier (auto, default, flex, scale, priority, fast): one tier here",
    "prompt_cache_key": _HINT + " (the prefix cache matches prompts by their tokens)",
    "prompt_cache_retention": _HINT + " (prefix cache blocks stay until the pool needs room)",
    "prompt_cache_options": _HINT + " (prefix cache blocks stay until the pool needs room)",
    "safety_identifier": "an end-user id for OpenAI's abuse monitoring",
    "reasoning_effort": "for reasoning models; the served model has no reasoning budget to set",
    "verbosity": "a style hint for OpenAI's reasoning models; not a sampling parameter",
    "web_search_options": "OpenAI's web search tool; this server has none, the model answers from the prompt",
    "prediction": "predicted output only speeds OpenAI's decoding; the output is the same without it",
    "moderation": "OpenAI's moderation pass; none runs here",
    "modalities": "output modalities: text is the only one (asking for audio is a 400)",
    "audio": "audio output parameters: null is accepted, a value is a 400 (text output only)",
}
_IGNORED_COMPLETION = {
    **_IGNORED_COMMON,
}

# vLLM's sampling extensions and ours, honoured on both routes
_EXTENSIONS = {"top_k", "min_p", "repetition_penalty", "ignore_eos", "timeout"}
# llama.cpp's stream telemetry (api/llama_timings.py)
LLAMA_TELEMETRY = frozenset({"timings_per_token", "return_progress"})
_HONOURED_COMMON = _EXTENSIONS | LLAMA_TELEMETRY | {
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "logprobs",
    "presence_penalty", "frequency_penalty", "logit_bias", "response_format",
}
CHAT = FieldTable("/v1/chat/completions", frozenset(_HONOURED_COMMON | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
    # vLLM's chat-template controls
    "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
    # deprecated; refused unless neutral (use tools / tool_choice)
    "functions", "function_call",
}), _IGNORED_CHAT)
COMPLETION = FieldTable("/v1/completions", frozenset(_HONOURED_COMMON | {
    "prompt", "echo",
    "suffix", "best_of",   # refused unless neutral: no fill-in-the-middle, no server-side ranking
}), _IGNORED_COMPLETION)

STREAM_OPTIONS = FieldTable("stream_options", frozenset({"include_usage", "continuous_usage_stats"}), {
    "include_obfuscation": "OpenAI pads stream events against length side channels; no padding is sent",
})


# OpenAI's bounds on ``metadata`` (chat completions and Responses): key-value string pairs
METADATA_MAX_KEYS, METADATA_MAX_KEY_CHARS, METADATA_MAX_VALUE_CHARS = 16, 64, 512
USER_MAX_CHARS = 512   # ``user``/``safety_identifier``: an end-user id string (OpenAI's guide: a hash of it)


def check_echoed(body: dict) -> None:
    """The fields a route echoes back or stores, checked as OpenAI does: ``metadata`` an object of at most 16
    string keys of at most 64 characters, each value a string of at most 512; ``user`` and ``safety_identifier``
    strings of at most USER_MAX_CHARS. Raises InvalidRequestError (400) naming the field."""
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise InvalidRequestError("'metadata' must be an object of string values", param="metadata")
        if len(metadata) > METADATA_MAX_KEYS:
            raise InvalidRequestError(f"'metadata' has {len(metadata)} keys; at most {METADATA_MAX_KEYS}",
                                      param="metadata")
        for key, value in metadata.items():
            if len(key) > METADATA_MAX_KEY_CHARS:
                raise InvalidRequestError(f"'metadata' key {key[:METADATA_MAX_KEY_CHARS]!r}... is longer than "
                                          f"{METADATA_MAX_KEY_CHARS} characters", param="metadata")
            if not isinstance(value, str) or len(value) > METADATA_MAX_VALUE_CHARS:
                raise InvalidRequestError(f"'metadata.{key}' must be a string of at most {METADATA_MAX_VALUE_CHARS} "
                                          "characters", param="metadata")
    for name in ("user", "safety_identifier"):
        value = body.get(name)
        if value is not None and (not isinstance(value, str) or len(value) > USER_MAX_CHARS):
            raise InvalidRequestError(f"'{name}' must be a string of at most {USER_MAX_CHARS} characters",
                                      param=name)


class UnknownFields:
    """What the Responses and Messages routes do with a name they do not know (a top-level field, an input item or
    content block type, a tool type): these APIs grow often and their clients send the new names at once (Codex
    broke on llama.cpp when it added a tool type: openai/codex issue 10635), so by default the name is accepted and
    left out, logged at WARNING the first time per (route, name), and counted (``counts``, exported as
    ``pdserve_unknown_request_fields_total{route,field}``). ``strict`` (the config's ``strict_fields``): the 400
    naming it. The long-standing chat and completions fields keep their 400 (:class:`FieldTable`): a typo there is
    a client bug, not a newer API."""

    def __init__(self, strict: bool = False):
        self.strict = strict
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()

    def seen(self, route: str, name: str, message: str, param: str) -> None:
        """Raises InvalidRequestError(``message``, ``param``, code unknown_parameter) when strict; else logs (once)
        and counts ``name`` under ``route``."""
        if self.strict:
            raise InvalidRequestError(message, param=param, code="unknown_parameter")
        if (route, name) not in self.counts:
            log.warning("%s: %r is unknown to this server, accepted and left out (first seen in: %s; "
                        "--strict-fields refuses it)", route, name, message)
        self.counts[route, name] += 1

    def fields(self, route: str, body: dict, known, message: str = "unrecognized request argument {name!r}") -> None:
        """:meth:`seen` for every top-level field of ``body`` not in ``known``."""
        for name in body:
            if name not in known:
                self.seen(route, name, message.format(name=name), name)


STRICT = UnknownFields(strict=True)   # the default of the dialects' translate(): callers that do not say refuse
