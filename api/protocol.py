"""OpenAI request parsing and validation, and response bodies. Plain synchronous code, no I/O.

Every invalid input raises InvalidRequestError naming the parameter; the app turns it into
``{"error": {"message", "type", "param", "code"}}`` with status 400. Nothing invalid reaches an actor.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from actors.messages import Sampling
from pdserve.errors import InvalidRequestError, ModelNotFoundError, PdserveError

MAX_STOP_STRINGS = 16
MAX_SEED = 2**63 - 1
MAX_REQUEST_ID_CHARS = 40  # the state table's request_id field


def check_request_id(value: str | None, default: str) -> str:
    """The client's ``X-Request-Id`` (printable ASCII, at most 40 chars) or ``default``.

    Raises:
        InvalidRequestError: the header is empty, too long or not printable ASCII.
    """
    if value is None:
        return default
    if not value or len(value) > MAX_REQUEST_ID_CHARS or not (value.isascii() and value.isprintable()):
        raise InvalidRequestError(f"X-Request-Id must be 1-{MAX_REQUEST_ID_CHARS} printable ASCII characters",
                                  param="X-Request-Id")
    return value


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
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"'{name}' must be an integer, got {type(value).__name__}", param=name)
    if not (low <= value <= high):
        raise InvalidRequestError(f"'{name}' must be between {low} and {high}, got {value}", param=name)
    return value


def _stop_strings(body: dict) -> tuple[str, ...]:
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
    return tuple(stop)


def _message_text(message: Any, index: int) -> tuple[str, str]:
    if not isinstance(message, dict):
        raise InvalidRequestError(f"messages[{index}] must be an object", param="messages")
    role = message.get("role")
    if role not in ("system", "user", "assistant", "developer"):
        raise InvalidRequestError(f"messages[{index}].role must be system, user or assistant, got {role!r}",
                                  param="messages")
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
    return ("system" if role == "developer" else role), content


class RequestParser:
    """Validates request bodies against the served model, its tokenizer and the engine's limits.

    Args:
        tokenizer: gpu.tokenizer.Tokenizer of the served model.
        served_model_name: the only model name accepted in ``model``.
        max_model_len: longest prompt + output (tokens) the engine's KV pools can hold.
        default_max_tokens: used when the body gives neither max_tokens nor max_completion_tokens.
    """

    def __init__(self, tokenizer, served_model_name: str, max_model_len: int, default_max_tokens: int):
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens

    def _model(self, body: dict) -> str:
        model = body.get("model", self.served_model_name)
        if model is None:
            model = self.served_model_name
        if not isinstance(model, str):
            raise InvalidRequestError("'model' must be a string", param="model")
        if model != self.served_model_name:
            raise ModelNotFoundError(f"The model '{model}' does not exist; this server serves "
                                     f"'{self.served_model_name}'", param="model", code="model_not_found")
        return model

    def _sampling(self, body: dict, prompt_len: int) -> Sampling:
        if prompt_len == 0:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        room = self.max_model_len - prompt_len
        if room <= 0:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{prompt_len} tokens, which leaves no room for output", param="prompt",
                code="context_length_exceeded")
        max_tokens = _integer(body, "max_completion_tokens", None, 1, 2**31 - 1)
        if max_tokens is None:
            max_tokens = _integer(body, "max_tokens", None, 1, 2**31 - 1)
        if max_tokens is None:
            max_tokens = min(self.default_max_tokens, room)
        if prompt_len + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"({prompt_len}) plus max_tokens ({max_tokens}) exceeds it", param="max_tokens",
                code="context_length_exceeded")
        temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
        if top_p == 0.0:
            raise InvalidRequestError("'top_p' must be > 0", param="top_p")
        top_k = _integer(body, "top_k", -1, -1, 1 << 20)
        if top_k == 0:
            raise InvalidRequestError("'top_k' must be -1 (off) or >= 1", param="top_k")
        min_p = _number(body, "min_p", 0.0, 0.0, 1.0)
        seed = _integer(body, "seed", None, -MAX_SEED, MAX_SEED)
        n = _integer(body, "n", 1, 1, 1)
        del n  # n > 1 needs shared-prefill children (not built yet): rejected above with a clear 400
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise InvalidRequestError("'ignore_eos' must be a boolean", param="ignore_eos")
        return Sampling(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                        seed=None if seed is None else seed % (2**63), max_tokens=max_tokens,
                        ignore_eos=ignore_eos)

    def _common(self, body: Any) -> tuple[str, bool, bool]:
        if not isinstance(body, dict):
            raise InvalidRequestError("the request body must be a JSON object")
        model = self._model(body)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise InvalidRequestError("'stream' must be a boolean", param="stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise InvalidRequestError("'stream_options' must be an object", param="stream_options")
        return model, stream, bool(options.get("include_usage", False))

    def chat(self, body: Any, request_id: str | None = None) -> GenerationRequest:
        model, stream, include_usage = self._common(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("'messages' must be a non-empty list", param="messages")
        conversation = [dict(zip(("role", "content"), _message_text(m, i))) for i, m in enumerate(messages)]
        text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
        prompt_ids = self.tokenizer.encode(text)
        return GenerationRequest("chat", check_request_id(request_id, f"chatcmpl-{uuid.uuid4().hex[:24]}"), model, prompt_ids,
                                 self._sampling(body, len(prompt_ids)), _stop_strings(body), stream, include_usage)

    def completion(self, body: Any, request_id: str | None = None) -> GenerationRequest:
        model, stream, include_usage = self._common(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            if not all(0 <= t < self.tokenizer.vocab_size for t in prompt):
                raise InvalidRequestError(f"token ids in 'prompt' must be in [0, {self.tokenizer.vocab_size})",
                                          param="prompt")
            prompt_ids = list(prompt)
        else:
            raise InvalidRequestError("'prompt' must be a non-empty string, a list with one string, or a "
                                      "non-empty list of token ids", param="prompt")
        return GenerationRequest("completion", check_request_id(request_id, f"cmpl-{uuid.uuid4().hex[:24]}"), model, prompt_ids,
                                 self._sampling(body, len(prompt_ids)), _stop_strings(body), stream, include_usage)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def full_response(req: GenerationRequest, text: str, finish_reason: str | None, completion_tokens: int) -> dict:
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": req.request_id, "object": obj, "created": req.created, "model": req.model,
            "choices": [choice], "usage": usage(len(req.prompt_ids), completion_tokens)}


def chunk(req: GenerationRequest, text: str | None, finish_reason: str | None, *, first: bool = False,
          usage_body: dict | None = None) -> dict:
    """One SSE chunk. ``usage_body`` set = the final usage-only chunk (choices empty)."""
    if req.kind == "chat":
        obj = "chat.completion.chunk"
        choices = [] if usage_body else [{"index": 0, "delta": ({"role": "assistant", "content": text or ""}
                                                                if first else
                                                                ({"content": text} if text else {})),
                                          "logprobs": None, "finish_reason": finish_reason}]
    else:
        obj = "text_completion"
        choices = [] if usage_body else [{"index": 0, "text": text or "", "logprobs": None,
                                          "finish_reason": finish_reason}]
    body = {"id": req.request_id, "object": obj, "created": req.created, "model": req.model, "choices": choices}
    if usage_body is not None:
        body["usage"] = usage_body
    return body
