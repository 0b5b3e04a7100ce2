"""Token events -> text: one sequence's detokenized text with stop strings cut, the ``n`` choices merged.

=======================  =========================================================================
``StopStringMatcher``    holds back text that could start a stop string; the stop text is never returned
``generate_text``        one handle's ``(text, finish_reason, logprobs)`` items from the engine's token events
``merged_choices``       the ``n`` choices' items in arrival order, each with its choice index
``prompt_counts``        one HTTP request's prompt and cached prompt tokens (each prompt once)
=======================  =========================================================================

Every dialect's renderer gets its text from ``merged_choices`` (api/exchange.py drives it).
"""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from api.admission import RequestHandle
from api.formats import marker_texts, request_formats
from gpu.tokenizer import IncrementalDetokenizer
from pdserve.errors import PdserveError


class StopStringMatcher:
    """Holds back streamed text that could be the start of a stop string; the stop text is never returned."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""
        self.matched: str | None = None   # the stop string that ended the text

    def push(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, matched)."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            first = min(hits)
            self.matched = next(s for s in self.stops if self.pending.find(s) == first)
            out, self.pending = self.pending[:first], ""
            return out, True
        cut = max(len(self.pending) - self.hold, 0)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


async def generate_text(client, tokenizer, handle: RequestHandle,
                        metrics=None) -> AsyncIterator[tuple[str, str | None, list]]:
    """Yield ``(text_delta, finish_reason, logprobs)`` for one sequence; the last item has a finish reason (an
    embedding's one item: its base64 vector, ``"embedding"``).

    ``logprobs`` lists ``(token_id, [logprob, [[top_id, top_logprob], ...]])`` for the tokens received since the
    previous item (empty unless the request asked for log-probabilities; text held back by the stop-string
    matcher carries its tokens' logprobs to the next item).

    Raises:
        PdserveError: the engine or the monitor reported an error, or the deadline passed.
    """
    request = handle.request
    if getattr(request, "embedding", False):   # api/embeddings.py: one event, its vector (base64) as the text
        event = await client.next_event(handle)
        if event[0] == "error":
            raise event[1]
        yield event[1], "embedding", []
        return
    # a chat choice's parser markers stay in its text when they are special tokens (the rest are skipped)
    markers = marker_texts(request_formats(request), tools=getattr(request, "tools", None) is not None)
    detok = IncrementalDetokenizer(tokenizer, keep=tokenizer.special_ids_of(markers) if markers else frozenset())
    stops = StopStringMatcher(handle.request.stop)
    handle.completion_tokens = 0
    last_ns = 0
    logprobs: list = []
    while True:
        event = await client.next_event(handle)
        if event[0] == "error":
            raise event[1]
        _, token, reason, token_logprobs = event
        if request.echo_only:   # max_tokens 1 ran for the prompt's scores: its token is not part of the answer
            if reason is None:
                continue
            yield "", "length", []
            return
        if token_logprobs is not None:
            logprobs.append((token, token_logprobs))
        handle.completion_tokens += 1
        now_ns = time.monotonic_ns()
        if handle.first_token_ns == 0:
            handle.first_token_ns = now_ns
        elif metrics is not None:
            metrics.on_token((now_ns - last_ns) / 1e9)
        last_ns = now_ns
        text = detok.push(token)
        if reason is not None:
            # held-back bytes at the end (the output was cut inside a multi-byte character, e.g. at max_tokens)
            # decode to U+FFFD; they are not a character, so they are dropped rather than sent broken
            text += detok.flush().rstrip("\ufffd")
        out, matched = stops.push(text)
        if matched:
            handle.stop_string = stops.matched
            client.stop_generation(handle)
            yield out, "stop", logprobs
            return
        if reason is not None:
            yield out + stops.flush(), reason, logprobs
            return
        if out:
            yield out, None, logprobs
            logprobs = []


async def merged_choices(client, tokenizer, handles: list[RequestHandle],
                         metrics=None) -> AsyncIterator[tuple[int, str, str | None, list]]:
    """The ``n`` choices' :func:`generate_text` items merged in arrival order, as ``(index, text, finish_reason,
    logprobs)``. The first error of any choice is raised (the caller finishes every choice)."""
    if len(handles) == 1:
        async for item in generate_text(client, tokenizer, handles[0], metrics):
            yield (handles[0].index, *item)
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(handle: RequestHandle) -> None:
        try:
            async for item in generate_text(client, tokenizer, handle, metrics):
                queue.put_nowait((handle.index, item))
        except PdserveError as exc:
            queue.put_nowait((handle.index, exc))
        finally:
            if handle.on_text_end is not None:
                handle.on_text_end(handle)
            queue.put_nowait((handle.index, done))

    tasks = [asyncio.ensure_future(pump(h)) for h in handles]
    try:
        remaining = len(handles)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, PdserveError):
                raise item
            else:
                yield (index, *item)
    finally:
        for task in tasks:
            task.cancel()



def prompt_counts(handles) -> tuple[int, int]:
    """``(prompt tokens, cached prompt tokens)`` of one HTTP request's sequences (api.admission.RequestHandle: its
    ``request`` and ``timings``): each prompt once, as its ``n`` choices share its prefill, with the leading tokens
    the prefix cache held for it (the most any of its choices' first-token timings report)."""
    prompts: dict[int, tuple[int, int]] = {}
    for h in handles:
        tokens, cached = prompts.get(id(h.request), (len(h.request.prompt_ids), 0))
        prompts[id(h.request)] = (tokens, max(cached, int((h.timings or {}).get("cached_tokens", 0))))
    return sum(t for t, _ in prompts.values()), sum(c for _, c in prompts.values())
