"""A bug at any step of any dialect's exchange after admission (the ``exchange_bug`` fault, pdserve/faults.py,
aimed by ``X-Request-Id`` prefix at the session's fault engine) releases everything: each request gets a 500 in its
dialect's shape (a stream: its headers are out, so its dialect's error event), counted as an error, and afterwards
every queue gauge is 0, no row is live, every KV block is free and the next request is served."""
from __future__ import annotations

import httpx
import pytest

from pdserve.faults import EXCHANGE_STEPS
from tests.conftest import FRANCE_QUESTION, assert_recovered, scrape

MESSAGES = [{"role": "user", "content": FRANCE_QUESTION}]
ROUTES = {   # dialect -> (path, body without stream)
    "chat": ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3}),
    "completion": ("/v1/completions", {"prompt": "The three primary colors are", "max_tokens": 3}),
    "responses": ("/v1/responses", {"input": FRANCE_QUESTION, "max_output_tokens": 3}),
    "messages": ("/v1/messages", {"messages": MESSAGES, "max_tokens": 3}),
}
CASES = [(dialect, stream, step) for dialect in ROUTES for stream in (False, True) for step in EXCHANGE_STEPS
         if stream or step != "start"]   # a full answer has no start


def error_message(dialect: str, answer: httpx.Response, stream: bool) -> str:
    """The error's message in the dialect's shape (a stream's error event, or the JSON body)."""
    if stream and answer.status_code == 200:
        assert answer.headers["content-type"].startswith("text/event-stream")
        return answer.text   # the error event is the last one; its words are checked by the caller
    body = answer.json()
    if dialect == "messages":
        assert body["type"] == "error"
    return body["error"]["message"]


def test_a_bug_at_every_step_of_every_dialect_releases_everything(fault_engine, fault_probe):
    url = fault_engine.base_url
    before = scrape(url).get('pdserve_requests_total{finish_reason=error,status=500}', 0)
    with httpx.Client(timeout=60) as client:
        for dialect, stream, step in CASES:
            path, body = ROUTES[dialect]
            answer = client.post(url + path, json={**body, "stream": stream},
                                 headers={"X-Request-Id": f"xbug-{step}-{dialect}-{int(stream)}"})
            where = (dialect, stream, step)
            if stream and step in ("start", "event", "finish"):   # past the headers: the stream's error event
                assert answer.status_code == 200, where
            else:
                assert answer.status_code == 500, (where, answer.text)
            assert "internal error; see the server log" in error_message(dialect, answer, stream), where
    assert_recovered(fault_engine, fault_probe)
    after = scrape(url)['pdserve_requests_total{finish_reason=error,status=500}']
    assert after - before == len(CASES)   # each counted once, as an error
    log = fault_engine.log_text()
    assert all(f"injected fault exchange_bug at step {step}" in log for step in EXCHANGE_STEPS)
