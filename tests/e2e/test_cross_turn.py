"""Cross-turn KV reuse end to end (docs/architecture.md, "Cross-turn reuse"), on one engine with the default
disaggregated 1 x 1 layout: a finished answer's KV is handed back from the decode pool to the prefill actor's prefix
cache, so the next turn of a chat reports cached tokens covering the previous answer (up to where the chat template
re-renders it), greedy output with the reuse equals output computed without any cached prefix (an echo-with-logprobs
request skips the cache lookup), and a request aborted mid-decode hands nothing back and leaves no block held.
The engine runs ``--weights float32``: there decode and prefill compute a token's KV from the same weights; under
``auto`` the answer's KV comes from the int8-activation decode path and can part from a recomputation at a near tie
(docs/architecture.md, "Cross-turn reuse")."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.conftest import assert_recovered, cleanup_engine, probe_fixture, scrape, start_engine, wait_until

SYSTEM = "You are a terse assistant. Answer in one short sentence."


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = start_engine(tmp_path_factory.mktemp("crossturn"), "--kv-pool-tokens", str(64 * 16), "--weights", "float32")
    yield eng
    cleanup_engine(eng)


probe = probe_fixture()


def post(engine, path: str, body: dict) -> dict:
    response = httpx.post(engine.base_url + path, json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_the_next_chat_turn_finds_the_previous_answer_cached(engine, probe):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour of the sky."}]
    first = post(engine, "/v1/chat/completions", {"messages": messages, "max_tokens": 24, "temperature": 0})
    answer = first["choices"][0]["message"]["content"]
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And of grass?"}]
    second = post(engine, "/v1/chat/completions", {"messages": messages, "max_tokens": 4, "temperature": 0})
    turn1 = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    # all of turn 1 but its last token (no KV) and what the template renders differently at the answer's end
    assert cached(second) >= turn1 - 3, (cached(second), first["usage"], second["usage"])
    metrics = scrape(engine.base_url)
    assert metrics["pdserve_kv_hand_back_blocks_total{actor=prefill0}"] >= 1
    assert metrics["pdserve_kv_hand_backs_dropped_total{actor=decode0}"] == 0
    assert metrics["pdserve_kv_hand_backs_dropped_total{actor=prefill0}"] == 0
    assert_recovered(engine, probe)


def test_greedy_output_with_the_previous_answer_reused_equals_output_computed_without_cache(engine, probe):
    prompt = "The history of the printing press begins"
    body = {"max_tokens": 20, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    first = post(engine, "/v1/completions", {"prompt": prompt, **body})
    turn2 = prompt + first["choices"][0]["text"] + " In short,"
    reused = post(engine, "/v1/completions", {"prompt": turn2, **body})
    computed = post(engine, "/v1/completions", {"prompt": turn2, **body, "echo": True})   # no cache lookup
    assert cached(reused) >= first["usage"]["prompt_tokens"] + 20 - 4 and cached(computed) == 0
    assert reused["choices"][0]["logprobs"]["tokens"] == computed["choices"][0]["logprobs"]["tokens"][-20:]
    assert_recovered(engine, probe)


def test_a_request_aborted_mid_decode_hands_nothing_back_and_holds_nothing(engine, probe):
    before = scrape(engine.base_url)["pdserve_kv_hand_back_blocks_total{actor=prefill0}"]

    async def abort_mid_decode():
        async with httpx.AsyncClient(base_url=engine.base_url, timeout=300) as client:
            body = {"prompt": "Count slowly from one to one hundred:", "max_tokens": 400, "ignore_eos": True,
                    "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                chunks = 0
                async for line in response.aiter_lines():
                    chunks += line.startswith("data: {")
                    if chunks >= 40:   # prompt + answer: 3 blocks and more
                        break   # leaving the block closes the connection: the engine aborts the request
    asyncio.run(abort_mid_decode())
    wait_until(lambda: not probe.live_rows(), 30, 0.1, "the aborted request's row to end")
    assert_recovered(engine, probe)   # every decode and prefill block free, no cached block held
    # the probe request of assert_recovered (after the abort in prefill's queue) is handed back, one partial
    # block at most; the aborted one (3 blocks and more) is not
    assert scrape(engine.base_url)["pdserve_kv_hand_back_blocks_total{actor=prefill0}"] - before <= 1
