"""Incident bundles the engine writes itself (issue 26): when the monitor times a request out or flags a dead/hung
actor, a stuck gauge, a count mismatch or a leaked KV block, and when the API process sees a conservation violation
(api/conservation.py) or a failed watchdog drill (api/drill.py), a tar.gz of the evidence goes into
``incident_dir`` (off when that is empty). Each of the two processes has its own writer and limiter.

| name | what |
|---|---|
| ``IncidentLimiter`` | the decision: at most one bundle per ``incident_min_interval_s``; the ones between are counted |
| ``timeout_incident`` | the Incident of a monitor timeout (the replay recipe: tools/bundle.replay_recipe) |
| ``LogTail`` | a logging handler keeping the process's last log lines |
| ``prune`` | deletes the oldest bundles of a directory beyond a byte total |
| ``IncidentWriter`` | the I/O: a queue of one and a thread that runs ``python -m tools.bundle --incident SPEC`` |

The monitor's tick (and the API's loop) only calls ``IncidentWriter.report``: a limiter check and a non-blocking put
(a few us). The writer's thread hands the incident and the log lines to a ``tools.bundle`` process (tools sits above
actors in the package layering), which reads the engine's shm read-only and writes the tar.gz, so the snapshot, the
recorder read and the compression cost the caller's process nothing but a wait on a thread; at most once per
``incident_min_interval_s``. Bundle members: tools/bundle.py.
"""
from __future__ import annotations

import collections
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger("pdserve.incidents")

KINDS = ("timeout", "actor", "stuck_gauge", "gauge_mismatch", "router_mismatch", "conservation", "drill")
LOG_LINES = 500
WRITE_TIMEOUT_S = 120.0
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # where ``tools`` is importable from

@dataclass
class Incident:
    """What the monitor (or the API) saw: ``kind`` (one of KINDS), a one-line ``detail``, the request ids involved,
    and for a timeout (or a failed drill) its stage name (ipc/lifecycle's STAGE_NAME) and the config field of the
    deadline that fired (should have)."""
    kind: str
    detail: str
    request_ids: list[str] = field(default_factory=list)
    stage: str = ""
    deadline_field: str = ""
    base_url: str = ""      # the engine's HTTP root, for the replay command
    t_unix_s: float = field(default_factory=time.time)
    suppressed: int = 0     # incidents the limiter swallowed since the previous bundle
    holders: list[int] = field(default_factory=list)   # actor-table indices holding the requests (their stacks)


class IncidentLimiter:
    """At most one bundle per ``min_interval_s`` (the first at once); ``allow`` counts the refused ones and the
    next allowed incident carries that count."""

    def __init__(self, min_interval_s: float):
        self.min_interval_ns = int(min_interval_s * 1e9)
        self.last_ns: int | None = None
        self.suppressed = 0

    def allow(self, now_ns: int) -> int | None:
        """None: refused (counted); else how many were refused since the last allowed one."""
        if self.last_ns is not None and now_ns - self.last_ns < self.min_interval_ns:
            self.suppressed += 1
            return None
        self.last_ns, suppressed, self.suppressed = now_ns, self.suppressed, 0
        return suppressed


def timeout_incident(expired, base_url: str = "") -> Incident:
    """The Incident of a monitor timeout (actors/watchdog.Expired)."""
    from ipc.lifecycle import STAGE_NAME

    return Incident("timeout", expired.message(), [expired.request_id], STAGE_NAME.get(expired.stage, ""),
                    expired.field, base_url, holders=[expired.owner] if expired.owner >= 0 else [])


class LogTail(logging.Handler):
    """Keeps the last ``lines`` formatted log records of this process (any thread)."""

    def __init__(self, lines: int = LOG_LINES):
        super().__init__()
        self.lines: collections.deque[str] = collections.deque(maxlen=lines)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(self.format(record))
        except Exception:  # noqa: BLE001 - a log line must never raise into its caller
            pass


def prune(directory: str, max_bytes: int) -> list[str]:
    """Delete the oldest ``incident-*.tar.gz`` of ``directory`` until they total at most ``max_bytes`` (the newest
    is always kept); returns the deleted names."""
    entries = []
    for name in os.listdir(directory):
        if name.startswith("incident-") and name.endswith(".tar.gz"):
            path = os.path.join(directory, name)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime_ns, name, st.st_size))
    entries.sort()
    total, deleted = sum(e[2] for e in entries), []
    for _, name, size in entries[:-1]:
        if total <= max_bytes:
            break
        try:
            os.unlink(os.path.join(directory, name))
        except FileNotFoundError:
            pass
        total -= size
        deleted.append(name)
    return deleted


class IncidentWriter:
    """Writes the monitor's incident bundles on its own thread. ``report`` never blocks: an incident the limiter
    refuses, or one arriving while a bundle is being written, is counted in the next bundle."""

    def __init__(self, engine_id: str, directory: str, min_interval_s: float, max_bytes: int,
                 log_tail: LogTail | None = None):
        self.engine_id, self.directory, self.max_bytes = engine_id, directory, max_bytes
        self.limiter = IncidentLimiter(min_interval_s)
        self.log_tail = log_tail
        self.written: list[str] = []
        self.failed = 0
        self._queue: queue.Queue[Incident | None] = queue.Queue(maxsize=1)
        self._thread = threading.Thread(target=self._run, name="incident-bundles", daemon=True)
        os.makedirs(directory, exist_ok=True)
        self._thread.start()

    def report(self, incident: Incident, now_ns: int | None = None) -> bool:
        """Queue a bundle of ``incident`` if the limiter allows one now; True if queued. Never blocks."""
        suppressed = self.limiter.allow(time.monotonic_ns() if now_ns is None else now_ns)
        if suppressed is None:
            return False
        incident.suppressed = suppressed
        try:
            self._queue.put_nowait(incident)
            return True
        except queue.Full:
            self.limiter.suppressed += 1 + suppressed
            return False

    def close(self, timeout_s: float = 5.0) -> None:
        """Finish the bundle being written (up to ``timeout_s``) and stop the thread."""
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            return
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            incident = self._queue.get()
            if incident is None:
                return
            try:
                self.write(incident)
            except Exception:  # noqa: BLE001 - the thread outlives one failed bundle
                self.failed += 1
                log.exception("incident bundle for %s could not be written", incident.kind)

    def write(self, incident: Incident) -> str:
        """Write ``incident``'s bundle now through a ``tools.bundle`` process (the calling thread waits for it);
        returns its path. Raises RuntimeError when that process fails or takes over WRITE_TIMEOUT_S."""
        import dataclasses

        import orjson

        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(incident.t_unix_s))
        name = f"incident-{stamp}-{int(incident.t_unix_s * 1000) % 1000:03d}-{incident.kind}.tar.gz"
        path = os.path.join(self.directory, name)
        lines = list(self.log_tail.lines) if self.log_tail is not None else []
        spec = os.path.join(self.directory, f".{name}.json")
        with open(spec, "wb") as f:
            f.write(orjson.dumps({"engine_id": self.engine_id, "path": path, "log_lines": lines,
                                  "incident": dataclasses.asdict(incident)}))
        try:
            done = subprocess.run([sys.executable, "-m", "tools.bundle", "--incident", spec], cwd=REPO_ROOT,
                                  capture_output=True, timeout=WRITE_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"tools.bundle took over {WRITE_TIMEOUT_S:g} s") from exc
        finally:
            os.unlink(spec)
        if done.returncode != 0:
            raise RuntimeError(f"tools.bundle exited with {done.returncode}: {done.stderr.decode()[-2000:]}")
        self.written.append(path)
        prune(self.directory, self.max_bytes)
        log.warning("incident bundle %s written (%s: %s); read it with: python -m tools.inspect --bundle %s",
                    path, incident.kind, incident.detail, path)
        return path
