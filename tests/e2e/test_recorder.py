"""Scenario S14 (../shared/scenarios.md), the flight recorder after the fact: a request's transfer never completes
and it times out (504 naming its id); 50 more requests reuse every table row; then, with the API process
SIGSTOPped, tools/inspect --request prints its timeline from the recorder: each stage, its age, the deadline that
fired. GET /debug/requests/{id} answers the same timeline; --trace-out writes a Chrome/Perfetto trace."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import orjson
import pytest

from tests.conftest import ROOT, cleanup_engine, probe_fixture, start_engine, wait_until

INFLIGHT_TIMEOUT_S = 2.0
MAX_QUEUED = 8   # a table of 2 * 8 + 16 = 32 rows: 50 requests reuse every one of them
FAULTS = "transfer_stuck:match=stuck-;router_count_drift:count_delta=1,match=drift-"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = start_engine(tmp_path_factory.mktemp("recorder"), "--max-queued-requests", str(MAX_QUEUED),
                       env={"PDSERVE_FAULTS": FAULTS,
                            "PDSERVE_INFLIGHT_TIMEOUT_S": str(INFLIGHT_TIMEOUT_S), "PDSERVE_MONITOR_TICK_S": "0.5"})
    yield eng
    cleanup_engine(eng)


probe = probe_fixture("engine")


def inspect(engine, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.inspect", engine.engine_id, *args], cwd=ROOT,
                          capture_output=True, timeout=60)


def test_a_timed_out_requests_timeline_outlives_its_row_and_reads_with_the_api_stopped(engine, probe, tmp_path):
    post = lambda rid: httpx.post(engine.base_url + "/v1/completions", headers={"X-Request-Id": rid},   # noqa: E731
                                  json={"prompt": "Tell me about lighthouses", "max_tokens": 2, "temperature": 0},
                                  timeout=60)
    response = post("stuck-s14")
    assert response.status_code == 504, response.text
    message = response.json()["error"]["message"]
    assert "stuck-s14" in message and "tools/inspect --request stuck-s14" in message
    wait_until(lambda: "tools/inspect --request stuck-s14" in engine.log_text(), 10, 0.1, "the 504's log line")
    for i in range(50):
        assert post(f"after-{i}").status_code == 200
    api_pid = probe.pid("api")
    os.kill(api_pid, signal.SIGSTOP)
    try:
        text = inspect(engine, "--request", "stuck-s14")
        shown = inspect(engine, "--request", "stuck-s14", "--json")
        failed = inspect(engine, "--failed", "--json")
        traced = inspect(engine, "--trace-out", str(tmp_path / "trace.json"))
    finally:
        os.kill(api_pid, signal.SIGCONT)
    assert text.returncode == 0, text.stderr.decode()
    out = text.stdout.decode()
    assert "QUEUED -> PREFILLING -> BOOTSTRAP -> TRANSFERRING -> TIMED_OUT" in out, out
    assert f"inflight_timeout_s={INFLIGHT_TIMEOUT_S:g} s fired after" in out, out
    report = orjson.loads(shown.stdout)
    (timeline,) = report["timelines"]
    assert timeline["path"] == ["QUEUED", "PREFILLING", "BOOTSTRAP", "TRANSFERRING", "TIMED_OUT"]
    transfer = timeline["stages"][3]
    assert transfer["deadline_field"] == "inflight_timeout_s" and transfer["deadline_s"] == INFLIGHT_TIMEOUT_S
    assert INFLIGHT_TIMEOUT_S <= transfer["age_s"] <= INFLIGHT_TIMEOUT_S + 2.0, transfer
    assert timeline["stages"][4]["by"] == "monitor" and timeline["released"]
    assert timeline["timeout"]["stage"] == "transfer" and timeline["timeout"]["deadline_field"] == "inflight_timeout_s"
    assert timeline["timeout"]["age_s"] >= INFLIGHT_TIMEOUT_S
    kinds = [e["kind"] for e in timeline["events"]]
    assert {"http_headers", "admitted", "prefill_chunk", "timeout", "closed", "release"} <= set(kinds), kinds
    assert probe.state.row(timeline["slot"])["generation"] > timeline["generation"]   # its row was reused
    assert any(t["final"] == "TIMED_OUT" and t["key"] == timeline["key"]
               for t in orjson.loads(failed.stdout)["timelines"])
    trace = orjson.loads((tmp_path / "trace.json").read_bytes())
    assert traced.returncode == 0 and any(e.get("name") == "transfer" and e["ph"] == "X" for e in trace["traceEvents"])
    wait_until(lambda: httpx.get(engine.base_url + "/health", timeout=5).status_code == 200, 20,
               message="the API to answer again")
    over_http = httpx.get(engine.base_url + "/debug/requests/stuck-s14", timeout=10)
    assert over_http.status_code == 200
    assert over_http.json()["timelines"][0]["path"] == timeline["path"]
    assert httpx.get(engine.base_url + "/debug/requests/never-sent", timeout=10).status_code == 404


def test_a_router_count_drift_is_logged_with_the_ids_each_side_holds(engine, probe):
    """router_count_drift bends the router's count, not its set of requests: the monitor's log line says so by
    naming no diverging id on either side, and tools/inspect --reconcile agrees (exit 0). Runs last: the drift
    stays."""
    response = httpx.post(engine.base_url + "/v1/completions", headers={"X-Request-Id": "drift-1"},
                          json={"prompt": "drift", "max_tokens": 2}, timeout=60)
    assert response.status_code == 200, response.text
    wait_until(lambda: "router count mismatch" in engine.log_text(), 5, 0.1, "the mismatch log line")
    line = next(x for x in engine.log_text().splitlines() if "router count mismatch" in x)
    assert "ids the API holds and the table does not: none; the table holds and the API does not: none" in line
    shown = inspect(engine, "--reconcile", "--json")
    assert shown.returncode == 0, shown.stdout
    assert orjson.loads(shown.stdout) == {"api_only": [], "table_only": []}
