"""bench/kv_network: one small run (the figures themselves are not asserted: the machine is shared).
Skipped, with the import error as the reason, without the mooncake extra."""
from __future__ import annotations

import os

import pytest

try:   # an optional extra: the one place a missing library is a skip
    import ipc.mooncake_transport  # noqa: F401
except ImportError as exc:
    pytest.skip(f"{exc} (make test-mooncake installs both)", allow_module_level=True)

from bench import kv_network as bench_kv_network  # noqa: E402


@pytest.mark.timeout(180)
def test_each_contender_moves_a_128_token_request_and_mooncake_bytes_are_checked(capsys):
    rows = bench_kv_network.main(["--reps", "1", "--tokens", "128"])
    assert [(r["tokens"], r["layout"]) for r in rows] == [(128, "consecutive"), (128, "scattered")]
    for row in rows:   # _bench_one raised had the Mooncake copy differed from the source blocks
        assert row["mib"] == 128 * 45 / 1024 and all(row[f"{k}_gb_s"] > 0 for k in ("mooncake", "cpu-shm", "socket"))
    assert "mc/socket" in capsys.readouterr().out


@pytest.mark.timeout(180)
def test_with_netns_the_source_and_reader_run_in_two_namespaces_and_leave_nothing_behind(capsys):
    from bench.netns import can_create_netns

    ok, reason = can_create_netns()
    if not ok:
        pytest.skip(reason)
    rows = bench_kv_network.main(["--netns", "--reps", "1", "--tokens", "128"])
    assert [(r["tokens"], r["layout"]) for r in rows] == [(128, "consecutive"), (128, "scattered")]
    assert all(row[f"{k}_gb_s"] > 0 for row in rows for k in ("mooncake", "cpu-shm", "socket"))
    assert "between two network namespaces" in capsys.readouterr().out
    leftovers = [n for n in os.listdir("/dev/shm") if n.endswith(("kvsrc", "kvdst", "kvsrc.mc"))]
    assert leftovers == []


def test_netns_without_root_is_a_skip_message_not_an_error(monkeypatch, capsys):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert bench_kv_network.main(["--netns"]) == []
    assert "skipped: network namespaces need root (running as uid 1000)" in capsys.readouterr().out
