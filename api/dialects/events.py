"""The engine events one admitted sequence yields, shared by every dialect's renderer.

Events (tuples, in order):
    ("reasoning", str)                        reasoning text (before ``</think>``; api/formats.py), before any text
    ("text", str)                             answer text (stop strings removed, whole UTF-8 characters)
    ("call", call_id, name, arguments_piece)  a tool call starts (arguments: its first JSON text piece, maybe "")
    ("args", arguments_piece)                 more JSON text of the latest call's arguments (named tool_choice)
    ("finish", reason, stop_string)           last event: "stop", "length", "tool_calls" (a call was made and the
                                              answer ended normally), ...; the stop string that matched, or None

Built from api.app.merged_choices (detokenization, stop strings, logprobs) and api.formats.ChatDeltas (the
reasoning, the calls of auto/required in the served model's format, the arguments of a named function), exactly as
chat streams them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator

from api.formats import ChatDeltas, request_formats


async def engine_events(client, tokenizer, handle, metrics, reasons: dict) -> AsyncIterator[tuple]:
    """Yield the events of ``handle`` (one choice). ``reasons[handle.index]`` is set to the finish reason once
    known (api.app.Routes.finished counts the request by it). Raises PdserveError as generate_text does."""
    from api.app import merged_choices

    formats = request_formats(handle.request)
    deltas = ChatDeltas(formats, handle.request.tools) if formats is not None else None
    async for _, text, reason, _ in merged_choices(client, tokenizer, [handle], metrics):
        pieces = deltas.push(text, reason is not None) if deltas is not None else [(text, None, None)]
        if deltas is not None:
            reason = deltas.finish_reason(reason)
        for content, calls, thought in pieces:
            if thought:
                yield ("reasoning", thought)
            if content:
                yield ("text", content)
            for call in calls or ():
                if "id" in call:
                    yield ("call", call["id"], call["function"]["name"], call["function"]["arguments"])
                elif call["function"]["arguments"]:
                    yield ("args", call["function"]["arguments"])
        if reason is not None:
            reasons[handle.index] = reason
            yield ("finish", reason, handle.stop_string)
            return


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
