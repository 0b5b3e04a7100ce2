"""Prometheus metrics and /health, computed from the shm state and actor tables at scrape time.

Gauges are never kept as counters that could drift: each scrape counts the rows of the state table
by state, so the instant the engine goes idle every queue gauge reads 0. Latency histograms and request
counters are recorded by the API process, which sees each request's first token and its end.

Queue gauges (SGLang's names with our prefix):
  pdserve_num_queue_reqs                    rows in QUEUED (waiting for the prefill actor)
  pdserve_num_running_reqs                  rows in PREFILLING or DECODING
  pdserve_num_prefill_inflight_queue_reqs   rows in BOOTSTRAP or TRANSFERRING (prefill holds their KV)
  pdserve_num_decode_transfer_queue_reqs    rows in TRANSFERRING (decode pulling their KV)
  pdserve_num_decode_waiting_reqs           rows in DECODE_WAITING
"""
from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def queue_gauges(counts: dict) -> dict[str, int]:
    """Map ``{RequestState: rows}`` onto the queue gauges (see the module docstring)."""
    from ipc.state_table import RequestState as S

    c = {s: int(counts.get(s, 0)) for s in S}
    return {
        "num_queue_reqs": c[S.QUEUED],
        "num_running_reqs": c[S.PREFILLING] + c[S.DECODING],
        "num_prefill_inflight_queue_reqs": c[S.BOOTSTRAP] + c[S.TRANSFERRING],
        "num_decode_transfer_queue_reqs": c[S.TRANSFERRING],
        "num_decode_waiting_reqs": c[S.DECODE_WAITING],
    }


class _SharedStateCollector:
    def __init__(self, owner: "EngineMetrics"):
        self.owner = owner

    def collect(self):
        table, actors = self.owner.client.table, self.owner.client.actors
        for name, value in queue_gauges(table.count_by_state()).items():
            yield GaugeMetricFamily(f"pdserve_{name}", name.replace("_", " "), value=value)
        rows = actors.rows()
        total = sum(int(r["kv_blocks_total"]) for r in rows)
        free = sum(int(r["kv_blocks_free"]) for r in rows)
        yield GaugeMetricFamily("pdserve_kv_cache_usage_ratio", "fraction of KV blocks in use, all pools",
                                value=(total - free) / total if total else 0.0)
        free_family = GaugeMetricFamily("pdserve_kv_blocks_free", "free KV blocks per actor pool", labels=["actor"])
        age = GaugeMetricFamily("pdserve_actor_heartbeat_age_seconds", "time since each actor's last loop",
                                labels=["actor"])
        now = time.monotonic_ns()
        for r in rows:
            name = r["name"].decode() if isinstance(r["name"], bytes) else str(r["name"])
            if not name:
                continue
            if int(r["kv_blocks_total"]):
                free_family.add_metric([name], int(r["kv_blocks_free"]))
            if int(r["heartbeat_ns"]):
                age.add_metric([name], (now - int(r["heartbeat_ns"])) / 1e9)
        yield free_family
        yield age
        handoffs = CounterMetricFamily("pdserve_kv_handoffs", "requests whose KV passed prefill -> decode "
                                       "(counted by the API at completion)")
        handoffs.add_metric([], self.owner.handoffs)
        yield handoffs


class EngineMetrics:
    """Per-API-process registry: histograms and counters, plus the scrape-time shared-state collector."""

    def __init__(self, client, served_model_name: str):
        self.client = client
        self.handoffs = 0
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve_requests", "finished requests by finish reason", ["finish_reason"],
                                registry=r)
        self.admitted = Counter("pdserve_requests_admitted", "requests admitted to the engine", registry=r)
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "admission to first token",
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "admission to last token",
                             buckets=LATENCY_BUCKETS_S, registry=r)
        self.tpot = Histogram("pdserve_time_per_output_token_seconds", "mean time between output tokens",
                              buckets=LATENCY_BUCKETS_S, registry=r)
        r.register(_SharedStateCollector(self))
        self.served_model_name = served_model_name

    def on_admitted(self) -> None:
        self.admitted.inc()

    def on_finished(self, handle, reason: str | None) -> None:
        self.requests.labels(reason or "unknown").inc()
        row = self.client.table.read(handle.slot, handle.generation)
        if row is not None and int(row["n_transfers"]) > 0:
            self.handoffs += 1
        if reason in ("stop", "length") and handle.first_token_ns:
            now = time.monotonic_ns()
            self.ttft.observe((handle.first_token_ns - handle.admitted_ns) / 1e9)
            self.e2e.observe((now - handle.admitted_ns) / 1e9)
            if handle.completion_tokens > 1:
                self.tpot.observe((now - handle.first_token_ns) / 1e9 / (handle.completion_tokens - 1))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def health(self) -> dict[str, Any]:
        from ipc.actor_table import ActorStatus

        actors = {}
        problems = []
        for r in self.client.actors.rows():
            name = r["name"].decode() if isinstance(r["name"], bytes) else str(r["name"])
            if not name or name == "api":
                continue
            status = ActorStatus(int(r["status"])).name.lower()
            actors[name] = status
            if status != "ready":
                problems.append(f"{name} is {status}")
        return {"status": "ok" if not problems else "unavailable", "problems": problems, "actors": actors,
                "model": self.served_model_name, "active_requests": self.client.num_active()}
