"""Soak: 300 requests with random injected faults (dropped and delayed completions, stuck transfers, decode
rejections), client disconnects, and decode0 SIGKILLed mid-run. Every request gets a final answer before its
deadline (a 200 whose body is complete, or an OpenAI error with a 503/504), the faults really fired and decode0
was really restarted; afterwards every gauge is 0, every KV block free, no live row, and once the engine has
stopped (before any test-side sweep) no segment or process of it is left."""
from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import httpx
import orjson
import psutil

from tests.conftest import (EngineProbe, assert_recovered, cleanup_engine, scrape, shm_segments, start_engine,
                            wait_until)

REQUESTS = 300
CONCURRENCY = 16
REQUEST_TIMEOUT_S = 20.0
# aimed at the soak's own requests (ids "soak-N"), so the probe request after the soak is fault-free
FAULTS = ("drop_transfer_done:fraction=0.04,seed=1,match=soak-;"
          "delay_transfer_done:seconds=1,fraction=0.1,seed=2,match=soak-;"
          "transfer_stuck:fraction=0.06,seed=3,match=soak-;decode_reject:fraction=0.03,seed=4,match=soak-")


def test_soak_every_request_gets_a_final_answer_and_nothing_leaks(tmp_path):
    engine = start_engine(tmp_path, "--kv-pool-tokens", "2048",
                          env={"PDSERVE_FAULTS": FAULTS, "PDSERVE_INFLIGHT_TIMEOUT_S": "2",
                               "PDSERVE_BOOTSTRAP_TIMEOUT_S": "4", "PDSERVE_ACTOR_HANG_TIMEOUT_S": "5",
                               "PDSERVE_REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S)})
    probe = EngineProbe(engine.engine_id)
    try:
        killed_pid = probe.pid("decode0")
        outcomes = asyncio.run(_drive(engine, killed_pid))
        bad = [o for o in outcomes if isinstance(o, tuple)]
        kinds = {k: sum(1 for o in outcomes if o == k) for k in set(outcomes) if isinstance(k, str)}
        assert len(outcomes) == REQUESTS
        reasons = sorted({(status, text.split(":")[0][:40]) for _, status, text in bad})
        assert not bad and "hang" not in kinds, (kinds, f"{len(bad)} bad answers, e.g.", reasons[:4])
        # while decode0 restarts, the router has no serving decode actor and answers 503 + Retry-After at once
        # (issue 12) instead of queueing: those are correct answers, judged above; most of the rest must succeed
        assert kinds.get("ok", 0) > REQUESTS // 4, kinds
        assert kinds.get("ok", 0) + kinds.get("retryable", 0) > REQUESTS // 2, kinds
        # the faults fired: stuck transfers timed out in stage transfer (a stuck transfer whose decode actor is
        # killed first is a 503 instead: the chance is why stuck transfers are 6%), rejections came back as 503s
        assert scrape(engine.base_url)["pdserve_request_timeouts_total{stage=transfer}"] >= 1
        assert kinds.get("transfer_timeout", 0) > 0 and kinds.get("retryable", 0) > 0, ("no fault showed", kinds)
        log = engine.log_text()
        assert "fault drop_transfer_done" in log and "fault decode_reject" in log, "a fault never fired"
        # decode0 was killed and the supervisor restarted it
        wait_until(lambda: probe.pid("decode0") not in (0, killed_pid), 120, 0.2, "decode0 restarted")
        assert scrape(engine.base_url)["pdserve_actor_restarts_total{actor=decode0}"] >= 1
        assert_recovered(engine, probe, timeout_s=120)
        child_pids = list(engine.child_pids) + [probe.pid(name) for name in ("prefill0", "decode0", "api", "monitor")]
        probe.close()
        code = engine.stop()
        # checked between the engine's own stop and the test's sweep (cleanup_engine), so a leak shows here
        assert code == 0, engine.log_text()[-2000:]
        wait_until(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                                   for p in child_pids), 10, message="no engine process left")
        leftover = shm_segments(engine.engine_id)
        assert leftover == [], f"the engine left shm segments behind: {leftover}"
    finally:
        probe.close()
        cleanup_engine(engine)


def judge(response: httpx.Response, stream: bool):
    """The outcome of one answered request: "ok" (a 200 with a complete body), "transfer_timeout" (a 504
    naming the transfer stage), "timeout" (another 504), "retryable" (a 503 with a message), "stream_error"
    (a 200 stream that ends with an error event, then [DONE]; "transfer_timeout" when that event names the transfer
    stage), else ("bad", status, text)."""
    text = response.text
    if response.status_code == 200:
        if stream:
            lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
            if not lines or lines[-1] != "[DONE]":
                return "bad", 200, f"stream without [DONE]: {text[-300:]}"
            events = [orjson.loads(line) for line in lines[:-1]]
            if events and "error" in events[-1]:
                message = events[-1]["error"].get("message") or ""
                return "transfer_timeout" if "stage transfer" in message else "stream_error"
            if any(c.get("finish_reason") in ("stop", "length") for e in events for c in e.get("choices", [])):
                return "ok"
            return "bad", 200, f"stream without a finish_reason: {text[-300:]}"
        choices = response.json().get("choices") or []
        if choices and all(c.get("finish_reason") in ("stop", "length") for c in choices):
            return "ok"
        return "bad", 200, text[:300]
    if response.status_code in (503, 504):
        message = response.json()["error"]["message"]
        if message and response.status_code == 503:
            return "retryable"
        if message:
            return "transfer_timeout" if "stage transfer" in message else "timeout"
    return "bad", response.status_code, text[:300]


async def _drive(engine, decode_pid: int) -> list:
    rng = random.Random(7)
    semaphore = asyncio.Semaphore(CONCURRENCY)
    outcomes: list = []
    killed = asyncio.Event()

    async def one(i: int, client: httpx.AsyncClient) -> None:
        async with semaphore:
            if i == REQUESTS // 2 and not killed.is_set():
                killed.set()
                os.kill(decode_pid, signal.SIGKILL)
            body = {"prompt": f"Request {i}: say something about the number {i}.", "max_tokens": rng.randint(2, 8),
                    "stream": rng.random() < 0.3}
            disconnect_after_s = rng.uniform(0.05, 1.0) if rng.random() < 0.1 else None
            start = time.monotonic()
            try:
                request = client.post(engine.base_url + "/v1/completions", json=body,
                                      headers={"X-Request-Id": f"soak-{i}"})
                if disconnect_after_s is not None:
                    try:   # an answer before the client goes away is judged like any other
                        response = await asyncio.wait_for(request, disconnect_after_s)
                    except asyncio.TimeoutError:
                        outcomes.append("disconnected")
                        return
                else:
                    response = await request
            except httpx.TimeoutException:
                outcomes.append("hang")
                return
            elapsed = time.monotonic() - start
            outcomes.append("hang" if elapsed > REQUEST_TIMEOUT_S + 2 else judge(response, body["stream"]))

    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S + 10) as client:
        await asyncio.gather(*(one(i, client) for i in range(REQUESTS)))
    return outcomes
