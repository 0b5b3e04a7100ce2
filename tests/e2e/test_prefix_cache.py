"""The prefix cache end to end, on one engine with a small pool (32 blocks of 16 tokens): usage reports the cached
tokens, reused to the token (hits ending mid-block: the cached rows are copied into the request's own block),
greedy output equals output computed without the cache (an echo-with-logprobs request skips the cache lookup: it
needs every prompt position's logits), the metrics and tools/inspect show the cache (hit tokens not a multiple of
the block), a cache evicted under pressure still gives the same output, identical prompts aborted mid-prefill leave
nothing in the cache (their KV was never complete), and a request aborted after a mid-block hit holds nothing.
Faults with cached blocks held: tests/e2e/test_watchdog.py (its recovery check requires every cached block
released)."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from ipc.state_table import RequestState as S

from tests.conftest import assert_recovered, cleanup_engine, probe_fixture, scrape, start_engine, wait_until
from tools import inspect

BT = 16
PROMPT = [(i * 7919) % 30000 + 200 for i in range(70)]   # token ids: 4 full blocks, 6 tokens in a fifth
NEW = 8
SLOW = "slowcache-"   # requests whose prompt chunks each take 1 s longer (a fault aimed by X-Request-Id)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = start_engine(tmp_path_factory.mktemp("prefix"), "--kv-pool-tokens", str(32 * BT),
                       env={"PDSERVE_FAULTS": f"slow_prefill:seconds=1,match={SLOW}",
                            "PDSERVE_PREFILL_CHUNK_TOKENS": "32"})   # a slowed 100-token prompt: 4 s of chunks
    yield eng
    cleanup_engine(eng)


probe = probe_fixture()


def complete(engine, prompt: list[int], request_id: str = "", **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True, "logprobs": 0, **extra}
    headers = {"X-Request-Id": request_id} if request_id else {}
    response = httpx.post(engine.base_url + "/v1/completions", json=body, timeout=300, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


def generated(body: dict) -> list[str]:
    return body["choices"][0]["logprobs"]["tokens"][-NEW:]


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_repeats_and_prefixes_ending_mid_block_come_from_the_cache_to_the_token_with_unchanged_greedy_output(
        engine, probe):
    first = complete(engine, PROMPT)
    again = complete(engine, PROMPT)
    assert (cached(first), cached(again)) == (0, 69)   # 4 blocks + 5 rows of the cached partial one: only the
    assert generated(again) == generated(first)        # last token is computed (there must be logits)
    shared = PROMPT[:37] + [t + 1 for t in PROMPT[37:60]]   # shares 2 blocks + 5 tokens of a third
    inside = PROMPT[:45]                                    # ends inside the cached full third block
    with_cache = [complete(engine, shared), complete(engine, inside)]
    without = [complete(engine, shared, echo=True), complete(engine, inside, echo=True)]   # prompt logprobs: from 0
    assert [cached(b) for b in with_cache + without] == [37, 44, 0, 0]
    assert [generated(b) for b in with_cache] == [generated(b) for b in without]
    metrics = scrape(engine.base_url)
    assert metrics["pdserve_prefix_cache_hit_tokens_total{actor=prefill0}"] == 69 + 37 + 44   # not whole blocks
    # the echo requests looked nothing up
    assert metrics["pdserve_prefix_cache_query_tokens_total{actor=prefill0}"] == 2 * len(PROMPT) + 60 + 45
    assert metrics["pdserve_prefix_cache_cached_blocks{actor=prefill0}"] >= 4 + 1
    [prefill] = [a for a in inspect.EngineView(engine.engine_id).snapshot(0.01)["actors"] if a["name"] == "prefill0"]
    assert prefill["prefix_cache"]["hit_tokens"] == 150 and prefill["prefix_cache"]["in_use_blocks"] == 0
    assert_recovered(engine, probe)


def test_a_cache_evicted_under_pressure_gives_the_same_greedy_output(engine, probe):
    first = complete(engine, PROMPT)
    evicted_before = scrape(engine.base_url)["pdserve_prefix_cache_evicted_blocks_total{actor=prefill0}"]
    for k in range(3):   # 3 x 12 full blocks of other prompts through a 32-block pool
        complete(engine, [(t + 1000 * (k + 1)) % 30000 + 200 for t in PROMPT + PROMPT + PROMPT[:50]])
    assert scrape(engine.base_url)["pdserve_prefix_cache_evicted_blocks_total{actor=prefill0}"] > evicted_before
    again = complete(engine, PROMPT)
    assert cached(again) < 69, "nothing of the first prompt was evicted"
    twice = complete(engine, PROMPT)   # from blocks cached again after the eviction reused them
    assert cached(twice) == 69
    assert generated(again) == generated(twice) == generated(first)
    assert_recovered(engine, probe)
    assert scrape(engine.base_url)["pdserve_kv_cache_usage_ratio"] == 0   # evictable cached blocks count as free


def test_identical_prompts_aborted_mid_prefill_leave_nothing_cached_and_the_text_equals_a_cold_run(engine, probe):
    """Three identical prompts at once, all aborted while their prefill runs (4 chunks of 32 tokens, each slowed
    by 1 s, so all three are PREFILLING together for seconds, whatever order they were admitted in): none of their
    blocks may be cached (reusing them would read KV never written: silent wrong text). The prompt sent again
    computes everything; sent once more it comes from the cache; both texts equal one computed without it."""
    prompt = [(t * 31) % 30000 + 300 for t in range(100)]   # 6 full blocks + 4 tokens
    ids = [f"{SLOW}abort-{i}" for i in range(3)]

    async def abort_mid_prefill():
        async with httpx.AsyncClient(base_url=engine.base_url, timeout=120) as client:
            tasks = [asyncio.ensure_future(client.post("/v1/completions", headers={"X-Request-Id": rid}, json={
                "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True})) for rid in ids]
            await asyncio.to_thread(wait_until, lambda: all(
                any(r["state"] == S.PREFILLING for r in probe.rows_with_id(rid)) for rid in ids), 60, 0.01,
                "the three prompts prefilling")
            for task in tasks:
                task.cancel()   # the client goes away: the API aborts the request
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(abort_mid_prefill())
    wait_until(lambda: not probe.live_rows(), 30, 0.05, "the aborted rows to end")
    cold = complete(engine, prompt, request_id=f"{SLOW}again")
    assert cached(cold) == 0, "KV of a prompt aborted mid-prefill was reused"
    warm = complete(engine, prompt)
    reference = complete(engine, prompt, echo=True)   # prompt logprobs: no cache lookup, computed from position 0
    assert (cached(warm), cached(reference)) == (99, 0)
    assert generated(cold) == generated(warm) == generated(reference)
    assert_recovered(engine, probe)


def test_a_request_aborted_after_a_mid_block_hit_holds_no_cached_block_and_the_next_one_reads_the_same_kv(
        engine, probe):
    """A prompt cached (to the token), then sent again slowed (its one computed token takes 1 s) and aborted while
    it prefills, holding the cached blocks of its hit: once it ends no cached block is held, and the prompt sent
    again still comes from the cache with the cold run's text."""
    prompt = [(t * 53) % 30000 + 400 for t in range(90)]   # 5 full blocks + 10 tokens
    cold = complete(engine, prompt)
    rid = f"{SLOW}abort-hit"

    async def abort_mid_prefill():
        async with httpx.AsyncClient(base_url=engine.base_url, timeout=120) as client:
            task = asyncio.ensure_future(client.post("/v1/completions", headers={"X-Request-Id": rid}, json={
                "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True}))
            await asyncio.to_thread(wait_until, lambda: any(r["state"] == S.PREFILLING for r in probe.rows_with_id(rid))
                                    and max(int(r["prefix_cached_in_use"]) for r in probe.actors.rows()) == 5, 60,
                                    0.01, "the prompt prefilling, holding its hit's 5 full blocks (only them)")
            task.cancel()   # the client goes away: the API aborts the request
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(abort_mid_prefill())
    wait_until(lambda: not probe.live_rows(), 30, 0.05, "the aborted row to end")
    assert_recovered(engine, probe)   # no cached block held (prefix_cached_in_use 0)
    warm = complete(engine, prompt)
    assert (cached(cold), cached(warm)) == (0, 89) and generated(warm) == generated(cold)
    assert_recovered(engine, probe)
