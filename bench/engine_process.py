"""Start a `pdserve serve` subprocess for a tool: free port, readiness by /health, SIGTERM and a segment sweep
on exit; ``wait_until``, the polling-with-deadline helper of the tools and the tests. Used by
bench/detection.py, bench/colocated.py and others (tests start engines with tests/conftest.py)."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx


@dataclass
class RunningEngine:
    base_url: str
    engine_id: str
    log_path: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(base_url: str) -> bool:
    """GET ``base_url``/health answered 200 (a refused or timed-out connection is False)."""
    try:
        return httpx.get(base_url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05, message: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value (returned) or the deadline passes.

    Raises:
        AssertionError: ``timeout_s`` seconds passed; the message names ``message`` and the last exception
            ``predicate`` raised (exceptions are retried until the deadline).
    """
    deadline = time.monotonic() + timeout_s
    last_error = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - retried until the deadline
            last_error = exc
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {message} (last error: {last_error!r})")


def terminate(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM ``proc``, wait up to ``timeout_s``, then SIGKILL and reap it (no zombie left)."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@contextlib.contextmanager
def engine(*flags: str, env: dict[str, str] | None = None, ready_timeout_s: float = 300.0, cwd: str | None = None):
    """A `pdserve serve` subprocess on a free port with ``flags`` and extra ``env`` (PDSERVE_* from the caller's
    environment are dropped); yields a RunningEngine once /health is 200; SIGTERM and sweep on exit. ``cwd``: the
    checkout whose code it runs (its packages shadow the installed ones; default: this process's directory).

    Raises:
        RuntimeError: the engine exited or was not ready within ``ready_timeout_s`` (the message names its log).
    """
    from ipc.naming import unlink_all

    port = _free_port()
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    full_env.update(env or {})
    log_path = f"/tmp/pdserve_tool_engine_{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port), *flags],
                                env=full_env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd)
    base = f"http://127.0.0.1:{port}"
    engine_id = None
    try:
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"engine exited ({proc.returncode}); see {log_path}")
            match = re.search(r"pdserve engine (\w+) serving", open(log_path, errors="replace").read())
            if match:
                engine_id = match.group(1)
                if healthy(base):
                    break
            time.sleep(0.2)
        else:
            raise RuntimeError(f"engine not ready in {ready_timeout_s} s; see {log_path}")
        yield RunningEngine(base, engine_id, log_path)
    finally:
        terminate(proc, 60)
        if engine_id:
            unlink_all(engine_id)
