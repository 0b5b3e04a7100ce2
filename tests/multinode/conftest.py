"""Fixtures for the multi-node tests: two network namespaces (bench/netns.py) joined by a data veth and
bridged to the root namespace. Everything here is marked ``multinode`` and skips, saying why, where this process
cannot create network namespaces (not root) or the Mooncake extra does not import (``make test`` installs both
as root, best-effort)."""
from __future__ import annotations

from pathlib import Path

import pytest

from bench.netns import TwoHostNet, can_create_netns, sweep_stale

HERE = Path(__file__).resolve().parent


def pytest_itemcollected(item):
    if HERE in Path(item.path).resolve().parents:
        item.add_marker(pytest.mark.multinode)


@pytest.fixture(scope="session")
def multinode_ready():
    """Skips unless network namespaces can be created and ``mooncake`` imports; sweeps what a killed earlier
    run left (namespaces and links named after a pid that is gone)."""
    ok, reason = can_create_netns()
    if not ok:
        pytest.skip(f"multinode: {reason}")
    try:   # an optional extra: a missing library is a skip, with the import error as the reason
        import mooncake.engine  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"multinode: the mooncake extra is missing ({exc}); `make test` as root installs it, "
                    "or pip install -e '.[mooncake]' and apt-get install libibverbs1 librdmacm1 libnuma1")
    sweep_stale()


@pytest.fixture(scope="module")
def two_host_net(multinode_ready):
    """A TwoHostNet for the module, deleted at teardown whatever happened."""
    with TwoHostNet() as net:
        yield net
