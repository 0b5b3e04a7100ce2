"""`pdserve router`'s decisions as plain code: node choice, the router-vs-node count cross-check, its /health
report, the internal REQUEST wire form and the CLI's node URLs (the processes: tests/multinode)."""
from __future__ import annotations

import argparse

import pytest

from actors.messages import Sampling
from api.node_api import generation_request, request_wire
from api.protocol import GenerationRequest
from api.router_client import Node, RouterClient, pick_node
from api.router_server import RouterMetrics
from pdserve.cli import node_urls
from pdserve.config import load_config
from pdserve.errors import ConfigError, EngineOverloadedError, InvalidRequestError


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


def test_a_node_of_one_side_refuses_what_belongs_to_the_other():
    with pytest.raises(ConfigError, match="kv_transport=mooncake"):
        load_config({"role": "prefill"}, env={})
    with pytest.raises(ConfigError, match="colocated"):
        load_config({"role": "decode", "colocated": "true", "kv_transport": "mooncake"}, env={})
