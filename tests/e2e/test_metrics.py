"""/metrics on the shared fault engine: after a burst of requests (and a burst of aborts) every queue gauge is 0
and every per-request histogram counted exactly the requests sent; the text parses with prometheus-client's
parser; every metric the Grafana dashboard uses is exported."""
from __future__ import annotations

import asyncio
import json
import re

import httpx

from tests.conftest import QUEUE_GAUGES, ROOT, scrape, wait_until

REQUEST_HISTOGRAMS = ("pdserve_time_to_first_token_seconds", "pdserve_e2e_request_latency_seconds",
                      "pdserve_queue_time_seconds", "pdserve_prefill_time_seconds", "pdserve_kv_transfer_seconds",
                      "pdserve_kv_transfer_size_bytes")


def _burst(base_url: str, n: int, abort: bool) -> list[int]:
    async def run():
        async with httpx.AsyncClient(timeout=60, http2=True, http1=False) as client:
            async def one(i):
                body = {"prompt": f"Burst {i}:", "max_tokens": 60 if abort else 3, "stream": abort}
                if not abort:
                    return (await client.post(base_url + "/v1/completions", json=body)).json()["usage"]["completion_tokens"]
                async with client.stream("POST", base_url + "/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        return 0  # first chunk: reset the stream (HTTP/2 RST_STREAM)
            return await asyncio.gather(*(one(i) for i in range(n)))
    return asyncio.run(run())


def test_after_bursts_gauges_are_zero_and_histograms_count_every_request(fault_engine):
    base = fault_engine.base_url
    before = scrape(base)
    tokens = _burst(base, 12, abort=False)
    after = scrape(base)  # right after the burst: no waiting
    for gauge in QUEUE_GAUGES:
        assert after[gauge] == 0, gauge
    for name in REQUEST_HISTOGRAMS:
        assert after[name + "_count"] - before.get(name + "_count", 0) == 12, name
    itl = after["pdserve_inter_token_latency_seconds_count"] - before.get("pdserve_inter_token_latency_seconds_count", 0)
    assert itl == sum(t - 1 for t in tokens)
    aborted_before = sum(v for k, v in after.items() if k.startswith("pdserve_requests_total{finish_reason=abort"))
    _burst(base, 8, abort=True)

    def idle():
        m = scrape(base)
        return m if all(m[g] == 0 for g in QUEUE_GAUGES) and m["pdserve_kv_cache_usage_ratio"] == 0 else None
    final = wait_until(idle, 2.0, 0.05, "gauges 0 within 2 s of the aborts")
    aborted = sum(v for k, v in final.items() if k.startswith("pdserve_requests_total{finish_reason=abort"))
    assert aborted - aborted_before == 8


def test_every_metric_the_dashboard_uses_is_exported(fault_engine):
    dashboard = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    used = {m for p in dashboard["panels"] for t in p["targets"] for m in re.findall(r"pdserve_[a-z0-9_]+", t["expr"])}
    exported = {key.split("{")[0] for key in scrape(fault_engine.base_url)}
    assert used and not (used - exported), sorted(used - exported)
