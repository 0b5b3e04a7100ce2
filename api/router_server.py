"""`pdserve router --prefill-node URL --decode-node URL ...`: the OpenAI API in front of prefill and decode nodes.

One process: the same Starlette routes as a node's API (api/app.py: parsing, tokenization, chat templates, stop
strings, streaming) over ``RouterClient`` (api/router_client.py) instead of shared memory; /health is 200 while at
least one node of each role serves; /metrics has the router's request counts and latencies and one gauge set per
node; ``GET /debug/state`` is the router's view plus each node's own (their ``/internal/state``; ``tools/inspect
--url``), for an admin key once keys are configured (api/middleware.py). Every call to a node carries
``node_secret``; ``https://`` nodes are verified (api/router_client.py ``node_ssl_context``). SIGTERM or SIGINT
stops it gracefully.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api.metrics import RequestMetrics
from api.router_client import RouterClient

log = logging.getLogger("pdserve.router")


class _NodeCollector:
    def __init__(self, client: RouterClient):
        self.client = client

    def collect(self):
        up = GaugeMetricFamily("pdserve_router_node_up", "1 while the node answers and reports healthy",
                               labels=["node", "role"])
        flying = GaugeMetricFamily("pdserve_router_node_requests", "requests the router has in flight on the node",
                                   labels=["node", "role"])
        reported = GaugeMetricFamily("pdserve_router_node_reported_requests",
                                     "requests the node's API reports holding (last poll)", labels=["node", "role"])
        mismatch = CounterMetricFamily("pdserve_router_node_count_mismatch",
                                       "polls where router and node counts disagreed twice in a row",
                                       labels=["node", "role"])
        drained = GaugeMetricFamily("pdserve_router_node_drained", "1 = the router drained the node (no new "
                                    "requests) for repeated timeouts in one stage; /health names why",
                                    labels=["node", "role"])
        for n in self.client.nodes:
            labels = [n.url, n.role]
            up.add_metric(labels, float(n.healthy and not n.dead))
            flying.add_metric(labels, n.in_flight)
            reported.add_metric(labels, n.reported_active)
            mismatch.add_metric(labels, n.mismatches_total)
            drained.add_metric(labels, float(bool(n.drained)))
        yield from (up, flying, reported, mismatch, drained)


class RouterMetrics(RequestMetrics):
    """The router's /metrics (api.metrics.RequestMetrics: requests, TTFT, e2e, TPOT, ITL, each ``n`` choice
    counted) plus one gauge set per node, and its /health."""

    def __init__(self, client: RouterClient):
        super().__init__("requests admitted by the router")
        self.client = client
        self.registry.register(_NodeCollector(client))

    def health(self) -> dict[str, Any]:
        """ok while at least one node of each role serves; the problems name the others."""
        nodes, problems = {}, []
        for n in self.client.nodes:
            state = "ok" if n.healthy and not n.dead else ("dead" if n.dead else "unavailable")
            nodes[n.url] = f"{n.role} {state}"
            if state != "ok":
                problems.append(f"{n.role} node {n.url} is {state}" + (f": {n.last_error}" if n.last_error else ""))
            elif n.drained:
                problems.append(n.drained)
        for role in ("prefill", "decode"):
            if not any(n.role == role and n.healthy and not n.dead for n in self.client.nodes):
                problems.insert(0, f"no {role} node is serving")
        serving = not any(p.startswith("no ") for p in problems)
        return {"status": "ok" if serving else "unavailable", "problems": problems, "nodes": nodes}


def debug_route(client: RouterClient) -> Route:
    """``GET /debug/state``: ``{"router": client.view(), "nodes": [each node's /internal/state (its /debug/state
    snapshot), or {"url", "error"}]}`` (the document tools/inspect --url renders)."""
    async def debug_state(request: Request) -> Response:
        async def one(node) -> dict:
            try:
                resp = await asyncio.wait_for(client.poll_http.get(node.url + "/internal/state", timeout=2.0), 2.5)
                if resp.status_code == 200:
                    return {"url": node.url, **resp.json()}
                return {"url": node.url, "error": f"HTTP {resp.status_code}"}
            except Exception as exc:   # any failure of one node is shown, never raised
                return {"url": node.url, "error": f"{type(exc).__name__}: {exc}"}
        nodes = await asyncio.gather(*(one(n) for n in client.nodes))
        return JSONResponse({"router": client.view(), "nodes": list(nodes)})
    return Route("/debug/state", debug_state, methods=["GET"])


def run_router(loaded, prefill_urls: list[str], decode_urls: list[str]) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit status. Raises ConfigError / ModelLoadError before serving."""
    logging.getLogger("httpx").setLevel(logging.WARNING)   # a line per node poll otherwise
    from actors.supervisor import plan_layout

    layout = plan_layout(loaded, "router")   # model metadata and sizes only: the same limits the nodes apply
    asyncio.run(_serve(layout, prefill_urls, decode_urls))
    return 0


async def _serve(layout, prefill_urls: list[str], decode_urls: list[str]) -> None:
    from hypercorn.asyncio import serve

    from api.app import build_app
    from api.http_edges import (answer_cancelled_requests, ignore_cancelled_connection_callbacks,
                                install_idle_close, install_refused_streams, keep_alive_config)
    from api.middleware import load_api_keys
    from api.tracing import TraceContextMiddleware, start_router_tracer
    from api.formats import formats_for
    from api.protocol import RequestParser
    from gpu.grammar import GrammarCompiler
    from gpu.model_files import model_cache_dir
    from gpu.tokenizer import Tokenizer
    from pdserve.config import admin_keys, allowed_origins, node_secret

    config = layout.config
    tokenizer = Tokenizer.load(layout.model_path or None, model_cache_dir(config.model_cache_dir))
    if config.chat_template:
        import pathlib

        tokenizer.set_chat_template(pathlib.Path(config.chat_template).read_text(encoding="utf-8"))
    grammars = GrammarCompiler(tokenizer=tokenizer)
    client = RouterClient(config, prefill_urls, decode_urls, node_secret=node_secret(config))
    await client.start()
    parser = RequestParser(tokenizer, layout.served_model_name, layout.max_context_tokens,
                           config.reserve_output_tokens, layout.kv_blocks_per_pool, config.kv_block_tokens, grammars,
                           config.max_tokens_policy, formats_for(layout, tokenizer), config.max_queued_requests,
                           config.tool_calls_in_reasoning == "call", config.strict_fields)
    metrics = RouterMetrics(client)
    metrics.watch_unknown_fields(parser.unknown_fields)
    app = build_app(client, tokenizer, parser, metrics, load_api_keys(config), (debug_route(client),),
                    allowed_origins(config), admin_keys(config))
    hconfig = keep_alive_config(config.keep_alive_timeout_s)
    hconfig.bind = [f"{config.host}:{layout.http_port}"]
    hconfig.accesslog = None
    hconfig.graceful_timeout = 1.0
    install_idle_close()
    install_refused_streams()
    loop = asyncio.get_running_loop()
    ignore_cancelled_connection_callbacks(loop)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    log.info("pdserve router serving on http://%s:%d (prefill nodes %s; decode nodes %s)", config.host,
             layout.http_port, ", ".join(prefill_urls), ", ".join(decode_urls))
    tracing = start_router_tracer(config)
    try:
        await serve(answer_cancelled_requests(TraceContextMiddleware(app, tracing[0] if tracing else None)), hconfig,
                    shutdown_trigger=stop.wait)
    finally:
        if tracing is not None:
            tracing[1].shutdown()
        await client.stop()
        log.info("pdserve router stopped")
