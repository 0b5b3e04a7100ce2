"""Soak: 300 requests with random injected faults (dropped and delayed completions, stuck transfers, decode
rejections), client disconnects, and one actor SIGKILLed mid-run. Every request gets a final answer before
its deadline; afterwards every gauge is 0, every KV block free, no live row, no leaked segment or process."""
from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import httpx
import orjson
import psutil

from tests.conftest import EngineProbe, assert_recovered, cleanup_engine, shm_segments, start_engine, wait_until

REQUESTS = 300
CONCURRENCY = 16
REQUEST_TIMEOUT_S = 20.0
# aimed at the soak's own requests (ids "soak-N"), so the probe request after the soak is fault-free
FAULTS = ("drop_transfer_done:fraction=0.04,seed=1,match=soak-;"
          "delay_transfer_done:seconds=1,fraction=0.1,seed=2,match=soak-;"
          "transfer_stuck:fraction=0.03,seed=3,match=soak-;decode_reject:fraction=0.03,seed=4,match=soak-")


def test_soak_every_request_gets_a_final_answer_and_nothing_leaks(tmp_path):
    engine = start_engine(tmp_path, "--kv-pool-tokens", "2048",
                          env={"PDSERVE_FAULTS": FAULTS, "PDSERVE_INFLIGHT_TIMEOUT_S": "2",
                               "PDSERVE_BOOTSTRAP_TIMEOUT_S": "4", "PDSERVE_ACTOR_HANG_TIMEOUT_S": "5",
                               "PDSERVE_REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S)})
    probe = EngineProbe(engine.engine_id)
    child_pids = list(engine.child_pids)
    try:
        outcomes = asyncio.run(_drive(engine, probe))
        bad = [o for o in outcomes if isinstance(o, tuple)]
        outcomes = [o[0] if isinstance(o, tuple) else o for o in outcomes]
        kinds = {k: sum(1 for o in outcomes if o == k) for k in set(outcomes)}
        assert len(outcomes) == REQUESTS
        assert "hang" not in kinds and "bad" not in kinds, (kinds, bad[:3])
        assert kinds.get("ok", 0) > REQUESTS // 2, kinds
        assert_recovered(engine, probe, timeout_s=120)
        child_pids += [probe.pid(name) for name in ("prefill0", "decode0", "api", "monitor")]
    finally:
        probe.close()
        code = engine.stop()
        cleanup_engine(engine)
    assert code == 0
    assert shm_segments(engine.engine_id) == []
    wait_until(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                               for p in child_pids), 10, message="no engine process left")


async def _drive(engine, probe) -> list[str]:
    rng = random.Random(7)
    semaphore = asyncio.Semaphore(CONCURRENCY)
    outcomes: list[str] = []
    killed = asyncio.Event()

    async def one(i: int, client: httpx.AsyncClient) -> None:
        async with semaphore:
            if i == REQUESTS // 2 and not killed.is_set():
                killed.set()
                os.kill(probe.pid("decode0"), signal.SIGKILL)
            body = {"prompt": f"Request {i}: say something about the number {i}.", "max_tokens": rng.randint(2, 8),
                    "stream": rng.random() < 0.3}
            disconnect_after_s = rng.uniform(0.05, 1.0) if rng.random() < 0.1 else None
            start = time.monotonic()
            try:
                request = client.post(engine.base_url + "/v1/completions", json=body,
                                      headers={"X-Request-Id": f"soak-{i}"})
                if disconnect_after_s is not None:
                    try:
                        await asyncio.wait_for(request, disconnect_after_s)
                    except asyncio.TimeoutError:
                        outcomes.append("disconnected")
                        return
                    outcomes.append("ok")
                    return
                response = await request
            except httpx.TimeoutException:
                outcomes.append("hang")
                return
            elapsed = time.monotonic() - start
            if elapsed > REQUEST_TIMEOUT_S + 2:
                outcomes.append("hang")
            elif response.status_code == 200:
                text = response.text
                if body["stream"]:
                    last = [line for line in text.splitlines() if line.startswith("data: ")][-2]
                    event = orjson.loads(last[6:])
                    outcomes.append("error" if "error" in event else "ok")
                else:
                    outcomes.append("ok" if response.json()["choices"] else ("bad", 200, text[:300]))
            elif response.status_code in (503, 504) and response.json()["error"]["message"]:
                outcomes.append("error")
            else:
                outcomes.append(("bad", response.status_code, response.text[:300]))

    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S + 10) as client:
        await asyncio.gather(*(one(i, client) for i in range(REQUESTS)))
    return outcomes
