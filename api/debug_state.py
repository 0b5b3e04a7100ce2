"""The engine's live-state snapshot, built from its attached shm tables: one function behind both
``python -m tools.inspect --json`` (segments mapped read-only from the local host) and ``GET /debug/state`` on the
API (the segments the API process already holds). The JSON schema is in tools/inspect.py's docstring.

Plain code over raw reads: no lock is taken. Each table is copied once, one after the other, so two tables (or a
row caught mid-write) may disagree by what changed in the microseconds between copies; ages are shown in tenths
of a second.
"""
from __future__ import annotations

import time
from typing import Any

SCHEMA_VERSION = 1


def take_snapshot(manifest: dict, state, actors, status, sample_s: float = 0.2) -> dict[str, Any]:
    """One snapshot of an engine from its manifest (ipc/manifest.py) and its attached StateTable, ActorTable and
    EngineStatus (read-only or not: nothing is written). Reads the actor table twice ``sample_s`` seconds apart
    for the loop rates, sleeping in between: call it off an event loop."""
    first = {r["index"]: (r["loop_iterations"], time.monotonic()) for r in actors.rows()}
    time.sleep(sample_s)
    return build_snapshot(manifest, state.snapshot(), actors.rows(), status.snapshot(), first, time.monotonic_ns())


MAX_SAMPLE_S = 2.0   # longest loop-rate sample a caller may ask for (the snapshot holds a worker thread that long)


class DebugState:
    """``GET /debug/state`` of one API process: the snapshot over the tables its EngineClient holds attached
    (``client.table``, ``client.actors``, ``client.status``) and the engine's manifest, read once."""

    def __init__(self, client):
        self.client = client
        self.manifest: dict | None = None

    def sample_s(self, raw: str | None) -> float:
        """The ``sample_s`` query parameter (default 0.2 s). Raises InvalidRequestError (400) unless it is a number
        in [0, MAX_SAMPLE_S]."""
        from pdserve.errors import InvalidRequestError

        try:
            value = 0.2 if raw is None else float(raw)
        except ValueError:
            value = -1.0
        if not 0.0 <= value <= MAX_SAMPLE_S:
            raise InvalidRequestError(f"sample_s={raw!r}: give a number of seconds in [0, {MAX_SAMPLE_S:g}]",
                                      param="sample_s")
        return value

    async def answer(self, raw_sample_s: str | None) -> dict[str, Any]:
        """The snapshot for a ``sample_s`` query value (:meth:`sample_s`), taken in a worker thread (copies of the
        tables plus a loop-rate sample: never the event loop). Raises what :meth:`sample_s` and :meth:`snapshot`
        raise."""
        import asyncio

        return await asyncio.to_thread(self.snapshot, self.sample_s(raw_sample_s))

    def snapshot(self, sample_s: float) -> dict[str, Any]:
        """The snapshot (blocks ``sample_s`` seconds: run it in a worker thread). Raises RequestFailedError (503)
        when the engine's segments are gone or closed (the engine is stopping)."""
        from ipc.manifest import read_manifest
        from pdserve.errors import RequestFailedError

        client = self.client
        try:
            if self.manifest is None:
                self.manifest = read_manifest(client.layout.engine_id)
            return take_snapshot(self.manifest, client.table, client.actors, client.status, sample_s)
        except (FileNotFoundError, ValueError) as exc:
            raise RequestFailedError(f"the engine's state cannot be read ({exc}); is it stopping?") from None


def build_snapshot(manifest: dict, rows, actor_rows: list[dict], status: dict, first_iterations: dict,
                   now_ns: int) -> dict[str, Any]:
    """Assemble the JSON snapshot from raw reads (``rows``: a StateTable snapshot; schema: tools/inspect.py)."""
    from ipc.actor_table import sum_own_gauges
    from ipc.engine_status import GAUGE_METRIC, GAUGES, drill_problems
    from pdserve.faults import DRILL_PREFIX
    from ipc.lifecycle import (GAUGE_STATES, LIVE_STATES, RENEWABLE_STATES, STAGE_NAME, STAGE_TIMEOUT_FIELD,
                               RequestState)

    config = manifest["config"]
    names = manifest["actors"]
    window_s = float(config["eject_window_s"]["value"]) if "eject_window_s" in config else 0.0
    actors = _actor_entries(actor_rows, first_iterations, now_ns, float(config["monitor_tick_s"]["value"]), rows,
                            window_s)
    problems = [f"actor {a['name']} is {a['health']}" for a in actors if a["health"] != "ok"]
    problems += [a["drained"] for a in actors if a["drained"]]
    problems += [f"actor {a['name']}: the router counts {a['router_count']} requests on it, the state table "
                 f"{a['table_count']}" for a in actors if a["router_mismatch"]]
    state = rows["state"]
    own = sum_own_gauges(actor_rows)
    gauges = []
    for i, gauge in enumerate(GAUGES):
        value = int(sum(int((state == int(s)).sum()) for s in GAUGE_STATES[gauge]))
        since = int(status["gauge_nonzero_since_ns"][i])
        moved = int(status["gauge_moved_ns"][i])
        gauges.append({"name": gauge, "metric": GAUGE_METRIC[gauge], "value": value,
                       "nonzero_for_s": (now_ns - since) / 1e9 if value and since else 0.0,
                       "since_last_move_s": (now_ns - moved) / 1e9 if value and moved else 0.0,
                       "stuck": bool(status["stuck"][i]), "mismatch": bool(status["mismatch"][i]),
                       "actors_count": own[i]})
        if status["stuck"][i]:
            problems.append(f"gauge {gauge} is stuck at {value}")
        if status["mismatch"][i]:
            problems.append(f"gauge {gauge}: actors count {own[i]}, the state table {value}")
    requests = []
    for slot in [int(s) for s in (i for i in range(len(rows)) if int(state[i]) in LIVE_STATES)]:
        row = rows[slot]
        stage = RequestState(int(row["state"]))
        since_ns = int(row["state_since_ns"])
        request_id = row["request_id"].decode(errors="replace")
        drill = request_id.startswith(DRILL_PREFIX)   # a watchdog drill (api/drill.py): drill-<stage>-<n>
        drilled = drill and request_id.startswith(f"{DRILL_PREFIX}{STAGE_NAME[stage]}-") and "drill_timeout_s" in config
        limit_s = float(config["drill_timeout_s" if drilled else STAGE_TIMEOUT_FIELD[stage]]["value"])
        if stage in RENEWABLE_STATES:   # the stage deadline runs from the last renewal (actors/watchdog.py)
            since_ns = max(since_ns, int(row["last_progress_ns"]))
        owner = int(row["owner"])
        deadline_ns = int(row["deadline_ns"])
        requests.append({
            "request_id": request_id, "drill": drill, "slot": slot, "stage": STAGE_NAME[stage],
            "age_in_stage_s": (now_ns - int(row["state_since_ns"])) / 1e9,
            "total_age_s": (now_ns - int(row["created_ns"])) / 1e9,
            "owner": names[owner] if 0 <= owner < len(names) else None,
            "prefill_actor": _name(names, int(row["prefill_actor"])),
            "decode_actor": _name(names, int(row["decode_actor"])),
            "prefill_blocks": int(row["prefill_blocks"]), "decode_blocks": int(row["decode_blocks"]),
            "output_tokens": int(row["output_tokens"]),
            "stage_deadline_left_s": limit_s - (now_ns - since_ns) / 1e9,
            "request_deadline_left_s": (deadline_ns - now_ns) / 1e9 if deadline_ns else None,
        })
    requests.sort(key=lambda r: -r["total_age_s"])
    tick_ns = int(status["watchdog_last_tick_ns"])
    tick_age_s = (now_ns - tick_ns) / 1e9 if tick_ns else None
    tick_s = float(config["monitor_tick_s"]["value"])
    if tick_age_s is None or tick_age_s > 3 * tick_s + 1:
        problems.append(f"the watchdog has not ticked for {tick_age_s if tick_age_s is not None else 'ever'} s")
    problems += drill_problems(status)
    api_active = sum(max(int(r["active_requests"]), 0) for r in actor_rows)  # -1 = keeps no such count
    engine_active = len(requests)
    return {
        "schema": SCHEMA_VERSION, "engine_id": manifest["engine_id"], "url": manifest.get("url"),
        "role": node_role(config),
        "taken_unix_s": time.time(), "healthy": not problems, "problems": problems, "config": config,
        "actors": actors, "gauges": gauges, "requests": requests,
        "watchdog": _watchdog_entry(status, tick_age_s),
        "active_requests": {"api": api_active, "engine": engine_active, "agree": api_active == engine_active},
    }


def _watchdog_entry(status: dict, tick_age_s: float | None) -> dict[str, Any]:
    """The snapshot's "watchdog": ticks, timeouts and actor failures by stage, the drills run so far (api/drill.py)."""
    from ipc.engine_status import actor_failures
    from ipc.lifecycle import STAGE_NAME

    return {"ticks": int(status["watchdog_ticks"]), "last_tick_age_s": tick_age_s,
            "tick_cpu_ms": status["watchdog_tick_cpu_ns"] / 1e6,
            "timeouts_by_stage": {STAGE_NAME[s]: int(status["timeouts"][int(s)]) for s in STAGE_NAME},
            "actor_failures_by_stage": {STAGE_NAME[s]: int(actor_failures(status)[int(s)]) for s in STAGE_NAME},
            "drills": {STAGE_NAME[s]: {"runs": int(status["drill_runs"][int(s)]),
                                       "failures": int(status["drill_failures"][int(s)]),
                                       "last_success_unix_s": status["drill_last_success_s"][int(s)] or None,
                                       "failing": bool(status["drill_failing"][int(s)])}
                       for s in STAGE_NAME if status["drill_runs"][int(s)]}}


def node_role(config: dict) -> str:
    """The node's role, "prefill", "decode" or "both" (config field ``role``; "both" where the config has none, as
    an engine running every stage on one host has)."""
    return str(config.get("role", {}).get("value", "both"))


def _name(names: list[str], index: int) -> str | None:
    return names[index] if 0 <= index < len(names) else None


def _actor_entries(actor_rows: list[dict], first_iterations: dict, now_ns: int, monitor_tick_s: float,
                   rows, eject_window_s: float) -> list[dict]:
    """The snapshot's "actors" list: one entry per named row of the actor table (``rows``: the state table)."""
    from actors.ejection import row_drain
    from actors.monitor import table_counts_by_actor
    from actors.watchdog import actor_state
    from ipc.engine_status import GAUGES

    engine = [r["index"] for r in actor_rows if r["name"].rstrip("0123456789") in ("prefill", "decode")]
    api = [r for r in actor_rows if r["name"] == "api"]   # rows a dead predecessor API allocated: nobody counts them
    table_counts = table_counts_by_actor(rows, engine, since_ns=int(api[0]["started_ns"]) if api else 0)
    actors = []
    for r in actor_rows:
        if not r["name"]:
            continue
        hb_ns = int(r["heartbeat_ns"])
        prev_iter, prev_t = first_iterations.get(r["index"], (r["loop_iterations"], time.monotonic()))
        elapsed = max(time.monotonic() - prev_t, 1e-6)
        actors.append({
            "name": r["name"], "pid": int(r["pid"]), "device": r["device"],
            "status": getattr(r["status"], "name", str(r["status"])).lower(),
            "health": actor_state(r, r["health"], now_ns, monitor_tick_s),
            "heartbeat_age_s": (now_ns - hb_ns) / 1e9 if hb_ns else None,
            "loop_iterations_per_s": (int(r["loop_iterations"]) - int(prev_iter)) / elapsed,
            "restarts": int(r["restarts"]), "late_messages": int(r["late_messages"]),
            "kv_blocks_free": int(r["kv_blocks_free"]), "kv_blocks_total": int(r["kv_blocks_total"]),
            "role": r["name"].rstrip("0123456789"),
            "load": {g: v for g, v in zip(GAUGES, r["own_gauges"]) if v >= 0},
            "requests_done": int(r["requests_done"]),
            "router_count": int(r["routed_requests"]) if r["index"] in table_counts and r["routed_requests"] >= 0
            else None,
            "table_count": table_counts.get(r["index"]),
            "router_mismatch": bool(r["router_mismatch"]), "router_mismatches": int(r["router_mismatches"]),
            "prefix_cache": _prefix_cache_entry(r),
            "drained": row_drain(r, eject_window_s),
        })
    return actors


def _prefix_cache_entry(r: dict) -> dict | None:
    """An actor row's prefix cache (actors/prefix_cache.py), or None when it has none (or is restarting)."""
    if r["prefix_cached_blocks"] < 0:
        return None
    query, hit = int(r["prefix_query_tokens"]), int(r["prefix_hit_tokens"])
    return {"cached_blocks": int(r["prefix_cached_blocks"]), "in_use_blocks": int(r["prefix_cached_in_use"]),
            "query_tokens": query, "hit_tokens": hit, "hit_ratio": hit / query if query else None,
            "evicted_blocks": int(r["prefix_evicted_blocks"])}
