"""The KV handoff interface (prefill pool -> decode pool) and its CPU shared-memory implementation.

The decode actor pulls: it owns a ``KVTransport`` built over its own pool (the destination), opens the
prefill actor's pool once as the source (``open_peer``), and for each request copies the prefill blocks into
the blocks it reserved. Block ids and the token count travel in messages; the data never does.

Implementations: ``cpu-shm`` (here; every test runs on it). ``cuda-ipc`` (gpu/cuda_ipc.py: device pools through
CUDA IPC), ``torch-ipc`` (its CPU twin in the same module: CPU tensor pools shared through torch's shm) and ``mooncake``
(ipc/mooncake_transport.py, the Mooncake Transfer Engine over TCP; an optional extra) register with
``register_transport`` from their own modules, so the deadlines and the lifecycle above them stay the same.
A transport whose source side must do something at start (mooncake: register the prefill pool with its engine
and publish where it lives) also registers a source factory, which the prefill actor runs through
``publish_source``.
"""
from __future__ import annotations

import abc
import importlib
import itertools
from typing import Callable, Sequence

import numpy as np

from ipc.kv_pool import KVPool
from ipc.lifecycle import TransferStatus  # noqa: F401  (re-exported: the transports' status values)


class KVTransport(abc.ABC):
    """Moves whole KV blocks from a peer's pool (src: the prefill actor's) into the local pool (dst: the
    decode actor's, whose process runs the transport: the decode side pulls).

    Every method is non-blocking except where an implementation documents otherwise; the caller polls and
    enforces its own deadline (a transfer that stays IN_PROGRESS is the caller's timeout, not ours).
    """

    @abc.abstractmethod
    def open_peer(self, peer_pool_name: str) -> None:
        """Attach the source (prefill) pool ``peer_pool_name``; called once, the peer stays attached until
        ``close``. Raises FileNotFoundError if it does not exist, ValueError if its geometry (layers,
        block_tokens, kv heads, head_dim, dtype) differs from the local pool's."""

    @abc.abstractmethod
    def start_copy(self, src_block_ids: Sequence[int], dst_block_ids: Sequence[int], *,
                   num_tokens: int) -> int:
        """Start copying src block ``src_block_ids[i]`` (peer pool) into dst block ``dst_block_ids[i]`` (local
        pool), all layers, K and V; ``num_tokens`` (<= blocks * block_tokens) is the valid token count.
        Returns a transfer handle for ``poll``/``release``. Raises ValueError for mismatched lengths, ids out
        of range, repeated dst ids or a bad ``num_tokens``; RuntimeError if ``open_peer`` was not called."""

    @abc.abstractmethod
    def poll(self, handle: int) -> TransferStatus:
        """Status of transfer ``handle``. Raises KeyError for a handle never issued or already released."""

    def _recorded_status(self, handle: int) -> TransferStatus:
        """The status last recorded in ``self._handles`` (every implementation keeps one there per issued handle).
        Raises KeyError naming the handle if it was never issued or was released."""
        try:
            return self._handles[handle]
        except KeyError:
            raise KeyError(f"unknown KV transfer handle {handle!r} (never issued, or released)") from None

    @abc.abstractmethod
    def release(self, handle: int) -> None:
        """Forget transfer ``handle`` (idempotent: releasing an unknown/released handle does nothing)."""

    @property
    @abc.abstractmethod
    def bytes_moved_total(self) -> int:
        """Bytes copied by completed transfers since construction."""

    @abc.abstractmethod
    def close(self) -> None:
        """Detach the peer and drop every handle (idempotent)."""

    def error(self, handle: int) -> str | None:
        """Why transfer ``handle`` FAILED, if known."""
        return None


def attach_peer_pool(local: KVPool, peer_pool_name: str) -> KVPool:
    """Attach the peer's pool read-only and check it can feed ``local`` (same layers, block size, heads, head
    dim and dtype). Raises ValueError naming every difference (the peer is closed first)."""
    peer = KVPool.attach(peer_pool_name, readonly=True)
    fields = ("num_layers", "block_tokens", "num_kv_heads", "head_dim", "dtype")
    diff = [f"{f}: local {getattr(local, f)} vs peer {getattr(peer, f)}" for f in fields
            if getattr(local, f) != getattr(peer, f)]
    if diff:
        peer.close()
        raise ValueError(f"KV pool {peer_pool_name!r} cannot feed {local.name!r}: " + "; ".join(diff))
    return peer


def validate_copy(src_block_ids: Sequence[int], dst_block_ids: Sequence[int], num_tokens: int, *,
                  block_tokens: int, src_blocks: int, dst_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``start_copy`` argument rules every KVTransport applies: returns the ids as int64 arrays.

    Raises:
        ValueError: mismatched lengths, a ``num_tokens`` the blocks cannot hold, ids out of range, or a
            repeated destination id.
    """
    src = np.asarray(src_block_ids, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst_block_ids, dtype=np.int64).reshape(-1)
    if src.size != dst.size:
        raise ValueError(f"start_copy: {src.size} src blocks but {dst.size} dst blocks")
    if not 0 <= num_tokens <= src.size * block_tokens:
        raise ValueError(f"start_copy: num_tokens={num_tokens} does not fit {src.size} blocks "
                         f"of {block_tokens} tokens")
    if src.size:  # Python-level checks: a request has tens of ids, where numpy calls cost more than they save
        s, d = src.tolist(), dst.tolist()
        if min(s) < 0 or max(s) >= src_blocks:
            raise ValueError(f"start_copy: src block id outside the peer pool of {src_blocks}")
        if min(d) < 0 or max(d) >= dst_blocks:
            raise ValueError(f"start_copy: dst block id outside the local pool of {dst_blocks}")
        if len(set(d)) != len(d):
            raise ValueError("start_copy: a dst block id is listed twice")
    return src, dst


def _contiguous_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Split parallel block-id lists into runs where both advance by one: ``[(src0, dst0, length)]``."""
    runs = []
    start, n = 0, len(src)
    for i in range(1, n + 1):
        if i == n or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
            runs.append((src[start], dst[start], i - start))
            start = i
    return runs


class CpuShmTransport(KVTransport):
    """KV handoff between two POSIX shm pools on one host: a synchronous copy between numpy views.

    ``start_copy`` copies before it returns (its handle polls DONE, or FAILED if the copy raised). The copy is
    ``ipc.kv_copy.copy_blocks``, a numba loop over the pools seen as uint8 ``[layers * 2, blocks, piece_bytes]``:
    plane-outer, block-inner, ids sorted by source, each piece (one block of one layer's K or V) copied with
    non-temporal stores when pieces are 64-byte aligned (every real geometry), with a plain loop otherwise. No
    temporary: every byte is read once and written once. Bytewise, so every pool dtype (bf16 included) is exact.
    ``open_peer`` compiles the loop (or loads it from numba's cache): at actor start, not on a request's path,
    and sets ``streaming`` (True: this pair of pools is copied with non-temporal stores).
    Why this shape (4 KiB shm pages, 12 KiB pieces 3 MiB apart, glibc's memmove): what
    `python -m bench.ipc --only kv` measures.
    """

    kind = "cpu-shm"

    def __init__(self, local_pool: KVPool):
        if local_pool.readonly:
            raise ValueError(f"the local (destination) pool {local_pool.name!r} must be attached writable")
        from ipc import kv_copy  # numba: imported by the actors that copy, not by every importer of this module

        self._kv_copy = kv_copy
        self.local = local_pool
        self.peer: KVPool | None = None
        self._dst = kv_copy.byte_planes(local_pool.array())
        self._src: np.ndarray | None = None
        self.streaming = False
        self._handles: dict[int, TransferStatus] = {}
        self._errors: dict[int, str] = {}
        self._ids = itertools.count(1)
        self._bytes_total = 0

    def open_peer(self, peer_pool_name: str) -> None:
        if self.peer is not None:
            if self.peer.name == peer_pool_name:
                return
            raise ValueError(f"transport already attached to peer {self.peer.name!r}; close() it first")
        peer = attach_peer_pool(self.local, peer_pool_name)
        src = self._kv_copy.byte_planes(peer.array())
        self.streaming = all(x % self._kv_copy.STREAM_ALIGN_BYTES == 0
                           for x in (src.shape[2], src.ctypes.data, self._dst.ctypes.data))
        no_ids = np.zeros(0, dtype=np.int64)
        self._kv_copy.copy_blocks(src, self._dst, no_ids, no_ids, self.streaming)  # compile now, not per request
        self.peer, self._src = peer, src

    def start_copy(self, src_block_ids: Sequence[int], dst_block_ids: Sequence[int], *,
                   num_tokens: int) -> int:
        if self._src is None:
            raise RuntimeError("CpuShmTransport.start_copy before open_peer()")
        src, dst = validate_copy(src_block_ids, dst_block_ids, num_tokens, block_tokens=self.local.block_tokens,
                                 src_blocks=self.peer.num_blocks, dst_blocks=self.local.num_blocks)
        handle = next(self._ids)
        try:
            order = np.argsort(src, kind="stable")  # ascending source reads
            self._kv_copy.copy_blocks(self._src, self._dst, src[order], dst[order], self.streaming)
        except Exception as exc:  # a vanished/short mapping, MemoryError...
            self._handles[handle] = TransferStatus.FAILED
            self._errors[handle] = f"{type(exc).__name__}: {exc}"
            return handle
        self._bytes_total += int(src.size) * self.local.block_bytes
        self._handles[handle] = TransferStatus.DONE
        return handle

    def poll(self, handle: int) -> TransferStatus:
        return self._recorded_status(handle)

    def release(self, handle: int) -> None:
        self._handles.pop(handle, None)
        self._errors.pop(handle, None)

    def error(self, handle: int) -> str | None:
        return self._errors.get(handle)

    @property
    def bytes_moved_total(self) -> int:
        return self._bytes_total

    def close(self) -> None:
        self._handles.clear()
        self._errors.clear()
        self._src = None
        if self.peer is not None:
            self.peer.close()
            self.peer = None


_TRANSPORTS: dict[str, Callable[[KVPool], KVTransport]] = {"cpu-shm": CpuShmTransport}


def register_transport(kind: str, factory: Callable[[KVPool], KVTransport]) -> None:
    """Make ``make_transport(kind, pool)`` call ``factory(pool)`` (e.g. "cuda-ipc" from ``gpu/``).
    Raises ValueError if ``kind`` is already registered to another factory."""
    if _TRANSPORTS.get(kind, factory) is not factory:
        raise ValueError(f"KV transport kind {kind!r} is already registered")
    _TRANSPORTS[kind] = factory


_SOURCES: dict[str, Callable[[KVPool], object]] = {}


def register_source(kind: str, factory: Callable[[KVPool], object]) -> None:
    """Make ``publish_source(kind, pool)`` call ``factory(pool)`` in the prefill actor. Raises ValueError if
    ``kind`` already has another source factory."""
    if _SOURCES.get(kind, factory) is not factory:
        raise ValueError(f"KV transport source {kind!r} is already registered")
    _SOURCES[kind] = factory


# Transports whose pools are tensors in their actors (gpu/cuda_ipc.py): the KVPool segment is their KV table only.
TENSOR_POOL_TRANSPORTS = ("cuda-ipc", "torch-ipc")

# Transports that live in their own module (heavy or optional imports) and register on import.
_PLUGIN_MODULES = {"cuda-ipc": "gpu.cuda_ipc", "torch-ipc": "gpu.cuda_ipc", "mooncake": "ipc.mooncake_transport"}


def known_transports() -> list[str]:
    return sorted(set(_TRANSPORTS) | set(_PLUGIN_MODULES))


def _load(kind: str) -> None:
    if kind not in _TRANSPORTS and kind in _PLUGIN_MODULES:
        importlib.import_module(_PLUGIN_MODULES[kind])


def make_transport(kind: str, local_pool: KVPool) -> KVTransport:
    """A transport of ``kind`` whose destination is ``local_pool``. Raises ValueError naming the known kinds
    for an unknown one; ImportError if its optional library is missing."""
    _load(kind)
    try:
        factory = _TRANSPORTS[kind]
    except KeyError:
        raise ValueError(f"unknown KV transport {kind!r}; known: {', '.join(known_transports())}") from None
    return factory(local_pool)


def set_transport_host(kind: str, host: str) -> None:
    """Start ``kind``'s network engine of this process listening on ``host`` (mooncake: its TransferEngine,
    whose session id peers dial); a no-op for the local transports. Call it before the first transport or source
    of the process is made. Raises ImportError if the optional library is missing, RuntimeError if the engine
    does not start."""
    if kind == "mooncake":
        _load(kind)
        from ipc.mooncake_transport import process_engine

        process_engine(host)


def publish_source(kind: str, pool: KVPool) -> object | None:
    """Run ``kind``'s source-side start-up on the prefill actor's ``pool`` (mooncake: register it, publish
    its descriptor); returns the object to ``close`` at exit, or None for transports without one (cpu-shm).
    Raises ValueError for an unknown kind; ImportError if its optional library is missing."""
    if kind not in known_transports():
        raise ValueError(f"unknown KV transport {kind!r}; known: {', '.join(known_transports())}")
    _load(kind)
    factory = _SOURCES.get(kind)
    return None if factory is None else factory(pool)
