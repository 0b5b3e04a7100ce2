"""End to end on the embedded model: structured outputs (response_format json_schema / json_object) at temperature
0.8 over HTTP/1.1 and HTTP/2, streamed and not; tool calls through the official ``openai`` client (a named function,
"required", a second round with the tool's result, streamed ``delta.tool_calls``); API keys; ``x-request-id`` on
every kind of response. One engine for the module, with two API keys (a flag and a key file) and
``--chat-template examples/chatml_tools.jinja``."""
from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import orjson
import pytest

from tests.conftest import ROOT, cleanup_engine, start_engine, wait_until

KEY_FLAG, KEY_FILE = "sk-e2e-flag-key", "sk-e2e-file-key-longer"
AUTH = {"Authorization": f"Bearer {KEY_FLAG}"}
MAX_QUEUED = 64
# A nested object, an array, an enum and required fields, with short keys and bounded values: every token of an
# answer is a decode step, and decode is the slow part of this test on a shared 2-core machine.
PERSON = {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "color", "tags", "home"],
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
        "home": {"type": "object", "additionalProperties": False, "required": ["zip"],
                 "properties": {"zip": {"type": "string", "pattern": "^[0-9]{3}$"}}},
    },
}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
ADD = {"type": "object", "required": ["a", "b"], "additionalProperties": False,
       "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                      "b": {"type": "integer", "minimum": -1000, "maximum": 1000}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
pytestmark = pytest.mark.timeout(900)   # the first test also waits for the engine (minutes when the machine is busy)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("structured")
    key_file = tmp / "keys"
    key_file.write_text(f"# keys for the e2e test\n{KEY_FILE}\n")
    eng = start_engine(tmp, "--api-key", KEY_FLAG, "--api-key-file", str(key_file), "--max-queued-requests",
                       str(MAX_QUEUED), "--chat-template", str(ROOT / "examples" / "chatml_tools.jinja"),
                       ready_timeout_s=400)   # a busy 2-core machine can take minutes to load three processes
    yield eng
    cleanup_engine(eng)


async def one_request(client: httpx.AsyncClient, body: dict) -> list[str]:
    """The text of every choice of one chat request (streamed or not); asserts a 200 and a finish reason."""
    if not body.get("stream"):
        response = await client.post("/v1/chat/completions", json=body, headers=AUTH)
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        assert all(c["finish_reason"] in ("stop", "length") for c in choices)
        return [c["message"]["content"] for c in sorted(choices, key=lambda c: c["index"])]
    texts: dict[int, list[str]] = {}
    finished: set[int] = set()
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=AUTH) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = orjson.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                texts.setdefault(choice["index"], []).append(choice["delta"].get("content") or "")
                if choice["finish_reason"]:
                    finished.add(choice["index"])
    assert finished == set(texts)
    return ["".join(texts[i]) for i in sorted(texts)]


def structured_bodies(variant: int, count: int) -> list[dict]:
    """``count`` json_schema and ``count`` json_object requests; each variant also mixes in another feature
    (n > 1 on three of them, logprobs, a seed and a penalty, usage), so those work together with a grammar (a stop
    string with a grammar is a 400: test_a_stop_string_with_a_constrained_answer_is_a_400_naming_both). json_object
    answers get only 24 tokens: closing pressure must end them as complete objects."""
    extras = [{}, {"logprobs": True, "top_logprobs": 2}, {"seed": 3, "presence_penalty": 0.5},
              {"stream_options": {"include_usage": True}}][variant]
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    bodies = []
    for i in range(count):
        n = {"n": 2} if variant == 0 and i < 3 else {}
        bodies.append({"messages": [{"role": "user", "content": f"Describe person number {i} as JSON."}],
                       "response_format": schema, "temperature": 0.8, "max_tokens": 80, **extras, **n})
        bodies.append({"messages": [{"role": "system", "content": "Answer with a JSON object."},
                                    {"role": "user", "content": f"Give me facts about city number {i}."}],
                       "response_format": {"type": "json_object"}, "temperature": 0.8, "max_tokens": 24, **extras})
    return bodies


@pytest.mark.parametrize("variant,http2,stream", [(0, False, False), (1, False, True), (2, True, False),
                                                  (3, True, True)])
def test_fifty_plus_structured_answers_at_temperature_0_8_all_parse_and_validate(engine, variant, http2, stream):
    """13 json_schema and 13 json_object requests per variant, 52 of each over the four variants."""
    bodies = [dict(b, stream=stream) for b in structured_bodies(variant, 13)]
    if not stream:
        for b in bodies:
            b.pop("stream_options", None)

    async def run() -> list[list[str]]:
        async with httpx.AsyncClient(base_url=engine.base_url, http1=not http2, http2=http2, timeout=300) as client:
            return await asyncio.gather(*(one_request(client, b) for b in bodies))

    answers = asyncio.run(run())
    for body, texts in zip(bodies, answers):
        assert len(texts) == body.get("n", 1)
        for text in texts:
            value = json.loads(text)
            if body["response_format"]["type"] == "json_schema":
                jsonschema.validate(value, PERSON)
            else:
                assert isinstance(value, dict), text


@pytest.mark.parametrize("stop", ["}", [",", "]"]])
def test_a_stop_string_with_a_constrained_answer_is_a_400_naming_both(engine, stop):
    """Served, the stop string would cut every choice into JSON that does not parse (200, finish_reason stop)."""
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    chat = {"messages": [{"role": "user", "content": "A person as JSON."}], "response_format": schema, "n": 3,
            "stream": True, "stop": stop, "max_tokens": 40}
    completion = {"prompt": "JSON:", "response_format": {"type": "json_object"}, "stop": stop, "max_tokens": 8}
    tool = {"messages": [{"role": "user", "content": "Add 1 and 2."}], "tools": TOOLS, "tool_choice": "required",
            "stop": stop, "max_tokens": 40}
    for path, body, field in (("/v1/chat/completions", chat, "response_format"),
                              ("/v1/completions", completion, "response_format"),
                              ("/v1/chat/completions", tool, "tool_choice")):
        response = httpx.post(engine.base_url + path, json=body, headers=AUTH, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "stop" and f"'{field}'" in error["message"], error


def test_schema_integers_end_and_a_recursive_schema_closes_at_a_small_max_tokens(engine):
    """/v1/completions, n 3, temperature 0.8: a schema ``integer`` ends (digits are bounded) long before max_tokens;
    a recursive schema at max_tokens 100 ends as complete JSON (the closing window grows with the open depth)."""
    node = {"$defs": {"node": {"type": "object", "additionalProperties": False, "required": ["kids"],
                               "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
            "$ref": "#/$defs/node"}
    cases = [({"type": "integer"}, "The number of stars in the sky, in digits:", 64),
             (node, "A deeply nested tree as JSON:", 100)]
    for schema, prompt, max_tokens in cases:
        body = {"prompt": prompt, "n": 3, "temperature": 0.8, "seed": 1, "max_tokens": max_tokens,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
        response = httpx.post(engine.base_url + "/v1/completions", json=body, headers=AUTH, timeout=300)
        assert response.status_code == 200, response.text
        for choice in response.json()["choices"]:
            jsonschema.validate(json.loads(choice["text"]), schema)
            if schema.get("type") == "integer":
                assert choice["finish_reason"] == "stop" and len(choice["text"]) <= 28, choice


@pytest.fixture(scope="module")
def openai_client(engine):
    import openai   # a declared test dependency (setup.cfg): missing is an error, not a skip

    return openai.OpenAI(base_url=engine.base_url + "/v1", api_key=KEY_FILE, max_retries=0, timeout=120)


def test_the_openai_client_gets_a_named_tool_call_then_answers_with_its_result(openai_client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = openai_client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, tools=TOOLS,
                                                  tool_choice=named, temperature=0.8, max_tokens=40)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)

    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21})}]
    second = openai_client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, tools=TOOLS,
                                                   temperature=0, max_tokens=8)
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    assert answer.message.content or answer.message.tool_calls
    assert second.usage.prompt_tokens > first.usage.prompt_tokens   # the call and its result were in the prompt


def test_streamed_tool_call_pieces_concatenate_to_the_same_arguments(openai_client):
    request = dict(model="SmolLM2-135M-Instruct", tools=TOOLS, temperature=0, max_tokens=30,
                   messages=[{"role": "user", "content": "Add 19 and 23."}],
                   tool_choice={"type": "function", "function": {"name": "add"}})
    whole = openai_client.chat.completions.create(**request).choices[0].message.tool_calls[0]
    pieces, names, reasons = [], [], []
    for event in openai_client.chat.completions.create(stream=True, **request):
        for choice in event.choices:
            for delta in choice.delta.tool_calls or []:
                assert delta.index == 0
                names += [delta.function.name] if delta.function.name else []
                pieces.append(delta.function.arguments or "")
            reasons += [choice.finish_reason] if choice.finish_reason else []
    assert names == ["add"] and reasons == ["tool_calls"] and len([p for p in pieces if p]) > 1
    assert "".join(pieces) == whole.function.arguments
    jsonschema.validate(json.loads(whole.function.arguments), ADD)


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_always_yields_calls_that_validate(openai_client, stream):
    request = dict(model="SmolLM2-135M-Instruct", tools=TOOLS, tool_choice="required", temperature=0.8,
                   max_tokens=48, messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
                   parallel_tool_calls=False)
    if stream:   # a call's name first, then its arguments in pieces as they are written
        chunks = list(openai_client.chat.completions.create(stream=True, **request))
        deltas = [d for e in chunks for c in e.choices for d in c.delta.tool_calls or []]
        assert {d.index for d in deltas} == {0} and [d.function.name for d in deltas if d.function.name]
        calls = [(deltas[0].function.name, "".join(d.function.arguments or "" for d in deltas))]
        [reason] = [c.finish_reason for e in chunks for c in e.choices if c.finish_reason]
    else:
        choice = openai_client.chat.completions.create(**request).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        reason = choice.finish_reason
    assert len(calls) == 1 and reason in ("tool_calls", "length")
    for name, arguments in calls:
        if reason == "length":   # sampled at 0.8, a string can run to max_tokens: the call so far, as OpenAI cuts one
            assert name in SCHEMAS and arguments.startswith("{")
        else:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_a_function_without_parameters_gets_empty_arguments_and_a_cut_required_call_comes_back_as_a_call(engine):
    now = {"type": "function", "function": {"name": "now", "description": "The current time"}}
    forced = {"messages": [{"role": "user", "content": "What time is it?"}], "tools": TOOLS + [now],
              "tool_choice": {"type": "function", "function": {"name": "now"}}, "temperature": 0, "max_tokens": 20}
    response = httpx.post(engine.base_url + "/v1/chat/completions", json=forced, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    [call] = response.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "now", "arguments": "{}"}
    cut = {"messages": [{"role": "user", "content": "What is the weather in Oslo?"}], "tools": TOOLS,
           "tool_choice": "required", "temperature": 0, "max_tokens": 12, "parallel_tool_calls": False}
    response = httpx.post(engine.base_url + "/v1/chat/completions", json=cut, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None, choice
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] in SCHEMAS and "<tool_call>" not in call["function"]["arguments"]
    streamed, reasons = [], []
    with httpx.stream("POST", engine.base_url + "/v1/chat/completions", json=dict(cut, stream=True), headers=AUTH,
                      timeout=120) as sse:
        for line in sse.iter_lines():
            if line.startswith("data: {"):
                for c in orjson.loads(line[6:])["choices"]:
                    assert not c["delta"].get("content"), c
                    streamed += c["delta"].get("tool_calls") or []
                    reasons += [c["finish_reason"]] if c["finish_reason"] else []
    assert reasons == ["length"] and [d["function"] for d in streamed] == [call["function"]]


@pytest.mark.parametrize("headers", [
    {}, {"Authorization": "Bearer sk-wrong-key-of-same-len"}, {"Authorization": "Bearer x"},
    {"Authorization": KEY_FLAG}, {"Authorization": f"Basic {KEY_FLAG}"}, {"Authorization": "Bearer"},
])
def test_without_a_right_bearer_key_v1_routes_answer_401_in_openai_form(engine, headers):
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions")):
        response = httpx.request(method, engine.base_url + path, headers=headers, timeout=30,
                                 json={"prompt": "hi", "max_tokens": 1} if method == "POST" else None)
        assert response.status_code == 401, (path, response.text)
        assert response.headers["www-authenticate"].startswith("Bearer")
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
        assert response.headers["x-request-id"]


def test_either_configured_key_is_accepted_and_health_and_metrics_stay_open(engine):
    for key in (KEY_FLAG, KEY_FILE):
        response = httpx.post(engine.base_url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                              json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
        assert response.status_code == 200, response.text
    models = httpx.get(engine.base_url + "/v1/models", headers=AUTH, timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct"]
    health = httpx.get(engine.base_url + "/health", timeout=10)
    assert health.status_code == 200 and set(health.json()) == {"status", "problems", "actors"}
    for secret in (KEY_FLAG, KEY_FILE, "chatml_tools", "max_queued", str(MAX_QUEUED), "config"):
        assert secret not in health.text
    assert httpx.get(engine.base_url + "/metrics", timeout=10).status_code == 200


def test_every_kind_of_response_carries_x_request_id(engine):
    base = engine.base_url
    with httpx.Client(base_url=base, timeout=120, headers=AUTH) as http:
        ok = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 2})
        assert ok.status_code == 200 and ok.headers["x-request-id"] == ok.json()["id"]
        mine = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"X-Request-Id": "mine-1"})
        assert mine.headers["x-request-id"] == "mine-1" == mine.json()["id"]
        with http.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True}) as sse:
            first = next(line for line in sse.iter_lines() if line.startswith("data: {"))
            assert sse.headers["x-request-id"] == orjson.loads(first[6:])["id"]
        bad = http.post("/v1/completions", content=b"{not json", headers={"X-Request-Id": "mine-400"})
        assert bad.status_code == 400 and bad.headers["x-request-id"] == "mine-400"
        assert http.post("/v1/completions", content=b"[]").headers["x-request-id"].startswith("req-")
        missing = http.get("/v1/no-such-route")
        assert missing.status_code == 404 and missing.headers["x-request-id"]
        big = http.post("/v1/completions", content=b"x" * (5 << 20), headers={"Content-Type": "application/json",
                                                                              "X-Request-Id": "mine-413"})
        assert big.status_code == 413 and big.headers["x-request-id"] == "mine-413"
        late = http.post("/v1/completions", json={"prompt": "Tell me a long story.", "max_tokens": 1000,
                                                  "ignore_eos": True, "timeout": 1})
        assert late.status_code == 504 and late.headers["x-request-id"].startswith("cmpl-")

    async def full_then_503() -> httpx.Response:
        async with httpx.AsyncClient(base_url=base, timeout=120, headers=AUTH) as client:
            hold = {"prompt": "Count slowly:", "max_tokens": 30, "ignore_eos": True, "n": MAX_QUEUED - 12,
                    "stream": True}
            async with client.stream("POST", "/v1/completions", json=hold) as held:
                assert held.status_code == 200
                return await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 16},
                                          headers={"X-Request-Id": "mine-503"})

    busy = asyncio.run(full_then_503())
    assert busy.status_code == 503 and busy.headers["x-request-id"] == "mine-503"
    wait_until(lambda: httpx.get(base + "/health", timeout=5).status_code == 200, 30, 0.2, "/health 200")
