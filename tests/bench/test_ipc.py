"""bench/ipc: small runs of each part (the figures themselves are not asserted: the machine is shared)."""
from __future__ import annotations

import multiprocessing as mp

import orjson
import pytest

from bench import ipc as bench_ipc


@pytest.mark.parametrize("nbytes", [64, 1024, 65536])
def test_messages_encode_to_exactly_the_advertised_size(nbytes):
    assert len(orjson.dumps(bench_ipc.make_message(nbytes))) == nbytes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["ShmQueue", "ShmQueue mpmc", "mp.Queue", "mp.Pipe"])
def test_every_queue_contender_delivers_every_message(kind):
    ctx = mp.get_context("spawn")
    assert bench_ipc.throughput(ctx, kind, 1024, 300) > 0
    assert len(bench_ipc.round_trips(ctx, kind, 64, 100)) == 95  # first 5% dropped as warm-up


@pytest.mark.timeout(60)
def test_semaphore_floor_ping_pongs():
    assert len(bench_ipc.round_trips(mp.get_context("spawn"), "posix_ipc sem", 0, 100)) == 95


@pytest.mark.timeout(120)
def test_kv_and_monitor_parts_report_ratios_against_their_baselines():
    results = {"kv": bench_ipc.bench_kv(1), "monitor": bench_ipc.bench_monitor(1, num_rows=2000)}
    assert all(r["ratio_vs_numpy"] > 0 and r["transport_gb_s"] > 0 and r["run_slices_ratio_vs_numpy"] > 0
               and r["cached_stores_ratio_vs_numpy"] > 0 for r in results["kv"])
    assert {r["what"] for r in results["monitor"]} >= {"snapshot only (floor)"}
    text = bench_ipc.report(results)
    assert "target: >= 0.90x the numpy copy" in text and "target: tick < 5 ms CPU" in text
