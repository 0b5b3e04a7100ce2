"""End-to-end: the request fields of current OpenAI clients (honoured or accepted-and-ignored, api/fields.py), output
length without max_tokens, logit_bias, continue_final_message, the extra routes (/tokenize, /detokenize,
/v1/models/{id}, routes without /v1, HEAD /, the health split), model-name aliases, CORS, the log line of every 4xx,
and ``--strict-fields``. One engine for the module: a small context (MAX_LEN) so that an answer without max_tokens
runs to its end quickly, a small up-front reservation (RESERVE) so that it grows block by block, max_tokens_policy
clamp, and strict_fields (unknown Responses / Messages names refused)."""
from __future__ import annotations

import httpx
import pytest

from tests.conftest import cleanup_engine, start_engine, wait_until

MAX_LEN = 272          # > 256 (the old default max_tokens) + a short prompt
RESERVE = 32           # reserve_output_tokens: the answer below takes ~15 more blocks as it grows
ORIGIN = "http://app.example"
NAMES = ("main-model", "alias-model")
CHAT, COMP = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "hi"}]

# every field the engine accepts and ignores (api/fields.py), with the values current clients send
IGNORED_CHAT = {
    "store": True, "metadata": {"session": "s1"}, "service_tier": "flex", "prompt_cache_key": "codex-session-1",
    "prompt_cache_retention": "24h", "prompt_cache_options": {"ttl": "24h"}, "safety_identifier": "user-hash",
    "reasoning_effort": "minimal", "verbosity": "low", "web_search_options": {}, "prediction": {"type": "content",
                                                                                           "content": "x"},
    "moderation": {"model": "omni-moderation-latest"}, "modalities": ["text"], "audio": None, "user": "alice",
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = start_engine(tmp_path_factory.mktemp("fields"), "--max-model-len", str(MAX_LEN), "--kv-pool-tokens",
                       "1024", "--reserve-output-tokens", str(RESERVE), "--max-tokens-policy", "clamp",
                       "--served-model-name", NAMES[0], "--served-model-name", NAMES[1],
                       "--allowed-origins", ORIGIN, "--strict-fields", "true")
    yield eng
    cleanup_engine(eng)


@pytest.fixture(scope="module")
def http(engine):
    with httpx.Client(base_url=engine.base_url, timeout=120) as client:
        yield client


def test_every_accepted_and_ignored_field_gets_a_200_and_a_misspelt_one_a_400_naming_it_in_the_log(engine, http):
    from api import fields

    assert set(IGNORED_CHAT) == set(fields.CHAT.ignored)
    ok = http.post(CHAT, json={"messages": HI, "max_tokens": 2, "stream": True, **IGNORED_CHAT,
                               "stream_options": {"include_usage": True, "include_obfuscation": False}})
    assert ok.status_code == 200 and "data: [DONE]" in ok.text, ok.text
    ok = http.post(COMP, json={"prompt": "Hi", "max_tokens": 2, "user": "bob"})
    assert ok.status_code == 200, ok.text
    bad = http.post(CHAT, json={"messages": HI, "max_tokens": 2, "prompt_cache_keys": "x"},
                    headers={"X-Request-Id": "typo-1"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_cache_keys"
    audio = http.post(CHAT, json={"messages": HI, "max_tokens": 2, "modalities": ["text", "audio"]})
    assert audio.status_code == 400 and audio.json()["error"]["param"] == "modalities"
    line = "request typo-1: POST /v1/chat/completions -> 400 param=prompt_cache_keys: unrecognized request argument"
    wait_until(lambda: line in engine.log_text(), 10, 0.1, "the 400's log line")
    assert engine.log_text().count("request typo-1:") == 1   # once, and never the body
    assert "codex-session" not in engine.log_text()


def test_an_answer_without_max_tokens_runs_to_the_end_of_the_context_not_to_256(http):
    body = {"prompt": "Count:", "ignore_eos": True, "temperature": 0}
    response = http.post(COMP, json=body, timeout=600)
    assert response.status_code == 200, response.text
    usage, choice = response.json()["usage"], response.json()["choices"][0]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_LEN and usage["completion_tokens"] > 256
    assert choice["finish_reason"] == "length"


def test_max_tokens_over_the_room_left_is_clamped_under_the_clamp_policy(http):
    prompt = [1000] * (MAX_LEN - 5)
    response = http.post(COMP, json={"prompt": prompt, "max_tokens": 32000, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 5


def test_logit_bias_forces_and_bans_tokens(http, engine):
    forced = http.post("/tokenize", json={"prompt": " banana", "add_special_tokens": False}).json()["tokens"]
    assert len(forced) == 1
    response = http.post(COMP, json={"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0,
                                     "logit_bias": {str(forced[0]): 100}})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == " banana" * 3
    plain = http.post(COMP, json={"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0,
                                  "logprobs": 0}).json()["choices"][0]["text"]
    best = http.post("/tokenize", json={"prompt": plain}).json()["tokens"][0]
    banned = http.post(COMP, json={"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0,
                                   "logit_bias": {str(best): -100}}).json()["choices"][0]["text"]
    assert banned != plain
    bad = http.post(COMP, json={"prompt": "x", "max_tokens": 1, "logit_bias": {"5": 200}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"


def test_continue_final_message_continues_the_assistants_text(http):
    messages = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "A fruit: the"}]
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    counted = http.post("/tokenize", json={"messages": messages, **flags}).json()
    response = http.post(CHAT, json={"messages": messages, "max_tokens": 3, "temperature": 0, **flags})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == counted["count"]
    text = http.post("/detokenize", json={"tokens": counted["tokens"]}).json()["prompt"]
    assert text.endswith("A fruit: the")
    new_turn = http.post("/tokenize", json={"messages": messages}).json()
    assert new_turn["count"] > counted["count"]


def test_tokenize_detokenize_models_aliases_and_routes_without_v1(http):
    got = http.post("/tokenize", json={"prompt": "Hello world", "model": NAMES[1]}).json()
    assert got["count"] == len(got["tokens"]) > 0 and got["max_model_len"] == MAX_LEN
    assert http.post("/detokenize", json={"tokens": got["tokens"]}).json() == {"prompt": "Hello world",
                                                                              "content": "Hello world"}
    # llama.cpp's form of /tokenize (its server tests send content, with_pieces)
    pieces = http.post("/tokenize", json={"content": "Hello world", "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == got["tokens"] and "".join(p["piece"] for p in pieces) == "Hello world"
    listed = http.get("/v1/models").json()["data"]
    assert [m["id"] for m in listed] == [NAMES[0]]
    for name in NAMES:
        assert http.get(f"/v1/models/{name}").json()["id"] == name
        assert http.get(f"/models/{name}").status_code == 200
    assert http.get("/v1/models/gpt-4o").status_code == 404
    aliased = http.post("/chat/completions", json={"model": NAMES[1], "messages": HI, "max_tokens": 2})
    assert aliased.status_code == 200 and aliased.json()["model"] == NAMES[0]
    assert http.post("/completions", json={"prompt": "Hi", "max_tokens": 1}).status_code == 200
    assert http.get("/models").json()["data"][0]["id"] == NAMES[0]
    embeddings = http.post("/embeddings", json={"input": "hi", "model": NAMES[1]})   # tests/e2e/test_embeddings.py
    assert embeddings.status_code == 200 and embeddings.json()["model"] == NAMES[0]


def test_head_and_health_routes(http):
    for path in ("/", "/health", "/health/live", "/health/ready"):
        assert http.head(path).status_code == 200, path
    assert http.get("/health/live").json() == {"status": "ok"}
    ready = http.get("/health/ready").json()
    assert ready["status"] == "ok" and ready["problems"] == [] and http.get("/health").json() == ready


def test_cors_preflight_is_answered_for_an_allowed_origin_only(http):
    preflight = http.options(CHAT, headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                                            "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
    simple = http.post(COMP, json={"prompt": "Hi", "max_tokens": 1}, headers={"Origin": ORIGIN})
    assert simple.headers["access-control-allow-origin"] == ORIGIN
    other = http.options(CHAT, headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_strict_fields_restores_the_400_for_unknown_responses_and_messages_names(http):
    """With ``--strict-fields`` an unknown Responses or Messages field (or tool type) is the 400 naming it again
    (by default it is accepted and logged: tests/e2e/test_dialects.py)."""
    bad = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "frobnicate_v2": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "frobnicate_v2", bad.text
    bad = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "tools": [{"type": "shell_v3"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools", bad.text
    bad = http.post("/v1/messages", json={"max_tokens": 2, "messages": HI, "frobnicate_v2": 1})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error", bad.text
    assert http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2}).status_code == 200
