"""Stage-aware ejection on a 2 x 2 engine (issue 42 item 5): decode1 alone has a stuck transport for the first
three ``ej-`` requests it takes (``transfer_stuck:actor=decode1,count=3,match=ej-``); they time out in transfer, the
monitor drains decode1 with its reason (log, /metrics, /health, tools/inspect), traffic meanwhile goes to decode0
and sees no error; once the engine is idle, a readmission drill pinned to decode1 passes (the fault is used up) and
decode1 takes work again. One module engine; the tests run in file order."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from tests.conftest import cleanup_engine, probe_fixture, scrape, start_engine, wait_until
from tools import inspect as inspect_tool

TICK_S = 0.5
INFLIGHT_TIMEOUT_S = 1.5
DRILL_INTERVAL_S = 3.0
REASON = "decode1 drained: 3 transfer timeouts in 60 s"
BODY = {"prompt": "The three primary colors are", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = start_engine(tmp_path_factory.mktemp("ejection"), "--prefill-actors", "2", "--decode-actors", "2",
                       "--kv-pool-tokens", "2048",
                       env={"PDSERVE_FAULTS": "transfer_stuck:actor=decode1,count=3,match=ej-",
                            "PDSERVE_INFLIGHT_TIMEOUT_S": str(INFLIGHT_TIMEOUT_S),
                            "PDSERVE_MONITOR_TICK_S": str(TICK_S), "PDSERVE_DRILL_INTERVAL_S": str(DRILL_INTERVAL_S)},
                       ready_timeout_s=600)
    yield eng
    cleanup_engine(eng)


probe = probe_fixture()


def drained(engine) -> float:
    return scrape(engine.base_url)["pdserve_actor_drained{actor=decode1}"]


def decode_done(engine) -> dict[str, float]:
    metrics = scrape(engine.base_url)
    return {a: metrics[f"pdserve_actor_requests_done_total{{actor={a}}}"] for a in ("decode0", "decode1")}


class Traffic:
    """Two clients sending ``bg-`` requests back to back on a thread until ``stop``: the engine stays busy (no drill
    runs) and every answer's status is kept."""

    def __init__(self, base_url: str):
        self.base_url, self.statuses, self.stopping = base_url, [], threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self.run()), daemon=True)
        self.thread.start()

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            async def one_client(k: int) -> None:
                n = 0
                while not self.stopping.is_set():
                    n += 1
                    response = await client.post(self.base_url + "/v1/completions", json=BODY,
                                                  headers={"X-Request-Id": f"bg-{k}-{n}"})
                    self.statuses.append((response.status_code, response.text[:200]))
            await asyncio.gather(one_client(0), one_client(1))

    def stop(self) -> list:
        self.stopping.set()
        self.thread.join(timeout=60)
        assert not self.thread.is_alive()
        return self.statuses


async def wave(base_url: str, prefix: str, n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=60) as client:
        return await asyncio.gather(*(client.post(base_url + "/v1/completions", json=BODY,
                                                  headers={"X-Request-Id": f"{prefix}{i}"}) for i in range(n)))


def test_a_decode_actor_whose_transfers_keep_timing_out_is_drained_with_its_reason_and_traffic_sees_no_error(
        engine, probe):
    """With client traffic running throughout, waves of four ``ej-`` requests at once: the router spreads them
    over both decode actors; the three decode1 takes first are stuck in transfer and time out (504: the timeouts
    that drain it), every other one answers 200. decode1 then reads drained with its reason everywhere, takes no
    new request (its done count stays once its last one ended), and not one client request fails."""
    traffic = Traffic(engine.base_url)
    try:
        answers = []
        for k in range(6):   # until decode1 took three of them (each wave puts about half there)
            answers += [(r.status_code, r.text) for r in asyncio.run(wave(engine.base_url, f"ej-{k}-", 4))]
            if sum(status == 504 for status, _ in answers) >= 3:
                break
        assert sum(status == 504 for status, _ in answers) == 3, answers
        assert all(status == 200 or (status == 504 and "stage transfer" in text) for status, text in answers), answers
        wait_until(lambda: drained(engine) == 1, 10, 0.05, "decode1 drained on /metrics")
        assert scrape(engine.base_url)["pdserve_actor_drained{actor=decode0}"] == 0
        health = httpx.get(engine.base_url + "/health", timeout=5)
        assert health.status_code == 200 and REASON in health.json()["problems"], health.text
        view = inspect_tool.EngineView(engine.engine_id)
        try:
            snap = view.snapshot()
        finally:
            view.close()
        assert {a["name"]: a["drained"] for a in snap["actors"] if a["role"] == "decode"} == {
            "decode0": None, "decode1": REASON}
        assert REASON in snap["problems"]
        line = next(x for x in engine.log_text().splitlines() if "ejection: " + REASON in x)
        assert "ERROR" in line and "readmission drill" in line, line
        wait_until(lambda: scrape(engine.base_url)["pdserve_router_active_requests{actor=decode1}"] == 0, 30, 0.05,
                   "decode1's last requests from before the drain to end")
        before = decode_done(engine)
        wait_until(lambda: decode_done(engine)["decode0"] >= before["decode0"] + 6, 60, 0.1,
                   "six more requests served while decode1 is drained")
        assert decode_done(engine)["decode1"] == before["decode1"], "a drained actor took new work"
    finally:
        statuses = traffic.stop()
    assert statuses and all(status == 200 for status, _ in statuses), [s for s in statuses if s[0] != 200]


def test_a_passing_readmission_drill_on_the_idle_engine_readmits_the_drained_actor(engine, probe):
    """Idle, the API runs a drill pinned to decode1 in the stage after transfer (decode_waiting: it came through
    transfer there, the fault being used up); it passes, the monitor readmits decode1 (log, gauge 0, /health clear)
    and decode1 serves client requests again."""
    wait_until(lambda: drained(engine) == 0, 30, 0.1, "decode1 readmitted")
    log = engine.log_text()
    assert "readmission drill of decode1 (drained for transfer) passed in stage decode_waiting" in log
    assert f"ejection: decode1 readmitted after a passing readmission drill (it was {REASON})" in log
    assert REASON not in httpx.get(engine.base_url + "/health", timeout=5).json()["problems"]
    before = decode_done(engine)
    responses = asyncio.run(wave(engine.base_url, "ej-after-", 4))   # the fault is used up: nothing times out
    assert [r.status_code for r in responses] == [200] * 4, [r.text[:200] for r in responses]
    assert decode_done(engine)["decode1"] > before["decode1"]
    metrics = scrape(engine.base_url)
    assert metrics["pdserve_request_timeouts_total{stage=transfer}"] == 3   # the drills' timeouts are not counted
