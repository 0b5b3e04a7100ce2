"""Prefix cache of a prefill pool: blocks of prompt KV kept after their request ends, found again by a hash chain
over the full blocks' tokens (vLLM's automatic prefix caching, "block-hash chain"), then token by token inside the
next block (a hit may end mid-block; the design and why it was chosen over a radix tree are in
docs/architecture.md, "Prefix cache").

Plain synchronous code, no shm, torch or clock. ``PrefixCache`` is the bookkeeping (key -> block, reference
counts, least-recently-used order); ``CachingAllocator`` puts it in front of a block allocator (the KVPool,
or any AllocatorPort) and is what the prefill core (actors/prefill_core.py) allocates prompt blocks through.

A block's key is ``blake2b(parent key + its tokens as int32 bytes)``, 128 bits, the first block's parent
being empty: equal keys mean equal token prefixes up to the block's end (a collision is ~2**-64 likely at
2**32 blocks), and the KV of a token depends only on the tokens up to it, so one cached block serves every
prompt that starts with the same tokens. A prompt's partial last block is cached too, with no key: every cached
block is also filed under its parent's key and its first token, and after the longest chain of full-block hits
``acquire`` looks there for the cached block sharing the most leading tokens with the prompt's next block, and has
the shell copy those rows into the request's own new block (``copy_rows``; a cached block is never written).
"""
from __future__ import annotations

import collections
import hashlib
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np

from pdserve.errors import KVBlockStateError, OutOfKVBlocksError

CACHE_OWNER = 2**31 - 1   # owner slot of cached blocks in the pool's owner array (no state-table slot is this)
HANDBACK_OWNER = 2**31 - 2   # owner slot of a finished sequence's blocks a decode pool keeps for a hand-back


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
    key: bytes | None   # chain key of a full block; None: a partial block (found through its parent only)
    refs: int = 0   # requests holding the block now; 0 = evictable
    parent: bytes = b""   # the chain key of the block before it (b"": the prompt's first block)
    tokens: tuple[int, ...] = ()   # its tokens (block_tokens of them when full); () = not filed under its parent


class PrefixCache:
    """Cached blocks by key (full blocks), by block id, and by (parent key, first token) (every block cached with
    its tokens, full or partial), with reference counts; blocks no request holds wait in least-recently-released
    order (``evictable``) to be evicted first.

    ``listener`` (None, or an object with ``cached(block_id, key)`` and ``evicted(block_id)``, e.g. an
    ipc/cache_summary.py ``SummaryWriter``) is told of every block that enters or leaves the cache."""

    def __init__(self, listener=None) -> None:
        self.by_key: dict[bytes, CachedBlock] = {}
        self.by_block: dict[int, CachedBlock] = {}
        self.children: dict[tuple[bytes, int], dict[int, CachedBlock]] = {}   # (parent key, first token) -> blocks
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()   # oldest first
        self.listener = listener

    def __len__(self) -> int:
        return len(self.by_block)

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

    def match_rows(self, parent: bytes, tokens: Sequence[int]) -> tuple[int, int]:
        """``(block id, rows)``: of the cached blocks after ``parent`` (a chain key, b"" for a prompt's first
        block), the one whose leading tokens match the most leading ``tokens`` (at most ``len(tokens)``), and how
        many match; ``(-1, 0)`` if none matches even the first. References unchanged."""
        if not tokens:
            return -1, 0
        best, rows = -1, 0
        for entry in self.children.get((parent, int(tokens[0])), {}).values():
            n = 1
            for a, b in zip(entry.tokens[1:], tokens[1:]):
                if a != b:
                    break
                n += 1
            if n > rows:
                best, rows = entry.block_id, n
        return best, rows

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

    def insert(self, key: bytes, block_id: int, parent: bytes = b"", tokens: Sequence[int] = ()) -> bool:
        """Cache full block ``block_id`` under ``key``, held by its inserting request (refs 1), and file it under
        ``parent`` (the previous block's key) and its ``tokens`` (if given) for ``match_rows``. False (nothing
        changes) if ``key`` is cached already (another request computed the same tokens first)."""
        if key in self.by_key:
            return False
        entry = self._add(CachedBlock(block_id, key, 1, parent, tuple(int(t) for t in tokens)))
        self.by_key[key] = entry
        if self.listener is not None:
            self.listener.cached(block_id, key)
        return True

    def insert_partial(self, parent: bytes, tokens: Sequence[int], block_id: int) -> bool:
        """Cache ``block_id``, a prompt's last block holding only ``tokens`` (1 .. block_tokens - 1 of them) after
        the block keyed ``parent``, held by its inserting request (refs 1); found by ``match_rows`` only. False
        (nothing changes) if a block cached after ``parent`` starts with those tokens already."""
        tokens = tuple(int(t) for t in tokens)
        if not tokens:
            raise ValueError("insert_partial: a partial block holds at least one token")
        if self.match_rows(parent, tokens)[1] == len(tokens):
            return False
        self._add(CachedBlock(block_id, None, 1, parent, tokens))
        return True

    def _add(self, entry: CachedBlock) -> CachedBlock:
        if entry.block_id in self.by_block:
            raise KVBlockStateError(f"prefix cache: block {entry.block_id} is cached already (a bug)")
        self.by_block[entry.block_id] = entry
        if entry.tokens:
            self.children.setdefault((entry.parent, entry.tokens[0]), {})[entry.block_id] = entry
        return entry

    def evict(self, n: int) -> list[int]:
        """Drop the ``n`` least recently released blocks nobody holds; returns their ids (the caller frees them).
        Raises ValueError if fewer than ``n`` are evictable."""
        if n > len(self.evictable):
            raise ValueError(f"evict({n}): only {len(self.evictable)} cached blocks are evictable")
        out = []
        for _ in range(n):
            b, _ = self.evictable.popitem(last=False)
            entry = self.by_block.pop(b)
            if entry.key is not None:
                del self.by_key[entry.key]
                if self.listener is not None:   # the summary holds keyed (full) blocks only
                    self.listener.evicted(b)
            if entry.tokens:
                siblings = self.children[(entry.parent, entry.tokens[0])]
                del siblings[b]
                if not siblings:
                    del self.children[(entry.parent, entry.tokens[0])]
            out.append(b)
        return out

    def clear_evictable(self) -> list[int]:
        return self.evict(len(self.evictable))


@dataclass
class PromptBlocks:
    """A prompt's blocks in the pool, in position order: ``blocks[i]`` holds positions ``i * block_tokens ..``.
    Its first ``cached_tokens`` tokens' KV is there already: the first ``cached_tokens // block_tokens`` blocks
    came from the cache, and the next (the request's own) got its first ``copied_rows`` rows copied from a cached
    block (``cached_tokens % block_tokens`` of them). ``in_cache[i]`` says whether block ``i`` is a cached one
    (shared, reference-counted) or the request's own. ``token_ids``: the prompt (``commit`` files its blocks)."""

    blocks: list[int]
    owner_slot: int
    cached_tokens: int
    keys: list[bytes]
    in_cache: list[bool]
    token_ids: Sequence[int] = ()
    copied_rows: int = 0
    released: bool = field(default=False)


class CachingAllocator:
    """An AllocatorPort (actors/ports.py) over ``base`` (a KVPool, or any allocator with ``allocate``,
    ``free``, ``num_free``, ``num_blocks``, ``block_tokens`` and ``reassign``) with a prefix cache in front.

    Cached blocks belong to ``CACHE_OWNER`` in ``base``. ``num_free`` counts the evictable cached blocks as
    free (they are, on demand): ``allocate`` evicts least-recently-released cached blocks when ``base`` runs
    out. Prompts go through ``acquire`` (reuse the longest cached prefix, allocate the rest), ``commit`` (after
    the forward pass: cache its newly computed blocks) and ``release`` (exactly once per acquire).
    ``enabled=False``: no lookups and nothing cached; ``acquire`` is a plain allocation.

    ``copy_rows(src_block, dst_block, rows)``: the pool's copy of a block's first ``rows`` token rows (every
    layer, K and V) into another block (actors/model_runner.copy_block_rows), called inside ``acquire``; a hit
    may then end mid-block and prompts' partial last blocks are cached. None: hits end on block boundaries.

    Finished sequences come in through ``adopt`` (cross-turn reuse: a decode actor hands back the blocks of a
    prompt and its answer, docs/architecture.md, "Cross-turn reuse").

    Counters (monotonic): ``query_tokens`` (prompt tokens looked up), ``hit_tokens`` (of them found cached,
    copied rows included), ``evicted_blocks``, ``adopted_blocks`` (blocks ``adopt`` cached).
    """

    def __init__(self, base, *, enabled: bool = True, copy_rows: Callable[[int, int, int], None] | None = None):
        self.base = base
        self.enabled = enabled
        self.copy_rows = copy_rows
        self.block_tokens = base.block_tokens
        self.cache = PrefixCache()
        self.query_tokens = self.hit_tokens = self.evicted_blocks = self.adopted_blocks = 0

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

    def reassign(self, block_ids: Iterable[int], owner_slot: int, new_owner_slot: int) -> None:
        self.base.reassign(block_ids, owner_slot, new_owner_slot)

    def generations(self, block_ids: Iterable[int]) -> list[int]:
        """The base pool's generation of each block (ipc/kv_pool.py ``KVPool.generations``)."""
        return self.base.generations(block_ids)

    def acquire(self, prompt_ids: Sequence[int], owner_slot: int, *, use_cache: bool = True) -> PromptBlocks:
        """Blocks for a prompt of ``len(prompt_ids)`` tokens: its longest cached prefix of full blocks (at most
        ``(len - 1) // block_tokens`` of them), then newly allocated ones, the first of which gets the rows of the
        cached block after that prefix that share the most leading tokens with the prompt (with ``copy_rows``; at
        most up to the prompt's last token, so the last token is always computed and gives logits; not when
        keeping that block, idle, would leave too few free blocks: its rows are computed instead).
        ``use_cache=False`` skips the lookup (a request that needs every position's logits) but still lets
        ``commit`` cache its blocks. Raises OutOfKVBlocksError (holding nothing)."""
        bt, n = self.block_tokens, len(prompt_ids)
        total = math.ceil(n / bt)
        lookup = self.enabled and use_cache
        keys = block_keys(prompt_ids, bt) if self.enabled else []
        hit = self.cache.match(keys[:(n - 1) // bt]) if lookup else []
        src, rows = -1, 0
        if lookup and self.copy_rows is not None:   # the next block: how many of its leading rows are cached
            start = len(hit) * bt
            src, rows = self.cache.match_rows(keys[len(hit) - 1] if hit else b"",
                                              prompt_ids[start:min(start + bt, n - 1)])
        need = total - len(hit)
        idle = sum(1 for b in hit if self.cache.refs(b) == 0)
        if rows and self.cache.refs(src) == 0 and need > self.num_free - idle - 1:
            src, rows = -1, 0   # only the copy's source stands in the way: compute its rows (a prompt of every block
            #                     would otherwise wait for room it can never have)
        held = hit + [src] if rows else hit   # the copy's source is held only until it is copied
        idle += int(bool(rows) and self.cache.refs(src) == 0)
        if need > self.num_free - idle:
            raise OutOfKVBlocksError(f"a prompt of {n} tokens needs {need} new KV blocks ({len(hit)} cached), "
                                     f"{self.num_free - idle} of {self.num_blocks} free; keep the request waiting "
                                     f"until blocks are freed")
        self.cache.ref(held)
        self._make_room(need)
        new = self.base.allocate(need, owner_slot)
        if rows:
            try:
                self.copy_rows(src, new[0], rows)
            except BaseException:
                self.cache.unref(reversed(held))
                self.base.free(new, owner_slot)
                raise
            self.cache.unref([src])
        cached = len(hit) * bt + rows
        if lookup:
            self.query_tokens += n
            self.hit_tokens += cached
        return PromptBlocks(hit + new, owner_slot, cached, keys, [True] * len(hit) + [False] * need,
                            prompt_ids, rows)

    def commit(self, prompt: PromptBlocks, tokens: int | None = None) -> int:
        """The prompt's KV is computed: cache each of its full blocks whose key is not cached yet, and (with
        ``copy_rows``) its partial last block unless a cached block after the same parent starts with its tokens
        (each block moves to CACHE_OWNER; this request holds one reference). ``tokens``: only the KV of the
        prompt's first ``tokens`` tokens may be reused (None: all of it); a full block past them is filed as a
        partial block of its leading tokens, and blocks wholly past them stay the request's. Returns how many
        blocks it cached."""
        added, bt, ids = 0, self.block_tokens, prompt.token_ids
        n = len(ids) if tokens is None else min(tokens, len(ids))
        full = n // bt   # the full blocks within the reusable tokens
        for i, key in enumerate(prompt.keys[:full]):
            block = prompt.blocks[i]
            if not prompt.in_cache[i] and self.cache.insert(key, block, prompt.keys[i - 1] if i else b"",
                                                            ids[i * bt:(i + 1) * bt]):
                self._to_cache(prompt, i)
                added += 1
        if (self.enabled and self.copy_rows is not None and n > full * bt and not prompt.in_cache[full]
                and self.cache.insert_partial(prompt.keys[full - 1] if full else b"", ids[full * bt:n],
                                              prompt.blocks[full])):
            self._to_cache(prompt, full)
            added += 1
        return added

    def _to_cache(self, prompt: PromptBlocks, i: int) -> None:
        self.base.reassign([prompt.blocks[i]], prompt.owner_slot, CACHE_OWNER)
        prompt.in_cache[i] = True

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

    def adopt(self, token_ids: Sequence[int], block_ids: Sequence[int], owner_slot: int,
              copy: Callable[[list[int], list[int]], bool] | None = None) -> int | None:
        """Cache a finished sequence: ``token_ids`` (n tokens) whose KV is in ``block_ids`` (``ceil(n /
        block_tokens)`` blocks, in position order), as ``commit`` caches a prompt; returns how many blocks it
        cached, or None if it cached nothing because the pool had no room or the copy failed.

        ``copy`` None: the blocks are this pool's, held by ``owner_slot``; each joins the cache or is freed
        (its key is cached already). ``copy(src_ids, dst_ids) -> bool``: the blocks are another pool's; the
        blocks after the longest cached prefix are copied into newly allocated ones (``owner_slot`` holds them
        meanwhile), which then join the cache; ``copy`` returns False when the source blocks changed under it
        (reallocated): their copies are freed, nothing is cached. Adopted blocks are evictable at once (no
        request holds them). Raises ValueError if ``block_ids`` cannot hold ``token_ids``."""
        bt, n = self.block_tokens, len(token_ids)
        if len(block_ids) != math.ceil(n / bt):
            raise ValueError(f"adopt: {n} tokens need {math.ceil(n / bt)} blocks of {bt}, got {len(block_ids)}")
        if not self.enabled or not n:
            if copy is None and block_ids:
                self.base.free(block_ids, owner_slot)
            return 0
        keys = block_keys(token_ids, bt)
        if copy is None:
            prompt = PromptBlocks(list(block_ids), owner_slot, 0, keys, [False] * len(block_ids), token_ids)
        else:
            hit = self.cache.match(keys)
            total = len(block_ids) if self.copy_rows is not None else len(keys)   # a partial block only with rows
            need = total - len(hit)
            if need <= 0:
                return 0
            self.cache.ref(hit)
            if need > self.num_free:
                self.cache.unref(reversed(hit))
                return None
            self._make_room(need)
            new = self.base.allocate(need, owner_slot)
            try:
                ok = copy(list(block_ids[len(hit):total]), new)
            except BaseException:
                self.cache.unref(reversed(hit))
                self.base.free(new, owner_slot)
                raise
            if not ok:
                self.cache.unref(reversed(hit))
                self.base.free(new, owner_slot)
                return None
            prompt = PromptBlocks(hit + new, owner_slot, len(hit) * bt, keys, [True] * len(hit) + [False] * need,
                                  token_ids)
        added = self.commit(prompt)
        self.release(prompt)
        self.adopted_blocks += added
        return added

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
