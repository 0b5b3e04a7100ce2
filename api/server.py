"""ApiActor: the HTTP process. Hypercorn serves the Starlette app over HTTP/1.1 and cleartext HTTP/2
(h2c with prior knowledge, and the HTTP/1.1 Upgrade) on one port; with ``ssl_certfile``/``ssl_keyfile``,
HTTP/2 over TLS (ALPN h2) and HTTP/1.1 over TLS instead (``ssl_ca_certs``: clients must present a certificate).
A node (``role`` prefill or decode) also mounts api/node_api.py's ``/internal/*`` routes, which take only the
router's ``node_secret``; a plain engine has none (404).

The process beats its heartbeat from the asyncio loop, so a wedged event loop shows up as a hung API. The watchdog
fire drill (api/drill.py, ``drill_interval_s``) is a task of the same loop; the heartbeat loop also runs the
conservation checks of ids and connections (api/conservation.py) once per ``monitor_tick_s``.

Connection edges Hypercorn and h2 handle short of the RFCs (idle close: GOAWAY on HTTP/2, a staged close on
HTTP/1.1; a connection the client closed while idle closed at once; ``Keep-Alive: timeout=N``; REFUSED_STREAM for
a stream over the HTTP/2 limit; no admission for a stream reset before its body was read; a 503 for a request cut
by the shutdown) are fixed by the guarded wrappers of ``api/http_edges.py``, which also keep the connection ledger
(ipc/ledger.py): what each connection is doing, readable by tools/inspect with this process stopped.
"""
from __future__ import annotations

import asyncio
import logging
import pathlib
import time

from actors.base import Actor, exit_now, parent_is_gone
from actors.topology import API_INDEX

log = logging.getLogger("pdserve.api")


def grammar_compiler(tokenizer, actors, topology):
    """``(GrammarCompiler, tick)`` for the API process: ``tick``, called from its loop, starts the compiler's
    ``warm_up()`` (the tokenizer view, in a daemon thread) the first time every engine actor of ``topology`` reads
    READY in ``actors`` (an ipc.actor_table.ActorTable), so the view does not compete with the actors' start-up;
    later calls do nothing. A constrained request before that builds the view itself (and waits for it)."""
    from gpu.grammar import GrammarCompiler
    from ipc.actor_table import ActorStatus

    grammars, pending = GrammarCompiler(tokenizer=tokenizer), [True]

    def tick() -> None:
        engine_actors = (*topology.prefill, *topology.decode)
        if pending and all(actors.row(i)["status"] == ActorStatus.READY for i in engine_actors):
            pending.clear()
            grammars.warm_up()
    return grammars, tick


class ApiActor(Actor):
    role = "api"

    def __init__(self, layout, index: int = API_INDEX):
        super().__init__(layout, index)

    def child_main(self) -> None:
        """The API process's entry: signals as every child (base.leave_signals_to_the_supervisor); the HTTP
        server stops gracefully when the supervisor sets the stop flag (``engine_stopping``) or dies."""
        self.parent_died = False

        def parent_died() -> None:   # from a signal handler: the shutdown trigger below notices within idle_wait_s
            self.parent_died = True

        self.parent = self.enter_child(parent_died, status_readonly=True)
        from ipc.actor_table import ActorStatus

        asyncio.run(self._serve())
        self.actors.set_status(self.index, ActorStatus.STOPPED)
        exit_now()

    def _stopping(self) -> bool:
        return self.engine_stopping() or self.parent_died or parent_is_gone(self.parent)

    def _hypercorn_config(self):
        """Hypercorn's config: the bind address; idle connections close after keep_alive_timeout_s (HTTP/1.1: in
        stages; HTTP/2: GOAWAY first), announced on HTTP/1.1 responses by Keep-Alive: timeout=N, and a request
        that has started is never cut by it; TLS with ALPN (h2, then HTTP/1.1) when certificates are given."""
        from api.http_edges import keep_alive_config

        hconfig = keep_alive_config(self.config.keep_alive_timeout_s)
        hconfig.bind = [f"{self.config.host}:{self.layout.http_port}"]
        hconfig.accesslog = None
        hconfig.graceful_timeout = 1.0
        certfile = getattr(self.config, "ssl_certfile", "") or ""
        keyfile = getattr(self.config, "ssl_keyfile", "") or ""
        if certfile or keyfile:
            if not (certfile and keyfile):
                raise ValueError("ssl_certfile and ssl_keyfile must be given together")
            hconfig.certfile, hconfig.keyfile = certfile, keyfile
            hconfig.alpn_protocols = ["h2", "http/1.1"]   # HTTP/2 over TLS, HTTP/1.1 for clients without h2
            if getattr(self.config, "ssl_ca_certs", ""):   # mutual TLS: no certificate signed by it, no handshake
                import ssl

                hconfig.ca_certs, hconfig.verify_mode = self.config.ssl_ca_certs, ssl.CERT_REQUIRED
        return hconfig

    def _write_records(self, app, metrics):
        """Attach what this process writes in shm besides the recorder: the arrival index (ipc/arrivals.py) and
        the connection ledger (ipc/ledger.py, around ``app``); returns the app."""
        from api.http_edges import install_connection_ledger, record_requests

        if "arrivals" in self.layout.segments:
            from ipc import arrivals

            arrivals.install(arrivals.ArrivalIndex.attach(self.layout.segment("arrivals")))
        if "conns" in self.layout.segments:
            from ipc.ledger import ConnectionLedger

            ledger = ConnectionLedger.attach(self.layout.segment("conns"))
            orphans = ledger.close_orphans(time.monotonic_ns())
            if orphans:   # a restart: the dead API's connections died with it
                log.warning("closed %d connection-ledger rows the previous API process left open (reason error)",
                            orphans)
            if install_connection_ledger(ledger):
                from pdserve.faults import FaultPlan

                app, metrics.ledger = record_requests(app, FaultPlan(self.config.faults, "api")), ledger
        return app

    async def _serve(self) -> None:
        from hypercorn.asyncio import serve

        from api.app import build_app
        from api.engine_client import EngineClient
        from api.http_edges import (answer_cancelled_requests, ignore_cancelled_connection_callbacks,
                                    install_idle_close, install_refused_streams, install_reset_streams)
        from api.metrics import EngineMetrics
        from api.middleware import admin_keys, load_api_keys, node_secret
        from pdserve.config import allowed_origins
        from api.node_api import NodeLimits, NodeRoutes
        from api.formats import formats_for
        from api.protocol import RequestParser
        from gpu.model_files import model_cache_dir
        from gpu.tokenizer import Tokenizer
        from ipc.actor_table import ActorStatus

        # the GGUF header comes from the model cache (written by the supervisor's plan_layout): ~4 s saved
        tokenizer = Tokenizer.load(self.layout.model_path or None, model_cache_dir(self.config.model_cache_dir))
        if self.config.chat_template:   # --chat-template FILE replaces the model's own template
            tokenizer.set_chat_template(pathlib.Path(self.config.chat_template).read_text(encoding="utf-8"))
        grammars, warm_grammars = grammar_compiler(tokenizer, self.actors, self.topology)   # warmed once READY
        client = EngineClient(self.layout)
        client.start(asyncio.get_running_loop())
        parser = RequestParser(tokenizer, self.layout.served_model_name, self.layout.max_context_tokens,
                               self.config.reserve_output_tokens, self.layout.kv_blocks_per_pool,
                               self.config.kv_block_tokens, grammars, self.config.max_tokens_policy,
                               formats_for(self.layout, tokenizer), self.config.max_queued_requests,
                               self.config.tool_calls_in_reasoning == "call", self.config.strict_fields)
        metrics = EngineMetrics(client, parser.served_model_name, parser.unknown_fields)
        node_routes = ()
        if self.config.role != "both":   # a node behind `pdserve router`: its /internal/* routes, its secret
            limits = NodeLimits(tokenizer.vocab_size, self.layout.max_context_tokens, self.config.kv_block_tokens)
            node_routes = NodeRoutes(client, metrics.health, self.layout.engine_id, limits).routes()
        app = build_app(client, tokenizer, parser, metrics, load_api_keys(self.config), node_routes,
                        allowed_origins(self.config), admin_keys(self.config), node_secret(self.config))

        hconfig = self._hypercorn_config()
        install_idle_close()
        install_refused_streams()
        install_reset_streams()
        app = self._write_records(app, metrics)
        tracer = None
        if self.config.otlp_traces_endpoint:   # OpenTelemetry traces of finished requests (api/tracing.py)
            from api.tracing import TraceMiddleware, start_tracer

            tracer = start_tracer(self.config, self.recorder, client.topology.names, self.layout.engine_id)
            app = TraceMiddleware(app, tracer)
            metrics.registry.register(tracer.collector())
        ignore_cancelled_connection_callbacks(asyncio.get_running_loop())
        from api.conservation import ConservationChecks, incident_writer
        from api.drill import Drills

        incidents = incident_writer(self.layout, self.config)   # conservation violations' and failed drills' bundles
        drills = Drills(client, parser.served_model_name, incidents)   # the watchdog fire drill
        drills.start()
        conservation = ConservationChecks(client, metrics.ledger, incidents)

        async def shutdown_trigger() -> None:
            self.actors.set_status(self.index, ActorStatus.READY)
            while not self._stopping():
                warm_grammars()
                self.actors.beat(self.index)
                self.actors.set_active_requests(self.index, client.num_active())
                client.publish_routed()
                if client.handles:
                    client.fail_lost()
                conservation.check()
                await asyncio.sleep(self.config.idle_wait_s)

        try:
            await serve(answer_cancelled_requests(app), hconfig, shutdown_trigger=shutdown_trigger)
        finally:
            drills.stop()
            if incidents is not None:
                incidents.close()
            client.stop()
            if tracer is not None:
                tracer.stop()
