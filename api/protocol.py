"""OpenAI request parsing and validation (the response bodies: api/dialects/openai.py). Plain synchronous code, no I/O.

Every invalid input raises InvalidRequestError naming the parameter; the app turns it into
``{"error": {"message", "type", "param", "code"}}`` with status 400. Nothing invalid reaches an actor.
"""
from __future__ import annotations

import dataclasses
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from api import fields
from api.formats import (THINK_CLOSE, THINK_OPEN, OutputFormats, prompt_closes_reasoning, prompt_opens_reasoning,
                         tool_parser, with_special_markers)
from api.tools import ToolPlan, parameters_schema, parse_tools, template_messages
from pdserve.errors import InvalidRequestError, ModelNotFoundError, PdserveError
from pdserve.faults import DRILL_PREFIX, PROBE_PREFIX
from pdserve.kv_budget import blocks_for
from pdserve.sampling import Sampling

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_SEED = 2**63 - 1
MAX_REQUEST_ID_CHARS = 256  # X-Request-Id; the state table keeps the first 40 bytes (state_table.REQUEST_ID_BYTES)
MAX_TIMEOUT_S = 86400.0
MAX_LOGPROBS = 20   # top alternatives per token (chat's top_logprobs, completions' logprobs)
MAX_N = 128         # choices per request (OpenAI's limit)
MAX_LOGIT_BIAS_ENTRIES = 1024   # tokens one logit_bias may name (OpenAI allows 300; the wire frame stays small)
# The inclusive range of each numeric Sampling field as the parser accepts it; SAMPLING_NOT_ZERO: in range, but 0
# is refused (top_p 0 keeps nothing, top_k 0 is neither off nor a count, repetition_penalty 0 divides by zero).
# api/node_api.py checks a Sampling from another node against the same table.
SAMPLING_BOUNDS = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "top_k": (-1, 1 << 20), "min_p": (0.0, 1.0),
                   "seed": (0, MAX_SEED), "max_tokens": (1, 2**31 - 1), "presence_penalty": (-2.0, 2.0),
                   "frequency_penalty": (-2.0, 2.0), "repetition_penalty": (0.0, 10.0), "logprobs": (0, MAX_LOGPROBS),
                   "prompt_logprobs": (0, MAX_LOGPROBS), "reserve_tokens": (0, 2**31 - 1),
                   "logit_bias_values": (-100.0, 100.0)}
SAMPLING_NOT_ZERO = frozenset({"top_p", "top_k", "repetition_penalty"})

# Top-level fields each route takes: api/fields.py (honoured, or accepted and ignored; anything else is a 400 naming
# the field, as OpenAI answers "Unrecognized request argument": a typo such as ``max_token`` is never ignored).
CHAT_FIELDS = fields.CHAT.names
COMPLETION_FIELDS = fields.COMPLETION.names
TOKENIZE = fields.FieldTable("/tokenize", frozenset({"model", "prompt", "messages", "add_special_tokens",
                                                     "add_generation_prompt", "continue_final_message",
                                                     # llama.cpp's form
                                                     "content", "add_special", "with_pieces"}),
                              {"parse_special": "llama.cpp's switch; special-token text is always read as the token"})
DETOKENIZE = fields.FieldTable("/detokenize", frozenset({"model", "tokens"}))


def check_request_id(value: str | None, default: str) -> str:
    """The client's ``X-Request-Id`` when it is 1-MAX_REQUEST_ID_CHARS visible ASCII characters (0x21-0x7E, as
    trace ids are), else ``default``: a tracing header never makes a request fail.

    The id is kept whole for the response (``id``, the ``X-Request-Id`` header) and the API's log lines; the shm
    state table stores its first 40 bytes, which is what tools/inspect and the monitor's log lines show. An id
    starting with ``pdserve.faults.DRILL_PREFIX`` is the engine's own watchdog drills' (faults aim at those), one
    starting with ``PROBE_PREFIX`` the router's readmission probes' (their timeouts never count toward ejection): a
    client's gets ``default``.
    """
    if (value and len(value) <= MAX_REQUEST_ID_CHARS and all("!" <= c <= "~" for c in value)
            and not value.startswith((DRILL_PREFIX, PROBE_PREFIX))):
        return value
    return default


REASONING_SHARE = 0.5   # of max_tokens, the most a reasoning before a constrained answer takes (then </think>)


@dataclass(frozen=True)

class GenerationRequest:
    """A validated request, ready for admission."""

    kind: str                   # "chat" or "completion"
    request_id: str
    model: str
    prompt_ids: list[int]
    sampling: Sampling
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    timeout_s: float | None = None   # per-request deadline (the body's ``timeout``); None = server default
    n: int = 1                       # choices; the engine prefills once and decodes n sequences
    echo_text: str | None = None     # completions with ``echo``: the prompt, returned before each choice's text
    echo_only: bool = False          # completions with ``echo`` and ``max_tokens`` 0: the prompt (and its scores)
    #                                  alone; the engine runs max_tokens 1, whose token is left out of the answer
    tools: ToolPlan | None = None    # chat with tools offered (tool_choice other than "none"); see api/tools.py
    formats: OutputFormats | None = None   # chat: its tool-call and reasoning parsers (api/formats.py)
    first_index: int = 0             # its first choice's index: k * n for the k-th prompt of a completions list
    timings_per_token: bool = False  # llama.cpp's extensions (api/llama_timings.py): ``timings`` in each chunk
    return_progress: bool = False    # and ``prompt_progress`` chunks before the first token (a stream's)
    created: int = field(default_factory=lambda: int(time.time()))


def error_body(error: PdserveError | str, error_type: str = "invalid_request_error",
               param: str | None = None, code: str | None = None) -> dict[str, Any]:
    if isinstance(error, PdserveError):
        return {"error": {"message": error.message, "type": error.error_type, "param": error.param,
                          "code": error.code}}
    return {"error": {"message": error, "type": error_type, "param": param, "code": code}}


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"'{name}' must be a number, got {type(value).__name__}", param=name)
    if not (low <= value <= high):
        raise InvalidRequestError(f"'{name}' must be between {low} and {high}, got {value}", param=name)
    return float(value)


def _integer(body: dict, name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():   # e.g. 10**26, which JSON parsers read as a float
        if low <= value <= high:
            raise InvalidRequestError(f"'{name}' must be an integer, got {value!r} (write it without a decimal point)",
                                      param=name)
        raise InvalidRequestError(f"'{name}' must be an integer between {low} and {high}, got {value:.17g}",
                                  param=name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"'{name}' must be an integer, got {type(value).__name__}", param=name)
    if not (low <= value <= high):
        raise InvalidRequestError(f"'{name}' must be between {low} and {high}, got {value}", param=name)
    return value


def _stop_strings(body: dict, constrained_by: str | None = None) -> tuple[str, ...]:
    """The request's stop strings. ``constrained_by``: the field whose grammar constrains the output (a stop
    string matched inside a constrained answer would cut it into text the grammar does not accept, e.g. JSON that
    does not parse; a constrained answer ends where its grammar does): stop strings with it are a 400."""
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise InvalidRequestError("'stop' must be a non-empty string or a list of non-empty strings", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}",
                                  param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise InvalidRequestError(f"each 'stop' string has at most {MAX_STOP_CHARS} characters", param="stop")
    if constrained_by is not None:
        raise InvalidRequestError(f"'stop' cannot be combined with '{constrained_by}': a stop string would cut the "
                                  f"constrained answer (e.g. JSON that does not parse); the answer ends where its "
                                  f"grammar does, send one of them", param="stop")
    return tuple(stop)


def _unsupported(name: str, why: str, fix: str = "remove it or send its neutral value") -> InvalidRequestError:
    return InvalidRequestError(f"'{name}' is not supported by this engine yet ({why}); {fix}", param=name,
                               code="unsupported_parameter")


def _repetition_penalty(body: dict) -> float:
    value = _number(body, "repetition_penalty", 1.0, *SAMPLING_BOUNDS["repetition_penalty"])
    if value == 0.0:
        raise InvalidRequestError("'repetition_penalty' must be in (0, 10] (1 = off), got 0",
                                  param="repetition_penalty")
    return value


def _check_unsupported_fields(body: dict, kind: str) -> None:
    """Fields the engine cannot honour: the neutral value passes, anything else is a 400 naming the field."""
    (fields.CHAT if kind == "chat" else fields.COMPLETION).check(body)
    if kind != "chat":
        echo = body.get("echo")
        if echo is not None and not isinstance(echo, bool):
            raise InvalidRequestError("'echo' must be a boolean", param="echo")
        suffix = body.get("suffix")
        if suffix is not None and not isinstance(suffix, str):
            raise InvalidRequestError("'suffix' must be a string", param="suffix")
        if suffix:
            raise _unsupported("suffix", "insertion (fill-in-the-middle) is not implemented")
    best_of = _integer(body, "best_of", 1, 1, 128)
    if best_of != 1:
        raise _unsupported("best_of", "server-side ranking of candidates is not implemented; use n")
    fields.check_echoed(body)
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise InvalidRequestError("'store' must be a boolean", param="store")
    if kind == "chat":
        modalities = body.get("modalities")
        if modalities is not None and (not isinstance(modalities, list) or any(m != "text" for m in modalities)):
            raise _unsupported("modalities", "the served model outputs text only; send [\"text\"] or leave it out")
        if body.get("audio") is not None:
            raise _unsupported("audio", "the served model outputs text only; send null or leave it out")
    if kind == "chat":
        functions = body.get("functions")
        if functions is not None and not isinstance(functions, list):
            raise InvalidRequestError("'functions' must be a list", param="functions")
        if functions:
            raise _unsupported("functions", "the deprecated 'functions' field is not implemented; use 'tools'")
        function_call = body.get("function_call")
        if function_call is not None and function_call != "none":
            raise _unsupported("function_call", "the deprecated 'function_call' field is not implemented; use "
                               "'tool_choice'")


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequestError(f"'{name}' must be a boolean", param=name)
    return value


def _llama_telemetry(body: dict) -> dict[str, bool]:
    """llama.cpp's ``timings_per_token`` and ``return_progress`` (booleans; api/llama_timings.py)."""
    return {name: _flag(body, name, False) for name in ("timings_per_token", "return_progress")}


def _logprobs(body: dict, kind: str) -> int | None:
    """How many top alternatives to return with each token's log-probability; None = no log-probabilities.

    Chat: ``logprobs`` (bool) and ``top_logprobs`` (0..20, needs ``logprobs: true``). Completions: ``logprobs``
    (0..20; OpenAI allows 5, vLLM 20).
    """
    value = body.get("logprobs")
    if kind == "chat":
        if value is not None and not isinstance(value, bool):
            raise InvalidRequestError("'logprobs' must be a boolean", param="logprobs")
        top = _integer(body, "top_logprobs", None, *SAMPLING_BOUNDS["logprobs"])
        if top and not value:
            raise InvalidRequestError("'top_logprobs' needs 'logprobs' set to true", param="top_logprobs")
        return (top or 0) if value else None
    if value is None or value is False:
        return None
    low, high = SAMPLING_BOUNDS["logprobs"]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidRequestError(f"'logprobs' must be an integer between 0 and {MAX_LOGPROBS}", param="logprobs")
    return value


def _timeout(body: dict) -> float | None:
    value = body.get("timeout")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_TIMEOUT_S:
        raise InvalidRequestError(f"'timeout' must be a number of seconds in (0, {MAX_TIMEOUT_S:g}]",
                                  param="timeout")
    return float(value)


_RESPONSE_FORMAT_KEYS = {"text": {"type"}, "json_object": {"type", "schema"}, "json_schema": {"type", "json_schema"}}


def _known_keys(value: dict, known: set[str], where: str) -> None:
    unknown = sorted(set(value) - known)
    if unknown:
        raise InvalidRequestError(f"'{where}.{unknown[0]}' is not supported here ({where} takes "
                                  f"{', '.join(sorted(known))})", param="response_format")


def _template_kwargs(body: dict) -> dict[str, Any]:
    """vLLM's ``chat_template_kwargs``: extra variables for the chat template (e.g. Qwen3's ``enable_thinking``).
    Raises InvalidRequestError naming the field for a non-object or a key that would replace the template's own
    inputs."""
    value = body.get("chat_template_kwargs")
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise InvalidRequestError("'chat_template_kwargs' must be an object of template variables",
                                  param="chat_template_kwargs")
    reserved = sorted(set(value) & {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
    if reserved:
        raise InvalidRequestError(f"'chat_template_kwargs' cannot set {', '.join(reserved)} (the request's own "
                                  "fields do)", param="chat_template_kwargs")
    return dict(value)


def _response_format(body: dict) -> dict | None | bool:
    """The JSON schema ``response_format`` asks for: False for none (absent or ``{"type": "text"}``), None for
    any JSON object (``json_object``), else the schema of ``json_schema``, or the ``schema`` of a ``json_object``
    (honoured, as llama.cpp's server does). A key we do not read is a 400 naming it, never silently dropped."""
    value = body.get("response_format")
    if value is None:
        return False
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidRequestError("'response_format' must be an object with a 'type'", param="response_format")
    kind = value["type"]
    if kind not in _RESPONSE_FORMAT_KEYS:
        raise InvalidRequestError(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got "
                                  f"{kind!r}", param="response_format")
    _known_keys(value, _RESPONSE_FORMAT_KEYS[kind], "response_format")
    if kind == "text":
        return False
    if kind == "json_object":
        schema = value.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise InvalidRequestError("'response_format.schema' must be a JSON schema object",
                                      param="response_format")
        return schema
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequestError("'response_format.json_schema' must be an object {'name', 'schema', 'strict'}",
                                  param="response_format")
    _known_keys(spec, {"name", "schema", "strict", "description"}, "response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not re.match(r"^[a-zA-Z0-9_-]{1,64}$", name):
        raise InvalidRequestError("'response_format.json_schema.name' must be 1-64 letters, digits, '_' or '-'",
                                  param="response_format")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise InvalidRequestError("'response_format.json_schema.strict' must be a boolean", param="response_format")
    schema = spec.get("schema")
    if schema is None:
        return None
    if not isinstance(schema, dict):
        raise InvalidRequestError("'response_format.json_schema.schema' must be a JSON schema object",
                                  param="response_format")
    return schema


def _chat_message(message: Any, index: int) -> dict[str, Any]:
    """A validated chat message: ``role`` and ``content`` (str; None only for an assistant's tool calls), plus
    ``tool_calls`` (assistant) or ``tool_call_id`` (tool)."""
    if not isinstance(message, dict):
        raise InvalidRequestError(f"messages[{index}] must be an object", param="messages")
    role = message.get("role")
    if role not in ("system", "user", "assistant", "developer", "tool"):
        raise InvalidRequestError(f"messages[{index}].role must be system, user, assistant or tool, got {role!r}",
                                  param="messages")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    calls = message.get("tool_calls") if role == "assistant" else None
    if calls is not None:
        if not isinstance(calls, list):
            raise InvalidRequestError(f"messages[{index}].tool_calls must be a list", param="messages")
        out["tool_calls"] = [_tool_call(call, index) for call in calls]
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise InvalidRequestError(f"messages[{index}] (role tool) needs a 'tool_call_id' string",
                                      param="messages")
        out["tool_call_id"] = call_id
    if role == "assistant":   # an earlier turn's reasoning (vLLM's ``reasoning_content``, or ``reasoning``)
        for name in ("reasoning_content", "reasoning"):
            value = message.get(name)
            if value is not None and not isinstance(value, str):
                raise InvalidRequestError(f"messages[{index}].{name} must be a string", param="messages")
            if value and "reasoning_content" not in out:
                out["reasoning_content"] = value
    if message.get("content") is None and out.get("tool_calls"):
        out["content"] = None
        return out
    out["content"] = _message_text(message, index)
    return out


REASONING_NAMES = ("reasoning_content", "thinking", "reasoning")   # transformers' names of a message's reasoning


def as_transformers_passes(messages: list[dict]) -> list[dict]:
    """The messages as transformers' ``apply_chat_template`` hands them to a template (transformers 5
    ``_normalize_chat_messages`` and ``_alias_reasoning_fields``): keys whose value is None dropped (a tool-call-only
    turn has no ``content`` key, so a template tests ``message.content is defined`` rather than meeting None), and
    an assistant's reasoning (any of :data:`REASONING_NAMES`) as ``reasoning_content`` and ``thinking`` (Qwen3 reads
    the first, gpt-oss the second)."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in REASONING_NAMES if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _tool_call(call: Any, index: int) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if (not isinstance(fn, dict) or call.get("type", "function") != "function" or not isinstance(fn.get("name"), str)
            or not isinstance(fn.get("arguments", ""), str)):
        raise InvalidRequestError(f"messages[{index}].tool_calls entries must be {{'id', 'type': 'function', "
                                  "'function': {'name': str, 'arguments': str}}", param="messages")
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise InvalidRequestError(f"messages[{index}].tool_calls[].id must be a string", param="messages")
    return {"id": call_id or "", "type": "function",
            "function": {"name": fn["name"], "arguments": fn.get("arguments") or "{}"}}


def _message_text(message: dict, index: int) -> str:
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"messages[{index}].content parts must be text parts "
                                          "({'type': 'text', 'text': ...})", param="messages")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise InvalidRequestError(f"messages[{index}].content must be a string or a list of text parts",
                                  param="messages")
    return content


class RequestParser:
    """Validates request bodies against the served model, its tokenizer and the engine's limits.

    Args:
        tokenizer: gpu.tokenizer.Tokenizer of the served model.
        served_model_name: the model names accepted in ``model`` (comma-separated aliases); responses name the
            first; ``*`` among them accepts any name.
        max_context_tokens: longest prompt + output (tokens) the engine serves (the resolved max_model_len).
        reserve_tokens: output tokens decode reserves KV blocks for, up front, for a request whose max_tokens is
            the rest of the context (none given, or clamped); its answer takes more blocks as it grows.
        max_tokens_policy: "reject" (an explicit max_tokens over the room the prompt leaves is a 400) or "clamp"
            (it becomes that room).
        kv_pool_blocks, kv_block_tokens: the decode KV pool's size (blocks) and block size (tokens), so that the
            ``n`` choices of one request can be checked to fit together; 0 blocks skips the check.
        grammars: gpu.grammar.GrammarCompiler, which checks ``response_format`` and forced tool calls on
            admission; None refuses both.
        formats: ``(tool-call parser, reasoning parser or None)`` of chat answers (api.formats.choose); None:
            ``hermes`` and no reasoning.
        max_sequences: the sequences admission takes at once (the config's ``max_queued_requests``): a list of
            prompts whose prompts x ``n`` exceed it is a 400, as it could never be admitted whole.
        calls_in_reasoning: a complete tool call inside the reasoning is a call (api/formats.py), not reasoning.
        strict_fields: the Responses and Messages routes refuse unknown names (api.fields.UnknownFields).

    A text prompt longer than ``max_token_chars * max_context_tokens`` characters cannot fit whatever its
    tokenization (one token covers at most ``max_token_chars`` characters), so it is rejected before the
    tokenizer runs: a 1 MB prompt costs microseconds, not a second of the event loop.
    """

    def __init__(self, tokenizer, served_model_name: str, max_context_tokens: int, reserve_tokens: int,
                 kv_pool_blocks: int = 0, kv_block_tokens: int = 16, grammars=None,
                 max_tokens_policy: str = "reject", formats: tuple[str, str | None] | None = None,
                 max_sequences: int = 256, calls_in_reasoning: bool = True, strict_fields: bool = False):
        self.tokenizer = tokenizer
        self.calls_in_reasoning = calls_in_reasoning   # the config's tool_calls_in_reasoning is "call"
        self.unknown_fields = fields.UnknownFields(strict_fields)   # the Responses and Messages routes' (api/fields.py)
        self.tool_parser, self.reasoning_parser = formats or ("hermes", None)
        tool_parser(self.tool_parser)   # KeyError naming the choices
        self.grammars = grammars                 # gpu.grammar.GrammarCompiler; None = no constrained decoding
        self.template_has_tools = "tools" in (getattr(tokenizer, "chat_template", None) or "")
        self.kv_pool_blocks = kv_pool_blocks     # the decode pool's blocks; 0 = no check of n against it
        self.kv_block_tokens = kv_block_tokens
        # several names (comma-separated: --served-model-name repeated) are aliases; the first is the one reported;
        # "*" among them accepts any name (llama-server's way with one model: `model` is not checked)
        names = tuple(n.strip() for n in served_model_name.split(",") if n.strip()) or (served_model_name,)
        self.any_model = "*" in names
        self.model_names = tuple(n for n in names if n != "*") or names
        self.served_model_name = self.model_names[0]
        self.max_context_tokens = max_context_tokens
        self.reserve_tokens = reserve_tokens
        self.max_tokens_policy = max_tokens_policy
        self.max_token_chars = _max_token_chars(tokenizer)
        self.max_sequences = max_sequences       # the config's max_queued_requests: bounds prompts x n of one request

    def _model(self, body: dict) -> str:
        model = body.get("model", self.served_model_name)
        if model is None:
            model = self.served_model_name
        if not isinstance(model, str):
            raise InvalidRequestError("'model' must be a string", param="model")
        if model not in self.model_names and not self.any_model:
            raise ModelNotFoundError(f"The model '{model}' does not exist; this server serves "
                                     f"{' or '.join(repr(n) for n in self.model_names)}", param="model",
                                     code="model_not_found")
        return self.served_model_name

    def _too_long(self, prompt_len: int, unit: str = "tokens") -> InvalidRequestError:
        return InvalidRequestError(
            f"This model's maximum context length is {self.max_context_tokens} tokens; the prompt has "
            f"{prompt_len} {unit}, which leaves no room for output", param="prompt",
            code="context_length_exceeded")

    def _encode(self, text: str, param: str) -> list[int]:
        if len(text) > self.max_token_chars * self.max_context_tokens:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_context_tokens} tokens; the prompt has "
                f"{len(text)} characters, more than that many tokens can hold", param=param,
                code="context_length_exceeded")
        try:
            return self.tokenizer.encode(text)
        except (TypeError, ValueError) as exc:   # e.g. a lone surrogate that slipped past the JSON parser
            raise InvalidRequestError(f"'{param}' cannot be tokenized: {exc}", param=param) from None

    def _sampling(self, body: dict, prompt_len: int, kind: str) -> Sampling:
        if prompt_len == 0:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        room = self.max_context_tokens - prompt_len
        if room <= 0:
            raise self._too_long(prompt_len)
        max_tokens = _integer(body, "max_completion_tokens", None, *SAMPLING_BOUNDS["max_tokens"])
        legacy = _integer(body, "max_tokens", None, *SAMPLING_BOUNDS["max_tokens"])
        param = "max_completion_tokens" if max_tokens is not None else "max_tokens"
        if max_tokens is None:
            max_tokens = legacy
        reserve = 0   # all of max_tokens
        if max_tokens is None or (max_tokens > room and self.max_tokens_policy == "clamp"):
            # like OpenAI and vLLM: up to the end of the context; decode reserves reserve_tokens of it up front
            max_tokens, reserve = room, min(self.reserve_tokens, room)
        if prompt_len + max_tokens > self.max_context_tokens:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_context_tokens} tokens; the prompt "
                f"({prompt_len}) plus {param} ({max_tokens}) exceeds it (the server's max_tokens_policy is reject)",
                param=param,
                code="context_length_exceeded")
        bounds = SAMPLING_BOUNDS
        temperature = _number(body, "temperature", 1.0, *bounds["temperature"])
        top_p = _number(body, "top_p", 1.0, *bounds["top_p"])
        if top_p == 0.0:
            raise InvalidRequestError("'top_p' must be > 0", param="top_p")
        top_k = _integer(body, "top_k", -1, *bounds["top_k"])
        if top_k == 0:
            raise InvalidRequestError("'top_k' must be -1 (off) or >= 1", param="top_k")
        min_p = _number(body, "min_p", 0.0, *bounds["min_p"])
        seed = _integer(body, "seed", None, -MAX_SEED, MAX_SEED)
        ignore_eos = body.get("ignore_eos", False)
        if ignore_eos is None:
            ignore_eos = False
        if not isinstance(ignore_eos, bool):
            raise InvalidRequestError("'ignore_eos' must be a boolean", param="ignore_eos")
        return Sampling(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                        seed=None if seed is None else seed % (2**63), max_tokens=max_tokens,
                        ignore_eos=ignore_eos, presence_penalty=_number(body, "presence_penalty", 0.0, *bounds["presence_penalty"]),
                        frequency_penalty=_number(body, "frequency_penalty", 0.0, *bounds["frequency_penalty"]),
                        repetition_penalty=_repetition_penalty(body), logprobs=_logprobs(body, kind),
                        reserve_tokens=reserve, **self._logit_bias(body))

    def _logit_bias(self, body: dict) -> dict[str, tuple]:
        """OpenAI's ``logit_bias`` ``{"token id": bias in [-100, 100]}`` as Sampling's two parallel tuples (sorted
        by id). Raises InvalidRequestError naming ``logit_bias``."""
        value = body.get("logit_bias")
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise InvalidRequestError("'logit_bias' must be an object of token id -> bias", param="logit_bias")
        if len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequestError(f"'logit_bias' takes at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got "
                                      f"{len(value)}", param="logit_bias")
        pairs = []
        for key, bias in value.items():
            token = int(key) if isinstance(key, str) and key.isdigit() else -1
            if not 0 <= token < self.tokenizer.vocab_size:
                raise InvalidRequestError(f"'logit_bias' key {key!r} is not a token id in [0, "
                                          f"{self.tokenizer.vocab_size})", param="logit_bias")
            low, high = SAMPLING_BOUNDS["logit_bias_values"]
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not low <= bias <= high:
                raise InvalidRequestError(f"'logit_bias' value for {key} must be a number in [-100, 100], got "
                                          f"{bias!r}", param="logit_bias")
            pairs.append((token, float(bias)))
        pairs.sort()
        return {"logit_bias_ids": tuple(t for t, _ in pairs), "logit_bias_values": tuple(b for _, b in pairs)}

    def _n(self, body: dict, prompt_len: int, sampling: Sampling) -> int:
        """``n`` choices (1..128). All of them decode at once, so together they must fit in the decode KV pool:
        the prompt's full blocks once (the choices share them, actors/decode_core.py) plus, per choice,
        ``ceil((prompt + reserved output tokens) / block_tokens)`` less those; more is a 400 rather than a request
        that could never be held."""
        n = _integer(body, "n", 1, 1, MAX_N)
        if n > 1 and self.kv_pool_blocks:
            per_choice = blocks_for(prompt_len, sampling.reserved_output_tokens, self.kv_block_tokens)
            shared = prompt_len // self.kv_block_tokens
            needed = shared + n * (per_choice - shared)
            if needed > self.kv_pool_blocks:
                raise InvalidRequestError(
                    f"n={n} choices of prompt ({prompt_len}) + max_tokens ({sampling.reserved_output_tokens}) tokens "
                    f"need {needed} KV blocks; the engine's decode pool holds {self.kv_pool_blocks}. "
                    "Lower n or max_tokens", param="n")
        return n

    def _common(self, body: Any, kind: str) -> tuple[str, bool, bool]:
        if not isinstance(body, dict):
            raise InvalidRequestError("the request body must be a JSON object")
        model = self._model(body)
        stream = body.get("stream", False)
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise InvalidRequestError("'stream' must be a boolean", param="stream")
        options = body.get("stream_options")
        if options is None:
            options = {}
        if not isinstance(options, dict):
            raise InvalidRequestError("'stream_options' must be an object", param="stream_options")
        if options and not stream:
            raise InvalidRequestError("'stream_options' is only allowed when 'stream' is true",
                                      param="stream_options")
        for name in options:
            if name not in fields.STREAM_OPTIONS.names:
                raise InvalidRequestError(f"unrecognized stream_options field '{name}'", param="stream_options")
        include_usage = options.get("include_usage", False)
        if include_usage is None:
            include_usage = False
        if not isinstance(include_usage, bool):
            raise InvalidRequestError("'stream_options.include_usage' must be a boolean", param="stream_options")
        if options.get("continuous_usage_stats"):
            raise _unsupported("stream_options", "continuous_usage_stats is not implemented")
        _check_unsupported_fields(body, kind)
        return model, stream, include_usage

    def chat(self, body: Any, request_id: str | None = None) -> GenerationRequest:
        """Validate a /v1/chat/completions body. Raises InvalidRequestError (400) or ModelNotFoundError (404)."""
        model, stream, include_usage = self._common(body, "chat")
        rid = check_request_id(request_id, f"chatcmpl-{uuid.uuid4().hex[:24]}")
        text, tools, plan, fmt, kwargs, parser = self._chat_prompt(body)
        prompt_ids = self._encode(text, "messages")
        sampling = self._sampling(body, len(prompt_ids), "chat")
        # the request's thinking switch, and whether the model reasons before its answer
        thinking = kwargs.get("enable_thinking", kwargs.get("thinking", True)) is not False
        reasons = bool(self.reasoning_parser) and thinking and not prompt_closes_reasoning(text)
        opened = reasons and (prompt_opens_reasoning(text) or self.reasoning_parser == "deepseek_r1")
        forced = plan is not None and plan.mode in ("named", "required")
        if forced or fmt is not False:
            sampling = self._constrain_answer(sampling, self._answer_grammar(plan, tools, fmt, parser), reasons,
                                              opened, "tool_choice" if forced else "response_format")
        constrained_by = None if sampling.grammar is None else "tool_choice" if plan else "response_format"
        # a grammar constrains the answer after the reasoning (after_reasoning), or the whole output without one
        reasoning = self.reasoning_parser if reasons and (sampling.grammar is None or sampling.reasoning_end) else None
        formats = OutputFormats(parser.name, reasoning, bool(reasoning) and opened, self.calls_in_reasoning)
        return GenerationRequest("chat", rid, model, prompt_ids, sampling, _stop_strings(body, constrained_by), stream,
                                 include_usage, _timeout(body), self._n(body, len(prompt_ids), sampling), tools=plan,
                                 formats=formats, **_llama_telemetry(body))

    def _chat_prompt(self, body: dict) -> tuple:
        """A chat body's prompt text through the chat template (its messages, tools and template controls) ->
        ``(text, tools, tool plan, response format, template kwargs, tool parser)``. Raises InvalidRequestError."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("'messages' must be a non-empty list", param="messages")
        conversation = [_chat_message(m, i) for i, m in enumerate(messages)]
        tools, plan = parse_tools(body)
        fmt = _response_format(body)
        if plan is not None and fmt is not False:
            raise InvalidRequestError("'response_format' cannot be combined with tool calling; send one of them",
                                      param="response_format")
        chars = sum(len(m["content"] or "") for m in conversation) + len(str(tools or ""))
        if chars > self.max_token_chars * self.max_context_tokens:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_context_tokens} tokens; the messages have "
                f"{chars} characters, more than that many tokens can hold", param="messages",
                code="context_length_exceeded")
        history_has_tools = any(m.get("tool_calls") or m["role"] == "tool" for m in conversation)
        parser = tool_parser(self.tool_parser)
        if tools or history_has_tools:   # a template without tools is taught the parser's format (Hermes: as before)
            conversation = template_messages(conversation, tools, self.template_has_tools,
                                             None if parser.name == "hermes" else parser)
        kwargs = _template_kwargs(body)
        extra = {**kwargs, "tools": tools} if tools and self.template_has_tools else kwargs
        return self.render_chat(conversation, body, extra), tools, plan, fmt, kwargs, parser

    def apply_template(self, body: Any) -> dict[str, str]:
        """llama.cpp's ``POST /apply-template``: a chat body -> ``{"prompt": text}``, the prompt its
        /v1/chat/completions would run (messages, tools, ``chat_template_kwargs``, ``add_generation_prompt``,
        ``continue_final_message``), not tokenized and not generated from. Raises InvalidRequestError (400, the
        chat route's checks) or ModelNotFoundError (404)."""
        self._common(body, "chat")
        fields.CHAT.check(body)
        return {"prompt": self._chat_prompt(body)[0]}

    def render_chat(self, conversation: list[dict], body: dict, extra: dict | None = None) -> str:
        """The chat template over ``conversation`` with vLLM's controls from ``body``: ``add_generation_prompt``
        (default true: open the assistant's turn) and ``continue_final_message`` (default false: the last message,
        an assistant's, is continued: the text ends where its content ends, with no end-of-turn after it).
        Raises InvalidRequestError naming the field."""
        add = _flag(body, "add_generation_prompt", True)
        cont = _flag(body, "continue_final_message", False)
        conversation = as_transformers_passes(conversation)
        if not cont:
            return self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add, **(extra or {}))
        if add and body.get("add_generation_prompt") is not None:
            raise InvalidRequestError("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                                      param="continue_final_message")
        final = conversation[-1]
        if final["role"] != "assistant" or not final.get("content"):
            raise InvalidRequestError("'continue_final_message' needs the last message to be an assistant's with "
                                      "text content", param="continue_final_message")
        text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=False, **(extra or {}))
        end = text.rfind(final["content"])
        if end < 0:
            raise InvalidRequestError("the chat template changes the final message's text, so it cannot be "
                                      "continued", param="continue_final_message")
        return text[:end + len(final["content"])]

    def tokenize(self, body: Any) -> dict[str, Any]:
        """vLLM's ``/tokenize``: ``prompt`` (text; ``add_special_tokens`` default true) or ``messages`` (through
        the chat template with ``add_generation_prompt`` / ``continue_final_message``; ``add_special_tokens``
        default false) -> ``{"count", "max_model_len", "tokens"}``; llama.cpp's: ``content`` (``add_special``
        default false, ``with_pieces``) -> ``{"tokens": [id, ...]}``, or with pieces ``{"tokens": [{"id", "piece"}]}``
        (the piece a string, or its bytes as a list of ints when not whole UTF-8). Raises InvalidRequestError (400)
        or ModelNotFoundError (404)."""
        if not isinstance(body, dict):
            raise InvalidRequestError("the request body must be a JSON object")
        TOKENIZE.check(body)
        self._model(body)
        if "content" in body and "prompt" not in body and "messages" not in body:
            return self._tokenize_llama_cpp(body)
        if ("prompt" in body) == ("messages" in body):
            raise InvalidRequestError("send one of 'prompt' (text) or 'messages'", param="prompt")
        if "prompt" in body:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise InvalidRequestError("'prompt' must be a string", param="prompt")
            text, special = prompt, _flag(body, "add_special_tokens", True)
        else:
            messages = body["messages"]
            if not isinstance(messages, list) or not messages:
                raise InvalidRequestError("'messages' must be a non-empty list", param="messages")
            text = self.render_chat([_chat_message(m, i) for i, m in enumerate(messages)], body)
            special = _flag(body, "add_special_tokens", False)
        if len(text) > self.max_token_chars * self.max_context_tokens:
            raise InvalidRequestError(f"the text has {len(text)} characters, more than the model's context "
                                      f"({self.max_context_tokens} tokens) can hold", param="prompt")
        tokens = self.tokenizer.encode(text, add_special_tokens=special)
        return {"count": len(tokens), "max_model_len": self.max_context_tokens, "tokens": tokens}

    def _tokenize_llama_cpp(self, body: dict) -> dict[str, Any]:
        content = body["content"]
        if not isinstance(content, str):
            raise InvalidRequestError("'content' must be a string", param="content")
        if len(content) > self.max_token_chars * self.max_context_tokens:
            raise InvalidRequestError(f"the text has {len(content)} characters, more than the model's context "
                                      f"({self.max_context_tokens} tokens) can hold", param="content")
        tokens = self.tokenizer.encode(content, add_special_tokens=_flag(body, "add_special", False))
        if not _flag(body, "with_pieces", False):
            return {"tokens": tokens}
        pieces = []
        for token in tokens:
            raw = self.tokenizer.token_bytes(token)
            try:
                piece: Any = raw.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(raw)
            pieces.append({"id": token, "piece": piece})
        return {"tokens": pieces}

    def detokenize(self, body: Any) -> dict[str, Any]:
        """vLLM's ``/detokenize``: ``tokens`` (ids in the vocabulary) -> ``{"prompt": text}``, the text also as
        llama.cpp's ``content``. Raises InvalidRequestError (400) or ModelNotFoundError (404)."""
        if not isinstance(body, dict):
            raise InvalidRequestError("the request body must be a JSON object")
        DETOKENIZE.check(body)
        self._model(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise InvalidRequestError("'tokens' must be a list of token ids", param="tokens")
        if not all(0 <= t < self.tokenizer.vocab_size for t in tokens):
            raise InvalidRequestError(f"token ids must be in [0, {self.tokenizer.vocab_size})", param="tokens")
        text = self.tokenizer.decode(tokens)
        return {"prompt": text, "content": text}

    def _answer_grammar(self, plan, tools, fmt, parser) -> str:
        """The Lark grammar (llguidance) of a constrained answer: a named function's arguments, ``required``'s
        calls in the parser's format (its markers written as the special tokens they are), or ``response_format``'s
        JSON."""
        from gpu.grammar import schema_lark

        if plan is not None and plan.mode == "named":
            return schema_lark(parameters_schema(tools, plan.function))
        if plan is not None and plan.mode == "required":
            return with_special_markers(parser.required_grammar(tools, plan.parallel), self._special(parser.markers))
        return schema_lark(fmt)

    def _special(self, markers) -> dict[str, int]:
        """Marker text -> token id, for the markers the tokenizer has as special tokens."""
        return {m: self.tokenizer.token_to_id(m) for m in markers
                if self.tokenizer.token_to_id(m) in self.tokenizer.special_ids}

    def _constrain_answer(self, sampling: Sampling, answer: str, reasons: bool, opened: bool,
                          param: str) -> Sampling:
        """``sampling`` constrained by ``answer`` (a Lark grammar): from the first token, or, when the model
        ``reasons`` first, after its reasoning (gpu.grammar.after_reasoning; ``opened``: the prompt opened it), which
        may take REASONING_SHARE of ``max_tokens`` before its end marker is forced."""
        from gpu.grammar import after_reasoning, lark_grammar

        if not reasons:
            return self._constrain(sampling, lark_grammar(answer), param)
        grammar = after_reasoning(answer, THINK_CLOSE, opened, THINK_OPEN, self._special((THINK_OPEN, THINK_CLOSE)))
        sampling = dataclasses.replace(sampling, reasoning_end=THINK_CLOSE,
                                       reasoning_budget=max(1, int(sampling.max_tokens * REASONING_SHARE)))
        return self._constrain(sampling, lark_grammar(grammar), param)

    def _schema_grammar(self, schema: dict | None, param: str) -> str:
        from gpu.grammar import json_schema_grammar

        try:
            return json_schema_grammar(schema)
        except InvalidRequestError as exc:
            raise InvalidRequestError(exc.message, param=param) from None

    def _constrain(self, sampling: Sampling, grammar: str, param: str) -> Sampling:
        """``sampling`` with ``grammar``, once the grammar compiles (cached). Raises InvalidRequestError naming
        ``param`` when it does not, or when this parser has no grammar compiler."""
        if self.grammars is None:
            raise _unsupported(param, "constrained decoding is not available in this server")
        self.grammars.check(grammar, param)
        return dataclasses.replace(sampling, grammar=grammar)

    def completions(self, body: Any, request_id: str | None = None) -> list[GenerationRequest]:
        """Validate a /v1/completions body: one request per prompt, as vLLM runs a list (``prompt``: a string, a
        list of token ids, or a list of several of either kind), sharing the id and creation time; the k-th has
        ``first_index`` k * n, so its choices are indexed k * n + i. Every prompt is checked before any is
        admitted; an error of one names it (``prompt[k] of K: ...``). Raises InvalidRequestError (400) or
        ModelNotFoundError (404)."""
        model, stream, include_usage = self._common(body, "completion")
        rid = check_request_id(request_id, f"cmpl-{uuid.uuid4().hex[:24]}")
        prompts = _prompt_list(body.get("prompt"))
        n = _integer(body, "n", 1, 1, MAX_N)
        if len(prompts) > 1 and len(prompts) * n > self.max_sequences:   # before any prompt is tokenized
            raise InvalidRequestError(
                f"'prompt' lists {len(prompts)} prompts of n={n} choices: {len(prompts) * n} sequences, more than "
                f"this server admits at once (max_queued_requests={self.max_sequences}), so the request could never "
                f"run whole; send at most {self.max_sequences // n} prompts per request", param="prompt")
        limit = body.get("max_tokens")
        echo_only = isinstance(limit, int) and not isinstance(limit, bool) and limit == 0
        if echo_only and body.get("echo") is not True:
            raise InvalidRequestError("'max_tokens' 0 asks for no tokens: it needs 'echo' (the prompt and, with "
                                      "'logprobs', its tokens' log-probabilities)", param="max_tokens")
        fmt = _response_format(body)
        grammar = None if fmt is False else self._schema_grammar(fmt, "response_format")
        stop = _stop_strings(body, None if grammar is None else "response_format")
        timeout_s, created, telemetry = _timeout(body), int(time.time()), _llama_telemetry(body)
        out = []
        for k, prompt in enumerate(prompts):
            try:
                prompt_ids = self._prompt_ids(prompt)
                sampling = self._sampling({**body, "max_tokens": 1} if echo_only else body, len(prompt_ids),
                                          "completion")
                if grammar is not None:
                    sampling = self._constrain(sampling, grammar, "response_format")
                echo_text = None
                if body.get("echo"):
                    echo_text = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt_ids)
                    if sampling.logprobs is not None:   # its tokens get log-probabilities too (the first: null)
                        sampling = dataclasses.replace(sampling, prompt_logprobs=sampling.logprobs)
                choices = self._n(body, len(prompt_ids), sampling)
            except InvalidRequestError as exc:
                raise _in_prompt(exc, k, len(prompts)) from None
            out.append(GenerationRequest("completion", rid, model, prompt_ids, sampling, stop, stream, include_usage,
                                         timeout_s, choices, echo_text, echo_only=echo_only, first_index=k * n,
                                         created=created, **telemetry))
        return out

    def _prompt_ids(self, prompt: str | list) -> list[int]:
        """One prompt of :func:`_prompt_list` as token ids. Raises InvalidRequestError naming ``prompt``: empty,
        not token ids, an id outside the vocabulary, too many characters for the context."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("'prompt' is empty", param="prompt")
            return self._encode(prompt, "prompt")
        if not prompt or not all(_is_token(t) for t in prompt):
            raise InvalidRequestError("a token-id prompt must be a non-empty list of integers", param="prompt")
        if not all(0 <= t < self.tokenizer.vocab_size for t in prompt):
            raise InvalidRequestError(f"token ids in 'prompt' must be in [0, {self.tokenizer.vocab_size})",
                                      param="prompt")
        return list(prompt)


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prompt_list(prompt: Any) -> list[str | list]:
    """``prompt`` as a list of prompts, each a string or a list (of token ids: :meth:`RequestParser._prompt_ids`
    checks each one's content), from the shapes OpenAI and vLLM take: a string, a list of token ids, a list of
    strings, a list of token-id lists. Raises InvalidRequestError naming ``prompt`` for an empty list, a list
    mixing strings and token-id lists, or any other shape."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(_is_token(t) for t in prompt):
            return [prompt]
        kinds = {str if isinstance(p, str) else list if isinstance(p, list) else None for p in prompt}
        if kinds in ({str}, {list}):
            return list(prompt)
        if kinds == {str, list}:
            raise InvalidRequestError("'prompt' mixes strings and token-id lists; send a list of one kind",
                                      param="prompt")
    if prompt == []:
        raise InvalidRequestError("'prompt' is an empty list", param="prompt")
    raise InvalidRequestError("'prompt' must be a non-empty string, a non-empty list of token ids, or a list of "
                              "such strings or such lists", param="prompt")


def _in_prompt(exc: InvalidRequestError, k: int, count: int) -> InvalidRequestError:
    """``exc``, raised while reading the k-th of ``count`` prompts, with a message naming that prompt when the
    error is the prompt's own: any error of a later prompt (one of the body as a whole fires on the first), and
    the first's about itself (its content, its length, its choices' KV). Param and code unchanged."""
    own = k > 0 or exc.param in ("prompt", "n") or exc.code == "context_length_exceeded"
    if count == 1 or not own:
        return exc
    return InvalidRequestError(f"prompt[{k}] of {count}: {exc.message}", param=exc.param, code=exc.code)


def _max_token_chars(tokenizer) -> int:
    """The most characters one token can stand for (byte-level BPE: one vocabulary character = one byte).

    Used as a sound bound: ``tokens >= chars / max_token_chars``. Falls back to a generous 64.
    """
    try:
        vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
        return max(64, max(len(t) for t in vocab))
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary view: keep the generous bound
        return 64
