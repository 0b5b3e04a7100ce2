"""Bounded admission: with ``--max-queued-requests 2`` the API holds at most two admitted-but-unfinished requests
(decoding ones count, not only queued ones); the excess gets an immediate 503 with Retry-After and an OpenAI error
body, over HTTP/1.1 and HTTP/2, streamed or not, never a 500 or a hang; the admitted ones complete and the engine
recovers.

Why 503 and not 429: the bound is the server's capacity, shared by every client, not a per-client rate limit
(what 429 means in OpenAI's API); the same error also answers while draining. SGLang's ``--max-queued-requests``
answered 503 too (it later moved to 429 + ``Retry-After: 0``, type ``rate_limit_error``, so that routers retry
elsewhere at once); vLLM's OpenAI server has no admission bound. One engine for the module."""
from __future__ import annotations

import asyncio
import time

import httpx
import orjson
import pytest

from tests.conftest import assert_recovered, cleanup_engine, probe_fixture, scrape, start_engine

MAX_QUEUED = 2
HOLD_TOKENS = 64        # long enough that both holders are still decoding while the flood is answered
FLOOD = 8               # excess requests, half over HTTP/1.1 (one connection each), half over one HTTP/2 connection
ANSWER_WITHIN_S = 10.0  # a refusal is immediate; this only bounds a hang


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = start_engine(tmp_path_factory.mktemp("admission"), "--kv-pool-tokens", "1024",
                       "--max-queued-requests", str(MAX_QUEUED))
    yield eng
    cleanup_engine(eng)


probe = probe_fixture()


async def hold(client: httpx.AsyncClient, request_id: str, started: asyncio.Event) -> tuple[int, str]:
    """A long streamed completion; ``started`` is set at its first SSE event (it is admitted and generating)."""
    body = {"prompt": "Count:", "max_tokens": HOLD_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    parts = []
    async with client.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": request_id}) as resp:
        async for text in resp.aiter_text():
            parts.append(text)
            if "data: " in "".join(parts):
                started.set()
        return resp.status_code, "".join(parts)


async def excess(client: httpx.AsyncClient, i: int) -> tuple[int, dict, bytes, float]:
    """One request over the bound: chat or completion, streamed or not."""
    route, body = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
                   if i % 2 else ("/v1/completions", {"prompt": "Hello", "max_tokens": 4}))
    body["stream"] = i % 4 >= 2
    start = time.monotonic()
    try:
        resp = await asyncio.wait_for(client.post(route, json=body, headers={"X-Request-Id": f"excess-{i}"}),
                                      ANSWER_WITHIN_S)
    except asyncio.TimeoutError:
        raise AssertionError(f"excess request {i} ({route}) got no answer within {ANSWER_WITHIN_S} s") from None
    return resp.status_code, dict(resp.headers), resp.content, time.monotonic() - start


def test_requests_over_max_queued_requests_get_503_with_retry_after_and_the_admitted_ones_complete(engine, probe):
    from ipc.state_table import RequestState

    admitted_before = scrape(engine.base_url)["pdserve_requests_admitted_total"]

    async def scenario():
        holders = [httpx.AsyncClient(base_url=engine.base_url, timeout=120) for _ in range(MAX_QUEUED)]
        h1 = [httpx.AsyncClient(base_url=engine.base_url, timeout=60) for _ in range(FLOOD // 2)]
        h2 = httpx.AsyncClient(base_url=engine.base_url, http1=False, http2=True, timeout=60)
        try:
            started = [asyncio.Event() for _ in holders]
            holding = [asyncio.ensure_future(hold(c, f"holder-{i}", started[i])) for i, c in enumerate(holders)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            rows = probe.live_rows()
            # both slots are taken by requests past the queue: the bound counts admitted-but-unfinished requests
            assert sorted((r["request_id"], r["state"]) for r in rows) == [
                ("holder-0", RequestState.DECODING), ("holder-1", RequestState.DECODING)], rows
            clients = h1 + [h2] * (FLOOD - len(h1))
            refused = await asyncio.gather(*(excess(c, i) for i, c in enumerate(clients)))
            still_holding = [not task.done() for task in holding]
            held = await asyncio.wait_for(asyncio.gather(*holding), 120)
            return refused, still_holding, held
        finally:
            for c in holders + h1 + [h2]:
                await c.aclose()

    refused, still_holding, held = asyncio.run(scenario())
    assert all(still_holding), "a holder finished before the flood was answered: the test did not load the bound"
    for i, (status, headers, content, elapsed) in enumerate(refused):
        assert status == 503, (i, status, content[:300])
        assert headers.get("retry-after", "").isdigit() and int(headers["retry-after"]) >= 0, headers
        assert headers["content-type"].startswith("application/json"), headers   # also for stream=True
        error = orjson.loads(content)["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["type"] == "overloaded_error" and "max_queued_requests" in error["message"], error
        assert elapsed < 2.0, (i, elapsed)
    for status, text in held:
        assert status == 200 and text.rstrip().endswith("data: [DONE]"), text[-300:]
        usage = orjson.loads([line for line in text.splitlines() if '"usage"' in line][-1][6:])["usage"]
        assert usage["completion_tokens"] == HOLD_TOKENS, usage
    # the refused requests never reached the engine: no row, no admission
    assert scrape(engine.base_url)["pdserve_requests_admitted_total"] == admitted_before + MAX_QUEUED
    assert all(probe.rows_with_id(f"excess-{i}") == [] for i in range(FLOOD))
    assert_recovered(engine, probe)


def test_requests_up_to_the_bound_are_all_admitted_and_capacity_frees_as_they_finish(engine, probe):
    """Exactly MAX_QUEUED at once are served; done one after another, many more than the bound are served."""
    async def scenario():
        async with httpx.AsyncClient(base_url=engine.base_url, timeout=60) as client:
            at_once = await asyncio.gather(*(client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4})
                                             for _ in range(MAX_QUEUED)))
            serial = [await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
                      for _ in range(3 * MAX_QUEUED)]
            return at_once + serial

    responses = asyncio.run(scenario())
    assert [r.status_code for r in responses] == [200] * len(responses), [r.text[:200] for r in responses]
    assert_recovered(engine, probe)


def test_n_over_the_bound_is_a_400_naming_n_not_a_retry_later_503(engine, probe):
    response = httpx.post(engine.base_url + "/v1/completions", timeout=30,
                          json={"prompt": "Hi", "max_tokens": 2, "n": MAX_QUEUED + 1})
    assert response.status_code == 400, response.text
    assert "retry-after" not in response.headers
    error = response.json()["error"]
    assert error["param"] == "n" and error["type"] == "invalid_request_error"
    exactly = httpx.post(engine.base_url + "/v1/completions", timeout=60,
                         json={"prompt": "Hi", "max_tokens": 2, "n": MAX_QUEUED})
    assert exactly.status_code == 200 and len(exactly.json()["choices"]) == MAX_QUEUED
    assert_recovered(engine, probe)


@pytest.mark.parametrize("field", ["metadata", "reasoning", "user"])
def test_deeply_nested_echoed_fields_are_400s_that_hold_no_admission(engine, probe, field):
    """256 streamed /v1/responses bodies with an echoed field nested 300 levels deep (past orjson's 255 output
    levels: once a 500 after admission; before the exchange, a slot held for good): each is a 400 naming the
    field, before admission, and then more requests than ``max_queued_requests`` are served one after another."""
    deep = b'{"a":' * 300 + b'"x"' + b"}" * 300   # orjson itself writes at most 255 levels
    body = b'{"input": "hi", "max_output_tokens": 2, "stream": true, "' + field.encode() + b'": ' + deep + b"}"
    with httpx.Client(timeout=ANSWER_WITHIN_S) as client:
        for _ in range(256):
            answer = client.post(engine.base_url + "/v1/responses", content=body,
                                 headers={"Content-Type": "application/json"})
            assert answer.status_code == 400 and answer.json()["error"]["param"] == field, answer.text
        for _ in range(MAX_QUEUED + 1):
            answer = client.post(engine.base_url + "/v1/responses", json={"input": "hi", "max_output_tokens": 2},
                                 timeout=60)
            assert answer.status_code == 200, answer.text
    assert_recovered(engine, probe)
