"""Embeddings from the served decoder model: POST /v1/embeddings and /embeddings (OpenAI's shape) and llama.cpp's
POST /embedding (its own shape, ``content`` or ``input``).

=======================  =========================================================================
``EMBEDDINGS``           the fields /v1/embeddings takes (``LLAMA_EMBEDDING``: /embedding's)
``EmbeddingInput``       one input: its token ids and index (the ``request`` of its RequestHandle)
``EmbeddingsRequest``    a validated body: its inputs, encoding format, model name
``parse_embeddings``     body -> EmbeddingsRequest; every bad input a 400 naming the field
``EmbeddingsExchange``   read, admit, wait (watching for the client leaving), answer, and always release
``answer_body``          the inputs' vectors -> OpenAI's JSON or llama.cpp's
=======================  =========================================================================

Each input is one state-table row and one EmbedRequest to a prefill actor (api/admission.py
``admit_embeddings``), which packs it into its forward passes beside the prompts it prefills and answers with the
pooled, L2-normalised final hidden state (actors/model_runner.py ``pooled_embedding``; the config's ``pooling``,
``last`` by default); the row goes QUEUED -> PREFILLING -> FINISHED under the same deadlines, gauges and admission
limits as a prompt's. Not offered: ``dimensions`` (a 400 naming it; the vectors have the model's hidden size),
llama.cpp's per-token vectors (its pooling ``none``), and embeddings through `pdserve router`.
"""
from __future__ import annotations

import asyncio
import base64
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from api import fields
from api.body import read_and_build
from api.exchange import JSONResponse, error_response, record_api
from api.http_edges import note_engine_requests
from api.protocol import RequestParser, check_request_id
from ipc.recorder import ClosedBy, EventKind
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


def _input_list(value: Any, param: str) -> list[str | list]:
    """The shapes OpenAI takes: a string, a list of token ids, a list of strings, a list of token-id lists. Raises
    InvalidRequestError naming ``param`` for an empty list, a mix of strings and token lists, any other type."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(_is_token(t) for t in value):
            return [value]
        if all(isinstance(v, str) for v in value) or all(isinstance(v, list) for v in value):
            return list(value)
    if value == []:
        raise InvalidRequestError(f"'{param}' is an empty list", param=param)
    raise InvalidRequestError(f"'{param}' must be a non-empty string, a non-empty list of token ids, or a list of "
                              "such strings or of such lists (not mixed)", param=param)


def _token_ids(parser: RequestParser, item: str | list, param: str) -> list[int]:
    """One input as token ids: at least one, at most the context (``max_model_len``), each in the vocabulary.
    Raises InvalidRequestError naming ``param``."""
    limit = parser.max_context_tokens
    if isinstance(item, str):
        if not item:
            raise InvalidRequestError(f"'{param}' is an empty string", param=param)
        if len(item) > parser.max_token_chars * limit:   # before the tokenizer: a 1 MB input costs microseconds
            raise InvalidRequestError(f"'{param}' has {len(item)} characters, more than the model's context "
                                      f"({limit} tokens) can hold", param=param, code="context_length_exceeded")
        try:
            ids = parser.tokenizer.encode(item)
        except (TypeError, ValueError) as exc:   # e.g. a lone surrogate that slipped past the JSON parser
            raise InvalidRequestError(f"'{param}' cannot be tokenized: {exc}", param=param) from None
        if not ids:
            raise InvalidRequestError(f"'{param}' tokenizes to no tokens", param=param)
    else:
        ids = item
        if not ids or not all(_is_token(t) for t in ids):
            raise InvalidRequestError(f"'{param}': a token-id input must be a non-empty list of integers", param=param)
        if not all(0 <= t < parser.tokenizer.vocab_size for t in ids):
            raise InvalidRequestError(f"'{param}': token ids must be in [0, {parser.tokenizer.vocab_size})",
                                      param=param)
    if len(ids) > limit:
        raise InvalidRequestError(f"This model's maximum context length is {limit} tokens; '{param}' has "
                                  f"{len(ids)}", param=param, code="context_length_exceeded")
    return list(ids)


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


class EmbeddingsExchange:
    """One embeddings HTTP request, as api/exchange.py's Exchange is one generation: ``await
    EmbeddingsExchange(...).run()`` is the route's answer. ``run`` reads, validates and admits (a refusal is
    answered there, nothing held); the admitted exchange is the ASGI response: it waits for every input's vector
    while watching for ``http.disconnect`` (499 and the rows aborted when it comes first), answers, and in one
    ``finally`` records the last byte and the close, counts each input (``finish_reason`` ``embedding``, or abort /
    error) and releases every row."""

    def __init__(self, client, parser: RequestParser, metrics, request: Request, llama: bool = False):
        self.client, self.parser, self.metrics, self.request, self.llama = client, parser, metrics, request, llama
        self.handles: list = []
        self.parsed: EmbeddingsRequest | None = None
        self.status = 499          # until the answer is out: 200 or the error's status; 500 for a bug
        self.sent_all = False
        self.headers_ns = self.body_bytes = 0

    async def run(self) -> Response | EmbeddingsExchange:
        self.headers_ns = time.monotonic_ns()
        if not hasattr(self.client, "submit_embeddings"):   # `pdserve router`: nodes are not asked for them
            return error_response(InvalidRequestError("`pdserve router` does not route embeddings; send them to a "
                                                      "node's API (pdserve serve)", param="input"))
        header_id = self.request.headers.get("x-request-id")
        try:
            self.parsed, self.body_bytes = await read_and_build(
                self.request, lambda body: parse_embeddings(self.parser, body, header_id, self.llama),
                self.client.config.body_read_timeout_s)
            self.handles = self.client.submit_embeddings(self.parsed.inputs, self.client.config.pooling)
        except PdserveError as exc:
            return error_response(exc, self.parsed.request_id if self.parsed else None)
        except ClientDisconnect:   # gone before its body was complete: nobody to answer, nothing admitted
            return Response(status_code=499)
        return self

    async def __call__(self, scope: dict, receive, send) -> None:
        try:
            note_engine_requests(scope, self.handles)   # the connection ledger (api/http_edges.py)
            for _ in self.handles:
                self.metrics.on_admitted()
            record_api(EventKind.HTTP_HEADERS, self.handles, t_ns=self.headers_ns, a=self.body_bytes)
            record_api(EventKind.ADMITTED, self.handles)
            response = await self.collect(receive)
            record_api(EventKind.FIRST_BYTE, self.handles)
            await response(scope, receive, send)
            self.sent_all = self.status != 499
        except ClientDisconnect:
            raise
        except Exception:
            self.status = 500   # a bug (logged by Starlette's error handler): not the client's doing
            raise
        finally:
            self.release()

    async def vector(self, handle) -> str:
        """The input's base64 vector: its one event. Raises the engine's PdserveError (a deadline: 504; its actor
        died: 503 ...)."""
        event = await self.client.next_event(handle)
        if event[0] == "error":
            raise event[1]
        if handle.on_text_end is not None:   # the ledger now waits on the inputs still running
            handle.on_text_end(handle)
        return event[1]

    async def collect(self, receive) -> Response:
        rid = self.parsed.request_id

        async def gone() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        work = asyncio.ensure_future(asyncio.gather(*(self.vector(h) for h in self.handles)))
        watch = asyncio.ensure_future(gone())
        try:
            done, _ = await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
            if work not in done:
                return Response(status_code=499)
            try:
                vectors = work.result()
            except PdserveError as exc:
                self.status = exc.http_status
                return error_response(exc, rid)
            self.status = 200
            return JSONResponse(answer_body(self.parsed, vectors), headers={"x-request-id": rid})
        finally:
            for task in (work, watch):
                task.cancel()

    def release(self) -> None:
        """Its last byte and close in the recorder, each input counted once, every row released (the live ones
        aborted: the prefill actor drops them from its next forward pass and frees their blocks)."""
        handles, status = self.handles, self.status
        try:
            if self.sent_all:
                record_api(EventKind.LAST_BYTE, handles, a=status)
            record_api(EventKind.CLOSED, handles, aux=ClosedBy.CLIENT if status == 499 else ClosedBy.SERVER, a=status)
            reason = "embedding" if status == 200 else "abort" if status == 499 else "error"
            for handle in handles:
                self.metrics.on_finished(handle, reason, status)
        finally:
            self.client.finish_all(handles)
