"""Tool calling and structured outputs in the API's plain code (api/tools.py, api/protocol.py): validation, the
prompt the model sees, the grammars of forced calls, and parsing recorded model outputs into ``tool_calls``."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest

from api.protocol import RequestParser
from api.tools import (ToolCallStream, ToolDeltas, finished_choice, parse_tool_calls, parse_tools,
                       required_call_grammar)
from gpu.grammar import GrammarCompiler, lark_grammar
from gpu.tokenizer import Tokenizer
from pdserve.errors import InvalidRequestError

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "required": ["a", "b"], "properties": {"a": {"type": "integer"},
                                                                      "b": {"type": "integer"}}}}}]
# Outputs as models write them (Hermes/Qwen format), with what they must parse to.
RECORDED = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ('Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>',
     "Let me check.", [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo", "unit": "celsius"})]),
    ('<tool_call>{"name": "add", "parameters": {"a": 5, "b": 7}}</tool_call>', None, [("add", {"a": 5, "b": 7})]),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1,\n</tool_call> that was not JSON',
     '<tool_call>\n{"name": "add", "arguments": {"a": 1,\n</tool_call> that was not JSON', []),
    ("The capital of France is Paris. <tool_call", "The capital of France is Paris. <tool_call", []),
    ("No tools needed: 2 < 3.", "No tools needed: 2 < 3.", []),
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load(None)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer=tokenizer)


@pytest.fixture(scope="module")
def parser(tokenizer, compiler) -> RequestParser:
    return RequestParser(tokenizer, MODEL, 2048, reserve_tokens=16, grammars=compiler)


def chat(**extra) -> dict:
    return {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], **extra}


@pytest.mark.parametrize("text,content,calls", RECORDED)
def test_recorded_outputs_parse_into_content_and_calls(text, content, calls):
    got_content, got_calls = parse_tool_calls(text)
    assert got_content == content
    assert [(c["name"], json.loads(c["arguments"])) for c in got_calls] == calls


@pytest.mark.parametrize("text,content,calls", RECORDED)
def test_streamed_in_any_pieces_the_same_calls_and_content_come_out(text, content, calls):
    rng = random.Random(len(text))
    for _ in range(20):
        stream = ToolCallStream()
        events, pos = [], 0
        while pos < len(text):
            step = rng.randint(1, 7)
            events += stream.push(text[pos:pos + step])
            pos += step
        events += stream.finish()
        streamed = "".join(v for k, v in events if k == "content")
        assert (streamed or None) == content
        assert [(v["name"], json.loads(v["arguments"])) for k, v in events if k == "call"] == calls


def assembled(entries: list[dict]) -> list[dict]:
    """Streamed ``delta.tool_calls`` entries joined by index, as a client rebuilds them: ``[{"name", "arguments"}]``."""
    calls: dict[int, dict] = {}
    for entry in entries:
        call = calls.setdefault(entry["index"], {"name": None, "arguments": ""})
        call["name"] = entry["function"].get("name") or call["name"]
        call["arguments"] += entry["function"].get("arguments") or ""
    return [calls[i] for i in sorted(calls)]


def test_without_parallel_tool_calls_only_the_first_call_is_kept():
    text = RECORDED[1][0]
    assert [c["name"] for c in parse_tool_calls(text, parallel=False)[1]] == ["add"]
    deltas = ToolDeltas(parse_tools({"tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": False})[1])
    pieces = deltas.push(text, final=True)
    assert [c["name"] for c in assembled([e for _, c in pieces for e in c or ()])] == ["add"]
    assert deltas.finish_reason("stop") == "tool_calls" and deltas.finish_reason("length") == "length"


def test_a_named_function_streams_its_arguments_as_pieces_of_one_call():
    plan = parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}})[1]
    deltas = ToolDeltas(plan)
    pieces = [deltas.push(t, final=False) for t in ('{"a"', ': 1, "b"', "", ": 2}")]
    first = pieces[0][0][1][0]
    assert first["function"]["name"] == "add" and first["id"].startswith("call_") and first["index"] == 0
    args = "".join(c[0]["function"]["arguments"] for p in pieces for _, c in p)
    assert json.loads(args) == {"a": 1, "b": 2}
    content, calls, reason = finished_choice(plan, '{"a": 1, "b": 2}', "stop")
    assert content is None and reason == "tool_calls" and json.loads(calls[0]["function"]["arguments"]) == {"a": 1,
                                                                                                          "b": 2}


NOW = {"type": "function", "function": {"name": "now", "description": "The current time"}}   # no parameters


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "now"}}, "required"])
def test_a_function_declared_without_parameters_takes_only_empty_arguments(parser, compiler, tokenizer, choice):
    """An open object schema let a forced call to ``now`` make arguments up (even another tool's call)."""
    gen = parser.chat(chat(tools=TOOLS + [NOW], tool_choice=choice, parallel_tool_calls=False))
    head, tail = ('<tool_call>\n{"name":"now","arguments":', "}\n</tool_call>") if choice == "required" else ("", "")
    assert compiler.matcher(gen.sampling.grammar, tokenizer.encode(head + "{}" + tail)).is_terminated()
    made_up = compiler.matcher(gen.sampling.grammar, tokenizer.encode(head + "{"))
    assert not made_up.accept(tokenizer.encode('"')[0])   # no property may follow


CUT = [   # (required-mode output cut by max_tokens, the partial call it must come back as)
    ('<tool_call>\n{"name":"add","arguments":{"a":1,', ("add", '{"a":1,')),
    ('<tool_call>\n{"name":"get_wea', ("get_weather", "")),
    ('<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_', ("add", '{"a":1,"b":2}')),
    ('<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>\n<tool_call>\n{"name":"add","argu',
     ("add", "")),
    # a string cut where it reads like the end of the block: the text so far, the marker's start with it
    ('<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo}}</tool', ("get_weather", '{"city":"Oslo}}</tool')),
]


@pytest.mark.parametrize("text,partial", CUT)
def test_a_required_call_cut_by_max_tokens_comes_back_as_tool_calls_with_its_partial_arguments(text, partial):
    plan = parse_tools({"tools": TOOLS, "tool_choice": "required"})[1]
    content, calls, reason = finished_choice(plan, text, "length")
    assert content is None and reason == "length"
    assert (calls[-1]["function"]["name"], calls[-1]["function"]["arguments"]) == partial
    assert len(calls) == 1 + text.count("</tool_call>")
    deltas = ToolDeltas(plan)
    pieces = [p for k in range(0, len(text), 7) for p in deltas.push(text[k:k + 7], False)] + \
        deltas.push("", "length")
    streamed = assembled([e for _, c in pieces for e in c or ()])
    assert not any(piece for piece, _ in pieces) and deltas.finish_reason("length") == "length"
    assert [(f["name"], f["arguments"]) for f in streamed][-1] == partial and len(streamed) == len(calls)


@pytest.mark.parametrize("body,param", [
    ({"tools": "f"}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_malformed_tool_requests_are_a_400_naming_the_field(body, param):
    with pytest.raises(InvalidRequestError) as err:
        parse_tools(body)
    assert err.value.param == param


def test_a_named_tool_choice_constrains_decoding_to_the_functions_parameters(parser, compiler, tokenizer):
    gen = parser.chat(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert gen.tools.mode == "named" and gen.tools.function == "get_weather"
    m = compiler.matcher(gen.sampling.grammar, tokenizer.encode('{"city":"Paris","unit":"celsius"}'))
    assert m.is_terminated()
    bad = compiler.matcher(gen.sampling.grammar, tokenizer.encode('{"city":"Paris","unit":"'))
    assert not bad.accept(tokenizer.encode("kelvin")[0])


def test_required_accepts_a_call_of_any_tool_that_validates_and_nothing_else(compiler, tokenizer):
    grammar = lark_grammar(required_call_grammar(TOOLS, parallel=True))
    compiler.check(grammar, "tool_choice")
    text = ('<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>\n'
            '<tool_call>\n{"name":"get_weather","arguments":{"city":"Rome","unit":"celsius"}}\n</tool_call>')
    m = compiler.matcher(grammar)
    for t in tokenizer.encode(text):
        assert m.accept(t), tokenizer.decode([t])
    _, calls = parse_tool_calls(text)
    jsonschema.validate(json.loads(calls[1]["arguments"]), WEATHER)
    single = compiler.matcher(lark_grammar(required_call_grammar(TOOLS, parallel=False)),
                              tokenizer.encode(text.split("\n<tool_call>")[0]))
    assert single.is_terminated()
    wrong = compiler.matcher(grammar, tokenizer.encode('<tool_call>\n{"name":"'))
    assert not wrong.accept(tokenizer.encode("delete_everything")[0])


def test_response_format_json_schema_and_json_object_set_a_grammar_on_chat_and_completions(parser):
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    assert parser.chat(chat(response_format=fmt)).sampling.grammar
    assert parser.completions({"prompt": "JSON:", "response_format": {"type": "json_object"}})[0].sampling.grammar
    assert parser.chat(chat(response_format={"type": "text"})).sampling.grammar is None


@pytest.mark.parametrize("fmt", [
    {"type": "xml"},
    {"type": "json_schema"},
    {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "string", "format": "no-such-format"}}}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}},
])
def test_a_response_format_the_library_or_we_reject_is_a_400_naming_response_format(parser, fmt):
    with pytest.raises(InvalidRequestError) as err:
        parser.chat(chat(response_format=fmt))
    assert err.value.param == "response_format"


@pytest.mark.parametrize("fmt", [{"type": "json_object", "schema": 123}, {"type": "json_object", "strict": True},
                                 {"type": "text", "schema": {}},
                                 {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "extra": 1}}])
def test_a_response_format_key_we_do_not_read_is_a_400_naming_it(parser, fmt):
    for call, body in ((parser.chat, chat(response_format=fmt)),
                       (parser.completions, {"prompt": "JSON:", "response_format": fmt})):
        with pytest.raises(InvalidRequestError) as err:
            call(body)
        assert err.value.param == "response_format" and ("schema" in err.value.message or "strict" in
                                                         err.value.message or "extra" in err.value.message)


def test_a_json_object_schema_is_honoured_as_a_json_schema_is(parser):
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    via_object = parser.chat(chat(response_format={"type": "json_object", "schema": schema})).sampling.grammar
    via_schema = parser.chat(chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema}})).sampling.grammar
    assert via_object == via_schema != parser.chat(chat(response_format={"type": "json_object"})).sampling.grammar


@pytest.mark.parametrize("extra, field", [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": WEATHER}}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
])
@pytest.mark.parametrize("stop", ["}", [",", "]"]])
def test_a_stop_string_with_a_constrained_answer_is_a_400_naming_both_fields(parser, extra, field, stop):
    """A stop string matched inside constrained output cuts it into text its grammar does not accept (JSON that
    does not parse): refused, not served."""
    calls = [(parser.chat, chat(stop=stop, **extra))]
    if field == "response_format":
        calls.append((parser.completions, {"prompt": "JSON:", "stop": stop, **extra}))
    for call, body in calls:
        with pytest.raises(InvalidRequestError) as err:
            call(body)
        assert err.value.param == "stop" and f"'{field}'" in err.value.message, err.value.message
    assert parser.chat(chat(stop=stop, tools=TOOLS)).stop   # tool_choice auto: nothing constrained, stop is kept


def test_tools_and_response_format_together_are_refused(parser):
    with pytest.raises(InvalidRequestError) as err:
        parser.chat(chat(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}))
    assert err.value.param == "response_format"


HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
               "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]


def test_a_template_without_tools_sees_them_in_the_system_turn_and_the_history_as_text(parser, tokenizer):
    gen = parser.chat({"messages": HISTORY, "tools": TOOLS})
    prompt = tokenizer.decode(gen.prompt_ids, skip_special_tokens=False)
    assert '"name": "get_weather"' in prompt.split("<|im_end|>")[0]   # offered in the system turn
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in prompt
    assert "<|im_start|>user\n<tool_response>\n{\"temperature\": 21}\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    none = parser.chat({"messages": HISTORY[:1], "tools": TOOLS, "tool_choice": "none"})
    assert "<tools>" not in tokenizer.decode(none.prompt_ids, skip_special_tokens=False) and none.tools is None


def test_a_chat_template_file_that_renders_tools_receives_them(tokenizer, compiler):
    from tests.conftest import ROOT

    own = Tokenizer.load(None)
    own.set_chat_template((ROOT / "examples" / "chatml_tools.jinja").read_text())
    parser = RequestParser(own, MODEL, 2048, reserve_tokens=16, grammars=compiler)
    assert parser.template_has_tools
    prompt = tokenizer.decode(parser.chat({"messages": HISTORY, "tools": TOOLS}).prompt_ids, skip_special_tokens=False)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert '"name": "add"' in prompt and "<tool_response>\n{\"temperature\": 21}" in prompt


@pytest.mark.parametrize("message", [
    {"role": "assistant", "content": None},
    {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": 3}}]},
    {"role": "assistant", "content": None, "tool_calls": "x"},
    {"role": "tool", "content": "21"},
])
def test_malformed_tool_history_is_a_400_naming_messages(parser, message):
    with pytest.raises(InvalidRequestError) as err:
        parser.chat({"messages": [{"role": "user", "content": "hi"}, message]})
    assert err.value.param == "messages"
