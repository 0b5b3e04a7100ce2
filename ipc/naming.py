"""Names of every POSIX shm segment and semaphore of one engine, and the leak/cleanup helpers over them.

Every name is ``/pdserve_{engine_id}_{what}``; a segment shows up as ``/dev/shm/pdserve_{engine_id}_{what}``
and a semaphore as ``/dev/shm/sem.pdserve_{engine_id}_{what}`` (glibc's layout on Linux). Objects that need
several semaphores suffix ``what`` (``_it``, ``_fr``, ``_lock`` ...), so one prefix glob finds everything an
engine made. Engine ids are ``[0-9A-Za-z]`` only (no ``_``), so engine ``ab`` never matches ``abc``.

One folder outside /dev/shm belongs to an engine too: ``forensics_dir`` (its actors' stack dumps,
actors/forensics.py), removed by ``unlink_all`` with the rest.

Keep ``segment_name`` at or under 30 characters where you can (``/pdserve_`` 9 + id 8 + ``_`` 1 leaves 12 for
``what``): some systems cap POSIX names at 31, and semaphores add up to 5 characters of suffix.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import tempfile

import posix_ipc

SHM_DIR = "/dev/shm"
PREFIX = "pdserve_"
SEM_FILE_PREFIX = "sem."
MAX_NAME_CHARS = 200  # NAME_MAX is 255 on Linux; leave room for suffixes and "sem."

_ENGINE_ID_RE = re.compile(r"^[0-9A-Za-z]{1,32}$")
_WHAT_RE = re.compile(r"^[0-9A-Za-z_.-]{1,160}$")


def new_engine_id() -> str:
    """A fresh random engine id: 8 lowercase hex characters (32 bits)."""
    return secrets.token_hex(4)


def _check_engine_id(engine_id: str) -> None:
    if not isinstance(engine_id, str) or not _ENGINE_ID_RE.match(engine_id):
        raise ValueError(f"engine_id {engine_id!r} must be 1-32 characters of [0-9A-Za-z] "
                         f"(new_engine_id() makes one)")


def segment_name(engine_id: str, what: str) -> str:
    """The POSIX name ``/pdserve_{engine_id}_{what}`` of one segment (or semaphore) of an engine.

    Raises ValueError if ``engine_id`` is not ``[0-9A-Za-z]{1,32}`` or ``what`` is not ``[0-9A-Za-z_.-]+``.
    """
    _check_engine_id(engine_id)
    if not isinstance(what, str) or not _WHAT_RE.match(what):
        raise ValueError(f"segment 'what' {what!r} must be 1-160 characters of [0-9A-Za-z_.-] (no '/')")
    name = f"/{PREFIX}{engine_id}_{what}"
    if len(name) > MAX_NAME_CHARS:
        raise ValueError(f"segment name {name!r} is {len(name)} characters; the limit is {MAX_NAME_CHARS}")
    return name


def engine_id_of(name: str) -> str | None:
    """The engine id inside a POSIX name or /dev/shm entry made by ``segment_name``, else None."""
    base = name.lstrip("/")
    if base.startswith(SEM_FILE_PREFIX):
        base = base[len(SEM_FILE_PREFIX):]
    if not base.startswith(PREFIX):
        return None
    eid, sep, _ = base[len(PREFIX):].partition("_")
    return eid if sep and _ENGINE_ID_RE.match(eid) else None


def list_engine_segments(engine_id: str | None = None) -> list[str]:
    """Sorted /dev/shm entries of one engine (or of every pdserve engine when ``engine_id`` is None).

    Entries are file names as they appear in /dev/shm: ``pdserve_{id}_{what}`` for segments and
    ``sem.pdserve_{id}_{what}`` for semaphores (POSIX name = "/" + entry without "sem."). Empty list if
    /dev/shm does not exist. Used for leak checks and by the inspect tool.
    """
    if engine_id is not None:
        _check_engine_id(engine_id)
        prefix = f"{PREFIX}{engine_id}_"
    else:
        prefix = PREFIX
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    out = [e for e in entries
           if (e.startswith(prefix) or (e.startswith(SEM_FILE_PREFIX) and e[4:].startswith(prefix)))]
    if engine_id is None:
        out = [e for e in out if engine_id_of(e) is not None]
    return sorted(out)


def posix_name_of(entry: str) -> tuple[str, bool]:
    """(POSIX name, is_semaphore) of a /dev/shm entry returned by ``list_engine_segments``."""
    if entry.startswith(SEM_FILE_PREFIX):
        return "/" + entry[len(SEM_FILE_PREFIX):], True
    return "/" + entry, False


def forensics_dir(engine_id: str) -> str:
    """The engine's folder of actor stack dumps (actors/forensics.py): ``<temp dir>/pdserve_<engine_id>``."""
    _check_engine_id(engine_id)
    return os.path.join(tempfile.gettempdir(), PREFIX + engine_id)


def unlink_all(engine_id: str) -> list[str]:
    """Best-effort unlink of every segment and semaphore of ``engine_id``; returns the entries removed.

    Processes that still have them open keep working on the (now nameless) objects until they close them.
    Never raises for an entry that is already gone; raises ValueError for an invalid ``engine_id`` (so an
    empty id can never match every engine). Used by the supervisor at exit and by tests' cleanup.
    """
    _check_engine_id(engine_id)
    removed = []
    for entry in list_engine_segments(engine_id):
        name, is_sem = posix_name_of(entry)
        try:
            if is_sem:
                posix_ipc.unlink_semaphore(name)
            else:
                posix_ipc.unlink_shared_memory(name)
            removed.append(entry)
            continue
        except posix_ipc.ExistentialError:
            continue
        except (posix_ipc.Error, OSError):
            pass
        try:  # fall back to the file itself (e.g. a permissions quirk in the posix_ipc call)
            os.unlink(os.path.join(SHM_DIR, entry))
            removed.append(entry)
        except OSError:
            pass
    shutil.rmtree(forensics_dir(engine_id), ignore_errors=True)
    return removed
