"""End-to-end OpenAI compatibility: a table of bad inputs (each a 4xx in OpenAI error form, then /health 200 and an
ordinary request still succeeds), scenarios S7, S11, S12, S13, a hypothesis fuzz over request bodies, the official
`openai` client, keep-alive (HTTP/1.1 close, HTTP/2 GOAWAY) and TLS (ALPN h2 + http/1.1). One engine for the module
(a second, TLS one only for the TLS test). tools/multiround.py is tested in test_multiround.py."""
from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

import httpx
import orjson
import pytest

from tests.conftest import (FRANCE_QUESTION, ROOT, assert_recovered, cleanup_engine, free_port, probe_fixture, scrape,
                            send_and_trace, start_engine, wait_until)
from tests.e2e.conftest import HTTP_SLACK_S

POOL_TOKENS = 1024          # the fitted context: max_model_len = min(model context 8192, the pool) = 1024
KEEP_ALIVE_S = 1.0
BODY_READ_TIMEOUT_S = 2.0
TOKEN = 1000                # any in-vocabulary id, to build prompts of an exact token count


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = start_engine(tmp_path_factory.mktemp("openai"), "--kv-pool-tokens", str(POOL_TOKENS), "--keep-alive-timeout-s",
                       str(KEEP_ALIVE_S), "--body-read-timeout-s", str(BODY_READ_TIMEOUT_S))
    yield eng
    cleanup_engine(eng)


probe = probe_fixture()


@pytest.fixture(scope="module")
def http(engine):
    with httpx.Client(base_url=engine.base_url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def max_len(http) -> int:
    return http.get("/v1/models").json()["data"][0]["max_model_len"]


@pytest.fixture(scope="module")
def tokenizer():
    from gpu.tokenizer import Tokenizer

    return Tokenizer.load(None)


@pytest.fixture(scope="module")
def model(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def still_serving(http: httpx.Client) -> None:
    """After every bad input: /health 200 and an ordinary one-token request succeeds."""
    assert http.get("/health").status_code == 200
    ok = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 1


def assert_error(response: httpx.Response, status: int, error_type: str, param: str | None = None,
                 code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
BAD = "invalid_request_error"


def chat(**extra):
    return {"messages": HI, "max_tokens": 2, **extra}


def comp(**extra):
    return {"prompt": "Hello", "max_tokens": 2, **extra}


# (id, route, json body or raw bytes, status, error type, param)
CASES = [
    ("chat-missing-messages", CHAT, {"max_tokens": 2}, 400, BAD, "messages"),
    ("S11-chat-empty-message-list", CHAT, chat(messages=[]), 400, BAD, "messages"),
    ("chat-messages-not-a-list", CHAT, chat(messages="hi"), 400, BAD, "messages"),
    ("chat-message-without-content", CHAT, chat(messages=[{"role": "user"}]), 400, BAD, "messages"),
    ("chat-message-unknown-role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, BAD, "messages"),
    ("chat-message-image-part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     400, BAD, "messages"),
    ("chat-message-not-an-object", CHAT, chat(messages=[5]), 400, BAD, "messages"),
    ("S11-prompt-empty-string", COMP, comp(prompt=""), 400, BAD, "prompt"),
    ("S11-prompt-empty-list", COMP, comp(prompt=[]), 400, BAD, "prompt"),
    ("prompt-missing", COMP, {"max_tokens": 2}, 400, BAD, "prompt"),
    ("prompt-wrong-type", COMP, comp(prompt=5), 400, BAD, "prompt"),
    ("prompt-token-outside-vocab", COMP, comp(prompt=[10**9]), 400, BAD, "prompt"),
    ("prompt-list-mixing-strings-and-token-lists", COMP, comp(prompt=["a", [TOKEN]]), 400, BAD, "prompt"),
    ("prompt-list-with-an-empty-string", COMP, comp(prompt=["a", ""]), 400, BAD, "prompt"),
    ("prompt-list-with-an-empty-token-list", COMP, comp(prompt=[[TOKEN], []]), 400, BAD, "prompt"),
    ("prompt-list-token-outside-vocab", COMP, comp(prompt=[[TOKEN], [TOKEN, 10**9]]), 400, BAD, "prompt"),
    ("prompt-list-over-max-queued-requests", COMP, comp(prompt=["a"] * 257), 400, BAD, "prompt"),
    ("prompt-list-times-n-over-max-queued-requests", COMP, comp(prompt=["a"] * 3, n=100), 400, BAD, "prompt"),
    ("prompt-list-one-over-the-context", COMP, comp(prompt=[[TOKEN], [TOKEN] * POOL_TOKENS], max_tokens=None), 400,
     BAD, "prompt"),
    ("max-tokens-zero", COMP, comp(max_tokens=0), 400, BAD, "max_tokens"),
    ("max-tokens-negative", COMP, comp(max_tokens=-1), 400, BAD, "max_tokens"),
    ("max-tokens-2**31", COMP, comp(max_tokens=2**31), 400, BAD, "max_tokens"),
    ("max-tokens-string", COMP, comp(max_tokens="5"), 400, BAD, "max_tokens"),
    ("max-tokens-float", COMP, comp(max_tokens=1.5), 400, BAD, "max_tokens"),
    ("max-completion-tokens-zero", CHAT, chat(max_completion_tokens=0), 400, BAD, "max_completion_tokens"),
    ("temperature-negative", CHAT, chat(temperature=-0.5), 400, BAD, "temperature"),
    ("temperature-string", CHAT, chat(temperature="hot"), 400, BAD, "temperature"),
    ("top-p-over-one", CHAT, chat(top_p=1.5), 400, BAD, "top_p"),
    ("top-p-zero", CHAT, chat(top_p=0), 400, BAD, "top_p"),
    ("top-k-zero", CHAT, chat(top_k=0), 400, BAD, "top_k"),
    ("min-p-over-one", CHAT, chat(min_p=2), 400, BAD, "min_p"),
    ("seed-string", CHAT, chat(seed="x"), 400, BAD, "seed"),
    ("n-zero", CHAT, chat(n=0), 400, BAD, "n"),
    ("n-200", CHAT, chat(n=200), 400, BAD, "n"),
    # 128 choices of 2 blocks each cannot be held together by a 64-block decode pool: refused before admission
    ("n-over-the-kv-pool", COMP, comp(n=128, max_tokens=20), 400, BAD, "n"),
    ("n-string", CHAT, chat(n="2"), 400, BAD, "n"),
    ("stop-list-of-50", CHAT, chat(stop=[f"s{i}" for i in range(50)]), 400, BAD, "stop"),
    ("stop-empty-string", CHAT, chat(stop=[""]), 400, BAD, "stop"),
    ("stop-not-strings", CHAT, chat(stop=[1, 2]), 400, BAD, "stop"),
    ("stream-not-bool", CHAT, chat(stream="yes"), 400, BAD, "stream"),
    ("stream-options-without-stream", CHAT, chat(stream_options={"include_usage": True}), 400, BAD,
     "stream_options"),
    ("chat-logprobs-integer", CHAT, chat(logprobs=3), 400, BAD, "logprobs"),
    ("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=5), 400, BAD, "top_logprobs"),
    ("top-logprobs-21", CHAT, chat(logprobs=True, top_logprobs=21), 400, BAD, "top_logprobs"),
    ("completion-logprobs-21", COMP, comp(logprobs=21), 400, BAD, "logprobs"),
    ("completion-logprobs-true", COMP, comp(logprobs=True), 400, BAD, "logprobs"),
    ("presence-penalty-3", CHAT, chat(presence_penalty=3), 400, BAD, "presence_penalty"),
    ("frequency-penalty-string", COMP, comp(frequency_penalty="1"), 400, BAD, "frequency_penalty"),
    ("repetition-penalty-zero", COMP, comp(repetition_penalty=0), 400, BAD, "repetition_penalty"),
    ("echo-not-bool", COMP, comp(echo="yes"), 400, BAD, "echo"),
    ("tools-without-function", CHAT, chat(tools=[{"type": "function"}]), 400, BAD, "tools"),
    ("tool-choice-unknown-function", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                                tool_choice={"type": "function", "function": {"name": "g"}}),
     400, BAD, "tool_choice"),
    ("response-format-bad-schema", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strng"}}}), 400, BAD, "response_format"),
    ("unknown-field-typo", COMP, comp(max_token=5), 400, BAD, "max_token"),
    ("user-not-string", CHAT, chat(user=5), 400, BAD, "user"),
    ("timeout-negative", CHAT, chat(timeout=-1), 400, BAD, "timeout"),
    ("model-wrong-type", CHAT, chat(model=5), 400, BAD, "model"),
    ("unknown-model", CHAT, chat(model="gpt-4o"), 404, "not_found_error", "model"),
    ("body-json-array", CHAT, [1, 2], 400, BAD, None),
    ("body-json-string", COMP, "hello", 400, BAD, None),
    ("invalid-json", CHAT, b'{"messages": [}', 400, BAD, None),
    ("truncated-body", CHAT, b'{"messages": [{"role": "user", "content": "hi"', 400, BAD, None),
    ("empty-body", COMP, b"", 400, BAD, None),
    ("non-utf8-bytes", COMP, b'{"prompt": "\xff\xfe\xfa", "max_tokens": 2}', 400, BAD, None),
    ("lone-high-surrogate", COMP, b'{"prompt": "a\\ud800b", "max_tokens": 2}', 400, BAD, None),
    ("lone-low-surrogate", CHAT, b'{"messages": [{"role": "user", "content": "\\udc00"}]}', 400, BAD, None),
    ("one-megabyte-prompt", COMP, comp(prompt="word " * (1 << 18)), 400, BAD, "prompt"),
    ("body-over-4MiB", COMP, comp(prompt="x" * (5 << 20)), 413, BAD, None),
    ("prompt-plus-max-tokens-over", COMP, comp(max_tokens=POOL_TOKENS), 400, BAD, "max_tokens"),
    ("prompt-exactly-the-context", COMP, comp(prompt=[TOKEN] * POOL_TOKENS, max_tokens=None), 400, BAD, "prompt"),
    ("prompt-one-token-over", COMP, comp(prompt=[TOKEN] * (POOL_TOKENS + 1), max_tokens=None), 400, BAD, "prompt"),
]


@pytest.mark.parametrize("route,body,status,error_type,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_an_openai_error_and_the_engine_keeps_serving(http, max_len, route, body, status, error_type,
                                                                   param):
    assert max_len == POOL_TOKENS
    if isinstance(body, bytes):
        response = http.post(route, content=body, headers={"Content-Type": "application/json"})
    else:
        response = http.post(route, content=orjson.dumps(body), headers={"Content-Type": "application/json"})
    assert_error(response, status, error_type, param)
    still_serving(http)


@pytest.mark.parametrize("method,path,status", [("GET", "/v1/nothing-here", 404), ("POST", "/v2/completions", 404),
                                                ("GET", COMP, 405), ("DELETE", CHAT, 405), ("PUT", "/health", 405)])
def test_unknown_routes_and_methods_are_openai_errors(http, method, path, status):
    response = http.request(method, path)
    assert response.status_code == status and "error" in response.json()
    if status == 405:
        assert response.headers["allow"]
    still_serving(http)


TRACE_ID = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01;" + "span=" * 30 + '{"k":[1]}~'   # 215 chars


def test_an_x_request_id_of_up_to_256_visible_ascii_is_kept_whole_and_the_table_holds_its_first_40_bytes(
        http, probe):
    assert len(TRACE_ID) > 200
    body = comp(prompt="Count:", max_tokens=12, ignore_eos=True, stream=True)
    with http.stream("POST", COMP, json=body, headers={"X-Request-Id": TRACE_ID}) as response:
        assert response.status_code == 200 and response.headers["x-request-id"] == TRACE_ID
        rows = wait_until(lambda: probe.rows_with_id(TRACE_ID), 30, 0.01, "the request's row")
        assert rows[0]["request_id"] == TRACE_ID[:40]
        chunks = [orjson.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    assert chunks and {c["id"] for c in chunks} == {TRACE_ID}
    whole = http.post(COMP, json=comp(), headers={"X-Request-Id": "x" * 256})
    assert whole.status_code == 200 and whole.json()["id"] == "x" * 256 == whole.headers["x-request-id"]
    still_serving(http)


@pytest.mark.parametrize("value", [b"x" * 257, b"has space", b"tab\there", b"caf\xc3\xa9"],
                         ids=["257-chars", "space", "tab", "non-ascii"])
def test_an_x_request_id_the_engine_cannot_use_is_replaced_never_refused(http, value):
    response = http.post(COMP, json=comp(), headers={"X-Request-Id": value})
    assert response.status_code == 200, response.text
    assert response.json()["id"].startswith("cmpl-") and response.headers["x-request-id"] == response.json()["id"]


def test_a_gzip_or_deflate_body_is_decoded_with_the_limit_on_its_decoded_size(http):
    import gzip
    import zlib

    body = orjson.dumps(comp(prompt="The capital of France is", max_tokens=2))
    for encoding, encoded in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body))):
        response = http.post(COMP, content=encoded, headers={"Content-Encoding": encoding,
                                                             "Content-Type": "application/json"})
        assert response.status_code == 200, (encoding, response.text)
        assert response.json()["usage"]["completion_tokens"] == 2
    bomb = gzip.compress(orjson.dumps(comp(prompt="x" * (5 << 20))))   # ~5 KiB on the wire, 5 MiB decoded
    assert len(bomb) < 64 * 1024
    response = http.post(COMP, content=bomb, headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
    assert_error(response, 413, BAD)
    response = http.post(COMP, content=body, headers={"Content-Encoding": "br", "Content-Type": "application/json"})
    assert "'br'" in assert_error(response, 415, BAD, "Content-Encoding")["message"]
    assert "gzip" in response.headers["accept-encoding"]
    still_serving(http)


def test_a_lying_content_length_over_the_limit_is_a_413_before_the_body_is_read(engine):
    with socket.create_connection(("127.0.0.1", engine.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 999999999\r\n\r\n{")
        head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 413"), head


def test_a_body_over_the_limit_is_read_to_its_end_so_the_client_gets_its_413_and_keeps_the_connection(engine):
    """A client still sending a refused body (40 MiB: more than the socket buffers hold) must read the 413, not a
    reset; the body is drained (api/app.py ``_drain``), so the same connection serves the next request."""
    big = orjson.dumps(comp(prompt="x" * (40 << 20)))
    small = orjson.dumps(comp(prompt="Count:", max_tokens=1))

    def post(body: bytes) -> bytes:
        return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    with socket.create_connection(("127.0.0.1", engine.port), timeout=60) as sock:
        sock.sendall(post(big))   # BrokenPipeError / ConnectionResetError if the server hung up on the body
        assert read_http1_response(sock).startswith(b"HTTP/1.1 413")
        sock.sendall(post(small))
        assert read_http1_response(sock).startswith(b"HTTP/1.1 200")


def test_neutral_values_of_unsupported_parameters_are_accepted(http):
    response = http.post(CHAT, json=chat(logprobs=False, top_logprobs=0, presence_penalty=0, frequency_penalty=0,
                                         repetition_penalty=1.0, n=1, user="alice", top_k=40, min_p=0.05,
                                         max_completion_tokens=2, timeout=30))
    assert response.status_code == 200, response.text
    response = http.post(COMP, json=comp(echo=False, logprobs=None, best_of=1, presence_penalty=0.0))
    assert response.status_code == 200, response.text
    # max_completion_tokens is not just accepted: it limits the output (no max_tokens beside it here)
    limited = http.post(CHAT, json={"messages": HI, "max_completion_tokens": 3, "ignore_eos": True})
    assert limited.status_code == 200, limited.text
    assert limited.json()["usage"]["completion_tokens"] == 3
    assert limited.json()["choices"][0]["finish_reason"] == "length"


def test_S11_chat_with_one_empty_message_is_a_valid_generation(http):
    response = http.post(CHAT, json=chat(messages=[{"role": "user", "content": ""}]))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    still_serving(http)


def test_S7_one_token_over_gets_400_and_is_never_admitted_while_exactly_fitting_runs(engine, http, probe, max_len):
    before = scrape(engine.base_url)["pdserve_requests_admitted_total"]
    over = http.post(COMP, json={"prompt": [TOKEN] * (max_len + 1), "max_tokens": 1},
                     headers={"X-Request-Id": "s7-over"})
    assert_error(over, 400, BAD, "prompt", "context_length_exceeded")
    full = http.post(COMP, json={"prompt": [TOKEN] * max_len, "max_tokens": 1}, headers={"X-Request-Id": "s7-full"})
    assert_error(full, 400, BAD, "prompt", "context_length_exceeded")
    assert scrape(engine.base_url)["pdserve_requests_admitted_total"] == before
    assert probe.rows_with_id("s7-over") == [] and probe.rows_with_id("s7-full") == []
    fits = http.post(COMP, json={"prompt": [TOKEN] * (max_len - 1), "max_tokens": 1, "ignore_eos": True})
    assert fits.status_code == 200, fits.text
    assert {k: v for k, v in fits.json()["usage"].items() if k != "prompt_tokens_details"} == {
        "prompt_tokens": max_len - 1, "completion_tokens": 1, "total_tokens": max_len}
    assert scrape(engine.base_url)["pdserve_requests_admitted_total"] == before + 1
    assert_recovered(engine, probe)


def test_a_one_megabyte_prompt_is_answered_quickly(http):
    start = time.monotonic()
    assert_error(http.post(COMP, json=comp(prompt="é" * (1 << 19))), 400, BAD, "prompt", "context_length_exceeded")
    assert time.monotonic() - start < 2.0


def sse(text: str) -> list[dict]:
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", text[-300:]
    return [orjson.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("content,max_tokens", [("Repeat after me: 😀🎉 你好世界 😀🎉 你好世界", 40),
                                                # greedy output is a run of 🌟 (3 byte-level tokens each), cut
                                                # by max_tokens in the middle of one
                                                ("Write three emoji and the Chinese for 'good morning':", 20)])
def test_S12_streamed_emoji_and_cjk_are_never_broken(http, content, max_tokens):
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0}
    plain = http.post(CHAT, json=body)
    assert plain.status_code == 200, plain.text
    streamed = http.post(CHAT, json={**body, "stream": True})
    assert streamed.status_code == 200
    events = sse(streamed.text)
    pieces = [e["choices"][0]["delta"].get("content", "") for e in events if e["choices"]]
    assert all("\ufffd" not in p for p in pieces), pieces
    text = "".join(pieces)
    assert text == plain.json()["choices"][0]["message"]["content"]
    assert "\ufffd" not in text
    assert any(ord(c) > 0x2000 for c in text), f"the model wrote no multi-byte characters: {text!r}"


def test_a_per_request_timeout_is_a_504_within_its_deadline(http, probe):
    from pdserve.config import EngineConfig

    response, answered_ns, trace = send_and_trace(probe, "timeout-0.5", lambda: http.post(
        COMP, headers={"X-Request-Id": "timeout-0.5"},
        json={"prompt": "Count to a thousand:", "max_tokens": 900, "ignore_eos": True, "timeout": 0.5}))
    assert_error(response, 504, "timeout_error")
    assert "(timeout=0.5)" in response.json()["error"]["message"], response.text   # the client's, not the server's
    assert trace.first, "the request's row was never seen"
    row = next(iter(trace.first.values()))
    deadline_ns = int(row["deadline_ns"])
    assert 0.49e9 < deadline_ns - int(row["created_ns"]) <= 0.5e9, row   # the body's timeout, from admission
    late_s = (answered_ns - deadline_ns) / 1e9   # the monitor fails it at its first tick past the deadline
    assert 0 <= late_s <= EngineConfig().monitor_tick_s + HTTP_SLACK_S, late_s
    still_serving(http)


# ---- fuzz ---------------------------------------------------------------------------------------------------
def fuzz_strategies():
    """(route, body): a valid body, a valid body with one field replaced by junk, a junk body, or raw bytes
    (random, or a valid body cut short)."""
    from hypothesis import strategies as st

    scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=False),
                       st.text(max_size=12))

    def containers(inner):
        return st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)

    junk = st.recursive(scalar, containers, max_leaves=8)
    text = st.text(min_size=1, max_size=30)
    sampling = {"temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 100),
                "min_p": st.floats(0, 1), "stop": st.one_of(text, st.lists(text, min_size=1, max_size=4)),
                "n": st.integers(1, 3), "stream": st.booleans(), "user": text,
                "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
                "repetition_penalty": st.floats(0.5, 2), "ignore_eos": st.booleans(),
                "timeout": st.floats(30, 600)}
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                     "content": st.one_of(st.text(max_size=30), st.lists(
                                         st.fixed_dictionaries({"type": st.just("text"), "text": text}),
                                         min_size=1, max_size=2))})
    chat_only = {"logprobs": st.booleans(), "top_logprobs": st.integers(0, 5)}
    completion_only = {"echo": st.booleans(), "logprobs": st.integers(0, 5)}
    valid = {
        CHAT: st.fixed_dictionaries({"messages": st.lists(message, min_size=1, max_size=3),
                                     "max_tokens": st.integers(1, 4)}, optional={**sampling, **chat_only}),
        COMP: st.fixed_dictionaries({"prompt": st.one_of(text, st.lists(st.integers(0, 49151), min_size=1,
                                                                        max_size=8)),
                                     "max_tokens": st.integers(1, 4)}, optional={**sampling, **completion_only}),
    }
    names = sorted({"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "stream_options",
                    "top_logprobs", "logprobs", "echo", "seed", "extra", *sampling})

    def corrupt(body_and_junk):
        body, name, value = body_and_junk
        return {**body, name: value}

    def for_route(route):
        good = valid[route]
        return st.one_of(good, st.tuples(good, st.sampled_from(names), junk).map(corrupt),
                         st.dictionaries(st.sampled_from(names), junk, max_size=5),
                         st.binary(max_size=64),
                         good.map(orjson.dumps).flatmap(lambda b: st.integers(0, len(b) - 1).map(lambda n: b[:n])))

    return st.sampled_from([CHAT, COMP]).flatmap(lambda route: st.tuples(st.just(route), for_route(route)))


def bound(body: dict) -> dict:
    """Keep a valid fuzzed body short: few tokens, no short client deadline (a 504 there is correct, not a bug)."""
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 4:
            body[name] = 4
    if "max_completion_tokens" in body and body["max_completion_tokens"] is None and body.get("max_tokens") is None:
        body["max_tokens"] = 4
    timeout = body.get("timeout")
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
        body["timeout"] = 60
    return body


def test_fuzzed_bodies_never_get_a_5xx_or_hang(engine, http, probe):
    from hypothesis import HealthCheck, given, settings

    seen: dict[int, int] = {}

    @settings(max_examples=150, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(fuzz_strategies())
    def one(case):
        route, body = case
        if isinstance(body, dict):
            body = bound(dict(body))
            if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
                body["max_tokens"] = 4
            content = orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS)
        else:
            content = body
        try:
            response = http.post(route, content=content, headers={"Content-Type": "application/json"}, timeout=30)
        except httpx.TimeoutException:
            raise AssertionError(f"no answer within 30 s to {route} {content[:300]!r}") from None
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, (route, content[:300], response.text)
        if response.status_code >= 400:
            assert response.json()["error"]["type"]

    one()
    assert seen.get(400, 0) > 50 and seen.get(200, 0) > 0, seen
    assert_recovered(engine, probe)


# ---- the official openai client -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def oai(engine):
    import openai   # a declared test dependency: missing, these tests fail (never skip)

    client = openai.OpenAI(base_url=engine.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield client
    client.close()


def test_openai_client_echo_with_max_tokens_zero_scores_the_prompt_alone(oai, model):
    """A loglikelihood request (``echo``, ``max_tokens`` 0, ``logprobs``; older lm-evaluation-harness): the prompt's
    text and its tokens' scores (the first one null), nothing generated, finish_reason length, no completion
    tokens; the same when streamed and for each of ``n`` choices."""
    prompt = "The quick brown fox jumps over the lazy dog."
    scored = oai.completions.create(model=model, prompt=prompt, echo=True, max_tokens=0, logprobs=1, temperature=0)
    with_next = oai.completions.create(model=model, prompt=prompt, echo=True, max_tokens=1, logprobs=1,
                                       temperature=0)
    (choice,) = scored.choices
    lp = choice.logprobs
    assert choice.text == prompt and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(lp.tokens) > 5
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.tokens == with_next.choices[0].logprobs.tokens[:-1]
    assert lp.token_logprobs == with_next.choices[0].logprobs.token_logprobs[:-1]
    events = list(oai.completions.create(model=model, prompt=prompt, echo=True, max_tokens=0, logprobs=1,
                                         n=2, stream=True, stream_options={"include_usage": True}))
    for index in (0, 1):
        mine = [e.choices[0] for e in events if e.choices and e.choices[0].index == index]
        assert "".join(c.text for c in mine) == prompt and mine[-1].finish_reason == "length"
        assert [t for c in mine if c.logprobs for t in c.logprobs.tokens] == lp.tokens
    assert events[-1].usage.completion_tokens == 0
    with pytest.raises(openai_bad_request()) as info:
        oai.completions.create(model=model, prompt=prompt, max_tokens=0)
    assert "echo" in str(info.value)


def openai_bad_request():
    import openai

    return openai.BadRequestError


def test_openai_client_chat_plain_and_streamed_with_stop(oai, model):
    messages = [{"role": "user", "content": FRANCE_QUESTION}]
    full = oai.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    text = full.choices[0].message.content
    assert "Paris" in text and full.usage.completion_tokens > 0
    cut = oai.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0, stop=["Paris"])
    assert cut.choices[0].message.content == text.split("Paris")[0] and cut.choices[0].finish_reason == "stop"
    stream = oai.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_openai_client_completions_plain_and_streamed_with_stop(oai, model):
    full = oai.completions.create(model=model, prompt="The three primary colors are", max_tokens=12, temperature=0)
    text = full.choices[0].text
    assert text and full.choices[0].finish_reason in ("length", "stop")
    streamed = "".join(c.choices[0].text for c in oai.completions.create(
        model=model, prompt="The three primary colors are", max_tokens=12, temperature=0, stream=True) if c.choices)
    assert streamed == text
    word = text.split()[1]   # a word after the first, so the text before the stop string is not empty
    cut = oai.completions.create(model=model, prompt="The three primary colors are", max_tokens=12, temperature=0,
                                 stop=[word])
    assert cut.choices[0].text == text.split(word)[0] and cut.choices[0].text.strip(), (text, word)
    assert cut.choices[0].finish_reason == "stop"


def test_openai_client_n_choices_with_stop_plain_and_streamed(oai, model):
    messages = [{"role": "user", "content": "Name a fruit."}]
    full = oai.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=1.0, seed=7, n=3)
    assert [c.index for c in full.choices] == [0, 1, 2]
    texts = [c.message.content for c in full.choices]
    assert all(texts) and len(set(texts)) > 1, texts   # seeds 7, 8, 9: different samples
    assert 3 <= full.usage.completion_tokens <= 24 and full.usage.prompt_tokens < 40   # the prompt counted once
    again = oai.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=1.0, seed=7, n=3)
    assert [c.message.content for c in again.choices] == texts   # reproducible per choice
    stream = oai.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=1.0, seed=7, n=3,
                                         stream=True, stream_options={"include_usage": True})
    streamed = {0: "", 1: "", 2: ""}
    reasons = {}
    chunks = list(stream)
    for c in chunks:
        for choice in c.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert [streamed[i] for i in range(3)] == texts and set(reasons) == {0, 1, 2}
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    greedy = oai.completions.create(model=model, prompt="The three primary colors are", max_tokens=12,
                                    temperature=0, n=2)
    word = greedy.choices[0].text.split()[1]
    cut = oai.completions.create(model=model, prompt="The three primary colors are", max_tokens=12, temperature=0,
                                 n=2, stop=[word])
    single = oai.completions.create(model=model, prompt="The three primary colors are", max_tokens=12, temperature=0)
    assert greedy.choices[0].text == greedy.choices[1].text == single.choices[0].text   # greedy children agree
    for choice in cut.choices:
        assert choice.text == greedy.choices[0].text.split(word)[0] and choice.text.strip(), (choice.text, word)
        assert choice.finish_reason == "stop"


def test_openai_client_logprobs_chat_and_completions(oai, model):
    import math

    messages = [{"role": "user", "content": FRANCE_QUESTION}]
    full = oai.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens
    text = full.choices[0].message.content
    assert "".join(t.token for t in content).startswith(text[:3])
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True) and sum(math.exp(v) for v in tops) <= 1.0 + 1e-5
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].token == entry.token and abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-5
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    stream = oai.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                         top_logprobs=3, stream=True)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    plain = oai.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == text

    comp_full = oai.completions.create(model=model, prompt="The capital of France is", max_tokens=5, temperature=0,
                                       logprobs=2)
    lp = comp_full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == comp_full.choices[0].text
    assert lp.text_offset[0] == 0 and all(len(d) == 2 for d in lp.top_logprobs)
    assert all(max(d.values()) == pytest.approx(v, abs=1e-5) for d, v in zip(lp.top_logprobs, lp.token_logprobs))
    # sampled at a high temperature, a token outside the top 1 still appears in its own top_logprobs (OpenAI: up
    # to logprobs + 1 entries)
    hot = oai.completions.create(model=model, prompt="My favourite animal is", max_tokens=16, temperature=1.8,
                                 seed=3, logprobs=1).choices[0].logprobs
    assert all(tok in d and d[tok] == v for tok, d, v in zip(hot.tokens, hot.top_logprobs, hot.token_logprobs))
    assert any(len(d) == 2 for d in hot.top_logprobs), "no sampled token outside the top 1 at temperature 1.8"


BATCH = ["The capital of France is", "The three primary colors are", "One, two, three,"]


def test_openai_client_a_list_of_prompts_answers_each_as_that_prompt_alone(oai, model, tokenizer):
    """vLLM's and OpenAI's batch: one choice per prompt (n per prompt, index prompt * n + i), each greedy text the
    prompt's own alone (greedy is batch-invariant here), usage summed (each prompt once, every choice's tokens);
    token-id lists the same."""
    alone = [oai.completions.create(model=model, prompt=p, max_tokens=8, temperature=0) for p in BATCH]
    batch = oai.completions.create(model=model, prompt=BATCH, max_tokens=8, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone] and all(c.text for c in batch.choices)
    assert [c.finish_reason for c in batch.choices] == [a.choices[0].finish_reason for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert batch.usage.total_tokens == batch.usage.prompt_tokens + batch.usage.completion_tokens
    ids = oai.completions.create(model=model, prompt=[tokenizer.encode(p) for p in BATCH[:2]], max_tokens=8,
                                 temperature=0)
    assert [c.text for c in ids.choices] == [a.choices[0].text for a in alone[:2]]
    twice = oai.completions.create(model=model, prompt=BATCH, max_tokens=8, temperature=0, n=2)
    assert [c.index for c in twice.choices] == list(range(6))
    assert [c.text for c in twice.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert twice.usage.prompt_tokens == batch.usage.prompt_tokens   # each prompt once, whatever n
    assert twice.usage.completion_tokens == 2 * batch.usage.completion_tokens


def test_openai_client_a_list_of_prompts_echoes_and_scores_each_prompt_as_alone(oai, model):
    """lm-evaluation-harness's loglikelihood batch: ``echo``, ``logprobs``, ``max_tokens`` 0 (and 1): each choice is
    its own prompt with that prompt's scores, as the prompt alone gets them; streamed the same, with summed usage."""
    prompts = BATCH[:2]
    scored = oai.completions.create(model=model, prompt=prompts, echo=True, max_tokens=0, logprobs=1, temperature=0)
    for prompt, choice in zip(prompts, scored.choices):
        alone = oai.completions.create(model=model, prompt=prompt, echo=True, max_tokens=0, logprobs=1,
                                       temperature=0).choices[0]
        assert choice.text == prompt == alone.text and choice.finish_reason == "length"
        assert choice.logprobs.tokens == alone.logprobs.tokens and choice.logprobs.token_logprobs[0] is None
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(alone.logprobs.token_logprobs[1:], abs=1e-4)
    assert scored.usage.completion_tokens == 0
    assert scored.usage.prompt_tokens == sum(len(c.logprobs.tokens) for c in scored.choices)
    with_next = oai.completions.create(model=model, prompt=prompts, echo=True, max_tokens=2, logprobs=1,
                                       temperature=0)
    plain = oai.completions.create(model=model, prompt=prompts, max_tokens=2, temperature=0)
    for k, choice in enumerate(with_next.choices):
        assert choice.text == prompts[k] + plain.choices[k].text
        assert choice.logprobs.tokens[:-2] == scored.choices[k].logprobs.tokens
    events = list(oai.completions.create(model=model, prompt=prompts, echo=True, max_tokens=0, logprobs=1, n=2,
                                         stream=True, stream_options={"include_usage": True}))
    for index in range(4):
        mine = [e.choices[0] for e in events if e.choices and e.choices[0].index == index]
        assert "".join(c.text for c in mine) == prompts[index // 2] and mine[-1].finish_reason == "length"
        assert [t for c in mine if c.logprobs for t in c.logprobs.tokens] == \
            scored.choices[index // 2].logprobs.tokens
    assert events[-1].usage.completion_tokens == 0 and events[-1].usage.prompt_tokens == scored.usage.prompt_tokens


def test_openai_client_a_streamed_list_of_prompts_indexes_each_choice_and_sums_the_usage(oai, model, tokenizer):
    full = oai.completions.create(model=model, prompt=BATCH, max_tokens=8, temperature=0, n=2)
    events = list(oai.completions.create(model=model, prompt=BATCH, max_tokens=8, temperature=0, n=2, stream=True,
                                         stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for event in events[:-1]:
        (choice,) = event.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.finish_reason:
            reasons[choice.index] = choice.finish_reason
    assert texts == {c.index: c.text for c in full.choices} and set(reasons) == set(range(6))
    assert events[-1].choices == [] and events[-1].usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in BATCH)
    assert events[-1].usage.completion_tokens == full.usage.completion_tokens
    echoed = list(oai.completions.create(model=model, prompt=BATCH[:2], max_tokens=8, temperature=0, echo=True,
                                         stream=True))
    for k in range(2):
        mine = "".join(e.choices[0].text for e in echoed if e.choices[0].index == k)
        assert mine == BATCH[k] + full.choices[2 * k].text


def test_openai_client_a_bad_list_of_prompts_is_a_400_naming_the_prompt(oai, model):
    for prompt, named in ((["a", ""], "prompt[1] of 2"), (["a", [TOKEN]], "mixes"), ([[TOKEN], [10**9]], "prompt[1]"),
                          ([], "empty list"), (["a"] * 257, "max_queued_requests")):
        with pytest.raises(openai_bad_request()) as info:
            oai.completions.create(model=model, prompt=prompt, max_tokens=2)
        assert info.value.body["param"] == "prompt" and named in info.value.body["message"], info.value.body


def test_a_prompt_over_the_context_fails_its_list_naming_it_and_none_of_the_list_is_admitted(engine, http, probe):
    before = scrape(engine.base_url)["pdserve_requests_admitted_total"]
    over = http.post(COMP, json={"prompt": [[TOKEN] * 4, [TOKEN] * POOL_TOKENS, [TOKEN] * 4], "max_tokens": 1},
                     headers={"X-Request-Id": "list-over"})
    error = assert_error(over, 400, BAD, "prompt", "context_length_exceeded")
    assert error["message"].startswith("prompt[1] of 3: ")
    assert probe.rows_with_id("list-over") == []
    assert scrape(engine.base_url)["pdserve_requests_admitted_total"] == before
    assert_recovered(engine, probe)


def test_a_list_that_does_not_fit_beside_the_sequences_in_flight_is_a_503_before_any_prompt_is_admitted(engine, http,
                                                                                                      probe):
    """255 sequences in flight (15 prompts of 17 choices, held streaming; max_queued_requests 256): a list of two
    prompts is refused whole, its 503 counting both, and none of it reaches the engine (no row, no timeline in the
    flight recorder). A refusal part way (a full state table) aborts the prompts admitted before it:
    tests/api/test_admission.py."""
    hold = {"prompt": [f"Count {k}:" for k in range(15)], "n": 17, "max_tokens": 30, "ignore_eos": True,
            "temperature": 0, "stream": True}   # 2 KV blocks per choice: 17 choices of a prompt fit in the pool
    with httpx.Client(base_url=engine.base_url, timeout=60) as client:
        with client.stream("POST", COMP, json=hold) as held:
            assert held.status_code == 200   # its headers: all 255 admitted
            refused = http.post(COMP, json={"prompt": ["a", "b"], "max_tokens": 1},
                                headers={"X-Request-Id": "list-refused-whole"})
            assert_error(refused, 503, "overloaded_error")
            assert "255 sequences in flight, 2 more asked for" in refused.json()["error"]["message"]
            assert probe.rows_with_id("list-refused-whole") == []
    assert http.get("/debug/requests/list-refused-whole").json()["timelines"] == []
    assert_recovered(engine, probe)


def test_echo_returns_the_prompt_before_the_completion(http):
    prompt = "The capital of France is"
    plain = http.post(COMP, json={"prompt": prompt, "max_tokens": 4, "temperature": 0}).json()["choices"][0]["text"]
    echoed = http.post(COMP, json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True}).json()
    assert echoed["choices"][0]["text"] == prompt + plain
    streamed = http.post(COMP, json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True,
                                     "stream": True}).text
    events = [orjson.loads(line[6:]) for line in streamed.splitlines()
              if line.startswith("data: {")]
    assert events[0]["choices"][0]["text"].startswith(prompt)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == prompt + plain


def test_echo_with_logprobs_scores_every_prompt_token_aligned_with_generation(http, engine):
    tokenizer_words = "The quick brown fox jumps over the lazy dog. " * 16   # ~160 tokens: two prefill chunks
    first = http.post(COMP, json={"prompt": tokenizer_words, "max_tokens": 1, "temperature": 0, "logprobs": 2})
    assert first.status_code == 200, first.text
    generated_lp = first.json()["choices"][0]["logprobs"]["token_logprobs"][0]
    prompt_tokens = first.json()["usage"]["prompt_tokens"]
    assert prompt_tokens > 128
    echoed = http.post(COMP, json={"prompt": tokenizer_words, "max_tokens": 1, "temperature": 0, "logprobs": 2,
                                   "echo": True})
    assert echoed.status_code == 200, echoed.text
    choice = echoed.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == prompt_tokens + 1 and "".join(lp["tokens"]) == choice["text"]
    assert choice["text"].startswith(tokenizer_words)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:]) and all(2 <= len(d) <= 3 for d in lp["top_logprobs"][1:])
    assert all(t in d for t, d in zip(lp["tokens"][1:], lp["top_logprobs"][1:]))   # the scored token is always there
    assert lp["text_offset"][:3] == [0, len(lp["tokens"][0]), len(lp["tokens"][0]) + len(lp["tokens"][1])]
    # the generated token's score in the echo equals the same token's score without echo
    assert lp["token_logprobs"][-1] == pytest.approx(generated_lp, abs=1e-4)
    # a repeated sentence is easy to predict: the later copies score far higher than the first
    assert sum(lp["token_logprobs"][-40:-1]) > sum(lp["token_logprobs"][1:40])
    streamed = http.post(COMP, json={"prompt": tokenizer_words, "max_tokens": 1, "temperature": 0, "logprobs": 2,
                                     "echo": True, "stream": True}).text
    events = [orjson.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    tokens = [t for e in events if e["choices"] and e["choices"][0]["logprobs"]
              for t in e["choices"][0]["logprobs"]["tokens"]]
    assert tokens == lp["tokens"]


@pytest.mark.parametrize("prompt_len", [128, 140])   # the scored token opens the second prefill chunk, or is inside it
def test_a_prompt_tokens_echo_score_equals_its_score_as_the_next_token(http, tokenizer, prompt_len):
    ids = [TOKEN + (i * 7) % 500 for i in range(prompt_len)]
    generated = http.post(COMP, json={"prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 0}).json()
    token_text = generated["choices"][0]["logprobs"]["tokens"][0]
    score = generated["choices"][0]["logprobs"]["token_logprobs"][0]
    token_id = tokenizer.encode(token_text)
    assert len(token_id) == 1, token_text
    echoed = http.post(COMP, json={"prompt": ids + token_id, "max_tokens": 1, "temperature": 0, "logprobs": 0,
                                   "echo": True}).json()["choices"][0]["logprobs"]
    assert echoed["tokens"][prompt_len] == token_text
    # the engine's default weights score a generated token in a low-bit decode step (int8-rounded activations) and
    # an echoed prompt token in the float32 prefill: 0.03-0.05 apart here; a score of a neighbouring position
    # would be off by nats
    assert echoed["token_logprobs"][prompt_len] == pytest.approx(score, abs=0.15)


def test_penalties_change_a_greedy_answer_and_are_reproducible(http):
    body = {"prompt": "one one one one one one one one", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    plain = http.post(COMP, json=body).json()["choices"][0]["text"]
    for penalty in ({"repetition_penalty": 2.0}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        first = http.post(COMP, json={**body, **penalty})
        assert first.status_code == 200, first.text
        text = first.json()["choices"][0]["text"]
        if "presence_penalty" not in penalty:   # presence (-2 once per seen token) is too weak to move this answer;
            assert text != plain, (penalty, plain)   # tests/gpu/test_sampling.py checks its formula
        assert http.post(COMP, json={**body, **penalty}).json()["choices"][0]["text"] == text

    def most_repeated_word(text: str) -> int:
        words = re.findall(r"[a-z]+", text.lower())
        return max((words.count(w) for w in words), default=0)

    penalised = http.post(COMP, json={**body, "frequency_penalty": 2.0}).json()["choices"][0]["text"]
    assert most_repeated_word(plain) > most_repeated_word(penalised), (plain, penalised)


def test_S13_sixty_four_children_share_one_prefill_and_an_abort_frees_every_one(engine, http, probe):
    before = sum(v for k, v in scrape(engine.base_url).items()
                 if k.startswith("pdserve_requests_total{finish_reason=abort"))
    # 64 choices of 1 KV block each (prompt + 8 tokens <= 16): they all fit in the 64-block decode pool together
    body = {"prompt": "Count:", "max_tokens": 8, "ignore_eos": True, "n": 64, "stream": True, "temperature": 0.8,
            "seed": 1}
    seen = set()
    with httpx.Client(base_url=engine.base_url, timeout=60) as client:
        with client.stream("POST", COMP, json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    seen.update(c["index"] for c in orjson.loads(line[6:])["choices"])
                if seen:
                    break   # the client goes away with 64 children admitted and most still decoding
    assert_recovered(engine, probe)   # every row final and released, both pools' blocks all free, gauges 0
    wait_until(lambda: sum(v for k, v in scrape(engine.base_url).items()
                           if k.startswith("pdserve_requests_total{finish_reason=abort")) - before == 64,
               timeout_s=10, message="an abort counted for each of the 64 children")
    full = http.post(COMP, json={**body, "stream": False, "max_tokens": 4}).json()
    assert sorted(c["index"] for c in full["choices"]) == list(range(64))
    assert full["usage"]["completion_tokens"] == 64 * 4 and full["usage"]["prompt_tokens"] < 16
    assert_recovered(engine, probe)


def test_greedy_children_hold_the_prompts_full_blocks_once_and_answer_as_the_request_alone(engine, http, probe):
    """n > 1 over the real transport: the children hold the prompt's two full blocks once in the decode pool and
    each pulls its partial last block (a 40-token prompt: 32 + 8 tokens); greedy children equal the request alone."""
    body = {"prompt": [TOKEN + i for i in range(40)], "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    single = http.post(COMP, json=body).json()["choices"][0]["text"]
    _, total = probe.free_blocks()["decode0"]
    shared_held = 2 + 3 * (5 - 2)   # ceil((40 + 40) / 16) = 5 blocks per child, 2 of them shared: 11, not 15
    texts = ["", "", ""]
    with http.stream("POST", COMP, json={**body, "n": 3, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in orjson.loads(line[6:])["choices"]:
                    texts[choice["index"]] += choice["text"]
                if all(texts) and shared_held:   # all three decoding: 40 steps left to look at the pool
                    wait_until(lambda: total - probe.free_blocks()["decode0"][0] == shared_held, 10, 0.01,
                               f"the decode pool to hold {shared_held} blocks for the three children")
                    shared_held = 0
    assert shared_held == 0 and texts == [single] * 3
    assert_recovered(engine, probe)


# ---- keep-alive -----------------------------------------------------------------------------------------------
def read_http1_response(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        more = sock.recv(65536)
        assert more, f"the server closed the connection before answering: {data!r}"
        data += more
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(rest) < length:
        more = sock.recv(65536)
        assert more, "the server closed the connection in the middle of a response"
        rest += more
    return head


def test_http1_idle_connection_is_closed_cleanly_after_keep_alive_but_a_long_request_is_not_cut(engine):
    body = orjson.dumps({"prompt": "Count:", "max_tokens": 1})
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    with socket.create_connection(("127.0.0.1", engine.port), timeout=KEEP_ALIVE_S + 10) as sock:
        sock.sendall(request)
        assert read_http1_response(sock).startswith(b"HTTP/1.1 200")
        sock.sendall(request)   # the same connection is reused while it is not idle
        assert read_http1_response(sock).startswith(b"HTTP/1.1 200")
        idle_from = time.monotonic()
        assert sock.recv(1) == b""          # an orderly close (FIN), not a reset (which would raise)
        idle = time.monotonic() - idle_from
    assert KEEP_ALIVE_S * 0.5 < idle < KEEP_ALIVE_S + 5, idle
    with httpx.Client(base_url=engine.base_url, timeout=60) as client:   # a request longer than keep-alive
        start = time.monotonic()
        long = client.post(COMP, json={"prompt": "Count:", "max_tokens": 160, "ignore_eos": True, "stream": True})
        assert long.status_code == 200 and long.text.rstrip().endswith("data: [DONE]")
        assert time.monotonic() - start > KEEP_ALIVE_S, "the request should outlast the keep-alive timeout"


class RawH2:
    """A raw h2 client on one socket (plain or TLS), recording when each frame event arrived."""

    def __init__(self, sock: socket.socket, scheme: str):
        import h2.config
        import h2.connection

        self.sock, self.scheme = sock, scheme
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self.sock.sendall(self.conn.data_to_send())
        self.events: list[tuple[float, object]] = []   # (time.monotonic(), h2 event)
        self.eof_at: float | None = None

    def request(self, path: str, body: dict | None = None) -> int:
        stream = self.conn.get_next_available_stream_id()
        headers = [(":method", "GET" if body is None else "POST"), (":path", path), (":scheme", self.scheme),
                   (":authority", "127.0.0.1")]
        data = orjson.dumps(body) if body is not None else b""
        if body is not None:
            headers += [("content-type", "application/json"), ("content-length", str(len(data)))]
        self.conn.send_headers(stream, headers, end_stream=body is None)
        if body is not None:
            self.conn.send_data(stream, data, end_stream=True)
        self.sock.sendall(self.conn.data_to_send())
        return stream

    def read_until(self, done) -> None:
        """Read frames until ``done(events)`` or EOF (an orderly close; a reset raises from recv)."""
        import h2.events

        while not done([e for _, e in self.events]):
            data = self.sock.recv(65536)
            if not data:
                self.eof_at = time.monotonic()
                return
            now = time.monotonic()
            for event in self.conn.receive_data(data):
                self.events.append((now, event))
                if isinstance(event, h2.events.DataReceived):
                    self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            pending = self.conn.data_to_send()
            if pending:
                self.sock.sendall(pending)

    def ended_at(self, stream: int) -> float:
        import h2.events

        return next(t for t, e in self.events if isinstance(e, h2.events.StreamEnded) and e.stream_id == stream)

    def body(self, stream: int) -> bytes:
        import h2.events

        return b"".join(e.data for _, e in self.events if isinstance(e, h2.events.DataReceived)
                        and e.stream_id == stream)


def check_h2_idle_goaway(client: RawH2) -> None:
    """One short request, then at once a streamed one that outlasts keep_alive_timeout_s (the idle timer of the
    first would fire under it: it must not be cut), then idleness: GOAWAY(NO_ERROR, last stream = the streamed
    request) after keep_alive_timeout_s, then an orderly close."""
    import h2.errors
    import h2.events

    def stream_ended(stream):
        return lambda events: any(isinstance(e, h2.events.StreamEnded) and e.stream_id == stream for e in events)

    first = client.request("/health")
    client.read_until(stream_ended(first))
    long_start = time.monotonic()
    long = client.request(COMP, {"prompt": "Count:", "max_tokens": 160, "ignore_eos": True, "stream": True})
    client.read_until(stream_ended(long))
    assert client.eof_at is None, "the connection was closed under a request in progress"
    long_end = client.ended_at(long)
    assert long_end - long_start > KEEP_ALIVE_S, "the request should outlast the keep-alive timeout"
    assert client.body(long).rstrip().endswith(b"data: [DONE]"), client.body(long)[-300:]
    statuses = [dict(e.headers)[b":status"] for _, e in client.events if isinstance(e, h2.events.ResponseReceived)]
    assert statuses == [b"200", b"200"], statuses
    client.read_until(lambda events: False)   # until EOF
    goaways = [(t, e) for t, e in client.events if isinstance(e, h2.events.ConnectionTerminated)]
    assert len(goaways) == 1, f"expected one GOAWAY before the close, got {client.events[-3:]}"
    goaway_at, goaway = goaways[0]
    assert goaway.error_code == h2.errors.ErrorCodes.NO_ERROR, goaway
    assert goaway.last_stream_id == long, goaway
    assert client.eof_at is not None and client.eof_at >= goaway_at
    idle = goaway_at - long_end
    assert KEEP_ALIVE_S * 0.5 < idle < KEEP_ALIVE_S + 5, idle


def test_http2_idle_connection_gets_goaway_after_keep_alive_but_a_long_request_is_not_cut(engine):
    with socket.create_connection(("127.0.0.1", engine.port), timeout=KEEP_ALIVE_S + 30) as sock:
        check_h2_idle_goaway(RawH2(sock, "http"))


TCP_CLOSE = 7   # tcp_info.tcpi_state on Linux (include/net/tcp_states.h)


def tcp_state(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]


def test_http1_idle_close_is_staged_so_a_request_crossing_it_sees_a_clean_eof_not_a_reset(engine):
    """RFC 9112 section 9.6: at keep_alive_timeout_s the server half-closes (FIN) and keeps reading. A request the
    client sent before it noticed the FIN (sent here right after the FIN, the moment a racing request arrives) is
    read and discarded: the client sees EOF and then an orderly close. Had the server closed the socket outright,
    the request would have been answered by a reset (SO_ERROR EPIPE, or ENOTCONN from shutdown)."""
    body = orjson.dumps({"prompt": "Count:", "max_tokens": 1})
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    with socket.create_connection(("127.0.0.1", engine.port), timeout=KEEP_ALIVE_S + 10) as sock:
        sock.sendall(request)
        head = read_http1_response(sock)
        assert head.startswith(b"HTTP/1.1 200")
        assert f"\r\nkeep-alive: timeout={int(KEEP_ALIVE_S)}".encode() in head.lower(), head
        assert sock.recv(1) == b""   # the server's FIN: it half-closed the idle connection
        sock.sendall(request)        # the request that crossed the close
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError as exc:
            pytest.fail(f"the server reset the connection under the racing request: {exc!r}")
        wait_until(lambda: tcp_state(sock) == TCP_CLOSE, 10, 0.01, "the connection to close")
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0, "the server reset the connection"
        assert sock.recv(1) == b""


def test_http2_responses_carry_no_keep_alive_header(engine):
    with httpx.Client(http1=False, http2=True, base_url=engine.base_url, timeout=30) as client:
        response = client.get("/v1/models")
    assert response.http_version == "HTTP/2" and "keep-alive" not in response.headers


def h2_refused(client: RawH2) -> list[int]:
    import h2.errors
    import h2.events

    return sorted(e.stream_id for _, e in client.events if isinstance(e, h2.events.StreamReset)
                  and e.error_code == h2.errors.ErrorCodes.REFUSED_STREAM)


def h2_statuses(client: RawH2) -> dict[int, bytes]:
    import h2.events

    return {e.stream_id: dict(e.headers)[b":status"] for _, e in client.events
            if isinstance(e, h2.events.ResponseReceived)}


def h2_follow_up_keeps_hpack_in_step(client: RawH2, request_id: str) -> None:
    """A request whose X-Request-Id the client's HPACK encoder sends as an index into the dynamic table entry that
    a refused stream's header block added: the server must have decoded that block to read it back right (the
    response echoes the id it read)."""
    import h2.events

    found = client.conn.encoder.header_table.search(b"x-request-id", request_id.encode())
    assert found and found[2] is not None and found[0] > 61, "the id should be in the encoder's dynamic table"
    data = orjson.dumps(comp(max_tokens=1))
    stream = client.conn.get_next_available_stream_id()
    client.conn.send_headers(stream, [(":method", "POST"), (":path", COMP), (":scheme", "http"),
                                      (":authority", "127.0.0.1"), ("content-type", "application/json"),
                                      ("content-length", str(len(data))), ("x-request-id", request_id)])
    client.conn.send_data(stream, data, end_stream=True)
    client.sock.sendall(client.conn.data_to_send())
    client.read_until(lambda events: any(isinstance(e, h2.events.StreamEnded) and e.stream_id == stream
                                         for e in events))
    response = next(dict(e.headers) for _, e in client.events
                    if isinstance(e, h2.events.ResponseReceived) and e.stream_id == stream)
    assert response[b":status"] == b"200" and response[b"x-request-id"] == request_id.encode(), response
    assert not [e for _, e in client.events if isinstance(e, h2.events.ConnectionTerminated)]


@pytest.mark.parametrize("streams", [101, 150])
def test_http2_streams_over_the_limit_in_one_flight_are_refused_and_the_others_answered(engine, streams):
    """RFC 9113 section 5.1.2: the server advertises 100 concurrent streams; a client that opens more before it has
    read that SETTINGS gets RST_STREAM(REFUSED_STREAM) on the extra ones only (safe to retry), the first 100 are
    answered, the connection lives on and HPACK state stays in step."""
    import h2.events

    with socket.create_connection(("127.0.0.1", engine.port), timeout=60) as sock:
        client = RawH2(sock, "http")   # preface + SETTINGS sent; the server's SETTINGS not read yet
        ids = []
        for i in range(streams):
            stream = client.conn.get_next_available_stream_id()
            client.conn.send_headers(stream, [(":method", "GET"), (":path", "/v1/models"), (":scheme", "http"),
                                              (":authority", "127.0.0.1"), ("x-request-id", f"flight-{i}")],
                                     end_stream=True)
            ids.append(stream)
        sock.sendall(client.conn.data_to_send())   # every HEADERS frame in one flight
        done = lambda events: len({e.stream_id for e in events if isinstance(e, (h2.events.StreamEnded,  # noqa: E731
                                                                               h2.events.StreamReset))}) == streams
        client.read_until(done)
        assert not [e for _, e in client.events if isinstance(e, h2.events.ConnectionTerminated)], client.events[-3:]
        assert h2_refused(client) == ids[100:]
        statuses = h2_statuses(client)
        assert sorted(statuses) == ids[:100] and set(statuses.values()) == {b"200"}
        h2_follow_up_keeps_hpack_in_step(client, f"flight-{streams - 1}")


def test_http2_one_stream_over_the_limit_next_to_a_live_stream_is_refused_and_the_stream_goes_on(engine):
    """A completion is streaming and 99 other streams are open (requests waiting for their bodies); one more
    stream is refused with REFUSED_STREAM while the completion streams on to [DONE]."""
    import h2.errors
    import h2.events
    import h2.exceptions

    with socket.create_connection(("127.0.0.1", engine.port), timeout=60) as sock:
        client = RawH2(sock, "http")
        live = client.request(COMP, {"prompt": "Count:", "max_tokens": 60, "ignore_eos": True, "stream": True})
        client.read_until(lambda events: any(isinstance(e, h2.events.DataReceived) and e.stream_id == live
                                             for e in events))
        waiting = []
        for _ in range(99):
            stream = client.conn.get_next_available_stream_id()
            client.conn.send_headers(stream, [(":method", "POST"), (":path", COMP), (":scheme", "http"),
                                              (":authority", "127.0.0.1"), ("content-type", "application/json"),
                                              ("content-length", "40")])   # its body never comes
            waiting.append(stream)
        extra = client.conn.get_next_available_stream_id()
        limit = client.conn.remote_settings.max_concurrent_streams
        assert limit == 100 and client.conn.open_outbound_streams == limit
        client.conn.remote_settings = OverTheLimit(client.conn.remote_settings)   # h2 would refuse to send it
        try:
            client.conn.send_headers(extra, [(":method", "GET"), (":path", "/v1/models"), (":scheme", "http"),
                                             (":authority", "127.0.0.1"), ("x-request-id", "one-over")],
                                     end_stream=True)
        finally:
            client.conn.remote_settings = client.conn.remote_settings.settings
        sock.sendall(client.conn.data_to_send())
        client.read_until(lambda events: any(isinstance(e, h2.events.StreamEnded) and e.stream_id == live
                                             for e in events) and extra in h2_refused(client))
        assert not [e for _, e in client.events if isinstance(e, h2.events.ConnectionTerminated)], client.events[-3:]
        assert h2_refused(client) == [extra] and h2_statuses(client)[live] == b"200"
        text = client.body(live)
        assert text.rstrip().endswith(b"data: [DONE]") and b'"error"' not in text, text[-300:]
        for stream in waiting:   # let the waiting requests go (those not answered 408 yet)
            try:
                client.conn.reset_stream(stream, h2.errors.ErrorCodes.CANCEL)
            except h2.exceptions.StreamClosedError:
                pass
        sock.sendall(client.conn.data_to_send())
        h2_follow_up_keeps_hpack_in_step(client, "one-over")


class OverTheLimit:
    """A client's view of the server's settings with no stream limit, so the test can overrun it on purpose."""

    max_concurrent_streams = 2**31 - 1

    def __init__(self, settings):
        self.settings = settings

    def __getattr__(self, name):
        return getattr(self.settings, name)


def test_http2_connection_that_never_sends_a_request_is_closed_after_keep_alive(engine):
    import h2.events

    with socket.create_connection(("127.0.0.1", engine.port), timeout=KEEP_ALIVE_S + 30) as sock:
        start = time.monotonic()
        client = RawH2(sock, "http")   # the preface and SETTINGS, then nothing
        client.read_until(lambda events: False)   # until EOF
        goaways = [t for t, e in client.events if isinstance(e, h2.events.ConnectionTerminated)]
        assert goaways, client.events
        # the server's idle timer starts when it has read the preface, after ``start``: never sooner
        assert KEEP_ALIVE_S - 0.05 <= goaways[0] - start < KEEP_ALIVE_S + 5, goaways[0] - start
        assert client.eof_at is not None and goaways[0] <= client.eof_at < start + KEEP_ALIVE_S + 5


@pytest.mark.parametrize("http2", [False, True], ids=["http1", "http2"])
def test_a_body_that_stops_arriving_gets_a_408_and_frees_the_handler(engine, http, probe, http2):
    with socket.create_connection(("127.0.0.1", engine.port), timeout=BODY_READ_TIMEOUT_S + 30) as sock:
        start = time.monotonic()
        if http2:
            import h2.events

            client = RawH2(sock, "http")
            stream = client.conn.get_next_available_stream_id()
            client.conn.send_headers(stream, [(":method", "POST"), (":path", COMP), (":scheme", "http"),
                                              (":authority", "127.0.0.1"), ("content-type", "application/json"),
                                              ("content-length", "100")])
            client.conn.send_data(stream, b'{"prompt": "')   # 12 of 100 bytes, then silence
            sock.sendall(client.conn.data_to_send())
            client.read_until(lambda events: any(isinstance(e, h2.events.StreamEnded) for e in events))
            status = [dict(e.headers)[b":status"] for _, e in client.events
                      if isinstance(e, h2.events.ResponseReceived)]
            assert status == [b"408"], client.events
        else:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompt\": \"")
            head = sock.recv(65536)
            assert head.startswith(b"HTTP/1.1 408"), head
            assert b"timeout_error" in head or b"timeout_error" in sock.recv(65536)
        assert BODY_READ_TIMEOUT_S * 0.5 < time.monotonic() - start < BODY_READ_TIMEOUT_S + 5
    still_serving(http)
    assert_recovered(engine, probe)


# ---- TLS ------------------------------------------------------------------------------------------------------
def self_signed(tmp_path):
    """A self-signed cert for 127.0.0.1/localhost: with `cryptography` if installed, else the openssl CLI."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    try:
        import datetime
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        import shutil

        if not shutil.which("openssl"):
            pytest.skip("neither the cryptography package nor the openssl CLI is available to make a test cert")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                        "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                        "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
        return cert, key
    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(private.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                               x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                  critical=False)
                   .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                   .sign(private, hashes.SHA256()))
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return cert, key


def test_tls_serves_h2_via_alpn_and_http1_to_clients_without_h2(tmp_path):
    import os
    import re
    import ssl

    cert, key = self_signed(tmp_path)
    port = free_port()
    log_path = tmp_path / "tls-engine.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port), "--kv-pool-tokens",
                                 "512", "--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--keep-alive-timeout-s",
                                 str(KEEP_ALIVE_S)],
                                cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    from tests.conftest import EngineProcess, descendants

    eng = EngineProcess(proc, port, log_path)
    context = ssl.create_default_context(cafile=str(cert))
    base = f"https://127.0.0.1:{port}"

    def ready():
        if proc.poll() is not None:
            raise RuntimeError(f"TLS engine exited with {proc.returncode}:\n{eng.log_text()[-3000:]}")
        match = re.search(r"pdserve engine (\w+) serving", eng.log_text())
        if match:
            eng.engine_id = match.group(1)
            eng.child_pids = descendants(proc.pid)
        return match and httpx.get(base + "/health", verify=context, timeout=2).status_code == 200

    try:
        wait_until(ready, 180, 0.2, "the TLS engine to answer /health over https")
        body = {"prompt": "Hello", "max_tokens": 2}
        with httpx.Client(http2=True, verify=context, timeout=60) as h2_client:
            response = h2_client.post(base + COMP, json=body)
            assert response.status_code == 200 and response.http_version == "HTTP/2", response
        with httpx.Client(http1=True, http2=False, verify=context, timeout=60) as h1_client:
            response = h1_client.post(base + COMP, json=body)
            assert response.status_code == 200 and response.http_version == "HTTP/1.1", response
        with pytest.raises(httpx.HTTPError):   # cleartext against the TLS port is refused, not served
            httpx.post(f"http://127.0.0.1:{port}" + COMP, json=body, timeout=10)
        # an idle TLS/ALPN h2 connection gets GOAWAY too, and a long request is not cut
        context.set_alpn_protocols(["h2"])
        with socket.create_connection(("127.0.0.1", port), timeout=KEEP_ALIVE_S + 30) as raw, \
                context.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
            assert sock.selected_alpn_protocol() == "h2"
            check_h2_idle_goaway(RawH2(sock, "https"))
    finally:
        cleanup_engine(eng)


def test_a_seeded_request_is_answered_and_reproducible(engine, http, probe):
    body = comp(prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=1234)
    first, second = http.post(COMP, json=body), http.post(COMP, json=body)
    assert first.status_code == 200 and second.status_code == 200, first.text
    assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]
    assert_recovered(engine, probe)
