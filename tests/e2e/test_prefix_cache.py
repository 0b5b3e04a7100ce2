"""The prefix cache end to end, on one engine with a small pool (32 blocks of 16 tokens): usage reports the cached
tokens, greedy output equals output computed without the cache (an echo-with-logprobs request skips the cache
lookup: it needs every prompt position's logits), the metrics and tools/inspect show the cache, and a cache
evicted under pressure still gives the same output. Faults with cached blocks held: tests/e2e/test_watchdog.py
(its recovery check requires every cached block released)."""
from __future__ import annotations

import httpx
import pytest

from tests.conftest import assert_recovered, cleanup_engine, probe_fixture, scrape, start_engine
from tools import inspect

BT = 16
PROMPT = [(i * 7919) % 30000 + 200 for i in range(70)]   # token ids: 4 full blocks, 6 tokens in a fifth
NEW = 8


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = start_engine(tmp_path_factory.mktemp("prefix"), "--kv-pool-tokens", str(32 * BT))
    yield eng
    cleanup_engine(eng)


probe = probe_fixture()


def complete(engine, prompt: list[int], **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True, "logprobs": 0, **extra}
    response = httpx.post(engine.base_url + "/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def generated(body: dict) -> list[str]:
    return body["choices"][0]["logprobs"]["tokens"][-NEW:]


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_repeats_and_a_prefix_shared_mid_block_come_from_the_cache_with_unchanged_greedy_output(engine, probe):
    first = complete(engine, PROMPT)
    again = complete(engine, PROMPT)
    assert (cached(first), cached(again)) == (0, 64)   # the block holding the last token is always computed
    assert generated(again) == generated(first)
    shared = PROMPT[:37] + [t + 1 for t in PROMPT[37:60]]   # shares 2 blocks + 5 tokens of a third
    with_cache = complete(engine, shared)
    without = complete(engine, shared, echo=True)   # prompt logprobs: computed from position 0
    assert (cached(with_cache), cached(without)) == (32, 0)
    assert generated(with_cache) == generated(without)
    metrics = scrape(engine.base_url)
    assert metrics["pdserve_prefix_cache_hit_tokens_total{actor=prefill0}"] == 64 + 32
    # the echo request looked nothing up
    assert metrics["pdserve_prefix_cache_query_tokens_total{actor=prefill0}"] == 2 * len(PROMPT) + len(shared)
    assert metrics["pdserve_prefix_cache_cached_blocks{actor=prefill0}"] >= 4 + 1
    [prefill] = [a for a in inspect.EngineView(engine.engine_id).snapshot(0.01)["actors"] if a["name"] == "prefill0"]
    assert prefill["prefix_cache"]["hit_tokens"] == 96 and prefill["prefix_cache"]["in_use_blocks"] == 0
    assert_recovered(engine, probe)


def test_a_cache_evicted_under_pressure_gives_the_same_greedy_output(engine, probe):
    first = complete(engine, PROMPT)
    evicted_before = scrape(engine.base_url)["pdserve_prefix_cache_evicted_blocks_total{actor=prefill0}"]
    for k in range(3):   # 3 x 12 full blocks of other prompts through a 32-block pool
        complete(engine, [(t + 1000 * (k + 1)) % 30000 + 200 for t in PROMPT + PROMPT + PROMPT[:50]])
    assert scrape(engine.base_url)["pdserve_prefix_cache_evicted_blocks_total{actor=prefill0}"] > evicted_before
    again = complete(engine, PROMPT)
    assert cached(again) < 64, "nothing of the first prompt was evicted"
    assert generated(again) == generated(first)
    assert_recovered(engine, probe)
    assert scrape(engine.base_url)["pdserve_kv_cache_usage_ratio"] == 0   # evictable cached blocks count as free
