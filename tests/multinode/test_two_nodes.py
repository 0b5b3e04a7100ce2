"""Issue 15: a prefill node and a decode node in two network namespaces, KV over Mooncake TCP on the data veth,
`pdserve router` in the root namespace. One cluster for the module (node start-up dominates); the tests run in
file order and the last one kills the decode node.

Issue 39: router -> node is HTTPS with mutual TLS under a CA the module makes (tests/multinode/certs.py): each
node serves its certificate for its namespace address and asks for a client certificate (``--ssl-ca-certs``), the
router verifies the nodes with ``--node-ca`` and presents ``--node-client-cert``; every internal call carries the
node secret (``--node-secret-file``). The test itself calls the nodes as the router does (``Tls.context``).

The nodes share this host's /dev/shm (network namespaces do not separate it), which lets the test read each
node's state table and pools through ``EngineProbe``; the nodes themselves exchange nothing through it.
"""
from __future__ import annotations

import concurrent.futures
import re
import secrets
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from actors.prefix_cache import block_keys
from api.router_client import read_cache_report
from ipc.cache_summary import key_words
from tests.multinode.certs import TestCA
from tests.conftest import (ROOT, EngineProbe, cleanup_engine, free_port, signal_pids, start_engine, sweep_engine,
                            wait_until)
from tests.e2e.test_recorder import OTEL, OtlpCollector, needs_otel
from bench.netns import start_in_namespace, stop_process, wait_http_ok

# the first test also waits for three engines to start and a reference run (minutes when the machine is busy)
pytestmark = pytest.mark.timeout(900)
NODE_PORT = 8000
TICK_S = 0.5
INFLIGHT_TIMEOUT_S = 5.0
BOOTSTRAP_TIMEOUT_S = 10.0
NODE_HANG_S = 4.0
PROMPT_FREE_S = 5.0   # a prefill row the router ends is freed this soon: half the bootstrap deadline
COMMON = ["--kv-pool-tokens", "4096", "--monitor-tick-s", str(TICK_S), "--actor-hang-timeout-s", "30"]
NODE_FLAGS = COMMON + ["--kv-transport", "mooncake", "--inflight-timeout-s", str(INFLIGHT_TIMEOUT_S),
                       "--bootstrap-timeout-s", str(BOOTSTRAP_TIMEOUT_S)]
PROMPTS = [f"Question {i}: name a colour, a number and an animal." if i % 2 else
           f"Write one short sentence about the number {i * 7}." for i in range(16)]


class Tls:
    """The module's CA, a server certificate per node address, the router's client certificate and the node
    secret, as files under ``directory``."""

    SECRET = "multinode-node-secret-" + secrets.token_hex(16)

    def __init__(self, directory: Path, net):
        self.ca = TestCA(directory)
        self.nodes = {"prefill": self.ca.issue("prefill", [net.prefill_addr]),
                      "decode": self.ca.issue("decode", [net.decode_addr])}
        self.router = self.ca.issue("router", [], client=True)
        self.secret_path = directory / "node-secret"
        self.secret_path.write_text(self.SECRET + "\n")
        self.secret_path.chmod(0o600)

    def node_flags(self, role: str) -> list[str]:
        return ["--ssl-certfile", str(self.nodes[role].cert_path), "--ssl-keyfile", str(self.nodes[role].key_path),
                "--ssl-ca-certs", str(self.ca.cert_path), "--node-secret-file", str(self.secret_path)]

    def router_flags(self) -> list[str]:
        return ["--node-ca", str(self.ca.cert_path), "--node-client-cert", str(self.router.cert_path),
                "--node-client-key", str(self.router.key_path), "--node-secret-file", str(self.secret_path)]

    def context(self, client_cert: bool = True) -> ssl.SSLContext:
        """What the router holds: the CA, and (``client_cert``) its certificate."""
        context = ssl.create_default_context(cafile=str(self.ca.cert_path))
        if client_cert:
            context.load_cert_chain(str(self.router.cert_path), str(self.router.key_path))
        return context

    def node_get(self, url: str, **kwargs) -> httpx.Response:
        """GET a node's internal route as the router does (its certificate, its secret)."""
        return httpx.get(url, verify=self.context(), trust_env=False, timeout=10,
                         headers={"authorization": f"Bearer {self.SECRET}"}, **kwargs)


class Node:
    """One `pdserve serve --role ROLE` inside a namespace, over TLS (``tls``); ``otlp``: the collector URL its
    traces go to."""

    def __init__(self, net, role: str, log_dir: Path, tls: Tls, faults: str = "", otlp: str = ""):
        self.role, self.tls = role, tls
        ns = net.prefill_ns if role == "prefill" else net.decode_ns
        self.addr = net.prefill_addr if role == "prefill" else net.decode_addr
        data_addr = net.prefill_data_addr if role == "prefill" else net.decode_data_addr
        self.log_path = log_dir / f"{role}.log"
        argv = [sys.executable, "-m", "pdserve.cli", "serve", "--role", role, "--host", self.addr, "--port",
                str(NODE_PORT), "--kv-transfer-host", data_addr, *NODE_FLAGS, *tls.node_flags(role)] \
            + (["--faults", faults] if faults else []) + (["--otlp-traces-endpoint", otlp] if otlp else [])
        # a read that stopped answering (link down) holds Mooncake's worker up to this many seconds (default 30)
        self.proc = start_in_namespace(ns, argv, self.log_path, env={"MC_TRANSFER_TIMEOUT": "5"})
        self.engine_id = ""
        self.pids: list[int] = []

    @property
    def url(self) -> str:
        return f"https://{self.addr}:{NODE_PORT}"

    def wait_ready(self, timeout_s: float = 400.0) -> None:
        wait_http_ok(self.url + "/health", timeout_s, self.proc, verify=self.tls.context())
        self.engine_id = re.search(r"pdserve engine (\w+) serving", self.log_path.read_text()).group(1)
        self.pids = [self.proc.pid] + [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]

    def stop(self) -> None:
        stop_process(self.proc)
        sweep_engine(self.pids, self.engine_id)


def complete(base_url: str, prompt: str, request_id: str = "", max_tokens: int = 16, timeout_s: float = 120.0):
    headers = {"x-request-id": request_id} if request_id else {}
    return httpx.post(base_url + "/v1/completions", headers=headers, timeout=timeout_s, trust_env=False,
                      json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def answers(base_url: str, prompts: list[str]) -> list[str]:
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(lambda p: complete(base_url, p), prompts))
    assert [r.status_code for r in responses] == [200] * len(prompts), [r.text[:200] for r in responses]
    return [r.json()["choices"][0]["text"] for r in responses]


@pytest.fixture(scope="module")
def collector(two_host_net):
    """A real OTLP/HTTP receiver on the root namespace's bridge address, which both nodes export their traces to
    (None without the otel extra: the nodes then run untraced)."""
    if not OTEL:
        yield None
        return
    c = OtlpCollector(two_host_net.root_addr)
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def tls(two_host_net, tmp_path_factory):
    return Tls(tmp_path_factory.mktemp("multinode-tls"), two_host_net)


@pytest.fixture(scope="module")
def cluster(two_host_net, tmp_path_factory, collector, tls):
    """(router URL, prefill Node, decode Node, the single-node engine's answers to PROMPTS)."""
    log_dir = tmp_path_factory.mktemp("multinode")
    net = two_host_net
    otlp = f"http://{collector.host}:{collector.port}" if collector is not None else ""
    nodes = [Node(net, "prefill", log_dir, tls, otlp=otlp),
             Node(net, "decode", log_dir, tls, faults="transfer_stuck:match=stuck-;drop_transfer_done:match=nodone-",
                  otlp=otlp)]
    router = None
    single = None
    try:
        single = start_engine(log_dir, *COMMON)   # the reference: one node, both sides, same model and flags
        reference = answers(single.base_url, PROMPTS)
        cleanup_engine(single)
        single = None
        for node in nodes:
            node.wait_ready()
        port = free_port()
        router_log = open(log_dir / "router.log", "wb")
        router = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "router", "--port", str(port),
                                   "--prefill-node", nodes[0].url, "--decode-node", nodes[1].url,
                                   "--monitor-tick-s", str(TICK_S), "--actor-hang-timeout-s", str(NODE_HANG_S),
                                   *tls.router_flags()] + (["--otlp-traces-endpoint", otlp] if otlp else []),
                                  cwd=ROOT, stdout=router_log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        wait_http_ok(base + "/health", 120, router)
        yield base, nodes[0], nodes[1], reference
    finally:
        if router is not None:
            stop_process(router)
        if single is not None:
            cleanup_engine(single)
        for node in nodes:
            node.stop()


def settled(node: Node) -> bool:
    """No live row, every block free (the prefix cache's blocks count as free)."""
    probe = EngineProbe(node.engine_id)
    try:
        return not probe.live_rows() and all(free == total for free, total in probe.free_blocks().values())
    finally:
        probe.close()


def test_sixteen_concurrent_greedy_requests_equal_the_single_node_answers(cluster):
    base, prefill, decode, reference = cluster
    assert answers(base, PROMPTS) == reference
    for node in (prefill, decode):   # well inside the bootstrap deadline: every transfer_done reached prefill
        wait_until(lambda n=node: settled(n), PROMPT_FREE_S, 0.1, f"the {node.role} node to settle")
    metrics = httpx.get(base + "/metrics", trust_env=False).text
    assert re.search(r'pdserve_router_node_up\{node="%s",role="prefill"\} 1\.0' % re.escape(prefill.url), metrics)
    view = httpx.get(base + "/health", trust_env=False).json()
    assert view["status"] == "ok", view


def one_trace(collector, trace_id: str, parent_of_router: str | None):
    """``(router span, {node root name: span}, spans)`` once the router's span (its parent ``parent_of_router``,
    None: none) and both nodes' internal calls as its children are in trace ``trace_id``; else None."""
    spans = collector.trace(trace_id)
    routers = [s for s in spans if s.name == "POST /v1/completions"]
    if len(routers) != 1:
        return None
    router = routers[0]
    roots = {s.name: s for s in spans if s.parent_span_id == router.span_id}
    if set(roots) != {"POST /internal/prefill", "POST /internal/decode"} or len(spans) < 7:
        return None
    assert router.parent_span_id.hex() == (parent_of_router or ""), router.parent_span_id.hex()
    return router, roots, spans


@needs_otel
def test_one_trace_id_covers_the_router_and_both_nodes(cluster, collector):
    """The router's span of a request has the client's ``traceparent`` as parent, and the router forwards its own
    context to the prefill and the decode node: each node's trace of its internal call (its HTTP span and its stage
    spans) is a child of the router's span, all in the client's trace."""
    base = cluster[0]
    trace_id, caller_span = secrets.token_hex(16), secrets.token_hex(8)
    response = httpx.post(base + "/v1/completions", timeout=120, trust_env=False,
                          headers={"traceparent": f"00-{trace_id}-{caller_span}-01"},
                          json={"prompt": "Name a lighthouse", "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200, response.text
    router, roots, spans = wait_until(lambda: one_trace(collector, trace_id, caller_span), 30, 0.2,
                                      "the router's and both nodes' spans in the client's trace")
    under = {name: {s.name for s in spans if s.parent_span_id == root.span_id} for name, root in roots.items()}
    assert {"queued", "prefill"} <= under["POST /internal/prefill"], under
    assert "decode" in under["POST /internal/decode"], under
    assert {s.trace_id.hex() for s in spans} == {trace_id}


@needs_otel
def test_a_request_without_traceparent_is_one_trace_rooted_at_the_router(cluster, collector):
    """No client ``traceparent``: the router's span starts the trace and both nodes' spans join it."""
    base = cluster[0]
    request_id = f"untraced-{secrets.token_hex(4)}"
    response = httpx.post(base + "/v1/completions", timeout=120, trust_env=False, headers={"X-Request-Id": request_id},
                          json={"prompt": "Name a river", "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200, response.text

    def found():
        ids = {s.trace_id.hex() for s in collector.request_spans(request_id)}
        return one_trace(collector, ids.pop(), None) if len(ids) == 1 else None
    router, roots, spans = wait_until(found, 30, 0.2, "one trace: the router's span and both nodes' spans under it")
    assert len({s.trace_id for s in spans}) == 1


def test_the_nodes_speak_only_verified_tls_and_take_only_the_node_secret(cluster, tls):
    """What the router's link rests on, tried from the root namespace: cleartext to a node's port gets no answer,
    a client without the router's certificate gets no handshake, one that does not trust the CA refuses the node,
    and through the handshake a client key is a 401 where the node secret is a 200."""
    _, prefill, decode, _ = cluster
    for node in (prefill, decode):
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://{node.addr}:{NODE_PORT}/internal/status", timeout=5, trust_env=False)
        with pytest.raises(httpx.HTTPError):   # mutual TLS: no client certificate, no request
            httpx.get(node.url + "/health", verify=tls.context(client_cert=False), timeout=5, trust_env=False)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):   # the system store: unknown CA
            httpx.get(node.url + "/health", timeout=5, trust_env=False)
        assert tls.node_get(node.url + "/internal/status").json()["role"] == node.role
        keyed = httpx.get(node.url + "/internal/status", verify=tls.context(), trust_env=False, timeout=10,
                          headers={"authorization": "Bearer sk-some-client"})
        assert keyed.status_code == 401


def test_a_router_told_of_a_cleartext_node_on_another_host_refuses_to_start(cluster, tls):
    _, prefill, decode, _ = cluster
    argv = [sys.executable, "-m", "pdserve.cli", "router", "--port", "0", "--node-secret-file",
            str(tls.secret_path), "--prefill-node", f"http://{prefill.addr}:{NODE_PORT}", "--decode-node", decode.url]
    refused = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--insecure-nodes" in refused.stderr, refused.stderr


def test_the_prefill_node_reports_the_blocks_its_cache_holds_to_the_router(cluster, tls):
    """Cache-aware routing across nodes: a prompt of 2 full blocks prefilled through the router shows up in the
    prefill node's /internal/status cache report (what the router polls and prefers a node by)."""
    base, prefill, _, _ = cluster
    prompt = [(i * 7919) % 30000 + 200 for i in range(40)]
    response = httpx.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0},
                          timeout=120, trust_env=False)
    assert response.status_code == 200, response.text
    report = tls.node_get(prefill.url + "/internal/status").json()
    words, block_tokens = read_cache_report(report["cache"])
    assert set(key_words(block_keys(prompt, block_tokens)).tolist()) <= set(words.tolist())


def stuck_where(base: str, request_id: str) -> list[tuple[str, str]]:
    """(node role, stage) of ``request_id``'s live rows, from the router's /debug/state (tools/inspect --url)."""
    doc = httpx.get(base + "/debug/state", timeout=10, trust_env=False).json()
    return [(node.get("role"), r["stage"]) for node in doc["nodes"] for r in node.get("requests", [])
            if r["request_id"] == request_id]


def test_a_stuck_transfer_across_hosts_is_a_504_naming_the_stage_and_frees_both_sides(cluster):
    base, prefill, decode, _ = cluster
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(lambda: (complete(base, "A transfer that never completes", "stuck-1"),
                                       time.monotonic()))
        # one command answers "which request is stuck where": the router's view holds both nodes' rows
        where = wait_until(lambda: ("decode", "transfer") in stuck_where(base, "stuck-1")
                           and stuck_where(base, "stuck-1"), INFLIGHT_TIMEOUT_S, 0.1, "the stuck row in the view")
        seen_at = time.monotonic()   # the row was TRANSFERRING by then (at most one 0.1 s poll earlier)
        assert ("prefill", "bootstrap") in where
        shown = subprocess.run([sys.executable, "-m", "tools.inspect", "--url", base], cwd=ROOT, timeout=60,
                               capture_output=True, text=True)
        assert "stuck-1" in shown.stdout and prefill.engine_id in shown.stdout and decode.engine_id in shown.stdout
        resp, answered_at = pending.result(timeout=60)
    took_s = answered_at - start
    assert resp.status_code == 504, resp.text
    assert "transfer" in resp.json()["error"]["message"]
    assert took_s < 60, took_s   # the decode node's stage deadline fired, not the request's (600 s)
    # error within inflight_timeout_s + one tick of the stage starting (+1 s for the hops back to the client)
    assert answered_at - seen_at < INFLIGHT_TIMEOUT_S + TICK_S + 1.0, answered_at - seen_at
    for node in (prefill, decode):
        wait_until(lambda n=node: settled(n), BOOTSTRAP_TIMEOUT_S + 2 * TICK_S, 0.1, f"the {node.role} node to free")
    assert complete(base, "After the stuck one").status_code == 200


def test_a_dropped_transfer_done_leaves_nothing_pinned_on_the_prefill_node(cluster):
    base, prefill, decode, _ = cluster
    resp = complete(base, "The decode node never says it is done", request_id="nodone-1")
    assert resp.status_code == 200, resp.text   # the client has its answer: only the prefill side's message is lost
    # the router aborts the prefill row when the request ends (before the node's own bootstrap deadline would)
    wait_until(lambda: settled(prefill), PROMPT_FREE_S, 0.1, "the prefill node to free")


def test_the_data_link_down_longer_than_the_inflight_timeout_errors_then_recovers(cluster, two_host_net):
    base, prefill, decode, _ = cluster
    two_host_net.data_link(False)
    try:
        start = time.monotonic()
        resp = complete(base, "Sent while the data link is down")
        took_s = time.monotonic() - start
        assert resp.status_code in (503, 504), resp.text
        # its transfer fails (no route) or times out: within inflight_timeout_s + one tick of the transfer starting,
        # which comes after the prompt's prefill (allowed 5 s here)
        assert took_s < INFLIGHT_TIMEOUT_S + TICK_S + 5.0, took_s
        if took_s < INFLIGHT_TIMEOUT_S:   # failed fast (no route): keep the link down past the inflight timeout
            wait_until(lambda: time.monotonic() - start > INFLIGHT_TIMEOUT_S + TICK_S, 30, 0.1, "the timeout")
    finally:
        two_host_net.data_link(True)
    for node in (prefill, decode):
        wait_until(lambda n=node: settled(n), BOOTSTRAP_TIMEOUT_S + 2 * TICK_S, 0.1, f"the {node.role} node to free")

    def served() -> bool:
        return complete(base, "After the link came back", max_tokens=4).status_code == 200
    wait_until(served, 30, 0.5, "a request to succeed after the link came back")


def wait_transferring(decode: Node, request_id: str) -> None:
    def transferring() -> bool:
        probe = EngineProbe(decode.engine_id)
        try:
            return any(int(r["state"]) == 4 for r in probe.rows_with_id(request_id))
        finally:
            probe.close()
    wait_until(transferring, 60, 0.05, f"{request_id} to be transferring on the decode node")


def signal_mid_transfer(base: str, decode: Node, request_id: str, signum: int, resume: int = 0):
    """Send a request pinned in TRANSFERRING on the decode node (fault ``transfer_stuck``), signal every process of
    that node once it is, and return (the answer, seconds from the signal to it); ``resume``: a signal sent after
    the answer, whatever happened (SIGCONT after a SIGSTOP)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(lambda: (complete(base, f"Frozen or killed while transferring ({request_id})",
                                                request_id), time.monotonic()))
        wait_transferring(decode, request_id)
        signalled_at = time.monotonic()
        signal_pids(decode.pids, signum)
        try:
            resp, answered_at = pending.result(timeout=NODE_HANG_S + 30)
        finally:
            if resume:
                signal_pids(decode.pids, resume)
    return resp, answered_at - signalled_at


def test_a_decode_node_that_stops_answering_is_marked_dead_and_its_requests_fail_fast(cluster):
    base, prefill, decode, _ = cluster
    # no reset, no answer: only the router's node poll can tell
    resp, failed_after_s = signal_mid_transfer(base, decode, "stuck-stop", signal.SIGSTOP, resume=signal.SIGCONT)
    assert resp.status_code == 503 and "stopped answering" in resp.json()["error"]["message"], resp.text
    assert failed_after_s < NODE_HANG_S + 3 * TICK_S + 2, failed_after_s
    wait_until(lambda: settled(prefill), BOOTSTRAP_TIMEOUT_S + 2 * TICK_S, 0.1, "the prefill node to free")
    wait_until(lambda: settled(decode), 30, 0.1, "the decode node to free after it resumed")

    def served() -> bool:
        return complete(base, "After the decode node resumed", max_tokens=4).status_code == 200
    wait_until(served, 30, 0.5, "a request to succeed on the resumed node")


def test_the_decode_node_killed_mid_transfer_fails_fast_and_the_prefill_node_frees(cluster):
    base, prefill, decode, _ = cluster
    resp, failed_after_s = signal_mid_transfer(base, decode, "stuck-kill", signal.SIGKILL)
    assert resp.status_code in (502, 503), resp.text
    assert failed_after_s < NODE_HANG_S + 5, failed_after_s
    wait_until(lambda: settled(prefill), BOOTSTRAP_TIMEOUT_S + 2 * TICK_S, 0.1, "the prefill node to free")

    def decode_marked_dead() -> bool:
        return "dead" in httpx.get(base + "/health", trust_env=False).json()["nodes"][decode.url]
    wait_until(decode_marked_dead, NODE_HANG_S + 5, 0.2, "the router to mark the decode node dead")
    resp = complete(base, "No decode node left")
    assert resp.status_code == 503 and "no decode node" in resp.json()["error"]["message"]
