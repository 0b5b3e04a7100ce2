"""The router's choices (api/router.py) as plain functions over actor loads."""
from __future__ import annotations

import dataclasses

import pytest

from api.router import ActorLoad, Routed, pick_decode, pick_prefill, route, with_routed
from pdserve.errors import EngineOverloadedError


def prefill(index, queued=0, serving=True, cached=None):
    return ActorLoad(index, f"prefill{index}", serving, queued_prompt_tokens=queued,
                     cached_prefix_tokens=(lambda ids: cached) if cached is not None else None)


def decode(index, free=64, running=0, serving=True):
    return ActorLoad(index, f"decode{index}", serving, running=running, kv_blocks_free=free, block_tokens=16)


def test_prefill_goes_to_the_fewest_queued_prompt_tokens_then_the_lowest_index():
    assert pick_prefill([prefill(0, 500), prefill(1, 20), prefill(2, 20)], [1, 2, 3]).index == 1


def test_a_longer_cached_prefix_beats_a_shorter_queue():
    assert pick_prefill([prefill(0, 0, cached=0), prefill(1, 900, cached=64)], list(range(80))).index == 1


def test_a_cached_prefix_wins_only_while_its_actors_queue_is_within_the_imbalance_bound():
    prompt = list(range(80))
    assert pick_prefill([prefill(0, 0, cached=0), prefill(1, 500, cached=64)], prompt, 500).index == 1
    assert pick_prefill([prefill(0, 0, cached=0), prefill(1, 501, cached=64)], prompt, 500).index == 0


def test_past_the_bound_the_longest_cached_prefix_among_the_actors_within_it_wins():
    """A hot prefix: prefill 0 caches the most of it but is far behind; prefill 2 caches some and is within the
    bound of the idle prefill 1, so it wins over the idle one."""
    actors = [prefill(0, 3000, cached=96), prefill(1, 0, cached=0), prefill(2, 100, cached=32)]
    assert pick_prefill(actors, list(range(100)), 2048).index == 2
    assert pick_prefill(actors, list(range(100)), None).index == 0   # no bound: the cache alone


def test_a_bound_of_0_lets_the_cache_break_ties_of_load_only():
    assert pick_prefill([prefill(0, 0, cached=0), prefill(1, 0, cached=32)], list(range(40)), 0).index == 1
    assert pick_prefill([prefill(0, 0, cached=0), prefill(1, 1, cached=32)], list(range(40)), 0).index == 0


def test_decode_goes_to_the_most_free_blocks_then_the_fewest_running():
    assert pick_decode([decode(0, 10), decode(1, 40, running=9), decode(2, 40, running=2)], 20, 10).index == 2


def test_a_full_decode_pool_is_skipped_while_another_has_room():
    assert pick_decode([decode(0, free=1, running=0), decode(1, free=2, running=30)], 10, 10).index == 1


def test_when_no_pool_fits_the_request_waits_on_the_one_with_the_most_room():
    assert pick_decode([decode(0, free=1), decode(1, free=2)], 100, 100).index == 1


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_no_serving_actor_is_a_retryable_503(role):
    actors = [prefill(0, serving=False)] if role == "prefill" else [decode(0, serving=False)]
    with pytest.raises(EngineOverloadedError) as info:
        pick_prefill(actors, [1]) if role == "prefill" else pick_decode(actors, 1, 1)
    assert info.value.http_status == 503 and "retry" in str(info.value)


def test_hung_or_draining_actors_get_no_work_even_when_idle():
    assert pick_prefill([prefill(0, 0, serving=False), prefill(1, 10_000)], [1]).index == 1
    assert pick_decode([decode(0, free=500, serving=False), decode(1, free=5, running=30)], 10, 10).index == 1


def test_colocated_routes_to_a_decode_actor_only():
    chosen = route([], [decode(0), decode(1, free=100)], [1, 2, 3], 8)
    assert chosen.prefill is None and chosen.decode == 1


def test_blocks_reserved_by_requests_routed_but_not_yet_pulled_count_against_their_decode_actor():
    """Decode 0 reports more free blocks, but a request routed there (not yet prefilled) will reserve 30 of them:
    the next request goes to decode 1. Once its first token came the actor's own count shows the reservation
    (nothing subtracted twice); its prompt tokens count on its prefill actor's queue until then."""
    table = [decode(0, free=50), decode(1, free=40)]
    pending = Routed(prefill=0, decode=0, prompt_tokens=300, reserve_blocks=30, prefilled=False)
    assert pick_decode(with_routed(table, []), 20, 10).index == 0
    loads = with_routed(table, [pending])
    assert [a.kv_blocks_free for a in loads] == [20, 40] and pick_decode(loads, 20, 10).index == 1
    assert [a.running for a in loads] == [1, 0]
    reserved = [decode(0, free=20), decode(1, free=40)]   # the table after decode 0 reserved them
    assert [a.kv_blocks_free for a in with_routed(reserved, [dataclasses.replace(pending, prefilled=True)])] == \
        [20, 40]
    queues = with_routed([prefill(0, 100), prefill(1, 250)], [pending])
    assert [a.queued_prompt_tokens for a in queues] == [400, 250] and pick_prefill(queues, [1]).index == 1
