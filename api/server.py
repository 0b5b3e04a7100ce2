"""ApiActor: the HTTP process. Hypercorn serves the Starlette app over HTTP/1.1 and cleartext HTTP/2
(h2c with prior knowledge, and the HTTP/1.1 Upgrade) on one port; with ``ssl_certfile``/``ssl_keyfile``,
HTTP/2 over TLS (ALPN h2) and HTTP/1.1 over TLS instead.

The process beats its heartbeat from the asyncio loop, so a wedged event loop shows up as a hung API.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

from actors.base import API_INDEX, Actor, _die_with_parent

log = logging.getLogger("pdserve.api")


class ApiActor(Actor):
    role = "api"

    def __init__(self, layout, index: int = API_INDEX):
        super().__init__(layout, index)

    def child_main(self, stop_event) -> None:
        _die_with_parent()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        logging.basicConfig(level=self.config.log_level.upper(),
                            format=f"%(asctime)s {self.name} %(levelname)s %(message)s")
        from ipc.actor_table import ActorStatus, ActorTable

        self.actors = ActorTable.attach(self.layout.segment("actors"))
        self.actors.set(self.index, pid=os.getpid(), status=ActorStatus.STARTING, started_ns=time.monotonic_ns())
        asyncio.run(self._serve(stop_event))
        self.actors.set(self.index, status=ActorStatus.STOPPED)

    async def _serve(self, stop_event) -> None:
        from hypercorn.asyncio import serve
        from hypercorn.config import Config

        from api.app import build_app
        from api.engine_client import EngineClient
        from api.metrics import EngineMetrics
        from api.protocol import RequestParser
        from gpu.tokenizer import Tokenizer
        from ipc.actor_table import ActorStatus

        tokenizer = Tokenizer.load(self.layout.model_path or None)
        client = EngineClient(self.layout)
        client.start(asyncio.get_running_loop())
        parser = RequestParser(tokenizer, self.layout.served_model_name, self.layout.max_model_len,
                               self.config.default_max_tokens, self.layout.kv_blocks_per_pool,
                               self.config.kv_block_tokens)
        metrics = EngineMetrics(client, self.layout.served_model_name, self.layout.effective_config())
        app = build_app(client, tokenizer, parser, metrics)

        hconfig = Config()
        hconfig.bind = [f"{self.config.host}:{self.config.port}"]
        hconfig.accesslog = None
        hconfig.graceful_timeout = 1.0
        # Idle connections close after keep_alive_timeout_s (HTTP/1.1: close; HTTP/2: GOAWAY); a request that
        # has started is never cut by it. getattr: works with configs that predate these fields.
        hconfig.keep_alive_timeout = float(getattr(self.config, "keep_alive_timeout_s", 5.0) or 5.0)
        certfile = getattr(self.config, "ssl_certfile", "") or ""
        keyfile = getattr(self.config, "ssl_keyfile", "") or ""
        if certfile or keyfile:
            if not (certfile and keyfile):
                raise ValueError("ssl_certfile and ssl_keyfile must be given together")
            hconfig.certfile, hconfig.keyfile = certfile, keyfile
            hconfig.alpn_protocols = ["h2", "http/1.1"]   # HTTP/2 over TLS, HTTP/1.1 for clients without h2
        loop = asyncio.get_running_loop()
        stopping = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stopping.set)

        async def shutdown_trigger() -> None:
            self.actors.set(self.index, status=ActorStatus.READY)
            while not stop_event.is_set() and not stopping.is_set():
                self.actors.beat(self.index)
                client.status.rec["api_active_requests"] = client.num_active()
                try:
                    await asyncio.wait_for(stopping.wait(), timeout=0.1)
                except asyncio.TimeoutError:
                    pass

        try:
            await serve(app, hconfig, shutdown_trigger=shutdown_trigger)
        finally:
            client.stop()
