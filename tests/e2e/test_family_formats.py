"""Each family's own chat template and output formats end to end: tiny random-weight models
(tests/gpu/tiny_families.py) whose model files carry the family's chat template (tests/data/chat_templates) and
declare its markers as special tokens, served with no parser flags: Qwen3 (a GGUF; Hermes ``<tool_call>`` and
``<think>``), and from Hugging Face directories Mistral (``[TOOL_CALLS]``), Llama 3.1 (JSON calls), DeepSeek-V2
weights with R1's template (V3's tool-call tokens, ``<think>`` opened) and with V3.1's (its call form, ``<think>``
opened by ``thinking``, else closed): every tool-call parser and both reasoning parsers. Per model: the parsers are
chosen from the template (the start-up log), a chat with ``tools`` is rendered by that template (the prompt's token
count), ``tool_choice: "required"`` (the grammar forces a call in the family's format, its markers as single special
tokens) and a named choice come back as OpenAI ``tool_calls`` through the ``openai`` client, streamed and not, and
where the template opens ``<think>`` the answer is ``reasoning_content``. One engine per model, module-scoped."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from gpu.tokenizer import Tokenizer
from tests.conftest import cleanup_engine, start_engine
from tests.gpu.tiny_families import save_with_formats

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 12}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
# family (-variant: another template) -> form, (tool parser, reasoning parser) chosen from the template, the first
# marker of a call (a special token of the model files; None: Llama's whole-message JSON), text the template renders
# the tools with, the chat_template_kwargs that open the reasoning (None: the template always does)
FAMILIES = {
    "qwen3": ("gguf", ("hermes", "qwen3"), "<tool_call>", "<tools>\n{", None),
    "mistral": ("hf", ("mistral", None), "[TOOL_CALLS]", "[AVAILABLE_TOOLS] [", None),
    "llama": ("hf", ("llama3_json", None), None, "Environment: ipython", None),
    "deepseek2": ("hf", ("deepseek_v3", "deepseek_r1"), "<｜tool▁calls▁begin｜>", "### Function", None),
    "deepseek2-v31": ("hf", ("deepseek_v31", "deepseek_r1"), "<｜tool▁calls▁begin｜>", "### get_weather",
                      {"thinking": True}),
}
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, tmp_path_factory):
    """(family, engine, openai client, our tokenizer of the served files)."""
    import openai

    name = request.param
    d = tmp_path_factory.mktemp(name)
    path = save_with_formats(name, d, FAMILIES[name][0])
    eng = start_engine(d, "--model", str(path), "--kv-pool-tokens", "1024", "--model-cache-dir", "off",
                       "--weights", "float32")
    try:
        client = openai.OpenAI(base_url=eng.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
        client.model = client.models.list().data[0].id
        yield name, eng, client, Tokenizer.load(path)
    finally:
        cleanup_engine(eng)


def test_the_parsers_are_chosen_from_the_model_files_template(served):
    name, eng, _, _ = served
    tool, reasoning = FAMILIES[name][1]
    found = re.search(r"chat output: tool-call parser (\S+), reasoning parser (\S+)", eng.log_text())
    assert found and found.groups() == (tool, reasoning or "none"), found and found.group(0)


def calls_of(client, stream: bool, **request) -> tuple[list[tuple[str, str]], str, str | None, list]:
    """``([(name, arguments)], finish_reason, content, logprob tokens)`` of one chat answer."""
    request = dict(model=client.model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=60, logprobs=True,
                   **request)
    if not stream:
        choice = client.chat.completions.create(**request).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        assert all(c.type == "function" and c.id for c in choice.message.tool_calls or [])
        return calls, choice.finish_reason, choice.message.content, [t.token for t in choice.logprobs.content]
    chunks = [c for c in client.chat.completions.create(stream=True, **request) if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for d in deltas:
        for call in d.tool_calls or []:
            if call.function.name:
                names[call.index] = call.function.name
            arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
    tokens = [t.token for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content or []]
    content = "".join(d.content or "" for d in deltas) or None
    return [(names[i], arguments[i]) for i in sorted(names)], chunks[-1].choices[0].finish_reason, content, tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_call_in_the_family_format_is_parsed_into_tool_calls(served, stream):
    name, eng, client, tok = served
    marker = FAMILIES[name][2]
    calls, finish, content, tokens = calls_of(client, stream, tool_choice="required", parallel_tool_calls=False)
    [(function, arguments)] = calls
    assert function == "get_weather" and finish == "tool_calls" and not content, (calls, finish, content, tokens)
    jsonschema.validate(json.loads(arguments), WEATHER)
    if marker is not None:   # the grammar wrote the call's marker as the model files' one special token
        assert tok.token_to_id(marker) in tok.special_ids and marker in tokens, tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_named_call_is_parsed_into_tool_calls(served, stream):
    _, _, client, _ = served
    choice = {"type": "function", "function": {"name": "get_weather"}}
    [(function, arguments)], finish, content, _ = calls_of(client, stream, tool_choice=choice)
    assert function == "get_weather" and not content
    jsonschema.validate(json.loads(arguments), WEATHER)


def test_a_chat_with_tools_is_rendered_by_the_family_template(served):
    name, _, client, tok = served
    text = tok.apply_chat_template(ASK, tools=TOOLS)
    assert FAMILIES[name][3] in text and "get_weather" in text
    answer = client.chat.completions.create(model=client.model, messages=ASK, tools=TOOLS, tool_choice="required",
                                            max_tokens=60, temperature=0)
    assert answer.usage.prompt_tokens == len(tok.encode(text))


def test_reasoning_opened_by_the_template_is_reasoning_content_streamed_and_not(served):
    name, _, client, _ = served
    if FAMILIES[name][1][1] is None:
        pytest.skip(f"{name}'s template has no reasoning")
    kwargs = FAMILIES[name][4]
    request = dict(model=client.model, temperature=0, max_tokens=8, messages=ASK,
                   extra_body={"ignore_eos": True, **({"chat_template_kwargs": kwargs} if kwargs else {})})
    message = client.chat.completions.create(**request).choices[0].message
    reasoning = getattr(message, "reasoning_content", None)
    assert message.content is None and reasoning and "<think>" not in reasoning, message
    deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **request) if c.choices]
    assert not "".join(d.content or "" for d in deltas)
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas).strip() == reasoning


def test_a_prompt_the_template_closes_gives_content_only(served):
    """DeepSeek-V3.1's template closes the reasoning (``</think>``) unless ``thinking`` is true."""
    name, _, client, _ = served
    if FAMILIES[name][4] is None:
        pytest.skip(f"{name}: no chat_template_kwargs switch its reasoning on or off")
    answer = client.chat.completions.create(model=client.model, temperature=0, max_tokens=8, messages=ASK,
                                            extra_body={"ignore_eos": True})
    message = answer.choices[0].message
    assert message.content and getattr(message, "reasoning_content", None) is None, message


def test_a_messages_tool_conversation_continues_in_every_family(served):
    """The Messages route's tool_use id comes back in the next turn's tool_result (and the assistant turn): the
    family's template takes it (Mistral's demands 9 letters and digits: vLLM issue 38738 was a 400 there); the
    assistant turn of calls alone has no content for the template to trip on (transformers' way)."""
    import httpx

    name, eng, client, _ = served
    tools = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]
    first = httpx.post(eng.base_url + "/v1/messages", timeout=120, json={
        "model": client.model, "max_tokens": 60, "temperature": 0, "tools": tools, "tool_choice": {"type": "any"},
        "messages": ASK})
    assert first.status_code == 200, first.text
    use = [b for b in first.json()["content"] if b["type"] == "tool_use"][0]
    if name == "mistral":
        assert re.fullmatch(r"[a-zA-Z0-9]{9}", use["id"]), use
    second = httpx.post(eng.base_url + "/v1/messages", timeout=120, json={
        "model": client.model, "max_tokens": 4, "temperature": 0, "tools": tools, "messages": [
            *ASK, {"role": "assistant", "content": [use]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "12 C"}]}]})
    assert second.status_code == 200, second.text


def test_messages_thinking_disabled_answers_text_on_a_thinking_template(served):
    """Anthropic ``thinking: {"type": "disabled"}`` is Qwen3's ``enable_thinking`` false: the template closes the
    reasoning, so the answer is text, not a thinking block that takes the whole budget."""
    import httpx

    name, eng, client, _ = served
    if name != "qwen3":
        pytest.skip("Qwen3's template has the enable_thinking switch")
    body = {"model": client.model, "max_tokens": 8, "temperature": 0, "messages": ASK}
    kinds = lambda r: [b["type"] for b in r.json()["content"]]   # noqa: E731
    on = httpx.post(eng.base_url + "/v1/messages", timeout=120, json=body)
    off = httpx.post(eng.base_url + "/v1/messages", timeout=120, json={**body, "thinking": {"type": "disabled"}})
    assert on.status_code == off.status_code == 200, (on.text, off.text)
    assert kinds(on)[0] == "thinking" and not on.json()["content"][-1].get("text"), on.text   # all reasoning
    assert kinds(off) == ["text"] and off.json()["content"][0]["text"], off.text
