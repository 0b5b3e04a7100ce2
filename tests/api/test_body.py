"""read_body / decode_body / parse_json on a real Starlette app: 413 over MAX_BODY_BYTES (declared, streamed, or
once a gzip/deflate body is decoded), 415 naming an unsupported Content-Encoding, 400 for bytes that are not JSON
(invalid UTF-8, lone surrogates, truncation) or not valid compressed data."""
from __future__ import annotations

import gzip
import random
import zlib

import orjson

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from api.body import (INFLATE_PIECE_BYTES, MAX_BODY_BYTES, MAX_GZIP_MEMBERS, MAX_JSON_DEPTH, decode_body, parse_json,
                      read_body)
from api.exchange import error_response
from pdserve.errors import PdserveError


async def echo(request):
    try:
        raw = decode_body(await read_body(request), request.headers.get("content-encoding"))
        body = parse_json(raw)
    except PdserveError as exc:
        return error_response(exc)
    return JSONResponse({"ok": type(body).__name__, "size": len(raw)})


@pytest.fixture(scope="module")
def client():
    with TestClient(Starlette(routes=[Route("/", echo, methods=["POST"])])) as c:
        yield c


def test_max_body_bytes_is_four_mebibytes():
    assert MAX_BODY_BYTES == 4 * 1024 * 1024


def test_a_body_at_the_limit_is_read_and_one_byte_over_is_413(client):
    filler = b'{"a":"' + b"x" * (MAX_BODY_BYTES - 8) + b'"}'
    assert len(filler) == MAX_BODY_BYTES
    assert client.post("/", content=filler).json()["ok"] == "dict"
    over = client.post("/", content=filler + b" ")
    assert over.status_code == 413 and over.json()["error"]["type"] == "invalid_request_error"


def test_a_streamed_body_without_content_length_is_cut_at_the_limit(client):
    def chunks():
        for _ in range(5):
            yield b" " * (1024 * 1024)

    response = client.post("/", content=chunks())
    assert response.status_code == 413


@pytest.mark.parametrize("raw", [b"", b"{", b'{"a": ', b"\xff\xfe{}", b'{"a": "\xc3"}', b'{"a": "\\ud800"}',
                                 b'{"a": "\\udc00x"}', b"[" * 5000, b"NaN", b"{'a': 1}"],
                         ids=["empty", "open-brace", "truncated", "non-utf8", "cut-utf8", "lone-high-surrogate",
                              "lone-low-surrogate", "unclosed-deep", "nan", "single-quotes"])
def test_bytes_that_are_not_json_are_a_400(client, raw):
    response = client.post("/", content=raw)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_a_paired_surrogate_escape_is_valid(client):
    assert client.post("/", content=b'{"a": "\\ud83d\\ude00"}').json()["ok"] == "dict"


BODY = b'{"prompt": "' + b"word " * 1000 + b'"}'


def raw_deflate(data: bytes) -> bytes:
    compressor = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return compressor.compress(data) + compressor.flush()


@pytest.mark.parametrize("encoding, encode", [
    ("gzip", gzip.compress), ("x-gzip", gzip.compress), ("GZip", gzip.compress), ("deflate", zlib.compress),
    ("deflate", raw_deflate), ("identity", lambda b: b), ("gzip, identity", gzip.compress),
    ("deflate, gzip", lambda b: gzip.compress(zlib.compress(b))),
    ("gzip", lambda b: gzip.compress(b[:100]) + gzip.compress(b[100:])),   # two members, as `cat a.gz b.gz`
], ids=["gzip", "x-gzip", "case", "deflate-zlib", "deflate-raw", "identity", "gzip-identity", "deflate-then-gzip",
        "gzip-two-members"])
def test_a_compressed_body_is_decoded(client, encoding, encode):
    response = client.post("/", content=encode(BODY), headers={"Content-Encoding": encoding})
    assert response.status_code == 200, response.text
    assert response.json() == {"ok": "dict", "size": len(BODY)}


def test_the_body_limit_applies_to_the_decoded_size(client):
    at_limit = b'{"a":"' + b"x" * (MAX_BODY_BYTES - 8) + b'"}'
    small = gzip.compress(at_limit)
    assert len(small) < 64 * 1024
    assert client.post("/", content=small, headers={"Content-Encoding": "gzip"}).json()["ok"] == "dict"
    bomb = gzip.compress(at_limit + b" ")   # one byte over once inflated, a few KiB on the wire
    response = client.post("/", content=bomb, headers={"Content-Encoding": "gzip"})
    assert response.status_code == 413, response.text
    assert "decoded" in response.json()["error"]["message"]
    huge = zlib.compress(b" " * (64 * MAX_BODY_BYTES))   # 256 MiB of spaces in ~256 KiB: never inflated whole
    assert client.post("/", content=huge, headers={"Content-Encoding": "deflate"}).status_code == 413


@pytest.mark.parametrize("encoding", ["br", "zstd", "compress", "gzip, br"])
def test_an_unsupported_encoding_is_a_415_naming_it(client, encoding):
    response = client.post("/", content=b"{}", headers={"Content-Encoding": encoding})
    assert response.status_code == 415, response.text
    error = response.json()["error"]
    assert error["param"] == "Content-Encoding" and encoding.split(", ")[-1] in error["message"]
    assert "gzip" in response.headers["accept-encoding"]


@pytest.mark.parametrize("content", [b"not gzip at all", gzip.compress(BODY)[:-20], gzip.compress(BODY) + b"junk"],
                         ids=["not-gzip", "truncated", "trailing-junk"])
def test_bytes_that_are_not_valid_gzip_are_a_400(client, content):
    response = client.post("/", content=content, headers={"Content-Encoding": "gzip"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "Content-Encoding"


def test_decode_body_without_an_encoding_returns_the_bytes_as_they_are():
    assert decode_body(b"\x1f\x8b raw", None) == b"\x1f\x8b raw"
    assert decode_body(b"abc", " ") == b"abc"


EMPTY_MEMBER = gzip.compress(b"")   # 20 bytes that decode to nothing


def test_a_body_of_empty_gzip_members_is_refused_at_the_member_bound_without_reading_the_rest(client):
    bomb = EMPTY_MEMBER * (MAX_BODY_BYTES // len(EMPTY_MEMBER))   # ~210,000 members, 4 MiB: the decoded limit never fires
    response = client.post("/", content=bomb, headers={"Content-Encoding": "gzip"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "Content-Encoding" and f"more than {MAX_GZIP_MEMBERS} gzip members" in error["message"]
    at_bound = gzip.compress(BODY[:10]) + EMPTY_MEMBER * (MAX_GZIP_MEMBERS - 2) + gzip.compress(BODY[10:])
    assert client.post("/", content=at_bound, headers={"Content-Encoding": "gzip"}).json()["size"] == len(BODY)


def test_inflating_walks_the_body_once_whatever_its_members():
    """Each member used to copy the rest of the body twice (zlib's unused tail and a strip): the cost grew with
    the square of the member count. Counted here as the bytes zlib is handed, which must stay within the body's
    length plus one piece per member."""
    seen = []
    real = zlib.decompressobj

    class Counting:
        def __init__(self, wbits):
            self.inner = real(wbits)

        def decompress(self, data, max_length=0):
            seen.append(len(data))
            return self.inner.decompress(data, max_length)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    parts = [random.Random(i).randbytes(60_000) for i in range(MAX_GZIP_MEMBERS)]   # incompressible: a 3.8 MB body
    body = b"".join(gzip.compress(part, compresslevel=1) for part in parts)
    zlib.decompressobj = Counting
    try:
        out = decode_body(body, "gzip")
    finally:
        zlib.decompressobj = real
    assert out == b"".join(parts)
    assert sum(seen) <= len(body) + MAX_GZIP_MEMBERS * INFLATE_PIECE_BYTES, (sum(seen), len(body))


def nested(levels: int, leaf=0):
    """``levels`` containers, objects and arrays in turn, around ``leaf``."""
    for level in range(levels):
        leaf = [leaf] if level % 2 else {"a": leaf}
    return leaf


def test_json_nested_deeper_than_the_bound_is_a_400_naming_the_field(client):
    deep = {"metadata": {"k": "v"}, "reasoning": nested(MAX_JSON_DEPTH)}   # the body's object makes one more
    response = client.post("/", content=orjson.dumps(deep))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "reasoning" and f"deeper than {MAX_JSON_DEPTH} levels" in error["message"]
    assert parse_json(orjson.dumps(nested(MAX_JSON_DEPTH))) == nested(MAX_JSON_DEPTH)
    flat = orjson.dumps({"prompt": [[i] for i in range(1000)] + [[[[[[]]]]]]})   # many containers, shallow
    assert parse_json(flat)["prompt"][-1] == [[[[[]]]]]
