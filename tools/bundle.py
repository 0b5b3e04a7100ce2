"""tools/inspect --bundle FILE: one tar.gz of a running engine's evidence, to attach to a bug report. Everything is
read from the engine's shm read-only (it answers with the API process wedged and disturbs nothing).

Members (JSON; a part that cannot be read is left out and its error named in ``bundle.json``)::

    bundle.json        {"schema": 1, "engine_id", "taken_unix_s", "versions": {package: version}, "members": [names],
                        "errors": {member: str}}
    config.json        the effective config, {field: {"value", "source"}} (secrets hidden, as the manifest keeps it)
    state.json         tools/inspect --json's snapshot (api/debug_state.py's schema, in tools/inspect's docstring)
    timelines/recent.json   the newest ``recent`` request timelines   (ipc/timeline.py requests_report's shape)
    timelines/failed.json   every timed-out or failed one the flight recorder still holds
    connections.json   the connection ledger (tools/connections_view.py's schema)

``read_bundle(path)`` returns ``{member name: parsed JSON}``.
"""
from __future__ import annotations

import io
import os
import sys
import tarfile
import time
from typing import Any, Callable

import orjson

SCHEMA_VERSION = 1
VERSIONED = ("pdserve", "torch", "numpy", "hypercorn", "starlette", "h2", "opentelemetry-sdk")


def versions() -> dict[str, str]:
    """The installed versions of the packages a report needs (absent ones left out)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "platform": platform.platform()}
    for name in VERSIONED:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def _parts(engine_id: str, recent: int) -> dict[str, Callable[[], Any]]:
    """Member name -> a function reading it (each may raise: the bundle then names the error)."""
    from ipc.manifest import read_manifest
    from ipc.timeline import requests_report
    from tools.inspect import EngineView
    from tools.timelines import read_events

    manifest = read_manifest(engine_id)
    names = tuple(manifest.get("actors", ()))
    config = manifest.get("config", {})
    events: list = []

    def timelines(**select) -> dict[str, Any]:
        if not events:
            events.append(read_events(manifest))
        return requests_report(events[0], time.monotonic_ns(), config, names, **select)

    def state() -> dict[str, Any]:
        view = EngineView(engine_id)
        try:
            return view.snapshot()
        finally:
            view.close()

    def connections() -> dict[str, Any]:
        from ipc.ledger import ConnectionLedger
        from tools import connections_view

        name = manifest["segments"].get("conns")
        if name is None:
            raise FileNotFoundError("this engine keeps no connection ledger (connection_ledger_rows=0)")
        with ConnectionLedger.attach(name, readonly=True) as ledger:
            return connections_view.snapshot(ledger)

    return {"config.json": lambda: config, "state.json": state,
            "timelines/recent.json": lambda: timelines(recent=recent),
            "timelines/failed.json": lambda: timelines(failed=True), "connections.json": connections}


def write_bundle(engine_id: str, path: str, recent: int = 200) -> dict[str, Any]:
    """Write the bundle of engine ``engine_id`` to ``path`` (a tar.gz, written to a temporary name then renamed);
    returns its ``bundle.json``. Raises FileNotFoundError when the engine is gone (no manifest)."""
    parts = _parts(engine_id, recent)
    members: dict[str, bytes] = {}
    errors: dict[str, str] = {}
    for name, read in parts.items():
        try:
            members[name] = orjson.dumps(read(), option=orjson.OPT_INDENT_2)
        except Exception as exc:  # noqa: BLE001 - one missing part never costs the rest of the evidence
            errors[name] = f"{type(exc).__name__}: {exc}"
    index = {"schema": SCHEMA_VERSION, "engine_id": engine_id, "taken_unix_s": time.time(), "versions": versions(),
             "members": ["bundle.json", *members], "errors": errors}
    members = {"bundle.json": orjson.dumps(index, option=orjson.OPT_INDENT_2), **members}
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with tarfile.open(tmp, "w:gz") as tar:
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.size, info.mtime, info.mode = len(data), int(index["taken_unix_s"]), 0o644
                tar.addfile(info, io.BytesIO(data))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return index


def read_bundle(path: str) -> dict[str, Any]:
    """``{member name: parsed JSON}`` of a bundle written by ``write_bundle``."""
    with tarfile.open(path, "r:gz") as tar:
        return {m.name: orjson.loads(tar.extractfile(m).read()) for m in tar.getmembers() if m.isfile()}


def main_bundle(engine_id: str, path: str, recent: int) -> int:
    """--bundle FILE: write it and say what is in it. Exit 0; 2 when the engine is gone."""
    try:
        index = write_bundle(engine_id, path, recent)
    except FileNotFoundError as exc:
        print(f"engine {engine_id} not found: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}: {', '.join(index['members'])}"
          + "".join(f"\n  left out {name}: {error}" for name, error in index["errors"].items()))
    return 0
