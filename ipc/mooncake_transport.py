"""The ``mooncake`` KV transport: decode pulls KV blocks out of the prefill actor's pool through the Mooncake
Transfer Engine (TCP protocol, ``P2PHANDSHAKE`` metadata: no etcd), the engine SGLang, vLLM and Dynamo use for
disaggregated KV handoff. Optional: ``pip install -e .[mooncake]`` plus Debian's ``libibverbs1 librdmacm1
libnuma1`` (loaded by the library even for TCP); importing this module without them raises ImportError.

How the pieces fit:

* One ``TransferEngine`` per process (``process_engine``), initialised on first use on ``LOCAL_HOST``
  (loopback: one host; node roles will pass each node's address), its session id ``host:rpc_port``.
* The prefill actor calls ``publish_source(pool)`` once at start (``ipc.kv_transport.publish_source``): the
  pool's data section (the numpy view of its POSIX shm mapping) is registered with the engine, and a
  ``PeerDescriptor`` (session id, base address, length, geometry, pool epoch) is written as JSON to the small
  shm segment ``<pool name>.mc``. Across hosts the same descriptor travels in the control plane
  (``PeerDescriptor.to_json``/``from_json``, ``MooncakeTransport.open_remote``); node roles are not built yet.
* The decode actor's transport registers its own pool's data section (the destination) once, finds the peer
  with ``open_peer(pool name)`` (reads the descriptor; if the prefill actor has not published yet, the
  descriptor is read again by the next ``start_copy``), and for each request submits ONE
  ``batch_transfer_sync_read``: one entry per (layer, K/V plane, run of consecutive blocks), since a block's
  bytes are strided across the ``[layers, 2, blocks, ...]`` pool.
* Non-blocking: 0.3.x offers no per-batch completion poll from Python (``transfer_check_status`` looks at the
  batch's first task only; ``get_batch_transfer_status`` blocks), so the sync read runs on ONE worker thread
  per process (the call releases the GIL) and ``poll`` looks at its future. The single FIFO worker is the
  ordering guarantee behind ``release``: a released in-flight read cannot be cancelled and finishes first,
  and any transfer started after it (into blocks the decode side may have reallocated) completes after it;
  decode writes a block only after the transfer that filled it is DONE.
* Failure: a dead peer fails the read within milliseconds (connection refused/EOF -> FAILED); a stalled one
  fails after Mooncake's ``MC_TRANSFER_TIMEOUT`` (seconds, read at engine start; 30 by default), while the
  decode core's own deadline fires first and releases the transfer. Caveat: a read Mooncake gave up on by its
  timeout is not cancelled inside the library (its sync call frees the batch while slices may be queued), so
  a stalled peer that wakes up later could still deliver into those blocks; a dead one cannot.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import struct
import threading
from dataclasses import asdict, dataclass
from typing import Sequence

from ipc import _shm
from ipc.kv_pool import KVPool
from ipc.kv_transport import (KVTransport, TransferStatus, _contiguous_runs, register_source, register_transport,
                              validate_copy)

os.environ.setdefault("MC_LOG_LEVEL", "WARNING")   # the library's INFO lines (per connection) flood actor logs
# A request's batch is (runs x layers x K/V) entries, each cut into slices: the default per-peer queue rejects a
# 128-token request ("TCP lane queue-full rejection"); 65535 is what vLLM/Dynamo deployments set.
for _knob in ("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER"):
    os.environ.setdefault(_knob, "65535")
try:
    from mooncake.engine import TransferEngine
except ImportError as exc:  # the package, or a shared library it loads (libibverbs.so.1, libnuma.so.1...)
    raise ImportError(f"the mooncake KV transport needs the Mooncake Transfer Engine: pip install -e .[mooncake] "
                      f"and apt-get install libibverbs1 librdmacm1 libnuma1 ({exc})") from exc

DESCRIPTOR_SUFFIX = ".mc"
DESCRIPTOR_BYTES = 4096
_HEADER = struct.Struct("<4sIQQ")   # magic b"PDMC", version, seq, payload_len; the JSON descriptor after
_SEQ = struct.Struct("<Q")           # at offset 8: a seqlock, odd while the publisher writes, +2 per publish
_MAGIC = b"PDMC"
LOCAL_HOST = "127.0.0.1"


@dataclass(frozen=True)
class PeerDescriptor:
    """Where a source pool lives for Mooncake: ``session_id`` ("host:rpc_port"), ``base_addr`` (the address
    of the pool's data section in the exporter's process, bytes) and ``data_bytes``, plus the geometry a
    reader needs to compute block addresses (data laid out ``[num_layers, 2, num_blocks, block_tokens,
    num_kv_heads, head_dim]``, C order, ``elem_bytes`` per element) and the pool ``epoch`` it was published at."""

    session_id: str
    base_addr: int
    data_bytes: int
    num_layers: int
    num_blocks: int
    block_tokens: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    elem_bytes: int
    epoch: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "PeerDescriptor":
        return cls(**json.loads(text))


class _ProcessEngine:
    """The process's TransferEngine, its session id, the regions it registered (address -> (bytes, users))
    and the single worker thread every transport of the process submits reads to."""

    def __init__(self, host: str):
        self.engine = TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, tcp) returned {rc}")
        self.session_id = f"{host}:{self.engine.get_rpc_port()}"
        self.worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mooncake-kv")
        self._regions: dict[int, list[int]] = {}
        self._lock = threading.Lock()

    def register(self, addr: int, nbytes: int) -> None:
        """Register ``[addr, addr + nbytes)`` (reference counted). Raises RuntimeError if Mooncake refuses."""
        with self._lock:
            entry = self._regions.get(addr)
            if entry is not None:
                entry[1] += 1
                return
            rc = self.engine.register_memory(addr, nbytes)
            if rc != 0:
                raise RuntimeError(f"Mooncake register_memory({addr:#x}, {nbytes}) returned {rc}")
            self._regions[addr] = [nbytes, 1]

    def unregister(self, addr: int) -> None:
        with self._lock:
            entry = self._regions.get(addr)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del self._regions[addr]
                self.engine.unregister_memory(addr)


_ENGINE: _ProcessEngine | None = None
_ENGINE_LOCK = threading.Lock()


def process_engine(host: str = LOCAL_HOST) -> _ProcessEngine:
    """This process's Mooncake engine, started on first call listening on ``host`` (later calls return it
    whatever their ``host``). Raises RuntimeError if it does not initialise."""
    global _ENGINE
    with _ENGINE_LOCK:
        if _ENGINE is None:
            _ENGINE = _ProcessEngine(host)
        return _ENGINE


def _data_region(pool: KVPool) -> tuple[int, int]:
    arr = pool.array()
    return int(arr.ctypes.data), int(arr.nbytes)


def describe(pool: KVPool, session_id: str) -> PeerDescriptor:
    addr, nbytes = _data_region(pool)
    return PeerDescriptor(session_id, addr, nbytes, pool.num_layers, pool.num_blocks, pool.block_tokens,
                          pool.num_kv_heads, pool.head_dim, str(pool.dtype).removeprefix("torch."),
                          pool.elem_bytes, pool.epoch)


def descriptor_name(pool_name: str) -> str:
    return pool_name + DESCRIPTOR_SUFFIX


class MooncakeSource:
    """The prefill side: registers ``pool``'s data with the process engine and publishes its descriptor to
    the shm segment ``<pool name>.mc`` (created, or rewritten by a restarted actor). ``close`` unregisters
    (and unlinks the segment with ``unlink=True``; the supervisor's ``naming.unlink_all`` also removes it)."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self._engine = process_engine()
        self._addr, nbytes = _data_region(pool)
        self._engine.register(self._addr, nbytes)
        self.descriptor = describe(pool, self._engine.session_id)
        self.name = descriptor_name(pool.name)
        try:
            self._mm = _shm.create_segment(self.name, DESCRIPTOR_BYTES)
        except FileExistsError:
            self._mm = _shm.attach_segment(self.name)
        payload = self.descriptor.to_json().encode()
        if _HEADER.size + len(payload) > DESCRIPTOR_BYTES:
            raise ValueError(f"Mooncake descriptor of {len(payload)} bytes does not fit {self.name!r}")
        magic, _, seq, _ = _HEADER.unpack_from(self._mm, 0)
        seq = seq + (seq & 1) if magic == _MAGIC else 0   # even: a publisher that died mid-write left it odd
        _HEADER.pack_into(self._mm, 0, _MAGIC, 1, seq + 1, 0)
        self._mm[_HEADER.size:_HEADER.size + len(payload)] = payload
        _HEADER.pack_into(self._mm, 0, _MAGIC, 1, seq + 2, len(payload))

    def close(self, unlink: bool = False) -> None:
        if self._mm is None:
            return
        _shm.close_mapping(self._mm)
        self._mm = None
        self._engine.unregister(self._addr)
        if unlink:
            _shm.unlink_segment_quiet(self.name)


def attach_descriptor(name: str):
    """Map the published descriptor segment ``name`` read-only (for ``read_descriptor``). Raises
    FileNotFoundError if it does not exist."""
    return _shm.attach_segment(name, readonly=True)


def read_descriptor(mm, name: str = "") -> tuple[int, PeerDescriptor]:
    """``(seq, descriptor)`` from the mapped descriptor segment ``mm``. Raises FileNotFoundError if it is not
    published, or being rewritten (seq odd or moved while reading: try again later)."""
    magic, _, seq, length = _HEADER.unpack_from(mm, 0)
    if magic != _MAGIC or seq & 1 or not 0 < length <= DESCRIPTOR_BYTES - _HEADER.size:
        raise FileNotFoundError(f"Mooncake descriptor {name!r} is not published yet")
    payload = bytes(mm[_HEADER.size:_HEADER.size + length])
    if _SEQ.unpack_from(mm, 8)[0] != seq:
        raise FileNotFoundError(f"Mooncake descriptor {name!r} is being republished")
    return seq, PeerDescriptor.from_json(payload.decode())


class MooncakeTransport(KVTransport):
    """KV handoff over the Mooncake Transfer Engine (see the module docstring). ``start_copy`` queues one
    batched read on the process's worker thread and returns at once; ``poll`` is IN_PROGRESS until it ends.
    ``local_pool`` (the destination) must be attached writable."""

    kind = "mooncake"

    def __init__(self, local_pool: KVPool):
        if local_pool.readonly:
            raise ValueError(f"the local (destination) pool {local_pool.name!r} must be attached writable")
        self.local = local_pool
        self._engine = process_engine()
        self._addr, nbytes = _data_region(local_pool)
        self._engine.register(self._addr, nbytes)
        self._registered = True
        self.peer: PeerDescriptor | None = None
        self._peer_name: str | None = None
        self._peer_seq = -1
        self._desc_mm = None   # the peer's descriptor segment, mapped once found
        self._futures: dict[int, concurrent.futures.Future] = {}
        self._orphans: list[concurrent.futures.Future] = []  # released while in flight
        self._nbytes: dict[int, int] = {}
        self._handles: dict[int, TransferStatus] = {}
        self._errors: dict[int, str] = {}
        self._ids = itertools.count(1)
        self._bytes_total = 0

    # -- peer ---------------------------------------------------------------------------------------------

    def open_peer(self, peer_pool_name: str) -> None:
        """Find the prefill pool ``peer_pool_name`` by its published descriptor. A descriptor not yet
        published is looked up again by the next ``start_copy`` (the prefill actor publishes at start, before
        any KVReady). Raises ValueError for a geometry that cannot feed the local pool, or if another peer is
        attached."""
        if self._peer_name is not None and self._peer_name != peer_pool_name:
            raise ValueError(f"transport already attached to peer {self._peer_name!r}; close() it first")
        self._peer_name = peer_pool_name
        try:
            self._refresh_peer()
        except FileNotFoundError:
            pass

    def open_remote(self, descriptor: PeerDescriptor) -> None:
        """Attach a peer known by its descriptor (another host: it came through the control plane).
        Raises ValueError for a geometry that cannot feed the local pool."""
        fields = ("num_layers", "block_tokens", "num_kv_heads", "head_dim", "elem_bytes")
        diff = [f"{f}: local {getattr(self.local, f)} vs peer {getattr(descriptor, f)}" for f in fields
                if getattr(self.local, f) != getattr(descriptor, f)]
        local_dtype = str(self.local.dtype).removeprefix("torch.")
        if local_dtype != descriptor.dtype:
            diff.append(f"dtype: local {local_dtype} vs peer {descriptor.dtype}")
        if diff:
            raise ValueError(f"Mooncake peer {descriptor.session_id} cannot feed {self.local.name!r}: "
                             + "; ".join(diff))
        self.peer = descriptor

    def _refresh_peer(self) -> None:
        """Re-read the local descriptor when it was republished (a restarted prefill actor)."""
        name = descriptor_name(self._peer_name)
        if self._desc_mm is None:
            self._desc_mm = _shm.attach_segment(name, readonly=True)
        if _SEQ.unpack_from(self._desc_mm, 8)[0] == self._peer_seq:
            return
        seq, descriptor = read_descriptor(self._desc_mm, name)
        if seq != self._peer_seq:
            self.open_remote(descriptor)
            self._peer_seq = seq

    # -- copies -------------------------------------------------------------------------------------------

    def _batch(self, src: list[int], dst: list[int]) -> tuple[list[int], list[int], list[int]]:
        """(local addresses, peer addresses, lengths): one entry per K/V plane of every layer per run."""
        peer, local = self.peer, self.local
        plane_block_bytes = local.block_bytes // (2 * local.num_layers)  # one block of one layer's K (or V)
        local_plane, peer_plane = local.num_blocks * plane_block_bytes, peer.num_blocks * plane_block_bytes
        dst_addrs, src_addrs, lengths = [], [], []
        for s0, d0, n in sorted(_contiguous_runs(src, dst)):
            for plane in range(2 * local.num_layers):
                dst_addrs.append(self._addr + plane * local_plane + d0 * plane_block_bytes)
                src_addrs.append(peer.base_addr + plane * peer_plane + s0 * plane_block_bytes)
                lengths.append(n * plane_block_bytes)
        return dst_addrs, src_addrs, lengths

    def start_copy(self, src_block_ids: Sequence[int], dst_block_ids: Sequence[int], *,
                   num_tokens: int) -> int:
        if self._peer_name is None and self.peer is None:
            raise RuntimeError("MooncakeTransport.start_copy before open_peer()")
        handle = next(self._ids)
        if self._peer_name is not None:
            try:
                self._refresh_peer()
            except (FileNotFoundError, ValueError) as exc:
                self._handles[handle] = TransferStatus.FAILED
                self._errors[handle] = f"{type(exc).__name__}: {exc}"
                return handle
        src, dst = validate_copy(src_block_ids, dst_block_ids, num_tokens, block_tokens=self.local.block_tokens,
                                 src_blocks=self.peer.num_blocks, dst_blocks=self.local.num_blocks)
        self._handles[handle] = TransferStatus.IN_PROGRESS
        self._nbytes[handle] = int(src.size) * self.local.block_bytes
        if src.size:
            batch = self._batch(src.tolist(), dst.tolist())
            self._futures[handle] = self._engine.worker.submit(
                self._engine.engine.batch_transfer_sync_read, self.peer.session_id, *batch)
        else:
            self._handles[handle] = TransferStatus.DONE
        return handle

    def poll(self, handle: int) -> TransferStatus:
        status = self._recorded_status(handle)
        if status is TransferStatus.IN_PROGRESS:
            future = self._futures[handle]
            if not future.done():
                return status
            del self._futures[handle]
            exc = future.exception()
            rc = None if exc is not None else future.result()
            if rc == 0:
                self._bytes_total += self._nbytes.pop(handle, 0)
                status = TransferStatus.DONE
            else:
                status = TransferStatus.FAILED
                self._errors[handle] = (f"{type(exc).__name__}: {exc}" if exc is not None else
                                        f"Mooncake batch_transfer_sync_read from {self.peer.session_id} "
                                        f"returned {rc} (peer gone, or MC_TRANSFER_TIMEOUT)")
            self._handles[handle] = status
        return status

    def release(self, handle: int) -> None:
        """Forget ``handle``. A read still in flight cannot be cancelled: it is kept until it ends, and every
        transfer started afterwards completes after it (one FIFO worker per process), so blocks it writes
        that decode reallocates are rewritten before they are read."""
        future = self._futures.pop(handle, None)
        if future is not None and not future.done():
            self._orphans.append(future)
        self._handles.pop(handle, None)
        self._errors.pop(handle, None)
        self._nbytes.pop(handle, None)
        self._orphans = [f for f in self._orphans if not f.done()]

    def error(self, handle: int) -> str | None:
        return self._errors.get(handle)

    @property
    def bytes_moved_total(self) -> int:
        return self._bytes_total

    @property
    def in_flight(self) -> int:
        """Reads submitted and not finished, released ones included."""
        return sum(not f.done() for f in itertools.chain(self._futures.values(), self._orphans))

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for this transport's reads in flight (so none writes into a pool being dropped; each ends
        within Mooncake's transfer timeout), then forget the peer and unregister the local pool (idempotent).
        Raises TimeoutError if ``timeout_s`` passes first (the registration is then kept)."""
        pending = [f for f in itertools.chain(self._futures.values(), self._orphans) if not f.done()]
        if pending:
            _, not_done = concurrent.futures.wait(pending, timeout=timeout_s)
            if not_done:
                raise TimeoutError(f"{len(not_done)} Mooncake reads still in flight after {timeout_s} s")
        self._futures.clear()
        self._orphans = []
        self._handles.clear()
        self._errors.clear()
        self._nbytes.clear()
        self.peer, self._peer_name, self._peer_seq = None, None, -1
        _shm.close_mapping(self._desc_mm)
        self._desc_mm = None
        if self._registered:
            self._registered = False
            self._engine.unregister(self._addr)


register_transport("mooncake", MooncakeTransport)
register_source("mooncake", MooncakeSource)
