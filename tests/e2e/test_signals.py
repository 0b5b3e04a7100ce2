"""Signals to the engine's processes (issue 17 items 1 and 2). Only the supervisor decides that the engine stops:
SIGTERM, SIGINT and SIGHUP sent to one child (prefill, decode, monitor, API) are ignored by it while traffic runs;
SIGTERM to every process at once (systemd's KillMode=control-group, ``kill -- -PGID``) drains exactly like SIGTERM
to the supervisor; children still leave when the supervisor dies, without needing SIGTERM for it.

One engine for the per-process cases (its last test kills its supervisor; before that it also serves a hundred
streams over one HTTP/2 connection); one in its own process group that gets SIGKILL, every process at once (the
resource tracker too); one more, in its own process group, for the group SIGTERM. Each of the last two starts
reclaims what the engine killed before it left in /dev/shm."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import re
import signal
import socket

import httpx
import orjson
import psutil
import pytest

from tests.conftest import (EngineProbe, cleanup_engine, descendants, probe_fixture, shm_segments, start_engine,
                            wait_until)

DRAIN_TIMEOUT_S = 10.0   # the short stream (16 tokens) finishes inside it even on a loaded 2-core machine
PROCESS_KINDS = ("prefill0", "decode0", "monitor", "api")
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
KILLED: list[str] = []   # engines a test SIGKILLed (their segments stay until the next engine starts and reclaims them)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = start_engine(tmp_path_factory.mktemp("signals"), "--kv-pool-tokens", "2048")
    yield eng
    cleanup_engine(eng)


probe = probe_fixture()


@pytest.fixture(scope="module", autouse=True)
def killed_engines_swept():
    """Whatever happens to the test that was to reclaim them, the KILLED engines' segments are gone after the
    module (the reclaim itself is asserted by ``assert_reclaimed_the_killed``)."""
    yield
    from ipc.naming import unlink_all

    for engine_id in KILLED:
        unlink_all(engine_id)


def assert_reclaimed_the_killed(eng) -> None:
    """``eng``'s start reclaimed the segments of each engine a test before it SIGKILLed, and its log names it."""
    for killed in KILLED:
        assert shm_segments(killed) == []
        assert re.search(rf"reclaimed engine {killed} \(supervisor pid \d+ is gone\): \d+ segments, \d+ "
                         rf"semaphores, [1-9]\d* bytes", eng.log_text()), eng.log_text()[-3000:]
    KILLED.clear()


def mapped_shm_objects(pids: list[int]) -> set[str]:
    """The /dev/shm entries (segments and named semaphores, ``sem.NAME``) that ``pids`` have mapped, matched by
    inode with /proc/PID/maps: a named semaphore's creator maps it under glibc's temporary name, unlinked since."""
    inodes = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                lines = maps.read().splitlines()
        except OSError:
            continue
        for line in lines:   # address perms offset dev inode path
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                inodes.add(int(fields[4]))
    names = set()
    for entry in os.scandir("/dev/shm"):
        with contextlib.suppress(OSError):
            if entry.inode() in inodes:
                names.add(entry.name)
    return names


def stream_completion(base_url: str, max_tokens: int, request_id: str, timeout_s: float = 120) -> tuple[int, bytes]:
    """A streamed completion of exactly ``max_tokens`` tokens; returns (status, whole body)."""
    with httpx.stream("POST", base_url + "/v1/completions", timeout=timeout_s, headers={"X-Request-Id": request_id},
                      json={"prompt": "Count slowly:", "max_tokens": max_tokens, "ignore_eos": True,
                            "stream": True}) as response:
        return response.status_code, response.read()


def sse_payloads(body: bytes) -> list:
    return [orjson.loads(line[6:]) for line in body.splitlines()
            if line.startswith(b"data: ") and line != b"data: [DONE]"]


def decoding(probe: EngineProbe, request_id: str) -> bool:
    return any(r["state"] == 6 for r in probe.rows_with_id(request_id))


def restarts(probe: EngineProbe) -> list[int]:
    return [int(probe.actor(kind)["restarts"]) for kind in PROCESS_KINDS]


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
@pytest.mark.parametrize("kind", PROCESS_KINDS)
def test_a_signal_to_one_engine_process_is_left_to_the_supervisor_and_traffic_goes_on(engine, probe, kind, sig):
    """A stream is decoding while the child gets the signal: the stream ends normally, the child keeps its pid (no
    restart, nothing failed), the watchdog keeps ticking, and a new request succeeds."""
    pid = probe.pid(kind)
    before = restarts(probe)
    rid = f"sig-{kind}-{signal.Signals(sig).name}"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(stream_completion, engine.base_url, 24, rid)
        wait_until(lambda: decoding(probe, rid) or running.done(), 60, 0.01, f"{rid} decoding")
        os.kill(pid, sig)
        status, body = running.result(timeout=120)
    assert status == 200, body[-500:]
    payloads = sse_payloads(body)
    assert not [p for p in payloads if "error" in p], body[-500:]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length" and body.rstrip().endswith(b"data: [DONE]")
    ticks = int(probe.status.rec["watchdog_ticks"])
    wait_until(lambda: int(probe.status.rec["watchdog_ticks"]) > ticks + 1, 10, message="the watchdog to tick")
    response = httpx.post(engine.base_url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=60)
    assert response.status_code == 200, response.text
    assert psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and probe.pid(kind) == pid
    assert restarts(probe) == before
    assert httpx.get(engine.base_url + "/health", timeout=10).status_code == 200


def test_a_hundred_concurrent_streams_on_one_http2_connection_all_complete(engine):
    """More streams than max_num_seqs (32), all on one HTTP/2 connection and its flow-control window: every one
    streams its 8 tokens and [DONE]."""
    count, max_tokens = 100, 8

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, str | None]:
        tokens, reason = 0, None
        body = {"prompt": f"Count to {i}:", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "temperature": 0}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200 and response.http_version == "HTTP/2", await response.aread()
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    return tokens, reason
                if line.startswith("data: "):
                    event = orjson.loads(line[6:])
                    assert "error" not in event, event
                    tokens += 1
                    reason = event["choices"][0]["finish_reason"] or reason
        raise AssertionError(f"stream {i} ended without [DONE]")

    async def run():
        async with httpx.AsyncClient(base_url=engine.base_url, http1=False, http2=True, timeout=300,
                                     limits=httpx.Limits(max_connections=1)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(count)))

    results = asyncio.run(run())
    assert len(results) == count and all(reason == "length" and tokens >= max_tokens for tokens, reason in results)


def test_children_leave_when_the_supervisor_is_killed_although_they_ignore_sigterm(engine, probe):
    """Parent-death detection must not rely on SIGTERM (which the children ignore): SIGKILL the supervisor (no
    drain, no cleanup of its own) and every child, the API included, exits. Runs last: it ends this engine."""
    children = [probe.pid(kind) for kind in PROCESS_KINDS]
    assert all(children) and set(children) <= set(engine.child_pids)
    probe.close()
    engine.proc.kill()
    engine.proc.wait(timeout=10)

    def gone(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
    wait_until(lambda: all(gone(pid) for pid in children), 15, 0.05, "every child to exit")
    assert shm_segments(engine.engine_id)   # nobody cleaned up: the next engine to start reclaims them
    KILLED.append(engine.engine_id)


def read_http1_response(sock: socket.socket) -> tuple[bytes, bytes]:
    """(head, body) of one HTTP/1.1 response with a Content-Length, read until the server closes."""
    data = b""
    while True:
        more = sock.recv(65536)
        if not more:
            break
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    return head, body


def test_sigkill_to_every_engine_process_at_once_leaves_only_what_the_next_start_reclaims(tmp_path):
    """SIGKILL to the whole process group (docker kill, systemd's SIGKILL when the stop timeout passes, an OOM kill
    of the cgroup): no process cleans up, the multiprocessing resource tracker included, so every /dev/shm object
    the engine had mapped stays. Each must be named with the engine id, which the next start reclaims them by (the
    group-SIGTERM test below checks that it does): an object of random name, such as a multiprocessing
    semaphore (sem.mp-*), would stay for good. Its own start reclaimed what the test before left."""
    eng = start_engine(tmp_path, "--kv-pool-tokens", "2048", new_session=True)
    left: list[str] = []
    try:
        assert_reclaimed_the_killed(eng)
        pids = [eng.proc.pid] + descendants(eng.proc.pid)
        assert any("resource_tracker" in " ".join(psutil.Process(pid).cmdline()) for pid in pids), pids
        mapped = mapped_shm_objects(pids)
        assert any(eng.engine_id in name for name in mapped), mapped   # the maps were read
        os.killpg(eng.proc.pid, signal.SIGKILL)
        eng.proc.wait(timeout=10)

        def gone(pid: int) -> bool:
            try:
                return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True
        wait_until(lambda: all(gone(pid) for pid in pids), 15, 0.05, "every process of the engine to die")
        left = sorted(name for name in mapped if os.path.exists(f"/dev/shm/{name}"))
        strays = [name for name in left if eng.engine_id not in name]
        assert not strays, f"left in /dev/shm, not named with engine id {eng.engine_id}: {strays}"
        assert shm_segments(eng.engine_id)   # nobody cleaned up: the next engine to start reclaims them
        KILLED.append(eng.engine_id)
    finally:
        if eng.engine_id not in KILLED:   # it failed: nothing is left for the next start to reclaim
            cleanup_engine(eng)
            for name in left:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"/dev/shm/{name}")


def test_sigterm_to_every_engine_process_at_once_drains_like_sigterm_to_the_supervisor(tmp_path):
    """``kill -TERM -- -PGID`` while streams run: new requests get 503 + Retry-After, a short stream finishes, a
    long one gets an error event at drain_timeout_s and [DONE], a request still sending its body when the HTTP
    server stops gets a 503 OpenAI error (never a 500 with an empty body); then exit 0, no process and no /dev/shm
    segment left. Its start reclaimed the segments of the engine the test before SIGKILLed, and its log names it."""
    eng = start_engine(tmp_path, "--kv-pool-tokens", "4096", "--drain-timeout-s", str(DRAIN_TIMEOUT_S),
                       new_session=True)
    try:
        assert_reclaimed_the_killed(eng)
        probe = EngineProbe(eng.engine_id)
        children = list(eng.child_pids)
        body = orjson.dumps({"prompt": "Hello", "max_tokens": 2})
        with concurrent.futures.ThreadPoolExecutor(2) as pool, \
                socket.create_connection(("127.0.0.1", eng.port), timeout=60) as partial:
            long = pool.submit(stream_completion, eng.base_url, 4000, "group-long")
            wait_until(lambda: decoding(probe, "group-long"), 60, 0.01, "the long stream decoding")
            short = pool.submit(stream_completion, eng.base_url, 16, "group-short")
            wait_until(lambda: decoding(probe, "group-short"), 60, 0.01, "the short stream decoding")
            probe.close()
            partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body[:5])
            os.killpg(eng.proc.pid, signal.SIGTERM)
            refused = wait_until(lambda: (lambda r: r if r.status_code == 503 else None)(
                httpx.post(eng.base_url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=10)),
                10, message="admission to stop")
            assert "shutting down" in refused.json()["error"]["message"] and refused.headers["retry-after"]
            status, short_body = short.result(timeout=60)
            assert status == 200 and short_body.rstrip().endswith(b"data: [DONE]"), short_body[-500:]
            assert sse_payloads(short_body)[-1]["choices"][0]["finish_reason"] == "length", short_body[-500:]
            status, long_body = long.result(timeout=60)
            assert status == 200 and long_body.rstrip().endswith(b"data: [DONE]"), long_body[-500:]
            errors = [p["error"] for p in sse_payloads(long_body) if "error" in p]
            assert len(errors) == 1 and "shutting down" in errors[0]["message"], long_body[-500:]
            head, rest = read_http1_response(partial)
            assert head.startswith(b"HTTP/1.1 503"), (head, rest)
            assert b"retry-after" in head.lower() and orjson.loads(rest)["error"]["type"], (head, rest)
        assert eng.proc.wait(timeout=60) == 0, eng.log_text()[-3000:]
        log = eng.log_text()
        assert " is dead" not in log and "killing it" not in log, log[-3000:]   # stopped, not dead or killed
        assert "Traceback" not in log, log[-3000:]   # a drain is not an error

        def exited(pid: int) -> bool:
            try:
                return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True
        wait_until(lambda: all(exited(pid) for pid in children), 10, message="children to exit")
        assert shm_segments(eng.engine_id) == []
        # the resource tracker (one of ``children``) has exited, so its leak report, if any, is in the log
        assert "leaked" not in eng.log_text(), eng.log_text()[-3000:]
    finally:
        cleanup_engine(eng)
