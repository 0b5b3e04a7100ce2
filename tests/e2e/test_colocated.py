"""Colocated mode (`--colocated true`): the decode actor prefills itself, no prefill actor, no KV handoff. It
serves the same greedy text as the disaggregated engine and leaves the same clean state behind."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.conftest import EngineProbe, FRANCE_QUESTION, assert_recovered, cleanup_engine, scrape, start_engine

FRANCE = [{"role": "user", "content": FRANCE_QUESTION}]
PROMPTS = ["The three primary colors are", "def fibonacci(n):", "Once upon a time", "Le fromage préféré"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = start_engine(tmp_path_factory.mktemp("colocated"), "--colocated", "true", "--kv-pool-tokens", "2048")
    yield eng
    cleanup_engine(eng)


def test_colocated_engine_answers_without_a_prefill_actor_or_a_handoff(engine):
    probe = EngineProbe(engine.engine_id)
    try:
        health = httpx.get(engine.base_url + "/health", timeout=10).json()
        assert health["status"] == "ok" and "prefill0" not in health["actors"] and health["actors"]["api"] == "ok"
        answer = httpx.post(engine.base_url + "/v1/chat/completions", timeout=120,
                            json={"messages": FRANCE, "temperature": 0, "max_tokens": 32}).json()
        assert answer["choices"][0]["message"]["content"].startswith("The capital of France is Paris.")
        body = {"temperature": 0, "max_tokens": 12}
        alone = [httpx.post(engine.base_url + "/v1/completions", json={**body, "prompt": p}, timeout=120)
                 .json()["choices"][0]["text"] for p in PROMPTS]

        async def together():
            async with httpx.AsyncClient(timeout=120) as client:
                responses = await asyncio.gather(*(client.post(engine.base_url + "/v1/completions",
                                                               json={**body, "prompt": p}) for p in PROMPTS))
                return [r.json() for r in responses]
        again = asyncio.run(together())
        assert [r["choices"][0]["text"] for r in again] == alone
        # each repeat came from the prefix cache in the decode pool to its last token but one (a partial block)
        assert [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in again] == \
            [r["usage"]["prompt_tokens"] - 1 for r in again]
        # n > 1: the prompt runs once and its KV blocks are copied to each child; greedy children equal the answer
        # alone, so the copies are right (a 20-token prompt spans two 16-token blocks)
        long_prompt = PROMPTS[0] + " and the three secondary colors are"
        single = httpx.post(engine.base_url + "/v1/completions", json={**body, "prompt": long_prompt},
                            timeout=120).json()["choices"][0]["text"]
        many = httpx.post(engine.base_url + "/v1/completions", json={**body, "prompt": long_prompt, "n": 3},
                          timeout=120).json()
        assert [c["text"] for c in many["choices"]] == [single] * 3
        metrics = scrape(engine.base_url)
        assert metrics["pdserve_kv_handoffs_total"] == 0
        assert metrics["pdserve_requests_admitted_total"] == 1 + 2 * len(PROMPTS) + 1 + 3
        assert_recovered(engine, probe)
    finally:
        probe.close()


def test_colocated_an_embedding_runs_in_the_decode_actors_prefill_core_and_leaves_it_clean(engine):
    """No prefill actor: the decode actor's prefill core pools it (api/admission.py names that decode actor);
    a batch equals each input alone, bit for bit."""
    probe = EngineProbe(engine.engine_id)
    try:
        def embed(inputs):
            response = httpx.post(engine.base_url + "/v1/embeddings", timeout=120,
                                  json={"input": inputs, "encoding_format": "base64"})
            assert response.status_code == 200, response.text
            return [d["embedding"] for d in response.json()["data"]]
        alone = [embed(p)[0] for p in PROMPTS]
        assert embed(PROMPTS) == alone and len(set(alone)) == len(PROMPTS)
        assert_recovered(engine, probe)
    finally:
        probe.close()
