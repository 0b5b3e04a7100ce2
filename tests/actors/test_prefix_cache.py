"""The prefix cache (actors/prefix_cache.py) as plain code: chain keys, longest-prefix reuse, reference counts,
least-recently-released eviction, and a property test against a model that tracks what each block holds."""
from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from actors.prefix_cache import CACHE_OWNER, CachingAllocator, block_keys
from pdserve.errors import KVBlockStateError, OutOfKVBlocksError
from tests.actors.fakes import FakeAllocator

BT = 4   # tokens per block in these tests


def cache(num_blocks: int = 16) -> CachingAllocator:
    return CachingAllocator(FakeAllocator(num_blocks, block_tokens=BT))


def test_chain_keys_cover_full_blocks_and_depend_on_everything_before():
    a = block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], BT)
    b = block_keys([1, 2, 3, 4, 5, 6, 7, 8], BT)
    c = block_keys([0, 2, 3, 4, 5, 6, 7, 8], BT)
    assert len(a) == 2 and a == b   # the partial third block has no key
    assert c[0] != a[0] and c[1] != a[1]   # same second block's tokens, other prefix: another key
    assert block_keys([5, 6, 7, 8], BT)[0] != a[1]


def test_a_second_prompt_reuses_the_first_ones_full_blocks_and_computes_the_rest():
    alloc = cache()
    first = alloc.acquire(list(range(10)), owner_slot=0)            # blocks: 4 + 4 + 2 tokens
    assert first.cached_tokens == 0 and len(first.blocks) == 3
    assert alloc.commit(first) == 2                                  # the two full blocks
    alloc.release(first)
    assert alloc.cached_blocks == 2 and alloc.num_free == 16         # cached blocks nobody holds count as free
    second = alloc.acquire(list(range(9)) + [99, 98], owner_slot=1)   # shares 9 tokens: 2 full blocks
    assert second.cached_tokens == 8 and second.blocks[:2] == first.blocks[:2]
    assert alloc.cache.refs(second.blocks[0]) == 1 and alloc.cached_blocks_in_use == 2
    assert (alloc.query_tokens, alloc.hit_tokens) == (10 + 11, 8)


def test_a_prompt_fully_cached_still_computes_its_last_block_so_there_are_logits():
    alloc = cache()
    prompt = list(range(8))
    first = alloc.acquire(prompt, 0)
    alloc.commit(first)
    alloc.release(first)
    again = alloc.acquire(prompt, 1)
    assert again.cached_tokens == 4 and again.in_cache == [True, False]   # block 2 recomputed into its own block
    assert alloc.commit(again) == 0                                        # its key is cached already
    alloc.release(again)
    assert alloc.base.num_free == 16 - 2 and alloc.num_free == 16


def test_a_commit_of_fewer_tokens_keeps_the_rest_of_the_prompt_out_of_the_cache():
    """``commit(prompt, tokens)`` (the prompt's last token ran as a decode step): a full block past ``tokens`` is
    filed as a partial block of its leading rows, so a longer prompt reuses all but that token, to the row."""
    copies = []
    alloc = CachingAllocator(FakeAllocator(16, block_tokens=BT), copy_rows=lambda s, d, r: copies.append((s, d, r)))
    first = alloc.acquire(list(range(8)), 0)   # two full blocks; its last token's KV must not be reused
    assert alloc.commit(first, 7) == 2         # block 1 as a partial block of 3 rows
    alloc.release(first)
    longer = alloc.acquire(list(range(10)), 1)
    assert longer.cached_tokens == 7 and longer.blocks[0] == first.blocks[0]
    assert copies == [(first.blocks[1], longer.blocks[1], 3)]
    alloc.commit(longer, 9)                    # blocks 1 (full now) and 2 (one row of two) join the cache
    alloc.release(longer)
    third = alloc.acquire(list(range(12)), 2)
    assert third.cached_tokens == 9 and third.blocks[:2] == longer.blocks[:2]   # the partial tail row: copied
    alloc.release(third)


def test_eviction_takes_the_least_recently_released_tail_first_and_only_blocks_nobody_holds():
    alloc = cache(num_blocks=6)
    a = alloc.acquire(list(range(12)), 0)        # 3 full blocks
    alloc.commit(a)
    alloc.release(a)
    b = alloc.acquire([50 + t for t in range(8)], 1)   # 2 more
    alloc.commit(b)
    assert alloc.num_free == 6 - 2                # a's 3 evictable + 1 free
    own = alloc.allocate(2, owner_slot=7)         # needs one eviction: a's tail block goes first
    assert alloc.evicted_blocks == 1 and alloc.cache.match(block_keys(list(range(12)), BT)) == a.blocks[:2]
    with pytest.raises(OutOfKVBlocksError):
        alloc.allocate(3, owner_slot=7)           # b's blocks are held: only a's two are evictable
    assert alloc.evicted_blocks == 1, "a refused allocation evicted something"
    alloc.free(own, 7)
    alloc.release(b)
    assert alloc.clear() == 4 and alloc.base.num_free == 6


def test_a_refused_acquire_holds_nothing_and_a_double_release_is_a_bug():
    alloc = cache(num_blocks=3)
    a = alloc.acquire(list(range(8)), 0)
    alloc.commit(a)
    with pytest.raises(OutOfKVBlocksError):
        alloc.acquire(list(range(8)) + list(range(100, 108)), 1)   # 1 cached (held) + 3 new > 1 free
    assert alloc.cache.refs(a.blocks[0]) == 1
    alloc.release(a)
    with pytest.raises(KVBlockStateError):
        alloc.release(a)


def test_with_the_cache_off_nothing_is_looked_up_or_kept():
    alloc = CachingAllocator(FakeAllocator(8, block_tokens=BT), enabled=False)
    for slot in (0, 1):
        p = alloc.acquire(list(range(9)), slot)
        assert p.cached_tokens == 0 and alloc.commit(p) == 0
        alloc.release(p)
    assert alloc.cached_blocks == 0 and alloc.base.num_free == 8 and alloc.query_tokens == 0


def test_cached_blocks_belong_to_the_cache_owner_in_the_pool():
    base = FakeAllocator(8, block_tokens=BT)
    alloc = CachingAllocator(base)
    p = alloc.acquire(list(range(6)), 3)
    alloc.commit(p)
    assert [base.owner[b] for b in p.blocks] == [CACHE_OWNER, 3]


# ---- property test: what each block holds -----------------------------------------------------------------
prompts = st.lists(st.integers(0, 2), min_size=1, max_size=14)   # a tiny alphabet: many shared prefixes
ops = st.lists(st.tuples(st.sampled_from(["acquire", "finish", "abort"]), prompts, st.integers(0, 7)),
               max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, num_blocks=st.integers(4, 12))
def test_every_reused_block_holds_exactly_the_prompts_prefix_and_every_block_is_accounted_for(ops, num_blocks):
    """A model of the KV: each block remembers the token prefix it was computed for (KV depends on every token
    before). A request reading a cached block must find its own prefix there; no block a request holds is ever
    handed to another; after everything is released, every block is free or evictable."""
    base = FakeAllocator(num_blocks, block_tokens=BT)
    alloc = CachingAllocator(base)
    holds: dict[int, tuple] = {}     # block -> the token prefix (up to the block's end) its KV was computed for
    live: list = []                  # (prompt ids, PromptBlocks)
    owners_seen = {}
    for op, prompt, pick in ops:
        if op == "acquire":
            try:
                p = alloc.acquire(prompt, owner_slot=len(owners_seen))
            except OutOfKVBlocksError:
                assert alloc.num_free < -(-len(prompt) // BT)
                continue
            owners_seen[len(owners_seen)] = True
            held = {b for _, q in live for b in q.blocks}
            for i, b in enumerate(p.blocks):
                end = min((i + 1) * BT, len(prompt))
                if i < p.cached_tokens // BT:
                    assert holds[b] == tuple(prompt[:end]), "a cached block holds another prefix's KV"
                else:
                    assert b not in held, "a block some request holds was handed out again"
                    holds[b] = tuple(prompt[:end])   # the forward pass writes it
            assert p.cached_tokens < len(prompt)
            live.append((prompt, p))
        elif live:
            prompt, p = live.pop(pick % len(live))
            if op == "finish":
                alloc.commit(p)
            alloc.release(p)
        cached = set(alloc.cache.by_block)
        in_use = {b for _, q in live for b in q.blocks}
        assert base.num_free + len(cached) + len({b for b in in_use if b not in cached}) == num_blocks
        assert all(alloc.cache.refs(b) == sum(b in q.blocks for _, q in live) for b in cached)
        assert alloc.num_free == base.num_free + sum(1 for b in cached if alloc.cache.refs(b) == 0)
    for _, p in live:
        alloc.release(p)
    assert alloc.num_free == num_blocks and alloc.cached_blocks_in_use == 0
    alloc.clear()
    assert base.num_free == num_blocks


# ---- the rules one at a time (each of these was seen failing on a mutation of actors/prefix_cache.py) ------------
def test_an_acquire_whose_cached_prefix_is_idle_under_a_full_pool_waits_and_holds_nothing():
    """The hit blocks are evictable (counted in ``num_free``) but the prompt will hold them: they cannot also make
    room for its new blocks. Nothing free besides them: OutOfKVBlocksError (the request waits), no reference kept."""
    alloc = cache(num_blocks=4)
    prompt = list(range(10))                     # 2 full blocks + 1 partial
    first = alloc.acquire(prompt, 0)
    alloc.commit(first)
    alloc.release(first)                         # 2 cached blocks nobody holds, 2 free
    other = alloc.allocate(2, owner_slot=9)      # the 2 free ones: only the idle cached blocks are left
    assert alloc.num_free == 2
    with pytest.raises(OutOfKVBlocksError):
        alloc.acquire(prompt, 1)                 # hits 2 idle blocks, needs 1 more: nothing to evict but its own
    assert [alloc.cache.refs(b) for b in first.blocks[:2]] == [0, 0] and alloc.num_free == 2
    alloc.free(other, 9)
    again = alloc.acquire(prompt, 1)             # room now: the same prefix reused
    assert again.cached_tokens == 8 and again.blocks[:2] == first.blocks[:2]
    alloc.release(again)
    assert alloc.num_free == 4 and alloc.cached_blocks_in_use == 0


@pytest.mark.parametrize("second_holder", ["hit", "insert"], ids=["held-by-a-hit", "still-held-by-its-committer"])
def test_a_cached_block_is_never_evicted_while_a_request_holds_it(second_holder):
    """Two requests hold the same cached blocks; the first lets go; a third prompt needs every block it can get.
    The blocks still held are not evicted (not handed out again), and the holder's release leaves them evictable."""
    alloc = cache(num_blocks=6)
    prompt = list(range(10))                     # 2 full blocks cached + 1 partial
    a = alloc.acquire(prompt, 0)
    alloc.commit(a)
    if second_holder == "hit":                   # b reuses a's blocks while a still holds them; a leaves
        b = alloc.acquire(prompt, 1)
        assert alloc.cache.refs(a.blocks[0]) == 2
        alloc.release(a)
    else:                                        # a leaves first, b takes the idle blocks (ref) again
        alloc.release(a)
        b = alloc.acquire(prompt, 1)
    shared = b.blocks[:2]
    assert b.cached_tokens == 8 and shared == a.blocks[:2] and all(alloc.cache.refs(x) == 1 for x in shared)
    assert alloc.num_free == 6 - 3               # b holds 2 cached + 1 own; nothing is evictable
    with pytest.raises(OutOfKVBlocksError):
        alloc.allocate(4, owner_slot=7)          # would need one of b's blocks
    third = alloc.allocate(3, owner_slot=7)
    assert not set(third) & set(b.blocks) and alloc.evicted_blocks <= 1
    assert alloc.cache.match(block_keys(prompt, BT)) == shared   # b's prefix still cached where b reads it
    alloc.release(b)
    alloc.free(third, 7)
    assert alloc.num_free == 6 and alloc.cached_blocks_in_use == 0


# ---- token-granular hits: a hit may end mid-block (the cached rows are copied into the request's own block) -----
class RowPool:
    """A model of the pool's KV, row by row: ``rows[block][r]`` is the token prefix whose last token's KV row ``r``
    of ``block`` holds (KV depends on every token up to it), None = never written. ``copy`` is the allocator's
    ``copy_rows`` port and checks it never writes into a cached block."""

    def __init__(self, num_blocks: int):
        self.base = FakeAllocator(num_blocks, block_tokens=BT)
        self.alloc = CachingAllocator(self.base, copy_rows=self.copy)
        self.rows = {b: [None] * BT for b in range(num_blocks)}
        self.copies: list[tuple[int, int, int]] = []

    def copy(self, src: int, dst: int, rows: int) -> None:
        assert src in self.alloc.cache and dst not in self.alloc.cache, "copied into a cached block"
        assert 0 < rows < BT + 1 and self.alloc.cache.refs(src) > 0, "copied from a block nobody holds"
        self.rows[dst][:rows] = self.rows[src][:rows]
        self.copies.append((src, dst, rows))

    def prefill(self, prompt: list[int], p) -> None:
        """Check the cached part holds the prompt's own prefix, then 'compute' the rest into the own blocks."""
        for pos in range(len(prompt)):
            b, r = p.blocks[pos // BT], pos % BT
            if pos < p.cached_tokens:
                assert self.rows[b][r] == tuple(prompt[:pos + 1]), f"position {pos} reused another prefix's KV"
            else:
                assert not p.in_cache[pos // BT], "a forward pass would write into a cached block"
                self.rows[b][r] = tuple(prompt[:pos + 1])

    def run(self, prompt: list[int], slot: int = 0, commit: bool = True):
        p = self.alloc.acquire(prompt, slot)
        self.prefill(prompt, p)
        if commit:
            self.alloc.commit(p)
        self.alloc.release(p)
        return p


def test_a_repeated_prompt_reuses_its_partial_last_block_to_the_token_and_computes_only_its_last_token():
    pool = RowPool(16)
    first = pool.run(list(range(10)))                    # 4 + 4 + 2 tokens: the 2-token block is cached too
    assert pool.alloc.cached_blocks == 3 and pool.alloc.cache.by_block[first.blocks[2]].key is None
    again = pool.alloc.acquire(list(range(10)), 1)
    assert (again.cached_tokens, again.copied_rows) == (9, 1)   # token 9 is computed: there are logits
    assert pool.copies == [(first.blocks[2], again.blocks[2], 1)] and again.in_cache == [True, True, False]
    assert pool.alloc.cache.refs(first.blocks[2]) == 0, "the copy's source stays held after the copy"
    assert (pool.alloc.query_tokens, pool.alloc.hit_tokens) == (20, 9)
    pool.prefill(list(range(10)), again)
    assert pool.alloc.commit(again) == 0                 # its partial block is cached already: it stays its own
    pool.alloc.release(again)
    assert pool.base.num_free == 16 - 3 and pool.alloc.num_free == 16


def test_a_hit_may_end_inside_a_cached_full_block_or_where_the_prompt_diverges_mid_block():
    pool = RowPool(16)
    a = list(range(12))
    pool.run(a)                                         # 3 full blocks
    p = pool.run(a[:10] + [99, 98])                     # diverges at token 10, inside block 2
    assert (p.cached_tokens, p.copied_rows) == (10, 2)
    p = pool.run(a[:7])                                 # ends inside block 1: rows 4, 5 copied, token 6 computed
    assert (p.cached_tokens, p.copied_rows) == (6, 2)
    p = pool.run(a)                                     # ends on a block boundary: 3 rows of block 2, not 0
    assert (p.cached_tokens, p.copied_rows) == (11, 3)
    p = pool.run([0, 1, 5])                             # the first block's rows are found too (parent b"")
    assert (p.cached_tokens, p.copied_rows) == (2, 2)
    p = pool.run([7, 7, 7])                             # nothing shared
    assert (p.cached_tokens, p.copied_rows) == (0, 0)
    assert pool.alloc.hit_tokens == 10 + 6 + 11 + 2


def test_the_cached_block_sharing_the_most_leading_tokens_is_the_one_copied():
    pool = RowPool(16)
    x = pool.run(list(range(4)) + [10, 11, 12])          # block 1 cached as a partial: 10 11 12
    y = pool.run(list(range(4)) + [10, 20])              # another partial after the same parent: 10 20
    p = pool.alloc.acquire(list(range(4)) + [10, 11, 99, 5], 2)
    assert (p.cached_tokens, pool.copies[-1]) == (6, (x.blocks[1], p.blocks[1], 2))
    pool.alloc.release(p)
    p = pool.alloc.acquire(list(range(4)) + [10, 20, 30], 2)
    assert (p.cached_tokens, pool.copies[-1]) == (6, (y.blocks[1], p.blocks[1], 2))
    pool.alloc.release(p)


def test_the_copy_source_is_not_evicted_for_its_own_copy_its_rows_are_computed_instead_of_waiting():
    pool = RowPool(4)
    prompt = list(range(6))                              # 1 full block + a 2-token partial one, both cached
    first = pool.run(prompt)
    other = pool.alloc.allocate(2, owner_slot=9)         # left: the two idle cached blocks
    squeezed = pool.alloc.acquire(prompt, 1)             # holds block 0; no room to keep block 1 for a copy
    assert (squeezed.cached_tokens, squeezed.copied_rows, pool.copies) == (4, 0, [])
    assert squeezed.blocks[0] == first.blocks[0] and pool.alloc.cached_blocks == 1   # block 1 became its own
    pool.prefill(prompt, squeezed)
    pool.alloc.commit(squeezed)
    pool.alloc.release(squeezed)
    pool.alloc.free(other[:1], 9)
    again = pool.alloc.acquire(prompt, 1)                # one truly free block: the copy's destination
    assert (again.cached_tokens, pool.copies) == (5, [(squeezed.blocks[1], again.blocks[1], 1)])
    pool.alloc.release(again)
    pool.alloc.free(other[1:], 9)
    assert pool.alloc.num_free == 4 and pool.alloc.cached_blocks_in_use == 0


def test_a_prompt_of_every_block_is_served_though_a_cached_block_shares_its_first_tokens():
    """A prompt as long as the pool (each block its own, nothing to share but the first rows of a cached partial
    block) waited for room to keep that block for the copy, which it could never have, until its queue timeout,
    and every request behind it with it."""
    pool = RowPool(4)
    pool.run([0, 1, 2])                                  # a cached partial block: 0 1 2
    whole = [0, 1] + list(range(50, 64))                 # 16 tokens = 4 blocks: the whole pool
    p = pool.alloc.acquire(whole, 1)
    assert (p.cached_tokens, p.copied_rows, pool.copies, pool.alloc.num_free) == (0, 0, [], 0)
    pool.prefill(whole, p)
    pool.alloc.release(p)
    other = pool.alloc.allocate(1, owner_slot=9)
    with pytest.raises(OutOfKVBlocksError):              # truly too few blocks: refused, holding nothing
        pool.alloc.acquire(whole, 1)
    pool.alloc.free(other, 9)
    assert pool.alloc.num_free == 4 and pool.alloc.cached_blocks_in_use == 0


def test_a_failed_copy_holds_nothing():
    pool = RowPool(8)
    pool.run(list(range(6)))

    def broken(src, dst, rows):
        raise RuntimeError("device error")

    pool.alloc.copy_rows = broken
    with pytest.raises(RuntimeError):
        pool.alloc.acquire(list(range(6)), 1)
    assert pool.alloc.cached_blocks_in_use == 0 and pool.base.num_free == 8 - 2 and pool.alloc.num_free == 8


def test_without_a_copy_port_hits_end_on_block_boundaries_and_partial_blocks_stay_the_requests_own():
    alloc = cache()
    p = alloc.acquire(list(range(10)), 0)
    assert alloc.commit(p) == 2
    alloc.release(p)
    again = alloc.acquire(list(range(10)), 1)
    assert again.cached_tokens == 8 and again.copied_rows == 0
    alloc.release(again)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, num_blocks=st.integers(4, 12))
def test_every_reused_row_holds_exactly_the_prompts_prefix_and_no_reference_outlives_its_request(ops, num_blocks):
    """The row-level model (``RowPool``) under random acquires, finishes and aborts (release without commit): every
    reused row, in a cached block or copied, holds the prompt's own prefix; nothing writes into a cached block; a
    cached block's references are exactly the live requests listing it (a copy's source is held by nobody after
    it); after every release each block is free or evictable."""
    pool = RowPool(num_blocks)
    alloc = pool.alloc
    live: list = []
    for slot, (op, prompt, pick) in enumerate(ops):
        if op == "acquire":
            try:
                p = alloc.acquire(prompt, owner_slot=slot)
            except OutOfKVBlocksError:
                continue
            held = {b for _, q in live for b in q.blocks}
            assert not {b for b, c in zip(p.blocks, p.in_cache) if not c} & held, "a held block handed out again"
            assert p.cached_tokens < len(prompt)
            pool.prefill(prompt, p)
            live.append((prompt, p))
        elif live:
            prompt, p = live.pop(pick % len(live))
            if op == "finish":
                alloc.commit(p)
            alloc.release(p)
        cached = set(alloc.cache.by_block)
        assert all(alloc.cache.refs(b) == sum(b in q.blocks for _, q in live) for b in cached)
        in_use = {b for _, q in live for b in q.blocks}
        assert pool.base.num_free + len(cached) + len(in_use - cached) == num_blocks
    for _, p in live:
        alloc.release(p)
    assert alloc.num_free == num_blocks and alloc.cached_blocks_in_use == 0
    alloc.clear()
    assert pool.base.num_free == num_blocks and not alloc.cache.children and not alloc.cache.by_key


# ---- adopt: a finished sequence (prompt + answer) handed back from decode ---------------------------------------
def test_adopt_copies_only_the_blocks_after_the_cached_prefix_and_never_evicts_that_prefix_for_them():
    base = FakeAllocator(3)
    c = CachingAllocator(base, copy_rows=lambda s, d, r: None)
    prompt = list(range(1, 33))   # two full blocks, cached by its prefill
    c.commit(p := c.acquire(prompt, 1))
    c.release(p)
    assert c.cached_blocks == 2 and c.num_free == 3
    copies = []
    answered = prompt + list(range(100, 120))   # 52 tokens: 2 cached blocks + a full one + a partial one to copy
    # room for 2 copies only by evicting the very prefix they extend: refused, the prefix stays
    assert c.adopt(answered, [10, 11, 12, 13], 7, copy=lambda s, d: copies.append((s, d)) or True) is None
    assert not copies and len(c.cache.match(block_keys(prompt, 16))) == 2
    assert base.num_free == 1 and c.cached_blocks_in_use == 0
    shorter = prompt + list(range(100, 110))   # 42 tokens: only the partial third block to copy
    assert c.adopt(shorter, [10, 11, 12], 7, copy=lambda s, d: copies.append((s, d)) or True) == 1
    assert copies == [([12], [b for b, o in base.owner.items() if o == CACHE_OWNER and b not in p.blocks[:2]])]
    keys = block_keys(shorter, 16)
    assert len(c.cache.match(keys)) == 2 and c.cache.match_rows(keys[1], shorter[32:])[1] == 10
    assert c.adopted_blocks == 1 and c.cached_blocks_in_use == 0


def test_adopt_caches_nothing_when_the_source_changed_under_the_copy():
    base = FakeAllocator(8)
    c = CachingAllocator(base, copy_rows=lambda s, d, r: None)
    assert c.adopt(list(range(40)), [3, 4, 5], 9, copy=lambda s, d: False) is None
    assert c.cached_blocks == 0 and base.num_free == 8 and c.adopted_blocks == 0
