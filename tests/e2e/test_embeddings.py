"""End-to-end embeddings (api/embeddings.py over the prefill actor): the official `openai` client (float and base64),
a batch of inputs equal to each input alone (the same bits), llama.cpp's /embedding, bad inputs as 400s naming the
field, the row's life QUEUED -> PREFILLING -> FINISHED with gauges back to 0, and the prefill deadline firing on a
stuck embedding (the session's fault engine). One engine for the module, `--weights auto` (the default)."""
from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import pytest

from tests.conftest import assert_recovered, cleanup_engine, probe_fixture, start_engine
from tests.e2e.conftest import PREFILL_TIMEOUT_S, TICK_S

TEXTS = ["The food was delicious and the waiter was friendly.", "Paris is the capital of France.",
         "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)"]
LONG = " ".join(f"Sentence {i} talks about the weather, the sea and the hills around the old town." for i in range(10))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    # chunks of 64 tokens: the long input is cut and packed beside the others
    eng = start_engine(tmp_path_factory.mktemp("embeddings"), "--kv-pool-tokens", "1024", "--prefill-chunk-tokens",
                       "64")
    yield eng
    cleanup_engine(eng)


probe = probe_fixture()


@pytest.fixture(scope="module")
def oai(engine):
    import openai

    with openai.OpenAI(base_url=engine.base_url + "/v1", api_key="none", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def model(oai) -> str:
    return oai.models.list().data[0].id


def test_the_openai_client_gets_unit_vectors_of_the_hidden_size_as_floats_and_as_base64(oai, model, engine):
    floats = oai.embeddings.create(model=model, input=TEXTS[0], encoding_format="float")
    encoded = oai.embeddings.create(model=model, input=TEXTS[0])   # the client asks for base64 and decodes it
    assert floats.object == "list" and floats.model == model and len(floats.data) == 1
    vector = np.asarray(floats.data[0].embedding)
    assert vector.shape == (576,) and abs(np.linalg.norm(vector) - 1) < 1e-5   # SmolLM2-135M's hidden size
    assert encoded.data[0].embedding == floats.data[0].embedding   # the same float32 values, bit for bit
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 5
    raw = httpx.post(engine.base_url + "/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"},
                     timeout=120).json()["data"][0]["embedding"]
    assert np.frombuffer(base64.b64decode(raw), "<f4").tolist() == floats.data[0].embedding
    similar = oai.embeddings.create(model=model, input=["The meal was tasty and the staff were kind.",
                                                        "Quantum chromodynamics describes the strong force."])
    near, far = (float(vector @ np.asarray(d.embedding)) for d in similar.data)
    assert near > far


def test_a_batch_of_inputs_gets_each_inputs_own_vector_bit_for_bit(oai, model, engine):
    """Alone, then all in one request (packed into the same forward passes, the long one in 64-token chunks), then
    the same request beside concurrent generations: the same base64 each time, in input order."""
    inputs = TEXTS + [LONG]
    alone = [httpx.post(engine.base_url + "/v1/embeddings", json={"input": text, "encoding_format": "base64"},
                        timeout=120).json()["data"][0]["embedding"] for text in inputs]
    batch = httpx.post(engine.base_url + "/v1/embeddings", json={"input": inputs, "encoding_format": "base64"},
                       timeout=120).json()
    assert [d["index"] for d in batch["data"]] == [0, 1, 2, 3]
    assert [d["embedding"] for d in batch["data"]] == alone
    assert batch["usage"]["prompt_tokens"] > 200 and len(set(alone)) == 4

    async def beside_generations():
        async with httpx.AsyncClient(base_url=engine.base_url, timeout=120) as client:
            gens = [client.post("/v1/completions", json={"prompt": text, "max_tokens": 8}) for text in TEXTS]
            embeds = client.post("/v1/embeddings", json={"input": inputs[::-1], "encoding_format": "base64"})
            return await asyncio.gather(embeds, *gens)
    mixed, *gens = asyncio.run(beside_generations())
    assert all(g.status_code == 200 for g in gens)
    assert [d["embedding"] for d in mixed.json()["data"]] == alone[::-1]


def test_llama_cpp_routes_answer_the_same_vectors_in_their_shapes(engine):
    base = engine.base_url
    openai_floats = httpx.post(base + "/v1/embeddings", json={"input": TEXTS[:2]}, timeout=120).json()["data"]
    unprefixed = httpx.post(base + "/embeddings", json={"input": TEXTS[:2]}, timeout=120).json()["data"]
    legacy = httpx.post(base + "/embedding", json={"content": TEXTS[:2]}, timeout=120).json()
    assert unprefixed == openai_floats
    assert legacy == [{"index": d["index"], "embedding": [d["embedding"]]} for d in openai_floats]


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": ["a", {"content": "b"}]}, "input[1]"),
    ({"input": [[1, 2], [-1]]}, "input[1]"), ({"input": "a", "dimensions": 8}, "dimensions"),
    ({"input": "a", "encoding_format": "hex"}, "encoding_format"), ({"input": "word " * 1100}, "input"),
    ({"input": "a", "temperature": 0}, "temperature"), ({"prompt": "a"}, "prompt"),
])
def test_a_bad_embeddings_body_is_a_400_naming_the_field_and_leaves_the_engine_serving(engine, probe, body, param):
    response = httpx.post(engine.base_url + "/v1/embeddings", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    assert f"param={param}" in engine.log_text()   # the API's log line names the field
    assert not probe.live_rows()


def test_an_embedding_row_goes_queued_prefilling_finished_and_every_gauge_returns_to_zero(engine, probe):
    """Through the prefill actor alone, as the flight recorder saw the row (GET /debug/requests/{id}): QUEUED ->
    PREFILLING -> FINISHED, moved there by prefill0, never BOOTSTRAP or a decode state; afterwards no live row,
    every block free, queue gauges 0 (tests.conftest.assert_recovered, which also sends an ordinary request)."""
    rid = "embed-trace-1"
    response = httpx.post(engine.base_url + "/v1/embeddings", json={"input": LONG}, headers={"x-request-id": rid},
                          timeout=120)
    assert response.status_code == 200 and response.headers["x-request-id"] == rid
    [timeline] = httpx.get(engine.base_url + f"/debug/requests/{rid}", timeout=10).json()["timelines"]
    assert [(st["state"], st["by"]) for st in timeline["stages"]] == [
        ("QUEUED", "api"), ("PREFILLING", "prefill0"), ("FINISHED", "prefill0")]
    assert sum(e["kind"] == "prefill_chunk" for e in timeline["events"]) == -(-response.json()["usage"][
        "prompt_tokens"] // 64)   # a chunk of 64 tokens per forward pass, each renewing the row
    assert_recovered(engine, probe)


def test_a_stuck_embedding_is_timed_out_by_the_monitor_with_a_504_and_nothing_left_held(fault_engine, fault_probe):
    """The session's fault engine holds prefill on requests whose id starts with ``stallp-``: the monitor's
    PREFILLING deadline fires as for a prompt."""
    response = httpx.post(fault_engine.base_url + "/v1/embeddings", json={"input": TEXTS[1]},
                          headers={"x-request-id": "stallp-embed-1"}, timeout=PREFILL_TIMEOUT_S + 30 * TICK_S)
    assert response.status_code == 504, response.text
    assert "prefill" in response.json()["error"]["message"]
    assert_recovered(fault_engine, fault_probe, timeout_s=20)
