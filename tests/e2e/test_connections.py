"""The connection ledger end to end (S15, S16; docs/architecture.md "The connection ledger"): one engine with a short
stall bound, read from outside the API process as tools/inspect does (a read-only attach of the ledger)."""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest

from ipc.ledger import CLOSE_REASONS, row_state
from tests.conftest import cleanup_engine, ledger_fixture, probe_fixture, scrape, start_engine
from bench.engine_process import wait_until

STALL_S = 2.0
# the stopped reader's stream: echo + logprobs of a long prompt for 8 choices, ~5 MB of SSE, more than the kernel's
# socket buffers (tcp_wmem's 4 MiB cap) and the transport's 64 KiB high-water mark hold
PROMPT_TOKENS = 700
TICK_S = 0.5
KEEP_ALIVE_S = 2.0
PING_S = 0.5
PREFILL_DELAY_S = 3.0


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = start_engine(tmp_path_factory.mktemp("conns"), "--http-stall-s", str(STALL_S), "--keep-alive-timeout-s",
                       str(KEEP_ALIVE_S), "--sse-ping-interval-s", str(PING_S),
                       env={"PDSERVE_MONITOR_TICK_S": str(TICK_S),
                            "PDSERVE_FAULTS": f"slow_prefill:seconds={PREFILL_DELAY_S},match=slowp-"})
    yield eng
    cleanup_engine(eng)


probe = probe_fixture()


ledger = ledger_fixture()


def mine(ledger, port: int):
    rows = [r for r in ledger.live_rows() if int(r["peer_port"]) == port]
    return rows[0] if rows else None


def closed(ledger, port: int):
    rows = [r for r in ledger.closed_rows() if int(r["peer_port"]) == port]
    return rows[0] if rows else None


def http_request(path: str, body: dict, request_id: str) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-request-id: {request_id}\r\n"
            f"content-length: {len(data)}\r\n\r\n").encode() + data


def h11_post(body: dict, request_id: str):
    """(an h11 client connection, the bytes of a POST /v1/completions of ``body``)."""
    import h11

    conn = h11.Connection(h11.CLIENT)
    data = json.dumps(body).encode()
    out = conn.send(h11.Request(method="POST", target="/v1/completions",
                                headers=[("host", "x"), ("content-type", "application/json"),
                                         ("x-request-id", request_id), ("content-length", str(len(data)))]))
    return conn, out + conn.send(h11.Data(data=data)) + conn.send(h11.EndOfMessage())


def h11_body(conn, sock) -> bytes:
    """The whole (de-chunked) response body read from ``sock``."""
    import h11

    body = b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            part = sock.recv(1 << 20)
            assert part, "the server closed the connection before the response ended"
            conn.receive_data(part)
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return body


def sse_tokens(body: bytes) -> tuple[int, dict]:
    """(log-probability entries over every choice's chunks, the usage chunk's usage) of a completions stream."""
    text = body.decode()
    assert text.endswith("data: [DONE]\n\n")
    events = [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: {")]
    tokens = sum(len(c["logprobs"]["tokens"]) for e in events for c in e["choices"] if c.get("logprobs"))
    return tokens, events[-1]["usage"]


def test_s15_a_client_that_stops_reading_is_named_write_blocked_others_are_served_and_it_resumes_whole(
        engine, ledger):
    rid = "s15-stopped-reader"
    body = {"prompt": [1000] * PROMPT_TOKENS, "echo": True, "max_tokens": 200, "n": 8, "ignore_eos": True,
            "stream": True, "logprobs": 20, "stream_options": {"include_usage": True}}
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", engine.port))
    try:
        port = sock.getsockname()[1]
        client, request = h11_post(body, rid)
        sock.sendall(request)
        row = wait_until(lambda: (r := mine(ledger, port)) is not None and r["blocked_since_ns"] and r, 120, 0.05,
                         "the stream to block on the client")
        blocked_at = time.monotonic_ns()
        assert row_state(row, blocked_at) == "write-blocked" and row["socket_buffered_bytes"] > 0
        assert rid.encode() in list(row["req_id"])
        # named by the monitor within the bound + 1 tick (+ slack for a loaded machine): flag, log line, metric
        flagged = wait_until(lambda: (r := mine(ledger, port)) is not None and r["flag_reasons"] & 2 and r,
                             STALL_S + TICK_S + 3, 0.05, "the write_blocked flag")
        assert (time.monotonic_ns() - int(flagged["blocked_since_ns"])) / 1e9 < STALL_S + TICK_S + 3
        wait_until(lambda: f"http write_blocked: connection {int(row['conn_id'])}" in engine.log_text()
                   and rid in engine.log_text(), 5, 0.1, "the log line naming the connection and request")
        with httpx.Client(base_url=engine.base_url, timeout=60) as other:   # others are served meanwhile
            answer = other.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4})
            assert answer.status_code == 200
            assert scrape(engine.base_url)['pdserve_http_problems_total{reason=write_blocked}'] >= 1
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)   # resume at full speed, not 4 KiB a window
        sock.settimeout(120)
        tokens, usage = sse_tokens(h11_body(client, sock))
        assert usage["completion_tokens"] == 8 * 200
        assert tokens == 8 * (PROMPT_TOKENS + 200)   # nothing lost: every echoed and generated token's entry
        wait_until(lambda: not mine(ledger, port)["blocked_since_ns"], 10, 0.05, "the block to clear")
    finally:
        sock.close()


def test_s16_a_response_the_engine_finished_while_the_api_is_stopped_is_named_and_completes_after_sigcont(
        engine, ledger, probe):
    rid = "s16-done-not-written"
    api_pid = probe.pid("api")
    result = {}

    def send() -> None:
        with httpx.Client(base_url=engine.base_url, timeout=120) as client:
            result["response"] = client.post("/v1/completions", headers={"x-request-id": rid},
                                             json={"prompt": "Count: 1 2 3", "max_tokens": 48,
                                                   "ignore_eos": True})

    thread = threading.Thread(target=send)
    thread.start()
    stopped = False
    try:
        def decoding():
            rows = probe.rows_with_id(rid)
            return rows and rows[0]["state"].name == "DECODING"
        wait_until(decoding, 60, 0.01, "the request to be decoding")
        os.kill(api_pid, signal.SIGSTOP)
        stopped = True
        wait_until(lambda: (rows := probe.rows_with_id(rid)) and rows[0]["state"].name == "FINISHED", 60, 0.05,
                   "the engine to finish the request")
        finished_at = time.monotonic()

        def named():
            for r in ledger.live_rows():   # read with the API stopped
                if rid.encode() in list(r["req_id"]) and r["flag_reasons"] & 1:
                    return r
            return None
        row = wait_until(named, STALL_S + TICK_S + 5, 0.05, "the done_not_written flag")
        assert time.monotonic() - finished_at < STALL_S + TICK_S + 5
        assert f"http done_not_written: request {rid}" in engine.log_text()
        assert f"connection {int(row['conn_id'])}" in engine.log_text()
    finally:
        if stopped:
            os.kill(api_pid, signal.SIGCONT)
        thread.join(120)
    assert result["response"].status_code == 200
    assert result["response"].json()["usage"]["completion_tokens"] == 48
    assert scrape(engine.base_url)["pdserve_http_problems_total{reason=done_not_written}"] >= 1


def test_a_list_of_prompts_is_watched_on_its_last_running_prompt_and_never_named_done_not_written(
        engine, ledger, probe):
    """Two prompts in one request end at different times: once the short one's row is final, the ledger names the
    long one's row (api/http_edges.note_engine_requests), so done_not_written does not fire while the long prompt
    still prefills (it fired STALL_S after the short one finished when the ledger named the first row only)."""
    rid = "list-watch-last-running"
    metric = "pdserve_http_problems_total{reason=done_not_written}"
    before = scrape(engine.base_url).get(metric, 0)
    result = {}

    def send() -> None:
        with httpx.Client(base_url=engine.base_url, timeout=180) as client:
            result["response"] = client.post("/v1/completions", headers={"x-request-id": rid},
                                             json={"prompt": [[1000] * 8, [1000] * 3000], "max_tokens": 2,
                                                   "ignore_eos": True})

    thread = threading.Thread(target=send)
    thread.start()
    try:
        def short_done_long_live():
            rows = probe.rows_with_id(rid)
            states = sorted((r["state"].name, r["slot"]) for r in rows)
            final = [slot for state, slot in states if state == "FINISHED"]
            live = [slot for state, slot in states if state in ("QUEUED", "PREFILLING", "BOOTSTRAP", "TRANSFERRING",
                                                                 "DECODE_WAITING", "DECODING")]
            return len(rows) == 2 and len(final) == 1 and len(live) == 1 and (final[0], live[0])
        short_slot, long_slot = wait_until(short_done_long_live, 60, 0.01, "the short prompt to finish first")
        waited_from = time.monotonic()
        while time.monotonic() - waited_from < STALL_S + 3 * TICK_S:   # past the bound, the long prompt still live
            row = mine_by_id(ledger, rid)
            assert row is not None and not row["flag_reasons"] & 1, "named done_not_written"
            time.sleep(TICK_S / 5)
        assert [r["state"].name for r in probe.rows_with_id(rid) if r["slot"] == long_slot] != ["FINISHED"], \
            "the long prompt finished too soon to show anything; make it longer"
        assert long_slot in [int(s) for s in row["req_slot"]]
    finally:
        thread.join(180)
    assert result["response"].status_code == 200, result["response"].text
    assert len(result["response"].json()["choices"]) == 2
    assert f"http done_not_written: request {rid}" not in engine.log_text()
    assert scrape(engine.base_url).get(metric, 0) == before


def mine_by_id(ledger, request_id: str):
    rows = [r for r in ledger.live_rows() if request_id.encode() in list(r["req_id"])]
    return rows[0] if rows else None


def test_a_silent_prefill_stream_gets_sse_pings_before_its_first_token(engine):
    started = time.monotonic()
    lines, first_data_s = [], None
    with httpx.Client(base_url=engine.base_url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", headers={"x-request-id": "slowp-pinged"},
                           json={"prompt": "Hello", "max_tokens": 2, "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and first_data_s is None:
                    first_data_s = time.monotonic() - started
                if line:
                    lines.append(line)
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data: "))
    assert lines[:first_data].count(": ping") >= int(PREFILL_DELAY_S / PING_S) - 2, \
        f"first data line after {first_data_s:.2f} s (slow_prefill {PREFILL_DELAY_S} s): {lines[:first_data + 1]}"
    assert lines[-1] == "data: [DONE]"


@pytest.mark.parametrize("offset_s", [-0.05, 0.05])
def test_http1_reuse_at_the_idle_edge_is_answered_or_cleanly_closed_never_reset(engine, ledger, offset_s):
    body = {"prompt": "Hi", "max_tokens": 1}
    with socket.create_connection(("127.0.0.1", engine.port)) as sock:
        port = sock.getsockname()[1]
        sock.sendall(http_request("/v1/completions", body, "edge-1"))
        first = b""
        while b'"usage"' not in first:
            first += sock.recv(65536)
        time.sleep(KEEP_ALIVE_S + offset_s)   # the scenario itself: a pool reusing the connection at the edge
        sock.settimeout(10)
        try:
            sock.sendall(http_request("/v1/completions", body, "edge-2"))
            second = b""
            while b'"usage"' not in second:
                part = sock.recv(65536)
                if not part:
                    break
                second += part
        except ConnectionResetError:
            pytest.fail("a reset under a request at the idle edge")
        assert second == b"" or second.startswith(b"HTTP/1.1 200"), second[:200]
    row = wait_until(lambda: closed(ledger, port), KEEP_ALIVE_S + 10, 0.05, "the closed row")
    who = CLOSE_REASONS[int(row["close_reason"])]
    if second:
        assert who in ("client_fin", "idle_close")
    else:   # the server closed first, and the ledger says so
        assert who == "idle_close" and row["late_bytes_in"] > 0


def _h2_exchange(client, sock, stream_id: int, request_id: str) -> tuple[bool, int | None]:
    """Send one request on ``stream_id``; returns (its response ended, the last_stream_id of a GOAWAY received)."""
    import h2.events

    body = json.dumps({"prompt": "Hi", "max_tokens": 1}).encode()
    client.send_headers(stream_id, [(":method", "POST"), (":path", "/v1/completions"), (":scheme", "http"),
                                    (":authority", "x"), ("content-type", "application/json"),
                                    ("x-request-id", request_id)])
    client.send_data(stream_id, body, end_stream=True)
    sock.sendall(client.data_to_send())
    goaway = None
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            if goaway is None:
                raise
            return False, goaway   # the reset came after the GOAWAY that refused the stream: clean
        if not data:
            return False, goaway
        for event in client.receive_data(data):
            if isinstance(event, h2.events.StreamEnded) and event.stream_id == stream_id:
                return True, goaway
            if isinstance(event, h2.events.StreamReset) and event.stream_id == stream_id:
                pytest.fail(f"stream {stream_id} reset ({event.error_code!r}) at the idle edge")
            if isinstance(event, h2.events.ConnectionTerminated):
                goaway = event.last_stream_id
                if goaway < stream_id:
                    return False, goaway   # refused: the client retries it on a new connection
        sock.sendall(client.data_to_send())


@pytest.mark.parametrize("offset_s", [-0.05, 0.05])
def test_http2_reuse_at_the_idle_edge_is_answered_or_refused_by_goaway_never_reset(engine, ledger, offset_s):
    import h2.config
    import h2.connection

    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    with socket.create_connection(("127.0.0.1", engine.port)) as sock:
        port = sock.getsockname()[1]
        sock.sendall(client.data_to_send())
        assert _h2_exchange(client, sock, 1, "edge-h2-1") == (True, None)
        time.sleep(KEEP_ALIVE_S + offset_s)   # the scenario itself: a pool reusing the connection at the edge
        sock.settimeout(10)
        try:
            answered, goaway = _h2_exchange(client, sock, 3, "edge-h2-2")
        except ConnectionResetError:
            pytest.fail("a reset under a request at the idle edge, before any GOAWAY")
        assert answered or (goaway is not None and goaway < 3)   # refused by GOAWAY: safe to retry
    row = wait_until(lambda: closed(ledger, port), KEEP_ALIVE_S + 10, 0.05, "the closed row")
    assert row["protocol"] == 2
    who = CLOSE_REASONS[int(row["close_reason"])]
    assert who == ("client_fin" if answered else "idle_close")
    if not answered:
        assert row["goaway_code"] == 0


def test_an_api_process_killed_with_a_request_in_progress_restarts_and_closes_the_rows_it_left(engine, ledger, probe):
    """Last in the module: it restarts the API. The new API process closes the dead one's ledger rows (reason
    error): none stays taken, shown by tools/inspect, or named by the monitor for good."""
    api_pid = probe.pid("api")
    with socket.create_connection(("127.0.0.1", engine.port)) as sock:
        port = sock.getsockname()[1]
        sock.sendall(http_request("/v1/completions", {"prompt": "Hello", "max_tokens": 2}, "slowp-orphaned"))
        wait_until(lambda: (r := mine(ledger, port)) is not None and 2 in list(r["req_phase"]), 30, 0.05,
                   "the request to wait on the engine")
        os.kill(api_pid, signal.SIGKILL)
        sock.settimeout(30)
        try:
            assert sock.recv(1 << 16) == b""   # the connection died with its process
        except ConnectionResetError:
            pass
    wait_until(lambda: probe.pid("api") not in (0, api_pid), 30, 0.1, "the API to restart")
    wait_until(lambda: httpx.get(engine.base_url + "/health", timeout=5).status_code == 200, 60, 0.2,
               "the restarted API to answer")
    assert mine(ledger, port) is None
    row = closed(ledger, port)
    assert row is not None and CLOSE_REASONS[int(row["close_reason"])] == "error"
    assert "connection-ledger rows the previous API process left open (reason error)" in engine.log_text()
    # the row the supervisor failed for the dead API waits for the reclaim, counted by no router: no mismatch
    beats = int(probe.actor("monitor")["heartbeat_count"])
    wait_until(lambda: int(probe.actor("monitor")["heartbeat_count"]) >= beats + 6, 30, 0.1, "six monitor ticks")
    assert "router count mismatch" not in engine.log_text()
