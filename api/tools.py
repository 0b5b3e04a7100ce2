"""Tool calling: validation of ``tools``/``tool_choice``, the prompt the model sees, the grammar of a forced call,
and parsing the model's output back into OpenAI ``tool_calls``. Plain synchronous code, no I/O.

Output format: Hermes-style blocks, as Qwen2.5, Hermes and SmolLM3 templates ask of their models::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

- ``tool_choice: "auto"``: the model decides; its text is parsed for such blocks (:func:`parse_tool_calls`, and
  :class:`ToolCallStream` while streaming: a block naming an offered function streams its name, then its arguments'
  JSON text in pieces as it is written; the whole answer is read by the same stream, so both agree).
- ``"required"``: decoding is constrained by a grammar of one block (several with ``parallel_tool_calls``) whose
  JSON is ``{"name": <one of the tools>, "arguments": <that tool's parameters schema>}``.
- a named function: decoding is constrained by the function's parameters schema and the whole output is the
  arguments (as vLLM does), streamed as ``delta.tool_calls[0].function.arguments`` pieces.
- ``"none"``: the tools are not shown to the model and nothing is parsed.

The model's own chat template receives ``tools`` (and the history's ``tool_calls`` and ``tool`` messages) when it
handles them (its source mentions ``tools``); otherwise, as for the embedded SmolLM2, the tools are described in the
system message in the format above, assistant tool calls are written back as blocks and tool results become user
turns in ``<tool_response>`` tags (Qwen2.5's rendering). ``--chat-template FILE`` supplies another template.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pdserve.errors import InvalidRequestError

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_CLOSE), re.S)
# the head of a block that can stream: the name, then the arguments object's opening brace (not consumed)
_STREAM_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([a-zA-Z0-9_-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
_PARTIAL = re.compile(r'\{\s*"name"\s*:\s*"([^"]*)("?)\s*(?:,\s*"(?:arguments|parameters)"\s*:\s*(.*))?', re.S)
MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asked of tool calling (None on the request: no tools offered, or ``"none"``).

    mode: "auto", "required" or "named". function: the forced function's name (mode "named"). parallel: more
    than one call allowed (``parallel_tool_calls``, default true). names: every offered function's name.
    """

    mode: str
    names: tuple[str, ...]
    function: str | None = None
    parallel: bool = True


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tools(body: dict) -> tuple[list[dict] | None, ToolPlan | None]:
    """Validate ``tools``, ``tool_choice`` and ``parallel_tool_calls``.

    Returns ``(tools for the chat template or None, plan or None)``: both None when no tools are offered or
    ``tool_choice`` is "none".

    Raises:
        InvalidRequestError: naming the field (a malformed tool, an unknown function in ``tool_choice``, ...).
    """
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    if tools is not None and not isinstance(tools, list):
        raise InvalidRequestError("'tools' must be a list", param="tools")
    if tools is not None and len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"'tools' takes at most {MAX_TOOLS} functions", param="tools")
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidRequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}",
                                      param="tools")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequestError(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-'",
                                      param="tools")
        if name in functions:
            raise InvalidRequestError(f"tools[{i}]: the function name {name!r} is used twice", param="tools")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise InvalidRequestError(f"tools[{i}].function.description must be a string", param="tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema object",
                                      param="tools")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise InvalidRequestError(f"tools[{i}].function.strict must be a boolean", param="tools")
        functions[name] = {k: fn[k] for k in ("name", "description", "parameters") if fn.get(k) is not None}
    if choice is None:
        choice = "auto" if functions else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequestError("'tool_choice' must be 'none', 'auto', 'required' or "
                                      "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
        if choice != "none" and not functions:
            raise InvalidRequestError(f"'tool_choice' {choice!r} needs 'tools'", param="tool_choice")
        if choice == "none":
            return None, None
        plan = ToolPlan(choice, tuple(functions), None, parallel is not False)
    else:
        name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
        if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidRequestError("'tool_choice' must be 'none', 'auto', 'required' or "
                                      "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
        if name not in functions:
            raise InvalidRequestError(f"'tool_choice' names the function {name!r}, which is not in 'tools'",
                                      param="tool_choice")
        plan = ToolPlan("named", tuple(functions), name, False)
    return [{"type": "function", "function": f} for f in functions.values()], plan


NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}   # arguments: {} only


def parameters_schema(tools: list[dict], name: str) -> dict:
    """The parameters schema of function ``name``; a function that declares none (or ``{}``) takes no arguments:
    ``NO_PARAMETERS``, which admits ``{}`` alone (an open object schema let a forced call make arguments up)."""
    for tool in tools:
        if tool["function"]["name"] == name:
            return tool["function"].get("parameters") or dict(NO_PARAMETERS)
    raise KeyError(name)


def required_call_grammar(tools: list[dict], parallel: bool) -> str:
    """The Lark grammar (llguidance dialect) of ``tool_choice: "required"``: one ``<tool_call>`` block, or
    several separated by newlines when ``parallel``, each ``{"name": ..., "arguments": ...}`` valid for one tool."""
    variants = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                 "properties": {"name": {"const": t["function"]["name"]},
                                "arguments": parameters_schema(tools, t["function"]["name"])}} for t in tools]
    schema = {"anyOf": variants} if len(variants) > 1 else dict(variants[0])
    schema["x-guidance"] = {"whitespace_flexible": False}   # compact JSON, as for response_format
    schema = json.dumps(schema)
    repeat = ' ("\\n" call)*' if parallel else ""
    return (f"start: call{repeat}\n"
            f'call: "{TOOL_CALL_OPEN}\\n" body "\\n{TOOL_CALL_CLOSE}"\n'
            f"body: %json {schema}\n")


def tools_system_text(tools: list[dict]) -> str:
    """The system-message text that offers ``tools`` to a model whose template does not (Qwen2.5's wording)."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{lines}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            f"{TOOL_CALL_OPEN}{TOOL_CALL_CLOSE} XML tags:\n{TOOL_CALL_OPEN}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n' + TOOL_CALL_CLOSE)


def call_block(name: str, arguments: str) -> str:
    """One ``<tool_call>`` block as the model writes it (``arguments``: the call's JSON text)."""
    try:
        args: Any = json.loads(arguments)
    except ValueError:
        args = arguments
    return f"{TOOL_CALL_OPEN}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{TOOL_CALL_CLOSE}"


def template_messages(messages: list[dict], tools: list[dict] | None, template_has_tools: bool,
                      parser=None) -> list[dict]:
    """The messages the chat template renders.

    ``messages`` are validated chat messages (``role``, ``content`` str or None, ``tool_calls`` on an assistant,
    ``tool_call_id`` on a tool message). A template that handles tools gets them as transformers passes them
    (arguments parsed back to objects, as vLLM does; call ids in the family's form, ``parser.history_id``); for any
    other template they are written as text, in the format of ``parser`` (an api.formats tool-call parser; None:
    Hermes blocks).
    """
    if template_has_tools:
        history_id = parser.history_id if parser is not None else str
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{**c, "id": history_id(c["id"]) if c.get("id") else c.get("id"),
                                    "function": {**c["function"], "arguments": _loads_or_text(
                                        c["function"]["arguments"])}} for c in m["tool_calls"]]
            if m.get("tool_call_id"):
                m["tool_call_id"] = history_id(m["tool_call_id"])
            out.append(m)
        return out
    out: list[dict] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            if parser is not None:
                blocks = parser.render_calls([c["function"] for c in m["tool_calls"]])
            else:
                blocks = "\n".join(call_block(c["function"]["name"], c["function"]["arguments"])
                                   for c in m["tool_calls"])
            text = f"{m['content']}\n{blocks}" if m.get("content") else blocks
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            response = f"<tool_response>\n{m['content'] or ''}\n</tool_response>"
            if out and out[-1].get("_tool_turn"):   # consecutive results share one user turn
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "_tool_turn": True})
        else:
            out.append({"role": m["role"], "content": m.get("content") or "",
                        **({"reasoning_content": m["reasoning_content"]} if m.get("reasoning_content") else {})})
    for m in out:
        m.pop("_tool_turn", None)
    if tools:
        text = parser.instructions(tools) if parser is not None else tools_system_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _loads_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _call_of(block: str) -> dict | None:
    """``{"name", "arguments"}`` of one block's JSON, or None when it is not a call."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}


def partial_call(block: str, names: tuple[str, ...]) -> dict | None:
    """The call an unclosed ``<tool_call>`` block (cut by ``max_tokens``) began, ``{"name", "arguments"}``: its
    function (named in full, or the one offered name the cut name starts) and the arguments written so far (JSON
    text, possibly incomplete, as OpenAI returns a call cut by ``length``). None when no function can be told."""
    match = _PARTIAL.match(block.strip())
    if match is None:
        return None
    name, closed, arguments = match.groups()
    candidates = [name] if closed else [n for n in names if n.startswith(name)]
    if len(candidates) != 1 or candidates[0] not in names:
        return None
    arguments = (arguments or "").rstrip()
    tail = partial_suffix(arguments, TOOL_CALL_CLOSE) or (len(TOOL_CALL_CLOSE) if arguments.endswith(
        TOOL_CALL_CLOSE) else 0)
    whole = arguments[:len(arguments) - tail].rstrip()
    if whole.endswith("}") and _loads_or_none(whole[:-1]) is not None:
        return {"name": candidates[0], "arguments": whole[:-1]}   # less the block's own closing brace
    if tail and _loads_or_none(whole) is None:   # the marker's start inside the arguments (a string): their text
        whole = arguments
    return {"name": candidates[0], "arguments": whole}


def _loads_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _cut_call(content: str | None, names: tuple[str, ...]) -> tuple[str | None, dict | None]:
    """``content`` without an unclosed block at its end, and the partial call of that block (None: none)."""
    start = (content or "").rfind(TOOL_CALL_OPEN)
    if start < 0 or TOOL_CALL_CLOSE in content[start:]:
        return content, None
    call = partial_call(content[start + len(TOOL_CALL_OPEN):], names)
    return (content[:start].strip() or None, call) if call is not None else (content, None)


def parse_tool_calls(text: str, parallel: bool = True) -> tuple[str | None, list[dict]]:
    """Split a finished answer into (content, calls): every well-formed ``<tool_call>`` block becomes a call
    ``{"name", "arguments"}`` (arguments as JSON text); the text around them, stripped, is the content (None if
    empty). A block whose JSON does not parse stays in the content. Without ``parallel`` only the first call
    is kept."""
    calls: list[dict] = []
    content: list[str] = []
    pos = 0
    for match in _BLOCK.finditer(text):
        call = _call_of(match.group(1))
        if call is None:
            continue
        content.append(text[pos:match.start()])
        pos = match.end()
        calls.append(call)
    content.append(text[pos:])
    rest = "".join(content).strip()
    return (rest or None), (calls if parallel else calls[:1])


class MarkerBuffer:
    """What every streamed tool-call parser shares (this module's Hermes stream, api/formats.py's marker
    streams): the text not yet sent (``buffer``), calls sent, and content sent with leading whitespace dropped
    until the first."""

    def __init__(self, parallel: bool = True):
        self.parallel = parallel
        self.buffer = ""
        self.calls = 0
        self.sent = False   # some content went out (leading whitespace is dropped until then)

    def _content(self, text: str, events: list) -> None:
        if not self.sent:
            text = text.lstrip()
        if text:
            self.sent = True
            events.append(("content", text))

    def _text_before(self, marker: str, events: list) -> int:
        """Send the buffer's content before ``marker`` and return where the marker starts; without one, send all but
        a tail that may start it (and trailing whitespace, dropped if the marker follows) and return -1."""
        start = self.buffer.find(marker)
        if start < 0:
            keep = partial_suffix(self.buffer, marker)
            head = self.buffer[:len(self.buffer) - keep]
            cut = len(head.rstrip())
            self._content(head[:cut], events)
            self.buffer = self.buffer[cut:]
            return -1
        self._content(self.buffer[:start].rstrip(), events)
        return start


class ToolCallStream(MarkerBuffer):
    """Streams an ``auto``/``required`` answer: text outside ``<tool_call>`` blocks goes out as content at once
    (except a tail that could be the start of a block), each block goes out as one call when it closes.

    ``push(text)`` and ``finish()`` return events ``("content", text)`` or ``("call", {"name", "arguments"})``.
    ``"".join(content) `` and the calls equal :func:`parse_tool_calls` on the whole text, up to whitespace.

    With ``names`` (the offered functions), a block that starts ``{"name": "<one of them>", "arguments": {`` streams
    as it is written: ``("call_start", name)``, then ``("args", piece)`` events carrying the arguments' JSON text as
    the model writes it (whitespace and a tail that may start ``</tool_call>`` held until more comes), then
    ``("call_end", {"name", "arguments"})`` whose arguments are those pieces joined: the object's text up to its
    closing brace, or, when the block closes (or the answer ends) before it, the text written so far.
    """

    def __init__(self, parallel: bool = True, names: tuple[str, ...] | None = None):
        super().__init__(parallel)
        self.names = names
        self.value = -1      # streaming a call: where its arguments start in the buffer (-1: not streaming)
        self.scanned = 0     # buffer index the JSON scan reached
        self.sent_to = 0     # buffer index the arguments went out to
        self.depth, self.in_string, self.escape, self.closed = 0, False, False, False
        self.name = ""

    def _start(self, events: list) -> None:
        """Begin streaming the block at the buffer's start when its head is complete and names an offered one."""
        match = _STREAM_HEAD.match(self.buffer, len(TOOL_CALL_OPEN))
        if match is None or match.group(1) not in self.names or not (self.parallel or self.calls == 0):
            return
        self.name, self.value = match.group(1), match.end()
        self.scanned = self.sent_to = self.value
        self.depth, self.in_string, self.escape, self.closed = 0, False, False, False
        events.append(("call_start", self.name))

    def _scan(self, stop: int) -> None:
        """Scan the arguments' JSON up to ``stop`` (string- and escape-aware), ending at their closing brace."""
        i, text = self.scanned, self.buffer
        while i < stop and not self.closed:
            c = text[i]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                self.closed = self.depth == 0
            i += 1
        self.scanned = i

    def _send(self, upto: int, events: list) -> None:
        if upto > self.sent_to:
            events.append(("args", self.buffer[self.sent_to:upto]))
            self.sent_to = upto

    def _end(self, rest_from: int, events: list) -> None:
        events.append(("call_end", {"name": self.name, "arguments": self.buffer[self.value:self.sent_to]}))
        self.calls += 1
        self.buffer, self.value = self.buffer[rest_from:].lstrip(), -1

    def _stream_call(self, events: list) -> bool:
        """Advance the streamed call; True when it ended (the buffer then holds what follows its block)."""
        close = self.buffer.find(TOOL_CALL_CLOSE, self.value)
        self._scan(close if close >= 0 else len(self.buffer))
        if self.closed:
            self._send(self.scanned, events)
        else:
            limit = close if close >= 0 else len(self.buffer) - partial_suffix(self.buffer, TOOL_CALL_CLOSE)
            self._send(self.value + len(self.buffer[self.value:limit].rstrip()), events)
        if close < 0:
            return False
        self._end(close + len(TOOL_CALL_CLOSE), events)
        return True

    def push(self, text: str) -> list[tuple[str, Any]]:
        self.buffer += text
        events: list[tuple[str, Any]] = []
        while True:
            if self.value >= 0:
                if not self._stream_call(events):
                    return events
                continue
            start = self._text_before(TOOL_CALL_OPEN, events)
            if start < 0:
                return events
            self.buffer = self.buffer[start:]
            if self.names is not None:
                self._start(events)
                if self.value >= 0:
                    continue
            end = self.buffer.find(TOOL_CALL_CLOSE)
            if end < 0:
                return events
            block = self.buffer[len(TOOL_CALL_OPEN):end].strip()
            whole = self.buffer[:end + len(TOOL_CALL_CLOSE)]
            self.buffer = self.buffer[end + len(TOOL_CALL_CLOSE):]
            call = _call_of(block)
            if call is None:
                self._content(whole, events)
            elif self.parallel or self.calls == 0:
                self.calls += 1
                events.append(("call", call))
            self.buffer = self.buffer.lstrip() if call is not None else self.buffer

    def finish(self, names: tuple[str, ...] | None = None) -> list[tuple[str, Any]]:
        """The held tail, as content; with ``names`` (the answer was cut by ``max_tokens``) an unclosed block
        at the end is the partial call it began (:func:`partial_call`), not markup in the content. A call being
        streamed ends with the arguments written so far."""
        events: list[tuple[str, Any]] = []
        if self.value >= 0:
            self._stream_call(events)
            if self.value >= 0:   # the block never closed: what follows its arguments and own brace is content
                if not self.closed:   # cut inside the arguments: all of their text, a held marker-like tail too
                    self._send(len(self.buffer.rstrip()), events)
                self._end(self.scanned if self.closed else len(self.buffer), events)
                rest = self.buffer.removeprefix("}").rstrip()
                self.buffer = rest[:len(rest) - partial_suffix(rest, TOOL_CALL_CLOSE)]
        out, self.buffer = self.buffer.rstrip(), ""
        call = None
        if names is not None and out.startswith(TOOL_CALL_OPEN):
            out, call = _cut_call(out, names)
        self._content(out or "", events)
        if call is not None and (self.parallel or self.calls == 0):
            self.calls += 1
            events.append(("call", call))
        return events


def partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``token``."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if text.endswith(token[:n]):
            return n
    return 0


def openai_call(call: dict, index: int | None = None, parser=None) -> dict:
    """A parsed call as an OpenAI ``tool_calls`` entry (a new id: ``call_...``, or the form ``parser`` gives);
    with ``index``, as a streamed ``delta.tool_calls`` entry."""
    out = {"id": parser.new_call_id() if parser is not None else new_call_id(), "type": "function",
           "function": {"name": call["name"], "arguments": call["arguments"]}}
    return out if index is None else {"index": index, **out}


def finished_choice(plan: ToolPlan, text: str, reason: str | None,
                    parser=None) -> tuple[str | None, list[dict], str | None]:
    """A finished chat choice of a request with tools: ``(content, tool_calls, finish_reason)``. A named function's
    output is its arguments; otherwise the text is parsed for ``<tool_call>`` blocks. ``finish_reason`` becomes
    "tool_calls" when the answer ended normally ("stop") with at least one call. An answer cut by ``max_tokens``
    ("length") inside a block keeps "length" and returns the call it began with its partial arguments (as OpenAI
    does), never the markup as content. ``parser``: the api.formats tool-call parser (None: Hermes blocks)."""
    if plan.mode == "named":
        content, calls = None, [{"name": plan.function, "arguments": text}]
    else:
        content, calls = (parser.parse(text, plan.parallel, plan.names) if parser else
                          parse_tool_calls(text, plan.parallel))
        if reason == "length":
            if parser is not None:
                content, partial = parser.cut(content, plan.names)
            else:
                content, one = _cut_call(content, plan.names)
                partial = [one] if one is not None else []
            for call in partial:
                if plan.parallel or not calls:
                    calls.append(call)
    if calls and reason == "stop":
        reason = "tool_calls"
    return content, [openai_call(c, None, parser) for c in calls], reason


class ToolDeltas:
    """One streamed chat choice of a request with tools: text deltas in, ``(content, delta_tool_calls)`` pieces out,
    as OpenAI streams them: a call's first piece has its index, id and name, later ones ``arguments`` pieces (a named
    function; a Hermes call of an offered function, as it is written: ``call_start`` / ``args`` events of the
    parser's stream); a call of another format goes out whole, once complete. ``parser``: the api.formats
    tool-call parser (None: Hermes ``<tool_call>`` blocks)."""

    def __init__(self, plan: ToolPlan, parser=None):
        self.plan = plan
        self.parser = parser
        self.stream = None if plan.mode == "named" else (parser.stream(plan.parallel, plan.names) if parser
                                                         else ToolCallStream(plan.parallel, plan.names))
        self.calls = 0
        self.open = False   # a streamed call's arguments are going out (call_start sent, call_end not yet)

    def push(self, text: str, final: bool | str | None) -> list[tuple[str | None, list[dict] | None]]:
        """``final``: the choice's finish reason when this is its last text (falsy before); "length" turns an
        unclosed block at the end into the partial call it began."""
        if self.stream is None:
            if self.calls == 0:
                self.calls = 1
                return [(None, [openai_call({"name": self.plan.function, "arguments": text}, 0, self.parser)])]
            return [(None, [{"index": 0, "function": {"arguments": text}}])] if text else []
        events = self.stream.push(text) + (self.stream.finish(self.plan.names if final == "length" else None)
                                           if final else [])
        out: list[tuple[str | None, list[dict] | None]] = []
        for kind, value in events:
            if kind == "content":
                out.append((value, None))
            elif kind == "call_start":   # a streamed call: its name now, its arguments in pieces ("args")
                self.open = self.plan.parallel or not self.calls   # (a call taken from the reasoning counts)
                if self.open:
                    out.append((None, [openai_call({"name": value, "arguments": ""}, self.calls, self.parser)]))
                    self.calls += 1
            elif kind == "args":
                if self.open:
                    out.append((None, [{"index": self.calls - 1, "function": {"arguments": value}}]))
            elif kind == "call_end":
                self.open = False
            elif self.plan.parallel or not self.calls:
                out.append((None, [openai_call(value, self.calls, self.parser)]))
                self.calls += 1
        return out

    def take(self, call: dict) -> list[dict]:
        """A call parsed elsewhere (inside the reasoning: api/formats.py) as the next ``delta.tool_calls`` entry;
        [] when ``parallel_tool_calls`` is false and a call went out already."""
        if not self.plan.parallel and self.calls:
            return []
        self.calls += 1
        return [openai_call(call, self.calls - 1, self.parser)]

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.calls else reason
