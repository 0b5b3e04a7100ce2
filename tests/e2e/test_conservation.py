"""Conservation by identity on one real engine (api/conservation.py; issue 42 item 4): a row the ``duplicate_row``
fault adds for a request (its id held twice in the state table) and a connection whose ledger count the
``ledger_count_drift`` fault makes drift are each named within two ticks: an ERROR line naming the id and the layer
(the connection and its peer), ``pdserve_conservation_violations_total{kind}``, an incident bundle. Ordinary traffic
(a client's reused id, ``n`` > 1) is never named: that test runs first (module order)."""
from __future__ import annotations

import concurrent.futures
import re
import time

import httpx
import pytest

from tests.conftest import cleanup_engine, scrape, start_engine, wait_until

TICK_S = 0.5
FAULTS = "duplicate_row:match=dup-;ledger_count_drift:match=ledgerdrift-"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    incidents = tmp_path_factory.mktemp("incidents")
    eng = start_engine(tmp_path_factory.mktemp("conservation"),
                       env={"PDSERVE_FAULTS": FAULTS, "PDSERVE_MONITOR_TICK_S": str(TICK_S),
                            "PDSERVE_INCIDENT_DIR": str(incidents), "PDSERVE_INCIDENT_MIN_INTERVAL_S": "0",
                            # the duplicated row is live until its queue deadline: the stop's drain waits on it
                            "PDSERVE_DRAIN_TIMEOUT_S": "1"})
    eng.incident_dir = incidents
    yield eng
    cleanup_engine(eng)


def alarms(engine) -> list[str]:
    """The API's conservation alarms in the engine's log (the monitor's KV-block ones left out)."""
    return [line for line in engine.log_text().splitlines()
            if " ERROR conservation: " in line and "KV blocks" not in line]


def violations(engine) -> dict[str, float]:
    metrics = scrape(engine.base_url)
    return {k: metrics[f"pdserve_conservation_violations_total{{kind={k}}}"]
            for k in ("blocks", "id_twice", "id_orphan", "inflight")}


def conservation_bundle(engine, request_id: str) -> dict | None:
    from tools.bundle import read_bundle

    for path in sorted(engine.incident_dir.glob("incident-*-conservation.tar.gz")):
        bundle = read_bundle(str(path))
        if request_id in bundle["incident.json"]["request_ids"]:
            return bundle
    return None


def ticks_pass(engine, n: int) -> None:
    """Wait for ``n`` more watchdog ticks (the API checks on the same period, ``monitor_tick_s``)."""
    def ticks() -> float:
        return scrape(engine.base_url)["pdserve_watchdog_ticks_total"]
    start = ticks()
    wait_until(lambda: ticks() >= start + n, 10 * n * TICK_S, 0.05, f"{n} watchdog ticks")


def complete(engine, client: httpx.Client | None = None, **body) -> httpx.Response:
    headers = {"X-Request-Id": body.pop("rid")}
    post = (client or httpx).post
    return post(engine.base_url + "/v1/completions", headers=headers, timeout=60,
                json={"prompt": "lighthouses", "max_tokens": 2, **body})


def test_ordinary_traffic_with_reused_ids_and_several_choices_is_never_named(engine):
    """Four requests at once, two with the same client id, one with n=2: after they end and three more checks,
    nothing was named and every counter reads 0."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        sent = [pool.submit(complete, engine, rid=rid, n=n) for rid, n in
                (("same-1", 1), ("same-1", 1), ("choices-1", 2), ("other-1", 1))]
        assert all(f.result().status_code == 200 for f in sent), [f.result().text for f in sent]
    ticks_pass(engine, 3)   # a bound on a negative: three checks that could have named something
    assert alarms(engine) == [] and set(violations(engine).values()) == {0}


def test_a_duplicated_row_is_named_held_twice_in_the_table_within_two_ticks(engine):
    """The duplicate_row fault allocates a second row with the request's id that no handle holds: the API names
    the id and the table layer within two ticks (slack for a loaded machine), once, counts it, and writes an
    incident bundle naming it. (A short request may have ended by the second check: the extra row is then named as
    having no API handle; both are the same finding, reported once.)"""
    sent = time.monotonic()
    assert complete(engine, rid="dup-1").status_code == 200
    line = wait_until(lambda: [a for a in alarms(engine) if "dup-1" in a], 2 * TICK_S + 3.0, 0.05,
                      "the conservation alarm")[0]
    assert time.monotonic() - sent < 2 * TICK_S + 3.0
    assert "request dup-1 is" in line and "state table" in line and "[layer table]" in line, line
    counts = violations(engine)
    assert counts["id_twice"] + counts["id_orphan"] == 1, counts
    bundle = wait_until(lambda: conservation_bundle(engine, "dup-1"), 20, 0.2, "the conservation incident")
    assert "dup-1" in bundle["incident.json"]["detail"]
    assert any("dup-1" in t["request_id"] for t in bundle["timelines/incident.json"]["timelines"])
    ticks_pass(engine, 2)
    assert len([a for a in alarms(engine) if "dup-1" in a]) == 1   # once while it stands


def test_a_connection_whose_ledger_count_drifted_is_named_with_its_peer_and_ids(engine):
    """The ledger_count_drift fault records the request's start twice in the connection ledger: with the
    keep-alive connection left open, the API names the connection, its peer and the id within two ticks (its count
    one above the API's), once, counts it, and writes an incident bundle naming the id."""
    with httpx.Client() as client:
        sent = time.monotonic()
        assert complete(engine, client, rid="ledgerdrift-1").status_code == 200
        line = wait_until(lambda: [a for a in alarms(engine) if "ledgerdrift-1" in a], 2 * TICK_S + 3.0, 0.05,
                          "the in-flight alarm")[0]
        assert time.monotonic() - sent < 2 * TICK_S + 3.0
        found = re.search(r"from 127\.0\.0\.1:\d+: the API has (\d+) requests in progress on it .* its ledger row "
                          r"counts (\d+) \(.*ledgerdrift-1", line)
        assert found and int(found.group(2)) == int(found.group(1)) + 1, line   # drifted by the start counted twice
        assert violations(engine)["inflight"] == 1
        bundle = wait_until(lambda: conservation_bundle(engine, "ledgerdrift-1"), 20, 0.2, "the incident")
        assert "ledger row counts" in bundle["incident.json"]["detail"]
