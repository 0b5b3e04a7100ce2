"""The engine manifest: one small shm segment per engine holding its layout and effective config as JSON,
so ``tools/inspect`` can find a running engine and everything it needs without talking to any process.

Layout of ``/pdserve_<id>_manifest`` (written once by the supervisor before any actor starts)::

    offset  size  field
    0       4     magic          b"PDMF"
    4       4     version        u4 = 1
    8       4     json_bytes     u4 length of the JSON below
    16      N     orjson-encoded object: engine_id, pid (supervisor), created_unix_s, model, served_model_name,
                  max_context_tokens, kv_blocks_per_pool, url, segments {what: posix name}, actors [names],
                  config {field: {"value", "source"}}
"""
from __future__ import annotations

import struct
from typing import Any

import orjson

from ipc import _shm
from ipc.naming import engine_id_of, list_engine_segments, segment_name

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
