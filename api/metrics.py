"""Prometheus metrics and /health, computed from the shm state, actor and status records at scrape time.

Gauges are never kept as counters that could drift: each scrape counts the rows of the state table
by state, so the instant the engine goes idle every queue gauge reads 0. Watchdog and actor-health
metrics come from the monitor's shm status record, so they stay true even if the API is the only
process left. Latency histograms and request counters are recorded by the API process, which sees each
request's first token and its end.

Queue gauges (SGLang's names with our prefix):
  pdserve_num_queue_reqs                    rows in QUEUED (waiting for the prefill actor)
  pdserve_num_running_reqs                  rows in PREFILLING or DECODING
  pdserve_num_prefill_inflight_queue_reqs   rows in BOOTSTRAP or TRANSFERRING (prefill holds their KV)
  pdserve_num_decode_transfer_queue_reqs    rows in TRANSFERRING (decode pulling their KV)
  pdserve_num_decode_waiting_reqs           rows in DECODE_WAITING

HTTP families from the connection ledger (ipc/ledger.py; README "Connections"): pdserve_http_connections{state},
pdserve_http_connections_closed_total{reason}, pdserve_http_problems_total{reason} (the monitor's detections),
pdserve_http_connections_unrecorded_total.

Watchdog drills (api/drill.py), per drilled stage: pdserve_watchdog_drill_last_success_timestamp{stage},
pdserve_watchdog_drills_total{stage}, pdserve_watchdog_drill_failures_total{stage}; a stage whose last drill failed
is a /health problem (status stays "ok": requests are still served).

Conservation (actors/watchdog.BlockConservation in the monitor, api/conservation.py in the API):
pdserve_conservation_violations_total{kind} (kinds: ipc/engine_status.CONSERVATION_KINDS).
"""
from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from actors.ejection import drain_problems
from actors.watchdog import actor_state
from ipc.lifecycle import GAUGE_STATES, STAGE_NAME
from ipc.engine_status import CONSERVATION_KINDS, GAUGES, actor_failures, drill_problems

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def queue_gauges(counts: dict) -> dict[str, int]:
    """Map ``{RequestState: rows}`` onto the queue gauges (see the module docstring)."""
    from ipc.state_table import RequestState as S

    def total(states):
        return sum(int(counts.get(s, 0)) for s in states)

    return {
        "num_queue_reqs": total(GAUGE_STATES["queued"]),
        "num_running_reqs": total(GAUGE_STATES["running"]),
        "num_prefill_inflight_queue_reqs": total(GAUGE_STATES["prefill_inflight"]),
        "num_decode_transfer_queue_reqs": total(GAUGE_STATES["decode_transfer"]),
        "num_decode_waiting_reqs": total((S.DECODE_WAITING,)),
    }


def _gauge(name: str, doc: str, value: float | None = None, labels: list[str] | None = None):
    return GaugeMetricFamily(name, doc, value=value, labels=labels)


class _SharedStateCollector:
    def __init__(self, owner: "EngineMetrics"):
        self.owner = owner

    def _per_actor(self, client, rows):
        """The families labelled by actor: KV, heartbeat, health, restarts, router counts, own gauges."""
        free_family = _gauge("pdserve_kv_blocks_free", "free KV blocks per actor pool", labels=["actor"])
        age = _gauge("pdserve_actor_heartbeat_age_seconds", "time since each actor's last loop iteration",
                     labels=["actor"])
        health = _gauge("pdserve_actor_up", "1 = actor ok; 0 = dead, hung or starting", labels=["actor", "state"])
        restarts = CounterMetricFamily("pdserve_actor_restarts", "actor restarts by the supervisor",
                                       labels=["actor"])
        done = CounterMetricFamily("pdserve_actor_requests_done", "requests an engine actor finished its part of "
                                   "(prefill: KV handed off; decode: finished)", labels=["actor"])
        routed = _gauge("pdserve_router_active_requests", "the router's count of requests it sent to each engine "
                        "actor and still holds", labels=["actor"])
        mismatches = CounterMetricFamily("pdserve_router_engine_mismatch", "times the monitor found the router's "
                                         "count for an actor disagreeing with the state table", labels=["actor"])
        own = _gauge("pdserve_actor_own_gauge", "an actor's own count per queue gauge (cross-checked with the "
                     "table)", labels=["actor", "gauge"])
        drained = _gauge("pdserve_actor_drained", "1 = the monitor drained the engine actor (no new work) for "
                         "repeated timeouts in one stage (actors/ejection.py; /health names why); 0 = serving",
                         labels=["actor"])
        routed_counts = client.routed_counts()
        now = time.monotonic_ns()
        for r in rows:
            name = r["name"]
            if not name:
                continue
            if int(r["kv_blocks_total"]):
                free_family.add_metric([name], int(r["kv_blocks_free"]))
            if int(r["heartbeat_ns"]):
                age.add_metric([name], (now - int(r["heartbeat_ns"])) / 1e9)
            state = actor_state(r, r["health"], now, client.config.monitor_tick_s)
            health.add_metric([name, state], 1.0 if state == "ok" else 0.0)
            restarts.add_metric([name], r["restarts"])
            if r["index"] in routed_counts:
                drained.add_metric([name], 1.0 if r["drained"] else 0.0)
                done.add_metric([name], r["requests_done"])
                routed.add_metric([name], routed_counts[r["index"]])
                mismatches.add_metric([name], r["router_mismatches"])
            for gauge, value in zip(GAUGES, r["own_gauges"]):
                if value >= 0:
                    own.add_metric([name, gauge], value)
        yield from (free_family, age, health, restarts, done, routed, mismatches, own, drained)

    def collect(self):
        client = self.owner.client
        for name, value in queue_gauges(client.table.count_by_state()).items():
            yield _gauge(f"pdserve_{name}", name.replace("_", " "), value)
        rows = client.actors.rows()
        total = sum(int(r["kv_blocks_total"]) for r in rows)
        free = sum(int(r["kv_blocks_free"]) for r in rows)
        yield _gauge("pdserve_kv_cache_usage_ratio", "fraction of KV blocks in use, all pools",
                     (total - free) / total if total else 0.0)
        yield from self._per_actor(client, rows)
        yield from _prefix_cache_families(rows)
        status = client.status.snapshot()
        ticks = CounterMetricFamily("pdserve_watchdog_ticks", "heartbeat monitor ticks")
        ticks.add_metric([], status["watchdog_ticks"])
        yield ticks
        yield _gauge("pdserve_watchdog_last_tick_timestamp_seconds", "unix time of the monitor's last tick",
                     status["watchdog_last_tick_s"])
        yield _gauge("pdserve_watchdog_tick_cpu_seconds", "CPU time of the monitor's last tick",
                     status["watchdog_tick_cpu_ns"] / 1e9)
        timeouts = CounterMetricFamily("pdserve_request_timeouts", "requests timed out by the watchdog",
                                       labels=["stage"])
        failures = CounterMetricFamily("pdserve_request_actor_failures",
                                       "requests failed because their actor was dead or hung", labels=["stage"])
        failed_by_stage = actor_failures(status)
        for state, stage in STAGE_NAME.items():
            timeouts.add_metric([stage], status["timeouts"][int(state)])
            failures.add_metric([stage], failed_by_stage[int(state)])
        yield from (timeouts, failures)
        yield from _drill_families(client.config, status)
        violations = CounterMetricFamily("pdserve_conservation_violations", "conservation violations reported "
                                         "(blocks: a leaked KV block; id_twice: a request held twice in a layer; "
                                         "id_orphan: a live row no API handle holds; inflight: a connection whose "
                                         "ledger count is not the API's)", labels=["kind"])
        for i, kind in enumerate(CONSERVATION_KINDS):
            violations.add_metric([kind], status["conservation"][i])
        yield violations
        stuck = _gauge("pdserve_stuck_gauge", "1 = gauge > 0 while nothing left its stage for stuck_gauge_s",
                       labels=["gauge"])
        mismatch = _gauge("pdserve_gauge_mismatch", "1 = an actor's own count disagrees with the state table",
                          labels=["gauge"])
        for i, gauge in enumerate(GAUGES):
            stuck.add_metric([gauge], status["stuck"][i])
            mismatch.add_metric([gauge], status["mismatch"][i])
        yield from (stuck, mismatch)
        late = CounterMetricFamily("pdserve_late_messages", "messages for final or stale requests, dropped, by the "
                                   "actor that dropped them (kind: the API's stale frames by message kind; the "
                                   "engine actors count all kinds together)", labels=["actor", "kind"])
        for r in rows:
            if r["name"] and r["name"] != "api":
                late.add_metric([r["name"], "all"], r["late_messages"])
        for kind, count in sorted(client.stale_messages.items()):
            late.add_metric(["api", kind], count)
        yield late
        handoffs = CounterMetricFamily("pdserve_kv_handoffs", "requests whose KV passed prefill -> decode "
                                       "(counted by the API when the request ends)")
        handoffs.add_metric([], self.owner.handoffs)
        yield handoffs
        yield _gauge("pdserve_api_active_requests", "requests the API process is waiting on",
                     client.num_active())
        if self.owner.ledger is not None:
            yield from _ledger_families(self.owner.ledger)


def _drill_families(config, status):
    """The watchdog fire drill's (api/drill.py) results per drilled stage, from the status record; none with drills
    off."""
    from api.drill import drill_stages

    if config.drill_interval_s <= 0:
        return
    last = _gauge("pdserve_watchdog_drill_last_success_timestamp", "unix time of the last watchdog drill of the "
                  "stage that passed (its deadline fired within drill_timeout_s + one tick and freed everything; "
                  "0 = none yet)", labels=["stage"])
    runs = CounterMetricFamily("pdserve_watchdog_drills", "watchdog drills run", labels=["stage"])
    failed = CounterMetricFamily("pdserve_watchdog_drill_failures", "watchdog drills that failed", labels=["stage"])
    for state in drill_stages(config.role, config.colocated):
        stage, i = STAGE_NAME[state], int(state)
        last.add_metric([stage], status["drill_last_success_s"][i])
        runs.add_metric([stage], status["drill_runs"][i])
        failed.add_metric([stage], status["drill_failures"][i])
    yield from (last, runs, failed)


def _ledger_families(ledger):
    """From the connection ledger (ipc/ledger.py): open connections by state, closed ones by reason, the monitor's
    detections by reason (actors/connection_watch.py), connections not recorded (every row taken)."""
    from ipc.ledger import DETECTIONS, row_state

    now = time.monotonic_ns()
    states = {s: 0 for s in ("reading", "engine", "responding", "write-blocked", "idle")}
    for row in ledger.live_rows():
        state = row_state(row, now)
        states[state] = states.get(state, 0) + 1   # a row caught mid-close reads "closed"
    open_family = _gauge("pdserve_http_connections", "open HTTP connections by what they are doing (reading a "
                         "request, waiting on the engine, responding, write-blocked, idle)", labels=["state"])
    for state, n in states.items():
        open_family.add_metric([state], n)
    counters = ledger.counters()
    closed = CounterMetricFamily("pdserve_http_connections_closed", "HTTP connections closed, by how and by whom",
                                 labels=["reason"])
    for reason, n in counters["closes"].items():
        closed.add_metric([reason], n)
    detected = CounterMetricFamily("pdserve_http_problems", "problems the monitor found between the engine and "
                                   "the client, each counted once", labels=["reason"])
    for reason in DETECTIONS:
        detected.add_metric([reason], counters["detections"][reason])
    dropped = CounterMetricFamily("pdserve_http_connections_unrecorded", "connections the ledger had no row for")
    dropped.add_metric([], counters["dropped"])
    yield from (open_family, closed, detected, dropped)


def _prefix_cache_families(rows):
    """Per actor with a prefix cache (actors/prefix_cache.py): prompt tokens looked up and found cached
    (counters over every incarnation), blocks cached now and those of them requests hold."""
    query = CounterMetricFamily("pdserve_prefix_cache_query_tokens", "prompt tokens looked up in the prefix cache",
                                labels=["actor"])
    hit = CounterMetricFamily("pdserve_prefix_cache_hit_tokens", "prompt tokens whose KV the prefix cache held "
                              "(not recomputed)", labels=["actor"])
    evicted = CounterMetricFamily("pdserve_prefix_cache_evicted_blocks", "cached blocks evicted to make room",
                                  labels=["actor"])
    cached = _gauge("pdserve_prefix_cache_cached_blocks", "KV blocks in the prefix cache (held by requests or "
                    "evictable)", labels=["actor"])
    in_use = _gauge("pdserve_prefix_cache_cached_blocks_in_use", "cached KV blocks that requests hold now",
                    labels=["actor"])
    handed = CounterMetricFamily("pdserve_kv_hand_back_blocks", "KV blocks of finished requests (prompt + answer) "
                                 "a prefill actor's prefix cache took from decode (cross-turn reuse)",
                                 labels=["actor"])
    dropped = CounterMetricFamily("pdserve_kv_hand_backs_dropped", "hand-backs of finished requests' KV dropped "
                                  "(decode: prefill's queue full; prefill: prompt forgotten, no room, or the "
                                  "blocks reallocated)", labels=["actor"])
    for r in rows:
        if r["name"] and (r["prefix_query_tokens"] or r["prefix_cached_blocks"] >= 0):
            query.add_metric([r["name"]], r["prefix_query_tokens"])
            hit.add_metric([r["name"]], r["prefix_hit_tokens"])
            evicted.add_metric([r["name"]], r["prefix_evicted_blocks"])
        if r["name"] and r["prefix_cached_blocks"] >= 0:
            cached.add_metric([r["name"]], r["prefix_cached_blocks"])
            in_use.add_metric([r["name"]], r["prefix_cached_in_use"])
        if r["name"]:
            handed.add_metric([r["name"]], r["hand_back_blocks"])
            dropped.add_metric([r["name"]], r["hand_backs_dropped"])
    yield from (query, hit, evicted, cached, in_use, handed, dropped)


class RequestMetrics:
    """The request counters and latency histograms every OpenAI front end keeps (a node's API process and
    `pdserve router`): what api/exchange.py's Exchange calls, ``on_admitted``, ``on_token``, ``on_finished``, ``render``."""

    def __init__(self, admitted_doc: str):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve_requests", "ended requests by finish reason (stop, length, abort, "
                                "error; embedding: an input of /v1/embeddings) and HTTP status", ["finish_reason", "status"], registry=r)
        self.admitted = Counter("pdserve_requests_admitted", admitted_doc, registry=r)
        self.ttft = self.latency("pdserve_time_to_first_token_seconds", "admission to first token")
        self.e2e = self.latency("pdserve_e2e_request_latency_seconds", "admission to last token")
        self.tpot = self.latency("pdserve_time_per_output_token_seconds", "mean time between output tokens")
        self.itl = self.latency("pdserve_inter_token_latency_seconds", "time between two output tokens")

    def latency(self, name: str, doc: str) -> Histogram:
        return Histogram(name, doc, buckets=LATENCY_BUCKETS_S, registry=self.registry)

    def on_admitted(self) -> None:
        self.admitted.inc()

    def on_token(self, gap_s: float) -> None:
        self.itl.observe(gap_s)

    def on_finished(self, handle, reason: str | None, status: int = 200) -> bool:
        """Count the request (each of its ``n`` choices); latency histograms only for choices that completed
        (stop, length, tool_calls): returns whether it did."""
        self.requests.labels(reason or "unknown", str(status)).inc()
        if reason not in ("stop", "length", "tool_calls") or not handle.first_token_ns:
            return False
        now = time.monotonic_ns()
        self.ttft.observe((handle.first_token_ns - handle.admitted_ns) / 1e9)
        self.e2e.observe((now - handle.admitted_ns) / 1e9)
        if handle.completion_tokens > 1:
            self.tpot.observe((now - handle.first_token_ns) / 1e9 / (handle.completion_tokens - 1))
        return True

    def watch_unknown_fields(self, unknown) -> None:
        """Export ``unknown``'s counts (api.fields.UnknownFields) as ``pdserve_unknown_request_fields_total{route,
        field}``, read at scrape time."""
        self.registry.register(_UnknownFieldsCollector(unknown))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _UnknownFieldsCollector:
    def __init__(self, unknown):
        self.unknown = unknown

    def collect(self):
        family = CounterMetricFamily("pdserve_unknown_request_fields", "Responses / Messages request fields, input "
                                     "items and tool types unknown to this server, accepted and ignored",
                                     labels=["route", "field"])
        for (route, name), count in sorted(self.unknown.counts.items()):
            family.add_metric([route, name], count)
        yield family


class EngineMetrics(RequestMetrics):
    """Per-API-process registry: histograms and counters, plus the scrape-time shared-state collector."""

    def __init__(self, client, served_model_name: str, unknown_fields=None):
        super().__init__("requests admitted to the engine")
        if unknown_fields is not None:   # api.fields.UnknownFields of the parser
            self.watch_unknown_fields(unknown_fields)
        self.client = client
        self.handoffs = 0
        self.ledger = None   # the connection ledger, when the API process writes one (api/server.py)
        r = self.registry
        self.queue_time = self.latency("pdserve_queue_time_seconds", "admission to prefill start")
        self.prefill_time = self.latency("pdserve_prefill_time_seconds", "prompt forward pass")
        self.transfer_time = Histogram("pdserve_kv_transfer_seconds", "KV handoff prefill -> decode",
                                       buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
                                       registry=r)
        self.transfer_size = Histogram("pdserve_kv_transfer_size_bytes", "KV bytes moved per request",
                                       buckets=tuple(2.0 ** k for k in range(16, 32, 2)), registry=r)
        self.transfer_bytes = Counter("pdserve_kv_transfer_bytes", "KV bytes moved prefill -> decode", registry=r)
        r.register(_SharedStateCollector(self))
        self.served_model_name = served_model_name

    def on_finished(self, handle, reason: str | None, status: int = 200) -> bool:
        """``RequestMetrics.on_finished``, plus handoffs and the stage timings decode sent with the first token."""
        row = self.client.table.read(handle.slot, handle.generation)
        if row is not None and int(row["n_transfers"]) > 0:
            self.handoffs += 1
        completed = super().on_finished(handle, reason, status)
        timings = handle.timings or {}
        if completed and timings:
            self.queue_time.observe(timings["queue_s"])
            self.prefill_time.observe(timings["prefill_s"])
            self.transfer_time.observe(timings["transfer_s"])
            self.transfer_size.observe(timings["transfer_bytes"])
            self.transfer_bytes.inc(timings["transfer_bytes"])
        return completed

    def health(self) -> dict[str, Any]:
        """Readiness (``not_ready``): "ok" while a route through prefill and decode can serve; the problems name
        every actor that is not ok (an actor restarting beside others that serve is a problem, not an outage)."""
        status = self.client.status.snapshot()
        now_ns = time.monotonic_ns()
        actors, problems, states = {}, [], {}
        for r in self.client.actors.rows():
            name, index = r["name"], r["index"]
            if not name:
                continue
            if index == self.client.topology.api:   # this process, answering: up by construction
                actors[name] = "ok"
                continue
            state = actor_state(r, r["health"], now_ns, self.client.config.monitor_tick_s)
            actors[name] = states[index] = state
            if state != "ok":
                problems.append(f"actor {name} is {state}")
        reasons = not_ready(self.client.topology, states, bool(status["draining"]))
        problems += drain_problems(self.client.actors.rows(), self.client.config.eject_window_s)
        problems += drill_problems(status)   # a watchdog that failed its drill: a problem, not an outage
        # status and problems only: /health is open (no API key), so it tells nothing about the configuration;
        # the effective config is in tools/inspect (local shm access)
        return {"status": "ok" if not reasons else "unavailable", "problems": reasons + problems, "actors": actors}


def not_ready(topology, states: dict[int, str], draining: bool) -> list[str]:
    """Why the engine cannot serve a request, empty when it can: draining, or no prefill actor (when the
    topology has any: colocated decode actors prefill themselves, a decode node's prompts come prefilled) or no
    decode actor (when it has any: a prefill node's go to a decode node) whose state is "ok" (``states``: actor
    index -> actors.watchdog.actor_state)."""
    reasons = ["the engine is draining (shutting down)"] if draining else []
    for role, indices in (("prefill", topology.prefill), ("decode", topology.decode)):
        if indices and not any(states.get(i) == "ok" for i in indices):
            reasons.append(f"no {role} actor is serving")
    return reasons
