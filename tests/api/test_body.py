"""read_body / parse_json on a real Starlette app: 413 over MAX_BODY_BYTES (declared or streamed), 400 for bytes
that are not JSON (invalid UTF-8, lone surrogates, truncation)."""
from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from api.app import MAX_BODY_BYTES, parse_json, read_body
from api.protocol import error_body
from pdserve.errors import PdserveError


async def echo(request):
    try:
        body = parse_json(await read_body(request))
    except PdserveError as exc:
        return JSONResponse(error_body(exc), status_code=exc.http_status)
    return JSONResponse({"ok": type(body).__name__})


@pytest.fixture(scope="module")
def client():
    with TestClient(Starlette(routes=[Route("/", echo, methods=["POST"])])) as c:
        yield c


def test_max_body_bytes_is_four_mebibytes():
    assert MAX_BODY_BYTES == 4 * 1024 * 1024


def test_a_body_at_the_limit_is_read_and_one_byte_over_is_413(client):
    filler = b'{"a":"' + b"x" * (MAX_BODY_BYTES - 8) + b'"}'
    assert len(filler) == MAX_BODY_BYTES
    assert client.post("/", content=filler).json() == {"ok": "dict"}
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
    assert client.post("/", content=b'{"a": "\\ud83d\\ude00"}').json() == {"ok": "dict"}
