"""N x M actors behind the router (`--prefill-actors 2 --decode-actors 2`): one module engine.

Order matters (pytest keeps file order): answers and per-actor work first, then a decode actor killed and
restarted, then the router-count fault (it leaves the router's count wrong for good, so it runs last)."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from tests.conftest import EngineProbe, assert_recovered, cleanup_engine, scrape, start_engine, wait_until
from tools import inspect as inspect_tool

TICK_S = 0.5
PROMPTS = ["The three primary colors are", "def fibonacci(n):", "Once upon a time", "Le fromage préféré"]
ACTORS = ("prefill0", "prefill1", "decode0", "decode1")
FAULTS = "router_count_drift:count_delta=1,count=1,match=drift-"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = start_engine(tmp_path_factory.mktemp("nxm"), "--prefill-actors", "2", "--decode-actors", "2",
                       "--kv-pool-tokens", "2048",
                       env={"PDSERVE_FAULTS": FAULTS, "PDSERVE_MONITOR_TICK_S": str(TICK_S)}, ready_timeout_s=600)
    yield eng
    cleanup_engine(eng)


@pytest.fixture(scope="module")
def probe(engine):
    p = EngineProbe(engine.engine_id)
    yield p
    p.close()


def done_by_actor(base_url: str) -> dict[str, float]:
    metrics = scrape(base_url)
    return {a: metrics[f"pdserve_actor_requests_done_total{{actor={a}}}"] for a in ACTORS}


async def post_all(base_url: str, bodies: list[dict], headers: list[dict] | None = None) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=300) as client:
        return await asyncio.gather(*(client.post(base_url + "/v1/completions", json=body,
                                                  headers=(headers or [{}] * len(bodies))[i])
                                      for i, body in enumerate(bodies)))


def test_16_concurrent_greedy_answers_equal_each_alone_and_all_four_actors_work(engine, probe):
    body = {"temperature": 0, "max_tokens": 8}
    alone = {p: httpx.post(engine.base_url + "/v1/completions", json={**body, "prompt": p}, timeout=300)
             .json()["choices"][0]["text"] for p in PROMPTS}
    before = done_by_actor(engine.base_url)
    prompts = PROMPTS * 4
    responses = asyncio.run(post_all(engine.base_url, [{**body, "prompt": p} for p in prompts]))
    assert [r.status_code for r in responses] == [200] * 16
    assert [r.json()["choices"][0]["text"] for r in responses] == [alone[p] for p in prompts]
    after = done_by_actor(engine.base_url)
    assert all(after[a] > before[a] for a in ACTORS), (before, after)
    assert sum(after[a] - before[a] for a in ("decode0", "decode1")) == 16
    assert_recovered(engine, probe)
    metrics = scrape(engine.base_url)
    assert all(metrics[f"pdserve_router_active_requests{{actor={a}}}"] == 0 for a in ACTORS)
    assert all(metrics[f"pdserve_router_engine_mismatch_total{{actor={a}}}"] == 0 for a in ACTORS)


def test_a_killed_decode_actor_fails_only_its_requests_and_the_others_serve_on(engine, probe):
    from ipc.actor_table import ActorStatus
    from ipc.lifecycle import RequestState as S

    body = {"prompt": "Tell me a long story about a robot.", "max_tokens": 200, "ignore_eos": True,
            "temperature": 0}
    ids = [f"kill-{i}" for i in range(8)]
    victim = "decode1"
    victim_index = probe.actors.find(victim)
    pid_before = probe.pid(victim)

    async def run():
        task = asyncio.ensure_future(post_all(engine.base_url, [body] * 8, [{"X-Request-Id": i} for i in ids]))

        def all_decoding():
            rows = [probe.rows_with_id(i) for i in ids]
            return all(r and r[0]["state"] == S.DECODING for r in rows)
        await asyncio.to_thread(wait_until, all_decoding, 120, 0.02, "all 8 requests decoding")
        on_victim = {i for i in ids if probe.rows_with_id(i)[0]["decode_actor"] == victim_index}
        os.kill(pid_before, signal.SIGKILL)
        await asyncio.to_thread(wait_until, lambda: all(not probe.rows_with_id(i) or probe.rows_with_id(i)[0][
            "state"] == S.FAILED for i in on_victim), 10, 0.02, "the victim's requests failed")
        # the next 8 go to the survivor at once, while decode1 is still loading its model
        before = done_by_actor(engine.base_url)
        more = await post_all(engine.base_url, [{"prompt": "Hello", "max_tokens": 4}] * 8)
        victim_status = probe.actor(victim)["status"]
        return on_victim, await task, more, before, victim_status

    on_victim, responses, more, before, victim_status = asyncio.run(run())
    assert len(on_victim) == 4   # the router spread them evenly
    for request_id, response in zip(ids, responses):
        if request_id in on_victim:
            assert response.status_code == 503, response.text
            assert "decode1" in response.json()["error"]["message"]
        else:
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["finish_reason"] == "length"
    assert [r.status_code for r in more] == [200] * 8
    assert victim_status != ActorStatus.READY   # they were served without waiting for the restart
    after = done_by_actor(engine.base_url)
    assert after[victim] == before[victim]   # decode1 (dead, then loading) finished none of them
    # the restarted actor rejoins the rotation by itself
    wait_until(lambda: probe.actor(victim)["status"] == ActorStatus.READY, 400, 0.2, "decode1 restarted")
    asyncio.run(post_all(engine.base_url, [{"prompt": "Hello", "max_tokens": 4}] * 4))
    assert done_by_actor(engine.base_url)[victim] > after[victim]
    assert_recovered(engine, probe, timeout_s=30)


def test_a_drifting_router_count_is_flagged_within_two_ticks_in_metrics_and_inspect(engine, probe):
    response = httpx.post(engine.base_url + "/v1/completions", headers={"X-Request-Id": "drift-1"},
                          json={"prompt": "Hello", "max_tokens": 2}, timeout=120)
    assert response.status_code == 200
    drifted_at = time.monotonic()

    def flagged():
        metrics = scrape(engine.base_url)
        return all(metrics[f"pdserve_router_engine_mismatch_total{{actor={a}}}"] == 1 for a in ACTORS)
    wait_until(flagged, 10, 0.05, "the mismatch counted for every actor")
    assert time.monotonic() - drifted_at <= 3 * TICK_S + 0.75   # two ticks, plus a tick's phase and HTTP
    metrics = scrape(engine.base_url)
    assert all(metrics[f"pdserve_router_active_requests{{actor={a}}}"] == 1 for a in ACTORS)   # 1 off the table
    view = inspect_tool.EngineView(engine.engine_id)
    try:
        snap = view.snapshot()
    finally:
        view.close()
    engine_actors = [a for a in snap["actors"] if a["name"] in ACTORS]
    assert all(a["router_mismatch"] and a["router_count"] == 1 and a["table_count"] == 0 for a in engine_actors)
    assert not snap["healthy"] and any("router counts 1" in p for p in snap["problems"])
    line = inspect_tool.list_lines([engine.engine_id])[1]
    assert line.split()[0] == engine.engine_id and engine.base_url in line and line.split()[1] == str(engine.proc.pid)
