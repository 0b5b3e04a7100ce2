"""The request body: read within limits, decoded by its Content-Encoding, parsed as JSON, and built into a
dialect's requests (off the event loop when large).

=======================  =========================================================================
``read_body``            the bytes, at most MAX_BODY_BYTES, each piece within the read timeout (408, 413)
``decode_body``          Content-Encoding gzip / deflate / identity, the limit on the decoded size (413, 415)
``read_decoded_body``    both
``parse_json``           orjson: bad syntax, invalid UTF-8 and lone surrogates are a 400
``built``                ``build(parsed JSON)`` with every unforeseen error a 400 and a log line
``read_and_build``       all of the above; a body past INLINE_PARSE_BYTES is parsed in a worker thread
=======================  =========================================================================
"""
from __future__ import annotations

import asyncio
import logging
import zlib
from typing import Any, Callable

import orjson
from starlette.requests import ClientDisconnect, Request

from pdserve.errors import InvalidRequestError, PdserveError

log = logging.getLogger("pdserve.api")

MAX_BODY_BYTES = 4 * 1024 * 1024   # larger request bodies get a 413 (checked on Content-Length and on the bytes read)
MAX_DRAIN_BYTES = 64 * 1024 * 1024   # a refused body up to this size is read to its end before the 413 (_drain)
INLINE_PARSE_BYTES = 64 * 1024     # larger bodies are parsed and tokenized in a worker thread
MAX_JSON_DEPTH = 128               # arrays and objects nested deeper are a 400 (orjson writes at most 255 levels)


class PayloadTooLargeError(InvalidRequestError):
    http_status = 413


class BodyReadTimeoutError(InvalidRequestError):
    http_status = 408
    error_type = "timeout_error"


class UnsupportedEncodingError(InvalidRequestError):
    http_status = 415


async def read_body(request: Request, limit: int | None = None, timeout_s: float = 30.0) -> bytes:
    """The request body, never more than ``limit`` (default MAX_BODY_BYTES) bytes held in memory, each piece
    within ``timeout_s`` seconds of the previous one.

    Raises:
        PayloadTooLargeError (413): Content-Length or the bytes actually received exceed the limit.
        InvalidRequestError (400): Content-Length is not a number, or the body is empty.
        BodyReadTimeoutError (408): the client stopped sending in the middle of the body (slowloris).
        starlette.requests.ClientDisconnect: the client went away before the body was complete.
    """
    limit = MAX_BODY_BYTES if limit is None else limit
    declared = request.headers.get("content-length")
    pieces = request.stream().__aiter__()
    if declared is not None:
        if not declared.strip().isdigit():
            raise InvalidRequestError(f"Content-Length {declared!r} is not a number", param="Content-Length")
        if int(declared) > limit:
            await _drain(pieces, int(declared), timeout_s)
            raise PayloadTooLargeError(f"the request body has {int(declared)} bytes; the limit is {limit} "
                                       "(MAX_BODY_BYTES)")
    parts, size = [], 0
    while True:
        try:
            part = await asyncio.wait_for(pieces.__anext__(), timeout_s)
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise BodyReadTimeoutError(f"the request body stopped arriving: no bytes for {timeout_s:g} s after "
                                       f"{size} bytes (body_read_timeout_s)") from None
        size += len(part)
        if size > limit:
            await _drain(pieces, MAX_DRAIN_BYTES, timeout_s)
            raise PayloadTooLargeError(f"the request body is over the limit of {limit} bytes (MAX_BODY_BYTES)")
        parts.append(part)
    if size == 0:
        raise InvalidRequestError("the request body is empty; send a JSON object")
    return b"".join(parts)


async def _drain(pieces, declared_bytes: int, timeout_s: float) -> None:
    """Read and drop the rest of a refused body (at most MAX_DRAIN_BYTES, each piece within ``timeout_s``), so a
    client still sending it reads the 413 instead of a connection reset; a larger body is not read (the
    connection closes on it)."""
    if declared_bytes > MAX_DRAIN_BYTES:
        return
    dropped = 0
    try:
        while dropped <= MAX_DRAIN_BYTES:
            dropped += len(await asyncio.wait_for(pieces.__anext__(), timeout_s))
    except (StopAsyncIteration, asyncio.TimeoutError, ClientDisconnect):
        pass


MAX_GZIP_MEMBERS = 64             # concatenated gzip members of one body (each costs an inflater; empty ones cost
                                  # bytes but decode to nothing, so the decoded-size limit never stops them)
INFLATE_PIECE_BYTES = 64 * 1024   # compressed bytes given to zlib at a time (its copies of the input's tail stay small)
GZIP_MAGIC = b"\x1f\x8b"
# Content-Encoding codings of request bodies -> zlib wbits (None: nothing to decode)
BODY_ENCODINGS = {"identity": None, "gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS,
                  "deflate": zlib.MAX_WBITS}


def decode_body(raw: bytes, content_encoding: str | None, limit: int | None = None) -> bytes:
    """``raw`` decoded by its ``Content-Encoding`` (RFC 9110 section 8.4: codings listed in the order they were
    applied; ``identity``, ``gzip``/``x-gzip`` (concatenated members too) and ``deflate``, zlib-wrapped as the RFC
    says or raw as some clients send it), never holding more than ``limit`` (default MAX_BODY_BYTES) decoded
    bytes: the body limit applies to the decoded size, so a small body that inflates past it is refused.

    Raises:
        UnsupportedEncodingError (415): a coding other than those, named in the message.
        PayloadTooLargeError (413): the decoded body is over the limit.
        InvalidRequestError (400): the bytes are not valid data of their coding (corrupt or truncated).
    """
    if content_encoding is None or not content_encoding.strip():
        return raw
    limit = MAX_BODY_BYTES if limit is None else limit
    codings = [c.strip().lower() for c in content_encoding.split(",") if c.strip()]
    for coding in codings:
        if coding not in BODY_ENCODINGS:
            raise UnsupportedEncodingError(f"Content-Encoding {coding!r} is not supported; send the body as "
                                           f"{', '.join(BODY_ENCODINGS)}", param="Content-Encoding")
    for coding in reversed(codings):
        if BODY_ENCODINGS[coding] is not None:
            raw = _inflate(raw, coding, limit)
    return raw


def _inflate(data: bytes, coding: str, limit: int) -> bytes:
    """One coding's bytes inflated, in time linear in ``len(data)``: the input is fed in INFLATE_PIECE_BYTES
    pieces (zlib's unconsumed and unused tails are copies of what is left of its input, so a whole-body input
    made every member copy the rest of the body), gzip members at most MAX_GZIP_MEMBERS."""
    wbits = BODY_ENCODINGS[coding]
    view, out, pos, members = memoryview(data), bytearray(), 0, 0
    try:
        while True:
            members += 1
            if members > MAX_GZIP_MEMBERS:
                raise InvalidRequestError(f"the request body has more than {MAX_GZIP_MEMBERS} {coding} members "
                                          "(MAX_GZIP_MEMBERS); send it as one", param="Content-Encoding")
            try:
                pos = _inflate_member(view, pos, zlib.decompressobj(wbits), out, limit, coding)
            except zlib.error:
                if coding != "deflate" or wbits < 0 or out:
                    raise
                wbits = -zlib.MAX_WBITS   # raw deflate (no zlib header): what some clients send as "deflate"
                members -= 1
                continue
            if wbits != BODY_ENCODINGS["gzip"] or not data.startswith(GZIP_MAGIC, pos):   # no further member
                break
    except zlib.error as exc:
        raise InvalidRequestError(f"the request body is not valid {coding} data ({exc})",
                                  param="Content-Encoding") from None
    if view[pos:].tobytes().strip(b"\0"):   # once, at the end: trailing bytes (gzip writers may pad with zeros)
        raise InvalidRequestError(f"the request body has bytes after its {coding} data", param="Content-Encoding")
    return bytes(out)


def _inflate_member(view: memoryview, pos: int, inflater, out: bytearray, limit: int, coding: str) -> int:
    """Inflate one stream of ``view`` from ``pos`` into ``out`` (at most ``limit`` bytes in all); returns the
    offset just past it. Raises zlib.error when the data ends before the stream does, PayloadTooLargeError."""
    while not inflater.eof:
        piece = inflater.unconsumed_tail   # input zlib held back at max_length: a suffix of the last piece
        if not piece:
            if pos >= len(view):
                raise zlib.error("the compressed data ends early")
            piece = view[pos:pos + INFLATE_PIECE_BYTES]
            pos += len(piece)
        out += inflater.decompress(piece, limit + 1 - len(out))
        if len(out) > limit:
            raise PayloadTooLargeError(f"the request body inflates past the limit of {limit} bytes "
                                       f"(MAX_BODY_BYTES, applied to the decoded body; Content-Encoding {coding})")
    return pos - len(inflater.unused_data)


async def read_decoded_body(request: Request, timeout_s: float) -> bytes:
    """``read_body`` then ``decode_body`` by the request's Content-Encoding (inflating up to 4 MiB: off the event
    loop). Raises as both."""
    raw = await read_body(request, timeout_s=timeout_s)
    encoding = request.headers.get("content-encoding")
    return raw if encoding is None else await asyncio.to_thread(decode_body, raw, encoding)


def parse_json(raw: bytes) -> Any:
    """orjson, which rejects invalid UTF-8 and lone surrogates (``"\\ud800"``) as well as bad syntax; a value nested
    deeper than MAX_JSON_DEPTH arrays and objects is a 400 (whatever a route echoes back, orjson can write: its
    output stops at 255 levels)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}") from None
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _too_deep(body, MAX_JSON_DEPTH):
        path = _deep_path(body, MAX_JSON_DEPTH)
        raise InvalidRequestError(f"the request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels "
                                  f"(MAX_JSON_DEPTH) at '{path[:200]}'", param=path.split(".")[0].split("[")[0])
    return body


def _too_deep(value: Any, levels: int) -> bool:
    """Whether a container lies ``levels`` containers below the container ``value``: a walk of the containers
    (about 0.6x orjson's parse time on a body of small arrays; a flat list of numbers is one type check each)."""
    if levels == 0:
        return True
    for child in (value.values() if type(value) is dict else value):
        kind = type(child)
        if (kind is dict or kind is list) and _too_deep(child, levels - 1):
            return True
    return False


def _deep_path(value: Any, levels: int, path: str = "") -> str:
    """Where ``_too_deep`` found it, as ``a.b[3].c`` (called only then)."""
    items = value.items() if type(value) is dict else enumerate(value)
    for name, child in items:
        if type(child) in (dict, list) and _too_deep(child, levels - 1):
            inner = f"{path}[{name}]" if isinstance(name, int) else f"{path}.{name}" if path else str(name)
            return inner if levels == 1 else _deep_path(child, levels - 1, inner)
    return path


def built(build: Callable[[Any], Any], raw: bytes, what: str) -> Any:
    """``build(parse_json(raw))``: bad input of any shape is a PdserveError (4xx), never a crash; an error the
    validator did not foresee is a 400 and a log line (``what``: the route) to fix it."""
    body = parse_json(raw)
    try:
        return build(body)
    except PdserveError:
        raise
    except (RecursionError, MemoryError):
        raise InvalidRequestError("the request is nested too deeply or too large to validate") from None
    except Exception as exc:  # noqa: BLE001 - input the validator did not foresee: a 400, and a log line to fix it
        log.exception("unexpected error while validating a %s request", what)
        raise InvalidRequestError(f"the request could not be validated ({type(exc).__name__})") from None


async def read_and_build(request: Request, build: Callable[[Any], Any], timeout_s: float) -> tuple[Any, int]:
    """``(build(body), body bytes)``: JSON, chat template and tokenizer over a body past INLINE_PARSE_BYTES run in
    a worker thread (the event loop keeps beating heartbeats and feeding other streams). Raises PdserveError (4xx),
    ClientDisconnect (the client left mid-body)."""
    raw = await read_decoded_body(request, timeout_s)
    if len(raw) > INLINE_PARSE_BYTES:
        return await asyncio.to_thread(built, build, raw, request.url.path), len(raw)
    return built(build, raw, request.url.path), len(raw)
