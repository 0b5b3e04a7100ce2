"""ApiActor: the HTTP process. Hypercorn serves the Starlette app over HTTP/1.1 and cleartext HTTP/2
(h2c with prior knowledge, and the HTTP/1.1 Upgrade) on one port; with ``ssl_certfile``/``ssl_keyfile``,
HTTP/2 over TLS (ALPN h2) and HTTP/1.1 over TLS instead.

The process beats its heartbeat from the asyncio loop, so a wedged event loop shows up as a hung API.

Idle keep-alive: Hypercorn closes a connection with no request in progress after ``keep_alive_timeout_s``
(HTTP/1.1: an orderly close). For HTTP/2, Hypercorn 0.17/0.18 closes the TCP connection without a GOAWAY frame
(``TCPServer._idle_timeout`` -> ``_initiate_server_close`` -> ``H2Protocol.handle(Closed())``, which never calls
``close_connection()``), although RFC 9113 section 9.1 says a server SHOULD send GOAWAY first so the client knows
which streams were processed. ``install_idle_goaway()`` wraps ``_initiate_server_close`` to send
GOAWAY(NO_ERROR, last stream id = the highest stream the server received) before Hypercorn's own close, for h2c
and TLS/ALPN h2 alike. It checks the internals it relies on and, if they differ, logs a warning and leaves
Hypercorn's behaviour (close without GOAWAY) as it is. No Hypercorn config does this, and no upstream fix was
found for 0.18.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal

from actors.base import API_INDEX, Actor, _die_with_parent

log = logging.getLogger("pdserve.api")

_PATCH_MARK = "_pdserve_idle_goaway"


def install_idle_goaway() -> bool:
    """Make Hypercorn's asyncio worker send GOAWAY(NO_ERROR) before it closes an idle HTTP/2 connection.

    Idempotent (a second call is a no-op). Returns True when the wrapper is in place, False when Hypercorn's
    internals are not the expected ones (then idle HTTP/2 connections are closed without GOAWAY, as before).
    Only the idle / shutdown close goes through ``_initiate_server_close``; its timer is stopped while a
    request is in progress, so a started request is never cut by it.
    """
    try:
        import h2.errors
        import h2.exceptions
        from hypercorn.asyncio.tcp_server import TCPServer
        from hypercorn.protocol.h2 import H2Protocol
    except ImportError as exc:
        log.warning("idle HTTP/2 connections will close without GOAWAY: cannot import hypercorn/h2 internals (%s)",
                    exc)
        return False
    original = TCPServer.__dict__.get("_initiate_server_close")
    if getattr(original, _PATCH_MARK, False):
        return True
    expected = (asyncio.iscoroutinefunction(original)
                and asyncio.iscoroutinefunction(getattr(H2Protocol, "_flush", None)))
    if not expected:
        log.warning("idle HTTP/2 connections will close without GOAWAY: hypercorn %s has no "
                    "TCPServer._initiate_server_close / H2Protocol._flush coroutines", _hypercorn_version())
        return False

    async def _initiate_server_close(self) -> None:
        protocol = getattr(getattr(self, "protocol", None), "protocol", None)   # ProtocolWrapper.protocol
        if isinstance(protocol, H2Protocol) and not getattr(protocol, "closed", True):
            try:
                # last_stream_id defaults to the highest stream id received: every one of them was answered
                protocol.connection.close_connection(error_code=h2.errors.ErrorCodes.NO_ERROR)
                await protocol._flush()
            except (h2.exceptions.ProtocolError, AttributeError, OSError, RuntimeError) as exc:
                log.debug("no GOAWAY before closing an idle HTTP/2 connection: %r", exc)
        await original(self)

    setattr(_initiate_server_close, _PATCH_MARK, True)
    _initiate_server_close.__wrapped__ = original
    TCPServer._initiate_server_close = _initiate_server_close
    _install_h2_idle_start(H2Protocol)
    return True


def _install_h2_idle_start(H2Protocol) -> None:
    """Start the keep-alive timer of an HTTP/2 connection that has no stream yet.

    A prior-knowledge h2c client's preface is first parsed by Hypercorn's HTTP/1.1 protocol as a request (timer
    stopped), then handed to H2Protocol, which restarts the timer only when a stream closes: a client that sends
    the preface and nothing else kept its connection forever. After ``initiate`` an H2Protocol with no stream
    now reports itself idle (``Updated(idle=True)``), so such a connection gets its GOAWAY and close after
    ``keep_alive_timeout_s`` like any other idle one.
    """
    from hypercorn.events import Updated

    original = H2Protocol.__dict__.get("initiate")
    if original is None or getattr(original, _PATCH_MARK, False):
        return

    async def initiate(self, *args, **kwargs) -> None:
        await original(self, *args, **kwargs)
        if not self.streams:
            await self.send(Updated(idle=True))

    setattr(initiate, _PATCH_MARK, True)
    initiate.__wrapped__ = original
    H2Protocol.initiate = initiate


def _hypercorn_version() -> str:
    try:
        from importlib.metadata import version

        return version("hypercorn")
    except Exception:  # noqa: BLE001 - only for a log line
        return "?"


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
        self.actors.starting(self.index, os.getpid())
        asyncio.run(self._serve(stop_event))
        self.actors.set_status(self.index, ActorStatus.STOPPED)

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
        parser = RequestParser(tokenizer, self.layout.served_model_name, self.layout.max_context_tokens,
                               self.config.default_max_tokens, self.layout.kv_blocks_per_pool,
                               self.config.kv_block_tokens)
        metrics = EngineMetrics(client, self.layout.served_model_name, self.layout.effective_config())
        app = build_app(client, tokenizer, parser, metrics)

        hconfig = Config()
        hconfig.bind = [f"{self.config.host}:{self.layout.http_port}"]
        hconfig.accesslog = None
        hconfig.graceful_timeout = 1.0
        # Idle connections close after keep_alive_timeout_s (HTTP/1.1: close; HTTP/2: GOAWAY); a request that
        # has started is never cut by it. getattr: works with configs that predate these fields.
        hconfig.keep_alive_timeout = float(getattr(self.config, "keep_alive_timeout_s", 5.0) or 5.0)
        install_idle_goaway()   # HTTP/2: GOAWAY(NO_ERROR) before the idle close (see the module docstring)
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
            self.actors.set_status(self.index, ActorStatus.READY)
            while not stop_event.is_set() and not stopping.is_set():
                self.actors.beat(self.index)
                self.actors.set_active_requests(self.index, client.num_active())
                client.publish_routed()
                try:
                    await asyncio.wait_for(stopping.wait(), timeout=0.1)
                except asyncio.TimeoutError:
                    pass

        try:
            await serve(app, hconfig, shutdown_trigger=shutdown_trigger)
        finally:
            client.stop()
