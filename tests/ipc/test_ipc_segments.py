"""Every shm object shares one segment base (ipc._shm.ShmSegment): exclusive 0600 create, attach checks magic
and layout version, owner-only idempotent unlink, close, context manager, repr, pickling by name, and a
failed create leaves nothing behind."""
from __future__ import annotations

import os
import pickle
import stat
import struct

import pytest

from ipc import _shm, naming
from ipc.actor_table import ActorTable
from ipc.engine_status import EngineStatus
from ipc.kv_pool import KVPool
from ipc.manifest import Manifest
from ipc.shm_queue import ShmQueue
from ipc.state_table import StateTable
from pdserve.errors import QueueClosedError

pytestmark = pytest.mark.timeout(60)

MAKERS = {
    StateTable: lambda n: StateTable.create(n, 4),
    ActorTable: lambda n: ActorTable.create(n, 2),
    KVPool: lambda n: KVPool.create(n, num_layers=1, num_blocks=2, block_tokens=2, num_kv_heads=1, head_dim=2),
    EngineStatus: lambda n: EngineStatus.create(n),
    Manifest: lambda n: Manifest.create(n, {"engine_id": "e1", "actors": ["a"]}),
    ShmQueue: lambda n: ShmQueue.create(n, num_slots=2, slot_bytes=64),
}
KINDS = list(MAKERS)
IDS = [k.__name__ for k in KINDS]


def missing_error(kind) -> type[Exception]:
    return QueueClosedError if kind is ShmQueue else FileNotFoundError


def bad_layout_error(kind) -> type[Exception]:
    return QueueClosedError if kind is ShmQueue else ValueError


def shm_entries(name: str) -> list[str]:
    base = name.lstrip("/")
    return [e for e in os.listdir(naming.SHM_DIR) if e == base or e.startswith(f"sem.{base}_")]


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_create_is_exclusive_and_private_and_only_the_owner_unlinks(kind, name):
    seg_name = name("seg")
    owner = MAKERS[kind](seg_name)
    try:
        assert owner.is_owner and not owner.closed
        assert stat.S_IMODE(os.stat(os.path.join(naming.SHM_DIR, seg_name.lstrip("/"))).st_mode) == 0o600
        assert len(shm_entries(seg_name)) == 1 + len(kind.SEM_SUFFIXES)
        with pytest.raises(FileExistsError):
            MAKERS[kind](seg_name)
        other = kind.attach(seg_name)
        assert not other.is_owner
        assert seg_name in repr(other) and kind.__name__ in repr(other)
        with pytest.raises(PermissionError, match="only the creator"):
            other.unlink()
        other.close()
        other.close()  # idempotent
        assert other.closed
    finally:
        owner.close()
        owner.unlink()
    assert shm_entries(seg_name) == []
    with pytest.raises(missing_error(kind)):
        kind.attach(seg_name)
    successor = MAKERS[kind](seg_name)
    try:
        owner.unlink()  # idempotent: never removes a newer segment of the same name
        kind.attach(seg_name).close()
    finally:
        successor.close()
        successor.unlink()


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_attach_refuses_another_kind_and_another_layout_version(kind, name):
    other_kind = ActorTable if kind is not ActorTable else StateTable
    foreign = MAKERS[other_kind](name("foreign"))
    mine = MAKERS[kind](name("mine"))
    try:
        with pytest.raises(bad_layout_error(kind), match="not an initialized"):
            kind.attach(foreign.name)
        raw = _shm.attach_segment(mine.name)
        try:
            struct.pack_into("<I", raw, 4, kind.VERSION + 1)
            with pytest.raises(bad_layout_error(kind), match="layout version"):
                kind.attach(mine.name)
            struct.pack_into("<I", raw, 4, kind.VERSION)
            kind.attach(mine.name).close()
        finally:
            _shm.close_mapping(raw)
    finally:
        for segment in (foreign, mine):
            segment.close()
            segment.unlink()


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_a_segment_closes_as_a_context_manager_and_pickles_by_name(kind, name):
    with MAKERS[kind](name("ctx")) as owner:
        try:
            copy = pickle.loads(pickle.dumps(owner))
            with copy:
                assert copy.name == owner.name and not copy.is_owner
                assert copy.readonly == (kind is KVPool)  # a pickled pool is a peer's read-only view
            assert copy.closed
        finally:
            owner.unlink()
    assert owner.closed


@pytest.mark.parametrize("kind", [StateTable, ShmQueue], ids=["StateTable", "ShmQueue"])
def test_a_create_that_fails_midway_leaves_nothing_behind(kind, name):
    seg_name = name("half")
    blocker = _shm.create_semaphore(seg_name + kind.SEM_SUFFIXES[-1], 1)  # the last semaphore already exists
    try:
        with pytest.raises(FileExistsError):
            MAKERS[kind](seg_name)
        assert shm_entries(seg_name) == [f"sem.{seg_name.lstrip('/')}{kind.SEM_SUFFIXES[-1]}"]
    finally:
        _shm.close_semaphore_quiet(blocker)
        _shm.unlink_semaphore_quiet(seg_name + kind.SEM_SUFFIXES[-1])


def test_a_read_only_attach_refuses_writes(name):
    with EngineStatus.create(name("status")) as owner:
        try:
            owner.rec["watchdog_ticks"] = 3
            with EngineStatus.attach(owner.name, readonly=True) as view:
                assert view.snapshot()["watchdog_ticks"] == 3
                with pytest.raises(ValueError, match="read-only"):
                    view.rec["watchdog_ticks"] = 0
        finally:
            owner.unlink()


def test_the_manifest_round_trips_its_json(name):
    data = {"engine_id": "e1", "segments": {"state": "/x"}, "config": {"port": {"value": 1, "source": "flag"}}}
    with Manifest.create(name("manifest"), data) as owner:
        try:
            with Manifest.attach(owner.name, readonly=True) as view:
                assert view.data == data
        finally:
            owner.unlink()
