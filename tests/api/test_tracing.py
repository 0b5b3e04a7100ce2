"""Traces of finished requests (api/tracing.py) without an engine: a real flight recorder in shm written as the
actors write it, the tracer's thread logic stepped by hand, spans through the OpenTelemetry SDK into its own
in-memory exporter; and the config refusing the endpoint without the ``otel`` extra."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import time

import pytest

from api.tracing import (INCOMING, EventBuffer, QuietSdkLog, RequestFacts, RequestTracer, TraceContextMiddleware,
                         otlp_url, span_plan)
from ipc import naming
from ipc.recorder import EventKind, Recorder, TimeoutReason, request_key
from ipc.state_table import RequestState as S
from pdserve.config import EngineConfig, load_config
from pdserve.errors import ConfigError

NAMES = ("prefill0", "decode0", "api", "monitor")
PREFILL, DECODE, API, MONITOR = 0, 1, 2, 3
MS = 1_000_000
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
STAGES = ["queued", "prefill", "bootstrap", "transfer", "decode_waiting", "decode"]


@pytest.fixture
def ring(engine_id):
    rec = Recorder.create(naming.segment_name(engine_id, "rec"), num_writers=4, events_per_writer=256)
    yield rec
    rec.close()
    rec.unlink()


def write_life(ring, rid: str, slot: int, gen: int, t0: int, timeout_in_transfer: bool = False) -> int:
    """A request's row life as the actors record it, from ``t0`` (time.monotonic_ns()); returns its end."""
    w = {i: ring.open_writer(i, i) for i in range(4)}
    key = request_key(rid)

    def put(actor, kind, dt_ms, **fields):
        w[actor].append(kind, slot, gen, key, t_ns=t0 + dt_ms * MS, **fields)

    put(API, EventKind.ALLOCATE, 1, new=S.QUEUED, b=12)
    put(API, EventKind.HTTP_HEADERS, 0, a=321)
    put(API, EventKind.ADMITTED, 2)
    put(PREFILL, EventKind.TRANSITION, 10, old=S.QUEUED, new=S.PREFILLING)
    put(PREFILL, EventKind.CACHE_HIT, 11, a=8)
    put(PREFILL, EventKind.PREFILL_CHUNK, 20, a=4, b=12)
    put(PREFILL, EventKind.TRANSITION, 21, old=S.PREFILLING, new=S.BOOTSTRAP)
    put(DECODE, EventKind.TRANSITION, 30, old=S.BOOTSTRAP, new=S.TRANSFERRING)
    if timeout_in_transfer:
        put(MONITOR, EventKind.TRANSITION, 2100, old=S.TRANSFERRING, new=S.TIMED_OUT)
        put(MONITOR, EventKind.TIMEOUT, 2100, old=S.TRANSFERRING, a=2070 * MS, b=2000 * MS,
            aux=TimeoutReason.STAGE_DEADLINE)
        put(API, EventKind.CLOSED, 2101, a=504, aux=1)
        put(API, EventKind.RELEASE, 2102, old=S.TIMED_OUT)
        return t0 + 2103 * MS
    put(DECODE, EventKind.TRANSITION, 40, old=S.TRANSFERRING, new=S.DECODE_WAITING)
    put(DECODE, EventKind.KV_HANDOFF, 41, a=4096, b=9 * MS, c=1)
    put(DECODE, EventKind.TRANSITION, 50, old=S.DECODE_WAITING, new=S.DECODING)
    put(API, EventKind.FIRST_BYTE, 55)
    put(DECODE, EventKind.TRANSITION, 80, old=S.DECODING, new=S.FINISHED)
    put(API, EventKind.LAST_BYTE, 81, a=200)
    put(API, EventKind.CLOSED, 82, a=200, aux=1)
    put(API, EventKind.RELEASE, 83, old=S.FINISHED)
    return t0 + 84 * MS


def facts_of(rid: str, slot: int, gen: int, t0: int, end: int, status: int = 200, reason: str | None = "length",
             carrier: dict | None = None) -> RequestFacts:
    return RequestFacts(rid, "POST", "/v1/chat/completions", status, t0, end, time.time_ns() - time.monotonic_ns(),
                        carrier or {}, "chat", "smol", 12, [(0, slot, gen, reason, 3)], first_token_ns=t0 + 54 * MS,
                        cached_tokens=8, max_tokens=3, temperature=0.0, top_p=1.0)


def sdk_tracer():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exported = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    return provider.get_tracer("test"), exported


def config(**fields) -> EngineConfig:
    return dataclasses.replace(EngineConfig(), **fields)


def test_a_finished_request_becomes_a_trace_of_its_stages_under_the_callers_span(ring):
    tracer, exported = sdk_tracer()
    traces = RequestTracer(tracer, ring, config(inflight_timeout_s=2.0), NAMES)
    _, traces._seen, _ = ring.events_since(None)   # what start() does, without the thread
    t0 = time.monotonic_ns()
    end = write_life(ring, "chat-1", 3, 7, t0)
    traces.submit(facts_of("chat-1", 3, 7, t0, end, carrier={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}))
    traces.step(end + 10 * MS)
    spans = sorted(exported.get_finished_spans(), key=lambda s: s.start_time)
    root = spans[0]
    assert root.name == "POST /v1/chat/completions" and root.kind.name == "SERVER"
    assert f"{root.context.trace_id:032x}" == CALLER_TRACE and f"{root.parent.span_id:016x}" == CALLER_SPAN
    assert [s.name for s in spans[1:]] == STAGES
    assert all(s.parent.span_id == root.context.span_id and s.context.trace_id == root.context.trace_id
               for s in spans[1:])
    assert all(a.end_time <= b.start_time + 1000 for a, b in zip(spans[1:], spans[2:]))   # one after another
    attrs = root.attributes
    assert attrs["gen_ai.request.model"] == "smol" and attrs["gen_ai.usage.input_tokens"] == 12
    assert attrs["gen_ai.usage.output_tokens"] == 3 and list(attrs["gen_ai.response.finish_reasons"]) == ["length"]
    assert attrs["gen_ai.request.id"] == "chat-1" and attrs["http.response.status_code"] == 200
    assert attrs["gen_ai.latency.time_to_first_token"] == pytest.approx(0.054)
    assert attrs["gen_ai.latency.time_in_queue"] == pytest.approx(0.009, abs=1e-6)   # QUEUED at 1 ms, left at 10
    assert [e.name for e in root.events] == ["http_headers", "admitted", "first_byte", "last_byte", "closed"]
    prefill, transfer = spans[2], spans[4]
    assert [e.name for e in prefill.events] == ["cache_hit", "prefill_chunk"]
    assert prefill.attributes["pdserve.cached_tokens"] == 8 and prefill.attributes["pdserve.actor"] == "prefill0"
    assert transfer.attributes["pdserve.kv.bytes"] == 4096 and transfer.attributes["pdserve.kv.blocks"] == 1
    assert transfer.attributes["pdserve.deadline_field"] == "inflight_timeout_s"
    assert transfer.attributes["pdserve.deadline_s"] == 2.0
    assert (transfer.end_time - transfer.start_time) == 10 * MS
    assert root.status.status_code.name == "UNSET" and traces.counts["traced"] == 1
    assert traces.buffer.lives == {}   # claimed, forgotten


def test_a_timed_out_request_marks_its_stage_and_the_root_as_errors(ring):
    tracer, exported = sdk_tracer()
    traces = RequestTracer(tracer, ring, config(inflight_timeout_s=2.0), NAMES)
    _, traces._seen, _ = ring.events_since(None)
    t0 = time.monotonic_ns()
    end = write_life(ring, "stuck-1", 0, 1, t0, timeout_in_transfer=True)
    traces.submit(facts_of("stuck-1", 0, 1, t0, end, status=504, reason=None))
    traces.step(end)
    spans = {s.name: s for s in exported.get_finished_spans()}
    root, transfer = spans["POST /v1/chat/completions"], spans["transfer"]
    assert set(spans) == {"POST /v1/chat/completions", "queued", "prefill", "bootstrap", "transfer"}
    assert transfer.status.status_code.name == "ERROR" and "inflight_timeout_s=2 s fired" in transfer.status.description
    assert root.status.status_code.name == "ERROR" and root.attributes["pdserve.error_stage"] == "transfer"
    assert root.attributes["error.type"] == "TIMED_OUT" and "gen_ai.response.finish_reasons" not in root.attributes
    assert [e.name for e in transfer.events] == ["timeout"] and "gen_ai.latency.time_to_first_token" in root.attributes


def test_a_request_waits_for_its_rows_release_then_settles_without_it(ring):
    tracer, exported = sdk_tracer()
    traces = RequestTracer(tracer, ring, config(), NAMES, settle_s=1.0)
    _, traces._seen, _ = ring.events_since(None)
    t0 = time.monotonic_ns()
    w = ring.open_writer(API, API)
    w.append(EventKind.ALLOCATE, 5, 2, request_key("open-1"), new=S.QUEUED, t_ns=t0)
    traces.submit(facts_of("open-1", 5, 2, t0, t0 + MS))
    traces.step(t0 + 2 * MS)
    assert exported.get_finished_spans() == () and len(traces._pending) == 1   # not released: it waits
    w.append(EventKind.RELEASE, 5, 2, request_key("open-1"), old=S.ABORTED, t_ns=t0 + 3 * MS)
    traces.step(t0 + 4 * MS)
    assert len(exported.get_finished_spans()) == 2 and traces._pending == []   # root + queued
    w.append(EventKind.ALLOCATE, 6, 1, request_key("open-2"), new=S.QUEUED, t_ns=t0)
    traces.submit(facts_of("open-2", 6, 1, t0, t0 + MS))
    traces.step(t0 + 500 * MS)
    assert traces._pending
    traces.step(t0 + 1100 * MS)   # settle_s passed: traced with what is known
    assert traces._pending == [] and len(exported.get_finished_spans()) == 4


def test_a_full_queue_drops_traces_and_counts_them(ring):
    tracer, exported = sdk_tracer()
    traces = RequestTracer(tracer, None, config(), NAMES, max_pending=2)
    t0 = time.monotonic_ns()
    for i in range(5):
        traces.submit(facts_of(f"r{i}", i, 1, t0, t0 + MS))
    traces.step(t0 + 2 * MS)
    assert traces.counts["dropped"] == 3 and traces.counts["traced"] == 2
    assert [s.name for s in exported.get_finished_spans()] == ["POST /v1/chat/completions"] * 2   # no recorder
    (family, _, _) = traces.collector().collect()
    assert {s.labels["outcome"]: s.value for s in family.samples} == {"traced": 2, "dropped": 3, "failed": 0}


def test_the_event_buffer_keeps_lives_across_reads_and_forgets_stale_ones(ring):
    w = ring.open_writer(0, 0)
    buf = EventBuffer(keep_live_s=10.0, keep_released_s=1.0)
    seen = ring.events_since(None)[1]
    w.append(EventKind.TRANSITION, 1, 1, 11, t_ns=5 * MS)
    w.append(EventKind.ALLOCATE, 1, 1, 11, t_ns=1 * MS)
    w.append(EventKind.ALLOCATE, 2, 1, 22, t_ns=2 * MS)
    events, seen, _ = ring.events_since(seen)
    buf.add(events)
    w.append(EventKind.RELEASE, 1, 1, 11, t_ns=9 * MS)
    w.append(EventKind.TRANSITION, -1, 0, 0, t_ns=9 * MS)   # no row: not kept
    events, seen, _ = ring.events_since(seen)
    buf.add(events)
    assert buf.released((1, 1)) and not buf.released((2, 1)) and set(buf.lives) == {(1, 1), (2, 1)}
    assert buf.take((1, 1))["t_ns"].tolist() == [1 * MS, 5 * MS, 9 * MS] and buf.take((1, 1)) is None
    w.append(EventKind.RELEASE, 3, 1, 33, t_ns=20 * MS)
    buf.add(ring.events_since(seen)[0])
    buf.prune(1500 * MS)   # 3's release is 1.48 s old (> 1 s); 2 is live and 1.5 s old (< 10 s)
    assert set(buf.lives) == {(2, 1)}
    buf.prune(12_000 * MS)
    assert buf.lives == {}


def test_span_plan_without_timelines_is_the_http_span_alone():
    t0 = 1_000 * MS
    plan = span_plan(facts_of("x", 0, 1, t0, t0 + 5 * MS, status=503, reason=None), [])
    assert len(plan) == 1 and plan[0].error == "HTTP 503" and plan[0].attributes["error.type"] == "503"
    assert "gen_ai.latency.time_in_queue" not in plan[0].attributes


def test_otlp_url_adds_the_traces_path_only_when_there_is_none():
    assert otlp_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert otlp_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert otlp_url("https://c.example/otlp/v1/traces") == "https://c.example/otlp/v1/traces"


def test_the_endpoint_is_refused_without_the_otel_extra_or_a_url(monkeypatch):
    assert load_config({"otlp_traces_endpoint": "http://127.0.0.1:4318"}, {}).config.otlp_traces_endpoint
    with pytest.raises(ConfigError, match="http:// or https:// URL"):
        load_config({"otlp_traces_endpoint": "collector:4318"}, {})
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)   # as where the extra is not installed
    with pytest.raises(ConfigError, match=r"pip install \.\[otel\]") as info:
        load_config(None, {"PDSERVE_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318"})
    assert info.value.param == "otlp_traces_endpoint"
    assert load_config(None, {}).config.otlp_traces_endpoint == ""


def test_the_sdks_log_records_are_let_through_once_a_minute_saying_how_many_were_left_out():
    now = [100.0]
    quiet = QuietSdkLog(60.0, clock=lambda: now[0])

    def record(name: str, msg: str = "Failed to export %s", args=("batch",)) -> logging.LogRecord:
        return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, args, None)
    sdk = "opentelemetry.exporter.otlp.proto.http.trace_exporter"
    assert quiet.filter(record(sdk))
    assert [quiet.filter(record(sdk)) for _ in range(5)] == [False] * 5
    assert quiet.filter(record("pdserve.api")) and quiet.filter(record("uvicorn"))   # others untouched
    now[0] += 61
    kept = record(sdk)
    assert quiet.filter(kept)
    assert kept.getMessage() == ("Failed to export batch (and 5 more OpenTelemetry log records left out in the last "
                                 "61 s)")
    assert not quiet.filter(record(sdk))


def test_the_routers_middleware_hands_the_callers_trace_headers_to_the_tasks_a_request_starts():
    """What api/router_client.py sends the nodes: INCOMING, read in a task started while the request is served
    (as RouterClient.submit starts its prefill call), is that request's traceparent/tracestate and nothing else;
    outside a request it is empty."""
    seen = []

    async def app(scope, receive, send):
        async def call_a_node():
            await asyncio.sleep(0)
            seen.append(dict(INCOMING.get()))
        await asyncio.create_task(call_a_node())

    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    scope = {"type": "http", "headers": [(b"traceparent", parent.encode()), (b"tracestate", b"k=v"),
                                         (b"x-request-id", b"r1")]}

    async def serve_two():
        wrapped = TraceContextMiddleware(app)
        await asyncio.gather(wrapped(scope, None, None), wrapped({"type": "http", "headers": []}, None, None))
        seen.append(dict(INCOMING.get()))
    asyncio.run(serve_two())
    assert seen == [{"traceparent": parent, "tracestate": "k=v"}, {}, {}]
