"""The engine manifest: one small shm segment per engine holding its layout and effective config as JSON,
so ``tools/inspect`` can find a running engine and everything it needs without talking to any process.

Layout of ``/pdserve_<id>_manifest`` (written once by the supervisor before any actor starts)::

    offset  size  field
    0       4     magic b"PDMF"
    4       4     uint32 JSON length in bytes
    8       N     orjson-encoded object: engine_id, pid (supervisor), created_unix_s, model, served_model_name,
                  max_model_len, kv_blocks_per_pool, segments {what: posix name}, actors [names],
                  config {field: {"value", "source"}}
"""
from __future__ import annotations

import struct
from typing import Any

import orjson

from ipc._shm import attach_segment, close_mapping, create_segment, unlink_segment_quiet
from ipc.naming import list_engine_segments, segment_name

MAGIC = b"PDMF"
HEADER = struct.Struct("<4sI")


def write_manifest(engine_id: str, data: dict[str, Any]) -> str:
    """Create the manifest segment; returns its name (the caller unlinks it with ``remove_manifest``)."""
    name = segment_name(engine_id, "manifest")
    payload = orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS)
    mm = create_segment(name, HEADER.size + len(payload))
    try:
        mm[HEADER.size:] = payload
        mm[:HEADER.size] = HEADER.pack(MAGIC, len(payload))
    finally:
        close_mapping(mm)
    return name


def read_manifest(engine_id: str) -> dict[str, Any]:
    """Read an engine's manifest. Raises FileNotFoundError if that engine is not running."""
    mm = attach_segment(segment_name(engine_id, "manifest"), readonly=True)
    try:
        magic, length = HEADER.unpack(mm[:HEADER.size])
        if magic != MAGIC:
            raise FileNotFoundError(f"engine {engine_id}: manifest not written yet")
        return orjson.loads(mm[HEADER.size:HEADER.size + length])
    finally:
        close_mapping(mm)


def remove_manifest(engine_id: str) -> None:
    unlink_segment_quiet(segment_name(engine_id, "manifest"))


def running_engines() -> list[str]:
    """Engine ids that have a manifest in /dev/shm (running, or crashed without cleanup)."""
    from ipc.naming import engine_id_of

    return sorted({engine_id_of(n) for n in list_engine_segments() if n.endswith("_manifest")} - {None})
