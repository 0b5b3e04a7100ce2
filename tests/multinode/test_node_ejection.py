"""Stage-aware ejection across nodes (issue 42 item 5): a prefill node in one network namespace, two decode nodes in
the other (KV over Mooncake TCP on the data veth), `pdserve router` in the root namespace. One decode node's (d1,
the router's first) transport is stuck for the first three ``ej-`` requests it takes and for the router's first probe
(``transfer_stuck``): those time out in transfer there, the router drains the node with its reason, the failed probe
keeps it drained, traffic meanwhile goes to the first decode node without an error, and the next probe, which
answers, readmits it. Cleartext with ``--insecure-nodes`` (TLS between router and nodes: test_two_nodes.py)."""
from __future__ import annotations

import asyncio
import re
import subprocess
import sys

import httpx
import psutil
import pytest

from bench.netns import start_in_namespace, stop_process, wait_http_ok
from tests.conftest import ROOT, free_port, scrape, sweep_engine, wait_until

pytestmark = pytest.mark.timeout(900)   # three engines start (minutes when the machine is busy)
TICK_S = 0.5
INFLIGHT_TIMEOUT_S = 2.0
PROBE_INTERVAL_S = 8.0   # after the failed first probe: the test checks the drained node meanwhile
FLAGS = ["--kv-pool-tokens", "2048", "--monitor-tick-s", str(TICK_S), "--kv-transport", "mooncake",
         "--inflight-timeout-s", str(INFLIGHT_TIMEOUT_S), "--insecure-nodes"]
BODY = {"prompt": "The three primary colors are", "max_tokens": 4, "temperature": 0}


class Node:
    """`pdserve serve --role ROLE` on ``port`` in namespace ``ns``."""

    def __init__(self, ns: str, addr: str, data_addr: str, port: int, role: str, log_dir, faults: str = ""):
        self.role, self.url, self.log_path = role, f"http://{addr}:{port}", log_dir / f"{role}-{port}.log"
        argv = [sys.executable, "-m", "pdserve.cli", "serve", "--role", role, "--host", addr, "--port", str(port),
                "--kv-transfer-host", data_addr, *FLAGS] + (["--faults", faults] if faults else [])
        self.proc = start_in_namespace(ns, argv, self.log_path, env={"MC_TRANSFER_TIMEOUT": "5"})
        self.engine_id, self.pids = "", []

    def wait_ready(self) -> None:
        wait_http_ok(self.url + "/health", 400, self.proc)
        wait_until(lambda: re.search(r"pdserve engine (\w+) serving", self.log_path.read_text()), 30, 0.1,
                   "the engine's serving line")   # /health may answer before the supervisor logs it
        self.engine_id = re.search(r"pdserve engine (\w+) serving", self.log_path.read_text()).group(1)
        self.pids = [self.proc.pid] + [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]

    def done(self) -> float:
        """Requests this decode node's actor finished (its own /metrics)."""
        return scrape(self.url)["pdserve_actor_requests_done_total{actor=decode0}"]

    def stop(self) -> None:
        stop_process(self.proc)
        sweep_engine(self.pids, self.engine_id)


@pytest.fixture(scope="module")
def cluster(two_host_net, tmp_path_factory):
    """(router URL, router log path, decode node 0, decode node 1)."""
    net, log_dir = two_host_net, tmp_path_factory.mktemp("node-ejection")
    nodes = [Node(net.prefill_ns, net.prefill_addr, net.prefill_data_addr, 8000, "prefill", log_dir),
             Node(net.decode_ns, net.decode_addr, net.decode_data_addr, 8000, "decode", log_dir),
             Node(net.decode_ns, net.decode_addr, net.decode_data_addr, 8001, "decode", log_dir,
                  faults="transfer_stuck:count=3,match=ej-;transfer_stuck:count=1,match=eject-probe-")]
    router = None
    try:
        for node in nodes:
            node.wait_ready()
        port = free_port()
        router_log = log_dir / "router.log"
        router = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "router", "--port", str(port),
                                   "--prefill-node", nodes[0].url, "--decode-node", nodes[2].url,
                                   "--decode-node", nodes[1].url, "--monitor-tick-s", str(TICK_S),
                                   "--insecure-nodes", "--eject-probe-interval-s", str(PROBE_INTERVAL_S)],
                                  cwd=ROOT, stdout=open(router_log, "wb"), stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        wait_http_ok(base + "/health", 120, router)
        yield base, router_log, nodes[1], nodes[2]
    finally:
        if router is not None:
            stop_process(router)
        for node in nodes:
            node.stop()


async def wave(base: str, prefix: str, n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
        return await asyncio.gather(*(client.post(base + "/v1/completions", json=BODY,
                                                  headers={"X-Request-Id": f"{prefix}{i}"}) for i in range(n)))


def test_a_decode_node_whose_transfers_keep_timing_out_is_drained_then_readmitted_by_a_probe(cluster):
    base, router_log, d0, d1 = cluster
    reason = f"decode node {d1.url} drained: 3 transfer timeouts in 60 s"
    # the router picks the decode node with the fewest of its streams open, then list order (d1 first): a burst goes
    # to d1 before any stream opens, so its first three time out there and the fourth (the fault used up) answers
    answers = [(r.status_code, r.text) for r in asyncio.run(wave(base, "ej-", 4))]
    assert sum(status == 504 for status, _ in answers) == 3, answers
    assert all(status == 200 or (status == 504 and "stage transfer" in text) for status, text in answers), answers
    metrics = scrape(base)
    assert metrics[f"pdserve_router_node_drained{{node={d1.url},role=decode}}"] == 1
    assert metrics[f"pdserve_router_node_drained{{node={d0.url},role=decode}}"] == 0
    health = httpx.get(base + "/health", timeout=5, trust_env=False).json()
    assert health["status"] == "ok" and reason in health["problems"], health
    view = httpx.get(base + "/debug/state", timeout=10, trust_env=False).json()["router"]["nodes"]
    assert {n["url"]: n["drained"] for n in view if n["role"] == "decode"} == {d0.url: None, d1.url: reason}
    text = router_log.read_text()
    assert f"ERROR ejection: {reason}" in text, text[-3000:]
    wait_until(lambda: "probe eject-probe-1 through" in router_log.read_text(), 30, 0.2, "the first probe to fail")
    assert "it stays drained" in router_log.read_text()
    # no stream open on either decode node now (the failed probe's ended): list order would pick d1
    before = d1.done()
    responses = asyncio.run(wave(base, "other-", 6))   # while drained: every one on d0, and answered
    assert [r.status_code for r in responses] == [200] * 6, [r.text[:200] for r in responses]
    assert d1.done() == before and scrape(base)[f"pdserve_router_node_drained{{node={d1.url},role=decode}}"] == 1
    wait_until(lambda: scrape(base)[f"pdserve_router_node_drained{{node={d1.url},role=decode}}"] == 0,
               PROBE_INTERVAL_S + 30, 0.2, "the next probe to readmit the node")
    assert f"ejection: decode node {d1.url} readmitted: probe eject-probe-2 through it answered" in \
        router_log.read_text()
    assert reason not in httpx.get(base + "/health", timeout=5, trust_env=False).json()["problems"]
    before = d1.done()
    responses = asyncio.run(wave(base, "after-", 4))   # d1 serves again
    assert [r.status_code for r in responses] == [200] * 4, [r.text[:200] for r in responses]
    assert d1.done() > before
