"""The prefix-cache summary (ipc/cache_summary.py): what a prefill actor's cache holds, read by another process."""
from __future__ import annotations

import pytest

import ipc_children as kids
from actors.prefix_cache import PrefixCache, block_keys
from ipc.cache_summary import CacheSummary, key_words

pytestmark = pytest.mark.timeout(60)
BT = 4   # tokens per block


@pytest.fixture
def summary(name):
    s = CacheSummary.create(name("cachesum"), num_actors=2, slots=16)
    try:
        yield s
    finally:
        s.close()
        s.unlink()


def prompt(*blocks: int) -> list[int]:
    """A prompt of whole blocks: block value v is the tokens v, v, v, v."""
    return [v for v in blocks for _ in range(BT)]


def run_actor(ctx, summary, index, prompts) -> int:
    done = ctx.Event()
    p = ctx.Process(target=kids.cs_prefill_actor, args=(summary.name, index, prompts, BT, done))
    p.start()
    try:
        assert done.wait(30)
    finally:
        assert kids.join_all([p]) == [0]
    return p.pid


def test_a_reader_counts_the_leading_run_of_a_prompts_blocks_another_process_cached(summary, ctx):
    pid = run_actor(ctx, summary, 1, [prompt(1, 2, 3)])
    reader = CacheSummary.attach(summary.name, readonly=True)
    try:
        assert reader.writer_pid(1) == pid and reader.num_cached(1) == 3 and reader.changes(1) == 4   # clear + 3
        assert reader.cached_blocks(1, block_keys(prompt(1, 2, 3, 4, 5), BT), pid) == 3
        assert reader.cached_blocks(1, block_keys(prompt(1, 2, 9), BT), pid) == 2   # parts after block 2
        assert reader.cached_blocks(1, block_keys(prompt(2, 3), BT), pid) == 0      # a chain: not a prefix
        assert reader.cached_blocks(0, block_keys(prompt(1, 2, 3), BT)) == 0        # the other actor's region
        assert reader.cached_blocks(1, [], pid) == 0
        with pytest.raises(PermissionError):
            reader.writer(1)
    finally:
        reader.close()


def test_a_restarted_actor_clears_its_region_and_a_predecessors_pid_reads_as_nothing(summary, ctx):
    old = run_actor(ctx, summary, 0, [prompt(1, 2, 3)])
    keys = block_keys(prompt(1, 2, 3), BT)
    assert summary.cached_blocks(0, keys, old) == 3
    new = run_actor(ctx, summary, 0, [prompt(7)])   # the restart: an empty cache, then one block
    assert summary.writer_pid(0) == new != old
    assert summary.cached_blocks(0, keys, new) == 0 and summary.cached_blocks(0, keys, old) == 0
    assert summary.cached_blocks(0, block_keys(prompt(7), BT), new) == 1 and summary.num_cached(0) == 1


@pytest.mark.parametrize("first", [0, 1])
def test_eviction_empties_the_blocks_slot_and_a_prefix_ends_at_its_first_missing_block(summary, first):
    writer = summary.writer(0)
    writer.clear()
    cache = PrefixCache(listener=writer)
    keys = block_keys(prompt(1, 2), BT)
    for block, key in enumerate(keys):
        cache.insert(key, block)
    cache.unref([first, 1 - first])   # the first given is the first evicted
    assert cache.evict(1) == [first]
    assert summary.num_cached(0) == 1
    assert summary.cached_blocks(0, keys) == (1 if first == 1 else 0)   # block 1 alone is no prefix
    cache.evict(1)
    assert summary.cached_blocks(0, keys) == 0 and summary.num_cached(0) == 0


def test_key_words_are_the_keys_first_8_bytes_and_never_0():
    assert key_words([bytes(range(16)), bytes(16)]).tolist() == [int.from_bytes(bytes(range(8)), "little"), 1]
    with pytest.raises(ValueError):
        key_words([b"short"])


def test_sizes_out_of_range_are_refused(name):
    with pytest.raises(ValueError):
        CacheSummary.create(name("cs0"), num_actors=0, slots=4)
    with pytest.raises(ValueError):
        CacheSummary.create(name("cs1"), num_actors=1, slots=0)
