"""Scenario S14 (../shared/scenarios.md), the flight recorder after the fact: a request's transfer never completes
and it times out (504 naming its id); 50 more requests reuse every table row; then, with the API process
SIGSTOPped, tools/inspect --request prints its timeline from the recorder: each stage, its age, the deadline that
fired. GET /debug/requests/{id} answers the same timeline; --trace-out writes a Chrome/Perfetto trace.

The engine also exports OpenTelemetry traces (--otlp-traces-endpoint, api/tracing.py) to a real OTLP/HTTP collector
in this module (protobuf decoded with opentelemetry-proto): a completion's trace has its stage spans in order under
the caller's traceparent; a collector that hangs or is down leaves the answers working. The dialect routes record the
API's HTTP events as chat does, and tools/inspect --bundle writes an incident bundle that reads back whole."""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import orjson
import pytest

from tests.conftest import ROOT, cleanup_engine, free_port, probe_fixture, scrape, start_engine, wait_until

try:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                          ExportTraceServiceResponse)
    OTEL = True
except ImportError:   # without the otel extra (make install installs it): the engine runs untraced
    OTEL = False
needs_otel = pytest.mark.skipif(not OTEL, reason="the otel extra is not installed (pip install .[otel])")

INFLIGHT_TIMEOUT_S = 2.0
MAX_QUEUED = 8   # a table of 2 * 8 + 16 = 32 rows: 50 requests reuse every one of them
FAULTS = "transfer_stuck:match=stuck-;router_count_drift:count_delta=1,match=drift-;leak_blocks:match=leak-"


class OtlpCollector:
    """A real OTLP/HTTP trace receiver on ``host``:``port``: each POST's ExportTraceServiceRequest is decoded with
    opentelemetry-proto and its spans kept. ``hang()``: exports are held unanswered until ``answer()``; ``stop()``
    closes the port (connections refused), ``start()`` opens it again. (tests/multinode uses it too.)"""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = free_port()
        self.spans: list = []
        self.lock = threading.Lock()
        self.held = threading.Event()
        self.held.set()
        self.server: ThreadingHTTPServer | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                collector.held.wait(60)
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                with collector.lock:
                    collector.spans += [span for rs in request.resource_spans for ss in rs.scope_spans
                                        for span in ss.spans]
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer((self.host, self.port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.answer()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.thread.join(10)
            self.server = None

    def hang(self) -> None:
        self.held.clear()

    def answer(self) -> None:
        self.held.set()

    def trace(self, trace_id: str) -> list:
        with self.lock:
            return [s for s in self.spans if s.trace_id.hex() == trace_id]

    def request_spans(self, request_id: str) -> list:
        """Every span of the trace(s) whose root names ``request_id``."""
        with self.lock:
            ids = {s.trace_id for s in self.spans if attributes(s).get("gen_ai.request.id") == request_id}
            return [s for s in self.spans if s.trace_id in ids]


def attributes(span) -> dict:
    """A protobuf span's (or event's) attributes as plain values."""
    out = {}
    for kv in span.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = [x.string_value for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)
    return out


@pytest.fixture(scope="module")
def collector():
    c = OtlpCollector()
    if OTEL:
        c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def engine(tmp_path_factory, collector):
    traced = ("--otlp-traces-endpoint", f"http://127.0.0.1:{collector.port}") if OTEL else ()
    incidents = tmp_path_factory.mktemp("incidents")
    eng = start_engine(tmp_path_factory.mktemp("recorder"), "--max-queued-requests", str(MAX_QUEUED), *traced,
                       env={"PDSERVE_FAULTS": FAULTS,
                            "PDSERVE_INFLIGHT_TIMEOUT_S": str(INFLIGHT_TIMEOUT_S), "PDSERVE_MONITOR_TICK_S": "0.5",
                            "PDSERVE_INCIDENT_DIR": str(incidents), "PDSERVE_INCIDENT_MIN_INTERVAL_S": "0"})
    eng.incident_dir = incidents
    yield eng
    cleanup_engine(eng)


probe = probe_fixture("engine")


def inspect(engine, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.inspect", engine.engine_id, *args], cwd=ROOT,
                          capture_output=True, timeout=60)


def test_a_timed_out_requests_timeline_outlives_its_row_and_reads_with_the_api_stopped(engine, probe, tmp_path):
    post = lambda rid: httpx.post(engine.base_url + "/v1/completions", headers={"X-Request-Id": rid},   # noqa: E731
                                  json={"prompt": "Tell me about lighthouses", "max_tokens": 2, "temperature": 0},
                                  timeout=60)
    response = post("stuck-s14")
    assert response.status_code == 504, response.text
    message = response.json()["error"]["message"]
    assert "stuck-s14" in message and "tools/inspect --request stuck-s14" in message
    wait_until(lambda: "tools/inspect --request stuck-s14" in engine.log_text(), 10, 0.1, "the 504's log line")
    for i in range(50):
        assert post(f"after-{i}").status_code == 200
    api_pid = probe.pid("api")
    os.kill(api_pid, signal.SIGSTOP)
    try:
        text = inspect(engine, "--request", "stuck-s14")
        shown = inspect(engine, "--request", "stuck-s14", "--json")
        failed = inspect(engine, "--failed", "--json")
        traced = inspect(engine, "--trace-out", str(tmp_path / "trace.json"))
    finally:
        os.kill(api_pid, signal.SIGCONT)
    assert text.returncode == 0, text.stderr.decode()
    out = text.stdout.decode()
    assert "QUEUED -> PREFILLING -> BOOTSTRAP -> TRANSFERRING -> TIMED_OUT" in out, out
    assert f"inflight_timeout_s={INFLIGHT_TIMEOUT_S:g} s fired after" in out, out
    report = orjson.loads(shown.stdout)
    (timeline,) = report["timelines"]
    assert timeline["path"] == ["QUEUED", "PREFILLING", "BOOTSTRAP", "TRANSFERRING", "TIMED_OUT"]
    transfer = timeline["stages"][3]
    assert transfer["deadline_field"] == "inflight_timeout_s" and transfer["deadline_s"] == INFLIGHT_TIMEOUT_S
    assert INFLIGHT_TIMEOUT_S <= transfer["age_s"] <= INFLIGHT_TIMEOUT_S + 2.0, transfer
    assert timeline["stages"][4]["by"] == "monitor" and timeline["released"]
    assert timeline["timeout"]["stage"] == "transfer" and timeline["timeout"]["deadline_field"] == "inflight_timeout_s"
    assert timeline["timeout"]["age_s"] >= INFLIGHT_TIMEOUT_S
    kinds = [e["kind"] for e in timeline["events"]]
    assert {"http_headers", "admitted", "prefill_chunk", "timeout", "closed", "release"} <= set(kinds), kinds
    assert probe.state.row(timeline["slot"])["generation"] > timeline["generation"]   # its row was reused
    assert any(t["final"] == "TIMED_OUT" and t["key"] == timeline["key"]
               for t in orjson.loads(failed.stdout)["timelines"])
    trace = orjson.loads((tmp_path / "trace.json").read_bytes())
    assert traced.returncode == 0 and any(e.get("name") == "transfer" and e["ph"] == "X" for e in trace["traceEvents"])
    wait_until(lambda: httpx.get(engine.base_url + "/health", timeout=5).status_code == 200, 20,
               message="the API to answer again")
    over_http = httpx.get(engine.base_url + "/debug/requests/stuck-s14", timeout=10)
    assert over_http.status_code == 200
    assert over_http.json()["timelines"][0]["path"] == timeline["path"]
    assert httpx.get(engine.base_url + "/debug/requests/never-sent", timeout=10).status_code == 404


STAGES = ["queued", "prefill", "bootstrap", "transfer", "decode_waiting", "decode"]   # ipc/lifecycle.py's names


def stream_chat(engine, request_id: str, headers: dict | None = None) -> dict:
    """A streamed chat completion; returns its usage (the last chunk's, include_usage)."""
    body = {"messages": [{"role": "user", "content": "Name a lighthouse"}], "max_tokens": 4, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", engine.base_url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"X-Request-Id": request_id, **(headers or {})}) as response:
        assert response.status_code == 200
        chunks = [orjson.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    return chunks[-1]["usage"]


@needs_otel
def test_a_trace_counts_the_output_tokens_of_every_choice(engine, collector):
    """n=2: the root span's gen_ai.usage.output_tokens is the usage's completion_tokens, both choices' tokens (a
    count of the first choice's alone survived the suite before this test)."""
    trace_id = secrets.token_hex(16)
    r = httpx.post(engine.base_url + "/v1/completions", timeout=60,
                   headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"},
                   json={"prompt": "Name a lighthouse", "max_tokens": 4, "temperature": 0, "n": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    spans = wait_until(lambda: len(collector.trace(trace_id)) >= 1 + 2 * len(STAGES) and collector.trace(trace_id),
                       20, 0.1, "both choices' spans at the collector")
    attrs = attributes(min(spans, key=lambda s: s.start_time_unix_nano))
    assert attrs["gen_ai.usage.output_tokens"] == 8 and attrs["gen_ai.request.choice.count"] == 2


@needs_otel
def test_a_completion_is_exported_as_a_trace_of_its_stages_under_the_callers_span(engine, collector):
    trace_id, caller_span = secrets.token_hex(16), secrets.token_hex(8)
    usage = stream_chat(engine, "otel-1", {"traceparent": f"00-{trace_id}-{caller_span}-01"})
    spans = wait_until(lambda: len(collector.trace(trace_id)) >= 1 + len(STAGES) and collector.trace(trace_id),
                       20, 0.1, "the request's spans at the collector")
    spans = sorted(spans, key=lambda s: s.start_time_unix_nano)
    root = spans[0]
    assert root.name == "POST /v1/chat/completions" and root.parent_span_id.hex() == caller_span
    assert root.kind == root.SPAN_KIND_SERVER
    assert [s.name for s in spans[1:]] == STAGES, [s.name for s in spans]
    assert all(s.parent_span_id == root.span_id for s in spans[1:])
    assert all(a.end_time_unix_nano <= b.start_time_unix_nano + 1000 for a, b in zip(spans[1:], spans[2:]))
    assert root.start_time_unix_nano <= spans[1].start_time_unix_nano
    assert spans[-1].end_time_unix_nano <= root.end_time_unix_nano
    attrs = attributes(root)
    assert attrs["gen_ai.request.id"] == "otel-1" and attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] and attrs["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert attrs["gen_ai.response.finish_reasons"] in (["length"], ["stop"])
    assert 0 < attrs["gen_ai.latency.time_to_first_token"] <= attrs["gen_ai.latency.e2e"]
    assert attrs["http.response.status_code"] == 200
    assert {"http_headers", "admitted", "first_byte", "last_byte", "closed"} <= {e.name for e in root.events}
    transfer = attributes(spans[4])
    assert transfer["pdserve.kv.bytes"] > 0 and transfer["pdserve.deadline_field"] == "inflight_timeout_s"
    assert "prefill_chunk" in {e.name for e in spans[2].events}
    timelines = httpx.get(engine.base_url + "/debug/requests/otel-1", timeout=10).json()["timelines"]
    assert [st["stage"] for st in timelines[-1]["stages"] if st["stage"]] == STAGES   # the recorder's own view


@needs_otel
def test_a_timed_out_requests_trace_names_the_stage_whose_deadline_fired(engine, collector):
    response = httpx.post(engine.base_url + "/v1/completions", headers={"X-Request-Id": "stuck-otel"},
                          json={"prompt": "lighthouses", "max_tokens": 2}, timeout=60)
    assert response.status_code == 504
    spans = wait_until(lambda: len(collector.request_spans("stuck-otel")) >= 5 and collector.request_spans(
        "stuck-otel"), 20, 0.1, "the timed-out request's spans")
    by_name = {s.name: s for s in spans}
    assert set(by_name) == {"POST /v1/completions", "queued", "prefill", "bootstrap", "transfer"}
    root, transfer = by_name["POST /v1/completions"], by_name["transfer"]
    assert root.status.code == root.status.STATUS_CODE_ERROR and transfer.status.code == root.status.code
    assert f"inflight_timeout_s={INFLIGHT_TIMEOUT_S:g} s fired" in transfer.status.message
    assert attributes(root)["pdserve.error_stage"] == "transfer" and attributes(root)["error.type"] == "TIMED_OUT"
    assert attributes(root)["http.response.status_code"] == 504 and not root.parent_span_id   # a trace of its own


@needs_otel
def test_a_collector_that_hangs_or_is_down_leaves_the_answers_working(engine, collector):
    """Export runs on its own threads: answers keep coming while the collector holds every export unanswered,
    then while its port is closed; the failed exports are counted; once it is back, traces arrive again."""
    def answered_in_time() -> None:
        for i in range(3):
            started = time.monotonic()
            assert httpx.post(engine.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                              timeout=60).status_code == 200
            # below one export's timeout (api/tracing.EXPORT_TIMEOUT_S): an export waited on would take all of it
            assert time.monotonic() - started < 5.0
            assert httpx.get(engine.base_url + "/health", timeout=5).status_code == 200
    collector.hang()
    answered_in_time()
    time.sleep(0.6)   # a batch is due every 0.5 s: one export is now held by the collector
    collector.stop()   # answers the held export, then closes the port
    answered_in_time()
    wait_until(lambda: scrape(engine.base_url).get("pdserve_trace_spans_total{outcome=failed}", 0) > 0, 30, 0.2,
               "a failed export counted")
    collector.start()
    stream_chat(engine, "otel-back")
    wait_until(lambda: len(collector.request_spans("otel-back")) == 1 + len(STAGES), 30, 0.2,
               "the trace of a request sent once the collector is back")
    # the SDK logs each retry and each failed batch (3 lines or more here); api/tracing.QuietSdkLog lets one a minute
    # through (two if this test outlasted a minute)
    assert len([line for line in engine.log_text().splitlines() if "spans batch" in line]) <= 2


def test_the_dialect_routes_record_the_apis_http_events(engine, collector):
    """/v1/responses and /v1/messages leave the same API events in the recorder as chat does (and, traced, the
    same trace)."""
    model = httpx.get(engine.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    answer = httpx.post(engine.base_url + "/v1/responses", headers={"X-Request-Id": "resp-rec"}, timeout=60,
                        json={"model": model, "input": "Name a lighthouse", "max_output_tokens": 4})
    assert answer.status_code == 200, answer.text
    with httpx.stream("POST", engine.base_url + "/v1/messages", headers={"X-Request-Id": "msg-rec"}, timeout=60,
                      json={"model": model, "max_tokens": 4, "stream": True,
                            "messages": [{"role": "user", "content": "Name a lighthouse"}]}) as streamed:
        assert streamed.status_code == 200
        assert "message_stop" in streamed.read().decode()
    for rid, kinds in (("resp-rec", ["http_headers", "admitted", "last_byte", "closed"]),
                       ("msg-rec", ["http_headers", "admitted", "first_byte", "last_byte", "closed"])):
        report = wait_until(lambda: httpx.get(f"{engine.base_url}/debug/requests/{rid}", timeout=10).json(), 10,
                            message=f"{rid}'s timeline")
        events = report["timelines"][-1]["events"]
        assert [e["kind"] for e in events if e["kind"] in kinds] == kinds, events
        closed = next(e for e in events if e["kind"] == "closed")
        assert closed["status"] == 200 and closed["by"] == "server"
    if OTEL:
        for rid, path in (("resp-rec", "/v1/responses"), ("msg-rec", "/v1/messages")):
            spans = wait_until(lambda: collector.request_spans(rid), 20, 0.1, f"{rid}'s trace")
            assert f"POST {path}" in {s.name for s in spans} and "decode" in {s.name for s in spans}


def test_an_incident_bundle_holds_the_state_config_timelines_and_connections(engine, tmp_path):
    from tools.bundle import read_bundle

    assert httpx.post(engine.base_url + "/v1/completions", headers={"X-Request-Id": "stuck-bundle"}, timeout=60,
                      json={"prompt": "lighthouses", "max_tokens": 2}).status_code == 504
    path = tmp_path / "incident.tar.gz"
    made = inspect(engine, "--bundle", str(path), "--recent", "5")
    assert made.returncode == 0, made.stderr.decode()
    bundle = read_bundle(str(path))
    index = bundle["bundle.json"]
    assert index["engine_id"] == engine.engine_id and index["errors"] == {} and "pdserve" in index["versions"]
    assert set(index["members"]) == set(bundle) == {"bundle.json", "config.json", "state.json",
                                                    "timelines/recent.json", "timelines/failed.json",
                                                    "connections.json"}
    assert bundle["config.json"]["inflight_timeout_s"] == {"value": INFLIGHT_TIMEOUT_S, "source": "env"}
    assert bundle["state.json"]["engine_id"] == engine.engine_id and bundle["state.json"]["actors"]
    failed = [t for t in bundle["timelines/failed.json"]["timelines"] if t["request_id"] is None]
    assert any(t["final"] == "TIMED_OUT" and t["timeout"]["stage"] == "transfer" for t in failed)
    assert 0 < len(bundle["timelines/recent.json"]["timelines"]) <= 5
    ledger = bundle["connections.json"]   # the connection ledger: this test's own connections were recorded
    assert ledger["counters"]["last_conn_id"] > 0 and {"connections", "closed"} <= set(ledger)


def incident_bundles(directory) -> list[dict]:
    """Every incident bundle in ``directory``, read back."""
    from tools.bundle import read_bundle

    return [read_bundle(str(p)) for p in sorted(directory.glob("incident-*.tar.gz"))]


def bundle_of(directory, request_id: str) -> dict | None:
    return next((b for b in incident_bundles(directory) if request_id in b["incident.json"]["request_ids"]), None)


def multiround(argv: list[str], report) -> dict:
    run = subprocess.run([sys.executable, "-m", "tools.multiround", *argv, "--json", str(report)], cwd=ROOT,
                         capture_output=True, timeout=300)
    assert run.returncode == 0, run.stdout.decode()[-3000:] + run.stderr.decode()[-3000:]
    return orjson.loads(report.read_bytes())


def test_a_leaked_kv_block_is_named_by_the_conservation_check_within_two_ticks(engine):
    """The leak_blocks fault keeps a finished request's prompt blocks owned by its slot: with nothing else running
    the monitor names the blocks and the request within two ticks (0.5 s here; slack for a loaded machine), once,
    counts it (pdserve_conservation_violations_total{kind=blocks}) and writes a conservation incident holding
    prefill0's stacks. (The prompt runs twice: the second time its last
    block's tokens are in the prefix cache already, so that block is freed rather than filed, and the free is what
    the fault skips.)"""
    for rid in ("leak-0", "leak-1"):
        r = httpx.post(engine.base_url + "/v1/completions", headers={"X-Request-Id": rid}, timeout=60,
                       json={"prompt": list(range(300, 317)), "max_tokens": 1})
        assert r.status_code == 200, r.text
    answered = time.monotonic()

    def named():
        return [line for line in engine.log_text().splitlines() if "ERROR conservation: KV blocks leaked on prefill0" in line]
    line = wait_until(named, 2 * 0.5 + 3.0, 0.05, "the conservation check's line")[0]
    assert time.monotonic() - answered < 2 * 0.5 + 3.0 and "slots last held leak-" in line, line
    bundle = wait_until(lambda: next((b for b in incident_bundles(engine.incident_dir)
                                      if b["incident.json"]["kind"] == "conservation"), None),
                        20, 0.2, "the conservation incident")
    assert any(rid.startswith("leak-") for rid in bundle["incident.json"]["request_ids"])
    assert bundle["holders.json"]["holders"][0]["actor"] == "prefill0"
    lines = [line.split(" ERROR ", 1)[1] for line in named()]
    assert len(lines) == len(set(lines))   # a leak is reported once, not every tick
    assert scrape(engine.base_url)["pdserve_conservation_violations_total{kind=blocks}"] >= 1


def test_the_outage_one_keep_alive_connection_24_rounds_a_transfer_stuck_at_round_7(engine, tmp_path):
    """The outage's case (scenario S14 in full): one session, 24 rounds on one keep-alive connection, the transfer
    of round 7 (multiround's index 6) never completes and nothing else runs. Afterwards the recorder gives its
    timeline (the row long reused), the 504 named the id, the monitor wrote an incident bundle for the timeout,
    and that bundle's replay recipe, run against a fresh engine, gives a 504 at the same stage."""
    rid = "stuck-s0r6"
    report = multiround(["--base-url", engine.base_url, "--sessions", "1", "--rounds", "24", "--inject-round", "6",
                         "--inject-id-prefix", "stuck-", "--round-timeout-s", "60"], tmp_path / "outage.json")
    assert report["rounds_ok"] == 23 and report["connections_opened"] == 1 and not report["errors"], report
    (expected,) = report["expected_errors"]
    assert expected["round"] == 6 and expected["status"] == 504 and rid in expected["error"]
    text = inspect(engine, "--request", rid)
    assert text.returncode == 0, text.stderr.decode()
    out = text.stdout.decode()
    assert "QUEUED -> PREFILLING -> BOOTSTRAP -> TRANSFERRING -> TIMED_OUT" in out, out
    assert f"TIMED OUT in stage transfer: inflight_timeout_s={INFLIGHT_TIMEOUT_S:g} s fired after" in out, out
    assert "row released" in out and out.count(" age ") >= 5   # every stage with its age
    bundle = wait_until(lambda: bundle_of(engine.incident_dir, rid), 20, 0.2, "the timeout's incident bundle")
    incident = bundle["incident.json"]
    assert incident["kind"] == "timeout" and incident["stage"] == "transfer"
    assert incident["deadline_field"] == "inflight_timeout_s"
    (timeline,) = bundle["timelines/incident.json"]["timelines"]
    assert timeline["request_id"] == rid and timeline["timeout"]["stage"] == "transfer"
    assert timeline["partial"] is None and not timeline["live"]   # a whole life: nothing of it overwritten
    assert bundle["config.json"]["inflight_timeout_s"]["source"] == "env" and bundle["bundle.json"]["versions"]
    assert bundle["state.json"]["engine_id"] == engine.engine_id
    assert any(rid in line and "timeout" in line for line in bundle["log.json"]["lines"])
    (holder,) = bundle["holders.json"]["holders"]   # the row's owner when it timed out: its stacks and loop counters
    assert holder["actor"] in ("prefill0", "decode0") and 'File "' in holder["stacks"], holder
    assert holder["loop_position"] and holder["summary"].startswith(holder["actor"]) and holder["pid"] > 0
    replay = bundle["replay.json"]
    assert replay["faults"] == "transfer_stuck:count=1,match=replay-"
    assert replay["env"]["PDSERVE_INFLIGHT_TIMEOUT_S"] == f"{INFLIGHT_TIMEOUT_S:g}"
    argv = replay["multiround"]
    assert argv[:3] == ["python", "-m", "tools.multiround"] and argv[argv.index("--inject-round") + 1] == "6"
    read = inspect(engine, "--bundle", str(engine.incident_dir))   # the directory: its newest, read back
    assert read.returncode == 0 and "incident: timeout" in read.stdout.decode(), read.stdout.decode()
    assert f"held by {holder['actor']} (pid" in read.stdout.decode()
    # the replay recipe, as written, on a fresh engine
    fresh = start_engine(tmp_path, env=replay["env"])
    try:
        args = argv[3:]
        args[args.index("--base-url") + 1] = fresh.base_url
        again = multiround(args, tmp_path / "replay.json")
        (expected,) = again["expected_errors"]
        assert expected["status"] == 504 and "replay-s0r6" in expected["error"] and "stage transfer" in \
            expected["error"], expected
        shown = subprocess.run([sys.executable, "-m", "tools.inspect", fresh.engine_id, "--request", "replay-s0r6",
                                "--json"], cwd=ROOT, capture_output=True, timeout=60)
        (replayed,) = orjson.loads(shown.stdout)["timelines"]
        assert replayed["path"] == timeline["path"] and replayed["timeout"]["stage"] == "transfer"
    finally:
        cleanup_engine(fresh)


def test_a_router_count_drift_is_logged_with_the_ids_each_side_holds(engine, probe):
    """router_count_drift bends the router's count, not its set of requests: the monitor's log line says so by
    naming no diverging id on either side, and tools/inspect --reconcile agrees (exit 0). Runs last: the drift
    stays."""
    response = httpx.post(engine.base_url + "/v1/completions", headers={"X-Request-Id": "drift-1"},
                          json={"prompt": "drift", "max_tokens": 2}, timeout=60)
    assert response.status_code == 200, response.text
    wait_until(lambda: "router count mismatch" in engine.log_text(), 5, 0.1, "the mismatch log line")
    line = next(x for x in engine.log_text().splitlines() if "router count mismatch" in x)
    assert "ids the API holds and the table does not: none; the table holds and the API does not: none" in line
    shown = inspect(engine, "--reconcile", "--json")
    assert shown.returncode == 0, shown.stdout
    assert orjson.loads(shown.stdout) == {"api_only": [], "table_only": []}
