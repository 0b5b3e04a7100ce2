"""Fixtures for the ipc tests (``engine_id``, unlinking every shm object of a test, is in tests/conftest.py)."""
from __future__ import annotations

import multiprocessing as mp
import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parents[1]
for p in (str(_ROOT), str(_HERE)):  # spawned children inherit sys.path: they import ipc and ipc_children
    if p not in sys.path:
        sys.path.insert(0, p)

from ipc import naming  # noqa: E402


@pytest.fixture
def name(engine_id):
    """``name("what")`` -> a segment name unique to this test."""
    return lambda what: naming.segment_name(engine_id, what)


@pytest.fixture(scope="session")
def ctx():
    return mp.get_context("spawn")
