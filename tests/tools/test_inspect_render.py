"""tools/inspect's --url side without an engine: the router document's renderer over a hand-built document (the
shape documented in tools/inspect.py, which the router serves), the health and exit-status rules, and a URL
that refuses connections reported as unreachable."""
from __future__ import annotations

import socket

import orjson
from rich.console import Console

from tools import inspect


def node_snapshot(engine_id: str, role: str, url: str, *, healthy: bool = True, requests=()) -> dict:
    """A node's /debug/state document as the schema in tools/inspect.py describes it."""
    actor = {"name": f"{role}0", "role": role, "pid": 4242, "device": "cpu", "status": "ready", "health": "ok",
             "heartbeat_age_s": 0.1, "loop_iterations_per_s": 250.0, "restarts": 0, "late_messages": 0,
             "kv_blocks_free": 60, "kv_blocks_total": 64, "load": {"prefill_inflight": len(requests)},
             "requests_done": 7, "router_count": len(requests), "table_count": len(requests),
             "router_mismatch": False, "router_mismatches": 0, "prefix_cache": None}
    return {
        "schema": 1, "engine_id": engine_id, "url": url, "role": role, "taken_unix_s": 1.7e9, "healthy": healthy,
        "problems": [] if healthy else ["gauge prefill_inflight is stuck at 1"],
        "config": {"inflight_timeout_s": {"value": 2.0, "source": "env"},
                   "monitor_tick_s": {"value": 0.5, "source": "default"}},
        "actors": [actor],
        "gauges": [{"name": "prefill_inflight", "metric": "pdserve_prefill_inflight", "value": len(requests),
                    "nonzero_for_s": 3.0 if requests else 0.0, "since_last_move_s": 3.0 if requests else 0.0,
                    "stuck": not healthy, "mismatch": False, "actors_count": len(requests)}],
        "requests": [{"request_id": rid, "slot": i, "stage": "transfer", "age_in_stage_s": 3.0, "total_age_s": 3.5,
                      "owner": actor["name"], "prefill_actor": "prefill0", "decode_actor": "decode0",
                      "prefill_blocks": 2, "decode_blocks": 2, "output_tokens": 0, "stage_deadline_left_s": -1.0,
                      "request_deadline_left_s": 50.0} for i, rid in enumerate(requests)],
        "watchdog": {"ticks": 100, "last_tick_age_s": 0.2, "tick_cpu_ms": 1.5,
                     "timeouts_by_stage": {"transfer": 1}, "actor_failures_by_stage": {"transfer": 0}},
        "active_requests": {"api": len(requests), "engine": len(requests), "agree": True},
    }


P_URL, D_URL, GONE_URL = "http://10.0.0.5:8000", "http://10.0.0.6:8000", "http://10.0.0.7:8000"


def router_document(decode_healthy: bool = True) -> dict:
    return {
        "router": {
            "requests": [{"request_id": "chat-stuck-1", "prefill_node": P_URL, "decode_node": D_URL,
                          "stage": "transfer", "age_s": 3.5},
                         {"request_id": "chat-new-2", "prefill_node": P_URL, "decode_node": None,
                          "stage": "prefill", "age_s": 0.1}],
            "nodes": [{"url": P_URL, "role": "prefill", "healthy": True, "last_ok_age_s": 0.3, "in_flight": 2},
                      {"url": D_URL, "role": "decode", "healthy": decode_healthy, "last_ok_age_s": 0.4,
                       "in_flight": 1},
                      {"url": GONE_URL, "role": "decode", "healthy": False, "last_ok_age_s": 42.0, "in_flight": 0}],
        },
        "nodes": [node_snapshot("aaaa0001", "prefill", P_URL, requests=["chat-stuck-1", "chat-new-2"]),
                  node_snapshot("bbbb0002", "decode", D_URL, healthy=decode_healthy),
                  {"url": GONE_URL, "error": "ConnectError: connection refused"}],
    }


def text_of(renderable) -> str:
    console = Console(record=True, width=220, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_the_router_document_renders_its_nodes_its_requests_and_each_node_section():
    text = text_of(inspect.render_router(router_document()))
    lines = text.splitlines()
    gone = next(line for line in lines if GONE_URL in line and "UNHEALTHY" in line)
    assert "42.0s" in gone
    assert "router requests in flight (2)" in text
    stuck = next(line for line in lines if "chat-stuck-1" in line and P_URL in line)
    assert "transfer" in stuck and "3.5s" in stuck and D_URL in stuck
    assert f"node {P_URL}  engine aaaa0001  role prefill" in text
    assert f"node {D_URL}  engine bbbb0002  role decode" in text
    assert f"node {GONE_URL}" in text and "UNREACHABLE: ConnectError: connection refused" in text
    assert "live requests (2)" in text   # the prefill node's own table


def test_a_source_is_healthy_only_when_it_and_every_node_it_lists_are():
    router_ok = {"url": "http://r:9000", "ok": True, "error": None, "state": router_document()}
    assert not inspect.source_healthy(router_ok)   # GONE_URL is listed unhealthy and unreachable
    doc = router_document()
    doc["router"]["nodes"].pop()
    doc["nodes"].pop()
    assert inspect.source_healthy({**router_ok, "state": doc})
    doc_sick = router_document(decode_healthy=False)
    doc_sick["router"]["nodes"].pop()
    doc_sick["nodes"].pop()
    assert not inspect.source_healthy({**router_ok, "state": doc_sick})
    node = {"url": P_URL, "ok": True, "error": None, "state": node_snapshot("aaaa0001", "both", P_URL)}
    unreachable = {"url": GONE_URL, "ok": False, "error": "refused", "state": None}
    assert inspect.urls_exit_status([node]) == inspect.EXIT_OK
    assert inspect.urls_exit_status([node, unreachable]) == inspect.EXIT_PROBLEM
    assert inspect.urls_exit_status([unreachable]) == inspect.EXIT_NO_ENGINE
    text = text_of(inspect.render_sources([{**router_ok, "state": doc}, unreachable]))
    assert "router http://r:9000" in text and f"node {GONE_URL}" in text and "UNREACHABLE: refused" in text


def refused_url() -> str:
    """A loopback URL nothing listens on: a port bound and closed again, so connecting is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_a_url_that_refuses_connections_is_reported_unreachable_with_exit_status_2(capsys):
    url = refused_url()
    assert inspect.main(["--url", url, "--json", "--timeout-s", "2"]) == inspect.EXIT_NO_ENGINE
    [source] = orjson.loads(capsys.readouterr().out)["sources"]
    assert source["url"] == url and source["ok"] is False and source["state"] is None
    assert "refused" in source["error"].lower()
    assert inspect.main(["--url", url, "--timeout-s", "2"]) == inspect.EXIT_NO_ENGINE
    assert f"node {url}" in capsys.readouterr().out
    assert inspect.state_url(url + "/") == url + "/debug/state" == inspect.state_url(url + "/debug/state")


def test_an_id_with_no_timeline_is_never_reached_until_the_ring_wraps():
    from tools.timelines import not_found_text

    assert "never reached this server: the flight recorder holds every event" in not_found_text("x-1", 0, 5 * 10**9)
    wrapped = not_found_text("x-1", 2 * 10**9, 5 * 10**9)
    assert "never reached this server, or it came before the ring's horizon (3.0 s ago" in wrapped


def test_a_drained_node_and_a_drained_actor_are_shown_with_their_reasons():
    doc = router_document()
    reason = f"decode node {D_URL} drained: 3 transfer timeouts in 60 s"
    doc["router"]["nodes"][1]["drained"] = reason
    doc["nodes"][1]["actors"][0]["drained"] = "decode0 drained: 3 transfer timeouts in 60 s"
    text = text_of(inspect.render_router(doc))
    line = next(line for line in text.splitlines() if D_URL in line and "DRAINED" in line)
    assert reason in line
    assert any("decode0" in line and "ok DRAINED" in line for line in text.splitlines())
