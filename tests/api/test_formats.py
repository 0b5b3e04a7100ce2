"""Tool-call and reasoning parsers per family (api/formats.py) on the formats the families' chat templates write,
complete and streamed with awkward chunk boundaries, and their choice by family and flags."""
from __future__ import annotations

import json
import random
import re

import pytest

from api.formats import (FAMILY_DEFAULTS, TOOL_PARSERS, ChatDeltas, OutputFormats, ReasoningStream, choose,
                         finish_choice, prompt_opens_reasoning, split_reasoning, tool_parser)
from api.dialects.openai import ChoiceResult
from api.tools import ToolPlan, parse_tools
from gpu.families import FAMILIES
from tests.api.test_tools import assembled

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}

# what each family's model writes, as its chat template renders an assistant's tool calls (and the model cards show)
QWEN = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
# a call, then words about it (vLLM PR 19024's example): the call, and the words as content
LLAMA_THEN_TEXT = LLAMA + "\n\nI will check the weather in Paris for you."
LLAMA_TAGGED = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; ' \
               '{"name": "get_time", "parameters": {"zone": "CET"}}'
MISTRAL = ('Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
           '{"name": "get_time", "arguments": {"zone": "CET"}}]')
MISTRAL_V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
# the same calls as detokenization writes them: [TOOL_CALLS] is a control token, dropped with the special tokens
MISTRAL_DROPPED = ' [{"name": "get_weather", "arguments": {"city": "Paris"}}]'
# DeepSeek-V3's template writes type, name and fenced JSON per call; V3.1's the name and the JSON
DEEPSEEK_V3 = ('Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
               '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
               '```json\n{"zone": "CET"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
DEEPSEEK_V31 = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
                '<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "CET"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
PARIS = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
CET = {"name": "get_time", "arguments": '{"zone": "CET"}'}


def chunkings(text: str, seed: int = 0):
    """The text one character at a time, in random pieces, and whole."""
    rng = random.Random(seed)
    yield list(text)
    for _ in range(20):
        pieces, pos = [], 0
        while pos < len(text):
            n = rng.randint(1, 7)
            pieces.append(text[pos:pos + n])
            pos += n
        yield pieces
    yield [text]


def streamed(parser: str, pieces: list[str], parallel: bool = True):
    stream = tool_parser(parser).stream(parallel)
    events = [e for p in pieces for e in stream.push(p)] + stream.finish()
    content = "".join(v for k, v in events if k == "content").strip() or None
    return content, [v for k, v in events if k == "call"], events


@pytest.mark.parametrize("parser, text, content, calls", [
    ("hermes", QWEN, "Let me check.", [PARIS, CET]),
    ("llama3_json", LLAMA, None, [PARIS]),
    ("llama3_json", LLAMA_TAGGED, None, [PARIS, CET]),
    ("llama3_json", LLAMA_THEN_TEXT, "I will check the weather in Paris for you.", [PARIS]),
    ("mistral", MISTRAL, "Let me check.", [PARIS, CET]),
    ("mistral", MISTRAL_V11, None, [PARIS]),
    ("mistral", MISTRAL_DROPPED, None, [PARIS]),
    ("deepseek_v3", DEEPSEEK_V3, "Let me check.", [PARIS, CET]),
    ("deepseek_v3", DEEPSEEK_V31, None, [PARIS, CET]),
    ("deepseek_v31", DEEPSEEK_V31 + "\nDone.", "Done.", [PARIS, CET]),
])
def test_family_formats_complete_and_streamed(parser, text, content, calls):
    assert tool_parser(parser).parse(text) == (content, calls)
    for pieces in chunkings(text):
        got_content, got_calls, events = streamed(parser, pieces)
        assert (got_content, got_calls) == (content, calls), pieces
        for kind, value in events:   # no piece of a marker ever leaks into the content
            assert kind != "content" or not any(m in value for m in ("<tool_call", "[TOOL_CALLS", "<|python", "<｜"))


@pytest.mark.parametrize("parser, text", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par'),
    ("llama3_json", '{"answer": 42}'),   # JSON that is not a call
    ("llama3_json", '{"name": "Paris", "population": 2100000}'),   # an answer about a name, not a call
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Par'),
    ("mistral", '[TOOL_CALLS] [{"nom": "get_weather"}]'),
    ("mistral", '[{"nom": "get_weather"}] is a list'),
    ("mistral", 'See [1] and [{"name": "x", "arguments": {}}]'),   # a list after content needs the marker
    ("deepseek_v3", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Par'),
    ("deepseek_v3", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get weather<｜tool▁sep｜>{}<｜tool▁call▁end｜>'),
    ("deepseek_v31", '<｜tool▁calls▁begin｜>get_weather{"city": "Paris"}<｜tool▁calls▁end｜>'),
])
def test_malformed_calls_are_content(parser, text):
    content, calls = tool_parser(parser).parse(text)
    assert calls == [] and content == text.strip()
    for pieces in chunkings(text):
        assert streamed(parser, pieces)[:2] == (text.strip(), [])


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_plain_answers_stream_at_once(parser):
    stream = tool_parser(parser).stream(True)
    first = stream.push("The weather in Paris ")
    assert "".join(v for _, v in first).rstrip() == "The weather in Paris"
    rest = stream.push("is mild.") + stream.finish()
    assert "".join(v for _, v in first + rest) == "The weather in Paris is mild."


def test_llama_answer_not_starting_with_a_call_streams_as_content():
    stream = tool_parser("llama3_json").stream(True)
    assert stream.push("  ") == []
    assert stream.push("<|py") == []   # could be <|python_tag|>
    assert stream.push("thon is a language") == [("content", "<|python is a language")]


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_parallel_false_keeps_the_first_call(parser):
    text = {"hermes": QWEN, "llama3_json": LLAMA_TAGGED, "mistral": MISTRAL, "deepseek_v3": DEEPSEEK_V3,
            "deepseek_v31": DEEPSEEK_V31}[parser]
    assert tool_parser(parser).parse(text, parallel=False)[1] == [PARIS]


@pytest.fixture(scope="module")
def tokenizer():
    from gpu.tokenizer import Tokenizer

    return Tokenizer.load(None)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    from gpu.grammar import GrammarCompiler

    return GrammarCompiler(tokenizer=tokenizer)


REQUIRED_SAMPLES = {
    "hermes": '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>\n'
              '<tool_call>\n{"name":"get_time","arguments":{"zone":"CET"}}\n</tool_call>',
    "llama3_json": '{"name":"get_weather","parameters":{"city":"Paris"}}; {"name":"get_time","parameters":{"zone":"CET"}}',
    "mistral": '[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Paris"}}, '
               '{"name":"get_time","arguments":{"zone":"CET"}}]',
    "deepseek_v3": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                   '{"city":"Paris"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
                   '```json\n{"zone":"CET"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "deepseek_v31": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city":"Paris"}<｜tool▁call▁end｜>'
                    '<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone":"CET"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'}


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_required_grammar_output_is_read_by_its_parser(parser, tokenizer, compiler):
    """tool_choice "required" with each parser: the request's grammar (api/protocol.py) accepts calls in that
    parser's format, exactly, and the parser reads them back."""
    from api.protocol import RequestParser

    parse = RequestParser(tokenizer, "m", 2048, reserve_tokens=16, grammars=compiler, formats=(parser, None))
    gen = parse.chat({"messages": [{"role": "user", "content": "Weather and time in Paris?"}],
                      "tools": [WEATHER, TIME], "tool_choice": "required"})
    assert gen.formats.tool_parser == parser
    sample = REQUIRED_SAMPLES[parser]
    matcher = compiler.matcher(gen.sampling.grammar)
    for token in tokenizer.encode(sample):
        assert matcher.accept(token), (parser, tokenizer.decode([token]))
    assert matcher.accept(min(compiler.eos_ids))   # the answer may end here
    content, calls = tool_parser(parser).parse(sample)
    assert content is None
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                      ("get_time", {"zone": "CET"})]
    other = REQUIRED_SAMPLES["hermes" if parser != "hermes" else "mistral"]
    wrong = compiler.matcher(gen.sampling.grammar)
    assert not all(wrong.accept(t) for t in tokenizer.encode(other)[:3])   # another format is refused


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_history_and_instructions_round_trip(parser):
    """An assistant's earlier calls are written in the parser's own format (a template without tools), and the
    parser reads them back; the instructions name every tool."""
    p = tool_parser(parser)
    assert p.parse(p.render_calls([PARIS, CET]))[1] == [PARIS, CET]
    text = p.instructions([WEATHER, TIME])
    assert "get_weather" in text and "get_time" in text


# ---------------------------------------------------------------------------------------------------- reasoning

QWEN3_THINKING = "<think>\nThe user wants the weather in Paris.\n</think>\n\nIt is sunny in Paris."
R1 = "Okay, 2 + 2 is 4.\n</think>\n\nThe answer is 4."   # DeepSeek-R1's template opened <think> in the prompt


def reasoning_streamed(parser: str, pieces: list[str], opened: bool = False):
    stream = ReasoningStream(parser, opened)
    events = [e for p in pieces for e in stream.push(p)] + stream.finish()
    reasoning = "".join(v for k, v in events if k == "reasoning").strip() or None
    return reasoning, "".join(v for k, v in events if k == "content"), events


@pytest.mark.parametrize("parser, text, opened, reasoning, content", [
    ("qwen3", QWEN3_THINKING, False, "The user wants the weather in Paris.", "It is sunny in Paris."),
    ("qwen3", "It is sunny.", False, None, "It is sunny."),   # thinking off: no <think> block at all
    ("qwen3", " sunny, with a space first", False, None, " sunny, with a space first"),   # kept as generated
    ("qwen3", "It is sunny. </think> stays", False, None, "It is sunny. </think> stays"),
    ("qwen3", "Hmm, sunny.\n</think>\n\nSunny.", True, "Hmm, sunny.", "Sunny."),   # the prompt opened <think>
    ("qwen3", "<think>\nStill thinking when cut", False, "Still thinking when cut", ""),
    ("deepseek_r1", R1, False, "Okay, 2 + 2 is 4.", "The answer is 4."),
    ("deepseek_r1", "<think>\n" + R1, False, "Okay, 2 + 2 is 4.", "The answer is 4."),
    ("deepseek_r1", "Cut while thinking", False, "Cut while thinking", ""),
])
def test_reasoning_complete_and_streamed(parser, text, opened, reasoning, content):
    assert split_reasoning(parser, text, opened) == (reasoning, content)
    for pieces in chunkings(text):
        got_reasoning, got_content, events = reasoning_streamed(parser, pieces, opened)
        assert (got_reasoning, got_content) == (reasoning, content), pieces
        for kind, value in events:
            assert "<think" not in value and ("</think" not in value or "stays" in text)


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")   # enable_thinking false
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


def test_reasoning_then_tool_calls():
    """Qwen3: the reasoning is split off first, the content after </think> goes to the tool-call parser."""
    plan = parse_tools({"tools": [WEATHER, TIME]})[1]
    text = "<think>\nI need the weather tool.\n</think>\n\n" + QWEN
    formats = OutputFormats("hermes", "qwen3")
    choice = ChoiceResult(0, text, "stop")
    finish_choice(formats, plan, choice)
    assert choice.reasoning == "I need the weather tool."
    assert choice.text == "Let me check."
    assert [c["function"] for c in choice.tool_calls] == [PARIS, CET]
    assert choice.finish_reason == "tool_calls"
    for pieces in chunkings(text, seed=1):
        deltas = ChatDeltas(formats, plan)
        out = []
        for k, piece in enumerate(pieces):
            out += deltas.push(piece, "stop" if k == len(pieces) - 1 else None)
        assert "".join(r for _, _, r in out if r).strip() == "I need the weather tool."
        assert "".join(c for c, _, _ in out if c).strip() == "Let me check."
        calls = [c for _, cs, _ in out for c in cs or ()]
        assert assembled(calls) == [PARIS, CET] and [c["index"] for c in calls if "id" in c] == [0, 1]
        assert deltas.finish_reason("stop") == "tool_calls"


def test_reasoning_alone_has_no_content():
    choice = ChoiceResult(0, "<think>only thoughts</think>", "stop")
    finish_choice(OutputFormats("hermes", "qwen3"), None, choice)
    assert (choice.reasoning, choice.text) == ("only thoughts", None)


@pytest.mark.parametrize("parser, text", [("mistral", MISTRAL), ("llama3_json", LLAMA)])
def test_chat_deltas_with_other_parsers(parser, text):
    plan = ToolPlan("auto", ("get_weather", "get_time"))
    deltas = ChatDeltas(OutputFormats(parser), plan)
    out = deltas.push(text[:7], None) + deltas.push(text[7:], "stop")
    calls = [c for _, cs, _ in out for c in cs or ()]
    assert [c["function"]["name"] for c in calls][:1] == ["get_weather"]
    assert deltas.finish_reason("stop") == "tool_calls"
    choice = ChoiceResult(0, text, "stop")
    finish_choice(OutputFormats(parser), plan, choice)
    for call in calls + choice.tool_calls:   # Mistral's templates take 9-character ids alone in the history
        assert (len(call["id"]) == 9 and call["id"].isalnum()) if parser == "mistral" else \
            call["id"].startswith("call_")


# ------------------------------------------------------------------------------------------------------- choice


def test_every_family_has_defaults():
    assert set(FAMILY_DEFAULTS) == set(FAMILIES)


@pytest.mark.parametrize("family, template, expected", [
    ("llama", "{% if tools %}...{% endif %}", ("llama3_json", None)),
    ("llama", "{{ messages }}", ("hermes", None)),    # SmolLM2: no tools in the template, the Hermes prompt
    ("mistral", "[AVAILABLE_TOOLS] {{ tools }}", ("mistral", None)),
    ("qwen2", "{{ tools }}", ("hermes", None)),
    ("qwen2", "{{ tools }} <think>\n...</think>", ("hermes", "deepseek_r1")),   # an R1 distill of Qwen2.5
    ("qwen3", "{{ tools }}", ("hermes", "qwen3")),
    ("qwen3_moe", "{{ tools }}", ("hermes", "qwen3")),
    ("gemma3", "{{ messages }}", ("hermes", None)),
    ("llama", "{{ tools }} <tool_call>", ("hermes", None)),   # examples/chatml_tools.jinja on SmolLM2
    ("llama", "{{ tools }} <|python_tag|>", ("llama3_json", None)),   # Llama 3.1's own
    ("qwen2", "{{ tools }} [TOOL_CALLS]", ("mistral", None)),
    ("llama", "{{ tools }}<｜tool▁calls▁begin｜>", ("deepseek_v3", None)),
    ("deepseek2", "{{ tools }}<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>'",
     ("deepseek_v3", None)),
    ("deepseek2", "{{ tools }}<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>'",
     ("deepseek_v31", None)),
])
def test_choice_by_family(family, template, expected):
    assert choose(family, template) == expected


def test_flags_override_and_unknown_names_are_refused():
    assert choose("qwen3", "{{ tools }}", "mistral", "none") == ("mistral", None)
    assert choose("llama", "", "llama3_json", "deepseek_r1") == ("llama3_json", "deepseek_r1")
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        choose("llama", "", "pythonic")
    with pytest.raises(ValueError, match="none, qwen3, deepseek_r1"):
        choose("llama", "", "auto", "granite")
    with pytest.raises(KeyError, match="choose from"):
        tool_parser("xml")


def test_config_flags_refuse_unknown_names():
    from pdserve.config import load_config
    from pdserve.errors import ConfigError

    config = load_config({"tool_call_parser": "mistral", "reasoning_parser": "none"}, env={}).config
    assert (config.tool_call_parser, config.reasoning_parser) == ("mistral", "none")
    with pytest.raises(ConfigError, match="hermes, llama3_json, mistral"):
        load_config({"tool_call_parser": "pythonic"}, env={})
    with pytest.raises(ConfigError, match="qwen3, deepseek_r1"):
        load_config({"reasoning_parser": "granite"}, env={})


def test_arguments_are_json_text():
    _, calls = tool_parser("mistral").parse(MISTRAL)
    assert [json.loads(c["arguments"]) for c in calls] == [{"city": "Paris"}, {"zone": "CET"}]


# ------------------------------------------------------------------------------- reasoning in the other dialects

THOUGHT_EVENTS = [("reasoning", "The user "), ("reasoning", "greets."), ("text", "Hello"), ("finish", "stop", None)]


def sse(raw: list[bytes]) -> list[tuple[str, dict]]:
    out = []
    for frame in raw:
        head, data = frame.decode().strip().split("\n", 1)
        out.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


@pytest.mark.parametrize("events", [THOUGHT_EVENTS, THOUGHT_EVENTS[:2] + THOUGHT_EVENTS[3:]])
def test_responses_carry_reasoning_as_an_item(events):
    from api.dialects import responses
    from api.dialects.events import Outcome

    meta = responses.ResponseMeta("resp_1", "m", {"input": "x"})
    outcome = Outcome()
    for event in events:
        outcome.add(event)
    body = responses.response_object(meta, outcome, responses.usage_body(3, 2))
    stream = responses.ResponseStream(meta)
    raw = stream.start()
    for event in events[:-1]:
        raw += stream.event(event)
    closing, final = stream.finish("stop", responses.usage_body(3, 2))
    got = sse(raw + closing)
    for response in (body, final):
        item, message = response["output"]
        assert item["type"] == "reasoning" and item["summary"] == [{"type": "summary_text",
                                                                    "text": "The user greets."}]
        assert item["content"] == [{"type": "reasoning_text", "text": "The user greets."}]
        assert message["type"] == "message" and message["content"][0]["text"] == outcome.text
    assert "".join(b["delta"] for k, b in got if k == "response.reasoning_text.delta") == "The user greets."
    assert [b["output_index"] for k, b in got if k == "response.output_item.added"] == [0, 1]
    assert [b["sequence_number"] for _, b in got] == list(range(len(got)))


@pytest.mark.parametrize("events", [THOUGHT_EVENTS, THOUGHT_EVENTS[:2] + THOUGHT_EVENTS[3:]])
def test_messages_carry_reasoning_as_a_thinking_block(events):
    from api.dialects import anthropic
    from api.dialects.events import Outcome

    outcome = Outcome()
    for event in events:
        outcome.add(event)
    body = anthropic.message_object("msg_1", "m", outcome, anthropic.usage_body(3, 1))
    assert body["content"] == [{"type": "thinking", "thinking": "The user greets.", "signature": ""},
                               {"type": "text", "text": outcome.text}]
    stream = anthropic.MessageStream("msg_1", "m")
    raw = stream.start(anthropic.usage_body(3, 0))
    for event in events[:-1]:
        raw += stream.event(event)
    got = sse(raw + stream.finish("stop", None, anthropic.usage_body(3, 1)))
    starts = [b["content_block"]["type"] for k, b in got if k == "content_block_start"]
    assert starts == ["thinking", "text"]
    assert "".join(b["delta"].get("thinking", "") for k, b in got if k == "content_block_delta") == \
        "The user greets."
    assert [b["index"] for k, b in got if k == "content_block_stop"] == [0, 1]


THINKING_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- else %}<think>\n{%- endif %}{%- endif %}")


@pytest.mark.parametrize("reasoning", ["qwen3", "deepseek_r1"])
def test_request_formats_follow_the_prompt_and_chat_template_kwargs(reasoning, compiler):
    """A prompt the template ends inside <think> starts the answer in the reasoning; enable_thinking false (through
    chat_template_kwargs, which reach the template) splits nothing; a grammar-constrained answer is constrained
    after the reasoning (its end forced at half of max_tokens), or from its first token with thinking off; a
    malformed chat_template_kwargs is a 400 naming it."""
    from api.protocol import RequestParser
    from gpu.tokenizer import Tokenizer
    from pdserve.errors import InvalidRequestError

    tok = Tokenizer.load(None)
    tok.set_chat_template(THINKING_TEMPLATE)
    parse = RequestParser(tok, "m", 2048, reserve_tokens=16, grammars=compiler, formats=("hermes", reasoning))
    messages = [{"role": "user", "content": "Hi"}]
    gen = parse.chat({"messages": messages})
    assert gen.formats == OutputFormats("hermes", reasoning, True)
    assert tok.decode(gen.prompt_ids).rstrip().endswith("<think>")
    off = parse.chat({"messages": messages, "chat_template_kwargs": {"enable_thinking": False}})
    assert off.formats == OutputFormats("hermes", None, False)
    assert tok.decode(off.prompt_ids).rstrip().endswith("</think>")
    constrained = parse.chat({"messages": messages, "response_format": {"type": "json_object"}, "max_tokens": 40})
    assert constrained.formats == OutputFormats("hermes", reasoning, True)   # the JSON comes after the reasoning
    assert (constrained.sampling.reasoning_end, constrained.sampling.reasoning_budget) == ("</think>", 20)
    plain = parse.chat({"messages": messages, "response_format": {"type": "json_object"},
                        "chat_template_kwargs": {"enable_thinking": False}})
    assert plain.formats == OutputFormats("hermes", None, False) and plain.sampling.reasoning_end == ""
    for bad in (["enable_thinking"], {"messages": []}):
        with pytest.raises(InvalidRequestError) as err:
            parse.chat({"messages": messages, "chat_template_kwargs": bad})
        assert err.value.param == "chat_template_kwargs"


@pytest.mark.parametrize("parser, text", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CE'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": '
                    '{"zone": "CE'),
    ("mistral", 'Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {"zone": "CE'),
    ("deepseek_v3", 'Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n'
                    '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>'
                    'get_time\n```json\n{"zone": "CE'),
    ("deepseek_v31", 'Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>'
                     '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "CE'),
])
def test_a_call_cut_by_max_tokens_is_a_call_with_partial_arguments(parser, text):
    """As OpenAI returns a call cut by ``length``: the call with the arguments written so far, never markup as
    content; the same streamed (ChatDeltas with finish reason "length") and whole (finish_choice)."""
    plan = ToolPlan("auto", ("get_weather", "get_time"))
    choice = ChoiceResult(0, text, "length")
    finish_choice(OutputFormats(parser), plan, choice)
    assert choice.finish_reason == "length"
    assert [c["function"] for c in choice.tool_calls] == [PARIS, {"name": "get_time", "arguments": '{"zone": "CE'}]
    assert choice.text == ("Let me check." if parser in ("mistral", "deepseek_v3", "deepseek_v31") else None)
    for pieces in chunkings(text, seed=2):
        deltas = ChatDeltas(OutputFormats(parser), plan)
        out = []
        for k, piece in enumerate(pieces):
            out += deltas.push(piece, "length" if k == len(pieces) - 1 else None)
        assert assembled([c for _, cs, _ in out for c in cs or ()]) == [c["function"] for c in choice.tool_calls]
        assert "".join(c for c, _, _ in out if c).strip() == (choice.text or "")


@pytest.mark.parametrize("family, flags, expected", [
    ("qwen3", {}, ("hermes", "qwen3")),
    ("qwen2", {"reasoning_parser": "deepseek_r1", "tool_call_parser": "mistral"}, ("mistral", "deepseek_r1")),
])
def test_the_served_model_s_family_picks_its_parsers(family, flags, expected, tmp_path):
    """A tiny GGUF of the family (tests/gpu/tiny_families.py): plan_layout reads the family into the layout and
    formats_for picks the parsers from it (the embedded SmolLM2 tokenizer's template renders no tools: hermes)."""
    pytest.importorskip("transformers")
    from actors.supervisor import plan_layout
    from api.formats import formats_for
    from gpu.tokenizer import Tokenizer
    from pdserve.config import load_config
    from tests.gpu.tiny_families import build_hf, write_gguf

    path = write_gguf(family, build_hf(family), tmp_path / f"tiny-{family}.gguf")
    layout = plan_layout(load_config({"model": str(path), "port": "0", "model_cache_dir": "off", **flags}, {}),
                         "e1")
    assert layout.shape.family == family
    assert formats_for(layout, Tokenizer.load(path)) == expected


def test_required_grammar_names_the_markers_the_model_declares_special_tokens():
    """Quoted literals are split around the markers (written ``<[id]>``); a %json schema, even one whose strings
    hold a marker, is left as it is."""
    from api.formats import with_special_markers

    grammar = 'start: "<tool_call>\\n" body ("\\n" "</tool_call>")*\nbody: %json {"const": "<tool_call>\\""}\n'
    assert with_special_markers(grammar, {"<tool_call>": 7, "</tool_call>": 8}) == (
        'start: (<[7]> "\\n") body ("\\n" <[8]>)*\nbody: %json {"const": "<tool_call>\\""}\n')
    assert with_special_markers(grammar, {}) == grammar


def test_marker_texts_are_the_parsers_of_the_request():
    from api.formats import marker_texts

    assert marker_texts(None) == ()
    assert marker_texts(OutputFormats("mistral", None)) == ("[TOOL_CALLS]", "[ARGS]")
    assert marker_texts(OutputFormats("hermes", "qwen3"), tools=False) == ("<think>", "</think>")
    assert len(marker_texts(OutputFormats("deepseek_v3", "deepseek_r1"))) == 7


@pytest.mark.parametrize("parser, reasoning", [("hermes", "qwen3"), ("deepseek_v3", "deepseek_r1"),
                                               ("mistral", None)])
def test_markers_that_are_special_tokens_reach_the_parsers_token_by_token(parser, reasoning):
    """An answer whose markers are single special tokens (as the model files declare them), detokenized a token
    at a time as the API does (kept markers, other special tokens skipped), is split and parsed as its text is;
    with the markers skipped, as vLLM's skip_special_tokens would, no call is found."""
    from tokenizers import AddedToken

    from api.formats import marker_texts
    from gpu.tokenizer import IncrementalDetokenizer, Tokenizer

    formats = OutputFormats(parser, reasoning)
    markers = marker_texts(formats)
    backend = Tokenizer.load(None).backend
    backend.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in markers])
    tok = Tokenizer(backend, name="t", bos_token_id=None, eos_token_ids=[2], chat_template=None,
                    vocab_size=backend.get_vocab_size(with_added_tokens=True))
    call = REQUIRED_SAMPLES[parser]
    text = ("<think>Paris is in France.</think>\n\n" if reasoning else "") + "Checking. " + call
    ids = tok.encode(text + "<|im_end|>")
    assert tok.special_ids_of([m for m in markers if m in text]) <= set(ids)   # each marker is one token
    plan = ToolPlan("auto", ("get_weather", "get_time"))
    for keep, want_calls in ((tok.special_ids_of(markers), 2), (frozenset(), 0)):
        detok = IncrementalDetokenizer(tok, keep=keep)
        deltas = ChatDeltas(formats, plan)
        events = [e for i in ids for e in deltas.push(detok.push(i), False)] + deltas.push(detok.flush(), "stop")
        names = [c["function"]["name"] for _, calls, _ in events for c in calls or [] if c["function"].get("name")]
        assert len(names) == want_calls, (keep, events)
        if want_calls:
            assert names == ["get_weather", "get_time"]
            assert "".join(c or "" for c, _, _ in events).strip() == "Checking."
            assert "".join(r or "" for _, _, r in events).strip() == ("Paris is in France." if reasoning else "")


@pytest.mark.parametrize("variant, expected", [
    ("qwen3", ("hermes", "qwen3")), ("mistral", ("mistral", None)), ("llama", ("llama3_json", None)),
    ("deepseek2", ("deepseek_v3", "deepseek_r1")), ("deepseek2-v31", ("deepseek_v31", "deepseek_r1"))])
def test_the_families_own_templates_choose_their_parsers(variant, expected):
    """The test data templates (tests/data/chat_templates, also served end to end in test_family_formats.py)."""
    from tests.gpu.tiny_families import FAMILY_FORMATS, TEMPLATES

    template = (TEMPLATES / FAMILY_FORMATS[variant][0]).read_text(encoding="utf-8")
    assert choose(variant.split("-")[0], template) == expected


def test_a_prompt_the_template_closes_with_think_has_no_reasoning(tokenizer):
    """DeepSeek-V3.1's template closes the reasoning unless ``thinking`` is true (deepseek_r1 would otherwise read
    the whole answer as reasoning)."""
    from api.protocol import RequestParser
    from gpu.tokenizer import Tokenizer
    from tests.gpu.tiny_families import TEMPLATES

    tok = Tokenizer.load(None)
    tok.set_chat_template((TEMPLATES / "deepseek_v31.jinja").read_text(encoding="utf-8"))
    parse = RequestParser(tok, "m", 2048, reserve_tokens=16, formats=("deepseek_v31", "deepseek_r1"))
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    assert parse.chat(body).formats.reasoning is None
    thinking = parse.chat({**body, "chat_template_kwargs": {"thinking": True}}).formats
    assert thinking.reasoning == "deepseek_r1" and thinking.opened


@pytest.mark.parametrize("variant, call", [
    ("qwen3", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
              '<|im_start|>user\n<tool_response>\n12 C\n</tool_response><|im_end|>'),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcDEF123"}]'),
    ("llama", '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'
              '<|start_header_id|>ipython<|end_header_id|>\n\n12 C<|eot_id|>'),
    ("deepseek2", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                  '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    ("deepseek2-v31", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
                      '<｜tool▁call▁end｜><｜tool▁calls▁end｜>')])
def test_an_earlier_call_and_its_result_are_rendered_by_the_families_own_templates(variant, call):
    """A conversation with an assistant's call and the tool's result goes through the family's template (the
    request's parser is the one the template chooses) and comes out in the family's own format."""
    from api.protocol import RequestParser
    from gpu.tokenizer import Tokenizer
    from tests.gpu.tiny_families import FAMILY_FORMATS, TEMPLATES

    tok = Tokenizer.load(None)
    tok.set_chat_template((TEMPLATES / FAMILY_FORMATS[variant][0]).read_text(encoding="utf-8"))
    parse = RequestParser(tok, "m", 4096, reserve_tokens=16, formats=choose(variant.split("-")[0], tok.chat_template))
    gen = parse.chat({"tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_abcDEF123", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_abcDEF123", "content": "12 C"}]})
    assert call in tok.decode(gen.prompt_ids, skip_special_tokens=False)


def _family_parser(variant: str):
    from api.protocol import RequestParser
    from gpu.tokenizer import Tokenizer
    from tests.gpu.tiny_families import FAMILY_FORMATS, TEMPLATES

    tok = Tokenizer.load(None)
    tok.set_chat_template((TEMPLATES / FAMILY_FORMATS[variant][0]).read_text(encoding="utf-8"))
    return tok, RequestParser(tok, "m", 4096, reserve_tokens=16, formats=choose(variant.split("-")[0],
                                                                                tok.chat_template))


@pytest.mark.parametrize("variant", ["qwen3", "mistral", "llama"])
def test_a_tool_call_only_turn_reaches_the_template_without_content_as_transformers_passes_it(variant):
    """transformers drops a message's None-valued keys before the template sees it, so a template tests
    ``message.content is defined`` (Qwen3's test template does, and failed to render content None)."""
    tok, parse = _family_parser(variant)
    gen = parse.chat({"tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "abcDEF123", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "abcDEF123", "content": "12 C"}]})
    prompt = tok.decode(gen.prompt_ids, skip_special_tokens=False)
    assert "get_weather" in prompt and "Paris" in prompt and "None" not in prompt


@pytest.mark.parametrize("call_id, expected", [
    ("abcDEF123", "abcDEF123"), ("toolu_abcDEF123", "abcDEF123"), ("call_0123456789abcdef01234567", "f01234567"),
    ("toolu_01-xyz_ab", None)])
def test_mistral_call_ids_of_any_form_reach_its_template_as_9_alphanumerics(call_id, expected):
    """Mistral's template refuses any call id but 9 letters and digits (vLLM issue 38738: the Messages route's
    ``toolu_`` ids); the history's ids are mapped to that form, the call's and its result's alike."""
    tok, parse = _family_parser("mistral")
    from api.dialects import anthropic

    body = {"max_tokens": 5, "tools": [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
            "messages": [{"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": [{"type": "tool_use", "id": call_id, "name": "get_weather",
                                                            "input": {"city": "Paris"}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id,
                                                       "content": "12 C"}]}]}
    prompt = tok.decode(parse.chat(anthropic.translate(body)).prompt_ids, skip_special_tokens=False)
    ids = re.findall(r'"(?:id|call_id)": "([^"]*)"', prompt)
    assert len(ids) == 2 and ids[0] == ids[1] and re.fullmatch(r"[a-zA-Z0-9]{9}", ids[0]), prompt
    if expected is not None:
        assert ids[0] == expected


def test_the_messages_route_keeps_a_family_s_own_call_ids():
    from api.dialects import anthropic

    assert anthropic.tool_use_id("call_0123abc") == "toolu_0123abc"
    mistral = tool_parser("mistral").new_call_id()
    assert anthropic.tool_use_id(mistral) == mistral and len(mistral) == 9


def test_a_llama_call_followed_by_text_is_a_call_with_finish_reason_tool_calls():
    plan = parse_tools({"tools": [WEATHER]})[1]
    choice = ChoiceResult(0, LLAMA_THEN_TEXT, "stop", None)
    finish_choice(OutputFormats("llama3_json"), plan, choice)
    assert choice.finish_reason == "tool_calls" and choice.text == "I will check the weather in Paris for you."
    assert [c["function"]["name"] for c in choice.tool_calls] == ["get_weather"]
    # cut by max_tokens inside a second call: the partial call, not text
    cut = ChoiceResult(0, LLAMA + '; {"name": "get_weather", "parameters": {"city": "Os', "length", None)
    finish_choice(OutputFormats("llama3_json"), plan, cut)
    assert [c["function"]["arguments"] for c in cut.tool_calls] == ['{"city": "Paris"}', '{"city": "Os']
    assert cut.text is None and cut.finish_reason == "length"


CALL_IN_THOUGHT = ('Let me look it up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                   '</tool_call>\n</think>\n\nChecking.')


@pytest.mark.parametrize("calls_in_reasoning", [True, False])
def test_a_call_written_before_think_ends_is_a_call_unless_configured_to_stay_reasoning(calls_in_reasoning):
    """llama.cpp issue 22684: a Hermes call before ``</think>``. By default a call, as SGLang returns it (no longer in
    the reasoning); ``tool_calls_in_reasoning`` "reasoning" keeps it reasoning text, as vLLM does. Complete and in
    every chunking of the stream."""
    plan = parse_tools({"tools": [WEATHER]})[1]
    formats = OutputFormats("hermes", "qwen3", True, calls_in_reasoning)
    choice = ChoiceResult(0, CALL_IN_THOUGHT, "stop", None)
    finish_choice(formats, plan, choice)
    names = [c["function"]["name"] for c in choice.tool_calls]
    assert choice.text == "Checking."
    if calls_in_reasoning:
        assert names == ["get_weather"] and choice.finish_reason == "tool_calls"
        assert choice.reasoning == "Let me look it up." and "tool_call" not in choice.reasoning
    else:
        assert names == [] and choice.finish_reason == "stop" and "<tool_call>" in choice.reasoning
    for pieces in chunkings(CALL_IN_THOUGHT):
        deltas = ChatDeltas(formats, plan)
        events = [e for p in pieces for e in deltas.push(p, False)] + deltas.push("", "stop")
        calls = [c for _, cs, _ in events for c in cs or []]
        assert [c["function"]["name"] for c in calls] == names, pieces
        assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}] * len(names)
        assert "".join(r or "" for _, _, r in events).strip() == choice.reasoning, pieces
        assert "".join(c or "" for c, _, _ in events).strip() == "Checking."
        assert deltas.finish_reason("stop") == choice.finish_reason


def test_messages_thinking_disabled_closes_the_template_s_thinking_and_earlier_thinking_reaches_it():
    """Anthropic ``thinking: {"type": "disabled"}`` is the template's switch (Qwen3's ``enable_thinking``): no
    reasoning split; earlier turns' ``thinking`` blocks reach the template as ``reasoning_content``, which Qwen3's
    renders after the last user turn."""
    from api.dialects import anthropic

    tok, parse = _family_parser("qwen3")
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    on = parse.chat(anthropic.translate({"max_tokens": 5, "messages": ask}))
    off = parse.chat(anthropic.translate({"max_tokens": 5, "messages": ask, "thinking": {"type": "disabled"}}))
    assert on.formats.reasoning == "qwen3" and on.formats.opened
    assert off.formats.reasoning is None
    assert tok.decode(off.prompt_ids, skip_special_tokens=False).endswith("<think>\n\n</think>\n\n")
    tools = [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]
    turn = [*ask, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "The user wants Paris.", "signature": ""},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "12 C"}]}]
    prompt = tok.decode(parse.chat(anthropic.translate({"max_tokens": 5, "messages": turn, "tools": tools}))
                        .prompt_ids, skip_special_tokens=False)
    assert "<think>\nThe user wants Paris.\n</think>" in prompt
