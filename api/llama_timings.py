"""llama.cpp's stream telemetry, for the clients of its server (its web UI, its test suite): a request's
``timings_per_token`` puts a ``timings`` object in every streamed chunk (not a ping) and in a full answer;
``return_progress`` sends ``prompt_progress`` chunks before the first token. Plain code; api/exchange.py calls it.

=======================  =========================================================================
``timings``              llama.cpp's ``timings`` object from token counts and milliseconds
``Telemetry``            one exchange's: the progress chunks and the timings, from its handles and a clock
``with_fields``          an SSE frame with fields added to the JSON object of its ``data:`` line
=======================  =========================================================================

``prompt_progress`` is ``{"total", "cache", "processed", "time_ms"}`` (prompt tokens, those the prefix cache held,
those done, ms since the prompt started). llama.cpp reports it per batch of its prompt; here the API sees a prompt's
prefill end only with its first token, so the two chunks go out then: the prompt before prefill (``processed`` =
``cache``, 0 ms) and after it (``processed`` = ``total``). ``prompt_ms`` is the prefill actor's own time for the
prompt (the first token's ``prefill_s``; admission to first token where that is missing); ``predicted_*`` count
from the first token, and the rates are over ``predicted_n - 1`` steps (the first token came with the prompt), as
llama.cpp's are.
"""
from __future__ import annotations

import time
from typing import Callable

import orjson

from api.generation import prompt_counts


def timings(prompt_n: int, prompt_ms: float, predicted_n: int, predicted_ms: float, cache_n: int) -> dict:
    """llama.cpp's ``timings``: the counts and ms given, per-token ms and per-second rates (0 where the count or
    the time is 0; the generation rate over ``predicted_n - 1`` steps)."""
    steps = max(predicted_n - 1, 0)
    return {"cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n and prompt_ms else 0.0,
            "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_n and prompt_ms else 0.0,
            "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / steps if steps and predicted_ms else 0.0,
            "predicted_per_second": 1e3 * steps / predicted_ms if steps and predicted_ms else 0.0}


def with_fields(frame: bytes, fields: dict) -> bytes:
    """``frame`` (``[event: NAME\\n]data: JSON\\n\\n``) with ``fields`` set in its JSON object; a frame whose data
    is not an object (``[DONE]``, a comment, a ping) unchanged."""
    at = frame.find(b"data: ")
    if at < 0 or frame[at + 6:at + 7] != b"{":
        return frame
    body = orjson.loads(frame[at + 6:])
    body.update(fields)
    return frame[:at + 6] + orjson.dumps(body) + b"\n\n"


class Telemetry:
    """One exchange's llama.cpp telemetry (``handles``: api.admission.RequestHandle, all of one HTTP request);
    ``clock``: monotonic ns. ``of`` returns None for a request that asked for neither."""

    def __init__(self, handles: list, per_token: bool, progress: bool, clock: Callable[[], int] = time.monotonic_ns):
        self.handles, self.per_token, self.progress, self.clock = handles, per_token, progress, clock
        self.started = False

    @classmethod
    def of(cls, handles: list, clock: Callable[[], int] = time.monotonic_ns) -> Telemetry | None:
        request = handles[0].request   # a GenerationRequest (an embedding's input has neither field)
        per_token = getattr(request, "timings_per_token", False)
        progress = getattr(request, "return_progress", False)   # used by streams only (Exchange.frames)
        return cls(handles, per_token, progress, clock) if per_token or progress else None

    def _first_token_ns(self) -> int:
        return min((h.first_token_ns for h in self.handles if h.first_token_ns), default=0)

    def _prompt_ms(self) -> float:
        seconds = [h.timings["prefill_s"] for h in self.handles if h.timings and "prefill_s" in h.timings]
        if seconds:
            return 1e3 * max(seconds)
        first = self._first_token_ns()
        admitted = min(h.admitted_ns for h in self.handles)
        return (first - admitted) / 1e6 if first else 0.0

    def timings(self) -> dict:
        """The request's ``timings`` now."""
        total, cached = prompt_counts(self.handles)
        first = self._first_token_ns()
        predicted = sum(h.completion_tokens for h in self.handles)
        predicted_ms = (self.clock() - first) / 1e6 if first and predicted else 0.0
        return timings(total - cached, self._prompt_ms(), predicted, predicted_ms, cached)

    def opening(self, progress_frames: Callable[[dict], list[bytes]]) -> list[bytes]:
        """Called before the renderer makes the frames of each text event (a stream numbers its events): the
        first time, the two ``prompt_progress`` chunks (made by the renderer's ``progress_frames(
        prompt_progress)``) when asked for; [] after."""
        if self.started or not self.progress:
            self.started = True
            return []
        self.started = True
        return self._progress(progress_frames)

    def decorate(self, frames: list[bytes]) -> list[bytes]:
        """A stream's frames of one text event, or its closing frames, with ``timings`` when asked for."""
        if not self.per_token:
            return frames
        fields = {"timings": self.timings()}
        return [with_fields(f, fields) for f in frames]

    def _progress(self, progress_frames: Callable[[dict], list[bytes]]) -> list[bytes]:
        total, cached = prompt_counts(self.handles)
        prompt_ms = self._prompt_ms()
        out = []
        for processed, ms in ((cached, 0.0), (total, prompt_ms)):
            frames = progress_frames({"total": total, "cache": cached, "processed": processed, "time_ms": ms})
            if self.per_token:
                fields = {"timings": timings(processed - cached, ms, 0, 0.0, cached)}
                frames = [with_fields(f, fields) for f in frames]
            out += frames
        return out
