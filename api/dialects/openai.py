"""OpenAI chat/completions (``POST /v1/chat/completions``, ``POST /v1/completions``): the dialect whose parser is
api/protocol.py's RequestParser, and its renderers (the streamed chunks and the full response).

=======================  =========================================================================
``OpenAIDialect``        a body -> one chat request, or a completions list's one request per prompt
``ChatStream``           choices' text -> ``chat.completion.chunk`` / ``text_completion`` SSE chunks, ``[DONE]``
``ChatAnswer``           choices' text -> the ``chat.completion`` / ``text_completion`` object
``chunk``, ``full_response``, ``usage``, ``chat_logprobs``, ``completion_logprobs``: the bodies
=======================  =========================================================================

A chat choice's reasoning and tool calls come out of its text by api.formats (ChatDeltas while streaming,
finish_choice for a full answer). Plain synchronous code, no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from api.formats import ChatDeltas, finish_choice, request_formats
from api.generation import prompt_counts
from api.protocol import GenerationRequest, error_body
from pdserve.errors import PdserveError


def _fingerprint() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"pdserve-{version('pdserve')}"
    except PackageNotFoundError:   # a checkout run without installing it
        return "pdserve-dev"


# OpenAI's ``system_fingerprint`` (the backend configuration an answer came from): the engine and its version
SYSTEM_FINGERPRINT = _fingerprint()


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI ``usage``; ``prompt_tokens_details.cached_tokens``: leading prompt tokens whose KV the prefill
    actor's prefix cache held (not recomputed)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _logprob_entry(tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    raw = tokenizer.token_bytes(token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


def chat_logprobs(tokenizer, tokens: list[tuple[int, list]]) -> dict[str, Any]:
    """OpenAI chat ``logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}``.

    ``tokens`` holds ``(token_id, [logprob, [[top_id, top_logprob], ...]])`` per generated token.
    """
    content = []
    for token_id, (logprob, top) in tokens:
        entry = _logprob_entry(tokenizer, token_id, logprob)
        entry["top_logprobs"] = [_logprob_entry(tokenizer, t, v) for t, v in top]
        content.append(entry)
    return {"content": content}


def completion_logprobs(tokenizer, tokens: list[tuple[int, list]], text_offset: int = 0) -> dict[str, Any]:
    """Legacy completions ``logprobs``: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` (an entry
    of ``tokens`` may be None: an echoed prompt's first token, given null log-probabilities), where
    ``text_offset`` counts characters from the start of the choice's text (``text_offset`` is where these tokens
    begin: the streamed text so far, or the echoed prompt's length)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in tokens:
        text = tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")
        out["tokens"].append(text)
        if entry is None:   # an echoed prompt's first token: nothing before it to score it
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            logprob, top = entry
            out["token_logprobs"].append(logprob)
            alternatives = {tokenizer.token_bytes(t).decode("utf-8", errors="replace"): v for t, v in top}
            alternatives.setdefault(text, logprob)   # the sampled token is always there (up to logprobs + 1)
            out["top_logprobs"].append(alternatives)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
    return out


@dataclass
class ChoiceResult:
    """One finished choice of a non-streamed response."""

    index: int
    text: str | None
    finish_reason: str | None
    logprobs: dict | None = None
    tool_calls: list[dict] | None = None   # chat with tools: OpenAI ``message.tool_calls`` entries
    reasoning: str | None = None           # chat with a reasoning parser: ``message.reasoning_content``


def full_response(req: GenerationRequest, choices: list[ChoiceResult], usage_body: dict) -> dict:
    """The non-streamed body: the choices in index order (``req``: the first prompt's request; its id, kind, model
    and creation time are the whole request's); ``usage_body``: :func:`usage` of :func:`prompt_counts`."""
    out = []
    for c in sorted(choices, key=lambda c: c.index):
        if req.kind == "chat":
            message = {"role": "assistant", "content": c.text}
            if c.reasoning is not None:
                message["reasoning_content"] = c.reasoning
            if c.tool_calls:
                message["tool_calls"] = c.tool_calls
            out.append({"index": c.index, "message": message, "logprobs": c.logprobs,
                        "finish_reason": c.finish_reason})
        else:
            out.append({"index": c.index, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish_reason})
    obj = "chat.completion" if req.kind == "chat" else "text_completion"
    return {"id": req.request_id, "object": obj, "created": req.created, "model": req.model,
            "system_fingerprint": SYSTEM_FINGERPRINT, "choices": out, "usage": usage_body}


def chunk(req: GenerationRequest, text: str | None, finish_reason: str | None, *, first: bool = False,
          usage_body: dict | None = None, index: int = 0, logprobs: dict | None = None,
          tool_calls: list[dict] | None = None, reasoning: str | None = None) -> dict:
    """One SSE chunk of choice ``index``. ``usage_body`` set = the final usage-only chunk (choices empty).
    ``tool_calls``: chat ``delta.tool_calls`` entries (the first chunk then has ``content: null``); ``reasoning``:
    chat ``delta.reasoning_content`` (vLLM's and SGLang's field)."""
    if req.kind == "chat":
        obj = "chat.completion.chunk"
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if text or (first and not tool_calls and not reasoning):
            delta["content"] = text or ""
        elif first:
            delta["content"] = None
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choices = [] if usage_body else [{"index": index, "delta": delta, "logprobs": logprobs,
                                          "finish_reason": finish_reason}]
    else:
        obj = "text_completion"
        choices = [] if usage_body else [{"index": index, "text": text or "", "logprobs": logprobs,
                                          "finish_reason": finish_reason}]
    body = {"id": req.request_id, "object": obj, "created": req.created, "model": req.model,
            "system_fingerprint": SYSTEM_FINGERPRINT, "choices": choices}
    if usage_body is not None:
        body["usage"] = usage_body
    return body


def request_usage(handles: list) -> dict:
    """OpenAI ``usage`` of one HTTP request's sequences: each prompt once, every choice's completion tokens."""
    prompt_tokens, cached_tokens = prompt_counts(handles)
    return usage(prompt_tokens, sum(h.completion_tokens for h in handles), cached_tokens)


def format_logprobs(tokenizer, choice, handles: list, tokens: list, text_offset: int,
                    with_prompt: bool = False) -> dict | None:
    """``choice``'s logprobs body; ``with_prompt`` (echo + logprobs) puts its prompt's tokens first, from
    offset 0 (the prefill actor sent their log-probabilities to one of the handles of that prompt's choices,
    among ``handles``)."""
    req = choice.request
    if req.sampling.logprobs is None:
        return None
    if req.kind == "chat":
        return chat_logprobs(tokenizer, tokens)
    if with_prompt and req.sampling.prompt_logprobs is not None:
        entries = next((h.prompt_logprobs for h in handles if h.request is req and h.prompt_logprobs), [])
        tokens = list(zip(req.prompt_ids, entries)) + tokens
    return completion_logprobs(tokenizer, tokens, text_offset)


class OpenAIDialect:
    """``kind`` "chat" or "completion"; ``request_id``: the client's X-Request-Id (the parser checks it)."""

    error_body = staticmethod(error_body)

    def __init__(self, parser, tokenizer, kind: str, request_id: str | None):
        self.parser, self.tokenizer, self.kind, self.request_id = parser, tokenizer, kind, request_id

    def build(self, body: Any) -> list[GenerationRequest]:
        if self.kind == "chat":
            return [self.parser.chat(body, self.request_id)]
        return self.parser.completions(body, self.request_id)

    def renderer(self, handles: list):
        kind = ChatStream if handles[0].request.stream else ChatAnswer
        return kind(self.tokenizer, handles)


class ChatAnswer:
    """The choices' text collected into the full response (reasoning and tool calls parsed out at the end)."""

    stream = False

    def __init__(self, tokenizer, handles: list):
        self.tokenizer, self.handles = tokenizer, handles
        self.reasons: dict[int, str | None] = {}
        self.texts: dict[int, list[str]] = {h.index: [h.request.echo_text or ""] for h in handles}
        self.tokens: dict[int, list] = {h.index: [] for h in handles}

    def start(self) -> list[bytes]:
        return []

    def event(self, index: int, text: str, reason: str | None, logprobs: list) -> list[bytes]:
        self.texts[index].append(text)
        self.tokens[index].extend(logprobs)
        if reason is not None:
            self.reasons[index] = reason
        return []

    def finish(self) -> dict:
        req, choice_of = self.handles[0].request, {h.index: h for h in self.handles}
        results = [ChoiceResult(i, "".join(self.texts[i]), self.reasons.get(i),
                                format_logprobs(self.tokenizer, choice_of[i], self.handles, self.tokens[i], 0, True))
                   for i in self.texts]
        formats = request_formats(req)
        if formats is not None:   # reasoning, then the tool calls (or a named function's arguments)
            for c in results:
                finish_choice(formats, req.tools, c)
                self.reasons[c.index] = c.finish_reason
        return full_response(req, results, request_usage(self.handles))

    def failed(self, exc: PdserveError) -> list[bytes]:
        return [data(error_body(exc))]

    def progress(self, prompt_progress: dict) -> list[bytes]:
        return []


def data(body: dict) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


class ChatStream(ChatAnswer):
    """The choices' text as SSE chunks, each choice's first with its role (and its echo), then the usage chunk
    (``stream_options.include_usage``) and ``data: [DONE]``; an engine error is an error chunk, then [DONE]."""

    stream = True

    def __init__(self, tokenizer, handles: list):
        super().__init__(tokenizer, handles)
        req = handles[0].request
        self.choice_of = {h.index: h for h in handles}
        self.first = set(self.choice_of)   # choices whose first chunk is still to come
        self.offsets = {h.index: 0 for h in handles}   # characters of the choice's text sent so far (echo included)
        formats = request_formats(req)   # reasoning and tool calls parsed out of the text (api/formats.py)
        self.tools = {h.index: ChatDeltas(formats, req.tools) for h in handles} if formats is not None else {}

    def event(self, index: int, text: str, reason: str | None, logprobs: list) -> list[bytes]:
        choice = self.choice_of[index]
        if index in self.first and choice.request.echo_text:
            text = choice.request.echo_text + text
        pieces: list = [(text, None, None)]
        if self.tools:   # text becomes content, delta.tool_calls and delta.reasoning_content pieces
            pieces = self.tools[index].push(text, reason) or [("", None, None)]
            reason = self.tools[index].finish_reason(reason)
        if reason is not None:
            self.reasons[index] = reason
        frames = []
        for k, (piece, calls, thought) in enumerate(pieces):
            piece_reason = reason if k == len(pieces) - 1 else None
            piece_logprobs = logprobs if k == 0 else []
            first = index in self.first
            if piece or calls or thought or piece_reason is not None or first or piece_logprobs:
                frames.append(data(chunk(choice.request, piece, piece_reason, first=first, index=index,
                                         logprobs=format_logprobs(self.tokenizer, choice, self.handles,
                                                                  piece_logprobs, self.offsets[index], first),
                                         tool_calls=calls, reasoning=thought)))
                self.offsets[index] += len(piece or "")
                self.first.discard(index)
        return frames

    def finish(self) -> list[bytes]:
        req = self.handles[0].request
        usage_chunk = [data(chunk(req, None, None, usage_body=request_usage(self.handles)))] if req.include_usage \
            else []
        return usage_chunk + [DONE]

    def failed(self, exc: PdserveError) -> list[bytes]:
        return [data(error_body(exc)), DONE]

    def progress(self, prompt_progress: dict) -> list[bytes]:
        """llama.cpp's progress chunk: no choices, ``prompt_progress`` (api/llama_timings.py)."""
        req = self.handles[0].request
        obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
        return [data({"id": req.request_id, "object": obj, "created": req.created, "model": req.model,
                      "system_fingerprint": SYSTEM_FINGERPRINT, "choices": [], "prompt_progress": prompt_progress})]


DONE = b"data: [DONE]\n\n"
