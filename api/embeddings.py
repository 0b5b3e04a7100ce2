"""Embeddings from the served decoder model: POST /v1/embeddings and /embeddings (OpenAI's shape) and llama.cpp's
POST /embedding (its own shape, ``content`` or ``input``).

=======================  =========================================================================
``EMBEDDINGS``           the fields /v1/embeddings takes (``LLAMA_EMBEDDING``: /embedding's)
``EmbeddingInput``       one input: its token ids and index (the ``request`` of its RequestHandle)
``EmbeddingsRequest``    a validated body: its inputs, encoding format, model name
``parse_embeddings``     body -> EmbeddingsRequest; every bad input a 400 naming the field
``answer_body``          the inputs' vectors -> OpenAI's JSON or llama.cpp's
``EmbeddingsDialect``    api/exchange.py's Dialect (``build``, ``renderer``, ``error_body``); its Renderer
=======================  =========================================================================

api/exchange.py's Exchange runs it as it runs a generation (admission all or none, the wait for the client leaving,
the recorder, the metrics, the release); api/generation.py hands it each input's one event.

Each input is one state-table row and one EmbedRequest to a prefill actor (api/admission.py
``admit_embeddings``), which packs it into its forward passes beside the prompts it prefills and answers with the
pooled, L2-normalised final hidden state (actors/model_runner.py ``pooled_embedding``; the config's ``pooling``,
``last`` by default); the row goes QUEUED -> PREFILLING -> FINISHED under the same deadlines, gauges and admission
limits as a prompt's. Not offered: ``dimensions`` (a 400 naming it; the vectors have the model's hidden size),
llama.cpp's per-token vectors (its pooling ``none``), and embeddings through `pdserve router`.
"""
from __future__ import annotations

import base64
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from api import fields
from api.protocol import RequestParser, check_request_id, error_body
from pdserve.errors import InvalidRequestError, PdserveError

EMBEDDINGS = fields.FieldTable("/v1/embeddings", frozenset({"input", "model", "encoding_format", "dimensions"}),
                               {"user": "an end-user id for OpenAI's abuse monitoring; nothing to do here"})
LLAMA_EMBEDDING = fields.FieldTable("/embedding", frozenset({"content", "input", "model"}))
ENCODING_FORMATS = ("float", "base64")


@dataclass(frozen=True)
class EmbeddingInput:
    """One input of an embeddings request, admitted as one row: ``first_index`` is its index in the answer."""

    request_id: str
    prompt_ids: list[int]
    first_index: int
    timeout_s: float | None = None   # the server's request_timeout_s (the API takes no per-request deadline here)
    n: int = 1
    embedding: bool = True           # what api/engine_client.py submit and api/generation.py tell it apart by


@dataclass(frozen=True)
class EmbeddingsRequest:
    request_id: str
    model: str
    inputs: list[EmbeddingInput]
    encoding_format: str = "float"   # "float" or "base64" (OpenAI's: little-endian float32 bytes)
    llama: bool = False              # llama.cpp's /embedding: its answer shape

    @property
    def prompt_tokens(self) -> int:
        return sum(len(i.prompt_ids) for i in self.inputs)


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _input_list(value: Any, param: str) -> list[Any]:
    """The inputs of ``value``: OpenAI's shapes (a string, a list of token ids, a list of strings, a list of
    token-id lists) and llama.cpp's (a list of token ids and strings: one input, the strings' tokens in place; a
    list mixing strings, token lists, such mixed lists and prompt objects ``{"prompt_string"}`` or ``{"content":
    [text parts]}``, each one input; a prompt object alone). Raises InvalidRequestError naming ``param`` for an
    empty list or any other type; each input is checked by ``_token_ids``."""
    if isinstance(value, (str, dict)):
        return [value]
    if isinstance(value, list) and value:
        if any(_is_token(t) for t in value):   # token ids, or llama.cpp's tokens and strings: one input
            return [value]
        return list(value)
    if value == []:
        raise InvalidRequestError(f"'{param}' is an empty list", param=param)
    raise InvalidRequestError(f"'{param}' must be a non-empty string, a non-empty list of token ids, or a list of "
                              "such strings, lists or prompt objects", param=param)


def _prompt_text(item: dict, param: str) -> str:
    """llama.cpp's prompt object -> its text: ``{"prompt_string": str}`` (without ``multimodal_data``) or
    ``{"content": [{"type": "text", "text": str}, ...]}`` (the parts' texts joined). Raises InvalidRequestError
    naming ``param``: another key, a part other than text (this model reads no images, audio or video)."""
    if set(item) == {"prompt_string"} and isinstance(item["prompt_string"], str):
        return item["prompt_string"]
    if set(item) == {"content"} and isinstance(item["content"], list) and item["content"]:
        texts = []
        for k, part in enumerate(item["content"]):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"'{param}.content[{k}]' must be a text part ({{\"type\": \"text\", "
                                          f"\"text\": ...}}); got type {str(kind)[:40]!r}: this model reads text "
                                          "only", param=param)
            texts.append(part["text"])
        return "".join(texts)
    if "multimodal_data" in item:
        raise InvalidRequestError(f"'{param}.multimodal_data' is not supported: this model reads text only",
                                  param=param)
    raise InvalidRequestError(f"'{param}': a prompt object must be {{\"prompt_string\": text}} or {{\"content\": "
                              "[text parts]}", param=param)


def _encode(parser: RequestParser, text: str, param: str) -> list[int]:
    if len(text) > parser.max_token_chars * parser.max_context_tokens:   # before the tokenizer: microseconds
        raise InvalidRequestError(f"'{param}' has {len(text)} characters, too large for the model's context "
                                  f"({parser.max_context_tokens} tokens)", param=param,
                                  code="context_length_exceeded")
    try:
        return list(parser.tokenizer.encode(text))
    except (TypeError, ValueError) as exc:   # e.g. a lone surrogate that slipped past the JSON parser
        raise InvalidRequestError(f"'{param}' cannot be tokenized: {exc}", param=param) from None


def _token_ids(parser: RequestParser, item: Any, param: str) -> list[int]:
    """One input as token ids: at least one, at most the context (``max_model_len``), each in the vocabulary.
    Raises InvalidRequestError naming ``param``."""
    limit = parser.max_context_tokens
    if isinstance(item, dict):
        item = _prompt_text(item, param)
    if isinstance(item, str):
        if not item:
            raise InvalidRequestError(f"'{param}' is an empty string", param=param)
        ids = _encode(parser, item, param)
        if not ids:
            raise InvalidRequestError(f"'{param}' tokenizes to no tokens", param=param)
    elif isinstance(item, list) and item and all(_is_token(t) or isinstance(t, str) for t in item):
        ids = [t for piece in item for t in ([piece] if _is_token(piece) else _encode(parser, piece, param))]
        if not all(0 <= t < parser.tokenizer.vocab_size for t in ids):
            raise InvalidRequestError(f"'{param}': token ids must be in [0, {parser.tokenizer.vocab_size})",
                                      param=param)
    else:
        raise InvalidRequestError(f"'{param}' must be a non-empty string, a non-empty list of token ids (and "
                                  "strings), or a prompt object", param=param)
    if not ids:
        raise InvalidRequestError(f"'{param}' tokenizes to no tokens", param=param)
    if len(ids) > limit:
        raise InvalidRequestError(f"'{param}' has {len(ids)} tokens, too large for this model's maximum context "
                                  f"length of {limit} tokens", param=param, code="context_length_exceeded")
    return ids


def parse_embeddings(parser: RequestParser, body: Any, request_id: str | None = None,
                     llama: bool = False) -> EmbeddingsRequest:
    """Validate an embeddings body (``llama``: llama.cpp's /embedding, which takes ``content`` or ``input`` and
    answers floats). Raises InvalidRequestError (400, naming the field) or ModelNotFoundError (404)."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    (LLAMA_EMBEDDING if llama else EMBEDDINGS).check(body)
    model = parser._model(body)
    param = "content" if llama and "content" in body else "input"
    if body.get(param) is None:
        raise InvalidRequestError(f"'{param}' is required: the text (or token ids) to embed", param=param)
    encoding = body.get("encoding_format")
    if encoding is None:
        encoding = "float"
    if encoding not in ENCODING_FORMATS:
        raise InvalidRequestError(f"'encoding_format' must be one of {', '.join(ENCODING_FORMATS)}, got "
                                  f"{str(encoding)[:40]!r}", param="encoding_format")
    if body.get("dimensions") is not None:
        raise InvalidRequestError("'dimensions' is not supported: the embeddings of this decoder model have its "
                                  "hidden size (no shortened vectors); remove it", param="dimensions")
    items = _input_list(body[param], param)
    if len(items) > parser.max_sequences:
        raise InvalidRequestError(f"'{param}' lists {len(items)} inputs, more than this server admits at once "
                                  f"(max_queued_requests={parser.max_sequences}); send at most "
                                  f"{parser.max_sequences} per request", param=param)
    rid = check_request_id(request_id, f"embd-{uuid.uuid4().hex[:24]}")
    inputs = [EmbeddingInput(rid, _token_ids(parser, item, param if len(items) == 1 else f"{param}[{k}]"), k)
              for k, item in enumerate(items)]
    return EmbeddingsRequest(rid, model, inputs, encoding, llama)


def floats(data: str) -> list[float]:
    """actors.messages.Embedding's base64 -> the float32 values as Python floats (exact)."""
    return np.frombuffer(base64.b64decode(data), dtype="<f4").tolist()


def answer_body(request: EmbeddingsRequest, vectors: list[str]) -> Any:
    """The answer from each input's base64 vector, in input order: OpenAI's ``{"object": "list", "data": [{"object":
    "embedding", "index", "embedding"}], "model", "usage"}`` (``embedding`` floats, or the base64 string itself for
    ``encoding_format`` base64), or llama.cpp's ``[{"index", "embedding": [[floats]]}]`` (one pooled vector)."""
    if request.llama:
        return [{"index": i, "embedding": [floats(v)]} for i, v in enumerate(vectors)]
    data = [{"object": "embedding", "index": i, "embedding": v if request.encoding_format == "base64" else floats(v)}
            for i, v in enumerate(vectors)]
    tokens = request.prompt_tokens
    return {"object": "list", "data": data, "model": request.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


class EmbeddingsRenderer:
    """api/exchange.py's Renderer of an embeddings answer: each input's one item (its base64 vector as the text,
    finish reason ``embedding``) kept, the whole answer (``answer_body``) at the end; never streamed."""

    stream = False

    def __init__(self, request: EmbeddingsRequest):
        self.request = request
        self.vectors: dict[int, str] = {}
        self.reasons: dict[int, str | None] = {}

    def start(self) -> list[bytes]:
        return []

    def event(self, index: int, text: str, reason: str | None, logprobs: list) -> list[bytes]:
        self.vectors[index], self.reasons[index] = text, reason
        return []

    def finish(self) -> Any:
        return answer_body(self.request, [self.vectors[i] for i in range(len(self.request.inputs))])

    def failed(self, exc: PdserveError) -> list[bytes]:   # never streamed: the error is a JSON answer
        return []

    def progress(self, prompt_progress: dict) -> list[bytes]:   # never streamed
        return []


class EmbeddingsDialect:
    """api/exchange.py's Dialect of POST /v1/embeddings (``llama``: llama.cpp's /embedding): ``build`` validates
    the body into one EmbeddingInput per input, which the Exchange admits all or none (api/engine_client.py
    ``submit`` -> ``Admission.admit_embedding``); ``serves`` False (`pdserve router`, whose nodes are not asked
    for embeddings) refuses every body."""

    def __init__(self, parser: RequestParser, request_id: str | None, llama: bool = False, serves: bool = True):
        self.parser, self.request_id, self.llama, self.serves = parser, request_id, llama, serves
        self.parsed: EmbeddingsRequest | None = None

    def build(self, body: Any) -> list[EmbeddingInput]:
        if not self.serves:
            raise InvalidRequestError("`pdserve router` does not route embeddings; send them to a node's API "
                                      "(pdserve serve)", param="input")
        self.parsed = parse_embeddings(self.parser, body, self.request_id, self.llama)
        return self.parsed.inputs

    def renderer(self, handles: list) -> EmbeddingsRenderer:
        return EmbeddingsRenderer(self.parsed)

    def error_body(self, error: PdserveError) -> dict:
        return error_body(error)
