"""The events of one choice, shared by the renderers of the Responses and Messages dialects.

=======================  =========================================================================
``ChoiceEvents``         one choice's text pieces (api/generation.py) -> the events below
``Outcome``              the events of a finished choice, collected (a full answer's content)
``EventRenderer``        the base of both dialects' renderers (api/exchange.py's Renderer) over these events
``parse_chat``           a translated body through RequestParser.chat, its errors in the dialect's names
=======================  =========================================================================

Events (tuples, in order):
    ("reasoning", str)                        reasoning text (before ``</think>``; api/formats.py), before any text
    ("text", str)                             answer text (stop strings removed, whole UTF-8 characters)
    ("call", call_id, name, arguments_piece)  a tool call starts (arguments: its first JSON text piece, maybe "")
    ("args", arguments_piece)                 more JSON text of the latest call's arguments (named tool_choice)
    ("finish", reason, stop_string)           last event: "stop", "length", "tool_calls" (a call was made and the
                                              answer ended normally), ...; the stop string that matched, or None

The reasoning and the calls come out of the text by api.formats.ChatDeltas, exactly as chat streams them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from api.formats import ChatDeltas, request_formats
from api.generation import prompt_counts
from pdserve.errors import PdserveError


class ChoiceEvents:
    """One choice (``handle``: api.admission.RequestHandle) as events; ``reason``: its finish reason once known."""

    def __init__(self, handle):
        self.handle = handle
        formats = request_formats(handle.request)
        self.deltas = ChatDeltas(formats, handle.request.tools) if formats is not None else None
        self.reason: str | None = None

    def push(self, text: str, reason: str | None) -> list[tuple]:
        """The events of one text piece (``reason``: the finish reason with the last piece, else None)."""
        deltas = self.deltas
        pieces = deltas.push(text, reason is not None) if deltas is not None else [(text, None, None)]
        if deltas is not None:
            reason = deltas.finish_reason(reason)
        events: list[tuple] = []
        for content, calls, thought in pieces:
            if thought:
                events.append(("reasoning", thought))
            if content:
                events.append(("text", content))
            for call in calls or ():
                if "id" in call:
                    events.append(("call", call["id"], call["function"]["name"], call["function"]["arguments"]))
                elif call["function"]["arguments"]:
                    events.append(("args", call["function"]["arguments"]))
        if reason is not None:
            self.reason = reason
            events.append(("finish", reason, self.handle.stop_string))
        return events


@dataclass
class Outcome:
    """A finished sequence: its text, its tool calls (``{"id", "name", "arguments"}``, arguments as JSON text),
    its finish reason and matched stop string."""

    text: str = ""
    reasoning: str = ""
    calls: list[dict] = field(default_factory=list)
    reason: str | None = None
    stop_string: str | None = None

    def add(self, event: tuple) -> None:
        kind = event[0]
        if kind == "text":
            self.text += event[1]
        elif kind == "reasoning":
            self.reasoning += event[1]
        elif kind == "call":
            self.calls.append({"id": event[1], "name": event[2], "arguments": event[3]})
        elif kind == "args":
            self.calls[-1]["arguments"] += event[1]
        elif kind == "finish":
            self.reason, self.stop_string = event[1], event[2]


class EventRenderer:
    """One choice (these dialects take ``n`` 1) as events: ``outcome`` collects them; a stream renders each but the
    finish with ``frames(event)``. Subclasses give ``start``, ``frames``, ``finish`` and ``failed``."""

    def __init__(self, handles: list, stream: bool):
        self.handles, self.stream = handles, stream
        self.events = ChoiceEvents(handles[0])
        self.outcome = Outcome()
        self.reasons: dict[int, str | None] = {}

    def start(self) -> list[bytes]:
        return []

    def frames(self, event: tuple) -> list[bytes]:
        raise NotImplementedError

    def progress(self, prompt_progress: dict) -> list[bytes]:
        return []

    def event(self, index: int, text: str, reason: str | None, logprobs: list) -> list[bytes]:
        frames: list[bytes] = []
        for event in self.events.push(text, reason):
            self.outcome.add(event)
            if self.stream and event[0] != "finish":
                frames += self.frames(event)
        if self.events.reason is not None:
            self.reasons[index] = self.events.reason
        return frames

    def usage(self, shape) -> dict:
        """``shape(prompt tokens, output tokens, cached prompt tokens)``: the dialect's usage body."""
        prompt_tokens, cached_tokens = prompt_counts(self.handles)
        return shape(prompt_tokens, self.handles[0].completion_tokens, cached_tokens)


def parse_chat(parser, chat_body: dict, request_id: str, renamed) -> list:
    """``[parser.chat(chat_body)]``; its error with the dialect's field names (``renamed``)."""
    try:
        return [parser.chat(chat_body, request_id)]
    except PdserveError as exc:
        raise renamed(exc) from None
