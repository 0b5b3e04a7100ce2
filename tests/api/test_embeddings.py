"""The embeddings body (api/embeddings.py) with the real tokenizer: every OpenAI input shape, each bad input a 400
naming its field, and the answer's two shapes (OpenAI's, float or base64; llama.cpp's /embedding)."""
from __future__ import annotations

import base64

import numpy as np
import pytest

from api.embeddings import EmbeddingsDialect, answer_body, parse_embeddings
from api.protocol import RequestParser
from pdserve.errors import InvalidRequestError, ModelNotFoundError

MODEL = "test-model"
MAX_LEN = 64


@pytest.fixture(scope="module")
def parser():
    from gpu.tokenizer import Tokenizer

    return RequestParser(Tokenizer.load(None), MODEL, MAX_LEN, reserve_tokens=16, max_sequences=8)


def test_every_openai_input_shape_becomes_one_input_per_text_or_token_list(parser):
    hello = parser.tokenizer.encode("hello world")
    one = parse_embeddings(parser, {"input": "hello world", "model": MODEL, "user": "u-1"}, "rid-1")
    assert [(i.prompt_ids, i.first_index, i.request_id) for i in one.inputs] == [(hello, 0, "rid-1")]
    assert (one.model, one.encoding_format, one.llama) == (MODEL, "float", False)
    assert [i.prompt_ids for i in parse_embeddings(parser, {"input": [5, 6, 7]}).inputs] == [[5, 6, 7]]
    texts = parse_embeddings(parser, {"input": ["hello world", "a"], "encoding_format": "base64"})
    assert [i.prompt_ids for i in texts.inputs] == [hello, parser.tokenizer.encode("a")]
    assert [i.first_index for i in texts.inputs] == [0, 1] and texts.encoding_format == "base64"
    assert texts.prompt_tokens == len(hello) + 1
    lists = parse_embeddings(parser, {"input": [[1, 2], [3]]})
    assert [i.prompt_ids for i in lists.inputs] == [[1, 2], [3]]
    llama = parse_embeddings(parser, {"content": "hello world"}, llama=True)
    assert llama.llama and [i.prompt_ids for i in llama.inputs] == [hello]
    assert parse_embeddings(parser, {"input": "x"}).request_id.startswith("embd-")


@pytest.mark.parametrize("body, param, words", [
    ({"input": ""}, "input", "empty string"),
    ({"input": []}, "input", "empty list"),
    ({"input": ["a", ""]}, "input[1]", "empty string"),
    ({"input": [[1, 2], []]}, "input[1]", "non-empty list of token ids"),
    ({"input": {"content": "a"}}, "input", "prompt object"),
    ({"input": {"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}}, "input",
     "text only"),
    ({"input": {"content": [{"type": "unknown"}]}}, "input", "text part"),
    ({"input": {"prompt_string": "a", "multimodal_data": ["AAAA"]}}, "input", "text only"),
    ({"input": ["a", {"content": [{"type": "input_audio", "input_audio": {"data": "AAAA"}}]}]}, "input[1]",
     "text only"),
    ({"input": ["a", [1, None]]}, "input[1]", "non-empty string"),
    ({"input": True}, "input", "non-empty string"),
    ({"input": 7}, "input", "non-empty string"),
    ({"input": {"text": "a"}}, "input", "prompt object"),
    ({"input": [True, False]}, "input[0]", "non-empty string"),
    ({"input": [[1, 10**9]]}, "input", "token ids must be in"),
    ({"input": [[1.5, 2]]}, "input", "list of token ids"),
    ({}, "input", "is required"),
    ({"input": None}, "input", "is required"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format", "float, base64"),
    ({"input": "a", "dimensions": 64}, "dimensions", "not supported"),
    ({"input": "a", "max_tokens": 3}, "max_tokens", "unrecognized"),
    ({"input": "word " * 80}, "input", "maximum context length"),
    ({"input": "x" * 10**6}, "input", "characters"),
    ({"input": ["a"] * 9}, "input", "at most 8"),
    ({"input": "a", "model": 3}, "model", "string"),
])
def test_each_bad_input_is_a_400_naming_its_field(parser, body, param, words):
    with pytest.raises(InvalidRequestError) as caught:
        parse_embeddings(parser, body)
    assert caught.value.http_status == 400 and caught.value.param == param and words in caught.value.message


def test_llama_cpp_input_shapes_mixed_lists_and_prompt_objects_are_one_input_each(parser):
    """llama.cpp's /v1/embeddings takes more than OpenAI's shapes (its tests/unit/test_embedding.py): token ids and
    strings in one list are one input, a batch may mix strings, token lists and prompt objects, and a prompt object
    (``prompt_string``, or ``content`` text parts, joined) is the text it holds."""
    enc = parser.tokenizer.encode
    hello = enc("hello world")

    def ids(body):
        return [i.prompt_ids for i in parse_embeddings(parser, body).inputs]
    assert ids({"input": [12, 34, "string", 56]}) == [[12, 34, *enc("string"), 56]]
    assert ids({"input": ["string1", [12, 34]]}) == [enc("string1"), [12, 34]]
    assert ids({"input": [[12, 34], [12, "string", 34]]}) == [[12, 34], [12, *enc("string"), 34]]
    assert ids({"input": {"prompt_string": "hello world"}}) == [hello]
    parts = {"content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}
    assert ids({"input": parts}) == [hello]
    assert ids({"input": ["hello world", {"prompt_string": "a"}, parts]}) == [hello, enc("a"), hello]
    assert [i.first_index for i in parse_embeddings(parser, {"input": ["a", [1], parts]}).inputs] == [0, 1, 2]


def test_any_model_name_is_accepted_when_the_served_names_hold_a_wildcard(parser):
    wildcard = RequestParser(parser.tokenizer, f"{MODEL},*", MAX_LEN, reserve_tokens=16)
    request = parse_embeddings(wildcard, {"input": "a", "model": "text-embedding-3-small"})
    assert request.model == MODEL and wildcard.model_names == (MODEL,)


def test_an_unknown_model_is_a_404_and_llama_cpp_content_takes_only_its_fields(parser):
    with pytest.raises(ModelNotFoundError):
        parse_embeddings(parser, {"input": "a", "model": "text-embedding-3-small"})
    with pytest.raises(InvalidRequestError) as caught:
        parse_embeddings(parser, {"content": "a", "encoding_format": "base64"}, llama=True)
    assert caught.value.param == "encoding_format"
    with pytest.raises(InvalidRequestError, match="does not route embeddings"):
        EmbeddingsDialect(parser, None, serves=False).build({"input": "a"})


def test_the_answer_is_openai_floats_or_the_base64_itself_and_llama_cpp_nested_floats(parser):
    vectors = [np.asarray([0.5, -0.25, 1 / 3], dtype="<f4"), np.asarray([1.0, 0.0, 0.0], dtype="<f4")]
    wire = [base64.b64encode(v.tobytes()).decode() for v in vectors]
    request = parse_embeddings(parser, {"input": ["hello world", "a"]})
    body = answer_body(request, wire)
    assert body["object"] == "list" and body["model"] == MODEL
    assert [(d["object"], d["index"]) for d in body["data"]] == [("embedding", 0), ("embedding", 1)]
    assert [d["embedding"] for d in body["data"]] == [v.tolist() for v in vectors]   # exact float32 values
    assert body["usage"] == {"prompt_tokens": request.prompt_tokens, "total_tokens": request.prompt_tokens}
    as_base64 = answer_body(parse_embeddings(parser, {"input": ["b", "a"], "encoding_format": "base64"}), wire)
    assert [d["embedding"] for d in as_base64["data"]] == wire
    llama = answer_body(parse_embeddings(parser, {"content": ["b", "a"]}, llama=True), wire)
    assert llama == [{"index": 0, "embedding": [vectors[0].tolist()]}, {"index": 1, "embedding": [vectors[1].tolist()]}]
