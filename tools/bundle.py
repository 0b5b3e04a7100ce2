"""tools/inspect --bundle PATH: one tar.gz of a running engine's evidence, to attach to a bug report, or an incident
bundle the monitor wrote (``incident_dir``, actors/incidents.py) read back. Everything is read from the engine's shm
read-only (it answers with the API process wedged and disturbs nothing).

``--bundle PATH`` reads when PATH exists (a bundle; a directory: its newest ``incident-*.tar.gz``, every one listed)
and writes a new bundle there otherwise.

Members (JSON; a part that cannot be read is left out and its error named in ``bundle.json``)::

    bundle.json        {"schema": 1, "engine_id", "taken_unix_s", "versions": {package: version}, "members": [names],
                        "errors": {member: str}}
    config.json        the effective config, {field: {"value", "source"}} (secrets hidden, as the manifest keeps it)
    state.json         tools/inspect --json's snapshot (api/debug_state.py's schema, in tools/inspect's docstring)
    timelines/recent.json   the newest ``recent`` request timelines   (ipc/timeline.py requests_report's shape)
    timelines/failed.json   every timed-out or failed one the flight recorder still holds
    connections.json   the connection ledger (tools/connections_view.py's schema)

An incident bundle (written by the monitor) adds::

    incident.json      {"kind": "timeout"|"actor"|"stuck_gauge"|"gauge_mismatch"|"router_mismatch", "detail": str,
                        "request_ids": [str], "stage": str, "deadline_field": str, "t_unix_s": float,
                        "suppressed": int (incidents not bundled since the previous bundle: rate limit)}
    timelines/incident.json  the timelines of the requests involved (requests_report's shape, request_id null)
    log.json           {"lines": [str]}: the monitor process's last log lines
    holders.json       {"holders": [actors/forensics.holder_report]}: each actor holding the requests (a timeout's
                       row owner, a hung actor): its threads' stacks, where its loop is, its loop counters
    replay.json        replay_recipe (below): {"env", "faults", "multiround": argv, "commands", "note"}

``read_bundle(path)`` returns ``{member name: parsed JSON}``.
"""
from __future__ import annotations

import io
import os
import re
import shlex
import sys
import tarfile
import time
from typing import Any, Callable

import orjson

SCHEMA_VERSION = 1
VERSIONED = ("pdserve", "torch", "numpy", "hypercorn", "starlette", "h2", "opentelemetry-sdk")
REPLAY_PREFIX = "replay-"
# a stage's deadline -> the fault that holds a request in it (pdserve/faults.py); stages without one replay the
# traffic alone
STAGE_FAULTS = {"transfer": "transfer_stuck", "bootstrap": "bootstrap_silent", "prefill": "stall_prefill"}
HOLDS = {"stall_prefill"}   # faults that take seconds=: held well past the deadline
MULTIROUND_ID = re.compile(r"s(\d+)r(\d+)$")   # tools/multiround's injected ids: PREFIXs{session}r{round}


def _config_value(config: dict[str, Any], name: str) -> Any:
    value = config.get(name)
    return value.get("value") if isinstance(value, dict) else value


def replay_recipe(incident, config: dict[str, Any]) -> dict[str, Any]:
    """How to reproduce ``incident`` (actors/incidents.Incident) on a fresh engine: ``{"env": {PDSERVE_*: value}, "faults": spec,
    "multiround": argv list, "commands": [shell lines], "note": str}``. ``config``: the effective config (values or
    the manifest's ``{"value", "source"}`` entries). A timeout whose stage has a fault (STAGE_FAULTS) is held there
    by that fault, aimed at one request through its id prefix; a request id from tools/multiround
    (``...s{S}r{R}``) gives the round to aim at, so the conversation has the same length when it fires."""
    from ipc.lifecycle import STAGE_TIMEOUT_FIELD

    env: dict[str, str] = {}
    for name in ("monitor_tick_s", "request_timeout_s", *sorted(set(STAGE_TIMEOUT_FIELD.values()))):
        value = _config_value(config, name)
        if value is not None:
            env[f"PDSERVE_{name.upper()}"] = f"{value:g}" if isinstance(value, float) else str(value)
    faults = ""
    note = "no fault holds a request in this stage: the recipe replays the traffic alone"
    if incident.kind == "timeout" and incident.stage in STAGE_FAULTS:
        limit = float(_config_value(config, incident.deadline_field) or 60.0)
        fault = STAGE_FAULTS[incident.stage]
        params = [f"seconds={limit * 4 + 10:g}"] if fault in HOLDS else []
        faults = f"{fault}:" + ",".join(params + ["count=1", f"match={REPLAY_PREFIX}"])
        note = (f"the fault holds the aimed request in {incident.stage} until "
                f"{incident.deadline_field} fires: expect a 504 at that stage")
    elif incident.kind != "timeout":
        note = f"a {incident.kind} incident: the recipe replays the traffic (no fault reproduces it by itself)"
    if faults:
        env["PDSERVE_FAULTS"] = faults
    session, round_ = 0, 1
    ids = incident.request_ids
    match = MULTIROUND_ID.search(ids[0]) if ids else None
    if match:
        session, round_ = int(match.group(1)), int(match.group(2))
    base_url = incident.base_url or \
        f"http://{_config_value(config, 'host') or '127.0.0.1'}:{_config_value(config, 'port') or 8000}"
    deadline = float(_config_value(config, incident.deadline_field or "request_timeout_s") or 60.0)
    argv = ["python", "-m", "tools.multiround", "--base-url", base_url, "--sessions",
            str(session + 1), "--rounds", str(max(round_ + 1, 2)), "--round-timeout-s", f"{deadline * 3 + 30:g}"]
    if faults:
        argv += ["--inject-round", str(round_), "--inject-id-prefix", REPLAY_PREFIX]
    serve = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " pdserve serve"
    return {"env": env, "faults": faults, "multiround": argv, "note": note,
            "commands": [serve, " ".join(shlex.quote(a) for a in argv)]}




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


def _parts(engine_id: str, recent: int, incident=None, log_lines=None) -> dict[str, Callable[[], Any]]:
    """Member name -> a function reading it (each may raise: the bundle then names the error)."""
    from ipc.manifest import read_manifest
    from ipc.timeline import requests_report
    from tools.inspect import EngineView
    from tools.timelines import read_ring

    manifest = read_manifest(engine_id)
    names = tuple(manifest.get("actors", ()))
    config = manifest.get("config", {})
    events: list = []

    def timelines(request_id: str | None = None, **select) -> dict[str, Any]:
        if not events:
            events.append(read_ring(manifest))
        ring = dict(events[0])
        return requests_report(ring.pop("events"), time.monotonic_ns(), config, names, request_id, **ring, **select)

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

    parts = {"config.json": lambda: config, "state.json": state,
             "timelines/recent.json": lambda: timelines(recent=recent),
             "timelines/failed.json": lambda: timelines(failed=True), "connections.json": connections}
    if incident is not None:
        import dataclasses

        def involved() -> dict[str, Any]:
            found = [t for rid in dict.fromkeys(incident.request_ids) for t in timelines(request_id=rid)["timelines"]]
            return {"schema": 1, "request_id": None, "timelines": found}
        def holders() -> dict[str, Any]:
            from actors.forensics import holder_report
            from ipc.actor_table import ActorTable

            with ActorTable.attach(manifest["segments"]["actors"], readonly=True) as actors:
                return {"holders": [holder_report(engine_id, actors, i, names[i]) for i in incident.holders]}
        parts = {"incident.json": lambda: dataclasses.asdict(incident), "timelines/incident.json": involved,
                 **({"holders.json": holders} if incident.holders else {}),
                 "replay.json": lambda: replay_recipe(incident, config),
                 "log.json": lambda: {"lines": list(log_lines or ())}, **parts}
    return parts


def write_bundle(engine_id: str, path: str, recent: int = 200, incident=None,
                 log_lines: list[str] | None = None) -> dict[str, Any]:
    """Write the bundle of engine ``engine_id`` to ``path`` (a tar.gz, written to a temporary name then renamed);
    returns its ``bundle.json``. ``incident`` (actors/incidents.Incident) and ``log_lines``: the monitor's incident
    members. Raises FileNotFoundError when the engine is gone (no manifest)."""
    parts = _parts(engine_id, recent, incident, log_lines)
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


def newest_bundle(directory: str) -> tuple[str | None, list[str]]:
    """The newest ``incident-*.tar.gz`` of ``directory`` (None if none) and every one, oldest first."""
    names = sorted((os.stat(os.path.join(directory, n)).st_mtime_ns, n) for n in os.listdir(directory)
                   if n.startswith("incident-") and n.endswith(".tar.gz"))
    paths = [os.path.join(directory, n) for _, n in names]
    return (paths[-1] if paths else None), paths


def render_bundle(members: dict[str, Any]) -> list[str]:
    """Lines of text for a bundle read back: what it is, the incident, the involved requests' timelines, the
    replay recipe, the last log lines."""
    from ipc.timeline import render_text

    index = members.get("bundle.json", {})
    taken = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(index.get("taken_unix_s", 0)))
    lines = [f"bundle of engine {index.get('engine_id')} taken {taken}: {', '.join(index.get('members', []))}"]
    lines += [f"  left out {name}: {error}" for name, error in index.get("errors", {}).items()]
    versions_ = index.get("versions", {})
    lines.append("versions: " + ", ".join(f"{k} {v}" for k, v in versions_.items() if k != "platform"))
    incident = members.get("incident.json")
    if incident:
        lines.append(f"incident: {incident['kind']}: {incident['detail']}"
                     + (f" ({incident['suppressed']} more since the previous bundle, not bundled)"
                        if incident.get("suppressed") else ""))
        for timeline in members.get("timelines/incident.json", {}).get("timelines", []):
            lines += render_text(timeline)
        for holder in members.get("holders.json", {}).get("holders", []):
            lines.append(f"held by {holder['summary']} (stacks: holders.json)")
    replay = members.get("replay.json")
    if replay:
        lines.append(f"replay ({replay['note']}):")
        lines += [f"  {command}" for command in replay["commands"]]
    log_lines = members.get("log.json", {}).get("lines", [])
    if log_lines:
        lines.append(f"last {min(len(log_lines), 20)} of {len(log_lines)} log lines (log.json):")
        lines += [f"  {line}" for line in log_lines[-20:]]
    return lines


def main_read_bundle(path: str, as_json: bool) -> int:
    """--bundle PATH that exists: print it (``as_json``: every member as one JSON object). A directory: its newest
    incident bundle, after the list of all. Exit 0; 2 when there is none or it cannot be read."""
    if os.path.isdir(path):
        newest, every = newest_bundle(path)
        if newest is None:
            print(f"no incident bundle (incident-*.tar.gz) in {path}", file=sys.stderr)
            return 2
        if not as_json:
            print(f"{len(every)} incident bundles in {path}, newest last:")
            print("".join(f"  {p}\n" for p in every), end="")
        path = newest
    try:
        members = read_bundle(path)
    except (OSError, tarfile.TarError, orjson.JSONDecodeError) as exc:
        print(f"cannot read bundle {path}: {exc}", file=sys.stderr)
        return 2
    if as_json:
        sys.stdout.write(orjson.dumps({"path": path, "members": members}, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(f"{path}:")
        print("\n".join(render_bundle(members)))
    return 0


def main_incident(spec_path: str) -> int:
    """``python -m tools.bundle --incident SPEC``: the monitor's writer (actors/incidents.py) hands over
    ``{"engine_id", "path", "incident": Incident's fields, "log_lines"}``; write that incident's bundle."""
    from actors.incidents import Incident

    with open(spec_path, "rb") as f:
        spec = orjson.loads(f.read())
    write_bundle(spec["engine_id"], spec["path"], incident=Incident(**spec["incident"]), log_lines=spec["log_lines"])
    return 0


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


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tools.bundle", description="write the monitor's incident "
                                     "bundle (actors/incidents.py runs this); tools/inspect --bundle for people")
    parser.add_argument("--incident", metavar="SPEC", required=True, help="the incident's JSON hand-over file")
    sys.exit(main_incident(parser.parse_args().incident))
