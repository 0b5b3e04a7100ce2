"""The dialects' plain code (api/dialects): Responses and Messages bodies translated into the chat request the
engine runs (the same prompt ids, tools plan and grammar as the equivalent chat body), engine events rendered as
each dialect's SSE sequence, the bounded response store, error shapes, and x-api-key on the key check."""
from __future__ import annotations

import json

import orjson
import pytest
from prometheus_client import CollectorRegistry

from api.dialects import anthropic, responses
from api.dialects.events import Outcome
from api.middleware import ApiKeyMiddleware
from api.protocol import RequestParser
from gpu.grammar import GrammarCompiler
from gpu.tokenizer import Tokenizer
from pdserve.errors import InvalidRequestError, ModelNotFoundError

MODEL = "SmolLM2-135M-Instruct"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.fixture(scope="module")
def parser() -> RequestParser:
    tokenizer = Tokenizer.load(None)
    return RequestParser(tokenizer, MODEL, 2048, reserve_tokens=16, grammars=GrammarCompiler(tokenizer=tokenizer))


def frames(raw: list[bytes]) -> list[tuple[str, dict]]:
    out = []
    for frame in raw:
        event, data = frame.decode().strip().split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        body = orjson.loads(data[6:])
        assert body["type"] == event[7:]
        out.append((body["type"], body))
    return out


# -- translation: the same internal request as chat ---------------------------------------------------------------

def test_a_responses_body_becomes_the_chat_request_of_the_same_conversation(parser):
    tools = [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]
    body = {"model": MODEL, "instructions": "Be brief.", "tools": tools, "max_output_tokens": 30, "temperature": 0,
            "tool_choice": "required", "reasoning": {"effort": "low"}, "prompt_cache_key": "k", "store": False,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
                      {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                       "arguments": '{"city": "Paris"}'},
                      {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
                      {"type": "reasoning", "summary": []}]}
    chat_body, conversation = responses.translate(body)
    got = parser.chat(chat_body, "r1")
    want = parser.chat({"model": MODEL, "max_tokens": 30, "temperature": 0, "tool_choice": "required", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]}, "r1")
    assert got.prompt_ids == want.prompt_ids and got.sampling == want.sampling and got.tools == want.tools
    assert got.sampling.grammar and got.tools.mode == "required"
    assert [m["role"] for m in conversation] == ["user", "assistant", "tool"]   # no instructions kept


def test_a_stored_conversation_is_prepended_and_text_format_becomes_a_grammar(parser):
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    body = {"input": "And now?", "text": {"format": {"type": "json_schema", "name": "w", "schema": SCHEMA}}}
    chat_body, conversation = responses.translate(body, history)
    assert conversation == history + [{"role": "user", "content": "And now?"}]
    gen = parser.chat(chat_body, "r2")
    assert gen.sampling.grammar == parser.chat({"messages": conversation, "response_format": {
        "type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}}, "r2").sampling.grammar


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "max_output_token": 5}, "max_output_token"),
    ({"input": ""}, "input"),
    ({"input": [{"type": "input_image"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": "hi", "tools": [{"type": "retrieval"}]}, "tools"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "instructions": 3}, "instructions"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    # echoed fields, bounded as OpenAI bounds them
    ({"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"input": "hi", "metadata": {"k" * 65: "v"}}, "metadata"),
    ({"input": "hi", "metadata": {"k": "v" * 513}}, "metadata"),
    ({"input": "hi", "metadata": {"k": {"nested": "v"}}}, "metadata"),
    ({"input": "hi", "user": {"id": 1}}, "user"),
    ({"input": "hi", "user": "u" * 513}, "user"),
    ({"input": "hi", "reasoning": "high"}, "reasoning"),
])
def test_bad_responses_bodies_are_400s_naming_the_responses_field(body, param):
    with pytest.raises(InvalidRequestError) as exc:
        responses.translate(body)
    assert exc.value.param == param


def test_the_chat_parsers_errors_come_back_with_the_dialects_field_names(parser):
    chat_body, _ = responses.translate({"input": "hi", "max_output_tokens": 10**6})
    with pytest.raises(InvalidRequestError) as exc:
        parser.chat(chat_body, "r")
    error = responses.renamed(exc.value)
    assert error.param == "max_output_tokens" and "max_output_tokens" in error.message
    chat_body = anthropic.translate({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                                     "stop_sequences": [""]})
    with pytest.raises(InvalidRequestError) as exc:
        parser.chat(chat_body, "r")
    assert anthropic.renamed(exc.value).param == "stop_sequences"


def test_a_messages_body_becomes_the_chat_request_of_the_same_conversation(parser):
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": SCHEMA, "cache_control": {}}]
    body = {"model": MODEL, "max_tokens": 40, "temperature": 0, "top_k": 5,
            "system": [{"type": "text", "text": "Be brief."}], "tools": tools,
            "tool_choice": {"type": "tool", "name": "get_weather"}, "thinking": {"type": "disabled"},
            "messages": [{"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": [
                             {"type": "thinking", "thinking": "...", "signature": "s"},
                             {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                         {"role": "user", "content": [
                             {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text",
                                                                                           "text": "Sunny"}]},
                             {"type": "text", "text": "Thanks"}]}]}
    got = parser.chat(anthropic.translate(body), "m1")
    want = parser.chat({"model": MODEL, "max_tokens": 40, "temperature": 0, "top_k": 5,
                        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"}, {"role": "user", "content": "Thanks"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                    "parameters": SCHEMA}}]}, "m1")
    assert got.prompt_ids == want.prompt_ids and got.sampling == want.sampling
    assert got.tools.mode == "named" and got.tools.function == "get_weather"
    # stop_sequences become chat's stop (a stop string beside a forced tool call is a 400, as in chat)
    unforced = parser.chat(anthropic.translate({**body, "tool_choice": {"type": "auto"}, "stop_sequences": ["END"]}),
                           "m2")
    assert unforced.stop == ("END",)


@pytest.mark.parametrize("choice, mode, parallel", [
    ({"type": "any"}, "required", True), ({"type": "auto"}, "auto", True),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", False), ({"type": "none"}, None, None)])
def test_anthropic_tool_choice_maps_onto_the_chat_tools_plan(parser, choice, mode, parallel):
    body = {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tool_choice": choice,
            "tools": [{"name": "f", "input_schema": SCHEMA}]}
    plan = parser.chat(anthropic.translate(body), "m").tools
    if mode is None:
        assert plan is None
    else:
        assert (plan.mode, plan.parallel) == (mode, parallel)


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 5, "messages": []}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "temperature": 1.5}, "temperature"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "bash_20250124"}]},
     "tools"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "max_token": 5}, "max_token"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "all"}},
     "tool_choice"),
])
def test_bad_messages_bodies_are_400s_naming_the_field(body, param):
    with pytest.raises(InvalidRequestError) as exc:
        anthropic.translate(body)
    assert exc.value.param == param


def test_anthropic_error_bodies_follow_the_status():
    assert anthropic.error_body(InvalidRequestError("bad")) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}
    assert anthropic.error_body(ModelNotFoundError("no"))["error"]["type"] == "not_found_error"
    assert anthropic.error_body("x", 529)["error"]["type"] == "overloaded_error"
    assert anthropic.error_body("x", 500)["error"]["type"] == "api_error"


# -- rendering the shared engine events ---------------------------------------------------------------------------

TEXT_EVENTS = [("text", "Hel"), ("text", "lo"), ("call", "call_ab", "get_weather", '{"ci'), ("args", 'ty": "Oslo"}'),
               ("finish", "tool_calls", None)]


def test_the_responses_stream_is_the_documented_event_sequence():
    meta = responses.ResponseMeta("resp_1", MODEL, {"input": "x"})
    stream = responses.ResponseStream(meta)
    raw = stream.start()
    for event in TEXT_EVENTS[:-1]:
        raw += stream.event(event)
    closing, final = stream.finish("tool_calls", responses.usage_body(10, 5))
    got = frames(raw + closing)
    assert [k for k, _ in got] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [b["sequence_number"] for _, b in got] == list(range(len(got)))
    assert final["status"] == "completed" and final["usage"]["total_tokens"] == 15
    message, call = final["output"]
    assert message["content"][0]["text"] == "Hello" and message["status"] == "completed"
    assert call["arguments"] == '{"city": "Oslo"}' and call["call_id"] == "call_ab" and call["name"] == "get_weather"
    assert got[-1][1]["response"] == final
    assert all(b["output_index"] == 1 for k, b in got if k.startswith("response.function_call"))


def test_a_length_cut_response_is_incomplete_with_max_output_tokens():
    meta = responses.ResponseMeta("resp_2", MODEL, {"input": "x", "max_output_tokens": 2})
    outcome = Outcome()
    for event in [("text", "ab"), ("finish", "length", None)]:
        outcome.add(event)
    body = responses.response_object(meta, outcome, responses.usage_body(3, 2))
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    stream = responses.ResponseStream(meta)
    stream.start()
    stream.event(("text", "ab"))
    closing, final = stream.finish("length", responses.usage_body(3, 2))
    assert frames(closing)[-1][0] == "response.incomplete" and final["status"] == "incomplete"


def test_the_messages_stream_is_the_documented_event_sequence():
    stream = anthropic.MessageStream("msg_1", MODEL)
    raw = stream.start(anthropic.usage_body(10, 0))
    for event in TEXT_EVENTS[:-1]:
        raw += stream.event(event)
    raw += stream.finish("tool_calls", None, anthropic.usage_body(10, 5, 4))
    got = frames(raw)
    assert [k for k, _ in got] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                   "content_block_delta", "content_block_stop", "content_block_start",
                                   "content_block_delta", "content_block_delta", "content_block_stop",
                                   "message_delta", "message_stop"]
    assert got[6][1] == {"type": "content_block_start", "index": 1, "content_block": {
        "type": "tool_use", "id": "toolu_ab", "name": "get_weather", "input": {}}}
    assert "".join(b["delta"]["partial_json"] for k, b in got[7:9]) == '{"city": "Oslo"}'
    assert got[10][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert got[10][1]["usage"]["output_tokens"] == 5 and got[10][1]["usage"]["cache_read_input_tokens"] == 4


@pytest.mark.parametrize("reason, stop_string, want", [
    ("stop", None, "end_turn"), ("stop", "END", "stop_sequence"), ("length", None, "max_tokens"),
    ("tool_calls", None, "tool_use")])
def test_finish_reasons_map_onto_anthropic_stop_reasons(reason, stop_string, want):
    outcome = Outcome(text="x", reason=reason, stop_string=stop_string)
    if reason == "tool_calls":
        outcome.calls.append({"id": "call_1", "name": "f", "arguments": '{"a": 1}'})
    body = anthropic.message_object("msg_1", MODEL, outcome, anthropic.usage_body(3, 1))
    assert body["stop_reason"] == want and body["stop_sequence"] == stop_string
    if reason == "tool_calls":
        assert body["content"][1] == {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}


# -- the response store -------------------------------------------------------------------------------------------

def test_the_store_is_per_key_bounded_and_expires():
    now = [0.0]
    store = responses.ResponseStore(max_entries=2, ttl_s=10, clock=lambda: now[0])
    for i in range(3):
        store.put("k1", {"id": f"r{i}"}, [{"role": "user", "content": str(i)}])
    assert store.get("k1", "r0") is None   # the oldest went out at the cap
    assert store.history("k1", "r2") == [{"role": "user", "content": "2"}]
    assert store.get("k2", "r2") is None and not store.delete("k2", "r2")   # another key sees nothing
    with pytest.raises(ModelNotFoundError) as exc:
        store.history("k2", "r2")
    assert exc.value.param == "previous_response_id" and exc.value.http_status == 404
    now[0] = 10.5
    assert store.get("k1", "r1") is None and store.get("k1", "r2") is None and not store.entries
    store.put("k1", {"id": "r3"}, [])
    assert store.delete("k1", "r3") and store.get("k1", "r3") is None


def test_one_keys_load_never_evicts_another_keys_responses():
    store = responses.ResponseStore(max_entries=4)
    store.put("a", {"id": "ra"}, [{"role": "user", "content": "A's conversation"}])
    for i in range(10):   # key b well past its cap
        store.put("b", {"id": f"rb{i}"}, [])
    assert store.history("a", "ra") == [{"role": "user", "content": "A's conversation"}]
    assert [rid for rid in store.entries if store.entries[rid].key == "b"] == ["rb6", "rb7", "rb8", "rb9"]


def test_the_store_is_bounded_in_bytes_per_key_oldest_first_and_counts_them():
    store = responses.ResponseStore(max_bytes=3000)
    text = "x" * 900
    for i in range(4):
        assert store.put("b", {"id": f"r{i}"}, [{"role": "user", "content": text}])
    assert list(store.entries) == ["r1", "r2", "r3"] and store.key_bytes["b"] <= 3000   # r0 went for r3
    assert not store.put("b", {"id": "huge"}, [{"role": "user", "content": "y" * 4000}])   # alone over the bound
    assert store.get("b", "huge") is None and list(store.entries) == ["r1", "r2", "r3"]
    store.put("a", {"id": "ra"}, [{"role": "user", "content": text}])
    registry = CollectorRegistry()
    registry.register(store)
    assert registry.get_sample_value("pdserve_response_store_entries") == 4
    assert registry.get_sample_value("pdserve_response_store_bytes") == sum(len(e.blob) for e in store.entries.values())
    assert store.delete("a", "ra") and store.delete("b", "r1") and store.delete("b", "r2") and store.delete("b", "r3")
    assert registry.get_sample_value("pdserve_response_store_bytes") == 0 and not store.by_key


def test_the_assistant_message_stored_carries_the_calls():
    outcome = Outcome(text="", calls=[{"id": "call_1", "name": "f", "arguments": "{}"}], reason="tool_calls")
    message = responses.assistant_message(outcome)
    assert message["content"] is None and json.loads(message["tool_calls"][0]["function"]["arguments"]) == {}


@pytest.mark.parametrize("header, x_api_key, ok", [(None, "sk-right", True), (None, "sk-wrong", False),
                                                   ("Bearer sk-right", None, True), (None, None, False),
                                                   ("Bearer sk-wrong", "sk-right", False), (None, "", False)])
def test_the_key_check_takes_x_api_key_when_no_authorization_is_sent(header, x_api_key, ok):
    assert ApiKeyMiddleware(None, ["sk-right"]).authorized(header, x_api_key) is ok


def test_claude_codes_output_config_effort_is_accepted_and_a_json_schema_format_constrains_the_answer(parser):
    base = {"model": MODEL, "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}
    plain = parser.chat(anthropic.translate(base), "oc0")
    hinted = parser.chat(anthropic.translate({**base, "output_config": {"effort": "high"},
                                              "thinking": {"type": "adaptive"}}), "oc1")
    assert hinted.prompt_ids == plain.prompt_ids and hinted.sampling == plain.sampling
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    chat = anthropic.translate({**base, "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    assert parser.chat(chat, "oc2").sampling != plain.sampling   # the grammar is on


@pytest.mark.parametrize("config, param", [
    ({"effort": "extreme"}, "output_config.effort"), ({"verbosity": "low"}, "output_config.verbosity"),
    ({"format": {"type": "json_object"}}, "output_config.format"), ("high", "output_config")])
def test_an_output_config_we_do_not_honour_is_a_400_naming_it(config, param):
    body = {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "output_config": config}
    with pytest.raises(InvalidRequestError) as err:
        anthropic.translate(body)
    assert err.value.param == param


def test_a_system_message_inside_the_messages_list_becomes_a_chat_system_message():
    # Claude Code 2.1 sends {"role": "system", "content": "..."} among the turns (seen against pdserve)
    body = {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                                          {"role": "system", "content": "Remember the rules."},
                                          {"role": "user", "content": "go"}]}
    assert anthropic.translate(body)["messages"] == [
        {"role": "user", "content": "hi"}, {"role": "system", "content": "Remember the rules."},
        {"role": "user", "content": "go"}]
    with pytest.raises(InvalidRequestError) as err:
        anthropic.translate({**body, "messages": [{"role": "tool", "content": "x"}]})
    assert err.value.param == "messages"


def test_the_codex_clis_request_fields_and_hosted_tools_are_accepted_and_only_function_tools_reach_the_model():
    # what Codex CLI 0.171 sent against pdserve: client_metadata, include, reasoning, developer messages, and a
    # web_search and a namespace tool beside its function tools
    fn = {"type": "function", "name": "exec_command", "parameters": SCHEMA}
    body = {"model": MODEL, "stream": True, "tool_choice": "auto", "parallel_tool_calls": True,
            "reasoning": {"summary": "auto"}, "store": False, "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "t1", "client_metadata": {"thread_id": "t1"},
            "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
            "tools": [fn, {"type": "namespace", "name": "multi_agent_v1", "tools": []}, {"type": "web_search"}]}
    chat, _ = responses.translate(body)
    assert [t["function"]["name"] for t in chat["tools"]] == ["exec_command"]
    assert [m["role"] for m in chat["messages"]][-1] == "user"


# -- forward compatibility: unknown names of the Responses and Messages APIs ---------------------------------------

NEWER_RESPONSES = {"input": [{"role": "user", "content": "hi"}, {"type": "web_search_call_v9", "id": "ws_1"}],
                   "tools": [{"type": "tool_search_v2"}], "frobnicate": {"level": 3}}
NEWER_MESSAGES = {"max_tokens": 5, "frobnicate": True, "tools": [{"type": "bash_20250124", "name": "bash"}],
                  "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                            {"type": "hologram_v1", "data": "x"}]}]}


def test_unknown_responses_and_messages_names_are_accepted_logged_once_and_counted(parser, caplog):
    """Codex broke on a server that refused its new tool type (openai/codex issue 10635): by default an unknown
    field, item, block or tool type is left out, logged at WARNING the first time and counted; the request is the
    one without it."""
    from api.fields import UnknownFields
    from api.metrics import RequestMetrics

    unknown = UnknownFields()
    with caplog.at_level("WARNING", logger="api.fields"):
        for _ in range(2):
            chat_body, _ = responses.translate(NEWER_RESPONSES, unknown=unknown)
            plain, _ = responses.translate({"input": [{"role": "user", "content": "hi"}]})
            assert parser.chat(chat_body, "r").prompt_ids == parser.chat(plain, "r").prompt_ids
            assert chat_body["tools"] == []
            got = parser.chat(anthropic.translate(NEWER_MESSAGES, unknown=unknown), "m")
            want = parser.chat(anthropic.translate({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}),
                               "m")
            assert got.prompt_ids == want.prompt_ids and got.tools is None
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 6 and any("frobnicate" in w and "/v1/responses" in w for w in warned), warned
    assert unknown.counts[("/v1/responses", "frobnicate")] == 2
    assert unknown.counts[("/v1/responses", "input:web_search_call_v9")] == 2
    assert unknown.counts[("/v1/messages", "tools:bash_20250124")] == 2
    assert unknown.counts[("/v1/messages", "hologram_v1")] == 2
    metrics = RequestMetrics("admitted")
    metrics.watch_unknown_fields(unknown)
    text = metrics.render()[0].decode()
    assert 'pdserve_unknown_request_fields_total{field="frobnicate",route="/v1/responses"} 2.0' in text


@pytest.mark.parametrize("body, translate, param", [
    ({"input": "hi", "frobnicate": 1}, lambda b, u: responses.translate(b, unknown=u), "frobnicate"),
    ({**NEWER_RESPONSES, "frobnicate": None}, lambda b, u: responses.translate(b, unknown=u), "input"),
    ({"input": "hi", "tools": [{"type": "tool_search_v2"}]}, lambda b, u: responses.translate(b, unknown=u), "tools"),
    ({**NEWER_MESSAGES, "tools": None, "frobnicate": None}, lambda b, u: anthropic.translate(b, unknown=u),
     "messages"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "frobnicate": 1},
     lambda b, u: anthropic.translate(b, unknown=u), "frobnicate"),
])
def test_strict_fields_restores_the_400_naming_the_unknown_name(body, translate, param):
    from api.fields import UnknownFields

    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(InvalidRequestError) as exc:
        translate(body, UnknownFields(strict=True))
    assert exc.value.param == param and exc.value.code == "unknown_parameter"
    translate(body, UnknownFields())   # accepted without it


def test_a_content_part_we_cannot_honour_stays_a_400_whatever_the_mode():
    from api.fields import UnknownFields

    with pytest.raises(InvalidRequestError):
        responses.translate({"input": [{"type": "input_image", "image_url": "x"}]}, unknown=UnknownFields())
    with pytest.raises(InvalidRequestError):
        anthropic.translate({"max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {}}]}]}, unknown=UnknownFields())


# -- an auto call's arguments stream as they are written (issue 41 item 2) ----------------------------------------

WRITE = {"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "text": {"type": "string"}}}}}
LONG_TEXT = ('He said "close the brace }" then wrote </tool_call in a string; ' * 7)[:400]
LONG_CALL = json.dumps({"path": "notes/a}b.txt", "text": LONG_TEXT, "meta": [1, {"k": "v"}]})
LONG_ANSWER = f'Writing it.\n<tool_call>\n{{"name": "write_file", "arguments": {LONG_CALL}}}\n</tool_call>'


def _pieces(text: str, seed: int) -> list[str]:
    import random

    rng, out, pos = random.Random(seed), [], 0
    while pos < len(text):
        n = rng.randint(1, 6)
        out.append(text[pos:pos + n])
        pos += n
    return out


@pytest.mark.parametrize("seed", range(6))
def test_a_400_character_argument_streams_in_pieces_in_every_dialect_equal_to_the_whole_call(parser, seed):
    """The name once known, then the arguments' JSON text in pieces as tokens arrive (chat ``delta.tool_calls``,
    Responses ``function_call_arguments.delta``, Messages ``input_json_delta``); joined, the non-streamed call's."""
    from api.admission import RequestHandle
    from api.dialects.events import ChoiceEvents
    from api.dialects.openai import ChoiceResult
    from api.formats import ChatDeltas, finish_choice

    gen = parser.chat({"messages": [{"role": "user", "content": "Write it."}], "tools": [WRITE]}, "r")
    whole = ChoiceResult(0, LONG_ANSWER, "stop", None)
    finish_choice(gen.formats, gen.tools, whole)
    [call] = whole.tool_calls
    assert json.loads(call["function"]["arguments"]) == json.loads(LONG_CALL) and whole.finish_reason == "tool_calls"
    pieces = _pieces(LONG_ANSWER, seed)
    # chat
    deltas = ChatDeltas(gen.formats, gen.tools)
    out = [e for k, p in enumerate(pieces) for e in deltas.push(p, "stop" if k == len(pieces) - 1 else None)]
    entries = [c for _, cs, _ in out for c in cs or ()]
    args = [c["function"]["arguments"] for c in entries if c["function"].get("arguments")]
    assert entries[0]["function"] == {"name": "write_file", "arguments": ""} and entries[0]["id"] == entries[0]["id"]
    assert "".join(args) == call["function"]["arguments"] and len(args) >= 10
    assert "".join(c or "" for c, _, _ in out).strip() == "Writing it." and deltas.finish_reason("stop") == "tool_calls"
    # Responses and Messages, from the shared events
    events = ChoiceEvents(RequestHandle(gen, 0, 0))
    shared = [e for k, p in enumerate(pieces) for e in events.push(p, "stop" if k == len(pieces) - 1 else None)]
    meta = responses.ResponseMeta("resp_1", MODEL, {"input": "x"})
    rstream, mstream = responses.ResponseStream(meta), anthropic.MessageStream("msg_1", MODEL)
    raw_r, raw_m = rstream.start(), mstream.start(anthropic.usage_body(10, 0))
    for event in shared[:-1]:
        raw_r += rstream.event(event)
        raw_m += mstream.event(event)
    closing, final = rstream.finish("tool_calls", responses.usage_body(10, 5))
    got_r = frames(raw_r + closing)
    args_r = [b["delta"] for k, b in got_r if k == "response.function_call_arguments.delta"]
    assert "".join(args_r) == call["function"]["arguments"] == final["output"][-1]["arguments"]
    assert len(args_r) >= 10
    got_m = frames(raw_m + mstream.finish("tool_calls", None, anthropic.usage_body(10, 5)))
    args_m = [b["delta"]["partial_json"] for k, b in got_m if k == "content_block_delta"
              and b["delta"]["type"] == "input_json_delta"]
    assert "".join(args_m) == call["function"]["arguments"] and len(args_m) >= 10
    starts = [b["content_block"] for k, b in got_m if k == "content_block_start"]
    assert starts[-1]["type"] == "tool_use" and starts[-1]["name"] == "write_file"


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "write_file", "arguments": {"path": "a", "text": "b\\"}"}}\n</tool_call>',
    '<tool_call>{"name":"write_file","arguments":{"path":"a"}}</tool_call> and after',
    '<tool_call>\n{"name": "write_file", "arguments": {"path": "unclosed\n</tool_call>\nthen text',
    '<tool_call>\n{"name": "write_file", "arguments": {"path": "cut by the end',
    '<tool_call>\n{"name": "write_file", "arguments": {"path": "a"}}\nno closing tag, then words',
    '<tool_call>\n{"name": "nope", "arguments": {"path": "a"}}\n</tool_call>',
    '<tool_call>\n{"arguments": {"path": "a"}, "name": "write_file"}\n</tool_call>',
])
def test_streamed_and_whole_hermes_calls_agree_in_every_split(parser, text):
    """Whatever the text (strings holding braces and quotes, compact JSON, a block that closes or ends before its
    arguments do, an unknown name, the name after the arguments), the streamed calls joined are the whole answer's,
    and so are the content and the finish reason, in every split."""
    from api.dialects.openai import ChoiceResult
    from api.formats import ChatDeltas, finish_choice
    from tests.api.test_tools import assembled

    gen = parser.chat({"messages": [{"role": "user", "content": "Write it."}], "tools": [WRITE]}, "r")
    for reason in ("stop", "length"):
        whole = ChoiceResult(0, text, reason, None)
        finish_choice(gen.formats, gen.tools, whole)
        want = [c["function"] for c in whole.tool_calls]
        for seed in range(8):
            pieces = _pieces(text, seed) if seed else list(text)
            deltas = ChatDeltas(gen.formats, gen.tools)
            out = [e for k, p in enumerate(pieces) for e in deltas.push(p, reason if k == len(pieces) - 1 else None)]
            assert assembled([c for _, cs, _ in out for c in cs or ()]) == want, (reason, pieces)
            assert ("".join(c or "" for c, _, _ in out).strip() or None) == whole.text, (reason, pieces)
            assert deltas.finish_reason(reason) == whole.finish_reason
