"""Shared helpers for the shm modules: the ``ShmSegment`` base, semaphore waits, a dead-holder-safe lock.

Every pdserve segment starts with the same 8 bytes (``PREFIX``)::

    offset  size  field
    0       4     magic    4 ascii bytes naming the kind of segment (b"PDST", b"PDAT", ...)
    4       4     version  u4 layout version of that kind; attach refuses any other

``ShmSegment`` is the base of every shm object (StateTable, ActorTable, KVPool, EngineStatus, Manifest,
ShmQueue): create (the owner: O_CREX, mode 0600, magic written last, everything removed again if creation
fails) vs attach (magic and version checked), close (every process, idempotent), unlink (owner only,
idempotent), context manager, repr, pickling by name.

Everything here is plain synchronous code. Nothing in this module names a segment: callers pass full POSIX
names built with :func:`ipc.naming.segment_name`.

Robust lock record (``LOCK_RECORD``, 8 bytes, lives inside the segment the lock protects)::

    offset  size  field
    0       4     holder_pid  int32   pid of the process inside the critical section, 0 = none/unknown
    4       4     reserved

A lock is a binary posix_ipc semaphore (value 1 = free). After a successful wait the holder first lets the
caller stamp whatever it needs for repair (``stamp``), then writes its pid; just before posting it clears the
pid. A waiter that times out reads the pid: if that process no longer exists (or is a zombie) the waiter takes
the lock over under a second, per-segment "repair" semaphore (so two waiters cannot both take over) and tells
its caller, who repairs the data the dead holder may have left half-written. A holder that is alive but
stopped (SIGSTOP) or hung is reported, never robbed.

Limitations (documented where the locks are used): a process that dies between the semaphore wait and the
pid write (a few instructions) cannot be identified, and the lock then stays wedged until the owner
re-creates the segment; pid reuse within the lock timeout would make a dead holder look alive (same outcome).
"""
from __future__ import annotations

import errno
import mmap
import os
import struct
import time
from typing import Any, Callable, Sequence

import numpy as np
import posix_ipc

from pdserve.errors import PdserveError, ShmLockTimeoutError  # noqa: F401 (re-exported)

PREFIX = struct.Struct("<4sI")  # magic, layout version: the first 8 bytes of every pdserve segment
LOCK_RECORD = struct.Struct("<iI")  # holder_pid, reserved
_PID = struct.Struct("<i")

SEGMENT_MODE = 0o600
SEMAPHORE_MODE = 0o600


# --------------------------------------------------------------------------------------------------------
# segments


def create_segment(name: str, size: int) -> mmap.mmap:
    """Create the POSIX shm segment ``name`` (O_CREX, mode 0600) of ``size`` bytes, zero-filled, and map it.

    The pages are reserved up front (posix_fallocate), so a full /dev/shm raises OSError(ENOSPC) here
    instead of killing a process with SIGBUS later. Raises FileExistsError if a segment of that name exists
    (a leaked one from a crashed engine with the same id, or a second owner: both bugs).
    """
    try:
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=SEGMENT_MODE, size=size)
    except posix_ipc.ExistentialError as exc:
        raise FileExistsError(f"shm segment {name!r} already exists; unlink it (naming.unlink_all) "
                              f"or use a new engine id") from exc
    try:
        os.fchmod(shm.fd, SEGMENT_MODE)  # the umask cannot widen it, but make the mode exact
        try:
            # Reserve the pages now: a too-small /dev/shm must fail here, not SIGBUS on first touch later.
            os.posix_fallocate(shm.fd, 0, size)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise OSError(errno.ENOSPC, f"no room for shm segment {name!r} of {size} bytes in /dev/shm "
                                            f"(df /dev/shm; containers: --shm-size)") from exc
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
        return mmap.mmap(shm.fd, size)
    except BaseException:
        _quiet(posix_ipc.unlink_shared_memory, name)
        raise
    finally:
        shm.close_fd()


def attach_segment(name: str, *, readonly: bool = False) -> mmap.mmap:
    """Map the existing segment ``name``; ``readonly`` maps it PROT_READ (writes through it fault or raise).

    Raises FileNotFoundError if no such segment exists.
    """
    try:
        shm = posix_ipc.SharedMemory(name, 0, read_only=readonly)
    except posix_ipc.ExistentialError as exc:
        raise FileNotFoundError(f"shm segment {name!r} does not exist (not created yet, or already "
                                f"unlinked because the engine is shutting down)") from exc
    try:
        access = mmap.ACCESS_READ if readonly else mmap.ACCESS_WRITE
        return mmap.mmap(shm.fd, shm.size, access=access)
    finally:
        shm.close_fd()


def close_mapping(mm: mmap.mmap | None) -> None:
    """Unmap ``mm`` unless numpy arrays/tensors still view it; then the last of them unmaps it when freed.

    (``mmap.close`` refuses while buffers are exported; dropping our reference is then the safe choice.
    Never map tensors with ``torch.frombuffer`` directly on an mmap: it does not pin the mapping, and a later
    ``close`` leaves the tensor dangling -> SIGSEGV. Go through ``np.frombuffer`` + ``torch.from_numpy``.)
    """
    if mm is None:
        return
    try:
        mm.close()
    except BufferError:
        pass


def shm_array(mm: mmap.mmap, dtype, shape: int | tuple[int, ...], offset: int = 0) -> np.ndarray:
    """A numpy array of ``dtype``/``shape`` over ``mm`` at byte ``offset`` that pins the mapping.

    Use this, never ``np.ndarray(buffer=mm)``, which does not pin it: a later ``close_mapping`` then leaves
    the array dangling and the next access is a SIGSEGV. Read-only if ``mm`` was mapped read-only.
    """
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    count = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(mm, dtype=dtype, count=count, offset=offset).reshape(shape)


def create_semaphore(name: str, initial_value: int) -> posix_ipc.Semaphore:
    """Create the named semaphore ``name`` (O_CREX, mode 0600). Raises FileExistsError if it exists."""
    try:
        return posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=SEMAPHORE_MODE, initial_value=initial_value)
    except posix_ipc.ExistentialError as exc:
        raise FileExistsError(f"semaphore {name!r} already exists; unlink it (naming.unlink_all) "
                              f"or use a new engine id") from exc


def open_semaphore(name: str) -> posix_ipc.Semaphore:
    """Open the existing semaphore ``name``. Raises FileNotFoundError if it does not exist."""
    try:
        return posix_ipc.Semaphore(name, 0)
    except posix_ipc.ExistentialError as exc:
        raise FileNotFoundError(f"semaphore {name!r} does not exist (not created yet, or unlinked)") from exc


def unlink_segment_quiet(name: str) -> None:
    _quiet(posix_ipc.unlink_shared_memory, name)


def unlink_semaphore_quiet(name: str) -> None:
    _quiet(posix_ipc.unlink_semaphore, name)


def close_semaphore_quiet(sem: posix_ipc.Semaphore | None) -> None:
    if sem is not None:
        _quiet(sem.close)


def _quiet(fn: Callable, *args) -> None:
    try:
        fn(*args)
    except (posix_ipc.ExistentialError, posix_ipc.Error, OSError):
        pass


# --------------------------------------------------------------------------------------------------------
# semaphore waits


def sem_wait(sem: posix_ipc.Semaphore, timeout_s: float | None) -> bool:
    """Decrement ``sem``, waiting at most ``timeout_s`` seconds (0 = try once, None = forever).

    Returns True if decremented, False on timeout. Retries after signals (posix_ipc does not), keeping the
    original deadline. Blocks in the kernel (futex): no CPU is used while waiting.
    """
    if timeout_s is None:
        while True:
            try:
                sem.acquire(None)
                return True
            except posix_ipc.SignalError:
                continue
    if timeout_s <= 0:
        try:
            sem.acquire(0)
            return True
        except (posix_ipc.BusyError, posix_ipc.SignalError):
            return False
    deadline = time.monotonic() + timeout_s
    remaining = timeout_s
    while True:
        try:
            sem.acquire(remaining)
            return True
        except posix_ipc.BusyError:
            return False
        except posix_ipc.SignalError:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return sem_wait(sem, 0)


# --------------------------------------------------------------------------------------------------------
# process liveness


def pid_alive(pid: int) -> bool:
    """True if process ``pid`` exists and is not a zombie (a killed, not yet reaped child counts as dead)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        stat = b""
    if stat:
        # "pid (comm) S ..."; comm may contain spaces and parentheses: take the char after the last ')'.
        state = stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3]
        return state not in (b"Z", b"X", b"x")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --------------------------------------------------------------------------------------------------------
# robust lock


_lock_wait_hook: Callable[[str, str], bool] | None = None


def set_lock_wait_hook(hook: Callable[[str, str], bool] | None) -> None:
    """Make this process wait out a lock another process holds past its timeout instead of raising
    ShmLockTimeoutError: ``hook(what, who)`` runs after each timeout (``what`` names the lock, ``who`` its holder)
    and returns True to wait one more timeout, False to raise. An engine actor installs one that beats its
    heartbeat and waits until the supervisor kills the stuck holder (the lock is then taken over); the
    supervisor, monitor and API install none: they must get the error and carry on with other work."""
    global _lock_wait_hook
    _lock_wait_hook = hook


class RobustLock:
    """A mutex over a binary semaphore whose holder pid lives in shm, so a dead holder can be taken over.

    ``buf`` is the writable mapping holding the record at ``offset`` (see ``LOCK_RECORD``); ``repair`` is a
    binary semaphore serializing take-overs; ``what`` names the lock in error messages.
    """

    def __init__(self, sem: posix_ipc.Semaphore, repair: posix_ipc.Semaphore, buf: mmap.mmap, offset: int,
                 what: str, timeout_s: float):
        self.sem = sem
        self.repair = repair
        self.buf = buf
        self.offset = offset
        self.what = what
        self.timeout_s = timeout_s

    def holder_pid(self) -> int:
        return _PID.unpack_from(self.buf, self.offset)[0]

    def acquire(self, stamp: Callable[[], None] | None = None) -> bool:
        """Take the lock, waiting at most ``timeout_s``; call ``stamp()`` then record our pid.

        Returns False normally, True if the lock was taken over from a holder that died inside its critical
        section (the caller must then repair what that holder may have half-written; ``stamp`` is NOT called,
        so the dead holder's stamps are still readable). Raises ShmLockTimeoutError if a live process (or an
        unidentifiable one) holds it past the timeout, unless this process installed a ``set_lock_wait_hook``
        that says to wait on: then it waits again, a timeout at a time, until the holder frees or dies.
        """
        while True:
            for attempt in (0, 1):
                if sem_wait(self.sem, self.timeout_s):
                    if stamp is not None:
                        stamp()
                    _PID.pack_into(self.buf, self.offset, os.getpid())
                    return False
                if self.recover_if_dead():
                    return True
                holder = self.holder_pid()
                if attempt or holder <= 0 or pid_alive(holder):
                    break
                # the holder is dead but another waiter is repairing the lock: give it one more timeout
            if holder <= 0:
                who = "a process that did not record its pid (it died right after taking the lock, or is stopped)"
            elif pid_alive(holder):
                who = f"pid {holder}, which is alive (stopped or hung: SIGCONT or restart it)"
            else:
                who = f"pid {holder}, which is dead (another waiter is repairing the lock)"
            hook = _lock_wait_hook
            if hook is not None and hook(self.what, who):
                continue
            raise ShmLockTimeoutError(f"{self.what} stayed held for more than {self.timeout_s:.3g} s by {who}; "
                                      f"if it never frees, re-create the segment (restart the engine)")

    def recover_if_dead(self) -> bool:
        """If the recorded holder is dead, take the lock over and return True (the caller repairs, then
        ``release()``s). Returns False, changing nothing, if the lock is free, held by a live process, or
        another process is taking it over right now. Cheap when the holder field is 0."""
        holder = self.holder_pid()
        if holder <= 0 or holder == os.getpid() or pid_alive(holder):
            return False
        if not sem_wait(self.repair, 0):
            return False
        try:
            if self.holder_pid() == holder and self.sem.value == 0:
                _PID.pack_into(self.buf, self.offset, os.getpid())
                return True
            return False
        finally:
            self.repair.release()

    def release(self) -> None:
        _PID.pack_into(self.buf, self.offset, 0)
        self.sem.release()


# --------------------------------------------------------------------------------------------------------
# the segment base class


class ShmSegment:
    """Base of every pdserve shm object: one POSIX segment plus the named semaphores it needs.

    Subclasses set ``MAGIC`` (4 bytes), ``VERSION``, ``KIND`` (their name in messages), ``SEM_SUFFIXES``
    (semaphore ``name + suffix`` each), and build their views in ``_setup(mm)`` / drop them in
    ``_teardown()``; ``_check_layout(mm)`` checks what else the header must agree on. Their ``create``
    classmethods call ``_create``; ``attach`` is inherited.

    Ownership: the instance that created the segment (``is_owner``) alone unlinks it. Other processes attach,
    or receive the object pickled (only the name and ``readonly`` travel; unpickling attaches, never as owner).
    A read-only attach maps PROT_READ and opens no semaphore.
    """

    MAGIC: bytes = b""
    VERSION: int = 0
    KIND: str = "shm segment"
    SEM_SUFFIXES: tuple[str, ...] = ()

    def __init__(self) -> None:  # use create() / attach()
        self.name = ""
        self.readonly = False
        self._owner = False
        self._closed = True
        self._unlinked = False
        self._mm: mmap.mmap | None = None
        self._sems: list[posix_ipc.Semaphore] = []

    # ---- creation and attachment -------------------------------------------------------------------------

    @classmethod
    def _create(cls, name: str, size: int, init: Callable[[mmap.mmap], None] | None = None,
                sem_values: Sequence[int] = ()) -> Any:
        """Create and own segment ``name`` of ``size`` bytes: ``init(mm)`` writes the subclass's header and
        initial data, then the semaphores are created (initial values ``sem_values``, one per suffix), then
        the magic and version are written, last: an attacher treats a segment without magic as not ready.

        If anything fails, every object made so far is closed and unlinked before the error propagates.
        Raises FileExistsError if the segment or a semaphore exists, OSError(ENOSPC) if /dev/shm is full.
        """
        if len(sem_values) != len(cls.SEM_SUFFIXES):
            raise ValueError(f"{cls.KIND}: {len(sem_values)} semaphore values for {len(cls.SEM_SUFFIXES)} "
                             f"semaphores {cls.SEM_SUFFIXES}")
        mm = create_segment(name, size)
        sems: list[posix_ipc.Semaphore] = []
        try:
            if init is not None:
                init(mm)
            for suffix, value in zip(cls.SEM_SUFFIXES, sem_values):
                sems.append(create_semaphore(name + suffix, value))
            PREFIX.pack_into(mm, 0, cls.MAGIC, cls.VERSION)
        except BaseException:
            for sem in sems:
                close_semaphore_quiet(sem)
            for suffix in cls.SEM_SUFFIXES[:len(sems)]:
                unlink_semaphore_quiet(name + suffix)
            close_mapping(mm)
            unlink_segment_quiet(name)
            raise
        obj = cls()
        obj._bind(name, mm, sems, readonly=False, owner=True)
        return obj

    @classmethod
    def attach(cls, name: str, readonly: bool = False) -> Any:
        """Attach to the existing segment ``name``; ``readonly`` maps it PROT_READ and opens no semaphore.

        Raises FileNotFoundError if the segment (or one of its semaphores) does not exist, ValueError if it
        is not an initialized segment of this kind and layout version.
        """
        obj = cls()
        obj._attach_into(name, readonly)
        return obj

    def _attach_into(self, name: str, readonly: bool) -> None:
        self.__init__()
        mm = attach_segment(name, readonly=readonly)
        sems: list[posix_ipc.Semaphore] = []
        try:
            self._check_prefix(name, mm)
            self._check_layout(name, mm)
            if not readonly:
                for suffix in self.SEM_SUFFIXES:
                    sems.append(open_semaphore(name + suffix))
        except BaseException:
            for sem in sems:
                close_semaphore_quiet(sem)
            close_mapping(mm)
            raise
        self._bind(name, mm, sems, readonly=readonly, owner=False)

    def _check_prefix(self, name: str, mm: mmap.mmap) -> None:
        if len(mm) < PREFIX.size:
            raise ValueError(f"segment {name!r} is {len(mm)} bytes: not an initialized {self.KIND}")
        magic, version = PREFIX.unpack_from(mm, 0)
        if magic != self.MAGIC:
            raise ValueError(f"segment {name!r} is not an initialized {self.KIND} (magic {magic!r}, expected "
                             f"{self.MAGIC!r}; a segment being created has none yet)")
        if version != self.VERSION:
            raise ValueError(f"{self.KIND} {name!r} has layout version {version}; this code expects "
                             f"{self.VERSION} (engine and tool from different pdserve versions)")

    def _check_layout(self, name: str, mm: mmap.mmap) -> None:
        """Raise ValueError if the header disagrees with this code beyond magic and version (hook)."""

    def _bind(self, name: str, mm: mmap.mmap, sems: list, *, readonly: bool, owner: bool) -> None:
        self.name = name
        self.readonly = readonly
        self._owner = owner
        self._closed = False
        self._mm = mm
        self._sems = sems
        self._setup(mm)

    def _setup(self, mm: mmap.mmap) -> None:
        """Build the subclass's views over ``mm`` (hook; ``self._sems`` holds the opened semaphores)."""

    def _teardown(self) -> None:
        """Drop the subclass's views before the mapping is closed (hook)."""

    # ---- lifetime ------------------------------------------------------------------------------------------

    @property
    def is_owner(self) -> bool:
        return self._owner

    @property
    def closed(self) -> bool:
        return self._closed

    def _require_open(self) -> mmap.mmap:
        if self._closed:
            raise ValueError(f"{self.KIND} {self.name!r} is closed in this process")
        return self._mm

    def close(self) -> None:
        """Detach this process (idempotent); other processes carry on. Arrays or tensors obtained from the
        segment keep the mapping alive until they are freed (see ``close_mapping``)."""
        if self._closed:
            return
        self._closed = True
        self._teardown()
        for sem in self._sems:
            close_semaphore_quiet(sem)
        self._sems = []
        close_mapping(self._mm)
        self._mm = None

    def unlink(self) -> None:
        """Remove the segment and its semaphores from the system (owner only; idempotent; tolerates already
        gone). Processes still attached keep working on the nameless objects until they close.

        Raises PermissionError on an instance that did not create the segment (others close(); cleanup code
        uses ``naming.unlink_all``).
        """
        if not self._owner:
            raise PermissionError(f"only the creator of {self.KIND} {self.name!r} unlinks it")
        if self._unlinked:
            return
        self._unlinked = True
        unlink_segment_quiet(self.name)
        for suffix in self.SEM_SUFFIXES:
            unlink_semaphore_quiet(self.name + suffix)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getstate__(self):
        if not self.name:
            raise ValueError(f"cannot pickle a {self.KIND} that was never created/attached")
        return (self.name, True) if self.readonly else self.name

    def __setstate__(self, state) -> None:
        name, readonly = (state, False) if isinstance(state, str) else state
        self._attach_into(name, readonly)

    def _repr_fields(self) -> str:
        """``", key=value"`` pairs a subclass adds to its repr (hook)."""
        return ""

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.name!r}{self._repr_fields()}, readonly={self.readonly}, "
                f"owner={self._owner}, closed={self._closed})")
