"""RequestParser with the real tokenizer: every parameter validated, unsupported values named, never ignored."""
from __future__ import annotations

import dataclasses
import time

import pytest

from api.protocol import MAX_STOP_STRINGS, RequestParser
from pdserve.errors import InvalidRequestError, ModelNotFoundError

MODEL = "test-model"
MAX_LEN = 256


@pytest.fixture(scope="module")
def parser():
    from gpu.tokenizer import Tokenizer

    return RequestParser(Tokenizer.load(None), MODEL, MAX_LEN, reserve_tokens=16)


def chat_body(**extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


def completion_body(**extra):
    return {"model": MODEL, "prompt": "hello", **extra}


def rejected(call, body, param):
    with pytest.raises(InvalidRequestError) as info:
        call(body)
    assert info.value.param == param, info.value.message
    assert info.value.http_status == 400
    return info.value


def test_a_plain_chat_and_completion_parse_with_defaults(parser):
    chat = parser.chat(chat_body())
    # no max_tokens: the rest of the context, of which decode reserves reserve_tokens up front
    assert chat.kind == "chat" and chat.prompt_ids and chat.sampling.max_tokens == MAX_LEN - len(chat.prompt_ids)
    assert chat.sampling.reserved_output_tokens == 16
    assert chat.request_id.startswith("chatcmpl-") and chat.timeout_s is None
    comp = parser.completions(completion_body(max_tokens=3, temperature=0, top_p=0.5, top_k=5, min_p=0.1,
                                             seed=-3, stop=["x", "y"], user="u", timeout=2.5))[0]
    assert comp.sampling.max_tokens == 3 and comp.sampling.top_k == 5 and comp.sampling.seed == (-3) % 2**63
    assert comp.stop == ("x", "y") and comp.timeout_s == 2.5


@pytest.mark.parametrize("name,value", [
    ("logprobs", False), ("logprobs", None), ("top_logprobs", 0), ("presence_penalty", 0),
    ("frequency_penalty", 0.0), ("repetition_penalty", 1.0), ("n", 1), ("user", "alice"), ("logit_bias", {}),
    ("response_format", {"type": "text"}), ("tools", []), ("tool_choice", "none"), ("store", False),
    ("max_completion_tokens", 4), ("stream_options", None),
])
def test_neutral_values_of_unsupported_chat_parameters_are_accepted(parser, name, value):
    got, plain = parser.chat(chat_body(**{name: value})), parser.chat(chat_body())
    if name == "max_completion_tokens":   # not neutral: it is max_tokens' newer name
        assert got.sampling.max_tokens == value != plain.sampling.max_tokens
        got = dataclasses.replace(got, sampling=dataclasses.replace(got.sampling,
                                                                    max_tokens=plain.sampling.max_tokens,
                                                                    reserve_tokens=plain.sampling.reserve_tokens))
    assert same_request(got, plain)


def same_request(a, b) -> bool:
    """Equal in everything but the generated request id and creation time."""
    ignored = {"request_id": "", "created": 0}
    return dataclasses.replace(a, **ignored) == dataclasses.replace(b, **ignored)


@pytest.mark.parametrize("name,value", [
    ("functions", [{"name": "f"}]), ("function_call", "auto"),
])
def test_values_the_engine_cannot_honour_are_a_400_naming_the_parameter(parser, name, value):
    error = rejected(parser.chat, chat_body(**{name: value}), name)
    assert error.code == "unsupported_parameter"


@pytest.mark.parametrize("name,value", [("suffix", "end"), ("best_of", 2)])
def test_completion_only_parameters_we_cannot_honour_are_named(parser, name, value):
    rejected(parser.completions, completion_body(**{name: value}), name)


def test_echo_with_logprobs_asks_for_the_prompts_logprobs_too(parser):
    echoed = parser.completions(completion_body(echo=True, logprobs=3))[0]
    assert echoed.sampling.prompt_logprobs == 3 and echoed.sampling.logprobs == 3 and echoed.echo_text == "hello"
    assert parser.completions(completion_body(logprobs=3))[0].sampling.prompt_logprobs is None


def test_max_tokens_zero_with_echo_asks_for_the_prompt_alone_and_without_echo_is_named(parser):
    only = parser.completions(completion_body(echo=True, logprobs=1, max_tokens=0))[0]
    assert only.echo_only and only.sampling.max_tokens == 1 and only.sampling.prompt_logprobs == 1
    assert not parser.completions(completion_body(echo=True, max_tokens=1))[0].echo_only
    assert "echo" in rejected(parser.completions, completion_body(max_tokens=0), "max_tokens").message
    rejected(parser.completions, completion_body(echo=True, max_tokens=False), "max_tokens")
    rejected(parser.completions, completion_body(echo=True, max_tokens=-1), "max_tokens")
    rejected(parser.chat, chat_body(max_tokens=0), "max_tokens")


def test_echo_false_and_best_of_one_are_accepted(parser):
    got = parser.completions(completion_body(echo=False, best_of=1, suffix=None, logprobs=None))[0]
    assert same_request(got, parser.completions(completion_body())[0]) and got.echo_text is None


def test_penalties_logprobs_n_and_echo_reach_the_request(parser):
    chat = parser.chat(chat_body(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2, n=3,
                                 logprobs=True, top_logprobs=4))
    s = chat.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.logprobs) == (0.5, -1.0, 1.2, 4)
    assert chat.n == 3
    assert parser.chat(chat_body(logprobs=True)).sampling.logprobs == 0
    assert parser.chat(chat_body(logprobs=False, top_logprobs=None)).sampling.logprobs is None
    echoed = parser.completions(completion_body(echo=True))[0]
    assert echoed.echo_text == "hello" and echoed.sampling.logprobs is None
    ids = parser.tokenizer.encode("hello there")
    assert parser.completions(completion_body(prompt=ids, echo=True))[0].echo_text == "hello there"
    assert parser.completions(completion_body(logprobs=0))[0].sampling.logprobs == 0


@pytest.mark.parametrize("name,value", [
    ("top_logprobs", 21), ("top_logprobs", -1), ("presence_penalty", 2.5), ("frequency_penalty", -3),
    ("repetition_penalty", 0), ("repetition_penalty", 11), ("logprobs", 1),
])
def test_out_of_range_logprobs_and_penalties_are_a_400_naming_the_parameter(parser, name, value):
    rejected(parser.chat, chat_body(**{name: value}), name)


def test_a_huge_integer_read_as_a_float_is_reported_as_out_of_range(parser):
    import orjson

    body = orjson.loads(b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000000000000000000000000}')
    error = rejected(parser.chat, body, "max_tokens")
    assert "between 1 and" in error.message and "float" not in error.message
    error = rejected(parser.chat, {**body, "max_tokens": 1.0}, "max_tokens")   # in range, written as a float
    assert "got 1.0" in error.message and "between" not in error.message


def test_top_logprobs_needs_logprobs_true(parser):
    rejected(parser.chat, chat_body(top_logprobs=2), "top_logprobs")
    rejected(parser.chat, chat_body(logprobs=False, top_logprobs=2), "top_logprobs")
    assert parser.chat(chat_body(top_logprobs=0)).sampling.logprobs is None
    rejected(parser.completions, completion_body(logprobs=21), "logprobs")


def test_n_choices_must_fit_together_in_the_decode_pool():
    from gpu.tokenizer import Tokenizer

    small = RequestParser(Tokenizer.load(None), MODEL, MAX_LEN, reserve_tokens=16, kv_pool_blocks=64,
                          kv_block_tokens=16)
    # "hello" is one block with max_tokens 10: 64 choices fit exactly, 65 do not
    assert small.completions(completion_body(n=64, max_tokens=10))[0].n == 64
    error = rejected(small.completions, completion_body(n=65, max_tokens=10), "n")
    assert "64" in error.message and "65" in error.message
    # a 40-token prompt's 2 full blocks are held once for all choices: each adds 1 block (8 prompt + 8 output)
    assert small.completions(completion_body(prompt=[1] * 40, n=62, max_tokens=8))[0].n == 62
    error = rejected(small.completions, completion_body(prompt=[1] * 40, n=63, max_tokens=8), "n")
    assert "65 KV blocks" in error.message


@pytest.mark.parametrize("name,value", [
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 2**31), ("max_tokens", "5"), ("max_tokens", 1.5),
    ("max_tokens", True), ("temperature", -0.1), ("temperature", 2.5), ("temperature", "hot"), ("top_p", 0),
    ("top_p", 1.01), ("top_k", 0), ("top_k", -2), ("min_p", 1.5), ("seed", "x"), ("seed", 2**64),
    ("n", 0), ("n", 200), ("stop", ""), ("stop", [""]), ("stop", [1]), ("stop", ["s"] * 50),
    ("stop", "x" * 5000), ("stream", "yes"), ("stream_options", []), ("user", 5), ("timeout", 0),
    ("timeout", -1), ("timeout", "1"), ("ignore_eos", "no"), ("max_token", 5), ("max_completion_tokens", 0),
])
def test_invalid_values_are_a_400_naming_the_parameter(parser, name, value):
    rejected(parser.chat, chat_body(**{name: value}), name)


def test_stream_options_without_stream_is_rejected_and_with_stream_sets_usage(parser):
    rejected(parser.chat, chat_body(stream_options={"include_usage": True}), "stream_options")
    assert parser.chat(chat_body(stream=True, stream_options={"include_usage": True})).include_usage


def test_unknown_model_is_a_404_with_code_model_not_found(parser):
    with pytest.raises(ModelNotFoundError) as info:
        parser.chat(chat_body(model="gpt-4"))
    assert info.value.http_status == 404 and info.value.code == "model_not_found" and info.value.param == "model"


@pytest.mark.parametrize("messages", [None, [], "hi", [{"role": "user"}], [{"role": "tool", "content": "x"}],
                                      [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
                                      [5]])
def test_bad_message_lists_are_rejected(parser, messages):
    rejected(parser.chat, chat_body(messages=messages), "messages")


def test_content_as_text_parts_equals_content_as_string(parser):
    parts = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
    a = parser.chat(chat_body(messages=[{"role": "user", "content": parts}]))
    b = parser.chat(chat_body(messages=[{"role": "user", "content": "hello"}]))
    assert a.prompt_ids == b.prompt_ids


def test_one_empty_message_is_still_a_valid_chat_prompt(parser):
    assert parser.chat(chat_body(messages=[{"role": "user", "content": ""}])).prompt_ids


@pytest.mark.parametrize("prompt", ["", [], [[]], [-1], [10**9], [True], None, 5, {"a": 1}])
def test_empty_or_malformed_prompts_are_rejected(parser, prompt):
    rejected(parser.completions, completion_body(prompt=prompt), "prompt")


def test_prompt_fitting_exactly_with_one_output_token_passes_and_one_more_fails(parser):
    ok = parser.completions(completion_body(prompt=[42] * (MAX_LEN - 1), max_tokens=1))[0]
    assert len(ok.prompt_ids) == MAX_LEN - 1
    assert rejected(parser.completions, completion_body(prompt=[42] * MAX_LEN), "prompt").code == \
        "context_length_exceeded"
    assert rejected(parser.completions, completion_body(prompt=[42] * (MAX_LEN - 1), max_tokens=2),
                    "max_tokens").code == "context_length_exceeded"
    assert rejected(parser.chat, chat_body(max_completion_tokens=MAX_LEN), "max_completion_tokens").code == \
        "context_length_exceeded"


def test_a_one_megabyte_prompt_is_rejected_without_tokenizing_it(parser):
    start = time.monotonic()
    error = rejected(parser.completions, completion_body(prompt="a" * (1 << 20)), "prompt")
    assert error.code == "context_length_exceeded"
    assert time.monotonic() - start < 0.1
    rejected(parser.chat, chat_body(messages=[{"role": "user", "content": "b" * (1 << 20)}]), "messages")


def test_a_single_string_or_token_list_in_a_list_is_one_prompt(parser):
    assert parser.completions(completion_body(prompt=["hello"]))[0].prompt_ids == \
        parser.completions(completion_body(prompt="hello"))[0].prompt_ids
    assert parser.completions(completion_body(prompt=[[1, 2, 3]]))[0].prompt_ids == [1, 2, 3]


def test_a_list_of_prompts_is_one_request_per_prompt_whose_choices_follow_the_earlier_prompts_choices(parser):
    ids = parser.tokenizer.encode("hello there")
    for prompts in (["hello", "hello there", "a"], [[1, 2, 3], ids]):
        body = completion_body(prompt=prompts, n=2, max_tokens=3, echo=True, logprobs=1, stop=["x"], timeout=5)
        got = parser.completions(body, "batch-1")
        assert [r.first_index for r in got] == [0, 2, 4][:len(prompts)]
        assert {(r.request_id, r.created, r.n, r.stop, r.timeout_s) for r in got} == {("batch-1", got[0].created, 2,
                                                                                        ("x",), 5.0)}
        for prompt, r in zip(prompts, got):   # each as that prompt alone would be, bar its place
            (alone,) = parser.completions({**body, "prompt": prompt}, "batch-1")
            assert same_request(dataclasses.replace(r, first_index=0), alone)
            assert r.echo_text == (prompt if isinstance(prompt, str) else parser.tokenizer.decode(prompt))
            assert r.sampling.prompt_logprobs == 1
    assert [r.prompt_ids for r in parser.completions(completion_body(prompt=[[1, 2], [3]]))] == [[1, 2], [3]]
    assert [r.echo_only for r in parser.completions(completion_body(prompt=["a", "b"], echo=True, max_tokens=0))] \
        == [True, True]


@pytest.mark.parametrize("prompt,named", [
    (["a", [1, 2]], "mixes strings and token-id lists"), ([[1, 2], "a"], "mixes"), (["a", ""], "prompt[1] of 2"),
    ([[1], []], "prompt[1] of 2"), ([[1], [2, 10**9]], "prompt[1] of 2"), ([[1], [2, True]], "prompt[1] of 2"),
    ([[1], ["a"]], "prompt[1] of 2"), (["a", 5], "must be"), (["a", None], "must be"), ([[1], 5], "must be"),
    ([1, "a"], "must be"), ([], "empty list"), (["", "a"], "prompt[0] of 2"),
])
def test_a_bad_list_of_prompts_is_a_400_naming_prompt_and_which_one(parser, prompt, named):
    assert named in rejected(parser.completions, completion_body(prompt=prompt), "prompt").message


def test_a_prompt_too_long_among_several_fails_the_request_naming_it_and_a_body_error_names_none(parser):
    long = [42] * MAX_LEN
    for prompts, k in (([[1], long], 1), ([long, [1]], 0)):
        error = rejected(parser.completions, completion_body(prompt=prompts, max_tokens=None), "prompt")
        assert error.code == "context_length_exceeded" and error.message.startswith(f"prompt[{k}] of 2: ")
    error = rejected(parser.completions, completion_body(prompt=[[1], [42] * (MAX_LEN - 2)], max_tokens=3),
                     "max_tokens")
    assert error.code == "context_length_exceeded" and error.message.startswith("prompt[1] of 2: ")
    error = rejected(parser.completions, completion_body(prompt=["a", "b"], temperature=5), "temperature")
    assert not error.message.startswith("prompt[")


def test_prompts_times_n_over_what_admission_takes_at_once_is_a_400_before_any_prompt_is_tokenized():
    from gpu.tokenizer import Tokenizer

    small = RequestParser(Tokenizer.load(None), MODEL, MAX_LEN, reserve_tokens=16, max_sequences=6)
    assert len(small.completions(completion_body(prompt=["a"] * 3, n=2))) == 3
    error = rejected(small.completions, completion_body(prompt=["a"] * 4, n=2), "prompt")
    assert "max_queued_requests=6" in error.message and "at most 3 prompts" in error.message
    start = time.monotonic()   # 100k prompts of a megabyte body: refused on their count alone
    rejected(small.completions, completion_body(prompt=["word " * 2] * 100_000), "prompt")
    assert time.monotonic() - start < 0.1
    assert small.completions(completion_body(prompt="a", n=8))[0].n == 8   # one prompt's n: admission's to refuse


@pytest.mark.parametrize("field, value", [
    ("metadata", {f"k{i}": "v" for i in range(17)}), ("metadata", {"k" * 65: "v"}), ("metadata", {"k": "v" * 513}),
    ("metadata", {"k": 1}), ("user", "u" * 513), ("user", ["u"]), ("safety_identifier", 7),
])
def test_echoed_fields_are_bounded_as_openai_bounds_them(parser, field, value):
    rejected(parser.chat, chat_body(**{field: value}), field)
    rejected(parser.completions, completion_body(**{field: value}), field)
    assert parser.chat(chat_body(metadata={f"k{i}": "v" * 512 for i in range(16)}, user="u" * 512))


def test_stop_list_limit_is_a_named_constant(parser):
    assert parser.chat(chat_body(stop=["s"] * MAX_STOP_STRINGS)).stop == ("s",) * MAX_STOP_STRINGS


# every field a current OpenAI client may send that the engine accepts and ignores, with a realistic value
IGNORED_CHAT_VALUES = {
    "store": True, "metadata": {"k": "v"}, "service_tier": "flex", "prompt_cache_key": "session-1",
    "prompt_cache_retention": "24h", "prompt_cache_options": {"ttl": "24h"}, "safety_identifier": "u-1",
    "reasoning_effort": "low", "verbosity": "low", "web_search_options": {"search_context_size": "low"},
    "prediction": {"type": "content", "content": "x"}, "moderation": {"model": "omni-moderation-latest"},
    "modalities": ["text"], "audio": None, "user": "alice",
}


def test_the_ignored_field_table_matches_what_the_tests_send():
    from api import fields

    assert set(IGNORED_CHAT_VALUES) == set(fields.CHAT.ignored)
    assert set(fields.COMPLETION.ignored) == {"user"}


def test_every_openai_chat_and_completion_field_is_honoured_or_ignored():
    """The official client's request types (the package installed with the test extras) name no field we refuse
    as unknown."""
    import typing

    from openai.types import completion_create_params as completion
    from openai.types.chat import completion_create_params as chat

    from api import fields

    chat_names = set(typing.get_type_hints(chat.CompletionCreateParamsBase))
    completion_names = set(typing.get_type_hints(completion.CompletionCreateParamsBase))
    assert chat_names <= fields.CHAT.names, chat_names - fields.CHAT.names
    assert completion_names <= fields.COMPLETION.names, completion_names - fields.COMPLETION.names


def test_ignored_fields_are_accepted_and_change_nothing(parser):
    got, plain = parser.chat(chat_body(**IGNORED_CHAT_VALUES)), parser.chat(chat_body())
    assert same_request(got, plain)
    stream = parser.chat(chat_body(stream=True, stream_options={"include_usage": True, "include_obfuscation": False}))
    assert stream.include_usage


@pytest.mark.parametrize("route,name", [("chat", "prompt_cache_keys"), ("chat", "max_token"),
                                        ("completion", "reasoning_effort"), ("completion", "temprature")])
def test_a_misspelt_or_foreign_field_is_a_400_naming_it(parser, route, name):
    call, body = (parser.chat, chat_body) if route == "chat" else (parser.completions, completion_body)
    error = rejected(call, body(**{name: 1}), name)
    assert error.code == "unknown_parameter" and name in error.message


@pytest.mark.parametrize("name,value", [("modalities", ["text", "audio"]), ("audio", {"voice": "alloy"})])
def test_asking_for_audio_output_is_a_400_naming_the_field(parser, name, value):
    assert rejected(parser.chat, chat_body(**{name: value}), name).code == "unsupported_parameter"


def test_max_tokens_over_the_context_is_a_400_by_default_and_clamped_when_the_operator_says_so(parser):
    from gpu.tokenizer import Tokenizer

    rejected(parser.chat, chat_body(max_tokens=32000), "max_tokens")
    rejected(parser.completions, completion_body(max_tokens=MAX_LEN), "max_tokens")
    clamp = RequestParser(Tokenizer.load(None), MODEL, MAX_LEN, reserve_tokens=16, max_tokens_policy="clamp")
    got = clamp.chat(chat_body(max_tokens=32000))
    room = MAX_LEN - len(got.prompt_ids)
    assert got.sampling.max_tokens == room and got.sampling.reserved_output_tokens == 16   # reserved as if none
    fits = clamp.completions(completion_body(max_tokens=5))[0]
    assert fits.sampling.max_tokens == 5 and fits.sampling.reserved_output_tokens == 5      # honoured in full


def test_tokenize_takes_a_prompt_or_messages_and_detokenize_inverts_it(parser):
    ids = parser.tokenizer.encode("hello there")
    assert parser.tokenize({"prompt": "hello there"}) == {"count": len(ids), "max_model_len": MAX_LEN, "tokens": ids}
    chat = parser.tokenize({"messages": [{"role": "user", "content": "hi"}]})
    assert chat["tokens"] == parser.chat(chat_body()).prompt_ids
    assert parser.detokenize({"tokens": ids, "model": MODEL}) == {"prompt": "hello there", "content": "hello there"}
    rejected(parser.tokenize, {"prompt": "a", "messages": []}, "prompt")
    rejected(parser.tokenize, {"prompt": "a", "add_special_token": True}, "add_special_token")
    rejected(parser.detokenize, {"tokens": [10**9]}, "tokens")
    rejected(parser.detokenize, {"tokens": "hi"}, "tokens")


def test_continue_final_message_continues_a_trailing_assistant_message_instead_of_opening_a_new_turn(parser):
    messages = [{"role": "user", "content": "Say a colour."}, {"role": "assistant", "content": "The colour is"}]
    text = parser.tokenizer.decode(parser.chat(chat_body(messages=messages, continue_final_message=True,
                                                         add_generation_prompt=False)).prompt_ids,
                                   skip_special_tokens=False)
    assert text.endswith("The colour is")
    new_turn = parser.tokenizer.decode(parser.chat(chat_body(messages=messages)).prompt_ids, skip_special_tokens=False)
    assert not new_turn.endswith("The colour is") and new_turn.rstrip().endswith("assistant")
    bare = parser.tokenizer.decode(parser.chat(chat_body(add_generation_prompt=False)).prompt_ids,
                                   skip_special_tokens=False)
    assert not bare.rstrip().endswith("assistant")
    rejected(parser.chat, chat_body(messages=messages, continue_final_message=True, add_generation_prompt=True),
             "continue_final_message")
    rejected(parser.chat, chat_body(continue_final_message=True), "continue_final_message")   # last is the user's
    rejected(parser.chat, chat_body(add_generation_prompt="yes"), "add_generation_prompt")


def test_every_served_name_is_accepted_and_the_first_is_reported():
    from gpu.tokenizer import Tokenizer

    aliased = RequestParser(Tokenizer.load(None), "main, alias ,", MAX_LEN, reserve_tokens=16)
    assert aliased.model_names == ("main", "alias")
    assert aliased.chat(chat_body(model="alias")).model == "main"
    assert aliased.completions(completion_body(model="main"))[0].model == "main"
    with pytest.raises(ModelNotFoundError) as info:
        aliased.chat(chat_body(model="other"))
    assert "'main' or 'alias'" in info.value.message


def test_logit_bias_reaches_the_sampling_settings_and_bad_entries_are_a_400(parser):
    got = parser.chat(chat_body(logit_bias={"42": -100, "7": 2.5}))
    assert got.sampling.logit_bias_ids == (7, 42) and got.sampling.logit_bias_values == (2.5, -100.0)
    for bad in ({"-1": 1}, {"x": 1}, {str(10**9): 1}, {"5": 101}, {"5": "1"}, {"5": True}, [5],
                {str(i): 1 for i in range(1025)}):
        rejected(parser.completions, completion_body(logit_bias=bad), "logit_bias")


@pytest.mark.parametrize("method, body", [("tokenize", {"prompt": "hi", "add_special_token": True}),
                                          ("detokenize", {"tokens": [1], "skip_special_tokens": True})])
def test_tokenize_and_detokenize_refuse_an_unknown_field_naming_it(parser, method, body):
    (name,) = set(body) - {"prompt", "tokens"}
    with pytest.raises(InvalidRequestError) as err:
        getattr(parser, method)(body)
    assert err.value.param == name and err.value.code == "unknown_parameter"


def test_tokenize_takes_llama_cpp_s_content_and_answers_its_shape_with_pieces(parser):
    """llama.cpp's /tokenize: ``content`` (``add_special`` default false) -> ``{"tokens": [ids]}``; ``with_pieces``:
    ``{"tokens": [{"id", "piece"}]}``, a piece that is not whole UTF-8 as its bytes (llama.cpp's test_tokenize)."""
    text = "Hello wörld ✨"
    ids = parser.tokenizer.encode(text, add_special_tokens=False)
    assert parser.tokenize({"content": text}) == {"tokens": ids}
    pieces = parser.tokenize({"content": text, "with_pieces": True})["tokens"]
    assert [p["id"] for p in pieces] == ids
    raw = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert raw.decode() == text
    assert any(isinstance(p["piece"], list) for p in pieces)   # the sparkle's bytes span tokens
    assert parser.tokenize({"prompt": text})["count"] == len(parser.tokenizer.encode(text))   # vLLM's shape kept
    with pytest.raises(InvalidRequestError) as err:
        parser.tokenize({"content": 3})
    assert err.value.param == "content"


def test_apply_template_answers_the_prompt_text_the_chat_route_would_run(parser):
    """llama.cpp's /apply-template: a chat body -> ``{"prompt"}``, the text whose tokens the chat route prefills
    (template controls and tools included); the chat route's 400s and 404 apply."""
    messages = [{"role": "system", "content": "You are a test."}, {"role": "user", "content": "Hi there"}]
    prompt = parser.apply_template({"messages": messages})["prompt"]
    assert parser.tokenizer.encode(prompt) == parser.chat(chat_body(messages=messages)).prompt_ids
    assert "You are a test." in prompt and prompt.rstrip().endswith("assistant")
    bare = parser.apply_template({"messages": messages, "add_generation_prompt": False})["prompt"]
    assert not bare.rstrip().endswith("assistant")
    tool = {"type": "function", "function": {"name": "list_files", "parameters": {"type": "object"}}}
    assert "list_files" in parser.apply_template({"messages": messages, "tools": [tool]})["prompt"]
    rejected(parser.apply_template, {"messages": []}, "messages")
    rejected(parser.apply_template, {"messages": messages, "max_token": 3}, "max_token")
    with pytest.raises(ModelNotFoundError):
        parser.apply_template({"messages": messages, "model": "other"})
