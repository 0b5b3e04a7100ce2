"""The engine manifest: one small shm segment per engine holding its layout and effective config as JSON,
so ``tools/inspect`` can find a running engine and everything it needs without talking to any process.

Layout of ``/pdserve_<id>_manifest`` (written once by the supervisor before any actor starts)::

    offset  size  field
    0       4     magic          b"PDMF"
    4       4     version        u4 = 1
    8       4     json_bytes     u4 length of the JSON below
    16      N     orjson-encoded object: engine_id, pid (supervisor), pid_start_ticks (its /proc starttime),
                  created_unix_s, model, served_model_name,
                  max_context_tokens, kv_blocks_per_pool, url, segments {what: posix name}, actors [names],
                  config {field: {"value", "source"}}

The manifest is the first object an engine creates (its ``pid`` and ``pid_start_ticks`` tell whether the engine's
supervisor still runs, whatever the wall clock did since): ``reclaim_stale_engines`` unlinks the objects of engines whose supervisor is gone (SIGKILL leaves them;
``pdserve serve`` and ``tools/inspect --list`` call it at start).
"""
from __future__ import annotations

import logging
import os
import struct
import time
from typing import Any

import orjson

from ipc import _shm
from ipc.naming import SHM_DIR, engine_id_of, list_engine_segments, segment_name, unlink_all

log = logging.getLogger("pdserve.manifest")
NO_MANIFEST_GRACE_S = 60.0   # an engine's objects without a readable manifest younger than this may be starting

MAGIC = b"PDMF"
VERSION = 1
HEADER = struct.Struct("<4sII")  # magic, version, json_bytes
JSON_OFFSET = 16


class Manifest(_shm.ShmSegment):
    """The manifest segment; ``data`` is the decoded JSON object. Segment plumbing: ``ipc._shm.ShmSegment``."""

    MAGIC = MAGIC
    VERSION = VERSION
    KIND = "engine manifest"

    def __init__(self) -> None:  # use create() / attach()
        super().__init__()
        self.data: dict[str, Any] = {}

    @classmethod
    def create(cls, name: str, data: dict[str, Any]) -> "Manifest":
        """Create (O_CREX, mode 0600) and own the manifest ``name`` holding ``data`` (orjson-serializable).
        Raises FileExistsError if it exists, TypeError if ``data`` cannot be encoded."""
        payload = orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS)

        def init(mm) -> None:
            HEADER.pack_into(mm, 0, b"\0\0\0\0", VERSION, len(payload))
            mm[JSON_OFFSET:JSON_OFFSET + len(payload)] = payload

        return cls._create(name, JSON_OFFSET + len(payload), init)

    def _check_layout(self, name: str, mm) -> None:
        length = HEADER.unpack_from(mm, 0)[2] if len(mm) >= HEADER.size else -1
        if not 0 <= length <= len(mm) - JSON_OFFSET:
            raise ValueError(f"engine manifest {name!r} says {length} B of JSON in a {len(mm)} B segment")

    def _setup(self, mm) -> None:
        length = HEADER.unpack_from(mm, 0)[2]
        self.data = orjson.loads(mm[JSON_OFFSET:JSON_OFFSET + length])

    def _repr_fields(self) -> str:
        return f", engine_id={self.data.get('engine_id')!r}"


def write_manifest(engine_id: str, data: dict[str, Any]) -> Manifest:
    """Create engine ``engine_id``'s manifest; the caller owns it (``close()`` + ``unlink()`` at exit)."""
    return Manifest.create(segment_name(engine_id, "manifest"), data)


def read_manifest(engine_id: str) -> dict[str, Any]:
    """Read an engine's manifest. Raises FileNotFoundError if that engine is not running, ValueError if its
    manifest is not written yet or from another layout version."""
    with Manifest.attach(segment_name(engine_id, "manifest"), readonly=True) as manifest:
        return manifest.data


def running_engines() -> list[str]:
    """Engine ids that have a manifest in /dev/shm (running, or crashed without cleanup)."""
    return sorted({engine_id_of(n) for n in list_engine_segments() if n.endswith("_manifest")} - {None})


def process_start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (/proc/PID/stat's field 22, ``starttime``), or None
    if there is no such process. The same number for the life of the process whatever the wall clock does, and a
    reused pid's differs: the identity of a supervisor in the manifest (``pid_start_ticks``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])   # field 22, counted after the ")"
    except (OSError, IndexError, ValueError):
        return None


def process_started_unix_s(pid: int) -> float | None:
    """When process ``pid`` started (Unix seconds: the boot time /proc/stat gives now, plus its
    :func:`process_start_ticks`), or None if there is no such process. The boot time is the wall clock less the
    uptime, so a step of the wall clock (NTP, a paused VM set right) moves every process's answer by that step."""
    ticks = process_start_ticks(pid)
    try:
        with open("/proc/stat", "rb") as f:
            boot_s = next(float(line.split()[1]) for line in f if line.startswith(b"btime "))
    except (OSError, IndexError, StopIteration, ValueError):
        return None
    return None if ticks is None else boot_s + ticks / os.sysconf("SC_CLK_TCK")


def stale_engines(now_unix_s: float | None = None, only: set[str] | None = None) -> dict[str, str]:
    """Engines with objects in /dev/shm whose supervisor is gone: engine id -> why. Gone = the manifest's ``pid``
    runs no process, or another process than the one that wrote it (the pid was reused: its
    :func:`process_start_ticks` differ from the manifest's ``pid_start_ticks``; a manifest without them, from an
    older pdserve, falls back to the wall clock: a process started after ``created_unix_s``, which a forward step of
    the clock fakes, so a live engine's objects were unlinked under it). An engine without a readable manifest
    counts once its newest object is NO_MANIFEST_GRACE_S old (the supervisor writes the manifest first, so a
    starting engine has one within moments). ``only``: look at these ids alone."""
    now_unix_s = time.time() if now_unix_s is None else now_unix_s
    entries: dict[str, list[str]] = {}
    for entry in list_engine_segments():
        eid = engine_id_of(entry)
        if only is None or eid in only:
            entries.setdefault(eid, []).append(entry)
    stale = {}
    for eid, own in entries.items():
        try:
            manifest = read_manifest(eid)
        except (FileNotFoundError, ValueError, OSError):
            newest = max((_mtime(e) for e in own), default=now_unix_s)
            if now_unix_s - newest >= NO_MANIFEST_GRACE_S:
                stale[eid] = f"no readable manifest, objects {now_unix_s - newest:.0f} s old"
            continue
        pid, created = int(manifest.get("pid", -1)), float(manifest.get("created_unix_s", now_unix_s))
        ticks = process_start_ticks(pid) if pid > 0 else None
        if ticks is None:
            stale[eid] = f"supervisor pid {pid} is gone"
        elif "pid_start_ticks" in manifest:
            if ticks != int(manifest["pid_start_ticks"]):
                stale[eid] = f"supervisor pid {pid} now runs another process"
        elif (process_started_unix_s(pid) or 0.0) > created + 2.0:
            stale[eid] = f"supervisor pid {pid} now runs a process started after the engine"
    return stale


def _mtime(entry: str) -> float:
    try:
        return os.stat(os.path.join(SHM_DIR, entry)).st_mtime
    except OSError:
        return 0.0


def reclaim_stale_engines(now_unix_s: float | None = None, only: set[str] | None = None) -> list[dict[str, Any]]:
    """Unlink every object of each engine whose supervisor is gone (:func:`stale_engines`; a SIGKILLed supervisor
    leaves its segments: the KV pools are most of the RAM) and log which, how many and how many bytes. Returns
    ``[{"engine_id", "why", "segments", "semaphores", "bytes"}]``. Never raises for an object already gone."""
    reclaimed = []
    for eid, why in sorted(stale_engines(now_unix_s, only).items()):
        sizes = {}
        for entry in list_engine_segments(eid):
            try:
                sizes[entry] = os.stat(os.path.join(SHM_DIR, entry)).st_size
            except OSError:
                pass
        removed = unlink_all(eid)
        semaphores = sum(1 for e in removed if e.startswith("sem."))
        freed = sum(sizes.get(e, 0) for e in removed)
        log.warning("reclaimed engine %s (%s): %d segments, %d semaphores, %d bytes of /dev/shm", eid, why,
                    len(removed) - semaphores, semaphores, freed)
        reclaimed.append({"engine_id": eid, "why": why, "segments": len(removed) - semaphores,
                          "semaphores": semaphores, "bytes": freed})
    return reclaimed
