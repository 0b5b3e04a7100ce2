"""The monitor's incident bundles (actors/incidents.py): the rate limit, the replay recipe a timeout gets, the
directory's size bound, and the writer's thread: ``report`` returns at once while a bundle is written (against a
real flight recorder and state table), and the bundle reads back through tools/inspect --bundle."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest

from actors.incidents import Incident, IncidentLimiter, IncidentWriter, LogTail, prune
from tools.bundle import replay_recipe
from tests.conftest import ROOT, wait_until


@pytest.fixture
def engine_shm():
    """An engine's manifest, state table and flight recorder, without its processes (what the monitor's bundle
    reads), holding one request that timed out in TRANSFERRING; yields (engine id, request id)."""
    from ipc import naming, recorder
    from ipc.manifest import write_manifest
    from ipc.recorder import EventKind, Recorder, TimeoutReason, request_key
    from ipc.state_table import RequestState as S
    from ipc.state_table import StateTable

    eid = naming.new_engine_id()
    segments = {"state": naming.segment_name(eid, "state"), "recorder": naming.segment_name(eid, "recorder")}
    manifest = write_manifest(eid, {"engine_id": eid, "pid": os.getpid(), "created_unix_s": time.time(),
                                    "segments": segments, "actors": ["prefill0", "decode0", "api", "monitor"],
                                    "config": CONFIG})
    ring = Recorder.create(segments["recorder"], num_writers=2, events_per_writer=256)
    table = StateTable.create(segments["state"], num_rows=4)
    rid = "stuck-s0r6"
    try:
        recorder.install(ring, 0, 3)
        slot, gen = table.allocate(rid, prompt_tokens=3, deadline_ns=0)
        for state in (S.PREFILLING, S.BOOTSTRAP, S.TRANSFERRING, S.TIMED_OUT):
            assert table.transition(slot, gen, state)
        recorder.record(EventKind.TIMEOUT, slot, gen, request_key(rid), old=int(S.TRANSFERRING), a=2_100_000_000,
                        b=2_000_000_000, aux=int(TimeoutReason.STAGE_DEADLINE))
        assert table.release(slot, gen)
        yield eid, rid
    finally:
        recorder.install(None, 0, 0)
        for segment in (table, ring, manifest):
            segment.close()
            segment.unlink()

CONFIG = {"inflight_timeout_s": {"value": 2.0, "source": "env"}, "prefill_timeout_s": {"value": 4.0,
          "source": "env"}, "monitor_tick_s": {"value": 0.5, "source": "env"}, "port": {"value": 0,
          "source": "flag"}}


def test_the_limiter_lets_one_bundle_through_per_interval_and_counts_the_rest():
    limiter = IncidentLimiter(min_interval_s=10.0)
    s = 1_000_000_000
    assert limiter.allow(100 * s) == 0
    assert limiter.allow(101 * s) is None and limiter.allow(109 * s) is None
    assert limiter.allow(110 * s) == 2          # the next one carries how many were swallowed
    assert limiter.allow(110 * s + 1) is None
    assert IncidentLimiter(0.0).allow(5) == 0 and IncidentLimiter(0.0).allow(5) == 0


def test_a_transfer_timeout_replays_with_the_fault_aimed_at_its_multiround_round():
    incident = Incident("timeout", "request stuck-s0r6 timed out in stage transfer", ["stuck-s0r6"], "transfer",
                        "inflight_timeout_s", "http://127.0.0.1:8123")
    recipe = replay_recipe(incident, CONFIG)
    assert recipe["faults"] == "transfer_stuck:count=1,match=replay-"
    assert recipe["env"]["PDSERVE_FAULTS"] == recipe["faults"] and recipe["env"]["PDSERVE_INFLIGHT_TIMEOUT_S"] == "2"
    argv = recipe["multiround"]
    assert argv[argv.index("--base-url") + 1] == "http://127.0.0.1:8123"
    assert argv[argv.index("--rounds") + 1] == "7" and argv[argv.index("--inject-round") + 1] == "6"
    assert argv[argv.index("--sessions") + 1] == "1" and argv[argv.index("--inject-id-prefix") + 1] == "replay-"
    assert "PDSERVE_FAULTS=" in recipe["commands"][0] and recipe["commands"][1].startswith("python -m tools.multi")


def test_a_prefill_timeout_holds_the_prompt_past_its_deadline_and_other_incidents_replay_the_traffic():
    stall = replay_recipe(Incident("timeout", "x", ["a-client-id"], "prefill", "prefill_timeout_s"), CONFIG)
    assert stall["faults"] == "stall_prefill:seconds=26,count=1,match=replay-"
    assert stall["multiround"][stall["multiround"].index("--inject-round") + 1] == "1"   # not a multiround id
    decode = replay_recipe(Incident("timeout", "x", ["d"], "decode", "decode_stall_timeout_s"), CONFIG)
    assert decode["faults"] == "" and "PDSERVE_FAULTS" not in decode["env"] and "--inject-round" not in \
        decode["multiround"]
    actor = replay_recipe(Incident("actor", "actor decode0 (pid 1) is dead"), CONFIG)
    assert actor["faults"] == "" and "actor incident" in actor["note"]


def test_prune_keeps_the_directory_under_its_bound_and_always_the_newest(tmp_path):
    for i in range(5):
        path = tmp_path / f"incident-{i}.tar.gz"
        path.write_bytes(b"x" * 1000)
        os.utime(path, ns=(i * 10**9, i * 10**9))
    (tmp_path / "other.txt").write_bytes(b"y" * 5000)
    assert prune(str(tmp_path), 2500) == ["incident-0.tar.gz", "incident-1.tar.gz", "incident-2.tar.gz"]
    assert prune(str(tmp_path), 10) == ["incident-3.tar.gz"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["incident-4.tar.gz", "other.txt"]


def test_the_log_tail_keeps_the_last_lines():
    tail = LogTail(lines=3)
    logger = logging.getLogger("pdserve.test_incidents")
    logger.addHandler(tail)
    try:
        for i in range(5):
            logger.warning("line %d", i)
    finally:
        logger.removeHandler(tail)
    assert [line.rsplit(": ", 1)[1] for line in tail.lines] == ["line 2", "line 3", "line 4"]


def test_report_never_waits_for_the_bundle_and_the_bundle_reads_back(tmp_path, engine_shm):
    """``report`` from the monitor's tick returns in well under a millisecond while the writer's thread builds the
    bundle from the engine's shm (manifest, state table, recorder); a second incident while it writes is counted,
    not queued behind it."""
    engine_id, rid = engine_shm
    tail = LogTail()
    tail.lines.append("2026-12-02 a log line of the monitor")
    writer = IncidentWriter(engine_id, str(tmp_path / "incidents"), 0.0, 1 << 30, tail)
    try:
        incident = Incident("timeout", f"request {rid} timed out in stage transfer", [rid], "transfer",
                            "inflight_timeout_s")
        started = time.perf_counter()
        assert writer.report(incident)
        queued_s = time.perf_counter() - started
        assert not writer.report(Incident("stuck_gauge", "stuck gauge inflight=1"))   # the first still writing
        wait_until(lambda: writer.written, 30, 0.05, "the bundle")
        assert queued_s < 0.005, queued_s
    finally:
        writer.close()
    (path,) = writer.written
    assert writer.limiter.suppressed == 1 and writer.failed == 0
    read = subprocess.run([sys.executable, "-m", "tools.inspect", "--bundle", str(tmp_path / "incidents")],
                          cwd=ROOT, capture_output=True, timeout=60)
    out = read.stdout.decode()
    assert read.returncode == 0, read.stderr.decode()
    assert f"incident: timeout: request {rid} timed out in stage transfer" in out, out
    assert f"request {rid}" in out and "QUEUED -> PREFILLING" in out and "a log line of the monitor" in out
    assert "transfer_stuck:count=1,match=replay-" in out
