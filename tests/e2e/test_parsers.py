"""End to end on the embedded model (Llama family) with the parsers of other families chosen by flag:
``--tool-call-parser mistral`` (tool_choice "required" is decoded in the ``[TOOL_CALLS][...]`` format and parsed
back into ``tool_calls``) and ``--reasoning-parser qwen3`` with a Qwen3-style template that opens ``<think>`` in
the prompt unless ``chat_template_kwargs.enable_thinking`` is false (the greedy answer, cut by max_tokens, is all
reasoning: ``reasoning_content``), through the official ``openai`` client, streamed and not, and through the
Responses and Messages routes. One engine for the module."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.conftest import cleanup_engine, start_engine

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 12}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}}]
# ChatML that opens the reasoning as Qwen3's thinking templates do (and closes it empty when thinking is off)
THINKING_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- else %}<think>\n{%- endif %}{%- endif %}")
SEA = "Tell me about the sea."
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parsers")
    template = tmp / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)
    eng = start_engine(tmp, "--tool-call-parser", "mistral", "--reasoning-parser", "qwen3", "--chat-template",
                       str(template), ready_timeout_s=400)
    yield eng
    cleanup_engine(eng)


@pytest.fixture(scope="module")
def client(engine):
    import openai

    return openai.OpenAI(base_url=engine.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


def reasoning_of(obj) -> str | None:
    return getattr(obj, "reasoning_content", None)


@pytest.mark.parametrize("stream", [False, True])
def test_required_call_is_decoded_and_parsed_in_the_mistral_format(client, stream):
    request = dict(model=MODEL, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=40,
                   messages=[{"role": "user", "content": "What is the weather in Oslo?"}], parallel_tool_calls=False,
                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **request))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        calls = [(d.function.name, d.function.arguments) for x in deltas for d in x.tool_calls or []]
        assert not "".join(x.content or "" for x in deltas)   # no [TOOL_CALLS] markup as content
        assert not any(reasoning_of(x) for x in deltas)        # thinking off: no reasoning
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    else:
        choice = client.chat.completions.create(**request).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert reasoning_of(choice.message) is None
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert all(len(c.id) == 9 and c.id.isalnum() for c in choice.message.tool_calls)   # Mistral's ids
    [(name, arguments)] = calls
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_a_forced_call_thinks_first_then_calls_in_every_choice_streamed(client, tool_choice):
    """vLLM issue 20663: with the reasoning opened by the template, the grammar of a forced call starts after it
    (its end forced at half of max_tokens): in each of n=2 streamed choices reasoning_content deltas come first,
    then the call, whose arguments validate."""
    chunks = list(client.chat.completions.create(
        model=MODEL, tools=TOOLS, tool_choice=tool_choice, temperature=0.8, seed=5, max_tokens=60, n=2,
        parallel_tool_calls=False, stream=True,
        messages=[{"role": "user", "content": "What is the weather in Oslo?"}]))
    for index in (0, 1):
        deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].index == index]
        kinds = [("reasoning" if reasoning_of(d) else "call") for d in deltas if reasoning_of(d) or d.tool_calls]
        assert kinds and kinds[0] == "reasoning" and "call" in kinds, kinds
        assert kinds.index("call") > max(i for i, k in enumerate(kinds) if k == "reasoning")   # no reasoning after
        assert not "".join(d.content or "" for d in deltas)
        calls = [c for d in deltas for c in d.tool_calls or []]
        assert calls[0].function.name == "get_weather"
        jsonschema.validate(json.loads("".join(c.function.arguments or "" for c in calls)), WEATHER)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].index == index]
        assert finish[-1] == "tool_calls"


def test_reasoning_opened_by_the_template_is_reasoning_content_streamed_and_not(client):
    request = dict(model=MODEL, temperature=0, max_tokens=8, messages=[{"role": "user", "content": SEA}],
                   extra_body={"ignore_eos": True})
    message = client.chat.completions.create(**request).choices[0].message
    assert message.content is None and reasoning_of(message), message
    chunks = list(client.chat.completions.create(stream=True, **request))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not "".join(d.content or "" for d in deltas)
    assert "".join(reasoning_of(d) or "" for d in deltas).strip() == reasoning_of(message)
    assert "<think>" not in reasoning_of(message)


def test_thinking_off_gives_content_only(client):
    request = dict(model=MODEL, temperature=0, max_tokens=8, messages=[{"role": "user", "content": SEA}],
                   extra_body={"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True})
    message = client.chat.completions.create(**request).choices[0].message
    assert message.content and reasoning_of(message) is None
    deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **request) if c.choices]
    assert "".join(d.content or "" for d in deltas) == message.content
    assert not any(reasoning_of(d) for d in deltas)


def test_chat_template_kwargs_must_be_an_object(engine):
    response = httpx.post(engine.base_url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": ["enable_thinking"]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template_kwargs"


def test_responses_and_messages_carry_the_reasoning(engine):
    body = httpx.post(engine.base_url + "/v1/responses", timeout=120, json={
        "model": MODEL, "input": "Hi!", "max_output_tokens": 8, "temperature": 0}).json()
    assert body["output"][0]["type"] == "reasoning" and body["output"][0]["summary"][0]["text"], body
    body = httpx.post(engine.base_url + "/v1/messages", timeout=120, json={
        "model": MODEL, "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": "Hi!"}]}).json()
    assert body["content"][0]["type"] == "thinking" and body["content"][0]["thinking"], body
