"""tools/inspect against the shared fault engine: a pinned transfer shows up with its stage and a growing age
and exit status 1; once the monitor aborts it the request is gone and the status is 0; it answers while the
API process is SIGSTOPped; it never writes to the engine; GET /debug/state serves the same snapshot over HTTP,
which ``--url`` renders."""
from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import orjson

from tests.conftest import ROOT, wait_until
from tests.tools.test_inspect_render import refused_url
from tools import inspect


def run_inspect(capsys, *args: str) -> tuple[int, dict]:
    code = inspect.main([*args, "--json"])
    return code, orjson.loads(capsys.readouterr().out)


def test_a_pinned_transfer_is_shown_growing_then_gone_after_the_monitor_aborts_it(fault_engine, capsys):
    eid = fault_engine.engine_id
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(httpx.post, fault_engine.base_url + "/v1/completions",
                             json={"prompt": "pinned", "max_tokens": 4}, headers={"X-Request-Id": "stuck-inspect"},
                             timeout=60)
        seen = []

        def pinned_and_stuck():
            code, snap = run_inspect(capsys, eid)
            rows = [r for r in snap["requests"] if r["request_id"] == "stuck-inspect"]
            if rows:
                seen.append(rows[0]["age_in_stage_s"] if rows[0]["stage"] == "transfer" else None)
            inflight = [g for g in snap["gauges"] if g["name"] == "prefill_inflight"]
            return code == 1 and rows and rows[0]["stage"] == "transfer" and inflight and inflight[0]["stuck"]
        wait_until(pinned_and_stuck, 30, 0.05, "inspect to show the pinned request and prefill_inflight stuck")
        ages = [a for a in seen if a is not None]
        assert len(ages) >= 2 and ages == sorted(ages) and ages[-1] > ages[0], seen
        response = future.result(timeout=60)
    assert response.status_code == 504

    def gone_and_healthy():   # the API publishes its count on its heartbeat: "agree" may lag the table's row
        code, snap = run_inspect(capsys, eid)
        return (code == 0 and not [r for r in snap["requests"] if r["request_id"] == "stuck-inspect"]
                and snap["active_requests"]["agree"]) and snap
    snap = wait_until(gone_and_healthy, 10, 0.1, "inspect to show the request gone, the counts agreeing, exit 0")
    assert snap["watchdog"]["timeouts_by_stage"]["transfer"] >= 1
    assert {a["name"] for a in snap["actors"]} == {"prefill0", "decode0", "api", "monitor"}
    assert snap["config"]["inflight_timeout_s"] == {"value": 2.0, "source": "env"}
    # what start-up resolved (auto values) beside what was given: the pool's size as the actors hold it
    pool = snap["config"]["kv_pool_tokens"]
    prefill0 = next(a for a in snap["actors"] if a["name"] == "prefill0")
    assert pool["resolved"] == prefill0["kv_blocks_total"] * snap["config"]["kv_block_tokens"]["value"] > 0, pool
    assert pool["value"] != 0 or "auto" in pool["why"]
    dtype = snap["config"]["kv_cache_dtype"]
    assert dtype["resolved"] in ("float16", "float32") and (dtype["value"] == "auto" or dtype["value"] == dtype[
        "resolved"]), dtype
    from rich.console import Console

    from tools.inspect import render
    console = Console(record=True, width=200)
    console.print(render(snap))
    shown = console.export_text()
    assert f"{dtype['value']} -> {dtype['resolved']}" in shown or dtype["value"] == dtype["resolved"], shown
    # every field start-up resolved to something else than given is shown, defaults too (max_model_len 0 -> fit)
    context = snap["config"]["max_model_len"]
    assert context["source"] == "default" and context["value"] == 0 < context["resolved"], context
    assert re.search(rf"max_model_len\s*│\s*0 -> {context['resolved']}\s*│\s*default", shown), shown


def test_inspect_answers_while_the_api_process_is_stopped(fault_engine, fault_probe):
    api_pid = fault_probe.pid("api")
    os.kill(api_pid, signal.SIGSTOP)
    try:
        result = subprocess.run([sys.executable, "-m", "tools.inspect", fault_engine.engine_id, "--json"],
                                cwd=ROOT, capture_output=True, timeout=30)
    finally:
        os.kill(api_pid, signal.SIGCONT)
    assert result.returncode in (0, 1), result.stderr.decode()
    snap = orjson.loads(result.stdout)
    assert snap["engine_id"] == fault_engine.engine_id
    assert any(a["name"] == "api" for a in snap["actors"])
    wait_until(lambda: httpx.get(fault_engine.base_url + "/health", timeout=5).status_code == 200, 20,
               message="the API to answer again")


def test_inspect_lists_engines_and_says_when_there_is_none(fault_engine, capsys):
    assert inspect.main(["--list"]) == 0
    assert fault_engine.engine_id in capsys.readouterr().out.split()
    assert inspect.main(["ffffffff", "--json"]) == 2


def test_inspect_never_writes_to_the_engine(fault_engine):
    """Every segment inspect maps is read-only: a write through its view faults instead of changing state."""
    import pytest

    view = inspect.EngineView(fault_engine.engine_id)
    try:
        with pytest.raises(PermissionError):
            view.state.update(0, 0, output_tokens=1)
        with pytest.raises(ValueError, match="read-only"):
            view.status.rec["watchdog_ticks"] = 0
        before = view.actors.row(0)
        with pytest.raises(PermissionError):
            view.actors.spawned(0, 1)
        with pytest.raises(ValueError):
            view.actors.beat(0)
        assert view.actors.row(0)["pid"] == before["pid"] != 1
    finally:
        view.close()


def shape(value):
    """The keys of a JSON document, nested (a list: its first element's keys)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return None


def test_debug_state_serves_the_json_snapshot_over_http_and_inspect_url_renders_it(fault_engine, capsys):
    eid, url = fault_engine.engine_id, fault_engine.base_url
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(httpx.post, url + "/v1/completions", json={"prompt": "pinned", "max_tokens": 4},
                             headers={"X-Request-Id": "stuck-debug-state"}, timeout=60)

        def pinned_in_both():
            answer = httpx.get(url + "/debug/state", params={"sample_s": "0"}, timeout=10)
            _, local = run_inspect(capsys, eid)
            remote = answer.json()
            stages = [[r["stage"] for r in s["requests"] if r["request_id"] == "stuck-debug-state"]
                      for s in (remote, local)]
            if answer.status_code == 200 and stages[0] == ["transfer"] and stages[1]:
                return remote, local
        remote, local = wait_until(pinned_in_both, 30, 0.05, "/debug/state and --json to show the pinned request")
        assert shape(remote) == shape(local)
        [row] = [r for r in remote["requests"] if r["request_id"] == "stuck-debug-state"]
        assert row["total_age_s"] >= row["age_in_stage_s"] > 0
        assert remote["engine_id"] == eid and remote["role"] == local["role"] == "both"
        assert future.result(timeout=60).status_code == 504

    assert inspect.main(["--url", url]) in (inspect.EXIT_OK, inspect.EXIT_PROBLEM)
    screen = capsys.readouterr().out
    assert f"node {url}  engine {eid}  role both" in screen
    assert all(part in screen for part in (f"pdserve engine {eid} (role both)", "actors", "queues", "live requests ("))
    code = inspect.main(["--url", url, "--json"])
    [source] = orjson.loads(capsys.readouterr().out)["sources"]
    assert source["ok"] and source["state"]["engine_id"] == eid
    assert code == (inspect.EXIT_OK if source["state"]["healthy"] else inspect.EXIT_PROBLEM)
    gone = refused_url()   # a node that does not answer: shown unreachable, the others still shown, exit status 1
    assert inspect.main(["--url", url, "--url", gone, "--json", "--timeout-s", "5"]) == inspect.EXIT_PROBLEM
    answered, refused = orjson.loads(capsys.readouterr().out)["sources"]
    assert answered["ok"] and answered["state"]["engine_id"] == eid
    assert refused["url"] == gone and not refused["ok"] and "refused" in refused["error"].lower()
    bad = httpx.get(url + "/debug/state", params={"sample_s": "soon"}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sample_s"


def test_inspect_tells_an_id_whose_events_were_overwritten_from_one_that_never_arrived(engine_factory, capsys):
    """A 64-event ring (16 per writer) forgets a request after a few more; the arrival index (ipc/arrivals.py)
    still knows it reached the server, 1.5 s after its proxy's X-Request-Start, and that an id never sent did not.
    A request still in the ring shows where its time went; /metrics has each request's time outside the engine."""
    engine = engine_factory("--kv-pool-tokens", "1024", "--recorder-events", "64")
    with httpx.Client(timeout=60) as client:
        for i in range(12):
            rid = "old-1" if i == 0 else f"later-{i}"
            sent = time.time()
            proxy = {"X-Request-Start": f"t={sent - 1.5:.3f}"} if i == 0 else {}
            answer = client.post(engine.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                                 headers={"X-Request-Id": rid, **proxy})
            assert answer.status_code == 200, answer.text
            if i == 0:
                first_wait_s = time.time() - sent   # the first request's arrival can lag (a fresh connection)
        metrics = client.get(engine.base_url + "/metrics").text
    assert inspect.main([engine.engine_id, "--request", "old-1"]) == 1
    text = capsys.readouterr().out
    assert "request 'old-1' reached this server" in text
    after = re.search(r"\(answered 200\), (\d+\.\d{3}) s after the proxy's X-Request-Start", text)
    assert after and 1.5 - 0.002 <= float(after.group(1)) <= 1.5 + first_wait_s + 0.002, (text, first_wait_s)
    outside = re.search(r"outside the engine: (\d+\.\d{3}) s", text)
    assert re.search(r"engine done at \+\d\.\d{3} s", text) and outside and float(outside.group(1)) >= 1.5, text
    assert inspect.main([engine.engine_id, "--request", "later-11"]) == 0
    text = capsys.readouterr().out
    assert "where its time went" in text and "no X-Request-Start" in text, text
    assert 'pdserve_request_outside_engine_seconds_count{peer="127.0.0.1"} 12.0' in metrics
    assert inspect.main([engine.engine_id, "--request", "never-sent"]) == 1
    assert ("request 'never-sent' never reached this server: the arrival index holds every request id answered "
            "since the engine started") in capsys.readouterr().out
