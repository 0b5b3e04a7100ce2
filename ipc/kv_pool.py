"""KVPool: one actor's paged KV cache in one POSIX shm segment, and its block allocator.

Shared-memory layout of segment ``name`` (``HEADER`` below; little endian)::

    offset        size            field
    0             4               magic          b"PDKV"
    4             4               version        u4 = 1
    8             4               num_layers     u4
    12            4               num_blocks     u4
    16            4               block_tokens   u4  tokens per block
    20            4               num_kv_heads   u4
    24            4               head_dim       u4
    28            4               dtype_code     u4  DTYPE_CODES
    32            4               elem_bytes     u4
    36            4               epoch          u4  1 at create, +1 at every reset() (peers see a restart)
    40            8               meta_offset    u8  = HEADER_BYTES
    48            8               data_offset    u8  page (4096, hence 64-byte) aligned
    56            8               data_bytes     u8  0: a table without data (its data is a tensor)
    256           4*num_blocks    owner_slot     i4[num_blocks]  -1 = free, else the holder's state-table slot
    256+4*nb      4*num_blocks    generation     u4[num_blocks]  +1 at every allocate of that block
    data_offset   data_bytes      kv             dtype[num_layers, 2, num_blocks, block_tokens, num_kv_heads,
                                                        head_dim]   (axis 1: 0 = K, 1 = V)

Ownership: the process that creates the segment (the supervisor, or the actor itself) alone unlinks it.
Exactly one process at a time runs the allocator (the only writer of owner_slot and generation): the actor
that uses the pool, through a writable ``attach(name)`` (+ ``reset()`` after a restart; peers that mapped the
pool keep valid mappings and see ``epoch`` change). The creator's own instance must not allocate once an
actor has attached. Peers ``attach(name, readonly=True)`` to copy from it.

Allocator: a free-id stack in the owner's memory, rebuilt from owner_slot on a writable attach, so allocate
and free cost O(blocks asked), not O(pool). ``allocate`` returns block ids; ``generations(ids)`` gives the
generation of each, and a (block id, generation) pair whose generation no longer matches is stale.

torch is imported on the first ``tensor()`` or ``dtype`` only: the supervisor and the API create and read pools
without it.
"""
from __future__ import annotations

import struct
import warnings
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

from ipc import _shm
from pdserve.errors import KVBlockStateError, OutOfKVBlocksError

if TYPE_CHECKING:   # annotations only: torch is imported where a tensor is made
    import torch

MAGIC = b"PDKV"
VERSION = 1
HEADER_BYTES = 256
HEADER = struct.Struct("<4sIIIIIIIIIQQQ")
OFF_EPOCH = 36
U4 = struct.Struct("<I")
DATA_ALIGN = 4096

# dtype code -> (torch dtype name, numpy carrier dtype of the same width)
DTYPE_CODES: dict[int, tuple[str, np.dtype]] = {
    1: ("float32", np.dtype(np.float32)),
    2: ("float16", np.dtype(np.float16)),
    3: ("bfloat16", np.dtype(np.uint16)),
    4: ("float64", np.dtype(np.float64)),
    5: ("int8", np.dtype(np.int8)),
    6: ("uint8", np.dtype(np.uint8)),
}
_CODE_OF = {name: c for c, (name, _) in DTYPE_CODES.items()}


def dtype_name(dtype) -> str:
    """``"bfloat16"`` for ``torch.bfloat16`` or ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class BlockAllocator:
    """The allocator core: plain synchronous code over two arrays (shm views in KVPool, or plain arrays).

    ``owner``: int32[num_blocks], -1 = free; ``generation``: uint32[num_blocks]. Single writer: only one
    BlockAllocator may exist per pool, in the owning process.
    """

    def __init__(self, owner: np.ndarray, generation: np.ndarray):
        self._owner = owner
        self._gen = generation
        self._free: list[int] = np.flatnonzero(owner == -1)[::-1].tolist()  # stack: lowest id on top

    @property
    def num_blocks(self) -> int:
        return int(self._owner.shape[0])

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int, owner_slot: int) -> list[int]:
        """Hand ``n`` free blocks to ``owner_slot`` (>= 0), bumping each block's generation; returns the ids.

        All or nothing: raises OutOfKVBlocksError (allocating nothing) if fewer than ``n`` are free;
        ValueError for a negative ``n`` or ``owner_slot``.
        """
        if n < 0 or owner_slot < 0:
            raise ValueError(f"allocate(n={n}, owner_slot={owner_slot}): both must be >= 0")
        if n == 0:
            return []
        free = self._free
        if n > len(free):
            raise OutOfKVBlocksError(f"asked for {n} KV blocks, {len(free)} of {self.num_blocks} free; "
                                     f"keep the request waiting until blocks are freed")
        ids = free[-n:]
        del free[-n:]
        ids.reverse()
        idx = np.array(ids, dtype=np.int64)
        self._gen[idx] += np.uint32(1)  # wraps modulo 2**32
        self._owner[idx] = owner_slot
        return ids

    def free(self, block_ids: Iterable[int], owner_slot: int,
             generations: Sequence[int] | None = None) -> int:
        """Free each of ``block_ids`` held by ``owner_slot`` exactly once; returns how many were freed.

        Every id that is out of range, already free, held by another slot, repeated in ``block_ids``, or (when
        ``generations`` is given) of another generation is NOT freed; if there is any, the valid ones are
        still freed and then KVBlockStateError is raised naming the bad ones (``err.bad_blocks``: list of
        (block_id, reason)), so the caller can log it and continue without leaking blocks.
        """
        ids = [int(b) for b in block_ids]
        if generations is not None and len(generations) != len(ids):
            raise ValueError(f"free(): {len(ids)} block ids but {len(generations)} generations")
        nb = self.num_blocks
        owner, gen = self._owner, self._gen
        good: list[int] = []
        bad: list[tuple[int, str]] = []
        seen: set[int] = set()
        for i, b in enumerate(ids):
            if not 0 <= b < nb:
                bad.append((b, f"outside the pool of {nb} blocks"))
            elif b in seen:
                bad.append((b, "listed twice"))
            else:
                seen.add(b)
                o = int(owner[b])
                if o == -1:
                    bad.append((b, "already free"))
                elif o != owner_slot:
                    bad.append((b, f"held by slot {o}"))
                elif generations is not None and int(gen[b]) != int(generations[i]) & 0xFFFFFFFF:
                    bad.append((b, f"stale generation {generations[i]} (now {int(gen[b])})"))
                else:
                    good.append(b)
        if good:
            owner[np.array(good, dtype=np.int64)] = -1
            self._free.extend(reversed(good))
        if bad:
            detail = "; ".join(f"block {b}: {why}" for b, why in bad[:8])
            more = f" (+{len(bad) - 8} more)" if len(bad) > 8 else ""
            err = KVBlockStateError(f"free by slot {owner_slot} of {len(bad)} block(s) it does not hold: "
                                    f"{detail}{more}. A double free or a stale id (a bug); the "
                                    f"{len(good)} valid block(s) were freed")
            err.bad_blocks = bad
            raise err
        return len(good)

    def reassign(self, block_ids: Iterable[int], owner_slot: int, new_owner_slot: int) -> None:
        """Hand blocks held by ``owner_slot`` to ``new_owner_slot`` (>= 0) as they are: same ids, same
        generations, data untouched (a prompt's blocks joining the prefix cache). All or nothing: raises
        KVBlockStateError (changing nothing) if any is not held by ``owner_slot``."""
        idx = np.array([int(b) for b in block_ids], dtype=np.int64)
        if new_owner_slot < 0:
            raise ValueError(f"reassign(new_owner_slot={new_owner_slot}): must be >= 0")
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_blocks
                         or not np.all(self._owner[idx] == owner_slot)):
            raise KVBlockStateError(f"reassign by slot {owner_slot} of blocks {idx.tolist()[:8]} it does not all "
                                    f"hold (a bug); nothing changed")
        self._owner[idx] = new_owner_slot

    def free_owned_by(self, owner_slot: int) -> int:
        """Free every block held by ``owner_slot`` (cleanup of a timed-out/failed request); returns the count.
        O(pool), vectorized."""
        ids = np.flatnonzero(self._owner == owner_slot)
        if ids.size:
            self._owner[ids] = -1
            self._free.extend(ids[::-1].tolist())
        return int(ids.size)

    def reset(self) -> None:
        """Every block free (generations are kept, so pairs from before the reset stay detectably stale)."""
        self._owner[:] = -1
        self._free = list(range(self.num_blocks - 1, -1, -1))

    def audit(self) -> None:
        """Raise KVBlockStateError unless the free stack and the owner array agree exactly (tests, debug)."""
        free_arr = np.flatnonzero(self._owner == -1)
        if len(self._free) != len(set(self._free)) or sorted(self._free) != free_arr.tolist():
            raise KVBlockStateError(f"allocator out of sync: {len(self._free)} ids on the free stack, "
                                    f"{free_arr.size} blocks marked free")


class KVPool(_shm.ShmSegment):
    """One actor's paged KV cache in one shm segment (layout in the module docstring).

    ``tensor()`` is ``[num_layers, 2, num_blocks, block_tokens, num_kv_heads, head_dim]`` over the shm bytes,
    zero copy. Pickles by name (unpickling attaches read-only: a pickled pool is a peer's view). Segment
    plumbing: ``ipc._shm.ShmSegment``.
    """

    MAGIC = MAGIC
    VERSION = VERSION
    KIND = "KV pool"

    def __init__(self) -> None:  # use create() / attach()
        super().__init__()
        self.num_layers = self.num_blocks = self.block_tokens = self.num_kv_heads = self.head_dim = 0
        self.dtype_name = "float32"   # a DTYPE_CODES name; ``dtype`` is the torch dtype
        self.elem_bytes = 0
        self.data_offset = 0
        self.data_bytes = 0
        self._owner_slot: np.ndarray | None = None
        self._generation: np.ndarray | None = None
        self._alloc: BlockAllocator | None = None
        self._tensor: torch.Tensor | None = None
        self._array: np.ndarray | None = None

    @classmethod
    def create(cls, name: str, *, num_layers: int, num_blocks: int, block_tokens: int, num_kv_heads: int,
               head_dim: int, dtype: torch.dtype | str = "float32", data: bool = True) -> "KVPool":
        """Create (O_CREX, mode 0600) and own a pool with every block free; data zeroed, pages reserved.

        Bytes = num_layers * 2 * num_blocks * block_tokens * num_kv_heads * head_dim * dtype size (+ meta).
        ``data=False``: the KV table only (data_bytes 0; ``tensor()``/``array()`` raise): the pools of the
        tensor transports (cuda-ipc, torch-ipc) keep their data in a tensor (gpu/cuda_ipc.allocate_device_pool).
        Raises ValueError for a size or dtype out of range, FileExistsError if ``name`` exists,
        OSError(ENOSPC) if /dev/shm has no room.
        """
        dims = dict(num_layers=num_layers, num_blocks=num_blocks, block_tokens=block_tokens,
                    num_kv_heads=num_kv_heads, head_dim=head_dim)
        for k, v in dims.items():
            if not isinstance(v, (int, np.integer)) or not 1 <= v < 1 << 31:
                raise ValueError(f"KVPool {k}={v!r} must be an int in 1..2**31-1")
        if dtype_name(dtype) not in _CODE_OF:
            raise ValueError(f"KVPool dtype {dtype} not supported; use one of "
                             f"{[f'torch.{t}' for t, _ in DTYPE_CODES.values()]}")
        code = _CODE_OF[dtype_name(dtype)]
        elem = DTYPE_CODES[code][1].itemsize
        data_offset = _align(HEADER_BYTES + 8 * num_blocks, DATA_ALIGN)
        data_bytes = num_layers * 2 * num_blocks * block_tokens * num_kv_heads * head_dim * elem if data else 0

        def init(mm) -> None:
            HEADER.pack_into(mm, 0, b"\0\0\0\0", VERSION, num_layers, num_blocks, block_tokens, num_kv_heads,
                             head_dim, code, elem, 1, HEADER_BYTES, data_offset, data_bytes)
            _shm.shm_array(mm, "<i4", num_blocks, HEADER_BYTES)[:] = -1

        return cls._create(name, data_offset + data_bytes, init)

    @classmethod
    def attach(cls, name: str, readonly: bool = False) -> "KVPool":
        """Attach to the existing pool ``name``.

        ``readonly=True`` (a peer that copies from it): maps PROT_READ; the allocator is unavailable.
        NOTE torch has no read-only tensors: writing into such a pool's ``tensor()`` crashes the process
        (SIGSEGV) rather than corrupting the owner's cache. ``readonly=False`` is only for the actor that uses
        the pool (it then runs the allocator: one writer per pool). Raises FileNotFoundError if the pool does
        not exist, ValueError if the segment is not a KVPool of this layout version.
        """
        return super().attach(name, readonly)

    def _check_layout(self, name: str, mm) -> None:
        if len(mm) < HEADER_BYTES:
            raise ValueError(f"segment {name!r} is too small for a KVPool header")
        code = HEADER.unpack_from(mm, 0)[7]
        if code not in DTYPE_CODES:
            raise ValueError(f"KV pool {name!r} has dtype code {code}; this code knows {sorted(DTYPE_CODES)}")

    def _setup(self, mm) -> None:
        (_, _, self.num_layers, self.num_blocks, self.block_tokens, self.num_kv_heads, self.head_dim, code,
         self.elem_bytes, _, meta_offset, self.data_offset, self.data_bytes) = HEADER.unpack_from(mm, 0)
        self.dtype_name, carrier = DTYPE_CODES[code]
        nb = self.num_blocks
        self._owner_slot = _shm.shm_array(mm, "<i4", nb, meta_offset)
        self._generation = _shm.shm_array(mm, "<u4", nb, meta_offset + 4 * nb)
        self._alloc = None if self.readonly else BlockAllocator(self._owner_slot, self._generation)
        self._array = _shm.shm_array(mm, carrier, self.shape, self.data_offset) if self.data_bytes else None
        self._tensor = None   # made from _array on the first tensor()

    def _teardown(self) -> None:
        self._alloc = None
        self._tensor = self._array = None
        self._owner_slot = self._generation = None

    def __getstate__(self):
        state = super().__getstate__()
        return (state, True) if isinstance(state, str) else state  # a pickled pool is a peer's read-only view

    def _repr_fields(self) -> str:
        return (f", layers={self.num_layers}, blocks={self.num_blocks}, block_tokens={self.block_tokens}, "
                f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype=torch.{self.dtype_name}")

    # ------------------------------------------------------------------ geometry and data

    @property
    def dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype_name)

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (self.num_layers, 2, self.num_blocks, self.block_tokens, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        return self.num_layers * 2 * self.block_tokens * self.num_kv_heads * self.head_dim * self.elem_bytes

    @property
    def epoch(self) -> int:
        """1 at create, +1 at every reset(): a peer holding block ids can tell the owner restarted."""
        return U4.unpack_from(self._mm, OFF_EPOCH)[0]

    def tensor(self) -> torch.Tensor:
        """The pool as ``[num_layers, 2, num_blocks, block_tokens, num_kv_heads, head_dim]`` (K at [:, 0], V
        at [:, 1]) viewing the shm bytes, zero copy; data is 4096-byte (so 64-byte) aligned. Keep it no longer
        than the pool; it pins the mapping after ``close()``."""
        self._check_data()
        if self._tensor is None:
            import torch

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "non-writable array" for read-only peers
                t = torch.from_numpy(self._array)  # pins the mapping (torch.frombuffer would not: _shm.close_mapping)
            self._tensor = t if t.dtype == self.dtype else t.view(self.dtype)  # bf16 rides on uint16
        return self._tensor

    def array(self) -> np.ndarray:
        """The same bytes as ``tensor()`` as a numpy array of the same shape, in a carrier dtype of the same
        width (uint16 for bfloat16). Read-only (numpy refuses writes) in a read-only attach. For bytewise
        copies (the CPU transport)."""
        self._check_data()
        return self._array

    def _check_data(self) -> None:
        if self._closed:
            raise ValueError(f"KV pool {self.name!r} is closed in this process")
        if self._array is None:
            raise ValueError(f"KV pool {self.name!r} has no data section: its data is a tensor in its actor "
                             f"(kv_transport cuda-ipc / torch-ipc: gpu/cuda_ipc.allocate_device_pool)")

    # ------------------------------------------------------------------ allocator (owner only)

    def _allocator(self) -> BlockAllocator:
        if self._alloc is None:
            raise PermissionError(f"KV pool {self.name!r} is attached read-only here; only its owning actor "
                                  f"allocates and frees")
        return self._alloc

    def allocate(self, n: int, owner_slot: int) -> list[int]:
        """Give ``n`` blocks to state-table slot ``owner_slot``; returns block ids (see ``generations``).

        All or nothing: raises OutOfKVBlocksError without allocating if fewer than ``n`` are free;
        PermissionError in a read-only attach.
        """
        return self._allocator().allocate(n, owner_slot)

    def free(self, block_ids: Iterable[int], owner_slot: int,
             generations: Sequence[int] | None = None) -> int:
        """Free blocks held by ``owner_slot``, each exactly once; returns the number freed. Raises
        KVBlockStateError (after freeing the valid ones) for a block already free, held by another slot,
        listed twice, or of a stale generation (if ``generations`` given). See ``BlockAllocator.free``."""
        return self._allocator().free(block_ids, owner_slot, generations)

    def reassign(self, block_ids: Iterable[int], owner_slot: int, new_owner_slot: int) -> None:
        """Hand blocks from ``owner_slot`` to ``new_owner_slot`` unchanged (see ``BlockAllocator.reassign``)."""
        self._allocator().reassign(block_ids, owner_slot, new_owner_slot)

    def free_owned_by(self, owner_slot: int) -> int:
        """Free every block ``owner_slot`` holds; returns how many (cleanup of timed-out/failed requests)."""
        return self._allocator().free_owned_by(owner_slot)

    def reset(self) -> None:
        """Mark every block free and bump the epoch (a restarted actor re-taking its pool)."""
        self._allocator().reset()
        U4.pack_into(self._mm, OFF_EPOCH, (self.epoch + 1) & 0xFFFFFFFF)

    def audit(self) -> None:
        """Raise KVBlockStateError if the allocator's free stack and the shm owner array disagree."""
        self._allocator().audit()

    # ------------------------------------------------------------------ readers (anyone)

    @property
    def num_free(self) -> int:
        """Free blocks (O(1) in the owner; counted from shm, O(pool), elsewhere)."""
        if self._alloc is not None:
            return self._alloc.num_free
        return int(np.count_nonzero(self._owner_slot == -1))

    @property
    def usage_ratio(self) -> float:
        """Fraction of blocks in use, 0.0 .. 1.0."""
        return 1.0 - self.num_free / self.num_blocks

    def blocks_of(self, owner_slot: int) -> list[int]:
        """Ids of the blocks ``owner_slot`` holds, ascending (O(pool), vectorized)."""
        return np.flatnonzero(self._owner_slot == owner_slot).tolist()

    def generations(self, block_ids: Iterable[int]) -> list[int]:
        """Current generation of each block id (send these with the ids; compare with ``is_current``)."""
        return self._generation[np.asarray(list(block_ids), dtype=np.int64)].tolist()

    def is_current(self, block_ids: Sequence[int], generations: Sequence[int], owner_slot: int | None = None
                   ) -> bool:
        """True if every (id, generation) pair is current (and, if given, held by ``owner_slot``)."""
        if len(block_ids) != len(generations):
            return False
        idx = np.asarray(block_ids, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_blocks):
            return False
        ok = np.array_equal(self._generation[idx], np.asarray(generations, dtype=np.int64) & 0xFFFFFFFF)
        if ok and owner_slot is not None:
            ok = bool(np.all(self._owner_slot[idx] == owner_slot))
        return bool(ok)

    def owner_slots(self) -> np.ndarray:
        """A copy of the per-block owner slots (-1 = free)."""
        return self._owner_slot.copy()
