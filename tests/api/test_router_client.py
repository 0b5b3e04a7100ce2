"""`pdserve router`'s decisions as plain code: node choice, the router-vs-node count cross-check, its /health
report, the internal REQUEST wire form and the CLI's node URLs (the processes: tests/multinode)."""
from __future__ import annotations

import argparse
import asyncio

import orjson
import pytest

from actors.topology import REMOTE, Topology
from api.node_api import generation_request, request_wire
from api.protocol import GenerationRequest
from actors.prefix_cache import block_keys
from api.router_client import Node, RouterClient, cached_prefix_tokens, pick_node, read_cache_report
from api.router_server import RouterMetrics
from pdserve.cli import node_urls
from pdserve.config import load_config
from ipc.cache_summary import encode_words, key_words
from pdserve.errors import ConfigError, EngineOverloadedError, InvalidRequestError, PdserveError
from pdserve.sampling import Sampling


def router(prefill=("http://p0:1", "http://p1:1"), decode=("http://d0:1",)) -> RouterClient:
    return RouterClient(load_config({}, env={}).config, list(prefill), list(decode))


def test_the_router_picks_the_serving_node_of_a_role_with_the_fewest_requests_in_flight():
    nodes = [Node("http://p0:1", "prefill", healthy=True, in_flight=3),
             Node("http://p1:1", "prefill", healthy=True, in_flight=1),
             Node("http://p2:1", "prefill", healthy=True, dead=True),
             Node("http://p3:1", "prefill", healthy=False),
             Node("http://d0:1", "decode", healthy=True, in_flight=9)]
    assert pick_node(nodes, "prefill").url == "http://p1:1"
    assert pick_node(nodes, "decode").url == "http://d0:1"
    nodes[-1].dead = True
    with pytest.raises(EngineOverloadedError, match="no decode node is serving"):
        pick_node(nodes, "decode")


def cached_node(url: str, prompt_ids: list[int], in_flight: int = 0) -> Node:
    """A serving prefill node whose last poll reported every full block of ``prompt_ids`` cached (16 tokens each),
    through the wire form a node sends (api/node_api.py ``/internal/status``)."""
    words = key_words(block_keys(prompt_ids, 16))
    node = Node(url, "prefill", healthy=True, in_flight=in_flight)
    node.cache_words, node.block_tokens = read_cache_report({"block_tokens": 16, "words": encode_words(words)})
    return node


def test_the_router_sends_a_prompt_to_the_prefill_node_caching_its_longest_prefix_within_the_bound():
    """p1 caches the first 3 blocks of the prompt, p2 the first 1: p1 wins though it has more in flight, until its
    queued prompt tokens pass the least-queued node's by more than the bound; then the longest cached prefix among
    the nodes within it (p2). A prompt none caches goes by requests in flight."""
    prompt = list(range(1, 70))
    nodes = [Node("http://p0:1", "prefill", healthy=True, in_flight=0), cached_node("http://p1:1", prompt[:48], 5),
             cached_node("http://p2:1", prompt[:16], 3)]
    assert cached_prefix_tokens(nodes[1], prompt) == 48 and cached_prefix_tokens(nodes[2], prompt) == 16
    keys = block_keys(prompt[:48], 16)
    gap = cached_node("http://p3:1", [])   # blocks 0 and 2 cached, 1 evicted: the prefix ends at block 1
    gap.cache_words = read_cache_report({"block_tokens": 16, "words": encode_words(key_words([keys[0], keys[2]]))})[0]
    assert cached_prefix_tokens(gap, prompt) == 16
    assert pick_node(nodes, "prefill", prompt, {}, 2048).url == "http://p1:1"
    assert pick_node(nodes, "prefill", prompt, {"http://p1:1": 3000}, 2048).url == "http://p2:1"
    assert pick_node(nodes, "prefill", prompt, {"http://p1:1": 3000}, None).url == "http://p1:1"
    assert pick_node(nodes, "prefill", [9] * 70, {}, 2048).url == "http://p0:1"


def test_a_malformed_cache_report_is_refused_and_no_report_means_no_cache():
    assert read_cache_report(None) == (None, 16)
    for bad in ({"block_tokens": 16, "words": "not base64!"}, {"block_tokens": 16, "words": "AAAA"},
                {"block_tokens": 0, "words": ""}, ["words"]):
        with pytest.raises(ValueError):
            read_cache_report(bad)


def test_a_prefill_nodes_report_is_what_its_serving_actors_cache(engine_id):
    """The node side: the union of its prefill actors' summaries (real shm), a restarted actor's predecessor's
    region left out (its row names another pid)."""
    from api.admission import Admission
    from ipc.actor_table import ActorStatus
    from ipc.cache_summary import CacheSummary
    from ipc.naming import segment_name
    from tests.actors.fakes import FakeActors, FakeClock, FakeTable, Outbox

    summary = CacheSummary.create(segment_name(engine_id, "cachesum"), num_actors=2, slots=8)
    try:
        for index, tokens in ((0, list(range(32))), (1, [5] * 16)):
            writer = summary.writer(index)
            writer.clear(100 + index)
            for block, key in enumerate(block_keys(tokens, 16)):
                writer.cached(block, key)
        actors = FakeActors(["prefill0", "prefill1", "decode0"])
        actors.table[0]["actor_pid"], actors.table[1]["actor_pid"] = 100, 101
        config = load_config({}, env={}).config
        admission = Admission(config, FakeTable(FakeClock()), Outbox(), actors, FakeClock(), lambda: False,
                              owner=4, topology=Topology(2, 1), summaries=summary)
        expected = sorted(key_words(block_keys(list(range(32)), 16)).tolist() + key_words(block_keys([5] * 16, 16))
                          .tolist())
        assert admission.cached_words().tolist() == expected
        actors.table[1]["actor_pid"] = 999   # prefill1 restarted, its new process has not cleared the region yet
        assert admission.cached_words().tolist() == sorted(key_words(block_keys(list(range(32)), 16)).tolist())
        actors.table[0]["status"] = ActorStatus.STARTING
        assert admission.cached_words().tolist() == []
    finally:
        summary.close()


def test_queued_prompt_tokens_count_each_request_once_until_its_prefill_call_answers():
    from api.admission import RequestHandle
    from api.router_client import InFlight

    async def scenario():
        client = router()
        p0, p1, d0 = client.nodes
        loop = asyncio.get_running_loop()
        waiting, answered = loop.create_future(), loop.create_future()
        answered.set_result(None)
        for request_id, node, task, n in ((1, p0, waiting, 2), (2, p1, waiting, 1), (3, p1, answered, 1)):
            request = GenerationRequest("completion", f"r{request_id}", "m", list(range(10 * request_id)),
                                        Sampling(max_tokens=4), n=n)
            flights = [InFlight(RequestHandle(request, request_id, i + 1, i), node, d0) for i in range(n)]
            for flight in flights:
                client.flights[flight.handle.key] = flight
                flight.prefill_task, flight.siblings = task, flights
        return client.queued_prompt_tokens()
    assert asyncio.run(scenario()) == {"http://p0:1": 10, "http://p1:1": 20}


def test_router_and_node_counts_are_flagged_after_two_disagreeing_polls_in_a_row():
    client = router()
    node = client.nodes[0]
    node.in_flight, node.reported_active = 2, 3
    client._cross_check(node, before=2)
    assert node.mismatches_total == 0   # one poll may race a request ending
    client._cross_check(node, before=2)
    assert node.mismatches_total == 1
    client._cross_check(node, before=2)
    assert node.mismatches_total == 1   # one incident, flagged once
    node.reported_active = 2
    client._cross_check(node, before=2)
    assert node.mismatch_ticks == 0
    node.reported_active = 5
    client._cross_check(node, before=1)   # the router's count moved during the poll: not compared
    client._cross_check(node, before=1)
    assert node.mismatch_ticks == 0 and node.mismatches_total == 1


def test_router_health_is_ok_while_one_node_of_each_role_serves():
    client = router()
    metrics = RouterMetrics(client)
    report = metrics.health()
    assert report["status"] == "unavailable"
    assert report["problems"][:2] == ["no decode node is serving", "no prefill node is serving"]
    for node in client.nodes:
        node.healthy = True
    client.nodes[0].dead = True
    client.nodes[0].last_error = "ConnectError: refused"
    report = metrics.health()
    assert report["status"] == "ok"
    assert report["problems"] == ["prefill node http://p0:1 is dead: ConnectError: refused"]
    client.nodes[2].dead = True
    assert metrics.health()["status"] == "unavailable"


def test_the_internal_request_wire_form_round_trips_and_bad_ones_are_400s():
    request = GenerationRequest("chat", "req-1", "m", [1, 2, 3], Sampling(temperature=0.0, max_tokens=7,
                                                                           stop_token_ids=(5, 6)), n=2,
                                timeout_s=30.0)
    back = generation_request(request_wire(request))
    assert (back.request_id, back.prompt_ids, back.sampling, back.n, back.timeout_s) == \
        ("req-1", [1, 2, 3], request.sampling, 2, 30.0)
    good = request_wire(request)
    for bad in ({**good, "prompt_ids": []}, {**good, "prompt_ids": [1, -1]}, {**good, "prompt_ids": [True]},
                {**good, "n": 0}, {**good, "request_id": ""}, {**good, "sampling": "x"},
                {**good, "timeout_s": -1}, [1, 2], {**good, "sampling": good["sampling"][:-1]},
                {**good, "sampling": ["hot"] + good["sampling"][1:]},
                {**good, "sampling": good["sampling"][:6] + ["7"] + good["sampling"][7:]}):
        with pytest.raises(InvalidRequestError):
            generation_request(bad)


def test_the_router_cli_needs_a_node_of_each_role_as_http_host_port():
    def args(prefill, decode):
        return argparse.Namespace(prefill_nodes=prefill, decode_nodes=decode)
    assert node_urls(args(["http://10.0.0.1:8001"], ["http://h:2", "https://h:3"])) == \
        (["http://10.0.0.1:8001"], ["http://h:2", "https://h:3"])
    for prefill, decode in (([], ["http://h:2"]), (["http://h:1"], []), (["h:1"], ["http://h:2"]),
                            (["http://h"], ["http://h:2"]), (["ftp://h:1"], ["http://h:2"])):
        with pytest.raises(ConfigError):
            node_urls(args(prefill, decode))


SECRET = "router-node-secret-0123456789"


def test_cleartext_to_another_host_needs_insecure_nodes_and_loopback_may_stay_cleartext():
    """The node secret and the prompts travel in every call: http:// is refused unless the node is this host's
    loopback or the operator says --insecure-nodes; https:// always goes."""
    def args(prefill, decode):
        return argparse.Namespace(prefill_nodes=prefill, decode_nodes=decode)
    config = load_config({"node_secret": SECRET}, env={}).config
    for prefill, decode in ((["http://10.0.0.1:8001"], ["https://h:3"]), (["https://h:1"], ["http://node-b:2"]),
                            (["http://[fd00::1]:1"], ["https://h:2"])):
        with pytest.raises(ConfigError, match="--insecure-nodes") as err:
            node_urls(args(prefill, decode), config)
        assert err.value.param in ("prefill_node", "decode_node")
    insecure = load_config({"node_secret": SECRET, "insecure_nodes": "true"}, env={}).config
    assert node_urls(args(["http://10.0.0.1:8001"], ["http://node-b:2"]), insecure) == \
        (["http://10.0.0.1:8001"], ["http://node-b:2"])
    local = (["http://127.0.0.1:1", "http://localhost:2"], ["http://[::1]:3", "https://10.0.0.2:4"])
    assert node_urls(args(*local), config) == local
    with pytest.raises(ConfigError, match="node_secret") as err:   # nodes without a secret: said out loud
        node_urls(args(*local), load_config({}, env={}).config)
    assert err.value.param == "node_secret"
    assert node_urls(args(*local), load_config({"insecure_nodes": "true"}, env={}).config) == local


def test_the_router_sends_the_node_secret_and_no_client_key_to_its_nodes():
    config = load_config({"node_secret": SECRET, "api_key": "sk-client"}, env={}).config
    client = RouterClient(config, ["http://p0:1"], ["http://d0:1"], node_secret=SECRET)
    assert client.headers == {"authorization": f"Bearer {SECRET}"}


def test_a_node_that_refuses_the_routers_secret_is_a_502_naming_the_setting_not_a_401_to_the_client():
    client = router()
    with pytest.raises(PdserveError) as err:
        client._answer(client.nodes[0], "/internal/prefill", 401, b'{"error": {"message": "no"}}')
    assert err.value.http_status == 502 and "node_secret" in err.value.message


def test_the_node_tls_context_verifies_against_node_ca_and_loads_the_client_certificate(tmp_path, monkeypatch):
    import ssl

    from api.router_client import node_ssl_context
    from tests.multinode.certs import TestCA

    ca = TestCA(tmp_path)
    server = ca.issue("node", ["127.0.0.1"])
    client_cert = ca.issue("router", [], client=True)
    config = load_config({"node_ca": str(ca.cert_path), "node_client_cert": str(client_cert.cert_path),
                          "node_client_key": str(client_cert.key_path)}, env={}).config
    context = node_ssl_context(config)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert [c["subject"] for c in context.get_ca_certs()] == [((("commonName", "pdserve test CA"),),)]
    assert server.cert_path.exists()
    monkeypatch.setenv("SSL_CERT_FILE", str(ca.cert_path))   # no node_ca: the system's store, as OpenSSL finds it
    default = node_ssl_context(load_config({}, env={}).config)
    assert default.verify_mode == ssl.CERT_REQUIRED and default.check_hostname
    assert ((("commonName", "pdserve test CA"),),) in [c["subject"] for c in default.get_ca_certs()]


def test_a_node_of_one_side_refuses_what_belongs_to_the_other():
    with pytest.raises(ConfigError, match="kv_transport=mooncake"):
        load_config({"role": "prefill"}, env={})
    with pytest.raises(ConfigError, match="colocated"):
        load_config({"role": "decode", "colocated": "true", "kv_transport": "mooncake"}, env={})


def test_a_decode_node_checks_every_number_of_a_kv_ready_before_an_actor_sees_it():
    import dataclasses

    from actors.messages import KVReady
    from api.node_api import NodeLimits, sampling_from_wire
    limits = NodeLimits(vocab_size=1000, max_context_tokens=256, block_tokens=16)
    # an ipc.mooncake_transport.PeerDescriptor's JSON (that module needs the optional library)
    peer = orjson.dumps({"session_id": "10.0.0.1:1234", "base_addr": 4096, "data_bytes": 10 * 1024, "num_layers": 2,
                         "num_blocks": 10, "block_tokens": 16, "num_kv_heads": 1, "head_dim": 8, "dtype": "float32",
                         "elem_bytes": 4, "epoch": 1}).decode()
    good = KVReady(3, 1, "r-1", [4, 7], 20, 42, Sampling(max_tokens=8), 0.01, 0.2, None, [], REMOTE, 0,
                   peer, [3, 1])
    limits.check_kv_ready(good)
    bad = [dict(src_block_ids=[4]), dict(src_block_ids=[4, 10]), dict(src_block_ids=[4, -1]),
           dict(src_block_ids=[4, "a"]), dict(num_tokens=0), dict(num_tokens=300), dict(first_token=1000),
           dict(first_token=-1), dict(sampling=Sampling(max_tokens=250)), dict(peer="{}"), dict(peer="x"),
           dict(prompt_ids=[1] * 19), dict(prompt_ids=[5000] * 20), dict(cached_tokens=21), dict(queue_s="x"),
           dict(prompt_row=[1]), dict(first_logprobs=["x"]), dict(request_id="")]
    for change in bad:
        with pytest.raises(InvalidRequestError):
            limits.check_kv_ready(dataclasses.replace(good, **change))
    wire = list(dataclasses.astuple(Sampling(max_tokens=8)))
    for index, value in ((0, 3.0), (1, 0.0), (2, 0), (5, 0), (5, 2**40), (10, 0.0), (11, 50)):
        with pytest.raises(InvalidRequestError):
            sampling_from_wire(wire[:index] + [value] + wire[index + 1:])


def transfer_timeout(request_id: str, field: str = "inflight_timeout_s") -> PdserveError:
    """A decode node's 504 as the router makes it from the node's error line (the monitor's message)."""
    error = PdserveError(f"decode node: request {request_id} timed out in stage transfer after 5.10 s ({field}=5)")
    error.http_status, error.error_type = 504, "timeout_error"
    return error


def test_a_decode_node_whose_requests_keep_timing_out_in_transfer_is_drained_never_the_last_one():
    client = router(prefill=("http://p0:1",), decode=("http://d0:1", "http://d1:1"))
    p0, d0, d1 = client.nodes
    for node in client.nodes:
        node.healthy = True
    client.blame(d1, transfer_timeout("a"), "a")
    client.blame(d1, transfer_timeout("b", "request_timeout_s"), "b")   # the request's own deadline: no count
    client.blame(d1, transfer_timeout("c"), "eject-probe-1")            # a probe: no count
    not_timeout = PdserveError("decode node: the pool is full")
    not_timeout.http_status = 503
    client.blame(d1, not_timeout, "d")
    client.blame(d1, transfer_timeout("e"), "e")
    assert not d1.drained and client.ejection.seen
    client.blame(d1, transfer_timeout("f"), "f")
    reason = "decode node http://d1:1 drained: 3 transfer timeouts in 60 s"
    assert d1.drained == reason and not d1.serving and d1.view(0.0)["drained"] == reason
    assert [pick_node(client.nodes, "decode").url for _ in range(3)] == ["http://d0:1"] * 3
    metrics = RouterMetrics(client)
    assert metrics.health()["status"] == "ok" and metrics.health()["problems"] == [reason]
    assert 'pdserve_router_node_drained{node="http://d1:1",role="decode"} 1.0' in metrics.render()[0].decode()
    for request_id in "ghi":   # d0 is now the last serving decode node: it keeps serving
        client.blame(d0, transfer_timeout(request_id), request_id)
    assert not d0.drained and pick_node(client.nodes, "decode") is d0
    assert client.probe_due == {2: 0.0}   # d1's probe is due at once
    d0.healthy = False   # d0 fails its poll: the drained but healthy d1 serves rather than a 503 for everyone
    assert pick_node(client.nodes, "decode") is d1
    d1.dead = True
    with pytest.raises(EngineOverloadedError, match="no decode node is serving"):
        pick_node(client.nodes, "decode")


def test_a_probe_is_pinned_to_the_drained_node_and_readmits_it_when_it_answers():
    client = router(prefill=("http://p0:1",), decode=("http://d0:1", "http://d1:1"))
    for node in client.nodes:
        node.healthy = True
    d1 = client.nodes[2]
    for request_id in "abc":
        client.blame(d1, transfer_timeout(request_id), request_id)
    assert d1.drained

    async def run() -> list[tuple[bool, str]]:
        seen = []

        def answered(request, timeout_s=None, pin=None):   # the real submit routes; its I/O is replaced
            assert pin is d1 and request.request_id.startswith("eject-probe-")
            handles = RouterClient.submit(client, request, timeout_s, pin)
            seen.append((client.flights[handles[0].key].decode.url, client.flights[handles[0].key].prefill.url))
            for flight in client.flights.values():
                flight.prefill_task.cancel()
            handles[0].events.put_nowait(("token", 5, None, None) if len(seen) == 2 else
                                         ("error", transfer_timeout(request.request_id)))
            if len(seen) == 2:
                handles[0].events.put_nowait(("token", 6, "length", None))
            return handles
        client.submit = answered
        first = [await client.probe(2), d1.drained]    # stuck in transfer again: stays drained
        second = [await client.probe(2), d1.drained]   # answers: readmitted
        return [tuple(first), tuple(second)] + seen
    results = asyncio.run(run())
    assert results[0] == (False, "decode node http://d1:1 drained: 3 transfer timeouts in 60 s")
    assert results[1] == (True, "")
    assert results[2:] == [("http://d1:1", "http://p0:1")] * 2 and not client.handles
