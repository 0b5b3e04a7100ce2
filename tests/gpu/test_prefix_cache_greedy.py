"""Greedy output with the prefix cache equals greedy output without it, on the real model and a NaN-filled pool
(a slot read before it was written poisons the logits): the prefill actor's path (CachingAllocator.acquire with the
actor's row copy of a hit ending mid-block, packed prefill forwards from the cached prefix on, commit, release)
driven in process, against the same path with the cache off. Cases: the same prompt again (reused to its last token
but one), a shared prefix ending mid-block, one ending inside a cached full block and one ending on a block
boundary, a chunk boundary inside the computed part, and a cache evicted under pressure in a small pool."""
from __future__ import annotations

import functools
import math

import pytest
import torch

from actors.model_runner import copy_block_rows
from actors.prefix_cache import CachingAllocator
from gpu.model import kv_pool_shape
from tests.actors.fakes import FakeAllocator

BT = 16
NEW_TOKENS = 6


def greedy_through(model, kv, alloc: CachingAllocator, prompt: list[int], slot: int, chunk_tokens: int = 128):
    """Prefill ``prompt`` as the prefill actor does (only the tokens after the cached prefix), then decode
    greedily into the request's own blocks. Returns (tokens, cached prompt tokens)."""
    p = alloc.acquire(prompt, slot)
    extra = alloc.allocate(math.ceil((len(prompt) + NEW_TOKENS) / BT) - len(p.blocks), slot)
    logits = None
    for start in range(p.cached_tokens, len(prompt), chunk_tokens):   # one chunk per forward, as the actor runs it
        [logits] = model.prefill_packed(kv, [prompt[start:start + chunk_tokens]], [p.blocks], [start])
    alloc.commit(p)
    table, out, pos = p.blocks + extra, [], len(prompt)
    while len(out) < NEW_TOKENS:
        out.append(int(logits.argmax()))
        logits = model.decode(kv, [out[-1]], [pos], [table])[0]
        pos += 1
    alloc.release(p)
    alloc.free(extra, slot)
    return out, p.cached_tokens


_REFERENCES: dict[tuple, list[int]] = {}


def reference(model, prompt: list[int]) -> list[int]:
    """Greedy tokens with the cache off (memoized: the machine is slow and the tests share prompts)."""
    if tuple(prompt) not in _REFERENCES:
        kv = torch.full(kv_pool_shape(model.config, 16, BT), float("nan"), dtype=model.dtype)
        alloc = CachingAllocator(FakeAllocator(16, BT), enabled=False)
        _REFERENCES[tuple(prompt)] = greedy_through(model, kv, alloc, prompt, 0)[0]
    return _REFERENCES[tuple(prompt)]


@pytest.fixture(scope="module")
def prompt(tok) -> list[int]:
    ids = tok.encode("In computer science, a hash table is a data structure that maps keys to values. It uses a "
                     "hash function to compute an index into an array of buckets, from which the desired value can be "
                     "found. During lookup, the key is hashed and the resulting hash")
    assert 50 < len(ids) < 64
    return ids


def test_greedy_output_with_the_prefix_cache_equals_greedy_output_without_it(model, prompt):
    kv = torch.full(kv_pool_shape(model.config, 32, BT), float("nan"), dtype=model.dtype)
    alloc = CachingAllocator(FakeAllocator(32, BT), copy_rows=functools.partial(copy_block_rows, kv))
    other = [t + 7 for t in prompt[:20]]
    cases = [   # (what, prompt, cached tokens expected, prefill chunk tokens)
        ("cold", prompt, 0, 128),
        ("the same prompt again", prompt, len(prompt) - 1, 128),
        ("a shared prefix ending mid-block, computed in chunks of 5", prompt[:37] + other, 37, 5),
        ("a prefix ending inside a cached full block", prompt[:45], 44, 128),
        ("a shared prefix ending on a block boundary", prompt[:32] + other, 32, 128),
    ]
    for name, ids, cached, chunk_tokens in cases:
        tokens, got_cached = greedy_through(model, kv, alloc, ids, slot=1, chunk_tokens=chunk_tokens)
        assert got_cached == cached, name
        assert tokens == reference(model, ids), name


def test_greedy_output_is_unchanged_after_the_cache_was_evicted_under_pressure(model, prompt):
    blocks = math.ceil((len(prompt) + NEW_TOKENS) / BT)   # one request at a time fits, two prompts' caches do not
    kv = torch.full(kv_pool_shape(model.config, blocks + 1, BT), float("nan"), dtype=model.dtype)
    alloc = CachingAllocator(FakeAllocator(blocks + 1, BT), copy_rows=functools.partial(copy_block_rows, kv))
    first, _ = greedy_through(model, kv, alloc, prompt, slot=1)
    unrelated = [t + 11 for t in prompt]
    greedy_through(model, kv, alloc, unrelated, slot=2)
    assert alloc.evicted_blocks > 0
    again, cached = greedy_through(model, kv, alloc, prompt, slot=3)
    assert cached < len(prompt) - 1, "nothing of the first prompt was evicted"
    assert again == first == reference(model, prompt)
