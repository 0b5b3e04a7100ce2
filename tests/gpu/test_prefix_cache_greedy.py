"""Greedy output with the prefix cache equals greedy output without it, on the real model (float32 and the default
native weights) and a NaN-filled pool (a slot read before it was written poisons the logits): the prefill actor's
path (CachingAllocator.acquire with the actor's row copy of a hit ending mid-block, model_runner.prefill_forward
from the cached prefix on, natively with the prompt's last token as a decode step, commit, release) driven in
process, against the same path with the cache off; the first token's logits must be the same bits. Cases: a
prompt extending a cached one (mid-block and on a block boundary: natively the cached one's last token was a
decode step, whose KV is not reused), the same prompt again (reused to its last token but one), a shared prefix
ending mid-block, one ending inside a cached full block and one ending on a block boundary, a chunk boundary inside
the computed part, and a cache evicted under pressure in a small pool. The rule that keeps a prompt's last token out
of the cache when it ran as a decode step is checked once more through the actor's own PrefillCore and
PrefillRunner.run (the cases above apply it themselves)."""
from __future__ import annotations

import functools
import math

import pytest
import torch

from actors.model_runner import copy_block_rows, prefill_forward
from actors.prefix_cache import CachingAllocator
from actors.shell import configure_model, prefills_low_bit
from gpu.model import LlamaModel, kv_pool_shape
from pdserve.config import load_config
from tests.actors.fakes import FakeAllocator

BT = 16
NEW_TOKENS = 6


def greedy_through(model, kv, alloc: CachingAllocator, prompt: list[int], slot: int, chunk_tokens: int = 128):
    """Prefill ``prompt`` as the prefill actor does (only the tokens after the cached prefix), then decode
    greedily into the request's own blocks. Returns (tokens, cached prompt tokens, the first token's logits)."""
    p = alloc.acquire(prompt, slot)
    extra = alloc.allocate(math.ceil((len(prompt) + NEW_TOKENS) / BT) - len(p.blocks), slot)
    logits = by_decode = None
    for start in range(p.cached_tokens, len(prompt), chunk_tokens):   # one chunk per forward, as the actor runs it
        [(logits, by_decode)] = prefill_forward(model, kv, [(prompt, start, min(start + chunk_tokens, len(prompt)),
                                                              p.blocks, False)])
    alloc.commit(p, len(prompt) - 1 if by_decode else None)
    first, table, out, pos = logits.clone(), p.blocks + extra, [], len(prompt)
    while len(out) < NEW_TOKENS:
        out.append(int(logits.argmax()))
        logits = model.decode(kv, [out[-1]], [pos], [table])[0]
        pos += 1
    alloc.release(p)
    alloc.free(extra, slot)
    return out, p.cached_tokens, first


_REFERENCES: dict[tuple, tuple] = {}


def reference(model, prompt: list[int]) -> tuple:
    """Greedy tokens and first logits with the cache off (memoized: the machine is slow and the tests share
    prompts)."""
    key = (model.native, model.dense_min_tokens, tuple(prompt))
    if key not in _REFERENCES:
        kv = torch.full(kv_pool_shape(model.config, 16, BT), float("nan"), dtype=model.dtype)
        alloc = CachingAllocator(FakeAllocator(16, BT), enabled=False)
        tokens, _, first = greedy_through(model, kv, alloc, prompt, 0)
        _REFERENCES[key] = tokens, first
    return _REFERENCES[key]


@pytest.fixture(scope="module")
def native(gguf_path):
    return LlamaModel.from_path(gguf_path, progress=False, weights="auto")


@pytest.fixture(scope="module", params=["float32", "auto", "auto-low-bit-prefill"])
def any_model(request, model, native):
    """The float32 model (conftest) and the native one as the engine sets it up (actors/shell.configure_model):
    by default prefilling on its float32 copies, with ``--prefill-low-bit`` on its low-bit kernels; natively a
    prompt's last token runs as a decode step."""
    if request.param == "float32":
        return model
    flags = {"prefill_low_bit": "true"} if request.param == "auto-low-bit-prefill" else {}
    configure_model(native, load_config(flags, env={}).config)
    assert prefills_low_bit(native) == (request.param == "auto-low-bit-prefill")
    assert native.prompt_last_by_decode
    return native


@pytest.fixture(scope="module")
def prompt(tok) -> list[int]:
    ids = tok.encode("In computer science, a hash table is a data structure that maps keys to values. It uses a "
                     "hash function to compute an index into an array of buckets, from which the desired value can be "
                     "found. During lookup, the key is hashed and the resulting hash")
    assert 50 < len(ids) < 64
    return ids


def test_greedy_output_with_the_prefix_cache_equals_greedy_output_without_it(any_model, prompt):
    model = any_model
    kv = torch.full(kv_pool_shape(model.config, 32, BT), float("nan"), dtype=model.dtype)
    alloc = CachingAllocator(FakeAllocator(32, BT), copy_rows=functools.partial(copy_block_rows, kv))
    other = [t + 7 for t in prompt[:20]]
    boundary = [t + 3 for t in prompt[:32]]
    last = 1 if model.prompt_last_by_decode else 0   # the cached prompt's last token is not reused natively
    cases = [   # (what, prompt, cached tokens expected, prefill chunk tokens)
        ("cold", prompt[:40], 0, 128),
        ("a prompt extending a cached one", prompt, 40 - last, 128),
        ("cold, on a block boundary", boundary, 0, 128),
        ("a prompt extending a cached one that ends on a block boundary", boundary + other, 32 - last, 128),
        ("the same prompt again", prompt, len(prompt) - 1, 128),
        ("a shared prefix ending mid-block, computed in chunks of 5", prompt[:37] + other, 37, 5),
        ("a prefix ending inside a cached full block", prompt[:45], 44, 128),
        ("a shared prefix ending on a block boundary", prompt[:32] + other, 32, 128),
    ]
    for name, ids, cached, chunk_tokens in cases:
        tokens, got_cached, first = greedy_through(model, kv, alloc, ids, slot=1, chunk_tokens=chunk_tokens)
        assert got_cached == cached, name
        want_tokens, want_first = reference(model, ids)
        if model.native:   # the float32 path's SDPA sums a chunk's rows in an order that depends on the chunk
            assert torch.equal(first, want_first), name
        assert tokens == want_tokens, name


def test_greedy_output_is_unchanged_after_the_cache_was_evicted_under_pressure(any_model, prompt):
    model = any_model
    blocks = math.ceil((len(prompt) + NEW_TOKENS) / BT)   # one request at a time fits, two prompts' caches do not
    kv = torch.full(kv_pool_shape(model.config, blocks + 1, BT), float("nan"), dtype=model.dtype)
    alloc = CachingAllocator(FakeAllocator(blocks + 1, BT), copy_rows=functools.partial(copy_block_rows, kv))
    first, _, _ = greedy_through(model, kv, alloc, prompt, slot=1)
    unrelated = [t + 11 for t in prompt]
    greedy_through(model, kv, alloc, unrelated, slot=2)
    assert alloc.evicted_blocks > 0
    again, cached, _ = greedy_through(model, kv, alloc, prompt, slot=3)
    assert cached < len(prompt) - 1, "nothing of the first prompt was evicted"
    assert again == first == reference(model, prompt)[0]


def test_prefill_forward_gives_logits_only_where_a_prompt_ends(any_model, prompt):
    """A chunk before its prompt's end gets no logits (no LM head run for it); the prompt's end gets the same
    logits packed beside it as alone, and an echoing chunk every position's."""
    model = any_model
    kv = torch.full(kv_pool_shape(model.config, 16, BT), float("nan"), dtype=model.dtype)
    short = prompt[:9]
    (head, head_by_decode), (tail, tail_by_decode), (echo, _) = prefill_forward(model, kv, [
        (prompt, 0, 20, [0, 1, 2, 3], False), (short, 0, 9, [4], False), (short, 0, 9, [5], True)])
    assert head is None and not head_by_decode
    assert tail_by_decode == model.prompt_last_by_decode and tail.shape == (model.config.vocab_size,)
    assert echo.shape == (9, model.config.vocab_size)
    alone = torch.full(kv_pool_shape(model.config, 16, BT), float("nan"), dtype=model.dtype)
    [(tail_alone, _)] = prefill_forward(model, alone, [(short, 0, 9, [4], False)])
    if model.native:   # batch-invariant: the same bits
        assert torch.equal(tail, tail_alone)
    else:
        torch.testing.assert_close(tail, tail_alone, rtol=1e-4, atol=1e-4)


def test_more_prompts_than_one_last_token_step_holds_each_get_their_own_logits(native, prompt):
    """Natively the prompts' last tokens run in decode steps of at most LAST_TOKEN_ROWS rows: 18 prompts in one
    pass take two steps, and each prompt's logits are the bits it gets alone."""
    from actors.model_runner import LAST_TOKEN_ROWS

    configure_model(native, load_config({}, env={}).config)
    n = LAST_TOKEN_ROWS + 2
    prompts = [prompt[i:i + 3 + i % 4] for i in range(n)]
    kv = torch.full(kv_pool_shape(native.config, n + 1, BT), float("nan"), dtype=native.dtype)
    together = prefill_forward(native, kv, [(p, 0, len(p), [i], False) for i, p in enumerate(prompts)])
    assert all(by_decode for _, by_decode in together)
    for i in (0, LAST_TOKEN_ROWS - 1, LAST_TOKEN_ROWS, n - 1):
        alone = torch.full(kv_pool_shape(native.config, 2, BT), float("nan"), dtype=native.dtype)
        [(logits, _)] = prefill_forward(native, alone, [(prompts[i], 0, len(prompts[i]), [1], False)])
        assert torch.equal(together[i][0], logits), i


def test_the_prefill_runner_keeps_a_last_token_run_as_a_decode_step_out_of_the_prefix_cache(any_model, prompt):
    """The actor's own path, not a copy of its rule: PrefillCore plans the prompt, ``PrefillRunner.run`` runs it
    (natively the prompt's last token as a decode step, so that token's KV is not what a longer prompt's prefill
    computes) and finishes it, which commits the prompt to the cache; a prompt extending it then reuses all of it
    but that token natively, all of it with the float32 model."""
    from actors.messages import PrefillRequest, Sampling
    from actors.model_runner import PrefillRunner
    from actors.prefill_core import PrefillCore
    from gpu.sampling import Sampler
    from tests.actors.fakes import FakeClock, FakeTable, Outbox

    model = any_model
    kv = torch.full(kv_pool_shape(model.config, 32, BT), float("nan"), dtype=model.dtype)
    alloc = CachingAllocator(FakeAllocator(32, BT), copy_rows=functools.partial(copy_block_rows, kv))
    clock = FakeClock()
    table = FakeTable(clock)
    core = PrefillCore(table, alloc, Outbox(), clock, actor_index=0, chunk_tokens=16)
    runner = PrefillRunner(model, kv, Sampler(), core.outbox)
    short = prompt[:40]
    slot, generation = table.allocate("short", len(short))
    core.on_message(PrefillRequest(slot, generation, "short", short, Sampling(temperature=0.0, max_tokens=4), []))
    while core.has_work():
        runner.run(core, core.next_batch())
    assert not core.prefilling and (slot, generation) in core.inflight   # finished: handed to decode
    longer = alloc.acquire(prompt, 7)
    assert longer.cached_tokens == 40 - (1 if model.prompt_last_by_decode else 0)
    alloc.release(longer)
