"""What each prefill actor's prefix cache holds, in POSIX shm: the API's router reads it to send a prompt to the
actor that caches the longest prefix of it, with no round trip to the actors (api/router.py).

One segment per engine (``/pdserve_<id>_cachesum``), created and unlinked by the supervisor; one region per
prefill actor, written only by that actor (``SummaryWriter``, the listener of its actors/prefix_cache.py
``PrefixCache``), read by the API process (``CacheSummary.cached_blocks``).

Layout (little endian)::

    offset  size  field
    0       4     magic            b"PDCS"
    4       4     version          u4 = 1
    8       4     num_actors       u4   regions (prefill actor indices 0 .. num_actors - 1)
    12      4     slots            u4   slots per region = KV blocks per pool
    16      8     regions_offset   u8 = HEADER_BYTES (64)
    64      ...   num_actors regions of REGION_HEADER_BYTES + 8 * slots bytes

Region (one writer: its prefill actor)::

    offset  size       field
    0       4          writer_pid  i4   pid of the actor process whose cache the slots describe; 0 = none (never
                                        started, or being cleared)
    4       4          (reserved)
    8       8          changes     u8   slot writes so far (tools and tests watch it move)
    64      8 * slots  slot         u8[slots]  slot ``b``: the first 8 bytes (as a little-endian u8) of the chain
                                        key of the full block cached in pool block ``b``; 0 = block ``b`` holds
                                        nothing cached (a key whose 8 bytes are 0 is stored as 1)

A slot per pool block makes the summary exact and bounded (a pool caches at most its block count) and each
change one aligned 8-byte store. The keys are the prefix cache's own (``actors.prefix_cache.block_keys``):
equal keys mean equal token prefixes, so the API hashes a prompt's full blocks and counts the leading run found
in a region (each reader keeps its own dict of a region's values, updated from the slots that changed since its
last look). Readers take no lock: a lookup racing a change may count one block more or fewer, which only
sways a routing choice (the actor's own cache decides what is reused). A restarted actor clears its region
before it serves (``SummaryWriter.clear``: writer_pid 0, slots zeroed, then its own pid), and a reader passing
the actor table's pid for the row never counts a predecessor's slots.
"""
from __future__ import annotations

import base64
import os
import struct
from typing import Sequence

import numpy as np

from ipc import _shm

MAGIC = b"PDCS"
VERSION = 1
HEADER = struct.Struct("<4sIIIQ")   # magic, version, num_actors, slots, regions_offset
HEADER_BYTES = 64
REGION_HEADER_BYTES = 64
_PID = struct.Struct("<i")
_CHANGES = struct.Struct("<Q")
MAX_ACTORS = 4096


def key_words(keys: Sequence[bytes]) -> np.ndarray:
    """The slot value of each chain key (its first 8 bytes as a little-endian u8; 0 becomes 1): ``[len(keys)]``
    u8. Raises ValueError for a key shorter than 8 bytes."""
    if any(len(k) < 8 for k in keys):
        raise ValueError("a chain key has at least 8 bytes (actors.prefix_cache.block_keys gives 16)")
    words = np.frombuffer(b"".join(k[:8] for k in keys), dtype="<u8").copy()
    words[words == 0] = 1
    return words


def encode_words(words: np.ndarray) -> str:
    """Slot values as text for a JSON report (base64 of the little-endian u8 array): a node's ``/internal/status``
    ``cache.words`` (api/node_api.py), read back by ``decode_words`` in `pdserve router`."""
    return base64.b64encode(np.asarray(words, dtype="<u8").tobytes()).decode("ascii")


def decode_words(text: str) -> np.ndarray:
    """``encode_words``'s inverse, sorted and unique. Raises ValueError for text that is not base64 of whole u8s."""
    raw = base64.b64decode(text.encode("ascii"), validate=True)
    if len(raw) % 8:
        raise ValueError(f"{len(raw)} bytes of cache words: not a whole number of 8-byte words")
    return np.unique(np.frombuffer(raw, dtype="<u8"))


def leading_run(words: np.ndarray, keys: Sequence[bytes]) -> int:
    """How many of ``keys`` (chain keys, first block first) are among ``words`` (slot values, sorted and unique, as
    ``decode_words`` gives them), counted from the first up to the first missing one. O(len(keys) log len(words))."""
    if not keys or not len(words):
        return 0
    wanted = key_words(keys)
    at = np.minimum(np.searchsorted(words, wanted), len(words) - 1)
    found = words[at] == wanted
    return len(keys) if found.all() else int(np.argmin(found))


class CacheSummary(_shm.ShmSegment):
    """The per-actor cache summaries (layout in the module docstring). The supervisor creates and unlinks it;
    prefill actors attach and write their own region through ``writer(index)``; the API attaches and reads.
    Segment plumbing: ``ipc._shm.ShmSegment``."""

    MAGIC = MAGIC
    VERSION = VERSION
    KIND = "prefix cache summary"

    def __init__(self) -> None:  # use create() / attach()
        super().__init__()
        self.num_actors = self.slots = 0
        self._slots: list[np.ndarray] = []
        self._seen: list[np.ndarray] = []               # per region: the slots as this reader last saw them
        self._counts: list[dict[int, int]] = []          # per region: slot value -> slots holding it (of _seen)
        self._region_offsets: list[int] = []

    @classmethod
    def create(cls, name: str, num_actors: int, slots: int) -> "CacheSummary":
        """Create (O_CREX, mode 0600) and own ``num_actors`` empty regions of ``slots`` slots (KV blocks per
        pool). Raises ValueError for a size out of range, FileExistsError if ``name`` exists."""
        if not 1 <= num_actors <= MAX_ACTORS:
            raise ValueError(f"num_actors={num_actors} must be in 1..{MAX_ACTORS}")
        if slots < 1:
            raise ValueError(f"slots={slots} must be >= 1 (the KV pool's block count)")

        def init(mm) -> None:
            HEADER.pack_into(mm, 0, b"\0\0\0\0", VERSION, num_actors, slots, HEADER_BYTES)

        return cls._create(name, HEADER_BYTES + num_actors * (REGION_HEADER_BYTES + 8 * slots), init)

    def _check_layout(self, name: str, mm) -> None:
        _, _, num_actors, slots, offset = HEADER.unpack_from(mm, 0) if len(mm) >= HEADER.size else (0,) * 5
        if offset != HEADER_BYTES or len(mm) < offset + num_actors * (REGION_HEADER_BYTES + 8 * slots):
            raise ValueError(f"prefix cache summary {name!r} is {len(mm)} B, too small for its header's "
                             f"{num_actors} regions of {slots} slots")

    def _setup(self, mm) -> None:
        _, _, self.num_actors, self.slots, offset = HEADER.unpack_from(mm, 0)
        region_bytes = REGION_HEADER_BYTES + 8 * self.slots
        self._region_offsets = [offset + i * region_bytes for i in range(self.num_actors)]
        self._slots = [_shm.shm_array(mm, "<u8", self.slots, o + REGION_HEADER_BYTES) for o in self._region_offsets]
        self._seen = [np.zeros(self.slots, dtype="<u8") for _ in range(self.num_actors)]
        self._counts = [{} for _ in range(self.num_actors)]

    def _teardown(self) -> None:
        self._slots, self._region_offsets, self._seen, self._counts = [], [], [], []

    def _repr_fields(self) -> str:
        return f", num_actors={self.num_actors}, slots={self.slots}"

    def _region(self, index: int) -> int:
        self._require_open()
        index = int(index)
        if not 0 <= index < self.num_actors:
            raise IndexError(f"actor index {index} outside the cache summary's {self.num_actors} regions")
        return index

    # ---- readers --------------------------------------------------------------------------------------
    def writer_pid(self, index: int) -> int:
        """The pid whose cache region ``index`` describes (0 = none)."""
        return _PID.unpack_from(self._mm, self._region_offsets[self._region(index)])[0]

    def changes(self, index: int) -> int:
        return _CHANGES.unpack_from(self._mm, self._region_offsets[self._region(index)] + 8)[0]

    def num_cached(self, index: int) -> int:
        """Blocks region ``index`` lists as cached."""
        return int(np.count_nonzero(self._slots[self._region(index)]))

    def words(self, index: int, pid: int | None = None) -> np.ndarray:
        """Region ``index``'s cached keys as slot values (sorted, unique, u8); empty when ``pid`` is given and the
        region is another process's. For a node's ``/internal/status`` (api/node_api.py)."""
        slots = self._slots[self._region(index)]
        if pid is not None and self.writer_pid(index) != pid:
            return np.zeros(0, dtype="<u8")
        return np.unique(slots[slots != 0])

    def cached_blocks(self, index: int, keys: Sequence[bytes], pid: int | None = None) -> int:
        """How many of ``keys`` (a prompt's chain keys, first block first) region ``index`` lists, counted from
        the first up to the first missing one: the prompt's cached prefix in blocks. ``pid``: the actor process
        the caller believes serves the row (the actor table's); a region written by another process counts 0."""
        index = self._region(index)
        if not keys or (pid is not None and self.writer_pid(index) != pid):
            return 0
        cached = self._refresh(index)
        run = 0
        for word in key_words(keys).tolist():
            if word not in cached:
                break
            run += 1
        return run

    def _refresh(self, index: int) -> dict[int, int]:
        """Region ``index``'s slot values as a dict (value -> slots holding it), brought up to date with the slots
        that changed since this reader's last look (one vectorised compare, then the changed ones: a lookup costs
        O(changes + keys), not O(pool blocks))."""
        slots, seen, counts = self._slots[index], self._seen[index], self._counts[index]
        changed = np.flatnonzero(slots != seen)
        if changed.size:
            now = slots[changed]   # one read of each changed slot: seen and counts stay consistent with it
            for old, new in zip(seen[changed].tolist(), now.tolist()):
                if old:
                    left = counts[old] - 1
                    if left:
                        counts[old] = left
                    else:
                        del counts[old]
                if new:
                    counts[new] = counts.get(new, 0) + 1
            seen[changed] = now
        return counts

    # ---- the writer -------------------------------------------------------------------------------------
    def writer(self, index: int) -> "SummaryWriter":
        """Region ``index``'s writer (the prefill actor of that index only). Raises PermissionError through a
        read-only attach."""
        if self.readonly:
            raise PermissionError(f"prefix cache summary {self.name!r} is attached read-only")
        return SummaryWriter(self, self._region(index))


class SummaryWriter:
    """One actor's region: ``clear`` when it starts, then ``cached`` / ``evicted`` as its prefix cache changes
    (the ``PrefixCache.listener`` protocol)."""

    def __init__(self, summary: CacheSummary, index: int):
        self.summary, self.index = summary, index
        self._mm = summary._mm
        self._offset = summary._region_offsets[index]
        self._slots = summary._slots[index]
        self._changes = _CHANGES.unpack_from(self._mm, self._offset + 8)[0]

    def clear(self, pid: int | None = None) -> None:
        """An empty cache, owned by process ``pid`` (default: this one): writer_pid 0, every slot 0, then pid."""
        _PID.pack_into(self._mm, self._offset, 0)
        self._slots[:] = 0
        self._bump()
        _PID.pack_into(self._mm, self._offset, os.getpid() if pid is None else pid)

    def cached(self, block_id: int, key: bytes) -> None:
        """Pool block ``block_id`` now caches the full block of chain key ``key``."""
        self._slots[block_id] = key_words([key])[0]
        self._bump()

    def evicted(self, block_id: int) -> None:
        """Pool block ``block_id`` left the cache."""
        self._slots[block_id] = 0
        self._bump()

    def _bump(self) -> None:
        self._changes += 1
        _CHANGES.pack_into(self._mm, self._offset + 8, self._changes)
