"""Sampler behaviour on synthetic logits (no model needed)."""
from __future__ import annotations

import dataclasses
import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from gpu.sampling import (Sampler, Sampling, TokenLogprob, apply_penalties, make_generator, prompt_logprobs,
                          token_logprobs)
from pdserve.errors import InvalidRequestError

VOCAB = 1000


def logits_batch(b: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_temperature_zero_is_argmax():
    x = logits_batch()
    params = [Sampling(temperature=0.0)] * 4
    assert Sampler().sample(x, params, [None] * 4) == x.argmax(-1).tolist()
    tiny = [Sampling(temperature=1e-6, seed=1)] * 4
    assert Sampler().sample(x, tiny, [make_generator(1)] * 4) == x.argmax(-1).tolist()


def test_the_same_seed_gives_the_same_tokens():
    x = logits_batch()
    p = Sampling(temperature=1.0, seed=1234)

    def run():
        gens = [make_generator(p.seed) for _ in range(4)]
        return [Sampler().sample(x, [p] * 4, gens) for _ in range(20)]

    first, second = run(), run()
    assert first == second
    assert len({t for step in first for t in step}) > 4  # it really samples, not argmax


def test_a_seeded_row_does_not_depend_on_its_batch_neighbours():
    x = logits_batch(3)
    seeded = Sampling(temperature=0.8, seed=7)
    alone = Sampler().sample(x[1:2], [seeded], [make_generator(7)])
    g = make_generator(7)
    batched = Sampler().sample(x, [Sampling(temperature=0.0), seeded, Sampling(seed=None)],
                               [None, g, None])
    assert batched[1] == alone[0]


def test_top_k_one_is_greedy():
    x = logits_batch()
    params = [Sampling(temperature=1.5, top_k=1, seed=i) for i in range(4)]
    gens = [make_generator(i) for i in range(4)]
    for _ in range(10):
        assert Sampler().sample(x, params, gens) == x.argmax(-1).tolist()


def test_tiny_top_p_is_greedy():
    x = logits_batch()
    params = [Sampling(temperature=1.0, top_p=1e-6, seed=i) for i in range(4)]
    gens = [make_generator(i) for i in range(4)]
    for _ in range(10):
        assert Sampler().sample(x, params, gens) == x.argmax(-1).tolist()


def test_min_p_one_is_greedy():
    x = logits_batch()
    params = [Sampling(temperature=1.0, min_p=1.0, seed=i) for i in range(4)]
    assert Sampler().sample(x, params, [make_generator(i) for i in range(4)]) == x.argmax(-1).tolist()


def test_top_k_only_draws_from_the_k_best():
    x = logits_batch(1)
    best3 = set(torch.topk(x[0], 3).indices.tolist())
    p = Sampling(temperature=5.0, top_k=3, seed=3)
    g = make_generator(3)
    drawn = {Sampler().sample(x, [p], [g])[0] for _ in range(200)}
    assert drawn <= best3 and len(drawn) > 1


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probabilities 0.5, 0.3, 0.2: top_p=0.6 keeps the first two (0.5 < 0.6 <= 0.8).
    x = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    p = Sampling(temperature=1.0, top_p=0.6, seed=0)
    g = make_generator(0)
    drawn = {Sampler().sample(x, [p], [g])[0] for _ in range(300)}
    assert drawn == {0, 1}


def test_unseeded_requests_have_no_generator():
    assert make_generator(None) is None
    assert isinstance(make_generator(5), torch.Generator)


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("top_k", 2.5),
    ("min_p", -0.1), ("min_p", 1.1),
    ("seed", -1), ("seed", 2**64), ("seed", 1.0),
    ("max_tokens", 0), ("max_tokens", True),
    ("stop_token_ids", (-1,)), ("stop_token_ids", [1, 2]),
    ("ignore_eos", "yes"),
    ("presence_penalty", 2.1), ("presence_penalty", -2.5), ("presence_penalty", float("inf")),
    ("frequency_penalty", -2.01), ("frequency_penalty", 3), ("frequency_penalty", "often"),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", 10.5),
    ("repetition_penalty", float("nan")), ("repetition_penalty", True),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", 5.0), ("logprobs", True),
])
def test_out_of_range_values_are_rejected_naming_the_field(field, value):
    with pytest.raises(InvalidRequestError) as e:
        Sampling(**{field: value}).validate()
    assert e.value.param == field


def test_defaults_and_edge_values_are_valid():
    for params in [Sampling(),
                   Sampling(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, seed=0, max_tokens=1),
                   Sampling(top_k=0, min_p=1.0, seed=2**63 - 1, stop_token_ids=(0, 5), ignore_eos=True),
                   Sampling(presence_penalty=-2.0, frequency_penalty=2, repetition_penalty=10.0, logprobs=0),
                   Sampling(presence_penalty=2.0, frequency_penalty=-2.0, repetition_penalty=1e-3,
                                  logprobs=20)]:
        before = dataclasses.replace(params)
        assert params.validate() is params and params == before   # accepted as given, nothing rewritten
    with pytest.raises(InvalidRequestError):
        Sampling(stop_token_ids=(50000,)).validate(vocab_size=49152)


def test_mismatched_batch_sizes_are_a_caller_bug():
    with pytest.raises(ValueError):
        Sampler().sample(logits_batch(2), [Sampling()], [None])


# ---------------------------------------------------------------- penalties

def test_new_fields_default_off_and_positional_construction_still_works():
    p = Sampling(0.5, 0.9, 40, 0.05, 7, 32, True, (2,))
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.max_tokens, p.ignore_eos, p.stop_token_ids) == \
        (0.5, 0.9, 40, 0.05, 7, 32, True, (2,))
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.logprobs) == (0.0, 0.0, 1.0, None)
    assert not p.has_penalties
    assert Sampling(presence_penalty=0.1).has_penalties
    assert Sampling(frequency_penalty=-0.1).has_penalties
    assert Sampling(repetition_penalty=1.1).has_penalties
    assert not Sampling(logprobs=5).has_penalties


def reference_penalties(logits, params, histories):
    """vLLM's apply_penalties, dense, written out independently of gpu.sampling."""
    out = logits.clone()
    vocab = logits.shape[-1]
    for i, p in enumerate(params):
        if not p.has_penalties:
            continue
        prompt, output = histories[i]
        counts = torch.bincount(torch.tensor(list(output), dtype=torch.long), minlength=vocab).float()
        seen = counts > 0
        seen[torch.tensor(list(prompt), dtype=torch.long)] = True
        x = out[i]
        x = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
        x = x - p.frequency_penalty * counts
        x = x - p.presence_penalty * (counts > 0).float()
        out[i] = x
    return out


def random_histories(b, vocab, seed, prompt_len=12, output_len=9):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (prompt_len,), generator=g).tolist(),
             torch.randint(0, vocab, (output_len,), generator=g).tolist()) for _ in range(b)]


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0, 9.5])
def test_repetition_penalty_equals_hf_repetition_penalty_logits_processor(penalty):
    from transformers import RepetitionPenaltyLogitsProcessor
    vocab = 50
    x = logits_batch(4, seed=3)[:, :vocab].contiguous()
    histories = random_histories(4, vocab, seed=5)
    ours = apply_penalties(x, [Sampling(repetition_penalty=penalty)] * 4, histories)
    input_ids = torch.tensor([prompt + output for prompt, output in histories])  # [4, 21]
    hf = RepetitionPenaltyLogitsProcessor(penalty)(input_ids, x.clone())
    assert torch.equal(ours, hf)
    assert not torch.equal(ours, x)


def test_frequency_and_presence_penalties_match_a_hand_computation():
    x = torch.tensor([[1.0, -2.0, 0.5, 3.0, -0.25, 0.0]])
    prompt, output = [0, 1], [2, 2, 5, 2, 3]  # counts in the output: 2 -> 3, 3 -> 1, 5 -> 1; the prompt is ignored
    p = Sampling(frequency_penalty=0.5, presence_penalty=-0.25)
    got = apply_penalties(x, [p], [(prompt, output)])
    expected = [1.0, -2.0, 0.5 - 0.5 * 3 + 0.25, 3.0 - 0.5 + 0.25, -0.25, 0.0 - 0.5 + 0.25]
    assert got[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_repetition_then_frequency_and_presence_in_vllm_order():
    x = torch.tensor([[2.0, -2.0, 4.0, -1.0, 1.0]])
    prompt, output = [0, 1], [2, 2, 3]
    p = Sampling(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=1.0)
    got = apply_penalties(x, [p], [(prompt, output)])
    # seen (prompt or output): 0, 1, 2, 3. Then output counts 2 -> 2, 3 -> 1.
    expected = [2.0 / 2, -2.0 * 2, 4.0 / 2 - 0.5 * 2 - 1.0, -1.0 * 2 - 0.5 - 1.0, 1.0]
    assert got[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert torch.equal(got, reference_penalties(x, [p], [(prompt, output)]))


def test_a_strong_repetition_penalty_changes_the_greedy_choice():
    x = torch.tensor([[5.0, 4.0, 1.0, -1.0]])
    plain = Sampling(temperature=0.0)
    assert Sampler().sample(x, [plain], [None]) == [0]
    penalised = Sampling(temperature=0.0, repetition_penalty=10.0)
    assert Sampler().sample(x, [penalised], [None], histories=[([3], [0])]) == [1]
    assert Sampler().sample(x, [penalised], [None], histories=[([0, 1], [])]) == [2]
    freq = Sampling(temperature=0.0, frequency_penalty=2.0)
    assert Sampler().sample(x, [freq], [None], histories=[([], [0])]) == [1]


def test_rows_without_penalties_are_bit_identical_and_the_input_is_not_modified():
    x = logits_batch(4, seed=11)
    before = x.clone()
    params = [Sampling(temperature=0.0), Sampling(temperature=0.0, repetition_penalty=3.0),
              Sampling(temperature=0.9, seed=4), Sampling(temperature=0.0, presence_penalty=2.0)]
    histories = [None] + random_histories(3, VOCAB, seed=2)
    histories[2] = None
    got = apply_penalties(x, params, histories)
    assert torch.equal(x, before)
    assert torch.equal(got[0], x[0]) and torch.equal(got[2], x[2])
    assert not torch.equal(got[1], x[1]) and not torch.equal(got[3], x[3])
    batched = Sampler().sample(x, params, [None, None, make_generator(4), None], histories)
    assert torch.equal(x, before)
    assert batched[0] == int(x[0].argmax())
    assert batched[2] == Sampler().sample(x[2:3], [params[2]], [make_generator(4)])[0]
    no_penalties = [Sampling(temperature=0.0)] * 4
    assert apply_penalties(x, no_penalties, None) is x
    assert Sampler().sample(x, no_penalties, [None] * 4, histories=None) == x.argmax(-1).tolist()


def test_batched_and_single_row_penalties_agree():
    x = logits_batch(5, seed=21)
    params = [Sampling(temperature=0.0, repetition_penalty=1.0 + i / 2, frequency_penalty=0.3 * i - 0.6,
                             presence_penalty=-0.4 * i + 0.8) for i in range(5)]
    histories = [random_histories(1, VOCAB, seed=30 + i, prompt_len=3 * i, output_len=7 - i)[0] for i in range(5)]
    batched = apply_penalties(x, params, histories)
    for i in range(5):
        alone = apply_penalties(x[i:i + 1], [params[i]], [histories[i]])
        assert torch.equal(batched[i:i + 1], alone)
    assert torch.equal(batched, reference_penalties(x, params, histories))
    column_major = x.t().contiguous().t()  # same values, transposed strides
    assert torch.equal(apply_penalties(column_major, params, histories), batched)
    tokens = Sampler().sample(x, params, [None] * 5, histories)
    assert tokens == [Sampler().sample(x[i:i + 1], [params[i]], [None], [histories[i]])[0] for i in range(5)]


def test_histories_may_be_tensors_and_tuples():
    x = logits_batch(1, seed=8)
    p = Sampling(repetition_penalty=1.7, frequency_penalty=0.2)
    as_lists = apply_penalties(x, [p], [([1, 2, 3], [3, 4, 4])])
    assert torch.equal(as_lists, apply_penalties(x, [p], [((1, 2, 3), torch.tensor([3, 4, 4]))]))


def test_penalties_without_a_history_are_a_caller_bug():
    x = logits_batch(2)
    params = [Sampling(temperature=0.0), Sampling(temperature=0.0, frequency_penalty=1.0)]
    with pytest.raises(ValueError, match="histor"):
        Sampler().sample(x, params, [None, None])
    with pytest.raises(ValueError, match="histor"):
        Sampler().sample(x, params, [None, None], histories=[([1], [2]), None])
    with pytest.raises(ValueError, match="histor"):
        Sampler().sample(x, params, [None, None], histories=[None])
    with pytest.raises(ValueError, match="vocabulary"):
        Sampler().sample(x, params, [None, None], histories=[None, ([], [VOCAB])])
    with pytest.raises(ValueError, match="vocabulary"):
        apply_penalties(x, [Sampling(repetition_penalty=2.0)] * 2, [([-1], []), ([], [])])


@settings(max_examples=50, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(vocab=st.integers(2, 40), rows=st.integers(1, 4), data=st.data())
def test_penalties_never_make_nan_and_greedy_picks_the_penalised_argmax(vocab, rows, data):
    logit = st.floats(-1e4, 1e4, width=32, allow_subnormal=False)
    x = torch.tensor(data.draw(st.lists(st.lists(logit, min_size=vocab, max_size=vocab), min_size=rows,
                                        max_size=rows)), dtype=torch.float32)  # [rows, vocab]
    params, histories = [], []
    for _ in range(rows):
        params.append(Sampling(
            temperature=0.0,
            presence_penalty=data.draw(st.floats(-2, 2) | st.just(0.0)),
            frequency_penalty=data.draw(st.floats(-2, 2) | st.just(0.0)),
            repetition_penalty=data.draw(st.floats(0.01, 10) | st.just(1.0))).validate())
        ids = st.lists(st.integers(0, vocab - 1), max_size=20)
        histories.append((data.draw(ids), data.draw(ids)))
    penalised = apply_penalties(x, params, histories)
    assert not torch.isnan(penalised).any()
    assert torch.equal(penalised, reference_penalties(x, params, histories))
    assert Sampler().sample(x, params, [None] * rows, histories) == penalised.argmax(-1).tolist()


# ---------------------------------------------------------------- log-probabilities

def test_token_logprobs_match_log_softmax_and_topk_order():
    x = logits_batch(4, seed=13)
    chosen = [5, 17, 999, 0]
    got = token_logprobs(x, chosen, [5, None, 0, 20])
    reference = torch.log_softmax(x.float(), dim=-1)
    assert got[1] is None
    for i in (0, 2, 3):
        r = got[i]
        assert isinstance(r, TokenLogprob)
        assert r.token_id == chosen[i]
        assert r.logprob == pytest.approx(float(reference[i, chosen[i]]), abs=1e-6)
        values, indices = torch.topk(reference[i], 20)
        n = [5, None, 0, 20][i]
        assert [t for t, _ in r.top] == indices[:n].tolist()
        assert [v for _, v in r.top] == pytest.approx(values[:n].tolist(), abs=1e-6)
        assert all(a[1] >= b[1] for a, b in zip(r.top, r.top[1:]))
    assert got[2].top == ()
    assert math.isclose(float(reference[0].exp().sum()), 1.0, rel_tol=1e-5)


def test_token_logprobs_are_from_the_raw_logits_and_sum_to_one():
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    (r,) = token_logprobs(x, [1], [4])
    assert sum(math.exp(v) for _, v in r.top) == pytest.approx(1.0, abs=1e-6)
    assert r.logprob == pytest.approx(1.0 - math.log(sum(math.exp(v) for v in (2.0, 1.0, 0.0, -1.0))), abs=1e-6)
    assert [t for t, _ in r.top] == [0, 1, 2, 3]
    (wide,) = token_logprobs(x, [0], [20])  # more than the vocabulary: all of it
    assert len(wide.top) == 4


def test_token_logprobs_break_ties_by_lower_id():
    x = torch.zeros(2, 64)
    x[1, 40] = 1.0
    got = token_logprobs(x, [3, 40], [5, 4])
    assert [t for t, _ in got[0].top] == [0, 1, 2, 3, 4]
    assert [t for t, _ in got[1].top] == [40, 0, 1, 2]
    assert got[0].logprob == pytest.approx(-math.log(64), abs=1e-6)


def test_token_logprobs_without_requests_compute_nothing_and_bad_input_is_rejected():
    x = logits_batch(3)
    assert token_logprobs(x, [1, 2, 3], [None] * 3) == [None] * 3
    with pytest.raises(ValueError):
        token_logprobs(x, [1, 2], [1, 1])
    with pytest.raises(ValueError):
        token_logprobs(x, [1, 2, 3], [1, -1, 1])
    with pytest.raises(ValueError):
        token_logprobs(x, [1, 2, VOCAB], [1, 1, 1])


def test_prompt_logprobs_use_the_previous_position_and_start_with_none():
    x = logits_batch(6, seed=17)  # [T=6, vocab]
    prompt = [3, 9, 27, 81, 243, 729]
    got = prompt_logprobs(x, prompt, 2)
    assert len(got) == 6 and got[0] is None
    reference = torch.log_softmax(x, dim=-1)
    for i in range(1, 6):
        assert got[i].token_id == prompt[i]
        assert got[i].logprob == pytest.approx(float(reference[i - 1, prompt[i]]), abs=1e-6)
        assert [t for t, _ in got[i].top] == torch.topk(reference[i - 1], 2).indices.tolist()
    assert prompt_logprobs(x[:1], prompt[:1], 2) == [None]
    assert prompt_logprobs(x[:0], [], 2) == []
    with pytest.raises(ValueError):
        prompt_logprobs(x, prompt[:5], 2)


def test_logit_bias_bans_and_forces_tokens_greedy_or_sampled_and_leaves_other_rows_alone():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    best = int(logits[0].argmax())
    ban = Sampling(temperature=0.0, logit_bias_ids=(best,), logit_bias_values=(-100.0,))
    force = Sampling(temperature=1.0, seed=3, logit_bias_ids=(7,), logit_bias_values=(100.0,))
    plain = Sampling(temperature=0.0)
    before = logits.clone()
    tokens = Sampler().sample(logits, [ban, force, plain], [None, make_generator(3), None])
    assert tokens[0] != best and tokens[0] == int(logits[0].topk(2).indices[1])
    assert tokens[1] == 7 and tokens[2] == int(logits[2].argmax())
    assert torch.equal(logits, before)


@pytest.mark.parametrize("pair", [(5, 100.5), (-1, 1.0), (50, 1.0), (5, float("nan"))])
def test_out_of_range_logit_bias_is_rejected(pair):
    with pytest.raises(InvalidRequestError) as info:
        Sampling(logit_bias_ids=(pair[0],), logit_bias_values=(pair[1],)).validate(vocab_size=50)
    assert info.value.param == "logit_bias"
