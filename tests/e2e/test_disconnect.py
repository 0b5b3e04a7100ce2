"""A client that goes away aborts its request at any stage (queued, prefill, transfer, decode), over HTTP/1.1
(connection closed) and HTTP/2 (RST_STREAM), and both actors free its KV blocks; other streams on the same
HTTP/2 connection are unaffected."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from ipc.state_table import RequestState as S
from tests.conftest import assert_recovered, wait_until
from tests.e2e.conftest import TICK_S

# stage -> (request id prefix that holds the request there, state to wait for, max_tokens)
STAGES = {
    "queued": ("slowq-", S.QUEUED, 4),        # queued behind a request whose prefill is stalled
    "prefill": ("slowp-", S.PREFILLING, 4),   # prefill stalled 1.5 s by an injected fault
    "transfer": ("stuck-", S.TRANSFERRING, 4),  # transfer stays in progress
    "decode": ("long-", S.DECODING, 400),     # a long generation
}


def _in_state(probe, request_id: str, state: int) -> bool:
    return any(r["state"] == state for r in probe.rows_with_id(request_id))


class RawH2:
    """A minimal HTTP/2 (h2c, prior knowledge) client on the `h2` library, so a test can send RST_STREAM on one
    stream exactly when it wants and keep using the same connection."""

    def __init__(self, port: int):
        import socket

        import h2.config
        import h2.connection

        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self.sock.sendall(self.conn.data_to_send())
        self.bodies: dict[int, bytes] = {}
        self.ended: set[int] = set()
        self.status: dict[int, int] = {}

    def post(self, path: str, body: dict, headers: dict | None = None) -> int:
        import orjson

        data = orjson.dumps(body)
        stream_id = self.conn.get_next_available_stream_id()
        self.conn.send_headers(stream_id, [(":method", "POST"), (":path", path), (":scheme", "http"),
                                           (":authority", "127.0.0.1"), ("content-type", "application/json"),
                                           ("content-length", str(len(data))), *(headers or {}).items()])
        self.conn.send_data(stream_id, data, end_stream=True)
        self.sock.sendall(self.conn.data_to_send())
        self.bodies[stream_id] = b""
        return stream_id

    def reset(self, stream_id: int) -> None:
        from h2.errors import ErrorCodes

        self.conn.reset_stream(stream_id, ErrorCodes.CANCEL)
        self.sock.sendall(self.conn.data_to_send())

    def wait_end(self, stream_id: int, timeout_s: float = 60) -> tuple[int, bytes]:
        import h2.events

        deadline = time.monotonic() + timeout_s
        while stream_id not in self.ended:
            self.sock.settimeout(max(deadline - time.monotonic(), 0.01))
            for event in self.conn.receive_data(self.sock.recv(65536)):
                if isinstance(event, h2.events.ResponseReceived):
                    self.status[event.stream_id] = int(dict(event.headers)[b":status"])
                elif isinstance(event, h2.events.DataReceived):
                    self.bodies[event.stream_id] = self.bodies.get(event.stream_id, b"") + event.data
                    self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)):
                    self.ended.add(event.stream_id)
            self.sock.sendall(self.conn.data_to_send())
        return self.status.get(stream_id, 0), self.bodies[stream_id]

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("http2", [False, True], ids=["http1_close", "h2_rst_stream"])
@pytest.mark.parametrize("stage", list(STAGES))
def test_client_gone_at_any_stage_aborts_and_frees_both_sides(fault_engine, fault_probe, stage, http2):
    prefix, state, max_tokens = STAGES[stage]
    request_id = f"{prefix}{stage}-{int(http2)}"
    body = {"prompt": "Tell me everything about the sea.", "max_tokens": max_tokens, "stream": http2,
            "ignore_eos": stage == "decode"}

    def row_final():
        rows = fault_probe.rows_with_id(request_id)
        return not rows or all(r["state"] >= S.FINISHED for r in rows)

    async def run_http1():
        async with httpx.AsyncClient(timeout=60) as client:
            blocker = None
            if stage == "queued":  # occupy the prefill actor so the next request waits in QUEUED
                blocker = asyncio.ensure_future(client.post(fault_engine.base_url + "/v1/completions",
                                                            headers={"X-Request-Id": "slowp-blocker-1"},
                                                            json={"prompt": "block", "max_tokens": 2}))
                await asyncio.to_thread(wait_until, lambda: _in_state(fault_probe, "slowp-blocker-1", S.PREFILLING),
                                        30)
            async with httpx.AsyncClient(timeout=60) as own:  # its own connection, closed below
                request = asyncio.ensure_future(own.post(fault_engine.base_url + "/v1/completions", json=body,
                                                         headers={"X-Request-Id": request_id}))
                await asyncio.to_thread(wait_until, lambda: _in_state(fault_probe, request_id, state), 30, 0.01)
                request.cancel()
            gone_at = time.monotonic()
            await asyncio.to_thread(wait_until, row_final, 5, 0.01, "the row to turn final")
            detected_s = time.monotonic() - gone_at
            if blocker is not None:
                assert (await blocker).status_code == 200
            return detected_s

    def run_h2():
        h2c = RawH2(fault_engine.port)
        try:
            blocker = None
            if stage == "queued":
                blocker = h2c.post("/v1/completions", {"prompt": "block", "max_tokens": 2},
                                   {"x-request-id": "slowp-blocker-2"})
                wait_until(lambda: _in_state(fault_probe, "slowp-blocker-2", S.PREFILLING), 30)
            stream = h2c.post("/v1/completions", body, {"x-request-id": request_id})
            wait_until(lambda: _in_state(fault_probe, request_id, state), 30, 0.01)
            neighbour = h2c.post("/v1/completions", {"prompt": "Neighbour", "max_tokens": 3})
            h2c.reset(stream)  # RST_STREAM on this stream only; the connection stays open
            gone_at = time.monotonic()
            wait_until(row_final, 5, 0.01, "the row to turn final")
            detected_s = time.monotonic() - gone_at
            status, _ = h2c.wait_end(neighbour)
            assert status == 200, "a neighbouring stream on the same connection must be unaffected"
            if blocker is not None:
                assert h2c.wait_end(blocker)[0] == 200
            return detected_s
        finally:
            h2c.close()

    detected_s = run_h2() if http2 else asyncio.run(run_http1())
    assert detected_s <= TICK_S, detected_s
    # blocks free on both sides (a stalled prefill frees once its stall ends)
    wait_until(lambda: all(f == t for f, t in fault_probe.free_blocks().values()), 5, 0.05, "KV blocks freed")
    assert_recovered(fault_engine, fault_probe)


def _ttft(base_url: str, prompt: str) -> float:
    """Time to the first streamed token; the stream is read to its end, so the probe is no client abort (the
    first token is sent at admission, before the second is decoded)."""
    start = time.monotonic()
    first_s = None
    with httpx.stream("POST", base_url + "/v1/completions", timeout=60,
                      json={"prompt": prompt, "max_tokens": 2, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and first_s is None:
                first_s = time.monotonic() - start
    assert first_s is not None, "no token streamed"
    return first_s


def test_s6_cancel_32_long_prompts_before_first_token_then_a_short_one_is_fast(fault_engine, fault_probe):
    import statistics

    from tests.conftest import QUEUE_GAUGES, scrape

    base = fault_engine.base_url
    baseline_s = statistics.median(_ttft(base, "Hi there") for _ in range(3))
    aborted_before = sum(v for k, v in scrape(base).items() if k.startswith("pdserve_requests_total{finish_reason=abort"))
    long_prompt = "The history of the world, told slowly: " + "and then, " * 100

    async def send_and_leave():
        clients = [httpx.AsyncClient(timeout=60) for _ in range(32)]
        try:
            tasks = [asyncio.ensure_future(c.post(base + "/v1/completions", headers={"X-Request-Id": f"s6-{i}"},
                                                  json={"prompt": long_prompt, "max_tokens": 32, "stream": True}))
                     for i, c in enumerate(clients)]
            await asyncio.to_thread(wait_until, lambda: all(fault_probe.rows_with_id(f"s6-{i}") for i in range(32)),
                                    30, 0.01, "all 32 requests admitted")
            for task in tasks:
                task.cancel()  # before any first token: each connection closes
        finally:
            for c in clients:
                await c.aclose()

    asyncio.run(send_and_leave())
    after_s = _ttft(base, "Hi there")
    assert after_s <= 3 * baseline_s + 1.0, (baseline_s, after_s)  # at most one long prefill finishes first

    def settled():
        m = scrape(base)
        aborted = sum(v for k, v in m.items() if k.startswith("pdserve_requests_total{finish_reason=abort"))
        return aborted - aborted_before == 32 and all(m[g] == 0 for g in QUEUE_GAUGES)
    wait_until(settled, 5, 0.05, "32 aborts counted and queues 0")
    assert_recovered(fault_engine, fault_probe)
