"""Sampler behaviour on synthetic logits (no model needed)."""
from __future__ import annotations

import pytest
import torch

from gpu.sampling import Sampler, SamplingParams, make_generator
from pdserve.errors import InvalidRequestError

VOCAB = 1000


def logits_batch(b: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_temperature_zero_is_argmax():
    x = logits_batch()
    params = [SamplingParams(temperature=0.0)] * 4
    assert Sampler().sample(x, params, [None] * 4) == x.argmax(-1).tolist()
    tiny = [SamplingParams(temperature=1e-6, seed=1)] * 4
    assert Sampler().sample(x, tiny, [make_generator(1)] * 4) == x.argmax(-1).tolist()


def test_the_same_seed_gives_the_same_tokens():
    x = logits_batch()
    p = SamplingParams(temperature=1.0, seed=1234)

    def run():
        gens = [make_generator(p.seed) for _ in range(4)]
        return [Sampler().sample(x, [p] * 4, gens) for _ in range(20)]

    first, second = run(), run()
    assert first == second
    assert len({t for step in first for t in step}) > 4  # it really samples, not argmax


def test_a_seeded_row_does_not_depend_on_its_batch_neighbours():
    x = logits_batch(3)
    seeded = SamplingParams(temperature=0.8, seed=7)
    alone = Sampler().sample(x[1:2], [seeded], [make_generator(7)])
    g = make_generator(7)
    batched = Sampler().sample(x, [SamplingParams(temperature=0.0), seeded, SamplingParams(seed=None)],
                               [None, g, None])
    assert batched[1] == alone[0]


def test_top_k_one_is_greedy():
    x = logits_batch()
    params = [SamplingParams(temperature=1.5, top_k=1, seed=i) for i in range(4)]
    gens = [make_generator(i) for i in range(4)]
    for _ in range(10):
        assert Sampler().sample(x, params, gens) == x.argmax(-1).tolist()


def test_tiny_top_p_is_greedy():
    x = logits_batch()
    params = [SamplingParams(temperature=1.0, top_p=1e-6, seed=i) for i in range(4)]
    gens = [make_generator(i) for i in range(4)]
    for _ in range(10):
        assert Sampler().sample(x, params, gens) == x.argmax(-1).tolist()


def test_min_p_one_is_greedy():
    x = logits_batch()
    params = [SamplingParams(temperature=1.0, min_p=1.0, seed=i) for i in range(4)]
    assert Sampler().sample(x, params, [make_generator(i) for i in range(4)]) == x.argmax(-1).tolist()


def test_top_k_only_draws_from_the_k_best():
    x = logits_batch(1)
    best3 = set(torch.topk(x[0], 3).indices.tolist())
    p = SamplingParams(temperature=5.0, top_k=3, seed=3)
    g = make_generator(3)
    drawn = {Sampler().sample(x, [p], [g])[0] for _ in range(200)}
    assert drawn <= best3 and len(drawn) > 1


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probabilities 0.5, 0.3, 0.2: top_p=0.6 keeps the first two (0.5 < 0.6 <= 0.8).
    x = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    p = SamplingParams(temperature=1.0, top_p=0.6, seed=0)
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
])
def test_out_of_range_values_are_rejected_naming_the_field(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value}).validate()
    assert e.value.param == field


def test_defaults_and_edge_values_are_valid():
    SamplingParams().validate()
    SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, seed=0, max_tokens=1).validate()
    SamplingParams(top_k=0, min_p=1.0, seed=2**63 - 1, stop_token_ids=(0, 5), ignore_eos=True).validate()
    with pytest.raises(InvalidRequestError):
        SamplingParams(stop_token_ids=(50000,)).validate(vocab_size=49152)


def test_mismatched_batch_sizes_are_a_caller_bug():
    with pytest.raises(ValueError):
        Sampler().sample(logits_batch(2), [SamplingParams()], [None])
