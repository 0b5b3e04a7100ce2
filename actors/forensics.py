"""Holder forensics: what an actor's threads are doing, asked from another process while the actor is stuck.

| name | what |
|---|---|
| ``arm`` | in each engine child: ``faulthandler`` dumps every thread's stack to its stacks file on SIGUSR1 |
| ``process_state`` | a process's state letter from /proc ("T": stopped) |
| ``dump_stacks`` | from another process (the incident bundle's): SIGUSR1, then the text appended, or why there is none |
| ``loop_position`` | the innermost frame of the main thread in a dump ("where its loop is") |
| ``holder_report`` | one holder's evidence: stacks, where its loop is, its loop counters over a short window |

faulthandler's handler runs in C, without the GIL and without the interpreter's cooperation, so a loop stuck in a
C call (a kernel, a lock, a read) still answers; a stopped process (SIGSTOP) answers after SIGCONT, so the report
says "stopped" instead of waiting. The stacks file, ``ipc.naming.forensics_dir(engine_id) / <actor>.stacks``, is
opened for appending: a reader notes its size, signals, and reads what was added. ``ipc.naming.unlink_all`` removes
the folder with the engine's segments.
"""
from __future__ import annotations

import faulthandler
import os
import re
import signal
import time

STACKS_SIGNAL = signal.SIGUSR1
_armed: list = []   # the open stacks file (faulthandler keeps only its descriptor)


def stacks_path(engine_id: str, actor: str) -> str:
    from ipc.naming import forensics_dir

    return os.path.join(forensics_dir(engine_id), f"{actor}.stacks")


def arm(engine_id: str, actor: str) -> str:
    """In an engine child: on SIGUSR1 write every thread's stack to this actor's stacks file (appending). Returns
    the file's path."""
    path = stacks_path(engine_id, actor)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    f = open(path, "a", encoding="utf-8")   # noqa: SIM115 - held open for the process's life
    faulthandler.register(STACKS_SIGNAL, file=f, all_threads=True, chain=False)
    _armed[:] = [f]
    return path


def process_state(pid: int) -> str:
    """The state letter of /proc/PID/stat ("R", "S", "D", "T" stopped, "Z"...); "" when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def dump_stacks(pid: int, path: str, timeout_s: float = 2.0) -> tuple[str | None, str]:
    """``(stacks text, "")`` of process ``pid`` (armed with :func:`arm`, writing to ``path``), or ``(None, why)``:
    gone, stopped, not armed, or no answer within ``timeout_s``."""
    state = process_state(pid)
    if not state or state == "Z":
        return None, f"pid {pid} is gone"
    if state in ("T", "t"):
        return None, f"pid {pid} is stopped (SIGSTOP or a tracer): it cannot answer until it is continued"
    if not os.path.exists(path):
        return None, f"pid {pid} keeps no stacks file ({path}): it was not armed"
    before = os.path.getsize(path)
    try:
        os.kill(pid, STACKS_SIGNAL)
    except ProcessLookupError:
        return None, f"pid {pid} is gone"
    deadline, size, still_since = time.monotonic() + timeout_s, before, time.monotonic()
    while time.monotonic() < deadline:   # the dump is written in pieces: wait until it stops growing
        now = os.path.getsize(path)
        if now != size:
            size, still_since = now, time.monotonic()
        elif size > before and time.monotonic() - still_since > 0.1:
            break
        time.sleep(0.01)
    if size == before:
        return None, f"pid {pid} wrote no stacks within {timeout_s:g} s"
    with open(path, encoding="utf-8", errors="replace") as f:
        f.seek(before)
        return f.read(), ""


_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)', re.M)


def loop_position(stacks: str) -> str:
    """The innermost frame of the dump's main thread ("Current thread", which handled the signal; else the first
    thread listed) as ``file:line in function``; "" when the text has no frame."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", stacks.strip())
    main = next((b for b in blocks if b.startswith("Current thread")), blocks[0] if blocks else "")
    frame = _FRAME.search(main)
    return f"{frame['file']}:{frame['line']} in {frame['func']}" if frame else ""


def holder_report(engine_id: str, actors, index: int, name: str, window_s: float = 1.0) -> dict:
    """The evidence of actor ``index`` (``name``; ``actors``: the engine's ActorTable, read-only is enough): its pid,
    its loop iterations and heartbeat over ``window_s``, its stacks and where its main thread is, and a one-line
    ``summary``."""
    first = actors.rows()[index]
    pid = int(first["actor_pid"]) or int(first["pid"])
    stacks, why = dump_stacks(pid, stacks_path(engine_id, name)) if pid > 0 else (None, "no process")
    time.sleep(max(0.0, window_s))
    last = actors.rows()[index]
    iterations = int(last["loop_iterations"]) - int(first["loop_iterations"])
    heartbeat_age_s = (time.monotonic_ns() - int(last["heartbeat_ns"])) / 1e9
    position = loop_position(stacks) if stacks else ""
    summary = (f"{name} (pid {pid}): {iterations} loop iterations in {window_s:g} s, last heartbeat "
               f"{heartbeat_age_s:.1f} s ago; " + (f"its loop is in {position}" if position else why))
    return {"actor": name, "index": index, "pid": pid, "loop_iterations": int(last["loop_iterations"]),
            "iterations_in_window": iterations, "window_s": window_s, "heartbeat_age_s": heartbeat_age_s,
            "loop_position": position, "stacks": stacks, "why_no_stacks": why or None, "summary": summary}
