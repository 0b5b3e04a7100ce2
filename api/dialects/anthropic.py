"""Anthropic Messages (``POST /v1/messages``, ``/v1/messages/count_tokens``): body -> chat request, engine events
-> Message object and SSE events, Anthropic-shaped errors. Plain synchronous code, no I/O.

=======================  =========================================================================
``translate``            a Messages body -> an OpenAI chat body (``count_tokens``: without max_tokens)
``message_object``       a finished sequence as the Message object
``MessageStream``        engine events -> message_start, ping, content_block_start/_delta/_stop,
                         message_delta (stop_reason, usage), message_stop; ``error`` on failure
``error_body``           ``{"type": "error", "error": {"type", "message"}}`` for a PdserveError
``MessagesDialect``      the dialect of api/exchange.py: build, renderer (``MessagesRenderer``), error body
``count_tokens``         ``POST /v1/messages/count_tokens``: a body -> ``{"input_tokens"}``
=======================  =========================================================================

Honoured: ``system`` (string or text blocks), ``messages`` with text, ``tool_use`` and ``tool_result`` blocks,
``tools`` (``input_schema``), ``tool_choice`` (auto / any / tool / none, ``disable_parallel_tool_use``),
``stop_sequences``, ``max_tokens`` (required), ``temperature``, ``top_p``, ``top_k``, ``stream``, ``thinking``
(``disabled``: the template's thinking switch off). Accepted and ignored: :data:`IGNORED_FIELDS`, ``cache_control``;
``thinking`` blocks of earlier turns reach the template as the assistant's ``reasoning_content`` (templates that
render it, such as Qwen3's after the last user turn, do). Unknown fields, block and tool types: accepted, logged
and counted, or a 400 with ``--strict-fields`` (api.fields.UnknownFields).
The served model's reasoning (api/formats.py) comes back as a ``thinking`` block first (``thinking_delta``
while streaming; the signature is empty). Usage follows Anthropic: ``input_tokens`` excludes the prompt tokens read from the prefix cache
(``cache_read_input_tokens``).
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any

import orjson

from api import fields
from api.dialects.events import EventRenderer, parse_chat
from api.protocol import check_request_id
from pdserve.errors import InvalidRequestError, PdserveError

IGNORED_FIELDS = frozenset({"metadata", "service_tier", "container", "context_management", "mcp_servers"})
FIELDS = IGNORED_FIELDS | {"model", "messages", "system", "max_tokens", "stop_sequences", "stream", "temperature",
                           "top_p", "top_k", "tools", "tool_choice", "output_config", "thinking"}
# content block types of Anthropic's API this server knows (those it cannot honour, such as image, are a 400);
# any other type is unknown: api.fields.UnknownFields
KNOWN_BLOCKS = frozenset({"text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image", "document",
                          "search_result", "server_tool_use", "web_search_tool_result", "container_upload"})
COUNT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking", "context_management",
                          "mcp_servers", "output_config"})
OUTPUT_CONFIG_EFFORTS = ("low", "medium", "high", "max")   # output_config.effort: accepted and ignored
_RENAMES = {"stop": "stop_sequences", "prompt": "messages"}

# HTTP status -> Anthropic error type (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               529: "overloaded_error", 504: "timeout_error", 408: "timeout_error"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def error_body(error: PdserveError | str, status: int = 400) -> dict:
    """Anthropic's error JSON; the type follows the HTTP status (``api_error`` for unlisted ones)."""
    if isinstance(error, PdserveError):
        status, error = error.http_status, error.message
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": error}}


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where} must be a string or a list of text blocks", param="messages")
    out = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise InvalidRequestError(f"{where}: only text blocks are supported here", param="messages")
        out.append(block["text"])
    return "".join(out)


def _message(message: Any, index: int, unknown: fields.UnknownFields = fields.STRICT) -> list[dict]:
    """One Messages turn -> chat messages (``tool_result`` blocks become ``tool`` messages, before the turn's
    text; ``tool_use`` blocks an assistant's ``tool_calls``; an assistant's ``thinking`` blocks its
    ``reasoning_content``). A block type this server does not know goes to ``unknown``."""
    where = f"messages.{index}"
    if isinstance(message, dict) and message.get("role") == "system":   # Claude Code 2.1 sends these mid-list
        content = message.get("content")
        return [{"role": "system", "content": content if isinstance(content, str) else _text(content, where)}]
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise InvalidRequestError(f"{where}: each message needs a role 'user', 'assistant' or 'system'",
                                  param="messages")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}.content must be a string or a list of content blocks", param="messages")
    texts: list[str] = []
    results: list[dict] = []
    calls: list[dict] = []
    thoughts: list[str] = []
    for k, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise InvalidRequestError(f"{where}.content.{k}: tool_use needs 'id' and 'name' strings",
                                          param="messages")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"],
                                       "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise InvalidRequestError(f"{where}.content.{k}: tool_result needs a 'tool_use_id' string",
                                          param="messages")
            text = _text(block.get("content") or "", f"{where}.content.{k}.content")
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        elif kind == "thinking" and role == "assistant":
            if isinstance(block.get("thinking"), str):
                thoughts.append(block["thinking"])
        elif kind == "redacted_thinking" and role == "assistant":
            continue   # encrypted by Anthropic: nothing a template can render
        elif isinstance(kind, str) and kind not in KNOWN_BLOCKS:
            unknown.seen("/v1/messages", kind, f"{where}.content.{k}: block type {kind!r}", "messages")
        else:
            raise InvalidRequestError(f"{where}.content.{k}: block type {kind!r} is not supported in a {role} "
                                      "message (text, tool_use, tool_result)", param="messages")
    out = results
    reasoning = {"reasoning_content": "".join(thoughts)} if thoughts else {}
    if calls:
        out.append({"role": "assistant", "content": "".join(texts) or None, "tool_calls": calls, **reasoning})
    elif texts or not results:
        out.append({"role": role, "content": "".join(texts), **reasoning})
    return out


def _tools(body: dict, unknown: fields.UnknownFields = fields.STRICT) -> dict:
    chat: dict[str, Any] = {}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise InvalidRequestError("'tools' must be a list", param="tools")
        converted = []
        for i, tool in enumerate(tools):
            kind = tool.get("type", "custom") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "custom":   # Anthropic's server and versioned tools: not offered
                unknown.seen("/v1/messages", f"tools:{kind}", f"tools.{i}: tool type {kind!r}", "tools")
                continue
            if not isinstance(tool, dict) or tool.get("type", "custom") != "custom" or "input_schema" not in tool:
                kind = tool.get("type") if isinstance(tool, dict) else None
                raise InvalidRequestError(f"tools.{i}: only client tools {{'name', 'description', 'input_schema'}} "
                                          f"are supported (got type {kind!r})", param="tools")
            fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
            if tool.get("description") is not None:
                fn["description"] = tool["description"]
            converted.append({"type": "function", "function": fn})
        chat["tools"] = converted
    choice = body.get("tool_choice")
    if choice is None:
        return chat
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise InvalidRequestError("'tool_choice' must be {'type': 'auto' | 'any' | 'tool' | 'none'}",
                                  param="tool_choice")
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise InvalidRequestError("'tool_choice' of type 'tool' needs a 'name'", param="tool_choice")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        chat["tool_choice"] = {"any": "required"}.get(kind, kind)
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None:
        if not isinstance(disable, bool):
            raise InvalidRequestError("'tool_choice.disable_parallel_tool_use' must be a boolean",
                                      param="tool_choice")
        if kind != "tool":
            chat["parallel_tool_calls"] = not disable
    return chat


def translate(body: Any, count_only: bool = False, unknown: fields.UnknownFields = fields.STRICT) -> dict:
    """A Messages body -> a chat body for RequestParser.chat. ``count_only`` (count_tokens): no ``max_tokens``,
    sampling fields unknown. ``unknown``: what an unknown field, block or tool type gets (api.fields.UnknownFields;
    the default refuses it). Raises InvalidRequestError naming the Messages field."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    allowed = COUNT_FIELDS if count_only else FIELDS
    unknown.fields("/v1/messages", body, allowed, "{name}: Extra inputs are not permitted")
    if not count_only and body.get("max_tokens") is None:
        raise InvalidRequestError("max_tokens: Field required", param="max_tokens")
    system = body.get("system")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages: must be a non-empty list", param="messages")
    chat_messages: list[dict] = []
    if system is not None:
        if isinstance(system, list):
            system = _text(system, "system")
        if not isinstance(system, str):
            raise InvalidRequestError("system: must be a string or a list of text blocks", param="system")
        if system:
            chat_messages.append({"role": "system", "content": system})
    for i, m in enumerate(messages):
        chat_messages += _message(m, i, unknown)
    chat: dict[str, Any] = {"messages": chat_messages, **_tools(body, unknown), **_thinking(body.get("thinking"))}
    for name in ("model", "temperature", "top_p", "top_k", "max_tokens", "stream"):
        if body.get(name) is not None:
            chat[name] = body[name]
    chat.update(_output_config(body.get("output_config")))
    if count_only:
        chat["max_tokens"] = 1
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list):
            raise InvalidRequestError("stop_sequences: must be a list of strings", param="stop_sequences")
        if stops:
            chat["stop"] = stops
    if isinstance(chat.get("temperature"), (int, float)) and not isinstance(chat["temperature"], bool) \
            and chat["temperature"] > 1:
        raise InvalidRequestError("temperature: must be between 0 and 1", param="temperature")
    return chat


def _thinking(thinking: Any) -> dict:
    """``thinking``: ``{"type": "disabled"}`` turns the template's thinking off (``enable_thinking`` false: Qwen3's
    switch; DeepSeek-V3.1's ``thinking`` false), ``enabled`` / ``adaptive`` on; the reasoning parser then follows
    the prompt (api/protocol.py). ``budget_tokens`` is accepted and not enforced. Raises InvalidRequestError for a
    type it does not know."""
    if thinking is None:
        return {}
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise InvalidRequestError("thinking: must be {'type': 'enabled' | 'disabled' | 'adaptive', ...}",
                                  param="thinking")
    on = kind != "disabled"
    return {"chat_template_kwargs": {"enable_thinking": on, "thinking": on}}


def _output_config(config: Any) -> dict:
    """``output_config`` (Claude Code sends ``{"effort": "high"}``): ``effort`` is accepted and ignored (a hint for
    reasoning models); ``format`` ``{"type": "json_schema", "schema": {...}}`` becomes chat's json_schema
    ``response_format`` (grammar-constrained). Other keys are a 400 naming them."""
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise InvalidRequestError("output_config: must be an object", param="output_config")
    for key, value in config.items():
        if key == "effort":
            if value is not None and value not in OUTPUT_CONFIG_EFFORTS:
                raise InvalidRequestError(f"output_config.effort: must be one of {', '.join(OUTPUT_CONFIG_EFFORTS)}",
                                          param="output_config.effort")
        elif key != "format":
            raise InvalidRequestError(f"output_config.{key}: Extra inputs are not permitted",
                                      param=f"output_config.{key}", code="unknown_parameter")
    fmt = config.get("format")
    if fmt is None:
        return {}
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict) \
            or set(fmt) - {"type", "schema"}:
        raise InvalidRequestError('output_config.format: must be {"type": "json_schema", "schema": {...}}',
                                  param="output_config.format")
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}}


def renamed(exc: PdserveError) -> PdserveError:
    """The chat parser's error with this dialect's field names (in the param; in the message too, but for the
    words "prompt" and "messages", which also read as prose there)."""
    param = getattr(exc, "param", None)
    if param not in _RENAMES:
        return exc
    message = exc.message
    if param not in ("prompt", "messages"):
        message = re.sub(rf"\b{param}\b", _RENAMES[param], message)
    return type(exc)(message, param=_RENAMES[param], code=exc.code)


def new_id(prefix: str = "msg") -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def tool_use_id(call_id: str) -> str:
    """The engine's ``call_...`` ids as Anthropic's ``toolu_...``; a family's own form (Mistral's 9 letters and
    digits, which its template demands back in the next turn) unchanged."""
    return "toolu_" + call_id.removeprefix("call_") if call_id.startswith("call_") else call_id


def usage_body(prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict:
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}


def stop_reason(reason: str | None, stop_string: str | None) -> str:
    if reason == "stop" and stop_string is not None:
        return "stop_sequence"
    return STOP_REASONS.get(reason or "stop", "end_turn")


def _input(arguments: str) -> Any:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def message_object(message_id: str, model: str, outcome, usage: dict) -> dict:
    """The Message of a finished sequence (api.dialects.events.Outcome)."""
    content: list[dict] = []
    if outcome.reasoning:   # api/formats.py's reasoning as a thinking block (no signature: nothing to verify)
        content.append({"type": "thinking", "thinking": outcome.reasoning, "signature": ""})
    if outcome.text or not outcome.calls:
        content.append({"type": "text", "text": outcome.text})
    for call in outcome.calls:
        content.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["name"],
                        "input": _input(call["arguments"])})
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason(outcome.reason, outcome.stop_string),
            "stop_sequence": outcome.stop_string if outcome.reason == "stop" else None, "usage": usage}


def _frame(kind: str, body: dict) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **body}) + b"\n\n"


class MessageStream:
    """Engine events -> Messages SSE frames: message_start, ping, one content block per text run or tool call
    (content_block_start, content_block_delta text_delta / input_json_delta, content_block_stop), then
    message_delta (stop_reason, stop_sequence, usage.output_tokens) and message_stop; ``error`` on failure."""

    def __init__(self, message_id: str, model: str):
        self.id, self.model = message_id, model
        self.index = -1
        self.open: str | None = None   # "thinking", "text" or "tool_use"

    def start(self, usage: dict) -> list[bytes]:
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": {**usage, "output_tokens": 0}}
        return [_frame("message_start", {"message": message}), _frame("ping", {})]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_frame("content_block_stop", {"index": self.index})]

    def _start(self, kind: str, block: dict) -> list[bytes]:
        frames = self._close()
        self.index += 1
        self.open = kind
        return frames + [_frame("content_block_start", {"index": self.index, "content_block": block})]

    def event(self, event: tuple) -> list[bytes]:
        kind = event[0]
        frames: list[bytes] = []
        if kind == "reasoning":
            if self.open != "thinking":
                frames += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            frames.append(_frame("content_block_delta", {"index": self.index,
                                                         "delta": {"type": "thinking_delta", "thinking": event[1]}}))
        elif kind == "text":
            if self.open != "text":
                frames += self._start("text", {"type": "text", "text": ""})
            frames.append(_frame("content_block_delta", {"index": self.index,
                                                         "delta": {"type": "text_delta", "text": event[1]}}))
        elif kind == "call":
            frames += self._start("tool_use", {"type": "tool_use", "id": tool_use_id(event[1]), "name": event[2],
                                               "input": {}})
            frames += self._json(event[3])
        elif kind == "args":
            frames += self._json(event[1])
        return frames

    def _json(self, piece: str) -> list[bytes]:
        if not piece:
            return []
        return [_frame("content_block_delta", {"index": self.index,
                                               "delta": {"type": "input_json_delta", "partial_json": piece}})]

    def finish(self, reason: str | None, stop_string: str | None, usage: dict) -> list[bytes]:
        """The closing frames; ``usage``: the final usage (message_delta carries all of it, as Anthropic's does)."""
        answered = self.index >= 0 and self.open != "thinking" or self.index > 0
        frames = [] if answered else self._start("text", {"type": "text", "text": ""})
        frames += self._close()
        delta = {"stop_reason": stop_reason(reason, stop_string),
                 "stop_sequence": stop_string if reason == "stop" else None}
        return frames + [_frame("message_delta", {"delta": delta, "usage": usage}),
                         _frame("message_stop", {})]

    @staticmethod
    def failed(exc: PdserveError) -> bytes:
        return _frame("error", {"error": error_body(exc)["error"]})


class MessagesDialect:
    """``POST /v1/messages`` over api/exchange.py; ``headers``: the request's (X-Request-Id)."""

    error_body = staticmethod(error_body)

    def __init__(self, parser, headers):
        self.parser = parser
        self.message_id = new_id()
        self.request_id = check_request_id(headers.get("x-request-id"), self.message_id)

    def build(self, body: Any) -> list:
        return parse_chat(self.parser, translate(body, unknown=self.parser.unknown_fields), self.request_id, renamed)

    def renderer(self, handles: list) -> MessagesRenderer:
        return MessagesRenderer(handles, self.message_id)


class MessagesRenderer(EventRenderer):
    """The Message object, or its SSE events (MessageStream)."""

    def __init__(self, handles: list, message_id: str):
        request = handles[0].request
        super().__init__(handles, request.stream)
        self.id, self.model = message_id, request.model
        self.sse = MessageStream(message_id, request.model)

    def start(self) -> list[bytes]:
        return self.sse.start(usage_body(len(self.handles[0].request.prompt_ids), 0)) if self.stream else []

    def frames(self, event: tuple) -> list[bytes]:
        return self.sse.event(event)

    def finish(self) -> list[bytes] | dict:
        outcome = self.outcome
        if self.stream:
            return self.sse.finish(outcome.reason, outcome.stop_string, self.usage(usage_body))
        return message_object(self.id, self.model, outcome, self.usage(usage_body))

    def failed(self, exc: PdserveError) -> list[bytes]:
        return [self.sse.failed(exc)]


def count_tokens(parser, body: Any) -> dict:
    """``{"input_tokens": n}``: the prompt the Messages body would run, counted (nothing is admitted)."""
    (request,) = parse_chat(parser, translate(body, count_only=True, unknown=parser.unknown_fields), "count-tokens",
                            renamed)
    return {"input_tokens": len(request.prompt_ids)}
