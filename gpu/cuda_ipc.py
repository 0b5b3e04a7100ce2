"""The ``cuda-ipc`` KV transport (decode pulls KV blocks out of the prefill actor's GPU pool through CUDA IPC)
and its CPU twin ``torch-ipc`` (the same code over CPU tensor pools, so CI runs it with real processes).

| name                          | what                                                                       |
|-------------------------------|----------------------------------------------------------------------------|
| export segment I/O            | ``open_export_segment`` / ``write_export`` (seqlock) / ``read_export``     |
| ``CudaSeam`` / ``CpuSeam``    | the one seam: where the pool lives, how its storage shares, events, streams |
| ``allocate_device_pool``      | an actor's pool tensor, registered for ``make_transport``                   |
| ``PoolExport``                | prefill side: publish once, ``record_written`` after each forward          |
| ``CudaIpcExport``/``TorchIpcExport`` | ``PoolExport`` over each seam; ``publish_export(kind, pool, kv)``   |
| ``PoolTransport``             | decode side: open the export, copy on a side stream, poll, reopen on epoch  |
| ``CudaIpcTransport``/``TorchIpcTransport`` | registered as ``cuda-ipc`` / ``torch-ipc``                   |

The CPU twin differs only behind its seam: the storage is shared by torch's ``file_system`` strategy (the payload
names a ``/torch_<pid>_...`` shm file and torch's ``torch_shm_manager`` socket; a file-descriptor payload would
need a live connection to the exporter), there is no 'written' event (a CPU forward has written its KV when it
returns), and a copy runs on a one-thread host stream whose future stands in for the CUDA event.

How the pieces fit (design.md, "One process-actor per device"):

* Each actor keeps its KV cache in a device tensor of exactly its ``KVPool``'s shape and dtype
  (``[num_layers, 2, num_blocks, block_tokens, num_kv_heads, head_dim]``). The ``KVPool`` shm segment stays
  the KV *table*: block owners and generations (the allocator), the epoch, the geometry; its data section is
  unused on this path.
* The prefill actor exports its device pool ONCE at start-up (:meth:`CudaIpcExport.publish`): torch's CUDA
  IPC reduction of the tensor (``torch.multiprocessing.reductions.reduce_tensor``: ``cudaIpcGetMemHandle`` of
  the allocation plus offsets and torch's producer ref-counter) and the IPC handle of an interprocess CUDA
  event go, pickled, into a small shm segment named ``<pool name>.cuda`` (layout below).
* The decode actor's transport opens it ONCE (``open_peer``: ``rebuild_cuda_tensor`` ->
  ``cudaIpcOpenMemHandle``), then every ``start_copy`` is one batched launch on a side stream: the
  gather/scatter kernel of ``gpu/kernels/kv_copy.py`` (all layers, K and V, every block of the request), or
  ``index_select`` + ``index_copy_`` when numba is unavailable. Block ids and token counts travel in the
  messages and the KV table, as with ``cpu-shm``; the data never leaves the GPU.
* Ordering. Prefill -> decode: prefill records the shared event after writing a request's KV
  (:meth:`CudaIpcExport.record_written`, before it sends ``KVReady``) and the copy stream waits on that event
  before reading, so decode never reads blocks prefill has not finished writing. (Prefill's first-token
  sampling also synchronises its stream; the event keeps the guarantee if that ever changes.) Decode ->
  prefill: each copy records a local event, and ``poll`` reports DONE only once that event has completed;
  decode sends ``TransferDone`` (after which prefill frees the blocks) only after DONE, so prefill never
  frees blocks decode is still reading.
* Two GPUs: a cross-device copy gathers on the prefill GPU, copies peer-to-peer (``Tensor.to``, which uses
  P2P when ``torch.cuda.can_device_access_peer``), and scatters on the decode GPU: three launches, still no
  loop over blocks.
* Restart: a restarted prefill actor resets its pool (the KV table's epoch goes up) and publishes again;
  ``start_copy`` notices the epoch change and reopens the export before copying (a transfer that finds the
  pool not yet re-exported FAILS with the reason; the supervisor has already failed the old requests).

Export segment ``<pool name>.cuda`` (torch-ipc: ``<pool name>.tipc``; ``EXPORT_HEADER``, little endian)::

    offset  size  field
    0       4     magic         b"PDCX"
    4       4     version       u4 = 1
    8       8     seq           u8  seqlock: odd while the exporter writes, +2 per publish
    16      8     pool_epoch    u8  the KVPool epoch the export belongs to
    24      4     pid           i4  exporter pid
    28      4     device        i4  exporter's CUDA device index (-1: a CPU pool)
    32      8     payload_len   u8
    40      8     history_len   u8
    64      ...   payload       pickle: {"tensor": (rebuild_fn, args), "event": bytes | None,
                                         "shape": tuple, "dtype": str}
    32768   ...   history       every shm file a publish of this segment shared (torch-ipc), NUL-separated

The history is what makes the CPU twin's files go at engine stop whatever happened: a SIGKILLed exporter's file
stays mapped by the readers until they exit (torch's shm manager would unlink it only once all its clients are
gone, and not at all if it is killed with the engine's process group), so the supervisor unlinks every file
listed, after its actors exited (``unlink_exported_files``).

The exporting actor creates (or reuses, after a restart) and rewrites it; ``CudaIpcExport.close(unlink=True)``
or the supervisor's ``naming.unlink_all`` removes it (its name carries the engine id).
"""
from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import pickle
import struct
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any, Sequence

import numpy as np
import posix_ipc
import torch

from ipc.kv_pool import KVPool
from ipc.kv_transport import KVTransport, TransferStatus, attach_peer_pool, register_transport, validate_copy

MAGIC = b"PDCX"
VERSION = 1
EXPORT_HEADER = struct.Struct("<4sIQQiiQQ")
OFF_SEQ = 8
U8 = struct.Struct("<Q")
PAYLOAD_OFFSET = 64
EXPORT_BYTES = 64 * 1024
HISTORY_OFFSET = EXPORT_BYTES // 2
EXPORT_SUFFIX = ".cuda"


def export_name(pool_name: str, suffix: str = EXPORT_SUFFIX) -> str:
    """POSIX name of the export segment of KV pool ``pool_name`` (same engine prefix: swept with it):
    ``<pool>.cuda`` for cuda-ipc, ``<pool>.tipc`` for torch-ipc."""
    return pool_name + suffix


# ------------------------------------------------------------------------------------------------ segment I/O


@dataclass(frozen=True)
class ExportRecord:
    """One consistent read of an export segment."""

    seq: int
    pool_epoch: int
    pid: int
    device: int
    payload: bytes
    files: tuple[str, ...] = ()


def open_export_segment(name: str, *, create: bool) -> mmap.mmap:
    """Map the export segment ``name`` (``EXPORT_BYTES``), creating it (mode 0600) if ``create`` and absent.
    Raises FileNotFoundError if it does not exist and ``create`` is False."""
    flags = posix_ipc.O_CREAT if create else 0
    try:
        shm = posix_ipc.SharedMemory(name, flags, mode=0o600, size=EXPORT_BYTES if create else 0)
    except posix_ipc.ExistentialError as exc:
        raise FileNotFoundError(f"KV pool export {name!r} does not exist: the prefill actor has not "
                                f"published its pool tensor (yet: it publishes at start-up, with kv_transport "
                                f"cuda-ipc or torch-ipc)") from exc
    try:
        if shm.size < EXPORT_BYTES:
            if not create:
                raise ValueError(f"segment {name!r} is {shm.size} bytes, not a CUDA IPC export")
            os.ftruncate(shm.fd, EXPORT_BYTES)
        return mmap.mmap(shm.fd, EXPORT_BYTES)
    finally:
        shm.close_fd()


def _history(mm: mmap.mmap, n: int) -> tuple[str, ...]:
    raw = bytes(mm[HISTORY_OFFSET:HISTORY_OFFSET + n]) if 0 < n <= EXPORT_BYTES - HISTORY_OFFSET else b""
    return tuple(f.decode() for f in raw.split(b"\0") if f)


def write_export(mm: mmap.mmap, payload: bytes, *, pool_epoch: int, pid: int, device: int,
                 files: Sequence[str] = ()) -> int:
    """Publish ``payload`` under the seqlock (seq odd while writing); returns the new (even) seq. ``files``: the
    shm files this publish shares, added to the segment's history. One writer only (the exporting actor). Raises
    ValueError if the payload or the history does not fit."""
    if len(payload) > HISTORY_OFFSET - PAYLOAD_OFFSET:
        raise ValueError(f"KV pool export payload of {len(payload)} bytes exceeds {HISTORY_OFFSET - PAYLOAD_OFFSET}")
    initialised = mm[0:4] == MAGIC
    seq = U8.unpack_from(mm, OFF_SEQ)[0] if initialised else 0
    old = _history(mm, EXPORT_HEADER.unpack_from(mm, 0)[7]) if initialised else ()
    history = b"\0".join(f.encode() for f in dict.fromkeys(old + tuple(files)))
    if len(history) > EXPORT_BYTES - HISTORY_OFFSET:
        raise ValueError(f"KV pool export history of {len(history)} bytes exceeds {EXPORT_BYTES - HISTORY_OFFSET}")
    seq += 1 if seq % 2 == 0 else 0  # odd: readers retry
    EXPORT_HEADER.pack_into(mm, 0, MAGIC, VERSION, seq, pool_epoch, pid, device, len(payload), len(history))
    mm[PAYLOAD_OFFSET:PAYLOAD_OFFSET + len(payload)] = payload
    mm[HISTORY_OFFSET:HISTORY_OFFSET + len(history)] = history
    U8.pack_into(mm, OFF_SEQ, seq + 1)  # even: stable (x86 stores are not reordered with earlier stores)
    return seq + 1


def read_export(mm: mmap.mmap, *, timeout_s: float = 2.0) -> ExportRecord:
    """A consistent snapshot of an export segment: retried (polling until ``timeout_s``) while a publish is
    in progress. Raises ValueError for a segment that is not an export, TimeoutError if the writer seems to
    have died mid-publish (seq stays odd)."""
    deadline = time.monotonic() + timeout_s
    while True:
        magic, version, seq, epoch, pid, device, n, h = EXPORT_HEADER.unpack_from(mm, 0)
        if magic != MAGIC and seq == 0:
            raise ValueError("segment is not an initialised KV pool export")
        if seq % 2 == 0:
            if version != VERSION:
                raise ValueError(f"KV pool export of layout version {version}; this build reads {VERSION}")
            if n > HISTORY_OFFSET - PAYLOAD_OFFSET:
                raise ValueError(f"KV pool export claims a payload of {n} bytes")
            payload = bytes(mm[PAYLOAD_OFFSET:PAYLOAD_OFFSET + n])
            files = _history(mm, h)
            if U8.unpack_from(mm, OFF_SEQ)[0] == seq:
                return ExportRecord(seq, epoch, pid, device, payload, files)
        if time.monotonic() > deadline:
            raise TimeoutError(f"KV pool export stayed mid-publish (seq {seq}) for {timeout_s}s: its writer "
                               f"(pid {pid}) probably died while publishing")
        time.sleep(0.001)


def unlink_exported_files(name: str) -> list[str]:
    """Unlink every shm file export segment ``name`` lists in its history (the supervisor, at stop, once the
    actors that mapped them have exited); returns the names unlinked. A missing segment or file is no error."""
    try:
        mm = open_export_segment(name, create=False)
    except (FileNotFoundError, ValueError):
        return []
    try:
        files = read_export(mm, timeout_s=0.1).files
    except (ValueError, TimeoutError):
        files = _history(mm, EXPORT_HEADER.unpack_from(mm, 0)[7])   # a writer killed mid-publish: best effort
    finally:
        mm.close()
    gone = []
    for f in files:
        try:
            posix_ipc.unlink_shared_memory(f)
            gone.append(f)
        except posix_ipc.ExistentialError:
            pass
    return gone


# ----------------------------------------------------------------------------------------------------- seams
# What differs between a CUDA pool and a CPU pool: where the tensor lives, how its storage is shared, the 'KV
# written' event and the stream a copy runs on. Everything else (export segment, epochs, handles, polling,
# release of copies in flight) is one code path in PoolExport and PoolTransport below.


class _HostDone:
    """The CPU twin of a recorded CUDA event: the future of a copy queued on a host stream."""

    def __init__(self, future: Future | None = None):
        self.future = future

    def query(self) -> bool:
        return self.future is None or self.future.done()

    def error(self) -> str | None:
        exc = self.future.exception() if self.future is not None and self.future.done() else None
        return None if exc is None else f"{type(exc).__name__}: {exc}"


class _HostStream:
    """The CPU twin of a CUDA side stream: one worker thread runs the copies queued on it, in order, while the
    actor's loop goes on (torch's copy kernels release the GIL)."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-copy")

    def submit(self, fn, *args) -> _HostDone:
        return _HostDone(self._pool.submit(fn, *args))

    def synchronize(self) -> None:
        self._pool.submit(lambda: None).result()


class CudaSeam:
    """CUDA pools: ``cudaIpcGetMemHandle`` through ``reduce_tensor``, interprocess events, side streams."""

    kind = "cuda-ipc"
    suffix = ".cuda"
    where = "CUDA tensor"

    @staticmethod
    def missing() -> str | None:
        """Why this seam cannot run in this process (None: it can)."""
        if torch.cuda.is_available():
            return None
        return ("KV transport cuda-ipc needs a CUDA device and torch built with CUDA; on CPU use kv_transport "
                "cpu-shm (or torch-ipc, its CPU twin)")

    @staticmethod
    def holds(t: torch.Tensor) -> bool:
        return _on_gpu(t)

    @staticmethod
    def sharing():
        return contextlib.nullcontext()

    @staticmethod
    def device_index(kv: torch.Tensor) -> int:
        return kv.device.index if kv.device.index is not None else torch.cuda.current_device()

    @staticmethod
    def shared_files(kv: torch.Tensor) -> list[str]:
        return []  # CUDA IPC maps device memory: nothing in /dev/shm

    @staticmethod
    def written_event(kv: torch.Tensor):
        """``(event, ipc handle)``: an interprocess event recorded once on the pool's current stream."""
        with torch.cuda.device(CudaSeam.device_index(kv)):
            event = torch.cuda.Event(interprocess=True)  # interprocess events cannot time
            event.record(torch.cuda.current_stream(CudaSeam.device_index(kv)))
            return event, event.ipc_handle()

    @staticmethod
    def record(event, kv: torch.Tensor, stream) -> None:
        event.record(stream if stream is not None else torch.cuda.current_stream(kv.device))

    @staticmethod
    def open_event(src: torch.Tensor, handle):
        return torch.cuda.Event.from_ipc_handle(src.device, handle) if handle else None

    @staticmethod
    def stream(device):
        return torch.cuda.Stream(device)

    @staticmethod
    def finished(done) -> tuple[bool, str | None]:
        return bool(done.query()), None


class CpuSeam:
    """The CPU twin (``torch-ipc``): the pool's storage shared through POSIX shm by torch's ``file_system``
    strategy (``reduce_tensor`` + ``rebuild_storage_filename``: a name, not a file descriptor, so the payload
    can wait in the export segment for any reader; torch's ``torch_shm_manager`` unlinks the file once every
    process that mapped it has exited, SIGKILL included); no event (a CPU forward has written its KV when it
    returns); copies on a ``_HostStream``."""

    kind = "torch-ipc"
    suffix = ".tipc"
    where = "CPU tensor"

    @staticmethod
    def missing() -> str | None:
        return None

    @staticmethod
    def holds(t: torch.Tensor) -> bool:
        return t.device.type == "cpu"

    @staticmethod
    @contextlib.contextmanager
    def sharing():
        """torch's ``file_system`` strategy while a payload is pickled. The first share of a process starts its
        ``torch_shm_manager`` (fork + exec): the fds this process inherited are made close-on-exec meanwhile, so
        the manager, which outlives a SIGKILLed exporter while readers map its files, does not hold the
        supervisor's sentinel pipe open (the supervisor would not see the actor die, nor restart it)."""
        import torch.multiprocessing as tmp  # noqa: PLC0415  (registers the storage reductions)

        previous = tmp.get_sharing_strategy()
        tmp.set_sharing_strategy("file_system")
        inherited = _inheritable_fds()
        for fd in inherited:
            os.set_inheritable(fd, False)
        try:
            yield
        finally:
            for fd in inherited:
                os.set_inheritable(fd, True)
            tmp.set_sharing_strategy(previous)

    @staticmethod
    def device_index(kv: torch.Tensor) -> int:
        return -1

    @staticmethod
    def shared_files(kv: torch.Tensor) -> list[str]:
        """The shm file ``kv``'s storage lives in once shared (``/torch_<pid>_...``)."""
        return [kv.untyped_storage()._share_filename_cpu_()[1].decode()]

    @staticmethod
    def written_event(kv: torch.Tensor):
        return None, None

    @staticmethod
    def record(event, kv: torch.Tensor, stream) -> None:
        pass

    @staticmethod
    def open_event(src: torch.Tensor, handle):
        return None

    @staticmethod
    def stream(device):
        return _HostStream()

    @staticmethod
    def finished(done) -> tuple[bool, str | None]:
        return done.query(), done.error() if done.query() else None


def _inheritable_fds() -> list[int]:
    """This process's open fds above stderr that a child it forks and execs would inherit."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if fd > 2 and os.get_inheritable(fd):
                out.append(fd)
        except OSError:  # the listing's own fd, closed by now
            pass
    return out


def _on_gpu(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on a CUDA device (one seam, so the CPU tests can run the CUDA transport logic)."""
    return t.is_cuda


# ----------------------------------------------------------------------------------------------- device pools

_DEVICE_POOLS: dict[str, torch.Tensor] = {}
_LOCAL_EXPORTS: dict[str, tuple[torch.Tensor, Any]] = {}  # export name -> (tensor, event), this process


def allocate_device_pool(pool: KVPool, device: str | torch.device) -> torch.Tensor:
    """A zeroed tensor of ``pool``'s shape and dtype on ``device`` (``cuda:N`` for cuda-ipc, ``cpu`` for
    torch-ipc), registered for ``pool.name`` so that ``make_transport(kind, pool)`` finds it. Zeroed, not
    empty: masked-out padding reads of the torch attention path must read finite values."""
    kv = torch.zeros(pool.shape, dtype=pool.dtype, device=device)
    register_device_pool(pool.name, kv)
    return kv


def register_device_pool(pool_name: str, kv: torch.Tensor) -> None:
    """Declare ``kv`` as the tensor data of KV pool ``pool_name`` in this process (the transport checks that
    it lives where its kind needs it)."""
    _DEVICE_POOLS[pool_name] = kv


def device_pool(pool_name: str) -> torch.Tensor | None:
    """The tensor registered for ``pool_name`` in this process, if any."""
    return _DEVICE_POOLS.get(pool_name)


def check_device_pool(pool: KVPool, kv: torch.Tensor, what: str, seam=CudaSeam) -> None:
    """Raise ValueError unless ``kv`` is a contiguous tensor of ``pool``'s shape and dtype where ``seam``
    keeps its pools (CUDA by default)."""
    if tuple(kv.shape) != tuple(pool.shape) or kv.dtype != pool.dtype:
        raise ValueError(f"{what}: device tensor {list(kv.shape)} {kv.dtype} does not match KV pool "
                         f"{pool.name!r} {list(pool.shape)} {pool.dtype}")
    if not seam.holds(kv) or not kv.is_contiguous():
        raise ValueError(f"{what}: the KV pool of {seam.kind} must be a contiguous {seam.where} "
                         f"(got one on {kv.device})")


class PoolExport:
    """The prefill side: publishes its pool tensor once, and records the 'KV written' event.

    Use: ``export = CudaIpcExport.publish(pool, kv)`` (or ``TorchIpcExport``) in ``on_start``;
    ``export.record_written()`` after each prefill forward, before sending ``KVReady``; ``export.close()`` at
    stop. Keep ``kv`` alive while the export exists (importers map its memory).
    """

    seam: Any = CudaSeam

    def __init__(self, name: str, mm: mmap.mmap, kv: torch.Tensor, event, seq: int):
        self.name = name
        self._mm = mm
        self.kv = kv
        self.event = event
        self.seq = seq

    @classmethod
    def publish(cls, pool: KVPool, kv: torch.Tensor) -> "PoolExport":
        """Export ``kv`` (the tensor data of ``pool``) into segment ``<pool.name><seam.suffix>``, created if
        absent, rewritten if a previous incarnation left it. Raises ValueError for a tensor that does not match
        the pool."""
        from torch.multiprocessing.reductions import reduce_tensor  # noqa: PLC0415

        seam = cls.seam
        check_device_pool(pool, kv, f"{cls.__name__}.publish", seam)
        event, handle = seam.written_event(kv)
        with seam.sharing():
            payload = bytes(ForkingPickler.dumps({"tensor": reduce_tensor(kv), "event": handle,
                                                  "shape": tuple(kv.shape), "dtype": str(kv.dtype)},
                                                 protocol=pickle.HIGHEST_PROTOCOL))
        name = export_name(pool.name, seam.suffix)
        mm = open_export_segment(name, create=True)
        seq = write_export(mm, payload, pool_epoch=pool.epoch, pid=os.getpid(), device=seam.device_index(kv),
                           files=seam.shared_files(kv))
        _LOCAL_EXPORTS[name] = (kv, event)
        return cls(name, mm, kv, event, seq)

    def record_written(self, stream=None) -> None:
        """Mark 'every KV write enqueued so far on ``stream`` (default: the current one) is ordered before
        any copy that starts after this call'. Call after a prefill forward, before sending KVReady."""
        self.seam.record(self.event, self.kv, stream)

    def close(self, *, unlink: bool = False) -> None:
        """Stop exporting in this process (idempotent); ``unlink`` also removes the segment."""
        _LOCAL_EXPORTS.pop(self.name, None)
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        if unlink:
            try:
                posix_ipc.unlink_shared_memory(self.name)
            except posix_ipc.ExistentialError:
                pass


class CudaIpcExport(PoolExport):
    seam = CudaSeam


class TorchIpcExport(PoolExport):
    seam = CpuSeam


EXPORTS = {CudaSeam.kind: CudaIpcExport, CpuSeam.kind: TorchIpcExport}


# -------------------------------------------------------------------------------------------------- transport


class ExportNotReady(RuntimeError):
    """The peer's export is missing, not yet written, or of an older pool epoch: its prefill actor is starting
    or restarting (a copy asked for meanwhile FAILS with this reason)."""


@dataclass
class _Pending:
    done: Any  # torch.cuda.Event recorded after the copy, or the _HostDone of a host-stream copy
    nbytes: int
    keep: tuple = field(default=())  # tensors the copy reads: alive until it completed


class PoolTransport(KVTransport):
    """KV handoff between two tensor pools, the source exported by :class:`PoolExport` (module docstring).
    Runs in the decode actor.

    Args:
        local_pool: the decode actor's KV table (attached writable: it owns the allocator).
        device_kv: its tensor data; default: the tensor registered for ``local_pool.name``
            (:func:`allocate_device_pool` / :func:`register_device_pool`).
        copy_backend: ``"numba"`` (CUDA only: the one-launch gather/scatter kernel), ``"torch"``
            (index_select + index_copy_), or ``"auto"`` (numba when it can run here).

    ``start_copy`` enqueues and returns (the copy runs on a side stream, overlapping the decode step);
    ``poll`` is non-blocking. Raises RuntimeError at construction where the seam cannot run.
    """

    seam: Any = CudaSeam

    def __init__(self, local_pool: KVPool, *, device_kv: torch.Tensor | None = None,
                 copy_backend: str = "auto"):
        seam = self.seam
        if seam.missing():
            raise RuntimeError(seam.missing())
        if local_pool.readonly:
            raise ValueError(f"the local (destination) pool {local_pool.name!r} must be attached writable")
        kv = device_kv if device_kv is not None else device_pool(local_pool.name)
        if kv is None:
            raise RuntimeError(f"no device tensor for KV pool {local_pool.name!r} in this process: call "
                               f"gpu.cuda_ipc.allocate_device_pool(pool, device) before make_transport")
        check_device_pool(local_pool, kv, type(self).__name__, seam)
        self.copy_backend = self._backend(copy_backend)
        self.local = local_pool
        self.peer: KVPool | None = None
        self._dst = kv
        self._src: torch.Tensor | None = None
        self._src_event = None
        self._export_mm: mmap.mmap | None = None
        self._export_epoch = -1
        self._stream = seam.stream(kv.device)
        self._src_stream = None  # a stream on the peer's device when it is another GPU
        self._handles: dict[int, TransferStatus] = {}
        self._pending: dict[int, _Pending] = {}
        self._orphans: list[_Pending] = []  # released while in flight: kept until their copy completes
        self._errors: dict[int, str] = {}
        self._ids = itertools.count(1)
        self._bytes_total = 0

    def _backend(self, copy_backend: str) -> str:
        if copy_backend not in ("auto", "numba", "torch"):
            raise ValueError(f"copy_backend {copy_backend!r}: use auto, numba or torch")
        if self.seam is CpuSeam:
            if copy_backend == "numba":
                raise ValueError("copy_backend 'numba': the numba copy kernel runs on CUDA; torch-ipc uses torch")
            return "torch"
        if copy_backend == "auto":
            from gpu.exec_cuda import cuda_device_available  # noqa: PLC0415  (the one door to gpu.kernels)

            return "numba" if cuda_device_available() else "torch"
        return copy_backend

    # -- peer -------------------------------------------------------------------------------------------

    def open_peer(self, peer_pool_name: str) -> None:
        if self.peer is not None:
            if self.peer.name == peer_pool_name:
                return
            raise ValueError(f"transport already attached to peer {self.peer.name!r}; close() it first")
        peer = attach_peer_pool(self.local, peer_pool_name)
        try:
            self.peer = peer
            self._open_export()
        except ExportNotReady:
            pass  # the prefill actor is still starting: the first start_copy opens it (it sends KVReady after)
        except BaseException:
            self.peer = None
            peer.close()
            raise

    def _open_export(self) -> None:
        """(Re)map the peer's exported pool and event."""
        assert self.peer is not None
        name = export_name(self.peer.name, self.seam.suffix)
        try:
            if self._export_mm is None:
                self._export_mm = open_export_segment(name, create=False)
            record = read_export(self._export_mm)
            if record.pool_epoch != self.peer.epoch:
                # A restarted prefill resets its pool before publishing; a stale mapping (old segment unlinked
                # and re-created) must be dropped and the name opened again.
                self._export_mm.close()
                self._export_mm = None
                self._export_mm = open_export_segment(name, create=False)
                record = read_export(self._export_mm)
        except FileNotFoundError as exc:
            raise ExportNotReady(str(exc)) from None
        except ValueError as exc:  # created, not yet written
            raise ExportNotReady(f"{name!r}: {exc}") from None
        if record.pool_epoch != self.peer.epoch:
            raise ExportNotReady(f"the prefill pool {self.peer.name!r} is at epoch {self.peer.epoch} but its "
                                 f"{self.seam.kind} export is of epoch {record.pool_epoch}: the restarted prefill "
                                 f"actor has not published yet")
        if record.pid == os.getpid() and name in _LOCAL_EXPORTS:
            src, event = _LOCAL_EXPORTS[name]  # CUDA cannot open an IPC handle in the process that made it
        else:
            meta = pickle.loads(record.payload)  # a CPU storage is mapped here (rebuild_storage_filename)
            rebuild, args = meta["tensor"]
            src = rebuild(*args)
            event = self.seam.open_event(src, meta["event"])
        check_device_pool(self.peer, src, f"{type(self).__name__}.open_peer (exported tensor)", self.seam)
        self._src, self._src_event, self._export_epoch = src, event, record.pool_epoch
        if src.device != self._dst.device and self._src_stream is None:
            self._src_stream = self.seam.stream(src.device)

    # -- copies -----------------------------------------------------------------------------------------

    def start_copy(self, src_block_ids: Sequence[int], dst_block_ids: Sequence[int], *,
                   num_tokens: int) -> int:
        if self.peer is None:
            raise RuntimeError(f"{type(self).__name__}.start_copy before open_peer()")
        src, dst = validate_copy(src_block_ids, dst_block_ids, num_tokens,
                                 block_tokens=self.local.block_tokens, src_blocks=self.peer.num_blocks,
                                 dst_blocks=self.local.num_blocks)
        handle = next(self._ids)
        try:
            if self.peer.epoch != self._export_epoch:
                self._open_export()
            done, keep = self._enqueue(src, dst)
        except Exception as exc:  # noqa: BLE001 - a failed launch/IPC open is this transfer's failure
            self._handles[handle] = TransferStatus.FAILED
            self._errors[handle] = f"{type(exc).__name__}: {exc}"
            return handle
        self._handles[handle] = TransferStatus.IN_PROGRESS
        self._pending[handle] = _Pending(done, int(src.size) * self.local.block_bytes, keep)
        return handle

    def _enqueue(self, src: np.ndarray, dst: np.ndarray) -> tuple[Any, tuple]:
        """Queue the copy on the side stream; returns ``(done, what must stay alive until it completes)``."""
        if self.seam is CpuSeam:
            s_ids, d_ids, src_kv, dst_kv = torch.from_numpy(src), torch.from_numpy(dst), self._src, self._dst
            if not src.size:
                return _HostDone(), ()
            return self._stream.submit(lambda: dst_kv.index_copy_(2, d_ids, src_kv.index_select(2, s_ids))), ()
        keep = self._enqueue_cuda(src, dst) if src.size else ()
        done = torch.cuda.Event()
        done.record(self._stream)
        return done, keep

    def _enqueue_cuda(self, src: np.ndarray, dst: np.ndarray) -> tuple:
        """Enqueue the copy on the CUDA side stream (after the prefill's 'written' event); returns what must
        stay alive until it completes."""
        dst_dev = self._dst.device
        s_host = torch.from_numpy(src)
        d_host = torch.from_numpy(dst)
        if self._src.device == dst_dev:
            with torch.cuda.device(dst_dev), torch.cuda.stream(self._stream):
                if self._src_event is not None:
                    self._stream.wait_event(self._src_event)
                sid = s_host.to(dst_dev, non_blocking=True)
                did = d_host.to(dst_dev, non_blocking=True)
                if self.copy_backend == "numba":
                    from gpu.exec_cuda import copy_blocks  # noqa: PLC0415  (the one door to gpu.kernels)

                    copy_blocks(self._src, self._dst, sid, did)
                else:
                    self._dst.index_copy_(2, did, self._src.index_select(2, sid))
                return (sid, did)
        # two GPUs: gather on the source GPU, copy peer-to-peer, scatter on the destination GPU
        src_dev = self._src.device
        with torch.cuda.stream(self._src_stream), torch.cuda.stream(self._stream):
            if self._src_event is not None:
                self._src_stream.wait_event(self._src_event)
            with torch.cuda.device(src_dev):
                sid = s_host.to(src_dev, non_blocking=True)
                staging = self._src.index_select(2, sid)  # [L, 2, n, bt, Hkv, D] on the source GPU
            staged = staging.to(dst_dev, non_blocking=True)  # syncs both current streams (torch's P2P copy)
            with torch.cuda.device(dst_dev):
                did = d_host.to(dst_dev, non_blocking=True)
                self._dst.index_copy_(2, did, staged)
        return (sid, staging, staged, did)

    def poll(self, handle: int) -> TransferStatus:
        status = self._recorded_status(handle)
        if status is TransferStatus.IN_PROGRESS:
            pending = self._pending[handle]
            finished, error = self.seam.finished(pending.done)
            if finished:
                del self._pending[handle]
                if error is None:
                    self._bytes_total += pending.nbytes
                    status = self._handles[handle] = TransferStatus.DONE
                else:
                    self._errors[handle] = error
                    status = self._handles[handle] = TransferStatus.FAILED
        return status

    def release(self, handle: int) -> None:
        """Forget ``handle``. Releasing a transfer still in flight keeps its buffers until it completes (the
        stream still runs it); the blocks it writes must not be reused before (decode frees them only after
        DONE or when the request is final, and then reallocates on the same stream order)."""
        pending = self._pending.pop(handle, None)
        if pending is not None and not pending.done.query():
            self._orphans.append(pending)
        self._handles.pop(handle, None)
        self._errors.pop(handle, None)
        self._orphans = [p for p in self._orphans if not p.done.query()]

    def error(self, handle: int) -> str | None:
        return self._errors.get(handle)

    @property
    def bytes_moved_total(self) -> int:
        return self._bytes_total

    def close(self) -> None:
        """Wait for copies in flight (so no copy reads a peer mapping we drop), then detach (idempotent)."""
        if self._pending or self._orphans:
            self._stream.synchronize()
        self._pending.clear()
        self._orphans = []
        self._handles.clear()
        self._errors.clear()
        self._src = None
        self._src_event = None
        if self._export_mm is not None:
            self._export_mm.close()
            self._export_mm = None
        if self.peer is not None:
            self.peer.close()
            self.peer = None


class CudaIpcTransport(PoolTransport):
    """:class:`PoolTransport` between two GPU pools through CUDA IPC."""

    kind = "cuda-ipc"
    seam = CudaSeam


class TorchIpcTransport(PoolTransport):
    """:class:`PoolTransport` between two CPU tensor pools: the CPU twin of ``cuda-ipc``."""

    kind = "torch-ipc"
    seam = CpuSeam


def publish_export(kind: str, pool: KVPool, kv: torch.Tensor) -> PoolExport:
    """The prefill actor's start-up for ``kind`` (cuda-ipc or torch-ipc): export ``kv``. Raises ValueError for
    another kind."""
    try:
        return EXPORTS[kind].publish(pool, kv)
    except KeyError:
        raise ValueError(f"kv_transport {kind!r} has no tensor-pool export; known: {sorted(EXPORTS)}") from None


register_transport("cuda-ipc", CudaIpcTransport)
register_transport("torch-ipc", TorchIpcTransport)
