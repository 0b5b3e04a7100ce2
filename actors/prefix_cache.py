"""Prefix cache of a prefill pool: full blocks of prompt KV kept after their request ends, found again by a
hash chain over the block's tokens (vLLM's automatic prefix caching, "block-hash chain"; the design and why
it was chosen over a radix tree are in docs/architecture.md, "Prefix cache").

Plain synchronous code, no shm, torch or clock. ``PrefixCache`` is the bookkeeping (key -> block, reference
counts, least-recently-used order); ``CachingAllocator`` puts it in front of a block allocator (the KVPool,
or any AllocatorPort) and is what the prefill core (actors/prefill_core.py) allocates prompt blocks through.

A block's key is ``blake2b(parent key + its tokens as int32 bytes)``, 128 bits, the first block's parent
being empty: equal keys mean equal token prefixes up to the block's end (a collision is ~2**-64 likely at
2**32 blocks), and the KV of a token depends only on the tokens up to it, so one cached block serves every
prompt that starts with the same tokens. Only full blocks are cached; the partial last block of a prompt
stays the request's own.
"""
from __future__ import annotations

import collections
import hashlib
import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from pdserve.errors import KVBlockStateError, OutOfKVBlocksError

CACHE_OWNER = 2**31 - 1   # owner slot of cached blocks in the pool's owner array (no state-table slot is this)


def block_keys(token_ids: Sequence[int], block_tokens: int) -> list[bytes]:
    """The chain key of every full block of ``token_ids`` (``len // block_tokens`` of them, 16 bytes each)."""
    ids = np.asarray(token_ids, dtype="<i4")
    keys, parent = [], b""
    for start in range(0, len(ids) - block_tokens + 1, block_tokens):
        parent = hashlib.blake2b(parent + ids[start:start + block_tokens].tobytes(), digest_size=16).digest()
        keys.append(parent)
    return keys


@dataclass
class CachedBlock:
    block_id: int
    key: bytes
    refs: int = 0   # requests holding the block now; 0 = evictable


class PrefixCache:
    """Cached blocks by key and by block id, with reference counts; blocks no request holds wait in
    least-recently-released order (``evictable``) to be evicted first.

    ``listener`` (None, or an object with ``cached(block_id, key)`` and ``evicted(block_id)``, e.g. an
    ipc/cache_summary.py ``SummaryWriter``) is told of every block that enters or leaves the cache."""

    def __init__(self, listener=None) -> None:
        self.by_key: dict[bytes, CachedBlock] = {}
        self.by_block: dict[int, CachedBlock] = {}
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()   # oldest first
        self.listener = listener

    def __len__(self) -> int:
        return len(self.by_key)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.by_block

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """Block ids of the longest run of ``keys`` from the first that are all cached (references unchanged)."""
        out = []
        for key in keys:
            entry = self.by_key.get(key)
            if entry is None:
                break
            out.append(entry.block_id)
        return out

    def refs(self, block_id: int) -> int:
        return self.by_block[block_id].refs

    def ref(self, block_ids: Iterable[int]) -> None:
        """One more request holds each block (it leaves the evictable list)."""
        for b in block_ids:
            entry = self.by_block[b]
            entry.refs += 1
            self.evictable.pop(b, None)

    def unref(self, block_ids: Iterable[int]) -> None:
        """One request fewer holds each block; a block nobody holds joins the evictable list at its newest end,
        in the order given (give a prompt's blocks tail first: its tail is then evicted before its head).
        Raises KVBlockStateError for a block not cached or not held."""
        for b in block_ids:
            entry = self.by_block.get(b)
            if entry is None or entry.refs <= 0:
                raise KVBlockStateError(f"prefix cache: unref of block {b}, which "
                                        f"{'is not cached' if entry is None else 'no request holds'} (a bug)")
            entry.refs -= 1
            if entry.refs == 0:
                self.evictable[b] = None

    def insert(self, key: bytes, block_id: int) -> bool:
        """Cache ``block_id`` under ``key``, held by its inserting request (refs 1). False (nothing changes) if
        ``key`` is cached already (another request computed the same tokens first)."""
        if key in self.by_key:
            return False
        if block_id in self.by_block:
            raise KVBlockStateError(f"prefix cache: block {block_id} is cached already under another key (a bug)")
        entry = CachedBlock(block_id, key, refs=1)
        self.by_key[key] = entry
        self.by_block[block_id] = entry
        if self.listener is not None:
            self.listener.cached(block_id, key)
        return True

    def evict(self, n: int) -> list[int]:
        """Drop the ``n`` least recently released blocks nobody holds; returns their ids (the caller frees them).
        Raises ValueError if fewer than ``n`` are evictable."""
        if n > len(self.evictable):
            raise ValueError(f"evict({n}): only {len(self.evictable)} cached blocks are evictable")
        out = []
        for _ in range(n):
            b, _ = self.evictable.popitem(last=False)
            entry = self.by_block.pop(b)
            del self.by_key[entry.key]
            if self.listener is not None:
                self.listener.evicted(b)
            out.append(b)
        return out

    def clear_evictable(self) -> list[int]:
        return self.evict(len(self.evictable))


@dataclass
class PromptBlocks:
    """A prompt's blocks in the pool, in position order: ``blocks[i]`` holds positions ``i * block_tokens ..``.
    The first ``cached_tokens // block_tokens`` came from the cache (their KV is there already); ``in_cache[i]``
    says whether block ``i`` is a cached one (shared, reference-counted) or the request's own."""

    blocks: list[int]
    owner_slot: int
    cached_tokens: int
    keys: list[bytes]
    in_cache: list[bool]
    released: bool = field(default=False)


class CachingAllocator:
    """An AllocatorPort (actors/ports.py) over ``base`` (a KVPool, or any allocator with ``allocate``,
    ``free``, ``num_free``, ``num_blocks``, ``block_tokens`` and ``reassign``) with a prefix cache in front.

    Cached blocks belong to ``CACHE_OWNER`` in ``base``. ``num_free`` counts the evictable cached blocks as
    free (they are, on demand): ``allocate`` evicts least-recently-released cached blocks when ``base`` runs
    out. Prompts go through ``acquire`` (reuse the longest cached prefix, allocate the rest), ``commit`` (after
    the forward pass: cache its newly computed full blocks) and ``release`` (exactly once per acquire).
    ``enabled=False``: no lookups and nothing cached; ``acquire`` is a plain allocation.

    Counters (monotonic): ``query_tokens`` (prompt tokens looked up), ``hit_tokens`` (of them found cached),
    ``evicted_blocks``.
    """

    def __init__(self, base, *, enabled: bool = True):
        self.base = base
        self.enabled = enabled
        self.block_tokens = base.block_tokens
        self.cache = PrefixCache()
        self.query_tokens = self.hit_tokens = self.evicted_blocks = 0

    @property
    def num_blocks(self) -> int:
        return self.base.num_blocks

    @property
    def num_free(self) -> int:
        return self.base.num_free + len(self.cache.evictable)

    @property
    def cached_blocks(self) -> int:
        return len(self.cache)

    @property
    def cached_blocks_in_use(self) -> int:
        return len(self.cache) - len(self.cache.evictable)

    def allocate(self, n: int, owner_slot: int) -> list[int]:
        """``n`` blocks for ``owner_slot``, evicting cached blocks nobody holds if ``base`` has too few free.
        All or nothing: raises OutOfKVBlocksError (evicting nothing) if even that is not enough."""
        if n > self.num_free:
            raise OutOfKVBlocksError(f"asked for {n} KV blocks, {self.num_free} of {self.num_blocks} free (cached "
                                     f"blocks nobody holds included); keep the request waiting until blocks are freed")
        self._make_room(n)
        return self.base.allocate(n, owner_slot)

    def free(self, block_ids: Iterable[int], owner_slot: int) -> int:
        return self.base.free(block_ids, owner_slot)

    def acquire(self, prompt_ids: Sequence[int], owner_slot: int, *, use_cache: bool = True) -> PromptBlocks:
        """Blocks for a prompt of ``len(prompt_ids)`` tokens: its longest cached prefix of full blocks (at most
        ``(len - 1) // block_tokens`` of them, so the last token is always computed and gives logits), then
        newly allocated ones. ``use_cache=False`` skips the lookup (a request that needs every position's
        logits) but still lets ``commit`` cache its blocks. Raises OutOfKVBlocksError (holding nothing)."""
        bt = self.block_tokens
        total = math.ceil(len(prompt_ids) / bt)
        keys = block_keys(prompt_ids, bt) if self.enabled else []
        hit = self.cache.match(keys[:(len(prompt_ids) - 1) // bt]) if self.enabled and use_cache else []
        need = total - len(hit)
        idle_hits = sum(1 for b in hit if self.cache.refs(b) == 0)
        if need > self.num_free - idle_hits:
            raise OutOfKVBlocksError(f"a prompt of {len(prompt_ids)} tokens needs {need} new KV blocks "
                                     f"({len(hit)} cached), {self.num_free - idle_hits} of {self.num_blocks} free; "
                                     f"keep the request waiting until blocks are freed")
        self.cache.ref(hit)
        self._make_room(need)
        new = self.base.allocate(need, owner_slot)
        if self.enabled and use_cache:
            self.query_tokens += len(prompt_ids)
            self.hit_tokens += len(hit) * bt
        return PromptBlocks(hit + new, owner_slot, len(hit) * bt, keys, [True] * len(hit) + [False] * need)

    def commit(self, prompt: PromptBlocks) -> int:
        """The prompt's KV is computed: cache each of its full blocks whose key is not cached yet (the block
        moves to CACHE_OWNER; this request holds one reference). Returns how many blocks it cached."""
        added = 0
        for i, key in enumerate(prompt.keys):
            block = prompt.blocks[i]
            if not prompt.in_cache[i] and self.cache.insert(key, block):
                self.base.reassign([block], prompt.owner_slot, CACHE_OWNER)
                prompt.in_cache[i] = True
                added += 1
        return added

    def release(self, prompt: PromptBlocks) -> None:
        """The request no longer needs the prompt's blocks: drop its references to cached ones (tail first into
        the evictable order) and free its own. Raises KVBlockStateError on a second release."""
        if prompt.released:
            raise KVBlockStateError(f"prompt blocks of slot {prompt.owner_slot} released twice (a bug)")
        prompt.released = True
        shared = [b for b, c in zip(prompt.blocks, prompt.in_cache) if c]
        own = [b for b, c in zip(prompt.blocks, prompt.in_cache) if not c]
        self.cache.unref(reversed(shared))
        if own:
            self.base.free(own, prompt.owner_slot)

    def clear(self) -> int:
        """Evict every cached block nobody holds (returns how many); held ones stay."""
        ids = self.cache.clear_evictable()
        if ids:
            self.base.free(ids, CACHE_OWNER)
        return len(ids)

    def _make_room(self, n: int) -> None:
        short = n - self.base.num_free
        if short > 0:
            self.base.free(self.cache.evict(short), CACHE_OWNER)
            self.evicted_blocks += short
