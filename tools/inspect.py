"""tools/inspect: read-only live state of running pdserve engines: straight from a local engine's POSIX shared
memory, or over HTTP from any number of nodes (and routers) through their ``GET /debug/state``.

    python -m tools.inspect                 # the only running engine (or the list, if several)
    python -m tools.inspect --list          # running engines on this host
    python -m tools.inspect ENGINE_ID --json
    python -m tools.inspect ENGINE_ID --watch [--interval-s 1] [--connections]
    python -m tools.inspect ENGINE_ID --connections [--json]   # open HTTP connections, worst first
    python -m tools.inspect --url http://10.0.0.5:8000 --url http://10.0.0.6:8000 [--json] [--watch]
    python -m tools.inspect --request ID | --recent N | --failed | --slowest N | --trace-out FILE  (tools/timelines.py)
    python -m tools.inspect ENGINE_ID --bundle FILE [--recent N]   # a tar.gz for a bug report (tools/bundle.py)
    python -m tools.inspect --bundle EXISTING_FILE_OR_INCIDENT_DIR [--json]   # read a bundle back (the newest)

Local mode never goes through HTTP and never writes: every segment is mapped read-only, so it answers while the
API process is wedged and cannot disturb the engine. ``--url`` asks each URL's ``/debug/state`` (the same snapshot,
built by the same code: api/debug_state.py) with ``--timeout-s`` per call and ``--api-key`` (an admin key: the
debug views show every tenant's requests; default: the first of ``$PDSERVE_ADMIN_KEY``, else ``$PDSERVE_API_KEY``)
when the node has keys; a node that does not answer is shown as unreachable with the
error. Exit status: 0 healthy, 1 something stuck, hung, dead or mismatched (``--url``: or a URL unreachable),
2 no engine found (``--url``: no URL answered).

JSON snapshot schema (``--json``; version 1; times in seconds, ``null`` = unknown)::

    {"schema": 1, "engine_id": str, "url": str, "role": "prefill"|"decode"|"both" (config field ``role``),
     "taken_unix_s": float, "healthy": bool, "problems": [str],
     "config": {field: {"value": any, "source": "default"|"env"|"flag", "resolved": any (max_model_len, port,
                kv_cache_dtype, kv_pool_tokens: what the engine runs with), "why": str (kv_pool_tokens)}},
     "actors": [{"name", "role": "prefill"|"decode"|"api"|"monitor", "pid", "device", "status",
                 "health": "ok"|"hung"|"dead"|"starting"|"restarting"|..., "heartbeat_age_s",
                 "loop_iterations_per_s", "restarts", "late_messages", "kv_blocks_free", "kv_blocks_total",
                 "load": {gauge: the actor's own count} (engine actors), "requests_done",
                 "router_count": int|null (the router's count for it), "table_count": int|null (the state
                 table's), "router_mismatch": bool (flagged by the monitor), "router_mismatches": int,
                 "prefix_cache": null (none) | {"cached_blocks", "in_use_blocks", "query_tokens", "hit_tokens",
                                 "hit_ratio": float|null, "evicted_blocks"},
                 "drained": str|null (why the monitor drained it: no new work; actors/ejection.py)}],
     "gauges": [{"name", "metric", "value", "nonzero_for_s", "since_last_move_s", "stuck", "mismatch",
                 "actors_count"}],
     "requests": [{"request_id", "drill": bool (a watchdog drill's row, api/drill.py), "slot", "stage", "age_in_stage_s", "total_age_s", "owner", "prefill_actor",
                   "decode_actor", "prefill_blocks",
                   "decode_blocks", "output_tokens", "stage_deadline_left_s", "request_deadline_left_s"}],
     "watchdog": {"ticks", "last_tick_age_s", "tick_cpu_ms", "timeouts_by_stage": {stage: n},
                  "actor_failures_by_stage": {stage: n},
                  "drills": {stage: {"runs", "failures", "last_success_unix_s": float|null, "failing": bool}}
                            (stages drilled so far; api/drill.py)},
     "active_requests": {"api": int, "engine": int, "agree": bool}}

A router answers ``/debug/state`` with its own view and its nodes' snapshots (``age_s``, ``last_ok_age_s``:
seconds; ``in_flight``: the router's count of requests it sent that node; a node the router could not read is
``{"url", "error": str}`` in ``nodes``)::

    {"router": {"requests": [{"request_id", "prefill_node": url, "decode_node": url, "stage", "age_s"}],
                "nodes": [{"url", "role", "healthy": bool, "last_ok_age_s": float|null, "in_flight": int,
                           "drained": str|null (why the router drained it: no new requests)}]},
     "nodes": [<a node's snapshot, as above>, ...]}

``--url ... --json`` prints ``{"schema": 1, "sources": [{"url": the URL asked, "ok": bool, "error": str|null,
"state": the document it answered (either shape) or null}]}``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import orjson

from api.debug_state import SCHEMA_VERSION, take_snapshot
from tools.timelines import main_timelines, wants_timelines

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
        self.ledger = None   # the connection ledger (tools/connections_view.py), if the engine keeps one
        if "conns" in segments:
            from ipc.ledger import ConnectionLedger

            self.ledger = ConnectionLedger.attach(segments["conns"], readonly=True)

    def close(self) -> None:
        for segment in (self.state, self.actors, self.status, self.ledger):
            if segment is not None:
                segment.close()

    def snapshot(self, sample_s: float = 0.2) -> dict[str, Any]:
        """One consistent-enough snapshot; samples the actor table twice ``sample_s`` apart for loop rates."""
        return take_snapshot(self.manifest, self.state, self.actors, self.status, sample_s)


def render(snapshot: dict[str, Any]):
    """A rich renderable of a snapshot (the --watch screen and the default output)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    def secs(value) -> str:
        return "-" if value is None else f"{value:.1f}s"

    head = Text(f"pdserve engine {snapshot['engine_id']} (role {snapshot.get('role', 'both')})  {snapshot['url']}  ",
                style="bold")
    head.append("HEALTHY" if snapshot["healthy"] else "PROBLEM: " + "; ".join(snapshot["problems"]),
                style="green" if snapshot["healthy"] else "bold red")
    wd = snapshot["watchdog"]
    timeouts = ", ".join(f"{k}={v}" for k, v in wd["timeouts_by_stage"].items() if v) or "none"
    watchdog = Text(f"watchdog: {wd['ticks']} ticks, last {secs(wd['last_tick_age_s'])} ago, "
                    f"{wd['tick_cpu_ms']:.2f} ms CPU/tick; timeouts: {timeouts}")
    drills = wd.get("drills") or {}
    if drills:
        now = time.time()
        watchdog.append("; drills: " + ", ".join(
            f"{stage} " + ("FAILED" if d["failing"] else "ok") + (f" {now - d['last_success_unix_s']:.0f}s ago"
                                                                  if d["last_success_unix_s"] else " never")
            for stage, d in drills.items()))
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
        style = "red" if a["health"] in ("hung", "dead") or a["router_mismatch"] or a.get("drained") else ""
        health = a["health"] + (" DRAINED" if a.get("drained") else "")
        actors.add_row(a["name"], a["role"], str(a["pid"]), a["device"] or "-", a["status"], health,
                       secs(a["heartbeat_age_s"]), f"{a['loop_iterations_per_s']:.0f}", str(a["restarts"]),
                       str(a["late_messages"]), kv, cache, load, str(a["requests_done"]), counts, style=style)
    gauges = Table(title="queues", title_justify="left")
    for column in ("gauge", "value", "non-zero for", "since last move", "stuck", "actors' count"):
        gauges.add_column(column)
    for g in snapshot["gauges"]:
        kept = str(g["actors_count"]) if g["actors_count"] >= 0 else "-"   # -1: no actor here keeps that count
        gauges.add_row(g["metric"], str(g["value"]), secs(g["nonzero_for_s"]), secs(g["since_last_move_s"]),
                       "STUCK" if g["stuck"] else "", kept + (" MISMATCH" if g["mismatch"] else ""),
                       style="red" if g["stuck"] or g["mismatch"] else "")
    requests = Table(title=f"live requests ({len(snapshot['requests'])})", title_justify="left")
    for column in ("request", "stage", "in stage", "total", "owner", "prefill/decode", "KV P/D", "tokens",
                   "deadline left"):
        requests.add_column(column)
    for r in snapshot["requests"][:30]:
        left = r["stage_deadline_left_s"]
        requests.add_row(r["request_id"] + (" (drill)" if r.get("drill") else ""), r["stage"], secs(r["age_in_stage_s"]), secs(r["total_age_s"]),
                         r["owner"] or "-", f"{r['prefill_actor'] or '-'}/{r['decode_actor'] or '-'}",
                         f"{r['prefill_blocks']}/{r['decode_blocks']}", str(r["output_tokens"]),
                         secs(left), style="red" if left < 0 else "")
    settings = Table(title="config (timeouts, and every value not at its default)", title_justify="left")
    for column in ("field", "value", "source"):
        settings.add_column(column)
    for name, entry in snapshot["config"].items():
        resolved = entry.get("resolved", entry["value"])   # what the engine runs with (e.g. kv_cache_dtype auto)
        if entry["source"] != "default" or resolved != entry["value"] or name.endswith("_timeout_s") or name in (
                "monitor_tick_s", "stuck_gauge_s", "kv_cache_dtype", "kv_pool_tokens"):   # max_model_len 0 -> fit
            value = str(entry["value"]) + ("" if resolved == entry["value"] else f" -> {resolved}")
            settings.add_row(name, value, entry["source"])
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


STATE_PATH = "/debug/state"
MAX_STATE_BYTES = 64 * 1024 * 1024   # a larger answer is refused: no node's snapshot comes near it


def state_url(url: str) -> str:
    """``url`` (a node's or router's base URL, or its full /debug/state URL) -> the /debug/state URL."""
    url = url.rstrip("/")
    return url if url.endswith(STATE_PATH) else url + STATE_PATH


def fetch_state(url: str, timeout_s: float, api_key: str | None = None) -> dict[str, Any]:
    """One ``--url`` source: ``{"url", "ok", "error", "state"}`` (schema in the module doc). Never raises: a
    refused connection, a timeout (``timeout_s`` for the connect and for each read), an HTTP error status (its
    OpenAI error message) or an answer that is not a /debug/state document is ``ok: false`` with the error."""
    import urllib.error
    import urllib.request

    headers = {"Accept": "application/json"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(urllib.request.Request(state_url(url), headers=headers),
                                    timeout=timeout_s) as response:
            body = response.read(MAX_STATE_BYTES + 1)
        if len(body) > MAX_STATE_BYTES:
            raise ValueError(f"the answer is over {MAX_STATE_BYTES} bytes")
        state = orjson.loads(body)
        if not isinstance(state, dict) or not ("engine_id" in state or "router" in state):
            raise ValueError("the answer is not a pdserve /debug/state document")
        return {"url": url, "ok": True, "error": None, "state": state}
    except urllib.error.HTTPError as exc:
        return {"url": url, "ok": False, "error": f"HTTP {exc.code}: {_error_message(exc)}", "state": None}
    except (OSError, ValueError) as exc:   # URLError, timeouts and refused connections are OSErrors
        reason = getattr(exc, "reason", None) or exc
        return {"url": url, "ok": False, "error": f"{type(exc).__name__}: {reason}", "state": None}


def _error_message(exc) -> str:
    try:
        return str(orjson.loads(exc.read(65536))["error"]["message"])
    except (OSError, ValueError, KeyError, TypeError):
        return str(exc.reason)


def source_healthy(source: dict[str, Any]) -> bool:
    """A fetched source is healthy when it answered and every node in it (and, for a router, every node it lists)
    is healthy."""
    state = source["state"]
    if not source["ok"]:
        return False
    if "router" not in state:
        return bool(state["healthy"])
    return all(n["healthy"] for n in state["router"]["nodes"]) and \
        all(n.get("healthy", False) for n in state["nodes"])


def render_router(state: dict[str, Any]):
    """A rich renderable of a router's /debug/state document (shape in the module doc): its nodes, its requests
    in flight, then each node's section."""
    from rich.console import Group
    from rich.table import Table

    def secs(value) -> str:
        return "-" if value is None else f"{value:.1f}s"

    router = state["router"]
    nodes = Table(title=f"router nodes ({len(router['nodes'])})", title_justify="left")
    for column in ("node", "role", "health", "last ok", "in flight"):
        nodes.add_column(column)
    for n in router["nodes"]:
        health = ("ok" if n["healthy"] else "UNHEALTHY") + (f" DRAINED: {n['drained']}" if n.get("drained") else "")
        nodes.add_row(n["url"], n["role"], health, secs(n["last_ok_age_s"]), str(n["in_flight"]),
                      style="" if n["healthy"] and not n.get("drained") else "bold red")
    requests = Table(title=f"router requests in flight ({len(router['requests'])})", title_justify="left")
    for column in ("request", "stage", "age", "prefill node", "decode node"):
        requests.add_column(column)
    for r in sorted(router["requests"], key=lambda r: -r["age_s"])[:30]:
        requests.add_row(r["request_id"], r["stage"], secs(r["age_s"]), r["prefill_node"] or "-",
                         r["decode_node"] or "-")
    sections = [render_node(n.get("url") or "?", {"ok": "error" not in n, "error": n.get("error"), "state": n})
                for n in state["nodes"]]
    return Group(nodes, requests, *sections)


def render_node(title: str, source: dict[str, Any]):
    """One node's section: a rule titled ``title`` with its engine id and role, then its tables (or the error)."""
    from rich.console import Group
    from rich.rule import Rule
    from rich.text import Text

    if not source["ok"]:
        return Group(Rule(f"node {title}", align="left"), Text(f"UNREACHABLE: {source['error']}", style="bold red"))
    state = source["state"]
    return Group(Rule(f"node {title}  engine {state['engine_id']}  role {state.get('role', 'both')}",
                      align="left"), render(state))


def render_sources(sources: list[dict[str, Any]]):
    """The ``--url`` screen: one section per URL asked (a router's answer: its tables then its nodes')."""
    from rich.console import Group
    from rich.rule import Rule

    parts = []
    for source in sources:
        if source["ok"] and "router" in source["state"]:
            parts += [Rule(f"router {source['url']}", align="left", style="bold"), render_router(source["state"])]
        else:
            parts.append(render_node(source["url"], source))
    return Group(*parts)


def default_api_key() -> str | None:
    """The first admin key the engine's own config gives (PDSERVE_ADMIN_KEY / PDSERVE_ADMIN_KEY_FILE: /debug/state
    wants one once keys are configured), else its first API key (PDSERVE_API_KEY / _FILE), else None."""
    from pdserve.config import admin_keys, api_keys, load_config
    from pdserve.errors import ConfigError

    try:
        config = load_config({}).config
        keys = admin_keys(config) + api_keys(config)
    except ConfigError:
        return None
    return keys[0] if keys else None


def fetch_all(urls: list[str], timeout_s: float, api_key: str | None) -> list[dict[str, Any]]:
    """Every URL's source, asked concurrently (one slow node costs ``timeout_s``, not the sum)."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(max(len(urls), 1)) as pool:
        return list(pool.map(lambda u: fetch_state(u, timeout_s, api_key), urls))


def urls_exit_status(sources: list[dict[str, Any]]) -> int:
    if not any(s["ok"] for s in sources):
        return EXIT_NO_ENGINE
    return EXIT_OK if all(source_healthy(s) for s in sources) else EXIT_PROBLEM


def _main_urls(args, console) -> int:

    api_key = args.api_key or default_api_key()
    sources = fetch_all(args.url, args.timeout_s, api_key)
    if args.json:
        sys.stdout.write(orjson.dumps({"schema": SCHEMA_VERSION, "sources": sources},
                                      option=orjson.OPT_INDENT_2).decode() + "\n")
        return urls_exit_status(sources)
    if not args.watch:
        console.print(render_sources(sources))
        return urls_exit_status(sources)
    from rich.live import Live

    with Live(render_sources(sources), console=console, screen=False, auto_refresh=False) as live:
        try:
            while True:
                time.sleep(args.interval_s)
                sources = fetch_all(args.url, args.timeout_s, api_key)
                live.update(render_sources(sources), refresh=True)
        except KeyboardInterrupt:
            pass
    return urls_exit_status(sources)


def _main_connections(view: EngineView, args, console) -> int:
    """--connections (without --watch): the ledger once, as a table or JSON."""
    from tools import connections_view

    if view.ledger is None:
        print(f"engine {view.engine_id} keeps no connection ledger (connection_ledger_rows=0)", file=sys.stderr)
        return EXIT_NO_ENGINE
    snap = connections_view.snapshot(view.ledger)
    if args.json:
        sys.stdout.write(orjson.dumps(snap, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        console.print(connections_view.render(snap))
    return EXIT_PROBLEM if any(c["problems"] for c in snap["connections"]) else EXIT_OK


def _watch_screen(view: EngineView, snap: dict[str, Any], args):
    """The --watch screen: the engine's tables, then (--connections) the connection ledger's."""
    if not (args.connections and view.ledger is not None):
        return render(snap)
    from rich.console import Group

    from tools import connections_view

    return Group(render(snap), connections_view.render(connections_view.snapshot(view.ledger)))


def add_timeline_arguments(parser: argparse.ArgumentParser) -> None:
    """The flight recorder's views (tools/timelines.py) and the incident bundle (tools/bundle.py)."""
    parser.add_argument("--request", metavar="ID", help="the timeline of one request (client or completion id), "
                        "also after it ended and its row was reused")
    parser.add_argument("--recent", type=int, metavar="N", help="the N newest request timelines")
    parser.add_argument("--failed", action="store_true", help="timelines that timed out or failed")
    parser.add_argument("--slowest", type=int, metavar="N", help="the N longest request timelines")
    parser.add_argument("--trace-out", metavar="FILE", help="write Chrome/Perfetto trace JSON of the timelines")
    parser.add_argument("--window-s", type=float, help="--trace-out: only requests started this recently")
    parser.add_argument("--reconcile", action="store_true", help="the ids the API holds that the state table "
                        "does not, and the reverse, with their timelines (exit 1 if any)")
    parser.add_argument("--bundle", metavar="PATH", help="a new PATH: write a tar.gz of the engine's evidence for a "
                        "bug report: state snapshot, config, recent (--recent N, default 200) and failed timelines, "
                        "connection ledger; an existing bundle, or an incident_dir (its newest): print it "
                        "(tools/bundle.py)")


def _main_list() -> int:
    """--list: reclaim the engines whose supervisor is gone, then list the running ones."""
    from ipc.manifest import reclaim_stale_engines, running_engines

    for gone in reclaim_stale_engines():   # engines whose supervisor is gone are not listed: their memory is freed
        print(f"reclaimed engine {gone['engine_id']} ({gone['why']}): {gone['segments']} segments, "
              f"{gone['semaphores']} semaphores, {gone['bytes']} bytes", file=sys.stderr)
    engines = running_engines()
    for line in list_lines(engines):
        print(line)
    return EXIT_OK if engines else EXIT_NO_ENGINE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve-inspect", description=__doc__.split("\n\n")[0])
    parser.add_argument("engine_id", nargs="?", help="engine id (default: the only running engine)")
    parser.add_argument("--list", action="store_true", help="list running engines and exit")
    parser.add_argument("--json", action="store_true", help="print one JSON snapshot (schema in the module doc)")
    parser.add_argument("--watch", action="store_true", help="refresh in place, like top")
    parser.add_argument("--interval-s", type=float, default=1.0, help="--watch refresh period")
    parser.add_argument("--connections", action="store_true", help="the connection ledger: every open HTTP "
                        "connection, worst first, and the last closed ones (with --json: tools/connections_view.py's "
                        "schema; with --watch: below the engine's tables)")
    parser.add_argument("--url", action="append", metavar="URL",
                        help="a node's or router's base URL (repeatable): read its /debug/state over HTTP")
    parser.add_argument("--timeout-s", type=float, default=5.0, help="--url: limit of each HTTP call")
    parser.add_argument("--api-key", help="--url: the nodes' admin key (default: the first of $PDSERVE_ADMIN_KEY, else "
                        "$PDSERVE_API_KEY)")
    add_timeline_arguments(parser)
    args = parser.parse_args(argv)
    if args.url and (args.engine_id or args.list):
        parser.error("--url reads nodes over HTTP: it takes no engine id and no --list")
    from rich.console import Console

    from ipc.manifest import read_manifest, running_engines

    console = Console(width=None if sys.stdout.isatty() else 140)
    if args.url:
        return _main_urls(args, console)
    if args.list:
        return _main_list()
    if args.bundle and os.path.exists(args.bundle):   # an existing bundle, or incident_dir: read it back
        from tools.bundle import main_read_bundle

        return main_read_bundle(args.bundle, args.json)
    engine_id = _choose_engine(args.engine_id)
    if engine_id is None:
        engines = running_engines()
        print("no pdserve engine found" if not engines else
              f"several engines are running ({', '.join(engines)}); name one", file=sys.stderr)
        return EXIT_NO_ENGINE
    if args.bundle:
        from tools.bundle import main_bundle

        return main_bundle(engine_id, args.bundle, args.recent or 200)
    if wants_timelines(args):
        return main_timelines(args, read_manifest(engine_id))
    try:
        view = EngineView(engine_id)
    except (FileNotFoundError, ValueError) as exc:
        print(f"engine {engine_id} not found: {exc}", file=sys.stderr)
        return EXIT_NO_ENGINE
    try:
        if args.connections and not args.watch:
            return _main_connections(view, args, console)
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
        with Live(_watch_screen(view, snap, args), console=console, screen=False, auto_refresh=False) as live:
            try:
                while True:
                    snap = view.snapshot(sample_s=min(args.interval_s, 1.0))
                    live.update(_watch_screen(view, snap, args), refresh=True)
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
