"""Small, guarded wrappers around Hypercorn's and h2's connection handling, for the edges where their behaviour
falls short of the RFCs. Each one checks the internals it relies on; if they differ (another Hypercorn or h2
version), it logs a warning and leaves the library's own behaviour in place. Each install is idempotent.

- ``install_idle_close``: the keep-alive idle close (``TCPServer._initiate_server_close``, reached from
  ``TCPServer._idle_timeout`` after ``keep_alive_timeout`` with no request in progress, and at shutdown).
  HTTP/2: Hypercorn 0.17/0.18 closes the TCP connection without GOAWAY (``H2Protocol.handle(Closed())`` never
  calls ``close_connection()``), although RFC 9113 section 9.1 says a server SHOULD send one: the wrapper sends
  GOAWAY(NO_ERROR, last stream id = the highest stream received) first, over h2c and TLS alike.
  HTTP/1.1: Hypercorn closes the socket at once, so a request that crosses the close arrives at a closed
  socket and the kernel answers it with a reset (ECONNRESET for the client, a 502 behind a proxy). The wrapper
  closes in stages (RFC 9112 section 9.6): it stops reading requests, half-closes the write side (FIN), reads
  and discards whatever arrives for up to ``IDLE_CLOSE_LINGER_S`` or until the client closes, then closes; a
  racing request then sees a clean EOF. Over TLS (no TCP half-close under a TLS session) it closes as before.
- ``_install_h2_idle_start``: an h2c connection that sent only its preface starts its idle timer.
- ``_install_eof_close`` (installed with the idle close): a connection whose client closed its end while idle
  closes at once; Hypercorn's keep-alive timer held it in CLOSE-WAIT for ``keep_alive_timeout``.
- ``install_refused_streams``: h2 treats a HEADERS frame over our advertised SETTINGS_MAX_CONCURRENT_STREAMS as a
  connection error (``TooManyStreamsError``, raised before the header block is decoded), so Hypercorn answers
  GOAWAY(PROTOCOL_ERROR) and every stream on the connection dies. RFC 9113 section 5.1.2 makes it a stream
  error: the wrapper lets h2 open the stream (decoding its header block, so HPACK state stays in step) and
  refuses just that one with h2's own ``reset_stream(REFUSED_STREAM)``; the client may retry it.
- ``install_reset_streams``: HTTP/2 rapid reset (CVE-2023-44487). A stream opened and reset by the client in one
  read never reaches the application; one reset later, before its body was read, finds ``http.disconnect`` next
  (nothing admitted); a connection's pending streams are bounded (REFUSED_STREAM past the bound); a burst logs
  one WARNING naming the connection.
- ``KeepAliveConfig``: Hypercorn's config plus a ``Keep-Alive: timeout=N`` header on HTTP/1.1 responses, so
  connection pools and proxies retire idle connections before the server closes them.
- ``answer_cancelled_requests``: a request cancelled by Hypercorn's shutdown before its response started gets
  a 503 OpenAI error instead of a 500 with an empty body.
No Hypercorn or h2 setting does any of this. The GOAWAY, the staged close, the close on EOF, the handling of reset
streams and REFUSED_STREAM belong upstream (Hypercorn's H2Protocol, HTTPStream and TCPServer, h2's stream limit);
no upstream issue or fix was found for Hypercorn 0.18 / h2 4.x. setup.cfg pins both below their next major
versions, and tests/api/test_server.py asserts every wrapper is in place on the installed versions, so an upgrade
that disables one fails a test instead of a log line.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time

log = logging.getLogger("pdserve.api")

_PATCH_MARK = "_pdserve_patch"
IDLE_CLOSE_LINGER_S = 2.0   # how long a half-closed idle HTTP/1.1 connection keeps reading (and discarding)


def _hypercorn_version() -> str:
    try:
        from importlib.metadata import version

        return version("hypercorn")
    except Exception:  # noqa: BLE001 - only for a log line
        return "?"


def _mark(wrapper, original) -> None:
    setattr(wrapper, _PATCH_MARK, True)
    wrapper.__wrapped__ = original


async def _linger_close(server) -> bool:
    """First stages of an HTTP/1.1 close: stop handling requests, send FIN, read and discard until the client
    closes or IDLE_CLOSE_LINGER_S passed. Returns False (nothing done) when the transport cannot half-close."""
    from hypercorn.events import Closed

    transport = server.writer.transport
    if transport.is_closing() or not transport.can_write_eof():
        return False
    client_closed = asyncio.Event()

    async def discard(event) -> None:   # TCPServer._read_data keeps reading; what it reads now goes nowhere
        if isinstance(event, Closed):
            client_closed.set()

    server.protocol.handle = discard   # the connection's ProtocolWrapper, this connection only
    try:
        server.writer.write_eof()
    except (OSError, RuntimeError):
        return True
    try:
        await asyncio.wait_for(client_closed.wait(), IDLE_CLOSE_LINGER_S)
    except asyncio.TimeoutError:
        pass
    return True


def install_idle_close() -> bool:
    """Make Hypercorn's idle close send GOAWAY first on HTTP/2 and close in stages on HTTP/1.1 (module docstring).

    Returns True when the wrapper is in place, False when Hypercorn's internals are not the expected ones (then
    idle connections close as Hypercorn does it). Only the idle / shutdown close goes through
    ``_initiate_server_close``; its timer is stopped while a request is in progress, so a started request is
    never cut by it.
    """
    try:
        import h2.errors
        import h2.exceptions
        from hypercorn.asyncio.tcp_server import TCPServer
        from hypercorn.protocol.h2 import H2Protocol
        from hypercorn.protocol.h11 import H11Protocol
    except ImportError as exc:
        log.warning("idle connections will close as Hypercorn does it: cannot import hypercorn/h2 internals (%s)",
                    exc)
        return False
    original = TCPServer.__dict__.get("_initiate_server_close")
    if getattr(original, _PATCH_MARK, False):
        return True
    expected = (asyncio.iscoroutinefunction(original)
                and asyncio.iscoroutinefunction(getattr(H2Protocol, "_flush", None)))
    if not expected:
        log.warning("idle connections will close as Hypercorn does it: hypercorn %s has no "
                    "TCPServer._initiate_server_close / H2Protocol._flush coroutines", _hypercorn_version())
        return False

    async def _initiate_server_close(self) -> None:
        self._pdserve_closing = True   # _install_eof_close: a client FIN now leaves this close to finish
        protocol = getattr(getattr(self, "protocol", None), "protocol", None)   # ProtocolWrapper.protocol
        _ledger_server_closing(self, isinstance(protocol, H2Protocol))
        if isinstance(protocol, H2Protocol) and not getattr(protocol, "closed", True):
            try:
                # last_stream_id defaults to the highest stream id received: every one of them was answered
                protocol.connection.close_connection(error_code=h2.errors.ErrorCodes.NO_ERROR)
                await protocol._flush()
            except (h2.exceptions.ProtocolError, AttributeError, OSError, RuntimeError) as exc:
                log.debug("no GOAWAY before closing an idle HTTP/2 connection: %r", exc)
        elif isinstance(protocol, H11Protocol) and getattr(protocol, "stream", None) is None:
            try:
                await _linger_close(self)
            except (AttributeError, OSError, RuntimeError) as exc:
                log.debug("no staged close of an idle HTTP/1.1 connection: %r", exc)
        await original(self)

    _mark(_initiate_server_close, original)
    TCPServer._initiate_server_close = _initiate_server_close
    _install_h2_idle_start(H2Protocol)
    _install_eof_close(TCPServer)
    return True


def _install_eof_close(TCPServer) -> None:
    """Close a connection at once when its client closes its end (TCP FIN, TLS close) while it is idle.

    Hypercorn 0.18's asyncio ``TCPServer.run`` (trio's has the same shape) reads until EOF (``_read_data``), hands
    the protocol ``Closed()``, then leaves its task group, whose exit waits for every task in it, the keep-alive
    timer too; the socket is closed only after that. On an idle connection the timer is running (it stops only
    while a request is in progress) and nothing stops it on EOF: H11Protocol ignores ``Closed()`` without a
    request, H2Protocol just ends its sender. So a connection the client closed sat in CLOSE-WAIT for
    ``keep_alive_timeout`` (issue 39: 50 such sockets, the ledger listing them idle and open). After
    ``_read_data`` returns the wrapper stops the timer, and a timer started later (an HTTP/2 stream that ends after
    the EOF reports the connection idle again) returns at once; ``run`` then closes the socket as soon as the
    requests still running end (Hypercorn already told each one ``http.disconnect``).
    """
    read_data, idle_timeout = TCPServer.__dict__.get("_read_data"), TCPServer.__dict__.get("_idle_timeout")
    if getattr(read_data, _PATCH_MARK, False):
        return
    if not (asyncio.iscoroutinefunction(read_data) and asyncio.iscoroutinefunction(idle_timeout)):
        log.warning("connections closed by the client while idle stay open for keep_alive_timeout: hypercorn %s "
                    "has no TCPServer._read_data / _idle_timeout coroutines", _hypercorn_version())
        return

    async def _read_data(self) -> None:
        try:
            await read_data(self)
        finally:
            self._pdserve_read_closed = True
            if not getattr(self, "_pdserve_closing", False):   # the idle close under way ends by itself
                await self.idle_task.stop()

    async def _idle_timeout(self) -> None:
        if not getattr(self, "_pdserve_read_closed", False):
            await idle_timeout(self)

    for name, wrapper, original in (("_read_data", _read_data, read_data),
                                    ("_idle_timeout", _idle_timeout, idle_timeout)):
        _mark(wrapper, original)
        setattr(TCPServer, name, wrapper)


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

    _mark(initiate, original)
    H2Protocol.initiate = initiate


class _StreamLimitLifted:
    """``H2Connection.local_settings`` as seen by one call of ``_receive_headers_frame``: every setting as it is,
    except no limit on concurrent streams (so h2 opens the stream and decodes its header block)."""

    max_concurrent_streams = 2**31 - 1

    def __init__(self, settings):
        self._settings = settings

    def __getattr__(self, name):
        return getattr(self._settings, name)


def install_refused_streams() -> bool:
    """Refuse a stream over our SETTINGS_MAX_CONCURRENT_STREAMS with RST_STREAM(REFUSED_STREAM) instead of
    tearing the connection down with GOAWAY(PROTOCOL_ERROR) (module docstring). Returns True when in place.

    Wraps ``H2Connection._receive_headers_frame``: when h2 raises ``TooManyStreamsError`` (its first check,
    before any state changes), the frame is processed again with the stream limit lifted for that one call, so
    the stream is opened and its header block decoded as usual, then reset with h2's public ``reset_stream``,
    and the frame's events for that stream are dropped (the application never sees it). Later frames the client
    sent on it (its body) are answered by h2's handling of frames on a stream it reset.
    """
    try:
        import h2.connection
        import h2.errors
        import h2.exceptions
    except ImportError as exc:
        log.warning("HTTP/2 streams over the limit will close the connection: cannot import h2 (%s)", exc)
        return False
    H2Connection = h2.connection.H2Connection
    original = H2Connection.__dict__.get("_receive_headers_frame")
    if getattr(original, _PATCH_MARK, False):
        return True
    if original is None or not hasattr(h2.exceptions, "TooManyStreamsError") or \
            not callable(getattr(H2Connection, "reset_stream", None)):
        log.warning("HTTP/2 streams over the limit will close the connection: h2 has no "
                    "H2Connection._receive_headers_frame / reset_stream / TooManyStreamsError")
        return False
    too_many = h2.exceptions.TooManyStreamsError
    refused = h2.errors.ErrorCodes.REFUSED_STREAM

    def _receive_headers_frame(self, frame):
        try:
            return original(self, frame)
        except too_many:
            pass
        settings = self.local_settings
        self.local_settings = _StreamLimitLifted(settings)
        try:
            frames, events = original(self, frame)
        finally:
            self.local_settings = settings
        self.reset_stream(frame.stream_id, error_code=refused)
        log.info("HTTP/2 stream %d refused (REFUSED_STREAM): over the %d concurrent streams this server allows",
                 frame.stream_id, settings.max_concurrent_streams)
        return frames, [e for e in events if getattr(e, "stream_id", None) != frame.stream_id]

    _mark(_receive_headers_frame, original)
    H2Connection._receive_headers_frame = _receive_headers_frame
    return True


RAPID_RESET_WINDOW_S = 1.0   # the window in which a connection's client resets are counted
RAPID_RESET_WARN = 100       # client resets of unanswered streams within the window that name a rapid-reset burst
PENDING_STREAMS_PER_MAX = 2  # an HTTP/2 connection's pending streams, in h2_max_concurrent_streams, before refusals


class _ResetWatch:
    """One HTTP/2 connection's count of streams its client reset before their answer, per window."""

    __slots__ = ("since", "count", "warned")

    def __init__(self, now: float):
        self.since, self.count, self.warned = now, 0, False


def _note_client_resets(protocol, count: int) -> None:
    """Count ``count`` client resets on ``protocol`` (an H2Protocol); reaching RAPID_RESET_WARN within
    RAPID_RESET_WINDOW_S logs the connection's one WARNING."""
    now = time.monotonic()
    watch = getattr(protocol, "_pdserve_resets", None)
    if watch is None:
        watch = protocol._pdserve_resets = _ResetWatch(now)
    elif now - watch.since > RAPID_RESET_WINDOW_S:
        watch.since, watch.count = now, 0
    watch.count += count
    if watch.count >= RAPID_RESET_WARN and not watch.warned:
        watch.warned = True
        peer = protocol.client or ("?", 0)
        log.warning("HTTP/2 connection from %s:%s reset %d streams within %.3f s before they were answered (a "
                    "rapid-reset burst, CVE-2023-44487); a stream reset in the same read as its request never "
                    "reaches the application; logged once per connection", peer[0], peer[1], watch.count,
                    now - watch.since)


def _drop_and_refuse(protocol, events: list, opened: list[int], resets: set[int]) -> list:
    """The events of one read on ``protocol`` (an H2Protocol) less the streams opened and reset in it and the new
    streams past PENDING_STREAMS_PER_MAX x ``h2_max_concurrent_streams`` pending ones, which are refused with
    RST_STREAM(REFUSED_STREAM); a dropped stream's DATA is still credited to the connection's window."""
    import h2.errors
    import h2.events
    import h2.exceptions

    data_event, refused = h2.events.DataReceived, h2.errors.ErrorCodes.REFUSED_STREAM
    dropped = resets.intersection(opened)   # opened and reset in this read: nobody to answer
    limit = PENDING_STREAMS_PER_MAX * protocol.config.h2_max_concurrent_streams
    pending, refusing = len(protocol.stream_buffers), []
    for stream_id in opened:
        if stream_id in dropped:
            continue
        if pending >= limit:
            refusing.append(stream_id)
        else:
            pending += 1
    if dropped or refusing:
        skip = dropped.union(refusing)
        kept = []
        for event in events:
            stream_id = getattr(event, "stream_id", None)
            if stream_id not in skip:
                kept.append(event)
            elif isinstance(event, data_event):   # credit the connection's window (the stream's is gone)
                protocol.connection.acknowledge_received_data(event.flow_controlled_length, stream_id)
        events = kept
        for stream_id in refusing:
            try:
                protocol.connection.reset_stream(stream_id, error_code=refused)
            except h2.exceptions.ProtocolError:   # closed meanwhile
                pass
        if refusing:
            log.info("HTTP/2 connection from %s: %d streams refused (REFUSED_STREAM): %d streams of it "
                     "are still pending", protocol.client, len(refusing), pending)
        protocol.keep_alive_requests += len(skip)
        if protocol.keep_alive_requests > protocol.config.keep_alive_max_requests:   # as Hypercorn does it
            protocol.connection.close_connection()
    return events


def install_reset_streams() -> bool:
    """HTTP/2 streams the client resets cost no admission, a connection's pending streams are bounded, and a
    rapid-reset burst logs one WARNING naming its connection. Returns True when both wrappers are in place.

    A rapid-reset client (CVE-2023-44487) sends HEADERS, DATA and RST_STREAM together, over and over. Hypercorn 0.18
    makes each such stream an application task; the task read the whole body, admitted the request into the engine
    and only then met the disconnect (issue 39: 2,000 such streams in 0.6 s kept admission full and 681 other
    requests got 503). And a stream leaves Hypercorn's priority tree only once its task ended and its sender caught
    up, so a burst that outruns them fills the tree's 1,000 entries: ``priority.TooManyStreamsError`` escapes
    ``H2Protocol._create_stream`` and ends the connection's task group, leaving a task stuck in its response's
    drain. Two wrappers:

    - ``H2Protocol._handle_events`` (the events of one read): a stream the client opened and reset within the same
      read is dropped before Hypercorn sees it (its DATA still credited to the connection's flow-control window,
      and counted against ``keep_alive_max_requests`` like any request); a new stream while the connection has
      PENDING_STREAMS_PER_MAX x ``h2_max_concurrent_streams`` streams whose task has not ended is refused with
      RST_STREAM(REFUSED_STREAM) (RFC 9113 section 8.7: the client may retry it), which keeps the tree far below
      its limit and bounds what one connection can ask of admission. The client's resets of open streams are
      counted per connection; the RAPID_RESET_WARNth within RAPID_RESET_WINDOW_S logs the WARNING, once per
      connection.
    - ``HTTPStream.handle(StreamClosed)``: a stream reset in a later read, before its task read the body, drops
      the body messages still unread, so the task's next ``receive()`` is ``http.disconnect`` and the route
      answers 499 with nothing admitted (api/exchange.py). A stream reset after its body was read is admitted and
      then aborted by its disconnect watch, as before.
    """
    try:
        import h2.errors
        import h2.events
        import h2.exceptions
        from hypercorn.protocol.events import StreamClosed
        from hypercorn.protocol.h2 import H2Protocol
        from hypercorn.protocol.http_stream import HTTPStream
    except ImportError as exc:
        log.warning("HTTP/2 streams reset by the client may still be admitted: cannot import hypercorn/h2 "
                    "internals (%s)", exc)
        return False
    handle, handle_events = HTTPStream.__dict__.get("handle"), H2Protocol.__dict__.get("_handle_events")
    if _wrapped_by(handle, "reset_streams"):
        return True
    if not (asyncio.iscoroutinefunction(handle) and asyncio.iscoroutinefunction(handle_events)):
        log.warning("HTTP/2 streams reset by the client may still be admitted: hypercorn %s has no "
                    "HTTPStream.handle / H2Protocol._handle_events coroutines", _hypercorn_version())
        return False
    opened_event, reset_event = h2.events.RequestReceived, h2.events.StreamReset

    async def handle_events_filtered(self, events) -> None:
        opened = [e.stream_id for e in events if isinstance(e, opened_event)]
        resets = {e.stream_id for e in events if isinstance(e, reset_event) and e.remote_reset}
        if resets:
            _note_client_resets(self, sum(1 for i in resets if i in self.streams or i in opened))
        if opened:
            events = _drop_and_refuse(self, events, opened, resets)
        await handle_events(self, events)

    async def handle_closing(self, event) -> None:
        if isinstance(event, StreamClosed) and not self.closed:
            queue = getattr(getattr(self, "app_put", None), "__self__", None)   # app_put is app_queue.put
            if isinstance(queue, asyncio.Queue):
                while not queue.empty():
                    queue.get_nowait()
        await handle(self, event)

    for cls, name, wrapper, original in ((HTTPStream, "handle", handle_closing, handle),
                                         (H2Protocol, "_handle_events", handle_events_filtered, handle_events)):
        _mark(wrapper, original)
        wrapper._pdserve_role = "reset_streams"
        setattr(cls, name, wrapper)
    return True


def _wrapped_by(func, role: str) -> bool:
    """Whether ``func`` or a function it wraps (``__wrapped__``) is a wrapper of ``role``."""
    while func is not None:
        if getattr(func, "_pdserve_role", None) == role:
            return True
        func = getattr(func, "__wrapped__", None)
    return False


def keep_alive_header_value(keep_alive_timeout_s: float) -> bytes | None:
    """``timeout=N`` for a ``Keep-Alive`` response header: whole seconds the server keeps an idle connection
    (rounded down, so a client that trusts it never reuses a connection the server is closing); None below 1 s."""
    seconds = math.floor(keep_alive_timeout_s)
    return f"timeout={seconds}".encode() if seconds >= 1 else None


def keep_alive_config(keep_alive_timeout_s: float):
    """A Hypercorn ``Config`` with ``keep_alive_timeout`` set and, on HTTP/1.1 responses only (the header is
    connection-specific and forbidden in HTTP/2), ``Keep-Alive: timeout=N``."""
    from hypercorn.config import Config

    value = keep_alive_header_value(keep_alive_timeout_s)

    class KeepAliveConfig(Config):
        def response_headers(self, protocol: str) -> list[tuple[bytes, bytes]]:
            headers = super().response_headers(protocol)
            if protocol == "h11" and value is not None:
                headers.append((b"keep-alive", value))
            return headers

    config = KeepAliveConfig()
    config.keep_alive_timeout = keep_alive_timeout_s
    return config


def answer_cancelled_requests(app):
    """ASGI wrapper: a request whose task is cancelled before its response started gets a 503 OpenAI error with
    ``Retry-After`` instead of Hypercorn's 500 with an empty body.

    Hypercorn cancels the tasks still running ``graceful_timeout`` after its shutdown began (``worker_serve``);
    a task that dies of that before sending ``http.response.start`` is answered by ``HTTPStream.app_send(None)``
    with a bare 500. At that point the engine is stopping, so the honest answer is "retry elsewhere". A response
    already started (a stream) cannot be changed; the drain before the shutdown gives those their error event.
    """
    import orjson

    from api.protocol import error_body
    from pdserve.errors import EngineOverloadedError

    async def wrapped(scope, receive, send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        started = False

        async def tracking_send(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            if not started:
                body = orjson.dumps(error_body(EngineOverloadedError(
                    "the server is shutting down; retry on another replica")))
                try:
                    await send({"type": "http.response.start", "status": 503,
                                "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                                            (b"content-length", str(len(body)).encode())]})
                    await send({"type": "http.response.body", "body": body})
                except Exception as exc:  # noqa: BLE001 - the connection is going away too: nothing more to do
                    log.debug("could not answer a cancelled request: %r", exc)
            raise

    return wrapped


def ignore_cancelled_connection_callbacks(loop) -> None:
    """Install a loop exception handler that drops the CancelledError raised by asyncio's stream-reader callback
    when the server stops with a connection task still open (CPython gh-113538, fixed after 3.11.7: the callback
    calls ``task.exception()`` on a cancelled task and the loop logs a traceback for nothing). Every other error
    goes to the loop's default handler."""
    def handler(loop, context) -> None:
        if isinstance(context.get("exception"), asyncio.CancelledError):
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


# --------------------------------------------------------------------------------------------------------
# the connection ledger (ipc/ledger.py): what each connection is doing, written from Hypercorn's edges

_LEDGER = None          # the API process's ConnectionLedger once install_connection_ledger ran
_BY_PEER: dict = {}     # (peer host, peer port) -> _LedgerConn: how an ASGI scope finds its connection
_SERVER_FIRST = ("idle_close", "drain", "server_close")   # close reasons where the server acted first


class _LedgerConn:
    """One connection's ledger row, from the API process's side: who acted first at the end, writes waiting."""

    __slots__ = ("ledger", "index", "key", "first", "server_reason", "goaway_code", "blocked", "protocol_known",
                 "conn_id", "in_flight")

    def __init__(self, ledger, index: int, key):
        self.ledger, self.index, self.key = ledger, index, key
        self.conn_id = int(ledger.rows["conn_id"][index])
        self.in_flight: dict = {}   # _RequestEntry -> its request id: the HTTP requests in progress on it
        self.first = ""             # the first close event seen: a CLOSE_REASONS name
        self.server_reason = ""
        self.goaway_code = -1
        self.blocked = 0            # writes waiting now (HTTP/2: one per stream)
        self.protocol_known = False

    def saw(self, reason: str) -> None:
        if not self.first:
            self.first = reason

    def server_closing(self, reason: str, goaway_code: int = -1) -> None:
        if self.index >= 0:
            self.saw(reason)
            self.ledger.note_server_close(self.index, time.monotonic_ns(), self.first, goaway_code)

    def block(self, socket_bytes: int = -1, flow_bytes: int = -1) -> None:
        self.blocked += 1
        if self.blocked == 1 and self.index >= 0:
            self.ledger.note_blocked(self.index, time.monotonic_ns(), socket_bytes, flow_bytes)

    def unblock(self, socket_bytes: int = -1, flow_bytes: int = -1) -> None:
        self.blocked -= 1
        if self.index >= 0:
            since = 0 if self.blocked <= 0 else int(self.ledger.rows["blocked_since_ns"][self.index])
            self.ledger.note_blocked(self.index, since, socket_bytes, flow_bytes)


class _LedgerReader:
    """The connection's StreamReader, counting what arrives and telling a client FIN from a reset."""

    def __init__(self, reader, conn: _LedgerConn):
        self._reader, self._conn = reader, conn

    def __getattr__(self, name):
        return getattr(self._reader, name)

    def at_eof(self) -> bool:
        return self._reader.at_eof()

    async def read(self, n: int = -1) -> bytes:
        conn = self._conn
        try:
            data = await self._reader.read(n)
        except ConnectionResetError:
            conn.saw("client_rst")
            raise
        except OSError:
            conn.saw("error")
            raise
        if conn.index >= 0:
            if data:
                conn.ledger.note_in(conn.index, len(data), time.monotonic_ns(), late=conn.first in _SERVER_FIRST)
            else:
                conn.saw("client_fin")
        return data


class _LedgerWriter:
    """The connection's StreamWriter, counting what is written and marking a drain that has to wait."""

    def __init__(self, writer, conn: _LedgerConn):
        self._writer, self._conn = writer, conn

    def __getattr__(self, name):
        return getattr(self._writer, name)

    def _buffered(self) -> int:
        try:
            return self._writer.transport.get_write_buffer_size()
        except (AttributeError, RuntimeError):
            return 0

    def write(self, data) -> None:
        self._writer.write(data)
        conn = self._conn
        if conn.index >= 0:
            conn.ledger.note_out(conn.index, len(data), self._buffered(), time.monotonic_ns())

    async def drain(self) -> None:
        try:
            high = self._writer.transport.get_write_buffer_limits()[1]
        except (AttributeError, RuntimeError):
            high = None
        size = self._buffered()
        if high is None or size <= high:   # asyncio's drain waits only above the high-water mark
            await self._writer.drain()
            return
        self._conn.block(socket_bytes=size)
        try:
            await self._writer.drain()
        finally:
            self._conn.unblock(socket_bytes=self._buffered())

    def write_eof(self):
        self._server_closes()
        return self._writer.write_eof()

    def close(self):
        self._server_closes()
        return self._writer.close()

    def _server_closes(self) -> None:
        conn = self._conn
        if not conn.first:   # the server acts first: Connection: close, a protocol error, GOAWAY received...
            conn.server_closing(conn.server_reason or "server_close")


def _ledger_conn(server) -> _LedgerConn | None:
    return getattr(server, "_pdserve_conn", None)


def _ledger_server_closing(server, h2: bool) -> None:
    """Called by the idle-close wrapper: the server closes an idle connection (or every one, at shutdown)."""
    conn = _ledger_conn(server)
    if conn is not None:
        conn.server_reason = "drain" if server.context.terminated.is_set() else "idle_close"
        conn.server_closing(conn.server_reason, 0 if h2 else -1)


def install_connection_ledger(ledger) -> bool:
    """Record every connection in ``ledger`` (an ipc.ledger.ConnectionLedger this process writes): wraps
    ``TCPServer.run`` (the row's life; its reader and writer count bytes, tell who closed first, mark a drain that
    waits), ``H2Protocol.stream_send`` (a stream waiting for the client's flow-control window) and
    ``H2Protocol._handle_events`` (a GOAWAY from the client). Requests on a connection are recorded by
    ``record_requests``. Returns True when in place, False (no ledger) with Hypercorn internals it does not know."""
    global _LEDGER
    try:
        import h2.events
        import h2.exceptions
        from hypercorn.asyncio.tcp_server import TCPServer
        from hypercorn.protocol import h2 as hypercorn_h2
        from hypercorn.protocol.events import Body, Data, EndBody, EndData
    except ImportError as exc:
        log.warning("no connection ledger: cannot import hypercorn/h2 internals (%s)", exc)
        return False
    H2Protocol = hypercorn_h2.H2Protocol
    run, stream_send = TCPServer.__dict__.get("run"), H2Protocol.__dict__.get("stream_send")
    handle_events = H2Protocol.__dict__.get("_handle_events")
    _LEDGER = ledger
    if getattr(run, _PATCH_MARK, False):
        return True
    high_water = getattr(hypercorn_h2, "BUFFER_HIGH_WATER", None)
    if not (asyncio.iscoroutinefunction(run) and asyncio.iscoroutinefunction(stream_send)
            and asyncio.iscoroutinefunction(handle_events) and isinstance(high_water, int)):
        log.warning("no connection ledger: hypercorn %s has no TCPServer.run / H2Protocol.stream_send / "
                    "_handle_events coroutines or BUFFER_HIGH_WATER", _hypercorn_version())
        _LEDGER = None
        return False

    wrappers = ((TCPServer, "run", _recorded_run(run), run),
                (H2Protocol, "stream_send", _recorded_stream_send(stream_send, high_water, (Body, Data),
                                                                  (EndBody, EndData), h2.exceptions.ProtocolError),
                 stream_send),
                (H2Protocol, "_handle_events", _recorded_handle_events(handle_events,
                                                                       h2.events.ConnectionTerminated), handle_events))
    for cls, name, wrapper, original in wrappers:
        _mark(wrapper, original)
        setattr(cls, name, wrapper)
    return True


def _recorded_run(run):
    """``TCPServer.run`` with the connection's ledger row around it (its reader and writer wrapped)."""
    async def run_recorded(self) -> None:
        ledger = _LEDGER
        conn = None
        if ledger is not None:
            peer = self.writer.get_extra_info("peername")
            host, port = (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) and len(peer) >= 2 else ("?", 0)
            index = ledger.open(host, port, time.monotonic_ns())
            if index >= 0:
                conn = _LedgerConn(ledger, index, (host, port))
                self._pdserve_conn = conn
                _BY_PEER[conn.key] = conn
                self.reader = _LedgerReader(self.reader, conn)
                self.writer = _LedgerWriter(self.writer, conn)
        try:
            await run(self)
        finally:
            if conn is not None:
                _BY_PEER.pop(conn.key, None)
                index, conn.index = conn.index, -1
                ledger.close_connection(index, conn.first or "error", time.monotonic_ns(), conn.goaway_code)

    return run_recorded


def _recorded_stream_send(stream_send, high_water: int, data_events: tuple, end_events: tuple,
                          protocol_error: type):
    """``H2Protocol.stream_send`` marking the connection write-blocked while a stream's send waits for the client's
    flow-control window (hypercorn's StreamBuffer: a push at BUFFER_HIGH_WATER, an end with data left)."""
    def flow_buffered(protocol) -> int:
        return sum(len(b.buffer) for b in protocol.stream_buffers.values())

    async def stream_send_recorded(self, event) -> None:
        conn = _ledger_conn(getattr(self.send, "__self__", None))
        if conn is None or conn.index < 0:
            await stream_send(self, event)
            return
        buffer = self.stream_buffers.get(getattr(event, "stream_id", None))
        try:
            waits = buffer is not None and (
                (isinstance(event, data_events) and len(buffer.buffer) + len(event.data) >= high_water)
                or (isinstance(event, end_events) and len(buffer.buffer) > 0
                    and self.connection.local_flow_control_window(event.stream_id) <= 0))
        except protocol_error:   # h2 closed the stream (the client reset it): stream_send drops the event itself
            waits = False
        if not waits:
            await stream_send(self, event)
            return
        conn.block(flow_bytes=flow_buffered(self) + len(getattr(event, "data", b"")))
        try:
            await stream_send(self, event)
        finally:
            conn.unblock(flow_bytes=flow_buffered(self))

    return stream_send_recorded


def _recorded_handle_events(handle_events, connection_terminated):
    """``H2Protocol._handle_events`` noting a GOAWAY from the client (its error code)."""
    async def handle_events_recorded(self, events) -> None:
        conn = _ledger_conn(getattr(self.send, "__self__", None))
        if conn is not None:
            for event in events:
                if isinstance(event, connection_terminated):
                    conn.goaway_code = int(event.error_code or 0)
                    conn.saw("client_goaway")
        await handle_events(self, events)

    return handle_events_recorded


def _header_value(scope, names: tuple[bytes, ...]) -> str:
    for key, value in scope.get("headers") or ():
        if key in names:
            return value.decode("latin-1")
    return ""


def in_flight_by_connection() -> dict[int, tuple[int, str, list[str]]]:
    """The API's own count of each recorded connection's HTTP requests in progress: ``{ledger row: (conn_id,
    "host:port", [their request ids])}`` (actors/conservation.find_inflight_mismatches compares it with the
    ledger's ``streams_open``)."""
    return {c.index: (c.conn_id, f"{c.key[0]}:{c.key[1]}", list(c.in_flight.values()))
            for c in list(_BY_PEER.values()) if c.index >= 0}


def record_requests(app, faults=None):
    """ASGI wrapper: each HTTP request in the connection ledger (installed by ``install_connection_ledger``):
    headers received, response started, response ended; the connection's protocol and first Forwarded /
    X-Forwarded-For. A handler that admits engine requests calls ``note_engine_requests``. ``faults``: the API's
    pdserve.faults.FaultPlan (``ledger_count_drift``)."""
    async def wrapped(scope, receive, send) -> None:
        conn = _BY_PEER.get(tuple(scope.get("client") or ())) if scope["type"] == "http" else None
        if conn is None or conn.index < 0:
            await app(scope, receive, send)
            return
        ledger = conn.ledger
        now = time.monotonic_ns()
        if not conn.protocol_known:
            conn.protocol_known = True
            tls = scope.get("scheme") == "https"
            protocol = ("h2" if tls else "h2c") if scope.get("http_version") == "2" else ("h1-tls" if tls else "h1")
            ledger.note_protocol(conn.index, protocol, _header_value(scope, (b"forwarded", b"x-forwarded-for")))
        request_id = _header_value(scope, (b"x-request-id",))
        entry = _RequestEntry(conn, ledger.request_start(conn.index, request_id, now), request_id)
        scope["pdserve.ledger"] = entry
        if faults and faults.fires("ledger_count_drift", request_id):   # fault injection: a start recorded twice
            ledger.request_start(conn.index, request_id, now)

        async def recording_send(message) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                entry.responding(_header_value(message, (b"x-request-id",)))
            await send(message)
            if kind == "http.response.body" and not message.get("more_body", False):
                entry.end(served=True)

        try:
            await app(scope, receive, recording_send)
        finally:
            entry.end(served=False)

    return wrapped


class _RequestEntry:
    __slots__ = ("conn", "index", "entry", "ended")

    def __init__(self, conn: _LedgerConn, entry: int, request_id: str = ""):
        self.conn, self.index, self.entry, self.ended = conn, conn.index, entry, False
        conn.in_flight[self] = request_id

    def live(self) -> bool:
        return not self.ended and self.conn.index == self.index and self.index >= 0

    def engine(self, slot: int, generation: int, request_id: str) -> None:
        if not self.ended:
            self.conn.in_flight[self] = request_id
        if self.live() and self.entry >= 0:
            self.conn.ledger.request_engine(self.index, self.entry, slot, generation, request_id,
                                            time.monotonic_ns())

    def rewait(self, slot: int, generation: int, request_id: str) -> None:
        if self.live() and self.entry >= 0:
            self.conn.ledger.request_rewait(self.index, self.entry, slot, generation, request_id)

    def responding(self, request_id: str) -> None:
        if self.live() and self.entry >= 0:
            self.conn.ledger.request_responding(self.index, self.entry, time.monotonic_ns())

    def end(self, served: bool) -> None:
        if self.live():
            self.conn.ledger.request_end(self.index, self.entry, served)
        self.ended = True
        self.conn.in_flight.pop(self, None)


def note_engine_requests(scope, handles) -> None:
    """Tell the connection ledger which engine request (state-table slot and generation) the HTTP request of
    ``scope`` waits on: the first of ``handles``, then, as each one's text ends (``RequestHandle.on_text_end``),
    one whose text has not (the n choices or the prompts of one request end at different times, and the monitor's
    done_not_written reads the named row's end as the response's due time). A no-op without a ledger. Every route
    that submits to the engine calls it right after ``EngineClient.submit``; the request's trace note
    (api/tracing.py), when tracing is on, gets ``handles`` too, and the scope's ``pdserve.handles`` (the arrival
    index's time split, api/middleware.py)."""
    scope.setdefault("pdserve.handles", []).extend(handles)   # api/middleware.py: the request's time split
    entry = scope.get("pdserve.ledger")
    if entry is not None and handles:
        first = handles[0]
        entry.engine(first.slot, first.generation, first.request.request_id)
        if len(handles) > 1:
            running = list(handles)

            def text_ended(handle) -> None:
                at = next((i for i, h in enumerate(running) if h is handle), None)
                if at is not None:
                    del running[at]
                    if at == 0 and running:
                        entry.rewait(running[0].slot, running[0].generation, running[0].request.request_id)

            for handle in handles:
                handle.on_text_end = text_ended
    trace = scope.get("pdserve.trace")   # api/tracing.py: the request's trace is built from these rows
    if trace is not None:
        trace.handles = list(handles)
