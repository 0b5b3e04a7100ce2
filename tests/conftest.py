"""Shared test helpers: a real `pdserve serve` subprocess on a free port, polled (never slept) until ready."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bench.engine_process import wait_until

ROOT = Path(__file__).resolve().parent.parent


# ---- the whole run: what skipped and why, and what it left in /dev/shm --------------------------------------
def _shm_objects() -> set[str]:
    """/dev/shm entries a test run can leave: pdserve segments and semaphores, multiprocessing's semaphores."""
    try:
        return {e for e in os.listdir("/dev/shm") if e.startswith(("pdserve_", "sem.pdserve_", "sem.mp-"))}
    except FileNotFoundError:
        return set()


def pytest_addoption(parser):
    parser.addoption("--shm-leaks", choices=("report", "fail"), default="report",
                     help="at the end of the run, list the /dev/shm segments and named semaphores (sem.mp-*, "
                          "pdserve_*) that appeared during it; 'fail' also fails the run on pdserve objects of "
                          "engines whose supervisor is gone (make test; it checks sem.mp-* after pytest exits)")


def pytest_sessionstart(session):
    session.config._shm_before = _shm_objects()


def pytest_sessionfinish(session, exitstatus):
    import gc

    gc.collect()   # multiprocessing objects this process still holds unlink their semaphores when collected
    deadline = time.monotonic() + 5   # a resource tracker of a stopped engine may still be unlinking
    while True:
        left = sorted(_shm_objects() - getattr(session.config, "_shm_before", set()))
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if left:   # an engine another run started meanwhile is not this run's leak: its supervisor is alive
        from ipc.manifest import NO_MANIFEST_GRACE_S, stale_engines
        from ipc.naming import engine_id_of

        ids = {engine_id_of(e) for e in left} - {None}
        dead = set(stale_engines(time.time() + NO_MANIFEST_GRACE_S, only=ids)) if ids else set()
        left = [e for e in left if engine_id_of(e) is None or engine_id_of(e) in dead]
    session.config._shm_left = left
    # sem.mp-* may still be registered with this process's own resource tracker, which unlinks them when pytest
    # exits: only pdserve objects fail the run here; make test checks sem.mp-* after pytest has exited
    if any(not e.startswith("sem.mp-") for e in left) and session.config.getoption("--shm-leaks") == "fail" \
            and session.exitstatus == 0:
        session.exitstatus = 1


ENGINE_LOGS: list[Path] = []   # every engine log this run wrote (start_engine), read back when the run fails
TRACEBACKS_SHOWN = 4               # engine logs whose last traceback a failed run prints
TRACEBACK_LINES = 30               # lines of each


def last_traceback(text: str) -> list[str]:
    """The last ``Traceback (most recent call last)`` block of a log, with the log line before it (which names
    the process and time) and up to its exception line; [] if the log has none."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if not starts:
        return []
    start = max(starts[-1] - 1, 0)
    end = starts[-1] + 1
    while end < len(lines) and (lines[end].startswith((" ", "\t")) or not lines[end].strip()):
        end += 1   # the frames are indented; the first unindented line is the exception
    block = lines[start:end + 1]
    return block if len(block) <= TRACEBACK_LINES else block[:3] + ["    ..."] + block[-(TRACEBACK_LINES - 4):]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The last lines: on a failed run, the last traceback of the engines that logged one (their logs are in
    the run's tmp dirs, gone with a CI machine); each group of skipped tests with its reason (a skip is never
    silent); what the run left in /dev/shm."""
    if terminalreporter.stats.get("failed") or terminalreporter.stats.get("error"):
        shown = [(path, block) for path in reversed(ENGINE_LOGS) if path.exists()
                 for block in [last_traceback(path.read_text(errors="replace"))] if block][:TRACEBACKS_SHOWN]
        if shown:
            terminalreporter.write_sep("-", "engine tracebacks (the last one of each engine log, newest first; "
                                            "tests that kill actors on purpose log some)")
            for path, block in shown:
                terminalreporter.write_line(f"{path}:")
                for line in block:
                    terminalreporter.write_line("  " + line)
    groups: dict[str, set[str]] = {}
    counts: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        groups.setdefault(reason, set()).add(report.nodeid.split("::")[0])
        counts[reason] = counts.get(reason, 0) + 1
    if groups:
        terminalreporter.write_sep("-", "skipped, by reason")
        for reason, files in sorted(groups.items(), key=lambda kv: -counts[kv[0]]):
            terminalreporter.write_line(f"{counts[reason]:4} skipped: {reason} ({', '.join(sorted(files))})")
    left = getattr(config, "_shm_left", [])
    if left:
        terminalreporter.write_sep("-", f"/dev/shm: {len(left)} objects left by this run")
        terminalreporter.write_line(" ".join(left[:40]) + (" ..." if len(left) > 40 else ""))
        if any(e.startswith("sem.mp-") for e in left):
            terminalreporter.write_line("(sem.mp-*: unless this process's resource tracker unlinks them at exit; "
                                        "make test checks after pytest exits)")
    else:
        terminalreporter.write_line("/dev/shm: nothing left by this run (segments and named semaphores)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shm_segments(engine_id: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if engine_id in n)


def descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


@dataclass
class EngineProcess:
    """A running `pdserve serve` subprocess."""

    proc: subprocess.Popen
    port: int
    log_path: Path
    engine_id: str = ""
    child_pids: list[int] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, wait up to ``timeout_s``, SIGKILL as a last resort; returns the exit code. Sweeps nothing:
        segments and child processes the engine left behind stay, for the caller to check (``cleanup_engine``
        sweeps them)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode


def start_engine(tmp_dir: Path, *args: str, env: dict | None = None, ready_timeout_s: float = 400.0,
                 new_session: bool = False, command: list[str] | None = None, port: int = 0) -> EngineProcess:
    """``pdserve serve`` on ``port`` (0: a free one), polled until /health is 200, watchdog drills off (``env`` may
    turn them on). ``new_session``: the engine leads its own session and process group (pgid = its pid), so a test
    can signal the whole group as systemd does. ``command``: what starts it instead of ``python -m pdserve.cli
    serve`` (given ``--port P`` and ``args``; it must exec the engine, as tools/llama_server_shim.py does)."""
    import httpx

    port = port or free_port()
    log_path = tmp_dir / f"engine-{port}.log"
    ENGINE_LOGS.append(log_path)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    # no watchdog drills (api/drill.py) unless a test asks: their rows would race the tests' own assertions
    full_env["PDSERVE_DRILL_INTERVAL_S"] = "0"
    full_env.update(env or {})
    log_file = open(log_path, "wb")
    command = command or [sys.executable, "-m", "pdserve.cli", "serve"]
    proc = subprocess.Popen([*command, "--port", str(port), *args],
                            cwd=ROOT, env=full_env, stdout=log_file, stderr=subprocess.STDOUT,
                            start_new_session=new_session)
    engine = EngineProcess(proc, port, log_path)

    def ready():
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited with {proc.returncode}:\n{engine.log_text()[-3000:]}")
        match = re.search(r"pdserve engine (\w+) serving", engine.log_text())
        if not match:
            return False
        engine.engine_id = match.group(1)
        return httpx.get(engine.base_url + "/health", timeout=2).status_code == 200

    try:
        wait_until(ready, ready_timeout_s, 0.2, "the engine to answer /health")
    except BaseException:
        engine.stop()
        raise
    engine.child_pids = descendants(proc.pid)
    return engine


def signal_pids(pids: list[int], signum: int) -> None:
    """Send ``signum`` to each of ``pids`` still alive."""
    import psutil

    for pid in pids:
        try:
            psutil.Process(pid).send_signal(signum)
        except psutil.NoSuchProcess:
            pass


def sweep_engine(pids: list[int], engine_id: str) -> None:
    """After an engine's stop, whatever happened: SIGKILL its processes still alive, unlink its segments. The
    multiprocessing resource tracker goes last: it unlinks the named semaphores (``sem.mp-*``) of the processes
    it served once they are gone, and exits by itself; killed first, it would leave them in /dev/shm."""
    import psutil

    def is_tracker(pid: int) -> bool:
        try:
            return "resource_tracker" in " ".join(psutil.Process(pid).cmdline())
        except psutil.Error:
            return False
    trackers = [pid for pid in pids if is_tracker(pid)]
    signal_pids([pid for pid in pids if pid not in trackers], signal.SIGKILL)
    for pid in trackers:
        try:
            psutil.Process(pid).wait(timeout=5)
        except psutil.TimeoutExpired:
            pass
        except psutil.NoSuchProcess:
            continue
    signal_pids(trackers, signal.SIGKILL)
    if engine_id:
        from ipc.naming import unlink_all

        unlink_all(engine_id)


def cleanup_engine(engine: EngineProcess) -> None:
    """Stop the engine and, whatever happened, kill leftovers and unlink its segments."""
    engine.stop()
    sweep_engine(engine.child_pids, engine.engine_id)


@pytest.fixture
def engine_factory(tmp_path):
    """Start engines with custom flags/env inside one test; every one is stopped and swept afterwards."""
    started: list[EngineProcess] = []

    def factory(*args: str, env: dict | None = None) -> EngineProcess:
        engine = start_engine(tmp_path, *args, env=env)
        started.append(engine)
        return engine

    yield factory
    for engine in started:
        cleanup_engine(engine)


class EngineProbe:
    """Read-only view of a running engine's shm tables (what tools/inspect reads), for assertions."""

    def __init__(self, engine_id: str):
        from ipc.actor_table import ActorTable
        from ipc.engine_status import EngineStatus
        from ipc.naming import segment_name
        from ipc.state_table import StateTable

        self.state = StateTable.attach(segment_name(engine_id, "state"), readonly=True)
        self.actors = ActorTable.attach(segment_name(engine_id, "actors"), readonly=True)
        self.status = EngineStatus.attach(segment_name(engine_id, "status"), readonly=True)

    def close(self) -> None:
        for segment in (self.state, self.actors, self.status):
            segment.close()

    def actor(self, name: str) -> dict:
        return next(r for r in self.actors.rows() if r["name"] == name)

    def pid(self, name: str) -> int:
        return int(self.actor(name)["pid"])

    def live_rows(self) -> list[dict]:
        return [self.state.row(slot) for slot in self.state.live_slots()]

    def rows_with_id(self, request_id: str) -> list[dict]:
        return [self.state.row(slot) for slot, _ in self.state.find(request_id)]

    def free_blocks(self) -> dict[str, tuple[int, int]]:
        return {r["name"]: (int(r["kv_blocks_free"]), int(r["kv_blocks_total"])) for r in self.actors.rows()
                if int(r["kv_blocks_total"])}


@dataclass
class RowTrace:
    """What polling the state table saw of one request's rows (the first, if it has several), by state:
    ``first[state]`` the row as first seen in that state, ``last_seen_ns[state]`` the monotonic ns of the last
    poll that still saw it there."""

    request_id: str
    first: dict[int, dict] = field(default_factory=dict)
    last_seen_ns: dict[int, int] = field(default_factory=dict)

    def since_ns(self, state: int) -> int:
        """The row's own ``state_since_ns`` stamp for ``state``; AssertionError if it was never seen there."""
        assert state in self.first, f"{self.request_id} was never seen in state {state} (seen: {sorted(self.first)})"
        return int(self.first[state]["state_since_ns"])

    def created_ns(self) -> int:
        assert self.first, f"no row of {self.request_id} was ever seen in the state table"
        return int(next(iter(self.first.values()))["created_ns"])


def send_and_trace(probe: "EngineProbe", request_id: str, send, timeout_s: float = 120.0,
                   interval_s: float = 0.01, on_poll=None):
    """Run ``send()`` (which sends request ``request_id``) in a thread and poll the state table for its rows
    until it returns, calling ``on_poll()`` (if given) at each poll. Returns ``(send's result, monotonic ns
    when it returned, RowTrace)``: deadlines are measured from the row's own stamps, so time queued on a
    loaded machine does not count."""
    import concurrent.futures

    trace = RowTrace(request_id)

    def timed():
        result = send()
        return result, time.monotonic_ns()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(timed)
        deadline = time.monotonic() + timeout_s
        while not future.done() and time.monotonic() < deadline:
            rows = probe.rows_with_id(request_id)
            now_ns = time.monotonic_ns()
            if rows:
                state = int(rows[0]["state"])
                trace.first.setdefault(state, rows[0])
                trace.last_seen_ns[state] = now_ns
            if on_poll is not None:
                on_poll()
            time.sleep(interval_s)
        result, answered_ns = future.result(timeout=timeout_s)
    return result, answered_ns, trace


def scrape(base_url: str) -> dict[str, float]:
    """/metrics as {name or name{k=v,...}: value}, parsed with prometheus-client's text parser."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(httpx.get(base_url + "/metrics", timeout=10).text):
        for sample in family.samples:
            key = sample.name
            if sample.labels:
                key += "{" + ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())) + "}"
            values[key] = sample.value
    return values


# The default model's greedy answer to it is "The capital of France is Paris." by a clear margin at every token (the
# first token by 1.4 logits); without the last sentence its first token is a near tie ("The" vs "L'", 0.02 apart) that
# the CPU's vector width decides (AVX-512 machines said "The capital...", AVX2 ones "L'Étoile...")
FRANCE_QUESTION = "What is the capital of France? Answer in one sentence."

QUEUE_GAUGES = ("pdserve_num_running_reqs", "pdserve_num_queue_reqs", "pdserve_num_prefill_inflight_queue_reqs",
                "pdserve_num_decode_transfer_queue_reqs")


def fully_healthy(base_url: str) -> bool:
    """/health is 200 and names no problem (it is 200 too while some actors are down beside others that serve)."""
    import httpx

    response = httpx.get(base_url + "/health", timeout=5)
    return response.status_code == 200 and not response.json()["problems"]


def assert_recovered(engine: EngineProcess, probe: EngineProbe, timeout_s: float = 10.0) -> None:
    """The after-every-scenario rule: queue gauges 0, every pool's blocks free (cached prefix blocks count as
    free once no request holds them), no live row, /health 200 naming no problem, and one ordinary request
    succeeds."""
    import httpx

    def settled():
        metrics = scrape(engine.base_url)
        return (all(metrics[g] == 0 for g in QUEUE_GAUGES) and not probe.live_rows()
                and all(free == total for free, total in probe.free_blocks().values())
                and all(int(r["prefix_cached_in_use"]) <= 0 for r in probe.actors.rows())
                and fully_healthy(engine.base_url))

    wait_until(settled, timeout_s, 0.1, "gauges 0, KV blocks free, no live row, /health 200 with no problem")
    response = httpx.post(engine.base_url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3},
                          timeout=60)
    assert response.status_code == 200, response.text


@pytest.fixture
def engine_id():
    """A fresh engine id; every shm segment and semaphore named with it is unlinked after the test, pass or
    fail (for tests that build ipc objects themselves, without an engine)."""
    from ipc import naming

    eid = naming.new_engine_id()
    try:
        yield eid
    finally:
        naming.unlink_all(eid)


def probe_fixture(engine_fixture: str = "engine", scope: str = "module"):
    """A pytest fixture yielding an EngineProbe attached to the engine of fixture ``engine_fixture``, closed at
    teardown. Use in a module as ``probe = probe_fixture()``."""
    import pytest

    @pytest.fixture(scope=scope)
    def probe(request):
        p = EngineProbe(request.getfixturevalue(engine_fixture).engine_id)
        yield p
        p.close()
    return probe


def ledger_fixture(engine_fixture: str = "engine", scope: str = "module"):
    """A pytest fixture yielding the connection ledger (ipc/ledger.py) of the engine of fixture
    ``engine_fixture``, attached read-only, closed at teardown. Use in a module as ``ledger = ledger_fixture()``."""
    import pytest

    @pytest.fixture(scope=scope)
    def ledger(request):
        from ipc.ledger import ConnectionLedger
        from ipc.naming import segment_name

        led = ConnectionLedger.attach(segment_name(request.getfixturevalue(engine_fixture).engine_id, "conns"),
                                      readonly=True)
        yield led
        led.close()
    return ledger


@pytest.fixture
def ring(engine_id):
    """A flight recorder of one 1,024-event sub-ring, installed as this process's (what the state table and the
    API's events write to), uninstalled and unlinked after the test."""
    from ipc import naming, recorder
    from ipc.recorder import Recorder

    ring = Recorder.create(naming.segment_name(engine_id, "rec"), num_writers=1, events_per_writer=1024)
    recorder.install(ring, 0, 0)
    try:
        yield ring
    finally:
        recorder.install(None, 0, 0)
        ring.close()
        ring.unlink()
