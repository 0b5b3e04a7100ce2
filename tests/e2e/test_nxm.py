"""N x M actors behind the router (`--prefill-actors 2 --decode-actors 2`): one module engine.

Order matters (pytest keeps file order): the idle-CPU window first (nothing has run yet), answers and per-actor
work, a decode actor killed and restarted, a decode actor stopped (hung) and a prefill actor killed (their
restarts overlap, and one test checks both rejoin), the health split (one decode actor killed, then both), then
the router-count fault (it leaves the router's count
wrong for good, so it runs last)."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import psutil
import pytest

from ipc.cache_summary import CacheSummary
from ipc.naming import segment_name
from tests.conftest import assert_recovered, cleanup_engine, probe_fixture, scrape, start_engine, wait_until
from tools import inspect as inspect_tool

TICK_S = 0.5
HANG_TIMEOUT_S = 10.0   # the config default, stated: a stopped actor is declared hung after this (4 s gave false
# hangs on a loaded 2-core machine)
IDLE_WINDOW_S = 15.0   # a 20 Hz poller wakes 300 times in it, 2.5x the 120 allowed
IDLE_CPU_FRACTION = 0.05
IDLE_WAKEUPS_PER_S = 8   # the API's two threads wake 2/s each with idle_wait_s 0.5 s; a 20 Hz poller fails
PROMPTS = ["The three primary colors are", "def fibonacci(n):", "Once upon a time", "Le fromage préféré"]
ACTORS = ("prefill0", "prefill1", "decode0", "decode1")
# On the first "pkill-" request it takes, prefill1 blocks (no heartbeat) until the test kills it, well before
# HANG_TIMEOUT_S would call it hung, and prefill0 for 2 s: no prompt is prefilled while the 8 are admitted, so
# the router's least-queued-tokens choice alternates and each holds 4
FAULTS = ";".join(["router_count_drift:count_delta=1,count=1,match=drift-",
                    "stall:actor=prefill1,seconds=60,count=1,match=pkill-",
                    "stall:actor=prefill0,seconds=2,count=1,match=pkill-"])
# long enough that every request is still decoding once all 8 are admitted, short enough to finish soon on a
# loaded machine (decode there can fall to a few tokens per second)
LONG = {"prompt": "Tell me a long story about a robot.", "max_tokens": 96, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = start_engine(tmp_path_factory.mktemp("nxm"), "--prefill-actors", "2", "--decode-actors", "2",
                       "--kv-pool-tokens", "2048",
                       env={"PDSERVE_FAULTS": FAULTS, "PDSERVE_MONITOR_TICK_S": str(TICK_S),
                            "PDSERVE_ACTOR_HANG_TIMEOUT_S": str(HANG_TIMEOUT_S)}, ready_timeout_s=600)
    yield eng
    cleanup_engine(eng)


probe = probe_fixture()


def done_by_actor(base_url: str) -> dict[str, float]:
    metrics = scrape(base_url)
    return {a: metrics[f"pdserve_actor_requests_done_total{{actor={a}}}"] for a in ACTORS}


def prefill_hits(base_url: str) -> dict[str, float]:
    """Prompt tokens each prefill actor found in its prefix cache so far (/metrics)."""
    metrics = scrape(base_url)
    return {a: metrics.get(f"pdserve_prefix_cache_hit_tokens_total{{actor={a}}}", 0) for a in ("prefill0", "prefill1")}


async def post_all(base_url: str, bodies: list[dict], headers: list[dict] | None = None) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=300) as client:
        return await asyncio.gather(*(client.post(base_url + "/v1/completions", json=body,
                                                  headers=(headers or [{}] * len(bodies))[i])
                                      for i, body in enumerate(bodies)))


def sched(process: psutil.Process) -> tuple[float, int]:
    """``(CPU seconds, times scheduled)`` of ``process``'s live threads, from the scheduler's exact counters
    (``/proc/PID/task/*/schedstat``: run time in ns, timeslices run). Not psutil's ``cpu_times()``: utime/stime
    are sampled at the timer tick, and a loop woken by a timer is running as the tick fires."""
    total_ns = slices = 0
    for task in os.listdir(f"/proc/{process.pid}/task"):
        try:
            with open(f"/proc/{process.pid}/task/{task}/schedstat") as f:
                fields = f.read().split()
        except FileNotFoundError:   # the thread exited meanwhile
            continue
        total_ns, slices = total_ns + int(fields[0]), slices + int(fields[2])
    return total_ns / 1e9, slices


def test_an_idle_engine_wakes_each_process_a_few_times_a_second_and_never_polls_hot(engine, probe):
    """Issue 13: idle for IDLE_WINDOW_S, each actor (and the supervisor) is scheduled at most
    IDLE_WAKEUPS_PER_S times a second (its loop blocks on its inbox or timer for idle_wait_s, the monitor ticks
    every monitor_tick_s, the supervisor waits a second; a loop polling at 20 Hz, as before, fails) and uses under
    IDLE_CPU_FRACTION of a core (a hot loop uses all of it). The CPU share is printed: issue 13's 1% target is not
    asserted, because on this VM a wake-up from idle costs a Python process milliseconds of CPU whatever the loop
    does (docs/performance.md section 21).
    Measured once start-up's background work (grammar warm-ups, off the actors' loops after READY) has ended."""
    supervisor = psutil.Process(engine.proc.pid)
    children = {c.pid for c in supervisor.children()}
    processes = {name: psutil.Process(probe.pid(name)) for name in ACTORS + ("api", "monitor")}
    assert {p.pid for p in processes.values()} <= children
    processes["supervisor"] = supervisor

    def rates(first: dict, wall_s: float) -> dict[str, tuple[float, float]]:
        """Per process, (CPU fraction, wake-ups per second) since ``first``."""
        now = {name: sched(p) for name, p in processes.items()}
        return {n: ((now[n][0] - first[n][0]) / wall_s, (now[n][1] - first[n][1]) / wall_s) for n in processes}

    def busy(sample: dict) -> dict:
        return {n: (round(f, 4), round(w, 1)) for n, (f, w) in sample.items()
                if f >= IDLE_CPU_FRACTION or w > IDLE_WAKEUPS_PER_S}

    def settled() -> bool:   # start-up's tail (background grammar warm-ups) is over: a quiet 3 s sample
        first, since = {name: sched(p) for name, p in processes.items()}, time.monotonic()
        time.sleep(3.0)
        still = busy(rates(first, time.monotonic() - since))
        assert not still, f"still busy (CPU fraction, wake-ups/s over 3 s): {still}"   # wait_until names it
        return True
    wait_until(settled, 120, 0.0, "the engine's start-up work to end")
    before = {name: sched(p) for name, p in processes.items()}
    started = time.monotonic()
    while (left_s := started + IDLE_WINDOW_S - time.monotonic()) > 0:   # the measured window, kept idle
        assert not probe.live_rows()
        time.sleep(min(left_s, 1.0))
    sample = rates(before, time.monotonic() - started)
    assert all(p.is_running() for p in processes.values())   # no actor restarted meanwhile
    print("idle per process over %.0f s (CPU fraction, wake-ups/s): %s (load average %s)" % (
        IDLE_WINDOW_S, {n: (round(f, 4), round(w, 1)) for n, (f, w) in sample.items()}, os.getloadavg()))
    assert not busy(sample), sample


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


def test_multi_block_prompts_hand_off_between_the_pools_and_each_prefill_actor_reuses_its_cache(engine, probe):
    """Two prompts of 5 KV blocks each (4 full + 6 tokens), sent at once (the router gives each prefill actor one:
    fewest queued tokens), then again at once (each goes where its prefix is cached): every block is handed to a
    decode actor of the other pool, the repeats hit the cache on both prefill actors, and the greedy text is the
    same."""
    prompts = [[(i * 7919 + 13 * k) % 30000 + 200 for i in range(70)] for k in (1, 2)]
    body = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}

    def hits() -> dict[str, float]:
        return prefill_hits(engine.base_url)
    before = hits()
    first = asyncio.run(post_all(engine.base_url, [{**body, "prompt": p} for p in prompts]))
    again = asyncio.run(post_all(engine.base_url, [{**body, "prompt": p} for p in prompts]))
    assert [r.status_code for r in first + again] == [200] * 4
    assert [r.json()["choices"][0]["text"] for r in again] == [r.json()["choices"][0]["text"] for r in first]
    assert [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in first + again] == [0, 0, 69, 69]
    after = hits()
    assert all(after[a] - before[a] == 69 for a in after), (before, after)   # one repeat on each prefill actor
    assert_recovered(engine, probe)


def test_each_turn_of_a_session_goes_to_the_prefill_actor_that_cached_its_earlier_turns(engine, probe):
    """Issue 28, cache-aware routing: 4 sessions of 4 turns, each turn's prompt the previous one plus 20 new
    tokens. The first turns go out at once (load spreads them over both prefill actors); turns 2-4 one at a time,
    last session first, so load alone (every queue empty) would send each to prefill0. Every later turn reuses
    at least the full blocks of its session's previous prompt, and both prefill actors serve such hits."""
    sessions = [[(i * 7919 + 31 * s) % 30000 + 200 for i in range(40)] for s in range(4)]
    body = {"temperature": 0, "max_tokens": 2, "ignore_eos": True}
    before = prefill_hits(engine.base_url)
    first = asyncio.run(post_all(engine.base_url, [{**body, "prompt": p} for p in sessions]))
    assert [r.status_code for r in first] == [200] * 4
    cached: dict[tuple[int, int], tuple[int, int]] = {}   # (session, turn) -> (cached tokens, full blocks' tokens)
    for turn in range(2, 5):
        for s in reversed(range(4)):
            previous = sessions[s]
            sessions[s] = previous + [(t * 104729 + 17 * s + turn) % 30000 + 200 for t in range(20)]
            response = httpx.post(engine.base_url + "/v1/completions", json={**body, "prompt": sessions[s]},
                                  timeout=300)
            assert response.status_code == 200, response.text
            cached[s, turn] = (response.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
                               len(previous) // 16 * 16)
    assert all(hit >= full for hit, full in cached.values()), cached
    after = prefill_hits(engine.base_url)
    assert all(after[a] > before[a] for a in after), (before, after)   # the sessions were on both actors
    assert_recovered(engine, probe)


async def fail_one_actor_while_serving(engine, probe, ids: list[str], body: dict, victim: str, victim_holds,
                                       fault) -> tuple[set[str], list[httpx.Response], list[httpx.Response], dict]:
    """Send ``body`` under ``ids`` at once; once every one was admitted and ``victim_holds(latest row by id)``
    returns the ids the victim holds, run ``fault()`` on it and wait for exactly those rows to turn FAILED; then
    send 8 more requests. Returns (ids on the victim, the answers, the 8 more answers, the victim's actor row
    when the 8 more were sent: a restart with a warm prepared-model cache can be over before they are done). A
    row released (its request answered) stays in ``latest`` as last seen."""
    from ipc.lifecycle import RequestState as S

    task = asyncio.ensure_future(post_all(engine.base_url, [body] * len(ids), [{"X-Request-Id": i} for i in ids]))
    latest: dict[str, dict] = {}

    def held():
        for request_id in ids:
            rows = probe.rows_with_id(request_id)
            if rows:
                latest[request_id] = rows[0]
        return len(latest) == len(ids) and victim_holds(latest)
    on_victim = await asyncio.to_thread(wait_until, held, 120, 0.02, f"{victim} holding its share of the requests")
    fault()
    await asyncio.to_thread(wait_until, lambda: all(not probe.rows_with_id(i) or probe.rows_with_id(i)[0][
        "state"] == S.FAILED for i in on_victim), HANG_TIMEOUT_S + 20, 0.02, f"{victim}'s requests failed")
    victim_row = probe.actor(victim)   # the 8 more are all admitted (and routed) within moments of this
    more = await post_all(engine.base_url, [{"prompt": "Hello", "max_tokens": 4}] * 8)
    return set(on_victim), await task, more, victim_row


def assert_only_the_victims_failed(ids, on_victim, responses, more, victim: str, why: str) -> None:
    assert len(on_victim) == 4, on_victim   # the router spread them evenly
    for request_id, response in zip(ids, responses):
        if request_id in on_victim:
            assert response.status_code == 503, response.text
            message = response.json()["error"]["message"]
            assert victim in message and why in message, message
        else:
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["finish_reason"] == "length"
    assert [r.status_code for r in more] == [200] * 8


def decoding_on(victim_index: int):
    """``victim_holds`` for a decode actor: its rows, once all of them are DECODING (the others may be done)."""
    from ipc.lifecycle import RequestState as S

    def holds(latest):
        mine = {i for i, r in latest.items() if r["decode_actor"] == victim_index}
        if mine and all(latest[i]["state"] == S.DECODING for i in mine):
            return mine
    return holds


def test_a_killed_decode_actor_fails_only_its_requests_and_the_others_serve_on(engine, probe):
    from ipc.actor_table import ActorStatus

    ids, victim = [f"kill-{i}" for i in range(8)], "decode1"
    victim_index, pid_before = probe.actors.find(victim), probe.pid(victim)
    before = done_by_actor(engine.base_url)
    on_victim, responses, more, victim_row = asyncio.run(fail_one_actor_while_serving(
        engine, probe, ids, LONG, victim, decoding_on(victim_index), lambda: os.kill(pid_before, signal.SIGKILL)))
    assert_only_the_victims_failed(ids, on_victim, responses, more, victim, "dead")
    after = done_by_actor(engine.base_url)
    if victim_row["status"] != ActorStatus.READY:   # the 8 more were sent while decode1 was down (a warm restart
        assert after[victim] == before[victim]   # can be over by then): served by the others, none by decode1
    # the restarted actor rejoins the rotation by itself
    wait_until(lambda: probe.actor(victim)["status"] == ActorStatus.READY, 400, 0.2, "decode1 restarted")
    asyncio.run(post_all(engine.base_url, [{"prompt": "Hello", "max_tokens": 4}] * 4))
    assert done_by_actor(engine.base_url)[victim] > after[victim]
    assert_recovered(engine, probe, timeout_s=30)


def test_a_stopped_decode_actor_is_declared_hung_fails_only_its_requests_and_is_replaced(engine, probe):
    from ipc.actor_table import ActorHealth, ActorStatus

    # (stopped inside a critical section of the state table or q_api, a few us per decode step, it would block
    # the other actors too: the "live holder that is stopped" limit in ipc/_shm.py and ipc/shm_queue.py)
    ids, victim = [f"stop-{i}" for i in range(8)], "decode0"
    victim_index, pid_before = probe.actors.find(victim), probe.pid(victim)

    before = done_by_actor(engine.base_url)
    try:
        on_victim, responses, more, victim_row = asyncio.run(fail_one_actor_while_serving(
            engine, probe, ids, LONG, victim, decoding_on(victim_index), lambda: os.kill(pid_before, signal.SIGSTOP)))
        # the supervisor kills the stopped process and starts another
        wait_until(lambda: probe.pid(victim) not in (0, pid_before), 30, 0.1, f"{victim} replaced")
    finally:   # if the test failed before the supervisor acted, do not leave a stopped process behind
        try:
            if psutil.Process(pid_before).status() == psutil.STATUS_STOPPED:
                os.kill(pid_before, signal.SIGCONT)
        except psutil.NoSuchProcess:
            pass
    assert_only_the_victims_failed(ids, on_victim, responses, more, victim, "hung")
    # the 8 more were sent while decode0 was hung or loading, and served without waiting for it: it finished none
    assert not (victim_row["status"] == ActorStatus.READY and victim_row["health"] == ActorHealth.OK)
    assert done_by_actor(engine.base_url)[victim] == before[victim]


def test_a_killed_prefill_actor_fails_only_its_requests_and_the_others_serve_on(engine, probe):
    from ipc.actor_table import ActorStatus
    from ipc.lifecycle import RequestState as S

    ids, victim = [f"pkill-{i}" for i in range(8)], "prefill1"
    victim_index, pid_before = probe.actors.find(victim), probe.pid(victim)
    body = {"prompt": "The capital of France is", "max_tokens": 8, "ignore_eos": True, "temperature": 0}

    def queued_on_victim(rows):   # prefill1 is blocked on one of its 4 (PREFILLING), the others wait for it
        mine = {i: r for i, r in rows.items() if r["prefill_actor"] == victim_index}
        if any(r["state"] == S.PREFILLING for r in mine.values()) and \
                all(r["state"] in (S.QUEUED, S.PREFILLING) for r in mine.values()):
            return set(mine)
    before = done_by_actor(engine.base_url)
    on_victim, responses, more, victim_row = asyncio.run(fail_one_actor_while_serving(
        engine, probe, ids, body, victim, queued_on_victim, lambda: os.kill(pid_before, signal.SIGKILL)))
    assert_only_the_victims_failed(ids, on_victim, responses, more, victim, "dead")
    if victim_row["status"] != ActorStatus.READY:   # the 8 more were sent while prefill1 was down: served by
        assert done_by_actor(engine.base_url)[victim] == before[victim]   # prefill0 (a warm restart can be over)


def test_the_restarted_actors_rejoin_the_rotation_by_themselves(engine, probe):
    from ipc.actor_table import ActorHealth, ActorStatus

    def all_serving():
        return all(probe.actor(a)["status"] == ActorStatus.READY and probe.actor(a)["health"] == ActorHealth.OK
                   for a in ACTORS)
    wait_until(all_serving, 400, 0.2, "decode0 and prefill1 restarted")
    summary = CacheSummary.attach(segment_name(engine.engine_id, "cachesum"), readonly=True)
    try:   # the router's view of each prefill cache (ipc/cache_summary.py) is the restarted process's: its full
        # blocks (the summary holds chain keys; partial blocks, found by their tokens only, are not in it)
        for index, name in enumerate(("prefill0", "prefill1")):
            row = probe.actor(name)
            assert summary.writer_pid(index) == row["actor_pid"], name
            assert summary.num_cached(index) <= row["prefix_cached_blocks"], name
    finally:
        summary.close()
    before = done_by_actor(engine.base_url)
    responses = asyncio.run(post_all(engine.base_url, [{"prompt": "Hello", "max_tokens": 4}] * 16))
    assert [r.status_code for r in responses] == [200] * 16
    after = done_by_actor(engine.base_url)
    assert all(after[a] > before[a] for a in ACTORS), (before, after)
    metrics = scrape(engine.base_url)
    assert all(metrics[f"pdserve_actor_restarts_total{{actor={a}}}"] >= 1 for a in ("decode0", "prefill1"))
    assert_recovered(engine, probe, timeout_s=30)


def test_ready_while_one_decode_actor_restarts_and_not_ready_while_every_decode_actor_is_down(engine, probe):
    """The health split: /health/ready (and /health) stay 200 while decode1 is SIGKILLed and restarting, naming it
    in ``problems``; with both decode actors killed they are 503 saying no decode actor serves; /health/live is
    200 throughout."""
    from ipc.actor_table import ActorStatus

    def get(path: str) -> httpx.Response:
        return httpx.get(engine.base_url + path, timeout=5)

    os.kill(probe.pid("decode1"), signal.SIGKILL)
    wait_until(lambda: any("decode1" in p for p in get("/health/ready").json()["problems"]), 30, 0.02,
               "/health/ready naming decode1")
    seen, deadline = 0, time.monotonic() + 400
    while time.monotonic() < deadline:   # until decode1 has restarted and is ok again
        ready = get("/health/ready")
        assert ready.status_code == 200 and ready.json()["status"] == "ok", ready.text
        assert get("/health").status_code == 200 and get("/health/live").status_code == 200
        if not any("decode1" in p for p in ready.json()["problems"]):
            break
        seen += 1
        time.sleep(0.05)
    assert seen > 0 and probe.actor("decode1")["status"] == ActorStatus.READY

    pids = {name: probe.pid(name) for name in ("decode0", "decode1")}
    for pid in pids.values():
        os.kill(pid, signal.SIGKILL)

    def down() -> bool:
        ready = get("/health/ready")
        return ready.status_code == 503 and "no decode actor is serving" in ready.json()["problems"]
    wait_until(down, 30, 0.02, "/health/ready 503: no decode actor is serving")
    assert get("/health/live").status_code == 200
    wait_until(lambda: all(probe.pid(n) not in (0, pid) and probe.actor(n)["status"] == ActorStatus.READY
                           for n, pid in pids.items()), 400, 0.2,
               "both decode actors restarted")
    wait_until(lambda: get("/health/ready").status_code == 200, 30, 0.1, "/health/ready 200 again")
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
