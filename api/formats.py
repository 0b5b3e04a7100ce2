"""Output formats per model family: the tool-call parser and the reasoning parser a chat answer goes through.

=====================  ==========================================================================================
name                   what the model writes
=====================  ==========================================================================================
tool ``hermes``        ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks (Qwen2.5/Qwen3,
                       Hermes; api/tools.py, also what the fallback tools prompt teaches a template without tools)
tool ``llama3_json``   the message starts with ``{"name": ..., "parameters": {...}}`` (Llama 3.1-3.3's template),
                       optionally after ``<|python_tag|>``; several calls separated by ``;``; text after the calls
                       is content
tool ``mistral``       ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` after any content (Mistral v3
                       tokenizer); the v11 form ``[TOOL_CALLS]name[ARGS]{...}`` is read as well
tool ``deepseek_v3``   ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` + fenced JSON
                       + ``<｜tool▁call▁end｜>`` ... ``<｜tool▁calls▁end｜>`` (DeepSeek-V3); ``deepseek_v31`` writes
                       ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``; each reads both forms
reasoning ``qwen3``    ``<think>...</think>`` at the start of the answer (or opened by the prompt's end, as Qwen3's
                       thinking templates do); an answer that does not start in it has no reasoning
reasoning             the answer starts inside the reasoning (DeepSeek-R1's template opens ``<think>`` in the
``deepseek_r1``        prompt); everything before ``</think>`` is reasoning, all of it when none comes
=====================  ==========================================================================================

The choice (:func:`choose`): ``--tool-call-parser`` / ``--reasoning-parser`` when given, else by the model's family
(:data:`FAMILY_DEFAULTS`), unless the chat template says otherwise: one that does not render ``tools`` gets
``hermes`` (the format the fallback prompt describes), one that writes a format's marker (:data:`TEMPLATE_MARKERS`)
gets that format's parser (DeepSeek's: ``deepseek_v31`` when it writes the name right after the call marker).
Reasoning is split before tool calls: the content after ``</think>`` goes to the tool parser. A request that turns
thinking off (``chat_template_kwargs: {"enable_thinking": false}``, or a prompt the template ends with
``</think>``) has no reasoning split off; a grammar (``response_format``, forced tool calls) then constrains the
whole answer, else the answer after the reasoning (gpu.grammar.after_reasoning). A complete call the model writes
before ``</think>`` (llama.cpp issue 22684) is a call, as SGLang returns it, and is no longer in the reasoning; the
config's ``tool_calls_in_reasoning`` "reasoning" leaves it there, as vLLM does.

Hermes calls stream as they are written (api.tools.ToolCallStream: the name, then the arguments' JSON text in
pieces, equal when joined to the whole answer's call, which the same stream reads); the other formats' calls go out
whole once complete. Streams hold back text that may be the start of a marker (``<tool_call>``, ``[TOOL_CALLS]``,
``</think>``), so a marker split across deltas never leaks into the content; a call cut by ``max_tokens`` comes back as a call with
the arguments written so far, whatever the parser. Markers the model files declare special tokens stay in the text
the parsers read (:func:`marker_texts`, kept by api/generation.py's detokenizer) and are named as those tokens in the
``required`` grammar (:func:`with_special_markers`). Entry points: :func:`formats_for` (API start-up),
:class:`OutputFormats` (per request, api/protocol.py), :class:`ChatDeltas` (a streamed choice: api/dialects/openai.py,
api/dialects/events.py) and :func:`finish_choice` (a whole one). Plain synchronous code, no I/O.
"""
from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

from api import tools as hermes

__all__ = ["FAMILY_DEFAULTS", "REASONING_PARSERS", "TOOL_PARSERS", "OutputFormats", "ReasoningStream", "choose",
           "marker_texts", "split_reasoning", "tool_parser", "with_special_markers"]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
REASONING_PARSERS = ("qwen3", "deepseek_r1")
# the marker a chat template writes -> the parser of that format (Qwen2.5/Hermes, Mistral v3+, Llama 3.1+)
TEMPLATE_MARKERS = (("<tool_call>", "hermes"), (MISTRAL_CALLS, "mistral"), (PYTHON_TAG, "llama3_json"),
                    ("<｜tool▁calls▁begin｜>", "deepseek_v3"))

# family (gpu/families.py) -> (tool-call parser, reasoning parser or None), as vLLM's recipes pick them
FAMILY_DEFAULTS: dict[str, tuple[str, str | None]] = {
    "llama": ("llama3_json", None), "mistral": ("mistral", None), "qwen2": ("hermes", None),
    "qwen3": ("hermes", "qwen3"), "qwen3_moe": ("hermes", "qwen3"), "phi3": ("hermes", None),
    "gemma2": ("hermes", None), "gemma3": ("hermes", None),
    "deepseek2": ("deepseek_v3", None),  # DeepSeek-V2.5's template writes V3's tool-call format
    "deepseek3": ("deepseek_v3", None)}  # V3 / R1 (R1's template writes </think>: deepseek_r1 reasoning)


@dataclass(frozen=True)
class OutputFormats:
    """The parsers of one chat request. ``tool_parser``: a :data:`TOOL_PARSERS` name. ``reasoning``: a
    :data:`REASONING_PARSERS` name or None (no split). ``opened``: the prompt ends inside ``<think>``, so the answer
    starts in the reasoning. ``calls_in_reasoning``: complete calls in the reasoning are calls (the config's
    ``tool_calls_in_reasoning`` "call"), not reasoning text."""

    tool_parser: str = "hermes"
    reasoning: str | None = None
    opened: bool = False
    calls_in_reasoning: bool = True   # a complete call written before </think> is a call (else it stays reasoning)


def choose(family: str, template: str | None, tool_flag: str = "auto",
           reasoning_flag: str = "auto") -> tuple[str, str | None]:
    """``(tool parser, reasoning parser or None)`` for a model of ``family`` whose chat template is ``template``.
    ``tool_flag`` / ``reasoning_flag``: the config's ``tool_call_parser`` / ``reasoning_parser`` ("auto": by
    family; "none" for reasoning: no split). Raises ValueError naming the choices for an unknown name."""
    tool, reasoning = FAMILY_DEFAULTS.get(family, ("hermes", None))
    text = template or ""
    if "tools" not in text:
        tool = "hermes"   # the fallback tools prompt (api/tools.py) teaches the Hermes format
    else:   # a template that writes one format's marker asks for that format, whatever the weights' family
        tool = next((name for marker, name in TEMPLATE_MARKERS if marker in text), tool)
        if tool == "deepseek_v3" and _writes_v31_calls(text):
            tool = "deepseek_v31"
    if reasoning is None and THINK_CLOSE in (template or ""):
        reasoning = "deepseek_r1"   # a template that writes </think> (DeepSeek-R1 distills of Qwen2.5 / Llama)
    if tool_flag != "auto":
        if tool_flag not in TOOL_PARSERS:
            raise ValueError(f"unknown tool-call parser {tool_flag!r}; choose from auto, {', '.join(TOOL_PARSERS)}")
        tool = tool_flag
    if reasoning_flag != "auto":
        if reasoning_flag not in REASONING_PARSERS + ("none",):
            raise ValueError(f"unknown reasoning parser {reasoning_flag!r}; choose from auto, none, "
                             f"{', '.join(REASONING_PARSERS)}")
        reasoning = None if reasoning_flag == "none" else reasoning_flag
    return tool, reasoning


def _writes_v31_calls(template: str) -> bool:
    """True when the template writes DeepSeek calls V3.1's way, the name right after ``<｜tool▁call▁begin｜>`` (V3.1:
    ``'<｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>'``; V3 and R1 write the type there:
    ``tool['type']`` or ``function``)."""
    heads = [after.split(DS_SEP, 1)[0] for after in template.split(DS_CALL_BEGIN)[1:] if DS_SEP in after[:80]]
    return bool(heads) and all("name" in h.lower() and "type" not in h.lower() for h in heads)


def prompt_closes_reasoning(prompt_text: str) -> bool:
    """True when the rendered prompt ends with ``</think>``: the template closed the reasoning (thinking off, as
    DeepSeek-V3.1's and Qwen3's templates write it), so the answer has none."""
    return prompt_text.rstrip().endswith(THINK_CLOSE)


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """True when the rendered prompt ends inside a ``<think>`` block (the template opened it)."""
    text = prompt_text.rstrip()
    return text.endswith(THINK_OPEN)


# ---------------------------------------------------------------------------------------------------- reasoning


class ReasoningStream:
    """Splits answer text deltas into reasoning and content. ``push(text)`` / ``finish()`` return events
    ``("reasoning", text)`` or ``("content", text)``; whitespace between ``</think>`` and the content is dropped.

    ``parser``: "qwen3" or "deepseek_r1"; ``opened``: the prompt opened ``<think>`` (deepseek_r1 always starts
    inside the reasoning)."""

    def __init__(self, parser: str, opened: bool = False):
        self.parser = parser
        self.state = "start"
        self.opened = opened or parser == "deepseek_r1"
        self.buffer = ""
        self.content_started = False
        self.after_think = False   # the content follows </think>: its leading whitespace is the template's

    def _emit_content(self, text: str, events: list) -> None:
        if not self.content_started and self.after_think:
            text = text.lstrip()
        if text:
            self.content_started = True
            events.append(("content", text))

    def push(self, text: str) -> list[tuple[str, str]]:
        self.buffer += text
        events: list[tuple[str, str]] = []
        if self.state == "start":
            head = self.buffer.lstrip()
            if head.startswith(THINK_OPEN):
                self.buffer, self.state = head[len(THINK_OPEN):], "reasoning"
            elif THINK_OPEN.startswith(head):
                return events   # maybe the start of <think>: wait
            else:
                self.state = "reasoning" if self.opened else "content"
        if self.state == "reasoning":
            end = self.buffer.find(THINK_CLOSE)
            if end < 0:
                keep = hermes.partial_suffix(self.buffer, THINK_CLOSE)
                piece, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                if piece:
                    events.append(("reasoning", piece))
                return events
            if end:
                events.append(("reasoning", self.buffer[:end]))
            self.buffer, self.state, self.after_think = self.buffer[end + len(THINK_CLOSE):], "content", True
        if self.state == "content":
            piece, self.buffer = self.buffer, ""
            self._emit_content(piece, events)
        return events

    def finish(self) -> list[tuple[str, str]]:
        """The held text: content, or reasoning when the answer ended inside it (cut by ``max_tokens``)."""
        rest, self.buffer = self.buffer, ""
        events: list[tuple[str, str]] = []
        if self.state == "start" and self.opened:
            self.state = "reasoning"
        if self.state == "reasoning":
            if rest:
                events.append(("reasoning", rest))
        else:
            self._emit_content(rest, events)
        return events


def split_reasoning(parser: str, text: str, opened: bool = False) -> tuple[str | None, str]:
    """A finished answer as ``(reasoning or None, content)``, exactly as :class:`ReasoningStream` streams it
    (reasoning stripped; None when there was none)."""
    stream = ReasoningStream(parser, opened)
    events = stream.push(text) + stream.finish()
    reasoning = "".join(t for k, t in events if k == "reasoning").strip()
    content = "".join(t for k, t in events if k == "content")
    seen = any(k == "reasoning" for k, _ in events) or stream.state != "content" or THINK_CLOSE in text
    return (reasoning if seen and reasoning else None), content


# --------------------------------------------------------------------------------------------- tool-call parsers


class ToolParser:
    """One tool-call format. ``parse(text, parallel) -> (content or None, [{"name", "arguments"}])`` (arguments:
    JSON text); ``stream(parallel)``: an object with ``push(text)`` and ``finish(names=None)`` returning events
    ``("content", text)`` / ``("call", {"name", "arguments"})``; ``required_grammar(tools, parallel)``: the Lark
    grammar (llguidance) of ``tool_choice: "required"`` in this format; ``instructions(tools)``: the system text that
    teaches the format to a model whose template does not render tools; ``render_calls(calls)``: an assistant's
    earlier calls (``{"name", "arguments"}``) as the model writes them. ``markers``: the marker strings the
    format is read by (kept in the text when the model files declare them special tokens: :func:`marker_texts`)."""

    name = ""
    markers: tuple[str, ...] = ()

    def parse(self, text: str, parallel: bool = True,
              names: tuple[str, ...] | None = None) -> tuple[str | None, list[dict]]:
        stream = self.stream(parallel, names)
        return _collect(stream.push(text) + stream.finish())

    def stream(self, parallel: bool = True, names: tuple[str, ...] | None = None):
        """``names``: the offered functions, for a format whose calls stream as written (``call_start`` /
        ``args`` / ``call_end`` events: api.tools.ToolCallStream); the others ignore it."""
        raise NotImplementedError

    def cut(self, content: str | None, names: tuple[str, ...]) -> tuple[str | None, list[dict]]:
        """An answer cut by ``max_tokens`` (``content``: what :meth:`parse` left as content): the content without
        the unclosed calls at its end, and those calls, the last with the arguments written so far
        (:func:`api.tools.partial_call`); ``(content, [])`` when there are none."""
        stream = self.stream(True)
        return _collect(stream.push(content or "") + stream.finish(names))

    def required_grammar(self, tools: list[dict], parallel: bool) -> str:
        raise NotImplementedError

    def instructions(self, tools: list[dict]) -> str:
        raise NotImplementedError

    def render_calls(self, calls: list[dict]) -> str:
        raise NotImplementedError

    def new_call_id(self) -> str:
        """The id of a new call (OpenAI's ``call_...`` form)."""
        return hermes.new_call_id()

    def history_id(self, call_id: str) -> str:
        """A call id of the history (an assistant's ``tool_calls[].id``, a tool message's ``tool_call_id``) as this
        family's template takes it; the same id always maps to the same one. Any id, here."""
        return call_id


def _collect(events: list) -> tuple[str | None, list[dict]]:
    content = "".join(v for k, v in events if k == "content").strip()
    return content or None, [v for k, v in events if k in ("call", "call_end")]


def _call_schema(tools: list[dict], arguments_key: str) -> str:
    """The JSON schema (llguidance %json) of one call ``{"name": const, <arguments_key>: parameters}``."""
    variants = [{"type": "object", "additionalProperties": False, "required": ["name", arguments_key],
                 "properties": {"name": {"const": t["function"]["name"]},
                                arguments_key: hermes.parameters_schema(tools, t["function"]["name"])}}
                for t in tools]
    schema = {"anyOf": variants} if len(variants) > 1 else dict(variants[0])
    schema["x-guidance"] = {"whitespace_flexible": False}
    return json.dumps(schema)


def _as_call(obj: Any) -> dict | None:
    """``{"name", "arguments"}`` of a decoded call object (``arguments`` or Llama's ``parameters``), or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}


def _tools_lines(tools: list[dict]) -> str:
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)


class HermesParser(ToolParser):
    """``<tool_call>`` blocks: api/tools.py's parser (partial calls cut by ``max_tokens`` included)."""

    name = "hermes"
    markers = (hermes.TOOL_CALL_OPEN, hermes.TOOL_CALL_CLOSE)

    def parse(self, text, parallel=True, names=None):
        """Without ``names``: :func:`api.tools.parse_tool_calls`; with them, the calls exactly as they stream."""
        return hermes.parse_tool_calls(text, parallel) if names is None else super().parse(text, parallel, names)

    def stream(self, parallel=True, names=None):
        return hermes.ToolCallStream(parallel, names)

    def cut(self, content, names):
        content, call = hermes._cut_call(content, names)
        return content, [call] if call is not None else []

    def required_grammar(self, tools, parallel):
        return hermes.required_call_grammar(tools, parallel)

    def instructions(self, tools):
        return hermes.tools_system_text(tools)

    def render_calls(self, calls):
        return "\n".join(hermes.call_block(c["name"], c["arguments"]) for c in calls)


class _WholeMessageStream:
    """Llama 3.x: an answer that starts with ``{`` (or ``<|python_tag|>``) is held whole and parsed at the end as
    calls separated by ``;``, then any text after them as content; any other answer streams as content at once."""

    def __init__(self, parallel: bool):
        self.parallel = parallel
        self.buffer = ""
        self.mode = "start"   # "start" (deciding), "content", "calls" (held to the end)

    def push(self, text: str) -> list[tuple[str, Any]]:
        if self.mode == "content":
            return [("content", text)] if text else []
        self.buffer += text
        if self.mode == "start":
            head = self.buffer.lstrip()
            if not head or (PYTHON_TAG.startswith(head) and len(head) < len(PYTHON_TAG)):
                return []
            self.mode = "calls" if head.startswith(("{", PYTHON_TAG)) else "content"
            if self.mode == "content":
                out, self.buffer = head, ""
                return [("content", out)]
        return []

    def finish(self, names: tuple[str, ...] | None = None) -> list[tuple[str, Any]]:
        """The held answer; with ``names`` (cut by ``max_tokens``) an unclosed last call is the partial call it
        began."""
        text, self.buffer = self.buffer, ""
        if self.mode == "content":
            return [("content", text)] if text else []
        parsed = _llama_calls(text.strip())
        rest = ""
        if names is not None and (parsed is None or parsed[1]):   # cut inside a call: the partial call, not text
            cut = _cut_calls(text.strip().removeprefix(PYTHON_TAG), ";", names)
            if cut is not None:
                parsed = cut, ""
        if parsed is None:
            text = text.strip()
            return [("content", text)] if text else []
        calls, rest = parsed
        events: list[tuple[str, Any]] = [("call", c) for c in (calls if self.parallel else calls[:1])]
        return events + ([("content", rest)] if rest else [])


def _llama_calls(text: str) -> tuple[list[dict], str] | None:
    """The calls a Llama 3.x answer starts with (``<|python_tag|>`` optional, objects separated by ``;``) and the
    text after them, stripped (vLLM PR 19024: a model writes a call, then words about it); None when it does not
    start with a call."""
    if text.startswith(PYTHON_TAG):
        text = text[len(PYTHON_TAG):]
    decoder = json.JSONDecoder()
    calls, pos = [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
            pos += 1
        if pos == len(text):
            return (calls, "") if calls else None
        try:
            obj, end = decoder.raw_decode(text, pos)
        except ValueError:
            obj, end = None, pos
        call = _as_call(obj)
        if call is None or not ("parameters" in obj or "arguments" in obj):
            return (calls, text[pos:].strip()) if calls else None
        calls.append(call)
        pos = end


def _cut_calls(text: str, separator: str, names: tuple[str, ...]) -> list[dict] | None:
    """The calls of a list cut by ``max_tokens``: the complete ones (JSON objects separated by ``separator``) and
    the partial call the last began (:func:`api.tools.partial_call`), or None when that one names no function."""
    decoder = json.JSONDecoder()
    calls, pos = [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] == separator):
            pos += 1
        if pos == len(text):
            return calls or None
        try:
            obj, end = decoder.raw_decode(text, pos)
        except ValueError:
            break
        call = _as_call(obj)
        if call is None:
            return None
        calls.append(call)
        pos = end
    partial = hermes.partial_call(text[pos:], names)
    return calls + [partial] if partial is not None else None


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = (PYTHON_TAG,)

    def stream(self, parallel=True, names=None):
        return _WholeMessageStream(parallel)

    def required_grammar(self, tools, parallel):
        repeat = ' ("; " call)*' if parallel else ""
        return f"start: call{repeat}\ncall: %json {_call_schema(tools, 'parameters')}\n"

    def instructions(self, tools):
        return ("# Tools\n\nYou have access to the following functions:\n\n" + _tools_lines(tools) +
                "\n\nTo call a function, respond with only a JSON object of the form "
                '{"name": function name, "parameters": dictionary of argument name and its value}. '
                "Do not use variables.")

    def render_calls(self, calls):
        return "; ".join(json.dumps({"name": c["name"], "parameters": _loads_or_text(c["arguments"])},
                                    ensure_ascii=False) for c in calls)


def _loads_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class _MarkerStream(hermes.MarkerBuffer):
    """Mistral: content streams until ``[TOOL_CALLS]`` (a tail that may start it is held); after it the calls are
    held until they parse (a JSON list, or v11's ``name[ARGS]{...}``), then go out as calls and content resumes.
    Text after the marker that never parses goes out as content at the end, marker included. An answer that starts
    with a list of calls without the marker is read as calls too: ``[TOOL_CALLS]`` is a control token of Mistral's
    tokenizer, which detokenization drops with the other special tokens."""

    def __init__(self, parallel: bool):
        super().__init__(parallel)
        self.inside = False   # after a [TOOL_CALLS] whose calls have not parsed yet
        self.mark = 0         # characters of the marker at the buffer's start while inside (0: it was dropped)

    def _call(self, call: dict, events: list) -> None:
        if self.parallel or self.calls == 0:
            self.calls += 1
            events.append(("call", call))

    def push(self, text: str) -> list[tuple[str, Any]]:
        self.buffer += text
        events: list[tuple[str, Any]] = []
        while True:
            if not self.inside and not self.sent and not self.calls and self.buffer.lstrip().startswith("[{"):
                self.buffer, self.inside, self.mark = self.buffer.lstrip(), True, 0
            if not self.inside:
                start = self._text_before(MISTRAL_CALLS, events)
                if start < 0:
                    return events
                self.buffer, self.inside, self.mark = self.buffer[start:], True, len(MISTRAL_CALLS)
            parsed = _mistral_calls(self.buffer[self.mark:])
            if parsed is None:
                return events
            calls, used = parsed
            for call in calls:
                self._call(call, events)
            self.buffer, self.inside = self.buffer[self.mark + used:].lstrip(), False

    def finish(self, names: tuple[str, ...] | None = None) -> list[tuple[str, Any]]:
        """The held text, as content; with ``names`` (cut by ``max_tokens``) unclosed calls after the marker are the
        calls they began, the last with its partial arguments."""
        rest, self.buffer = self.buffer.rstrip(), ""
        events: list[tuple[str, Any]] = []
        if self.inside and names is not None:
            after = rest[self.mark:].lstrip()
            calls = _cut_calls(after[1:] if after.startswith("[") else after, ",", names)
            if calls is not None:
                for call in calls:
                    self._call(call, events)
                rest = ""
        self.inside = False
        self._content(rest, events)
        return events


_ALNUM = string.ascii_letters + string.digits
_MISTRAL_ID = re.compile(r"[a-zA-Z0-9]{9}")
_V11_NAME = re.compile(r"\s*([a-zA-Z0-9_-]{1,64})" + re.escape(MISTRAL_ARGS))


def _mistral_calls(text: str) -> tuple[list[dict], int] | None:
    """The calls after a ``[TOOL_CALLS]`` and the characters they take, or None (incomplete or not calls)."""
    decoder = json.JSONDecoder()
    lead = len(text) - len(text.lstrip())
    if text[lead:lead + 1] == "[":
        try:
            obj, end = decoder.raw_decode(text, lead)
        except ValueError:
            return None
        calls = [_as_call(o) for o in obj] if isinstance(obj, list) else [None]
        return (calls, end) if calls and None not in calls else None
    match = _V11_NAME.match(text)
    if match is None:
        return None
    try:
        args, end = decoder.raw_decode(text, match.end())
    except ValueError:
        return None
    if not isinstance(args, dict):
        return None
    return [{"name": match.group(1), "arguments": json.dumps(args, ensure_ascii=False)}], end


class MistralParser(ToolParser):
    name = "mistral"
    markers = (MISTRAL_CALLS, MISTRAL_ARGS)

    def stream(self, parallel=True, names=None):
        return _MarkerStream(parallel)

    def required_grammar(self, tools, parallel):
        repeat = ' (", " call)*' if parallel else ""
        return (f'start: "{MISTRAL_CALLS}[" call{repeat} "]"\n'
                f"call: %json {_call_schema(tools, 'arguments')}\n")

    def instructions(self, tools):
        return ("# Tools\n\nYou can call these functions:\n" + _tools_lines(tools) +
                f"\n\nTo call functions, write {MISTRAL_CALLS} followed by a JSON list of "
                '{"name": function name, "arguments": arguments object} entries.')

    def new_call_id(self):
        """9 letters and digits: Mistral's templates refuse any other tool-call id in the history."""
        return "".join(secrets.choice(_ALNUM) for _ in range(9))

    def history_id(self, call_id):
        """9 letters and digits, as Mistral's templates demand: the id itself when it is such, else its last 9
        characters when those are (vLLM's truncation: ``call_`` + 24 hex, Anthropic's ``toolu_...``), else 9
        characters of its SHA-256 (any other id a client made)."""
        if _MISTRAL_ID.fullmatch(call_id[-9:]):
            return call_id[-9:]
        digest = int.from_bytes(hashlib.sha256(call_id.encode()).digest(), "big")
        return "".join(_ALNUM[(digest >> (6 * k)) % len(_ALNUM)] for k in range(9))

    def render_calls(self, calls):
        return MISTRAL_CALLS + json.dumps([{"name": c["name"], "arguments": _loads_or_text(c["arguments"])}
                                           for c in calls], ensure_ascii=False)


DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_DS_FENCED = re.compile(r"\s*```(?:json)?\s*(.*?)\s*```\s*$", re.S)


def _deepseek_call(body: str) -> tuple[str, str] | None:
    """``(name, arguments text)`` of the text between ``<｜tool▁call▁begin｜>`` and ``<｜tool▁call▁end｜>``: V3's
    ``function<｜tool▁sep｜>NAME\n```json\nARGS\n````` or V3.1's ``NAME<｜tool▁sep｜>ARGS``; the arguments as
    written, possibly unclosed. None when no name can be read."""
    head, sep, rest = body.partition(DS_SEP)
    if not sep:
        return None
    if head.strip() == "function":   # V3: the type, then the name on its own line, then fenced JSON
        name, _, rest = rest.partition("\n")
        fenced = _DS_FENCED.match(rest)
        rest = fenced.group(1) if fenced else rest.strip().removeprefix("```json").removeprefix("```").strip()
    else:
        name = head
    name = name.strip()
    return (name, rest.strip()) if re.fullmatch(r"[a-zA-Z0-9_.-]{1,64}", name) else None


class _DeepSeekStream(_MarkerStream):
    """DeepSeek V3 / V3.1: content streams until ``<｜tool▁calls▁begin｜>`` (a tail that may start it is held); after
    it each ``<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>`` goes out as a call once closed, and content resumes after
    ``<｜tool▁calls▁end｜>``. Anything else after the marker, or a call that does not parse, makes the rest of the
    answer content, markers included, at the end."""

    def __init__(self, parallel: bool):
        super().__init__(parallel)   # buffer, inside (after the calls marker, before its end), calls, sent
        self.held = ""        # the marker and the raw text since the last call (content if the rest is malformed)
        self.broken = False

    def push(self, text: str) -> list[tuple[str, Any]]:
        self.buffer += text
        events: list[tuple[str, Any]] = []
        while not self.broken:
            if not self.inside:
                start = self._text_before(DS_CALLS_BEGIN, events)
                if start < 0:
                    return events
                self.held, self.buffer = DS_CALLS_BEGIN, self.buffer[start + len(DS_CALLS_BEGIN):]
                self.inside = True
            if not self._take_calls(events):
                return events
        return events

    def _take_calls(self, events: list) -> bool:
        """Consume closed calls and the end marker; False when more text is needed (or the calls are broken)."""
        while True:
            lead = len(self.buffer) - len(self.buffer.lstrip())
            rest = self.buffer[lead:]
            if rest.startswith(DS_CALLS_END):
                self.buffer, self.inside, self.held = rest[len(DS_CALLS_END):], False, ""
                return True
            if rest.startswith(DS_CALL_BEGIN):
                end = rest.find(DS_CALL_END)
                if end < 0:
                    return False
                call = _deepseek_call(rest[len(DS_CALL_BEGIN):end])
                if call is None or _loads_or_none(call[1]) is None:
                    self.broken = True
                    return False
                if self.parallel or self.calls == 0:
                    events.append(("call", {"name": call[0], "arguments": _compact(call[1])}))
                self.calls += 1
                self.held, self.buffer = DS_CALLS_BEGIN, self.buffer[lead + end + len(DS_CALL_END):]
                continue
            if not rest or DS_CALLS_END.startswith(rest) or DS_CALL_BEGIN.startswith(rest):
                return False
            self.broken = True
            return False

    def finish(self, names: tuple[str, ...] | None = None) -> list[tuple[str, Any]]:
        """The held text, as content; with ``names`` (cut by ``max_tokens``) an unclosed call is the call it began,
        with its partial arguments."""
        events: list[tuple[str, Any]] = []
        if self.inside and not self.broken:
            if names is not None:
                call = _deepseek_call(self.buffer.strip().removeprefix(DS_CALL_BEGIN))
                if call is not None and call[0] in names:
                    if self.parallel or self.calls == 0:
                        events.append(("call", {"name": call[0], "arguments": call[1]}))
                    self.buffer = ""
            if not self.buffer.strip():   # the calls ended without their end marker: nothing is left over
                self.inside = False
        rest = (self.held + self.buffer if self.inside else self.buffer).rstrip()
        self.buffer, self.held, self.inside = "", "", False
        self._content(rest, events)
        return events


def _loads_or_none(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _compact(text: str) -> str:
    return json.dumps(json.loads(text), ensure_ascii=False)


class DeepSeekV3Parser(ToolParser):
    """DeepSeek-V3's calls (``function<｜tool▁sep｜>NAME`` and fenced JSON); reads V3.1's form too."""

    name = "deepseek_v3"
    markers = (DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END, DS_SEP)

    def stream(self, parallel=True, names=None):
        return _DeepSeekStream(parallel)

    def _call(self, name: str, arguments: str) -> str:
        return f"{DS_CALL_BEGIN}function{DS_SEP}{name}\n```json\n{arguments}\n```{DS_CALL_END}"

    def _call_rule(self, name: str, schema: str) -> str:
        return f'"{DS_CALL_BEGIN}function{DS_SEP}{name}\\n```json\\n" %json {schema} "\\n```{DS_CALL_END}"'

    def required_grammar(self, tools, parallel):
        rules = []
        for t in tools:
            schema = dict(hermes.parameters_schema(tools, t["function"]["name"]))
            schema["x-guidance"] = {"whitespace_flexible": False}
            rules.append(self._call_rule(t["function"]["name"], json.dumps(schema)))
        repeat = "+" if parallel else ""
        return (f'start: "{DS_CALLS_BEGIN}" (call){repeat} "{DS_CALLS_END}"\n'
                f"call: " + " | ".join(rules) + "\n")

    def instructions(self, tools):
        example = self._call("NAME", "ARGUMENTS")
        return ("# Tools\n\nYou can call these functions:\n" + _tools_lines(tools) +
                f"\n\nTo call functions, write {DS_CALLS_BEGIN}, then each call as {example}, then {DS_CALLS_END}.")

    def render_calls(self, calls):
        return DS_CALLS_BEGIN + "".join(self._call(c["name"], c["arguments"]) for c in calls) + DS_CALLS_END


class DeepSeekV31Parser(DeepSeekV3Parser):
    """DeepSeek-V3.1's calls (``NAME<｜tool▁sep｜>ARGS``, no type, no fence); reads V3's form too."""

    name = "deepseek_v31"

    def _call(self, name: str, arguments: str) -> str:
        return f"{DS_CALL_BEGIN}{name}{DS_SEP}{arguments}{DS_CALL_END}"

    def _call_rule(self, name: str, schema: str) -> str:
        return f'"{DS_CALL_BEGIN}{name}{DS_SEP}" %json {schema} "{DS_CALL_END}"'


TOOL_PARSERS: dict[str, ToolParser] = {p.name: p for p in (HermesParser(), Llama3JsonParser(), MistralParser(),
                                                            DeepSeekV3Parser(), DeepSeekV31Parser())}


def tool_parser(name: str) -> ToolParser:
    """The parser called ``name``. Raises KeyError naming the choices."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise KeyError(f"unknown tool-call parser {name!r}; choose from {', '.join(TOOL_PARSERS)}") from None


# ------------------------------------------------------------------------------------------- one chat choice


def marker_texts(formats: OutputFormats | None, tools: bool = True) -> tuple[str, ...]:
    """The markers a chat choice's parsers read: the tool-call parser's when ``tools`` (the request has tools),
    ``<think>`` / ``</think>`` when it splits reasoning; () for None. The API keeps those that are special tokens
    in the detokenized text (gpu.tokenizer.Tokenizer.special_ids_of), other special tokens stay skipped."""
    if formats is None:
        return ()
    found = tool_parser(formats.tool_parser).markers if tools else ()
    return found + ((THINK_OPEN, THINK_CLOSE) if formats.reasoning else ())


def with_special_markers(grammar: str, ids: dict[str, int]) -> str:
    """A Lark grammar (llguidance) whose quoted literals write the markers in ``ids`` (marker text -> token id, the
    markers the model files declare special tokens) as those tokens, ``<[id]>``: llguidance matches a literal's
    text against text tokens only, so a call's marker has to be named as the special token the model writes.
    ``%json {...}`` schemas are left as they are."""
    if not ids:
        return grammar
    pattern = re.compile("(" + "|".join(re.escape(m) for m in sorted(ids, key=len, reverse=True)) + ")")
    decoder = json.JSONDecoder()
    out: list[str] = []
    i = 0
    while i < len(grammar):
        if grammar.startswith("%json", i):
            start = i + len("%json")
            start += len(grammar[start:]) - len(grammar[start:].lstrip(" "))
            end = decoder.raw_decode(grammar, start)[1]
            out.append(grammar[i:end])
            i = end
        elif grammar[i] == '"':
            j = i + 1
            while grammar[j] != '"':
                j += 2 if grammar[j] == "\\" else 1
            parts = [f"<[{ids[p]}]>" if p in ids else f'"{p}"' for p in pattern.split(grammar[i + 1:j]) if p]
            out.append(parts[0] if len(parts) == 1 else "(" + " ".join(parts) + ")")
            i = j + 1
        else:
            out.append(grammar[i])
            i += 1
    return "".join(out)


def request_formats(req) -> OutputFormats | None:
    """The parsers of a GenerationRequest (api/protocol.py): None when its text goes out untouched (a completion,
    or a chat with neither tools nor reasoning)."""
    formats = getattr(req, "formats", None)
    if req.kind != "chat" or (req.tools is None and (formats is None or formats.reasoning is None)):
        return None
    return formats or OutputFormats()


class ChatDeltas:
    """One streamed chat choice: text deltas in, ``(content, delta_tool_calls, reasoning)`` pieces out (as vLLM
    streams ``delta.reasoning_content``, then ``delta.content`` / ``delta.tool_calls`` from the text after
    ``</think>``)."""

    def __init__(self, formats: OutputFormats, plan):
        self.reasoning = ReasoningStream(formats.reasoning, formats.opened) if formats.reasoning else None
        self.tools = hermes.ToolDeltas(plan, tool_parser(formats.tool_parser)) if plan is not None else None
        # calls written inside the reasoning (llama.cpp issue 22684), read out of it by the same parser
        self.inner = (tool_parser(formats.tool_parser).stream(plan.parallel) if self.reasoning is not None and
                      plan is not None and plan.mode == "auto" and formats.calls_in_reasoning else None)

    def _thought(self, piece: str | None, out: list) -> None:
        """Reasoning text through the inner parser (None: the reasoning ended, flush what it holds)."""
        if self.inner is None:
            if piece:
                out.append((None, None, piece))
            return
        events = self.inner.push(piece) if piece is not None else self.inner.finish()
        if piece is None:
            self.inner = None
        for kind, value in events:
            if kind == "content":
                out.append((None, None, value))
            else:
                calls = self.tools.take(value)
                if calls:
                    out.append((None, calls, None))

    def push(self, text: str, final: bool | str | None) -> list[tuple[str | None, list[dict] | None, str | None]]:
        """``final``: the choice's finish reason when this is its last text (falsy before)."""
        if self.reasoning is None:
            events = [("content", text)]
        else:
            events = self.reasoning.push(text) + (self.reasoning.finish() if final else [])
        out: list[tuple[str | None, list[dict] | None, str | None]] = []
        for kind, piece in events:
            if kind == "reasoning":
                self._thought(piece, out)
                continue
            if self.inner is not None:
                self._thought(None, out)
            if self.tools is None:
                out.append((piece, None, None))
            else:
                out += [(c, calls, None) for c, calls in self.tools.push(piece, None)]
        if final and self.inner is not None:
            self._thought(None, out)
        if final and self.tools is not None:
            out += [(c, calls, None) for c, calls in self.tools.push("", final)]
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        return self.tools.finish_reason(reason) if self.tools is not None else reason


def finish_choice(formats: OutputFormats, plan, choice) -> None:
    """Parse a finished chat choice (api.dialects.openai.ChoiceResult) in place: ``reasoning`` split off, then ``text``,
    ``tool_calls`` and ``finish_reason`` from the tool-call parser (api.tools.finished_choice)."""
    text = choice.text or ""
    early: list[dict] = []   # calls written inside the reasoning
    if formats.reasoning:
        choice.reasoning, text = split_reasoning(formats.reasoning, text, formats.opened)
        if choice.reasoning and plan is not None and plan.mode == "auto" and formats.calls_in_reasoning:
            rest, early = tool_parser(formats.tool_parser).parse(choice.reasoning, plan.parallel)
            choice.reasoning = rest if early else choice.reasoning
    if plan is not None:
        choice.text, choice.tool_calls, choice.finish_reason = hermes.finished_choice(
            plan, text, choice.finish_reason, tool_parser(formats.tool_parser))
        if early:
            calls = [hermes.openai_call(c, None, tool_parser(formats.tool_parser)) for c in early]
            choice.tool_calls = (calls + choice.tool_calls)[:None if plan.parallel else 1]
            choice.finish_reason = "tool_calls" if choice.finish_reason == "stop" else choice.finish_reason
    else:
        choice.text = text
    if choice.reasoning and not choice.text:
        choice.text = None   # all reasoning: no content (as vLLM)


def formats_for(layout, tokenizer) -> tuple[str, str | None]:
    """The parsers of the served model (actors.base.EngineLayout: its family and config's ``tool_call_parser`` /
    ``reasoning_parser``; the tokenizer's chat template), logged once at start-up."""
    import logging

    config = layout.config
    tool, reasoning = choose(layout.shape.family, getattr(tokenizer, "chat_template", None),
                             config.tool_call_parser, config.reasoning_parser)
    logging.getLogger(__name__).info("chat output: tool-call parser %s, reasoning parser %s (family %s)", tool,
                                     reasoning or "none", layout.shape.family)
    return tool, reasoning
