"""End-to-end dialects: the official `openai` client's Responses API and the `anthropic` client's Messages API against
one engine started with an API key (sent as Bearer and as x-api-key), and scenario S17: the same greedy prompt gives
the same text and token counts through chat/completions, Responses and Messages, and a stream the client closes
early in each dialect frees its KV. Tool calls use tool_choice required/named (grammar-constrained: the tiny model
makes them reliably)."""
from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from tests.conftest import cleanup_engine, probe_fixture, scrape, start_engine, wait_until

KEY = "sk-dialects"
MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
           "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = start_engine(tmp_path_factory.mktemp("dialects"), "--kv-pool-tokens", "2048", "--api-key", KEY)
    yield eng
    cleanup_engine(eng)


probe = probe_fixture()


@pytest.fixture(scope="module")
def oai(engine):
    with openai.OpenAI(base_url=engine.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def claude(engine):
    with anthropic.Anthropic(base_url=engine.base_url, api_key=KEY, max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def http(engine):
    with httpx.Client(base_url=engine.base_url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


# -- OpenAI Responses --------------------------------------------------------------------------------------------

def test_responses_create_answers_and_is_stored_then_deleted(oai):
    r = oai.responses.create(model=MODEL, input="Say hello.", instructions="Be brief.", max_output_tokens=12,
                             temperature=0, reasoning={"effort": "low"}, prompt_cache_key="abc")
    assert r.status in ("completed", "incomplete") and r.output_text
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 12
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 12
    got = oai.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    oai.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)


def test_responses_stream_events_arrive_in_the_documented_order_and_rebuild_the_text(oai):
    # 8 tokens: the answer is longer (~15 tokens), so the stream ends incomplete at the limit
    events = list(oai.responses.create(model=MODEL, input="Count from one to five.", max_output_tokens=8,
                                       temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if events[-1].response.status == "incomplete" else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas and final.output_text == deltas == events[-4].text
    assert final.usage.output_tokens == 8 and final.incomplete_details.reason == "max_output_tokens"
    # the same request, not streamed, is the same greedy text
    full = oai.responses.create(model=MODEL, input="Count from one to five.", max_output_tokens=8, temperature=0)
    assert full.output_text == deltas
    # the SDK's stream helper checks each event against the response it accumulates (item ids, indices, one
    # response id); an incomplete response has no final `response.completed`, as with OpenAI's own server
    with oai.responses.stream(model=MODEL, input="Count from one to five.", max_output_tokens=8,
                              temperature=0) as helper:
        seen = list(helper)
    assert "".join(e.delta for e in seen if e.type == "response.output_text.delta") == deltas
    assert seen[-1].type == "response.incomplete" and seen[-1].response.output_text == deltas


@pytest.mark.parametrize("stream", [False, True])
def test_responses_function_call_round_trip_with_previous_response_id(oai, stream):
    tools = [{"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": WEATHER}]
    request = dict(model=MODEL, input="What is the weather in Paris?", tools=tools, tool_choice="required",
                   temperature=0, max_output_tokens=60)
    if stream:   # through the SDK's stream helper, which checks every event against what it accumulated
        with oai.responses.stream(**request) as helper:
            events = list(helper)
            first = helper.get_final_response()
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert args == "".join(item.arguments for item in first.output if item.type == "function_call")
    else:
        first = oai.responses.create(**request)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    second = oai.responses.create(model=MODEL, previous_response_id=first.id, temperature=0, max_output_tokens=20,
                                  tools=tools, input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                                       "output": "Sunny, 21 C"}])
    assert second.previous_response_id == first.id and second.output_text
    # the stored conversation was prepended: the second prompt holds the first one, the call and its result
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_responses_named_tool_choice_and_json_schema_text_format(oai):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    r = oai.responses.create(model=MODEL, input="Weather in Rome?", tools=tools, temperature=0,
                             tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40)
    assert r.output[0].type == "function_call" and "city" in json.loads(r.output[0].arguments)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = oai.responses.create(model=MODEL, input="Make up a person.", temperature=0, max_output_tokens=60,
                             text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                              "strict": True}})
    person = json.loads(r.output_text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)


def test_responses_bad_input_gets_openai_errors_naming_the_field(oai, http):
    with pytest.raises(openai.BadRequestError) as bad:
        oai.responses.create(model=MODEL, input="hi", max_output_tokens=10**6)
    assert bad.value.body["param"] == "max_output_tokens"
    with pytest.raises(openai.NotFoundError) as missing:
        oai.responses.create(model=MODEL, input="hi", previous_response_id="resp_nope")
    assert missing.value.body["param"] == "previous_response_id"
    r = http.post("/v1/responses", json={"input": [{"type": "input_image", "image_url": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    missing = http.get("/v1/responses/resp_nope")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "response_id"


# -- Anthropic Messages ------------------------------------------------------------------------------------------

def test_messages_create_and_count_tokens_with_x_api_key(claude):
    m = claude.messages.create(model=MODEL, max_tokens=12, system="Be brief.", temperature=0,
                               messages=[{"role": "user", "content": "Say hello."}], thinking={"type": "disabled"})
    assert m.type == "message" and m.role == "assistant" and m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens")
    count = claude.messages.count_tokens(model=MODEL, system="Be brief.",
                                         messages=[{"role": "user", "content": "Say hello."}])
    assert count.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_messages_stream_and_stop_sequences(claude):
    request = dict(model=MODEL, max_tokens=16, temperature=0,
                   messages=[{"role": "user", "content": "Count from one to five."}])
    with claude.messages.stream(**request) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text and final.usage.output_tokens > 0
    full = claude.messages.create(**request)
    assert full.content[0].text == text and full.usage.output_tokens == final.usage.output_tokens
    # a stop sequence found in that text ends the answer before it, named in the response
    stop = text.strip()[3:6]
    m = claude.messages.create(**request, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop and stop not in m.content[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_messages_tool_use_round_trip_with_tool_result(claude, stream):
    tools = [{"name": "get_weather", "description": "Weather of a city", "input_schema": WEATHER}]
    request = dict(model=MODEL, max_tokens=60, temperature=0, tools=tools, tool_choice={"type": "any"},
                   messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    if stream:
        with claude.messages.stream(**request) as s:
            kinds = [e.type for e in s]
            first = s.get_final_message()
        assert "input_json" in kinds and kinds[-1] == "message_stop"
    else:
        first = claude.messages.create(**request)
    use = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and use[0].name == "get_weather" and "city" in use[0].input
    assert use[0].id.startswith("toolu_")
    second = claude.messages.create(model=MODEL, max_tokens=20, temperature=0, tools=tools, messages=[
        *request["messages"], {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id, "content": "Sunny, 21 C"}]}])
    assert second.content[0].type == "text" and second.content[0].text
    named = claude.messages.create(**{**request, "tool_choice": {"type": "tool", "name": "get_weather"}})
    assert named.content[0].type == "tool_use" and "city" in named.content[0].input


def test_messages_errors_are_anthropic_shaped(engine, claude):
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model=MODEL, max_tokens=10**6, messages=[{"role": "user", "content": "hi"}])
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="claude-nope", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert missing.value.body["error"]["type"] == "not_found_error"
    raw = httpx.post(engine.base_url + "/v1/messages?beta=true", headers={"x-api-key": KEY},
                     json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})   # no max_tokens
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    with anthropic.Anthropic(base_url=engine.base_url, api_key="sk-wrong", max_retries=0) as wrong:
        with pytest.raises(anthropic.AuthenticationError) as denied:
            wrong.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert denied.value.body["error"]["type"] == "authentication_error"
    ok = httpx.post(engine.base_url + "/v1/messages?beta=true", headers={"x-api-key": KEY},
                    json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] == 2


# -- S17 ---------------------------------------------------------------------------------------------------------

def test_s17_the_three_dialects_give_the_same_greedy_text_and_token_counts(oai, claude):
    prompt = "Write one sentence about the sea."
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=24,
                                       temperature=0)
    resp = oai.responses.create(model=MODEL, input=prompt, max_output_tokens=24, temperature=0)
    msg = claude.messages.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=24,
                                 temperature=0)
    assert chat.choices[0].message.content == resp.output_text == msg.content[0].text
    assert chat.usage.completion_tokens == resp.usage.output_tokens == msg.usage.output_tokens
    assert (chat.usage.prompt_tokens == resp.usage.input_tokens
            == msg.usage.input_tokens + msg.usage.cache_read_input_tokens)


def _aborted(base_url: str) -> float:
    return sum(v for k, v in scrape(base_url).items() if k.startswith("pdserve_requests_total{finish_reason=abort"))


@pytest.mark.parametrize("route", ["responses", "messages"])
def test_s17_a_stream_closed_by_the_client_frees_its_kv(engine, probe, route):
    """The client reads a few deltas of a long answer and closes the stream: the request is counted as an abort
    and every KV block is free again within a tick or so."""
    prompt = "Count from 1 to 1000, separated by commas."
    if route == "responses":
        body = {"model": MODEL, "stream": True, "input": prompt, "max_output_tokens": 1000, "temperature": 0}
    else:
        body = {"model": MODEL, "stream": True, "max_tokens": 1000, "temperature": 0,
                "messages": [{"role": "user", "content": prompt}]}
    wait_until(lambda: not probe.live_rows(), 10, 0.05, "an idle engine")
    before = _aborted(engine.base_url)
    with httpx.Client(base_url=engine.base_url, timeout=60) as client:
        with client.stream("POST", f"/v1/{route}", json=body, headers={"x-api-key": KEY}) as r:
            assert r.status_code == 200
            deltas = 0
            for line in r.iter_lines():
                deltas += "delta" in line
                if deltas >= 3:
                    break
    wait_until(lambda: _aborted(engine.base_url) == before + 1, 5, 0.05, "the closed stream counted as an abort")
    wait_until(lambda: not probe.live_rows() and all(f == t for f, t in probe.free_blocks().values()), 5, 0.05,
               "the aborted stream's KV blocks freed")


def test_an_unknown_responses_field_is_accepted_logged_and_counted(engine, http):
    """Forward compatibility (api.fields.UnknownFields): a field, item or tool type newer than this server is
    left out, logged once and counted; ``--strict-fields`` restores the 400 (tests/api/test_dialects.py)."""
    body = {"input": "Say hi.", "max_output_tokens": 3, "frobnicate_v2": {"x": 1}, "tools": [{"type": "shell_v3"}]}
    for _ in range(2):
        r = http.post("/v1/responses", json=body)
        assert r.status_code == 200 and r.json()["output"], r.text
    text = http.get("/metrics").text
    assert 'pdserve_unknown_request_fields_total{field="frobnicate_v2",route="/v1/responses"} 2.0' in text
    assert 'field="tools:shell_v3"' in text
    warned = [line for line in engine.log_text().splitlines() if "'frobnicate_v2' is unknown" in line]
    assert len(warned) == 1 and "WARNING" in warned[0], warned


def test_responses_answer_without_the_v1_prefix_too(http):
    """``/responses`` as llama.cpp serves it, like the other unprefixed OpenAI routes (its GET and DELETE too)."""
    r = http.post("/responses", json={"input": "Say hi.", "max_output_tokens": 3})
    assert r.status_code == 200 and r.json()["object"] == "response", r.text
    rid = r.json()["id"]
    assert http.get(f"/responses/{rid}").json()["id"] == rid
    assert http.delete(f"/responses/{rid}").json()["deleted"] is True
