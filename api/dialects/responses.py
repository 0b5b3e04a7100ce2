"""OpenAI Responses (``POST /v1/responses``): body -> chat request, engine events -> Response object and SSE
events, and the bounded store behind ``store`` / ``previous_response_id``. Plain synchronous code, no I/O.

=======================  =========================================================================
``translate``            a Responses body (+ the stored conversation it continues) -> an OpenAI chat body
``response_object``      a finished (or failed) response as the Response object
``ResponseStream``       engine events -> the SSE event sequence the official SDK and Codex parse
``ResponseStore``        finished responses by id: per API key, TTL, entry cap (least recently stored out)
``ResponsesDialect``     the dialect of api/exchange.py: build, renderer (``ResponsesRenderer``), error body
``stored``, ``deleted``  ``GET`` / ``DELETE /v1/responses/{id}``: ``(status, body)``
=======================  =========================================================================

Honoured: ``input`` (a string, or items: messages with text parts, ``function_call``, ``function_call_output``;
``reasoning`` items are skipped), ``instructions`` (not carried to a later turn, as OpenAI), ``tools`` (type
``function``), ``tool_choice``, ``parallel_tool_calls``, ``text.format`` (text / json_object / json_schema),
``max_output_tokens``, ``temperature``, ``top_p``, ``stream``, ``store``, ``previous_response_id``, ``metadata``
(echoed). Accepted and ignored: :data:`IGNORED_FIELDS`. Unknown fields, item and tool types: accepted, logged and
counted, or a 400 with ``--strict-fields`` (api.fields.UnknownFields). The served model's reasoning (api/formats.py) comes back as
a ``reasoning`` output item first (summary text and ``reasoning_text`` content; ``response.reasoning_text.delta``
while streaming).
"""
from __future__ import annotations

import collections
import hashlib
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson
from prometheus_client.core import GaugeMetricFamily

from api import fields
from api.dialects.events import EventRenderer, Outcome, parse_chat
from api.protocol import check_request_id, error_body
from pdserve.errors import InvalidRequestError, ModelNotFoundError, PdserveError

# hints a model without reasoning or server-side tools has no use for (OpenAI documents each)
IGNORED_FIELDS = frozenset({"reasoning", "include", "truncation", "service_tier", "prompt_cache_key",
                            "prompt_cache_retention", "safety_identifier", "user", "max_tool_calls", "stream_options",
                            "background", "top_logprobs", "client_metadata"})
# tool types that run on OpenAI's side (or group tools for one client): not offered to the model, dropped (the Codex
# CLI sends web_search and a namespace on every request); an unknown type is a 400
HOSTED_TOOL_TYPES = frozenset({"web_search", "web_search_preview", "file_search", "code_interpreter",
                               "computer_use_preview", "image_generation", "mcp", "local_shell", "namespace"})
FIELDS = IGNORED_FIELDS | {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
                           "max_output_tokens", "temperature", "top_p", "stream", "store", "previous_response_id",
                           "metadata", "conversation", "prompt"} | fields.LLAMA_TELEMETRY
TABLE = fields.FieldTable("/v1/responses", FIELDS - IGNORED_FIELDS,
                          {name: "a hint for OpenAI's servers or reasoning models" for name in IGNORED_FIELDS})
# documented fields this server cannot honour: a 400 saying so (not "unrecognized") unless null
UNSUPPORTED = {"conversation": "the Conversations API is not served; use previous_response_id",
               "prompt": "stored prompt templates are not served; send the text as input"}
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
# content part types (input_image, ...) sent as items: a malformed input, not a newer item type
_CONTENT_PART_TYPES = frozenset(_TEXT_PARTS) | {"input_image", "input_file", "input_audio"}
# chat parser names -> this dialect's names (in the error's param and message)
_RENAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input",
            "prompt": "input"}

STORE_MAX_ENTRIES = 1024              # per API key
STORE_MAX_BYTES = 64 * 1024 * 1024    # per API key: a keyless server holds at most this much
STORE_TTL_S = 3600.0


def _item_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}.content must be a string or a list of text parts", param="input")
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequestError(f"{where}.content: only text parts (input_text, output_text) are supported, "
                                      f"got {kind!r}", param="input")
        text = part.get("refusal") if part["type"] == "refusal" else part.get("text")
        if not isinstance(text, str):
            raise InvalidRequestError(f"{where}.content parts need a 'text' string", param="input")
        parts.append(text)
    return "".join(parts)


def input_messages(value: Any, unknown: fields.UnknownFields = fields.STRICT) -> list[dict]:
    """``input`` as chat messages (``function_call`` items become an assistant's ``tool_calls``,
    ``function_call_output`` items ``tool`` messages); an item type this server does not know goes to ``unknown``
    (left out, or the 400). Raises InvalidRequestError (param ``input``)."""
    if isinstance(value, str):
        if not value:
            raise InvalidRequestError("'input' is empty", param="input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("'input' must be a non-empty string or a non-empty list of items", param="input")
    out: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequestError(f"{where}.role must be user, assistant, system or developer, got {role!r}",
                                          param="input")
            out.append({"role": role, "content": _item_text(item.get("content"), where)})
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "")
            if not (isinstance(call_id, str) and call_id and isinstance(name, str) and isinstance(args, str)):
                raise InvalidRequestError(f"{where} (function_call) needs 'call_id', 'name' and 'arguments' strings",
                                          param="input")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args or "{}"}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("_open"):
                out[-1]["tool_calls"].append(call)
            elif out and out[-1]["role"] == "assistant" and "tool_calls" not in out[-1]:
                out[-1].update(tool_calls=[call], _open=True)   # the text before the call, same turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call], "_open": True})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not call_id:
                raise InvalidRequestError(f"{where} (function_call_output) needs a 'call_id' string", param="input")
            text = output if isinstance(output, str) else _item_text(output, where)
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            continue
        elif isinstance(kind, str) and kind not in _CONTENT_PART_TYPES:
            unknown.seen("/v1/responses", f"input:{kind}", f"{where}: item type {kind!r}", "input")
        else:
            raise InvalidRequestError(f"{where}: items of type {kind!r} are not supported (message, function_call, "
                                      "function_call_output, reasoning)", param="input")
    for m in out:
        m.pop("_open", None)
    return out


def _tools(body: dict, unknown: fields.UnknownFields = fields.STRICT) -> dict:
    chat: dict[str, Any] = {}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise InvalidRequestError("'tools' must be a list", param="tools")
        converted = []
        for i, tool in enumerate(tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind in HOSTED_TOOL_TYPES:
                continue
            if isinstance(kind, str) and kind != "function":
                unknown.seen("/v1/responses", f"tools:{kind}", f"tools[{i}]: tool type {kind!r}", "tools")
                continue
            if kind != "function":
                raise InvalidRequestError(f"tools[{i}]: only tools of type 'function' are served (hosted tools such as "
                                          f"web_search are dropped), got {kind!r}", param="tools")
            converted.append({"type": "function", "function": {k: tool[k] for k in
                              ("name", "description", "parameters", "strict") if tool.get(k) is not None}})
        chat["tools"] = converted
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise InvalidRequestError("'tool_choice' must be 'none', 'auto', 'required' or "
                                      "{'type': 'function', 'name': ...}", param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        chat["tool_choice"] = choice
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    return chat


def _text_format(body: dict) -> dict | None:
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise InvalidRequestError("'text' must be an object {'format': {...}}", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequestError("'text.format.type' must be 'text', 'json_object' or 'json_schema'",
                                  param="text.format")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def translate(body: Any, history: list[dict] | None = None,
              unknown: fields.UnknownFields = fields.STRICT) -> tuple[dict, list[dict]]:
    """A Responses body -> ``(chat body for RequestParser.chat, this turn's conversation)``.

    ``history``: the stored conversation of ``previous_response_id`` (chat messages, no instructions). The
    conversation returned is ``history`` plus this turn's input (the answer is added when it is stored).
    ``unknown``: what an unknown field, input item or tool type gets (api.fields.UnknownFields; the default refuses
    it). Raises InvalidRequestError naming the Responses field.
    """
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    unknown.fields("/v1/responses", body, TABLE.names, "unrecognized request argument {name!r} for /v1/responses")
    for name, why in UNSUPPORTED.items():
        if body.get(name) is not None:
            raise InvalidRequestError(f"'{name}' is not supported ({why})", param=name, code="unsupported_parameter")
    for name in ("store", "stream", "background"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise InvalidRequestError(f"'{name}' must be a boolean", param=name)
    if body.get("background"):
        raise InvalidRequestError("'background' responses are not supported; send the request and wait",
                                  param="background", code="unsupported_parameter")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequestError("'instructions' must be a string", param="instructions")
    fields.check_echoed(body)
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise InvalidRequestError("'reasoning' must be an object", param="reasoning")
    conversation = list(history or []) + input_messages(body.get("input"), unknown)
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    chat: dict[str, Any] = {"messages": messages, **_tools(body, unknown)}
    for name in ("model", "temperature", "top_p", *fields.LLAMA_TELEMETRY):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    fmt = _text_format(body)
    if fmt is not None:
        chat["response_format"] = fmt
    return chat, conversation


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


def usage_body(prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [] if status == "in_progress" else [output_text(text)]}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    """The answer's reasoning (api/formats.py) as a ``reasoning`` output item: its text as the summary and as
    ``reasoning_text`` content (vLLM's form for open-weight models)."""
    done = status != "in_progress"
    return {"id": item_id, "type": "reasoning", "status": status,
            "summary": [{"type": "summary_text", "text": text}] if done else [],
            "content": [{"type": "reasoning_text", "text": text}] if done else []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


@dataclass
class ResponseMeta:
    """What a Response object echoes of its request, fixed at admission."""

    id: str
    model: str
    body: dict
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(self, status: str, output: list[dict], usage: dict | None = None, reason: str | None = None,
                 error: dict | None = None) -> dict:
        b = self.body
        fmt = (b.get("text") or {}).get("format") or {"type": "text"}
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "background": False, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
                "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
                "model": self.model, "output": output, "parallel_tool_calls": b.get("parallel_tool_calls", True),
                "previous_response_id": b.get("previous_response_id"), "reasoning": b.get("reasoning"),
                "store": b.get("store", True), "temperature": b.get("temperature", 1.0), "text": {"format": fmt},
                "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [],
                "top_p": b.get("top_p", 1.0), "truncation": "disabled", "usage": usage,
                "metadata": b.get("metadata") or {}, "user": b.get("user")}


def status_of(reason: str | None) -> str:
    return "incomplete" if reason == "length" else "completed"


def response_object(meta: ResponseMeta, outcome, usage: dict) -> dict:
    """The Response of a finished sequence (api.dialects.events.Outcome)."""
    output = [reasoning_item(new_id("rs"), outcome.reasoning)] if outcome.reasoning else []
    if outcome.text or not outcome.calls:
        output.append(message_item(new_id("msg"), outcome.text, status_of(outcome.reason)))
    for call in outcome.calls:
        output.append(call_item(new_id("fc"), call["id"], call["name"], call["arguments"]))
    return meta.response(status_of(outcome.reason), output, usage, outcome.reason)


def assistant_message(outcome) -> dict:
    """The answer as a chat message, for the stored conversation."""
    message: dict[str, Any] = {"role": "assistant", "content": outcome.text or None}
    if outcome.calls:
        message["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}} for c in outcome.calls]
    elif message["content"] is None:
        message["content"] = ""
    return message


class ResponseStream:
    """Engine events -> Responses SSE frames (``event: <type>`` + ``data: <json>``, each with a
    ``sequence_number``): response.created, response.in_progress, then per output item output_item.added,
    (content_part.added, output_text.delta..., output_text.done, content_part.done | function_call_arguments
    .delta..., .done), output_item.done, and last response.completed / response.incomplete (with usage) or
    response.failed."""

    def __init__(self, meta: ResponseMeta):
        self.meta = meta
        self.seq = 0
        self.output: list[dict] = []
        self.open: dict | None = None   # the item being streamed
        self.text = ""

    def _frame(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n"

    def start(self) -> list[bytes]:
        response = self.meta.response("in_progress", [])
        return [self._frame("response.created", response=response),
                self._frame("response.in_progress", response=response)]

    def progress(self, prompt_progress: dict) -> bytes:
        """llama.cpp's ``response.in_progress`` with ``prompt_progress`` (api/llama_timings.py)."""
        return self._frame("response.in_progress", response=self.meta.response("in_progress", []),
                           prompt_progress=prompt_progress)

    def _close(self, status: str = "completed") -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.output)
        if item["type"] == "reasoning":
            done = reasoning_item(item["id"], self.text)
            frames = [self._frame("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=self.text)]
        elif item["type"] == "message":
            part = output_text(self.text)
            done = message_item(item["id"], self.text, status)
            frames = [self._frame("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=self.text, logprobs=[]),
                      self._frame("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part)]
        else:
            done = {**item, "status": "completed"}
            frames = [self._frame("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=item["arguments"])]
        self.output.append(done)
        return frames + [self._frame("response.output_item.done", output_index=index, item=done)]

    def event(self, event: tuple) -> list[bytes]:
        kind = event[0]
        index = len(self.output)
        frames: list[bytes] = []
        if kind == "reasoning":
            if self.open is None or self.open["type"] != "reasoning":
                frames += self._close()
                index = len(self.output)
                self.open, self.text = reasoning_item(new_id("rs"), "", "in_progress"), ""
                frames.append(self._frame("response.output_item.added", output_index=index, item=self.open))
            self.text += event[1]
            frames.append(self._frame("response.reasoning_text.delta", item_id=self.open["id"], output_index=index,
                                      content_index=0, delta=event[1]))
        elif kind == "text":
            if self.open is None or self.open["type"] != "message":
                frames += self._close()
                index = len(self.output)
                self.open, self.text = message_item(new_id("msg"), "", "in_progress"), ""
                frames += [self._frame("response.output_item.added", output_index=index, item=self.open),
                           self._frame("response.content_part.added", item_id=self.open["id"], output_index=index,
                                       content_index=0, part=output_text(""))]
            self.text += event[1]
            frames.append(self._frame("response.output_text.delta", item_id=self.open["id"], output_index=index,
                                      content_index=0, delta=event[1], logprobs=[]))
        elif kind == "call":
            frames += self._close()
            index = len(self.output)
            self.open = call_item(new_id("fc"), event[1], event[2], "", "in_progress")
            frames.append(self._frame("response.output_item.added", output_index=index, item=dict(self.open)))
            frames += self._args(event[3], index)
        elif kind == "args":
            frames += self._args(event[1], index)
        return frames

    def _args(self, piece: str, index: int) -> list[bytes]:
        if not piece:
            return []
        self.open["arguments"] += piece
        return [self._frame("response.function_call_arguments.delta", item_id=self.open["id"], output_index=index,
                            delta=piece)]

    def finish(self, reason: str | None, usage: dict) -> tuple[list[bytes], dict]:
        """The closing frames and the final Response object (to store)."""
        frames: list[bytes] = []
        if self.open is not None and self.open["type"] == "reasoning":
            frames += self._close()
        if self.open is None and all(i["type"] == "reasoning" for i in self.output):   # no answer: an empty message
            index = len(self.output)
            self.open, self.text = message_item(new_id("msg"), "", "in_progress"), ""
            frames += [self._frame("response.output_item.added", output_index=index, item=self.open),
                       self._frame("response.content_part.added", item_id=self.open["id"], output_index=index,
                                   content_index=0, part=output_text(""))]
        frames += self._close(status_of(reason))
        response = self.meta.response(status_of(reason), self.output, usage, reason)
        kind = "response.incomplete" if reason == "length" else "response.completed"
        return frames + [self._frame(kind, response=response)], response

    def failed(self, exc: PdserveError) -> bytes:
        response = self.meta.response("failed", self.output,
                                      error={"code": exc.error_type, "message": exc.message})
        return self._frame("response.failed", response=response)


@dataclass
class _Stored:
    key: str
    blob: bytes          # orjson of [response, conversation]: what the entry costs is its length
    expires_s: float

    @property
    def response(self) -> dict:
        return orjson.loads(self.blob)[0]

    @property
    def conversation(self) -> list[dict]:
        return orjson.loads(self.blob)[1]


class ResponseStore:
    """Finished responses by id, for ``GET``/``DELETE /v1/responses/{id}`` and ``previous_response_id``.

    Each entry belongs to the API key that made it (``key``: a digest; "" when the server has no keys): another
    key sees nothing, and the bounds are per key, so one key's load never evicts another's entries: at most
    ``max_entries`` entries and ``max_bytes`` bytes per key (the oldest of that key goes first; an entry larger
    than ``max_bytes`` is not kept). Entries are held as orjson bytes, so the bytes counted are the memory held.
    An entry expires ``ttl_s`` seconds after it was stored. ``clock`` (seconds, monotonic) is injectable for
    tests. A prometheus collector: ``pdserve_response_store_entries`` and ``pdserve_response_store_bytes``.
    """

    def __init__(self, max_entries: int = STORE_MAX_ENTRIES, ttl_s: float = STORE_TTL_S,
                 max_bytes: int = STORE_MAX_BYTES, clock=time.monotonic):
        self.max_entries, self.max_bytes, self.ttl_s, self.clock = max_entries, max_bytes, ttl_s, clock
        self.entries: collections.OrderedDict[str, _Stored] = collections.OrderedDict()   # oldest first
        self.by_key: dict[str, collections.OrderedDict[str, None]] = {}   # each key's ids, oldest first
        self.key_bytes: collections.Counter[str] = collections.Counter()

    def _expire(self) -> None:
        now = self.clock()
        while self.entries:
            rid, entry = next(iter(self.entries.items()))
            if entry.expires_s > now:
                break
            self._drop(rid)

    def _drop(self, response_id: str) -> None:
        entry = self.entries.pop(response_id)
        ids = self.by_key[entry.key]
        del ids[response_id]
        self.key_bytes[entry.key] -= len(entry.blob)
        if not ids:
            del self.by_key[entry.key], self.key_bytes[entry.key]

    def put(self, key: str, response: dict, conversation: list[dict]) -> bool:
        """Keep the response; False when it alone is over ``max_bytes`` (it is not kept)."""
        self._expire()
        if response["id"] in self.entries:
            self._drop(response["id"])
        blob = orjson.dumps([response, conversation])
        if len(blob) > self.max_bytes:
            return False
        ids = self.by_key.setdefault(key, collections.OrderedDict())
        while ids and (len(ids) >= self.max_entries or self.key_bytes[key] + len(blob) > self.max_bytes):
            self._drop(next(iter(ids)))
            ids = self.by_key.setdefault(key, collections.OrderedDict())
        self.entries[response["id"]] = _Stored(key, blob, self.clock() + self.ttl_s)
        ids[response["id"]] = None
        self.key_bytes[key] += len(blob)
        return True

    def get(self, key: str, response_id: str) -> _Stored | None:
        self._expire()
        entry = self.entries.get(response_id)
        return entry if entry is not None and entry.key == key else None

    def delete(self, key: str, response_id: str) -> bool:
        if self.get(key, response_id) is None:
            return False
        self._drop(response_id)
        return True

    def history(self, key: str, response_id: Any) -> list[dict]:
        """The conversation ``previous_response_id`` continues. Raises InvalidRequestError (400) naming it when it
        is not a string, ModelNotFoundError-shaped 404 when no such response is stored for this key."""
        if not isinstance(response_id, str) or not response_id:
            raise InvalidRequestError("'previous_response_id' must be a response id string",
                                      param="previous_response_id")
        entry = self.get(key, response_id)
        if entry is None:
            raise ResponseNotFoundError(f"Previous response with id '{response_id}' not found ({self.limits()})",
                                        param="previous_response_id")
        return entry.conversation

    def limits(self) -> str:
        """The store's rules, for a 404's message."""
        return (f"responses are kept {self.ttl_s:g} s, at most {self.max_entries} and {self.max_bytes} bytes per "
                "API key, and only with 'store' true")

    def collect(self):
        """The store's size at scrape time (a prometheus_client collector)."""
        self._expire()
        yield GaugeMetricFamily("pdserve_response_store_entries", "stored responses (all API keys)",
                                value=len(self.entries))
        yield GaugeMetricFamily("pdserve_response_store_bytes", "bytes held by stored responses (all API keys)",
                                value=sum(self.key_bytes.values()))


class ResponseNotFoundError(ModelNotFoundError):
    """404: no stored response with that id (for this API key)."""

    error_type = "invalid_request_error"


def api_key_digest(headers) -> str:
    """The offered API key (Bearer, else x-api-key) as a SHA-256 hex digest; "" when none: the store's owner key."""
    scheme, _, token = headers.get("authorization", "").strip().partition(" ")
    token = token.strip() if scheme.lower() == "bearer" else headers.get("x-api-key", "").strip()
    return hashlib.sha256(token.encode("utf-8", errors="surrogateescape")).hexdigest() if token else ""


class ResponsesDialect:
    """``POST /v1/responses`` over api/exchange.py; ``headers``: the request's (API key, X-Request-Id)."""

    error_body = staticmethod(error_body)

    def __init__(self, parser, store: ResponseStore, headers):
        self.parser, self.store = parser, store
        self.key = api_key_digest(headers)
        self.response_id = new_id("resp")
        self.request_id = check_request_id(headers.get("x-request-id"), self.response_id)
        self.body: dict = {}
        self.conversation: list[dict] = []

    def build(self, body: Any) -> list:
        history = None
        if isinstance(body, dict) and body.get("previous_response_id") is not None:
            history = self.store.history(self.key, body["previous_response_id"])
        chat_body, self.conversation = translate(body, history, self.parser.unknown_fields)
        requests = parse_chat(self.parser, chat_body, self.request_id, renamed)
        self.body = body
        return requests

    def renderer(self, handles: list) -> ResponsesRenderer:
        meta = ResponseMeta(self.response_id, handles[0].request.model, self.body)
        return ResponsesRenderer(handles, meta, self.body.get("stream") is True, self.keep)

    def keep(self, outcome: Outcome, response: dict) -> None:
        if self.body.get("store") is not False:
            self.store.put(self.key, response, self.conversation + [assistant_message(outcome)])


class ResponsesRenderer(EventRenderer):
    """The Response object, or its SSE events (ResponseStream); the finished response goes to ``keep``."""

    def __init__(self, handles: list, meta: ResponseMeta, stream: bool, keep):
        super().__init__(handles, stream)
        self.meta, self.keep = meta, keep
        self.sse = ResponseStream(meta)

    def start(self) -> list[bytes]:
        return self.sse.start() if self.stream else []

    def frames(self, event: tuple) -> list[bytes]:
        return self.sse.event(event)

    def finish(self) -> list[bytes] | dict:
        if self.stream:
            frames, response = self.sse.finish(self.outcome.reason, self.usage(usage_body))
        else:
            response = frames = response_object(self.meta, self.outcome, self.usage(usage_body))
        self.keep(self.outcome, response)
        return frames

    def failed(self, exc: PdserveError) -> list[bytes]:
        return [self.sse.failed(exc)]

    def progress(self, prompt_progress: dict) -> list[bytes]:
        return [self.sse.progress(prompt_progress)] if self.stream else []


def _not_stored(store: ResponseStore, response_id: str) -> tuple[int, dict]:
    return 404, error_body(f"No response with id '{response_id}' found ({store.limits()})", "invalid_request_error",
                           "response_id", "not_found")


def stored(store: ResponseStore, headers, response_id: str) -> tuple[int, dict]:
    """``GET /v1/responses/{id}``: ``(status, body)``."""
    entry = store.get(api_key_digest(headers), response_id)
    return _not_stored(store, response_id) if entry is None else (200, entry.response)


def deleted(store: ResponseStore, headers, response_id: str) -> tuple[int, dict]:
    """``DELETE /v1/responses/{id}``: ``(status, body)``."""
    if not store.delete(api_key_digest(headers), response_id):
        return _not_stored(store, response_id)
    return 200, {"id": response_id, "object": "response.deleted", "deleted": True}
