"""Grammar-constrained sampling (gpu/grammar.py) with the embedded model's real tokenizer and synthetic logits:
whatever the logits say, what the sampler picks under the mask parses and validates."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from gpu.grammar import (AFTER_REASONING_SPACE, CLOSE_WITHIN_TOKENS, MAX_NUMBER_CHARS, GrammarCompiler, accept_tokens,
                         after_reasoning, batch_allowed, json_schema_grammar, lark_grammar, schema_lark)
from gpu.sampling import Sampler, Sampling, make_generator
from pdserve.errors import InvalidRequestError

PERSON = {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "color", "tags", "address"],
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {"type": "object", "required": ["city"], "additionalProperties": False,
                    "properties": {"city": {"type": "string", "maxLength": 12}}},
    },
}


@pytest.fixture(scope="module")
def compiler(tok) -> GrammarCompiler:
    c = GrammarCompiler(tokenizer=tok)
    c.warm_up(background=False)
    return c


def generate(compiler, tok, grammar: str, logits_of, rows: int, max_tokens: int, seed: int = 0,
             reasoning_budget: int = 0) -> list[str]:
    """Sample ``rows`` sequences at once under ``grammar`` the way the decode actor does (batch_allowed ->
    Sampler(allowed=) -> accept_tokens), with logits from ``logits_of(step)`` ``[rows, vocab]``;
    ``reasoning_budget``: the grammar follows a reasoning ending in ``</think>`` (after_reasoning)."""
    params = [Sampling(temperature=1.0, seed=seed + i, max_tokens=max_tokens, grammar=grammar,
                       reasoning_end="</think>" if reasoning_budget else "", reasoning_budget=reasoning_budget)
              for i in range(rows)]
    gens = [make_generator(p.seed) for p in params]
    matchers = [compiler.for_sampling(p) for p in params]
    out: list[list[int]] = [[] for _ in range(rows)]
    done = [False] * rows
    for step in range(max_tokens):
        live = [i for i in range(rows) if not done[i]]
        if not live:
            break
        logits = logits_of(step)[live]
        allowed = batch_allowed([matchers[i] for i in live], logits.shape[-1], [max_tokens - step] * len(live))
        tokens = Sampler().sample(logits, [params[i] for i in live], [gens[i] for i in live], None, allowed)
        accept_tokens([matchers[i] for i in live], tokens)
        for i, t in zip(live, tokens):
            if t in tok.eos_token_ids:
                done[i] = True
                continue
            out[i].append(t)
            done[i] = matchers[i].is_terminated()
    return [tok.decode(ids) for ids in out]


def test_whatever_the_logits_every_sampled_answer_validates_against_the_schema(compiler, tok):
    grammar = json_schema_grammar(PERSON)
    noise = torch.Generator().manual_seed(7)
    texts = generate(compiler, tok, grammar, lambda step: torch.randn(8, tok.vocab_size, generator=noise) * 4,
                     rows=8, max_tokens=120)
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 4   # really sampled, not one forced answer


def test_a_grammar_after_the_reasoning_leaves_it_free_then_forces_its_end_at_the_budget(compiler, tok):
    """Reasoning first (vLLM issue 20663): logits that favour brackets and quotes meet no closing pressure nor
    grammar in the reasoning; at the budget ``</think>`` is forced, and the answer after it validates, after at
    most AFTER_REASONING_SPACE characters of the whitespace the logits favour too."""
    grammar = lark_grammar(after_reasoning(schema_lark(PERSON), "</think>", opened=True))
    bias = torch.zeros(tok.vocab_size)
    for piece in ("[", "{", '"', "]}", " the", "\n\n", "  "):
        for t in tok.encode(piece):
            bias[t] = 11.0
    noise = torch.Generator().manual_seed(11)
    budget = 30
    texts = generate(compiler, tok, grammar, lambda step: torch.randn(6, tok.vocab_size, generator=noise) + bias,
                     rows=6, max_tokens=160, reasoning_budget=budget)
    for text in texts:
        reasoning, _, answer = text.partition("</think>")
        assert len(tok.encode(reasoning)) <= budget + 4, text   # re-encoded text: a few tokens apart
        jsonschema.validate(json.loads(answer), PERSON)
        assert len(answer) - len(answer.lstrip()) <= AFTER_REASONING_SPACE, text
    assert sum(text.partition("</think>")[0].count("{") for text in texts) > 3   # brackets left open in reasoning
    ids = tok.encode(texts[0])[:budget + 8]   # decode rebuilds the matcher from the tokens so far
    stepped = compiler.for_sampling(Sampling(grammar=grammar, reasoning_end="</think>", reasoning_budget=budget))
    for t in ids:
        stepped.accept(t)
    rebuilt = compiler.for_sampling(Sampling(grammar=grammar, reasoning_end="</think>", reasoning_budget=budget), ids)
    assert torch.equal(stepped.allowed_tokens(tok.vocab_size, 50), rebuilt.allowed_tokens(tok.vocab_size, 50))


def test_closing_pressure_ends_an_unbounded_json_object_inside_max_tokens(compiler, tok):
    """Logits that favour opening brackets and long strings: without closing pressure no object would close in
    40 tokens; with it every answer is a complete JSON object."""
    grammar = json_schema_grammar(None)
    vocab = tok.vocab_size
    bias = torch.zeros(vocab)
    for piece in ("[", "{", "[{", '{"', "a", "abc", " the", ":"):
        for t in tok.encode(piece):
            bias[t] = 8.0
    noise = torch.Generator().manual_seed(3)
    texts = generate(compiler, tok, grammar, lambda step: torch.randn(8, vocab, generator=noise) + bias,
                     rows=8, max_tokens=40)
    for text in texts:
        assert isinstance(json.loads(text), dict), text


def test_closing_pressure_closes_an_open_string_with_a_quote(compiler, tok):
    grammar = json_schema_grammar({"type": "object", "properties": {"a": {"type": "string"}}})
    ids = tok.encode('{"a":"xyz')
    m = compiler.matcher(grammar, ids)
    assert m.close_within() == CLOSE_WITHIN_TOKENS + 1   # one bracket open
    relaxed = m.allowed_tokens(tok.vocab_size, tokens_left=m.close_within() + 1)
    pressed = m.allowed_tokens(tok.vocab_size, tokens_left=m.close_within())
    assert relaxed.sum() > 1000
    pieces = {tok.decode([t]) for t in pressed.nonzero().flatten().tolist()}
    assert pieces and all(p.startswith('"') and set(p[1:]) <= set("]}") for p in pieces), pieces


def biased(tok, pieces, weight: float, seed: int):
    """Logits ``[8, vocab]``: noise plus ``weight`` on every token of ``pieces``."""
    bias = torch.zeros(tok.vocab_size)
    for piece in pieces:
        for t in tok.encode(piece):
            bias[t] = weight
    noise = torch.Generator().manual_seed(seed)
    return lambda step: torch.randn(8, tok.vocab_size, generator=noise) + bias


DIGITS = [str(d) for d in range(10)] + ["12", "345", "6789", "00", "."]


@pytest.mark.parametrize("schema", [
    {"type": "integer"},
    {"type": "object", "required": ["n", "x"], "additionalProperties": False,
     "properties": {"n": {"type": "integer"}, "x": {"type": "number"}}},
], ids=["integer", "object-of-numbers"])
def test_a_schema_number_ends_after_a_bounded_count_of_digits(compiler, tok, schema):
    """Logits that want digits forever: every number stops once it has MAX_NUMBER_CHARS characters (the token
    that reaches the bound may carry a few more) and the answer ends long before max_tokens (without the bound,
    digits run until the closing pressure of the last tokens)."""
    max_tokens = 120
    texts = generate(compiler, tok, json_schema_grammar(schema), biased(tok, DIGITS, 9.0, seed=5), rows=8,
                     max_tokens=max_tokens)
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
        numbers = re.findall(r"[-0-9.eE+]+", text)
        assert numbers and all(len(n) <= MAX_NUMBER_CHARS + 4 for n in numbers), text
        assert len(tok.encode(text)) < max_tokens - CLOSE_WITHIN_TOKENS - 8, text


def test_a_deeply_nested_answer_starts_closing_early_enough_to_close_every_level(compiler, tok):
    """Logits that favour opening brackets: the answers nest deeper than CLOSE_WITHIN_TOKENS levels, yet every one
    is complete JSON within max_tokens (the closing window grows with the open depth)."""
    texts = generate(compiler, tok, json_schema_grammar(None),
                     biased(tok, ("[", "[[", "[[[", "[{", '{"', '":[', "a", ":"), 9.0, seed=11), rows=8,
                     max_tokens=100)
    depths = []
    for text in texts:
        assert isinstance(json.loads(text), dict), text
        depth = deepest = 0
        for ch in text:
            depth += (ch in "[{") - (ch in "]}")
            deepest = max(deepest, depth)
        depths.append(deepest)
    assert max(depths) > CLOSE_WITHIN_TOKENS, depths   # deeper than a fixed window could close


def test_a_matcher_rebuilt_from_the_tokens_so_far_allows_what_the_stepped_one_allows(compiler, tok):
    grammar = json_schema_grammar(PERSON)
    ids = tok.encode('{"name":"Ann","age":41,"color":"gr')
    stepped = compiler.matcher(grammar)
    for t in ids:
        assert stepped.accept(t)
    rebuilt = compiler.matcher(grammar, ids)
    assert torch.equal(stepped.allowed_tokens(tok.vocab_size), rebuilt.allowed_tokens(tok.vocab_size))
    allowed = {tok.decode([t]) for t in rebuilt.allowed_tokens(tok.vocab_size).nonzero().flatten().tolist()}
    assert "een" in allowed and "ay" not in allowed


def test_a_complete_answer_terminates_and_then_allows_only_eos(compiler, tok):
    grammar = json_schema_grammar({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                   "additionalProperties": False})
    m = compiler.matcher(grammar, tok.encode('{"ok":true}'))
    assert m.is_terminated()
    assert m.allowed_tokens(tok.vocab_size).nonzero().flatten().tolist() == list(tok.eos_token_ids)


def test_a_rejected_token_leaves_eos_as_the_only_choice(compiler, tok):
    m = compiler.matcher(json_schema_grammar(None))
    assert not m.accept(tok.encode("hello")[0])
    assert m.allowed_tokens(tok.vocab_size).nonzero().flatten().tolist() == list(tok.eos_token_ids)


def test_a_schema_the_library_rejects_is_an_error_naming_the_field(compiler):
    with pytest.raises(InvalidRequestError) as err:
        compiler.check(json_schema_grammar({"type": "object", "properties": {"a": {"type": "strng"}}}))
    assert err.value.param == "response_format" and "strng" in err.value.message
    with pytest.raises(InvalidRequestError) as err:
        compiler.check(lark_grammar("start: undefined_rule"), param="tool_choice")
    assert err.value.param == "tool_choice"


def test_batch_masks_leave_unconstrained_rows_alone_and_forbid_ids_past_the_tokenizer(compiler, tok):
    m = compiler.matcher(json_schema_grammar(None))
    assert batch_allowed([None, None], tok.vocab_size) is None
    allowed = batch_allowed([None, m], tok.vocab_size + 64)
    assert allowed.shape == (2, tok.vocab_size + 64)
    assert bool(allowed[0].all())
    assert not bool(allowed[1, tok.vocab_size:].any())
    # computed without the mask: compact JSON text starts with "{" (no whitespace), so the first token's bytes
    # must; of those, the ones the library's parser takes (consume_token, not the mask code)
    compiled = compiler._compiled(json_schema_grammar(None))
    expected = [t for t, raw in enumerate(compiler.token_bytes[:tok.vocab_size])
                if raw[:1] == b"{" and compiled.deep_copy().consume_token(t)]
    assert len(expected) >= 2 and tok.encode("{")[0] in expected and tok.encode('{"')[0] in expected
    assert allowed[1].nonzero().flatten().tolist() == expected


def test_the_sampler_only_picks_allowed_tokens_and_refuses_an_empty_mask():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    allowed = torch.zeros(3, 50, dtype=torch.bool)
    allowed[0, 7] = allowed[1, [3, 4]] = allowed[2, 49] = True
    params = [Sampling(temperature=0.0), Sampling(temperature=1.5, seed=1),
              Sampling(temperature=1.0, top_k=2)]
    for _ in range(20):
        tokens = Sampler().sample(logits, params, [None, make_generator(1), None], None, allowed)
        assert tokens[0] == 7 and tokens[1] in (3, 4) and tokens[2] == 49
    allowed[2] = False
    with pytest.raises(ValueError, match="no allowed token"):
        Sampler().sample(logits, params, [None] * 3, None, allowed)
