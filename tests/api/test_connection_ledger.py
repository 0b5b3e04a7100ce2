"""The connection ledger's Hypercorn hooks (api/http_edges.py: install_connection_ledger, record_requests) on a real
Hypercorn server on a free port, serving a small ASGI app, with real sockets and a real ledger segment (no engine:
the e2e tests in tests/e2e/test_connections.py cover the engine's routes)."""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from ipc.ledger import CLOSE_REASONS, ConnectionLedger, row_state
from tests.conftest import free_port, wait_until

KEEP_ALIVE_S = 1.0
CHUNK = b"x" * 65536
CHUNKS = 64   # 4 MiB: far more than the socket buffers hold


async def app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    headers = [(b"content-type", b"text/plain"), (b"x-request-id", b"req-" + scope["path"][1:].encode())]
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for _ in range(CHUNKS):
            await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": headers + [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def served(engine_id):
    """(port, ledger): Hypercorn with the ledger hooks in a thread of this process; the hooks are removed after."""
    from hypercorn.asyncio import serve

    from api import http_edges
    from ipc import naming

    ledger = ConnectionLedger.create(naming.segment_name(engine_id, "conns"), num_live=16, num_closed=16)
    assert http_edges.install_idle_close() and http_edges.install_connection_ledger(ledger)
    port = free_port()
    config = http_edges.keep_alive_config(KEEP_ALIVE_S)
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(serve(http_edges.record_requests(app), config, shutdown_trigger=stop.wait))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: _connectable(port), 20, 0.05, "the test server to listen")
        yield port, ledger
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        http_edges._LEDGER = None   # the class wrappers stay; without a ledger they pass through
        ledger.close()
        ledger.unlink()


def _connectable(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _read_response(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data or not data.endswith(b"ok"):
        part = sock.recv(65536)
        if not part:
            break
        data += part
    return data


def _closed_with(ledger, port: int):
    for row in ledger.closed_rows():
        if int(row["peer_port"]) == port:
            return row
    return None


def test_a_request_and_the_clients_close_are_recorded_with_protocol_bytes_and_forwarded_for(served):
    port, ledger = served
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /small HTTP/1.1\r\nhost: x\r\nx-forwarded-for: 203.0.113.5\r\n\r\n")
        assert _read_response(sock).endswith(b"ok")
        me = sock.getsockname()[1]
        row = wait_until(lambda: [r for r in ledger.live_rows() if int(r["peer_port"]) == me and
                                  r["requests_served"] == 1][0], 10, 0.02, "the response's end in the ledger")
        assert row["protocol"] == 1 and row["forwarded"] == b"203.0.113.5" and row["requests_served"] == 1
        assert row["bytes_in"] > 0 and row["bytes_out"] > 0 and row_state(row, time.monotonic_ns()) == "idle"
    wait_until(lambda: _closed_with(ledger, me) is not None, 10, 0.05, "the closed row")
    assert CLOSE_REASONS[_closed_with(ledger, me)["close_reason"]] == "client_fin"


def test_an_idle_connection_closed_by_the_server_says_so_and_a_client_writing_after_it_is_recorded(served):
    port, ledger = served
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /small HTTP/1.1\r\nhost: x\r\n\r\n")
        assert _read_response(sock).endswith(b"ok")
        me = sock.getsockname()[1]
        sock.settimeout(KEEP_ALIVE_S + 5)
        assert sock.recv(100) == b""   # the server's FIN after keep_alive_timeout_s (the staged close)
        sock.sendall(b"GET /small HTTP/1.1\r\nhost: x\r\n\r\n")   # a pool that reuses it anyway
        wait_until(lambda: _closed_with(ledger, me) is not None, 10, 0.05, "the closed row")
    row = _closed_with(ledger, me)
    assert CLOSE_REASONS[row["close_reason"]] == "idle_close" and row["server_close_ns"] > 0
    assert row["late_bytes_in"] > 0 and row["requests_served"] == 1


def test_a_client_that_stops_reading_is_write_blocked_and_gets_every_byte_when_it_reads_again(served):
    port, ledger = served
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    try:
        me = sock.getsockname()[1]
        sock.sendall(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")

        def blocked():
            rows = [r for r in ledger.live_rows() if int(r["peer_port"]) == me]
            return rows and row_state(rows[0], time.monotonic_ns()) == "write-blocked" and rows[0]
        row = wait_until(blocked, 20, 0.05, "the connection to show write-blocked")
        assert row["socket_buffered_bytes"] > 0 and row["req_id"][0] == b"" and row["req_phase"][0] == 3
        body = b""
        while not body.endswith(b"0\r\n\r\n"):
            body += sock.recv(1 << 20)
        assert body.partition(b"\r\n\r\n")[2].count(b"x") == CHUNKS * len(CHUNK)   # nothing lost
        wait_until(lambda: not [r for r in ledger.live_rows() if int(r["peer_port"]) == me and
                                r["blocked_since_ns"]], 10, 0.05, "the block to clear")
    finally:
        sock.close()


def test_an_http2_stream_the_client_gives_no_window_is_write_blocked_on_flow_control(served):
    import h2.connection
    import h2.events

    port, ledger = served
    client = h2.connection.H2Connection()
    client.initiate_connection()
    client.send_headers(1, [(":method", "GET"), (":path", "/stream"), (":scheme", "http"), (":authority", "x")],
                        end_stream=True)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(client.data_to_send())
        me = sock.getsockname()[1]
        received = 0

        def blocked():
            nonlocal received
            sock.settimeout(0.05)
            try:
                for event in client.receive_data(sock.recv(1 << 16)):
                    if isinstance(event, h2.events.DataReceived):
                        received += len(event.data)   # read, but no WINDOW_UPDATE: the window runs out
            except socket.timeout:
                pass
            rows = [r for r in ledger.live_rows() if int(r["peer_port"]) == me]
            return rows and rows[0]["blocked_since_ns"] and rows[0]
        row = wait_until(blocked, 20, 0, "the stream to show write-blocked")
        assert row["protocol"] == 2 and row["flow_buffered_bytes"] > 0 and row["streams_open"] == 1
        assert received <= 65535
        ended = False
        sock.settimeout(10)
        while not ended:
            for event in client.receive_data(sock.recv(1 << 16)):
                if isinstance(event, h2.events.DataReceived):
                    received += len(event.data)
                    client.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                ended = ended or isinstance(event, h2.events.StreamEnded)
            sock.sendall(client.data_to_send())
        assert received == CHUNKS * len(CHUNK)
        wait_until(lambda: [r for r in ledger.live_rows() if int(r["peer_port"]) == me and not r["blocked_since_ns"]
                            and r["requests_served"] == 1], 10, 0.02, "the stream's end in the ledger")
