"""Readiness (api.metrics.not_ready) over actor states of N x M topologies, and the error log line's reason
(api.middleware.error_reason)."""
from __future__ import annotations

import logging

import orjson
import pytest

from actors.topology import Topology
from api.metrics import not_ready
from api.middleware import error_reason, log_error

TWO_BY_TWO = Topology(2, 2)   # prefill 0, 1; decode 2, 3


def states(**by_index) -> dict[int, str]:
    out = {0: "ok", 1: "ok", 2: "ok", 3: "ok"}
    out.update({int(k[1:]): v for k, v in by_index.items()})
    return out


def test_one_actor_of_each_role_serving_is_ready():
    assert not_ready(TWO_BY_TWO, states(), False) == []
    assert not_ready(TWO_BY_TWO, states(a3="dead"), False) == []
    assert not_ready(TWO_BY_TWO, states(a0="restarting", a2="hung"), False) == []


@pytest.mark.parametrize("down,reason", [({"a2": "dead", "a3": "restarting"}, "no decode actor is serving"),
                                         ({"a0": "hung", "a1": "dead"}, "no prefill actor is serving")])
def test_all_actors_of_one_role_down_is_not_ready_and_says_which(down, reason):
    assert not_ready(TWO_BY_TWO, states(**down), False) == [reason]


def test_draining_is_not_ready_and_colocated_or_one_sided_nodes_need_only_their_own_role():
    assert not_ready(TWO_BY_TWO, states(), True) == ["the engine is draining (shutting down)"]
    colocated = Topology(0, 2)   # decode 0, 1 prefill themselves
    assert not_ready(colocated, {0: "dead", 1: "ok"}, False) == []
    assert not_ready(colocated, {0: "dead", 1: "dead"}, False) == ["no decode actor is serving"]
    prefill_node = Topology(1, 0)
    assert not_ready(prefill_node, {0: "ok"}, False) == []


def test_the_error_log_names_the_param_and_message_and_never_the_body(caplog):
    body = orjson.dumps({"error": {"message": "unrecognized request argument 'max_token'", "type": "x",
                                   "param": "max_token", "code": None}})
    assert error_reason(400, body) == "param=max_token: unrecognized request argument 'max_token'"
    assert error_reason(499, b"") == "the client closed the connection first"
    assert error_reason(500, b"not json") == "(no error body)"
    with caplog.at_level(logging.INFO, logger="pdserve.api"):
        log_error("req-1", "POST", "/v1/completions", 400, body)
        log_error("req-2", "POST", "/v1/completions", 503, b"")
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.WARNING]
    assert caplog.records[0].getMessage() == ("request req-1: POST /v1/completions -> 400 param=max_token: "
                                              "unrecognized request argument 'max_token'")
