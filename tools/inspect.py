"""tools/inspect: read-only live state of a running pdserve engine, straight from its POSIX shared memory.

    python -m tools.inspect                 # the only running engine (or the list, if several)
    python -m tools.inspect --list          # running engines on this host
    python -m tools.inspect ENGINE_ID --json
    python -m tools.inspect ENGINE_ID --watch [--interval-s 1]

It never goes through HTTP and never writes: every segment is mapped read-only, so it answers while the API
process is wedged and cannot disturb the engine. Exit status: 0 healthy, 1 something stuck, hung, dead or
mismatched, 2 no engine found.

JSON snapshot schema (``--json``; version 1; times in seconds, ``null`` = unknown)::

    {"schema": 1, "engine_id": str, "url": str, "taken_unix_s": float, "healthy": bool, "problems": [str],
     "config": {field: {"value": any, "source": "default"|"env"|"flag"}},
     "actors": [{"name", "role": "prefill"|"decode"|"api"|"monitor", "pid", "device", "status",
                 "health": "ok"|"hung"|"dead"|"starting"|"restarting"|..., "heartbeat_age_s",
                 "loop_iterations_per_s", "restarts", "late_messages", "kv_blocks_free", "kv_blocks_total",
                 "load": {gauge: the actor's own count} (engine actors), "requests_done",
                 "router_count": int|null (the router's count for it), "table_count": int|null (the state
                 table's), "router_mismatch": bool (flagged by the monitor), "router_mismatches": int,
                 "prefix_cache": null (none) | {"cached_blocks", "in_use_blocks", "query_tokens", "hit_tokens",
                                 "hit_ratio": float|null, "evicted_blocks"}}],
     "gauges": [{"name", "metric", "value", "nonzero_for_s", "since_last_move_s", "stuck", "mismatch",
                 "actors_count"}],
     "requests": [{"request_id", "slot", "stage", "age_in_stage_s", "total_age_s", "owner", "prefill_actor",
                   "decode_actor", "prefill_blocks",
                   "decode_blocks", "output_tokens", "stage_deadline_left_s", "request_deadline_left_s"}],
     "watchdog": {"ticks", "last_tick_age_s", "tick_cpu_ms", "timeouts_by_stage": {stage: n},
                  "actor_failures_by_stage": {stage: n}},
     "active_requests": {"api": int, "engine": int, "agree": bool}}
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import orjson

SCHEMA_VERSION = 1
EXIT_OK, EXIT_PROBLEM, EXIT_NO_ENGINE = 0, 1, 2


class EngineView:
    """Read-only attachment to one engine's segments (state table, actor table, status record)."""

    def __init__(self, engine_id: str):
        from ipc.actor_table import ActorTable
        from ipc.engine_status import EngineStatus
        from ipc.manifest import read_manifest
        from ipc.state_table import StateTable

        self.manifest = read_manifest(engine_id)
        segments = self.manifest["segments"]
        self.engine_id = engine_id
        self.state = StateTable.attach(segments["state"], readonly=True)
        self.actors = ActorTable.attach(segments["actors"], readonly=True)
        self.status = EngineStatus.attach(segments["status"], readonly=True)

    def close(self) -> None:
        for segment in (self.state, self.actors, self.status):
            segment.close()

    def snapshot(self, sample_s: float = 0.2) -> dict[str, Any]:
        """One consistent-enough snapshot; samples the actor table twice ``sample_s`` apart for loop rates."""
        first = {r["index"]: (r["loop_iterations"], time.monotonic()) for r in self.actors.rows()}
        time.sleep(sample_s)
        return build_snapshot(self.manifest, self.state.snapshot(), self.actors.rows(), self.status.snapshot(),
                              first, time.monotonic_ns())


def build_snapshot(manifest: dict, rows, actor_rows: list[dict], status: dict, first_iterations: dict,
                   now_ns: int) -> dict[str, Any]:
    """Assemble the JSON snapshot from raw reads (plain code; see the module docstring for the schema)."""
    from ipc.actor_table import sum_own_gauges
    from ipc.engine_status import GAUGE_METRIC, GAUGES
    from ipc.lifecycle import (GAUGE_STATES, LIVE_STATES, RENEWABLE_STATES, STAGE_NAME, STAGE_TIMEOUT_FIELD,
                               RequestState)

    config = manifest["config"]
    names = manifest["actors"]
    actors = _actor_entries(actor_rows, first_iterations, now_ns, float(config["monitor_tick_s"]["value"]), rows)
    problems = [f"actor {a['name']} is {a['health']}" for a in actors if a["health"] != "ok"]
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
        limit_s = float(config[STAGE_TIMEOUT_FIELD[stage]]["value"])
        if stage in RENEWABLE_STATES:   # the stage deadline runs from the last renewal (actors/watchdog.py)
            since_ns = max(since_ns, int(row["last_progress_ns"]))
        owner = int(row["owner"])
        deadline_ns = int(row["deadline_ns"])
        requests.append({
            "request_id": row["request_id"].decode(errors="replace"), "slot": slot, "stage": STAGE_NAME[stage],
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
    api_active = sum(max(int(r["active_requests"]), 0) for r in actor_rows)  # -1 = keeps no such count
    engine_active = len(requests)
    return {
        "schema": SCHEMA_VERSION, "engine_id": manifest["engine_id"], "url": manifest.get("url"),
        "taken_unix_s": time.time(), "healthy": not problems, "problems": problems, "config": config,
        "actors": actors, "gauges": gauges, "requests": requests,
        "watchdog": {"ticks": int(status["watchdog_ticks"]), "last_tick_age_s": tick_age_s,
                     "tick_cpu_ms": status["watchdog_tick_cpu_ns"] / 1e6,
                     "timeouts_by_stage": {STAGE_NAME[s]: int(status["timeouts"][int(s)]) for s in STAGE_NAME},
                     "actor_failures_by_stage": {STAGE_NAME[s]: int(status["actor_failures"][int(s)])
                                                 for s in STAGE_NAME}},
        "active_requests": {"api": api_active, "engine": engine_active, "agree": api_active == engine_active},
    }


def _name(names: list[str], index: int) -> str | None:
    return names[index] if 0 <= index < len(names) else None


def _actor_entries(actor_rows: list[dict], first_iterations: dict, now_ns: int, monitor_tick_s: float,
                   rows) -> list[dict]:
    """The snapshot's "actors" list: one entry per named row of the actor table (``rows``: the state table)."""
    from actors.monitor import table_counts_by_actor
    from actors.watchdog import actor_state
    from ipc.engine_status import GAUGES

    engine = [r["index"] for r in actor_rows if r["name"].rstrip("0123456789") in ("prefill", "decode")]
    table_counts = table_counts_by_actor(rows, engine)
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


def render(snapshot: dict[str, Any]):
    """A rich renderable of a snapshot (the --watch screen and the default output)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    def secs(value) -> str:
        return "-" if value is None else f"{value:.1f}s"

    head = Text(f"pdserve engine {snapshot['engine_id']}  {snapshot['url']}  ", style="bold")
    head.append("HEALTHY" if snapshot["healthy"] else "PROBLEM: " + "; ".join(snapshot["problems"]),
                style="green" if snapshot["healthy"] else "bold red")
    wd = snapshot["watchdog"]
    timeouts = ", ".join(f"{k}={v}" for k, v in wd["timeouts_by_stage"].items() if v) or "none"
    watchdog = Text(f"watchdog: {wd['ticks']} ticks, last {secs(wd['last_tick_age_s'])} ago, "
                    f"{wd['tick_cpu_ms']:.2f} ms CPU/tick; timeouts: {timeouts}")
    active = snapshot["active_requests"]
    views = Text(f"active requests: api {active['api']} / engine table {active['engine']}"
                 + ("" if active["agree"] else "   <-- DISAGREE"), style="" if active["agree"] else "bold red")
    actors = Table(title="actors", title_justify="left")
    for column in ("actor", "role", "pid", "device", "status", "health", "heartbeat", "loops/s", "restarts",
                   "late msgs", "KV free", "prefix cache", "load", "done", "router/table"):
        actors.add_column(column)
    for a in snapshot["actors"]:
        kv = f"{a['kv_blocks_free']}/{a['kv_blocks_total']}" if a["kv_blocks_total"] else "-"
        load = " ".join(f"{k}={v}" for k, v in a["load"].items() if v) or "-"
        pc = a["prefix_cache"]
        cache = "-" if pc is None else (f"{pc['cached_blocks']} blk ({pc['in_use_blocks']} used) hit "
                                        + ("-" if pc["hit_ratio"] is None else f"{pc['hit_ratio']:.0%}"))
        counts = "-" if a["table_count"] is None else \
            f"{a['router_count']}/{a['table_count']}" + (" MISMATCH" if a["router_mismatch"] else "")
        style = "red" if a["health"] in ("hung", "dead") or a["router_mismatch"] else ""
        actors.add_row(a["name"], a["role"], str(a["pid"]), a["device"] or "-", a["status"], a["health"],
                       secs(a["heartbeat_age_s"]), f"{a['loop_iterations_per_s']:.0f}", str(a["restarts"]),
                       str(a["late_messages"]), kv, cache, load, str(a["requests_done"]), counts, style=style)
    gauges = Table(title="queues", title_justify="left")
    for column in ("gauge", "value", "non-zero for", "since last move", "stuck", "actors' count"):
        gauges.add_column(column)
    for g in snapshot["gauges"]:
        gauges.add_row(g["metric"], str(g["value"]), secs(g["nonzero_for_s"]), secs(g["since_last_move_s"]),
                       "STUCK" if g["stuck"] else "", str(g["actors_count"]) + (" MISMATCH" if g["mismatch"] else ""),
                       style="red" if g["stuck"] or g["mismatch"] else "")
    requests = Table(title=f"live requests ({len(snapshot['requests'])})", title_justify="left")
    for column in ("request", "stage", "in stage", "total", "owner", "prefill/decode", "KV P/D", "tokens",
                   "deadline left"):
        requests.add_column(column)
    for r in snapshot["requests"][:30]:
        left = r["stage_deadline_left_s"]
        requests.add_row(r["request_id"], r["stage"], secs(r["age_in_stage_s"]), secs(r["total_age_s"]),
                         r["owner"] or "-", f"{r['prefill_actor'] or '-'}/{r['decode_actor'] or '-'}",
                         f"{r['prefill_blocks']}/{r['decode_blocks']}", str(r["output_tokens"]),
                         secs(left), style="red" if left < 0 else "")
    settings = Table(title="config (timeouts, and every value not at its default)", title_justify="left")
    for column in ("field", "value", "source"):
        settings.add_column(column)
    for name, entry in snapshot["config"].items():
        if entry["source"] != "default" or name.endswith("_timeout_s") or name in ("monitor_tick_s", "stuck_gauge_s"):
            settings.add_row(name, str(entry["value"]), entry["source"])
    return Group(head, watchdog, views, actors, gauges, requests, settings)


def list_lines(engine_ids: list[str], now_unix_s: float | None = None) -> list[str]:
    """``--list``: one line per engine: id, supervisor pid, URL, model, uptime (from its manifest); an engine whose
    manifest cannot be read is listed by id alone."""
    from ipc.manifest import read_manifest

    now_unix_s = time.time() if now_unix_s is None else now_unix_s
    lines = [f"{'engine':10} {'pid':>8}  {'url':28} {'model':32} uptime"] if engine_ids else []
    for eid in engine_ids:
        try:
            m = read_manifest(eid)
        except (FileNotFoundError, ValueError):
            lines.append(f"{eid:10} {'?':>8}  (manifest unreadable)")
            continue
        uptime_s = now_unix_s - float(m.get("created_unix_s", now_unix_s))
        lines.append(f"{eid:10} {m.get('pid', '?'):>8}  {m.get('url', '?'):28} "
                     f"{m.get('served_model_name', '?'):32} {uptime_s:.0f}s")
    return lines


def _choose_engine(engine_id: str | None) -> str | None:
    from ipc.manifest import running_engines

    if engine_id:
        return engine_id
    engines = running_engines()
    return engines[0] if len(engines) == 1 else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve-inspect", description=__doc__.split("\n\n")[0])
    parser.add_argument("engine_id", nargs="?", help="engine id (default: the only running engine)")
    parser.add_argument("--list", action="store_true", help="list running engines and exit")
    parser.add_argument("--json", action="store_true", help="print one JSON snapshot (schema in the module doc)")
    parser.add_argument("--watch", action="store_true", help="refresh in place, like top")
    parser.add_argument("--interval-s", type=float, default=1.0, help="--watch refresh period")
    args = parser.parse_args(argv)
    from rich.console import Console

    from ipc.manifest import running_engines

    console = Console(width=None if sys.stdout.isatty() else 140)
    if args.list:
        engines = running_engines()
        for line in list_lines(engines):
            print(line)
        return EXIT_OK if engines else EXIT_NO_ENGINE
    engine_id = _choose_engine(args.engine_id)
    if engine_id is None:
        engines = running_engines()
        print("no pdserve engine found" if not engines else
              f"several engines are running ({', '.join(engines)}); name one", file=sys.stderr)
        return EXIT_NO_ENGINE
    try:
        view = EngineView(engine_id)
    except (FileNotFoundError, ValueError) as exc:
        print(f"engine {engine_id} not found: {exc}", file=sys.stderr)
        return EXIT_NO_ENGINE
    try:
        if args.json:
            snap = view.snapshot()
            sys.stdout.write(orjson.dumps(snap, option=orjson.OPT_INDENT_2).decode() + "\n")
            return EXIT_OK if snap["healthy"] else EXIT_PROBLEM
        if not args.watch:
            snap = view.snapshot()
            console.print(render(snap))
            return EXIT_OK if snap["healthy"] else EXIT_PROBLEM
        from rich.live import Live

        snap = view.snapshot()
        with Live(render(snap), console=console, screen=False, auto_refresh=False) as live:
            try:
                while True:
                    snap = view.snapshot(sample_s=min(args.interval_s, 1.0))
                    live.update(render(snap), refresh=True)
                    time.sleep(max(args.interval_s - 1.0, 0.0))
            except KeyboardInterrupt:
                pass
        return EXIT_OK if snap["healthy"] else EXIT_PROBLEM
    except FileNotFoundError as exc:  # the engine went away mid-read
        print(f"engine {engine_id} is gone: {exc}", file=sys.stderr)
        return EXIT_NO_ENGINE
    finally:
        view.close()


if __name__ == "__main__":
    sys.exit(main())
