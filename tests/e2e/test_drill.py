"""The watchdog fire drill (api/drill.py) on one real engine: a round of drills every DRILL_INTERVAL_S, and a monitor
blind to the first drill only (``monitor_blind:match=drill-,count=1``), so the first drill (stage queued) fails and
the later ones pass. The blind test runs first (module order): it watches that first drill."""
from __future__ import annotations

import time

import httpx
import pytest

from tests.conftest import FRANCE_QUESTION, cleanup_engine, probe_fixture, scrape, start_engine, wait_until

DRILL_INTERVAL_S = 1.0
DRILL_TIMEOUT_S = 1.0
TICK_S = 0.5
SLACK_S = 0.25   # api/drill.py SLACK_S
STAGES = ("queued", "prefill", "bootstrap", "transfer", "decode_waiting", "decode")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    incidents = tmp_path_factory.mktemp("incidents")
    eng = start_engine(tmp_path_factory.mktemp("drill"),
                       env={"PDSERVE_DRILL_INTERVAL_S": str(DRILL_INTERVAL_S),
                            "PDSERVE_DRILL_TIMEOUT_S": str(DRILL_TIMEOUT_S), "PDSERVE_MONITOR_TICK_S": str(TICK_S),
                            "PDSERVE_FAULTS": "monitor_blind:match=drill-,count=1",
                            "PDSERVE_INCIDENT_DIR": str(incidents), "PDSERVE_INCIDENT_MIN_INTERVAL_S": "0"})
    eng.ready_at = time.monotonic()   # /health answered 200: the actors serve, drills can be admitted
    eng.incident_dir = incidents
    yield eng
    cleanup_engine(eng)


probe = probe_fixture()


def problems(engine) -> list[str]:
    response = httpx.get(engine.base_url + "/health", timeout=5)
    assert response.status_code == 200, response.text   # a failed drill is a problem, not an outage
    return response.json()["problems"]


def test_a_drill_the_monitor_cannot_fire_on_raises_the_alarm_and_a_health_problem_within_one_interval(engine, probe):
    """The first drill meets a monitor blind to it: /health names the failed stage within one drill interval of the
    engine serving plus the drill itself (the driver's poll, the limit, one tick, the slack), the API logs an
    ERROR, the failure is counted, the drill's row is aborted and released, and an incident bundle names the
    stage, the id, the verdict and the holder's stacks; the engine keeps answering 200."""
    wait_until(lambda: any("watchdog drill of stage queued failed" in p for p in problems(engine)), 30, 0.02,
               "/health to name the failed drill")
    seen_s = time.monotonic() - engine.ready_at
    bound_s = DRILL_INTERVAL_S + TICK_S + DRILL_TIMEOUT_S + TICK_S + SLACK_S + 1.0   # + 1 s: a loaded 2-core host
    assert seen_s <= bound_s, f"the alarm came {seen_s:.2f} s after the engine served (bound {bound_s:.2f} s)"
    assert any("did not fire within drill_timeout_s + one tick" in p for p in problems(engine))
    assert scrape(engine.base_url)["pdserve_watchdog_drill_failures_total{stage=queued}"] >= 1
    wait_until(lambda: "watchdog drill drill-queued-1 FAILED" in engine.log_text(), 5, 0.1, "the ERROR line")
    line = next(x for x in engine.log_text().splitlines() if "drill-queued-1 FAILED" in x)
    assert "ERROR" in line, line
    wait_until(lambda: not probe.rows_with_id("drill-queued-1"), 5, 0.05, "the failed drill's row released")
    from tools.bundle import read_bundle

    path = wait_until(lambda: sorted(engine.incident_dir.glob("incident-*-drill.tar.gz")), 30, 0.2,
                      "the failed drill's incident bundle")[0]
    bundle = read_bundle(str(path))
    incident = bundle["incident.json"]   # its stage, id and the judge's verdict
    assert incident["kind"] == "drill" and incident["stage"] == "queued", incident
    assert incident["request_ids"] == ["drill-queued-1"] and incident["deadline_field"] == "drill_timeout_s"
    assert "did not fire within drill_timeout_s + one tick" in incident["detail"], incident
    (holder,) = bundle["holders.json"]["holders"]   # the actor its row waited at: its stacks and loop counters
    assert holder["actor"] == "prefill0" and 'File "' in holder["stacks"], holder
    (timeline,) = bundle["timelines/incident.json"]["timelines"]
    assert timeline["request_id"] == "drill-queued-1"


def test_every_stage_is_drilled_and_passes_while_a_client_request_is_served(engine, probe):
    """Rounds of drills on an idle engine: each stage's last success on /metrics, the queued stage's earlier
    failure cleared from /health by its next pass, no drill counted as a client timeout or touching the prefix
    cache; a client request sent while drills run is served normally."""
    def passed() -> dict[str, float]:
        metrics = scrape(engine.base_url)
        return {s: metrics[f"pdserve_watchdog_drill_last_success_timestamp{{stage={s}}}"] for s in STAGES}
    wait_until(lambda: passed()["queued"] > 0, 60, 0.1, "a first pass of the queued drill")
    before = scrape(engine.base_url)   # a round of every stage ran before it, and no client request yet
    assert before["pdserve_prefix_cache_cached_blocks{actor=prefill0}"] == 0
    assert before["pdserve_prefix_cache_query_tokens_total{actor=prefill0}"] == 0
    response = httpx.post(engine.base_url + "/v1/completions", headers={"X-Request-Id": "drill-client-1"},
                          json={"prompt": FRANCE_QUESTION, "max_tokens": 8, "temperature": 0}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert response.headers["x-request-id"] != "drill-client-1"   # the drills' prefix is the engine's own
    wait_until(lambda: all(passed().values()), 90, 0.2, "every stage's drill to pass")
    now = time.time()
    assert all(now - t < 90 for t in passed().values()), passed()
    wait_until(lambda: not problems(engine), 30, 0.1, "/health with no problem (the failed stage passed again)")
    metrics = scrape(engine.base_url)
    assert all(metrics[f"pdserve_request_timeouts_total{{stage={s}}}"] == 0 for s in STAGES), metrics
    assert all(metrics[f"pdserve_watchdog_drills_total{{stage={s}}}"] >= 1 for s in STAGES)
    assert metrics["pdserve_prefix_cache_hit_tokens_total{actor=prefill0}"] == 0
    assert sum(v for k, v in metrics.items() if k.startswith("pdserve_requests_total{")) == 1   # the client's only
    state = httpx.get(engine.base_url + "/debug/state", params={"sample_s": "0"}, timeout=10).json()
    assert set(state["watchdog"]["drills"]) == set(STAGES)
    assert all(r["drill"] == r["request_id"].startswith("drill-") for r in state["requests"])
