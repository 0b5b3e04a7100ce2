"""OpenTelemetry traces of finished requests (``otlp_traces_endpoint``), built off the request path from the flight
recorder's timelines (ipc/timeline.py) and exported over OTLP/HTTP by the SDK's BatchSpanProcessor.

| name              | what                                                                                    |
|-------------------|-----------------------------------------------------------------------------------------|
| `TraceNote`       | what the API process knows of one HTTP request: start, ``traceparent``, handles, status  |
| `TraceMiddleware` | ASGI: a note per HTTP request (``scope["pdserve.trace"]``), handed to the tracer at its end |
| `RequestFacts`    | a finished request's facts, copied from the note and its handles on the event loop      |
| `span_plan`       | facts + the choices' timelines -> ``SpanSpec`` list (plain data, no OpenTelemetry)        |
| `EventBuffer`     | the recorder's new events per row life, kept until their trace is built or they go stale |
| `RequestTracer`   | the thread: reads new recorder events, waits for a request's rows to be released, emits |
| `start_tracer`    | the SDK's TracerProvider + BatchSpanProcessor(OTLP/HTTP exporter) for the config        |
| `start_router_tracer` | the same for `pdserve router`'s own spans (``TraceContextMiddleware``)              |
| `QuietSdkLog`     | a log filter: one OpenTelemetry SDK record a minute (a down collector logs every retry) |
| `TraceContextMiddleware` | ASGI (the router): its own span per request; its W3C headers in ``INCOMING`` for node calls |

A trace: the HTTP request's SERVER span (the caller's ``traceparent`` as its parent), with the gen_ai semantic
conventions' attributes (model, usage, finish reasons; vLLM's ``gen_ai.latency.*`` for TTFT, queue time, e2e),
and one child span per lifecycle stage of each choice's row, named as ipc/lifecycle.py names the stages (queued,
prefill, bootstrap, transfer, decode_waiting, decode) with the recorder's events on them (prefill chunks, cache
hits, the KV handoff with its bytes and blocks, the deadline that fired). Nothing here runs on the event loop but
``TraceMiddleware`` and ``RequestTracer.submit`` (a bounded deque append); a full deque drops the request's trace
and counts it; a slow or dead collector only fills the BatchSpanProcessor's own bounded queue.
"""
from __future__ import annotations

import collections
import contextvars
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from api.generation import prompt_counts
from ipc.recorder import EventKind

log = logging.getLogger("pdserve.api")

HTTP_EVENT_KINDS = frozenset({"http_headers", "admitted", "first_byte", "last_byte", "closed", "http_problem"})
EVENT_STAGE = {"kv_handoff": "transfer", "prefill_chunk": "prefill", "cache_hit": "prefill"}   # their own stage
ROW_LIFE_KINDS = frozenset({"transition", "allocate", "release"})   # the stages themselves, not span events
MAX_EVENTS_PER_SPAN = 64           # a long queue's renewals are cut here (the span says how many were left out)
POLL_S = 0.25                      # the tracer reads the recorder's new events this often
SETTLE_S = 2.0                     # longest a finished request waits for its rows' release before it is traced
KEEP_RELEASED_S = 30.0             # a released row life no request claimed is forgotten after this
MAX_PENDING = 4096                 # finished requests waiting to be traced; past it their traces are dropped
EXPORT_TIMEOUT_S = 5.0             # one OTLP/HTTP export (retries included) gives up after this
TRACE_HEADERS = (b"traceparent", b"tracestate")
# the W3C trace-context headers of the HTTP request being served (the router forwards them to the nodes; tasks
# started while serving it inherit the value)
INCOMING: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar("pdserve_trace_headers", default={})


def trace_headers(scope: dict) -> dict[str, str]:
    """The W3C trace-context headers (``traceparent``, ``tracestate``) of an ASGI ``scope``, lower-case names."""
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or ()
            if k.lower() in TRACE_HEADERS}


@dataclass
class TraceNote:
    """One HTTP request as the API process sees it; ``handles`` is set by api/http_edges.note_engine_requests
    when the route admits it to the engine (only those are traced). Times: time.monotonic_ns()."""

    start_ns: int
    wall_offset_ns: int            # time.time_ns() - time.monotonic_ns() at the start
    method: str
    path: str
    carrier: dict[str, str]        # the W3C trace-context headers (traceparent, tracestate) the request carried
    handles: list = field(default_factory=list)
    status: int = 0                # the HTTP status sent (0: none)


@dataclass
class RequestFacts:
    """A finished request, as its trace shows it. ``choices``: ``(index, slot, generation, finish_reason,
    completion_tokens)`` per choice; times are time.monotonic_ns() (0 = never)."""

    request_id: str
    method: str
    path: str
    status: int
    start_ns: int
    end_ns: int
    wall_offset_ns: int
    carrier: dict[str, str]
    operation: str                 # gen_ai.operation.name: "chat" or "text_completion"
    model: str
    prompt_tokens: int
    choices: list[tuple[int, int, int, str | None, int]]
    first_token_ns: int = 0
    cached_tokens: int = 0
    max_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0


def request_facts(note: TraceNote, end_ns: int) -> RequestFacts:
    """The facts of ``note``'s request (its handles read now: call it on the event loop, at the end)."""
    handles = note.handles
    req = handles[0].request
    prompt_tokens, cached_tokens = prompt_counts(handles)   # a completions list: every prompt once
    return RequestFacts(
        request_id=req.request_id, method=note.method, path=note.path, status=note.status, start_ns=note.start_ns,
        end_ns=end_ns, wall_offset_ns=note.wall_offset_ns, carrier=dict(note.carrier),
        operation="chat" if req.kind == "chat" else "text_completion", model=req.model,
        prompt_tokens=prompt_tokens,
        choices=[(h.index, h.slot, h.generation, h.finish_reason, h.completion_tokens) for h in handles],
        first_token_ns=min((h.first_token_ns for h in handles if h.first_token_ns), default=0),
        cached_tokens=cached_tokens,
        max_tokens=int(req.sampling.max_tokens), temperature=float(req.sampling.temperature),
        top_p=float(req.sampling.top_p))


# ---- the plan: plain data ---------------------------------------------------------------------------------------

@dataclass
class SpanSpec:
    """One span to emit. ``parent``: the index of its parent in the plan, None = the caller's context; times are
    time.monotonic_ns(); ``events``: ``(name, t_ns, attributes)``; ``error``: the status description of a span
    that failed (None = unset)."""

    name: str
    start_ns: int
    end_ns: int
    parent: int | None
    server: bool
    attributes: dict[str, Any]
    events: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)
    error: str | None = None
    events_left_out: int = 0

    def add_event(self, name: str, t_ns: int, attributes: dict[str, Any]) -> None:
        if len(self.events) < MAX_EVENTS_PER_SPAN:
            self.events.append((name, t_ns, attributes))
        else:
            self.events_left_out += 1
            self.attributes["pdserve.events_left_out"] = self.events_left_out


def _root_attributes(facts: RequestFacts) -> dict[str, Any]:
    reasons = [r for _, _, _, r, _ in sorted(facts.choices) if r is not None]
    attrs: dict[str, Any] = {
        "http.request.method": facts.method, "url.path": facts.path, "gen_ai.operation.name": facts.operation,
        "gen_ai.request.model": facts.model, "gen_ai.response.model": facts.model,
        "gen_ai.request.id": facts.request_id, "gen_ai.response.id": facts.request_id,
        "gen_ai.usage.input_tokens": facts.prompt_tokens,
        "gen_ai.usage.output_tokens": sum(c[4] for c in facts.choices),
        "gen_ai.request.max_tokens": facts.max_tokens, "gen_ai.request.temperature": facts.temperature,
        "gen_ai.request.top_p": facts.top_p, "gen_ai.request.choice.count": len(facts.choices),
        "gen_ai.usage.cache_read.input_tokens": facts.cached_tokens,
        "gen_ai.latency.e2e": (facts.end_ns - facts.start_ns) / 1e9,
    }
    if facts.status:
        attrs["http.response.status_code"] = facts.status
    if reasons:
        attrs["gen_ai.response.finish_reasons"] = reasons
    if facts.first_token_ns:
        attrs["gen_ai.latency.time_to_first_token"] = (facts.first_token_ns - facts.start_ns) / 1e9
    return attrs


def _event_attributes(event: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in event.items() if k not in ("t_s", "kind") and v is not None}


def _stage_specs(index: int, timeline: dict[str, Any], t0_ns: int) -> list[SpanSpec]:
    specs = []
    for st in timeline["stages"]:
        if st["stage"] is None:   # a final state: the end, not a stage
            continue
        start = t0_ns + round(st["t_s"] * 1e9)
        attrs = {"pdserve.state": st["state"], "pdserve.actor": st["by"], "pdserve.choice": index}
        if st["deadline_field"]:
            attrs["pdserve.deadline_field"] = st["deadline_field"]
            if st["deadline_s"] is not None:
                attrs["pdserve.deadline_s"] = float(st["deadline_s"])
        specs.append(SpanSpec(st["stage"], start, start + round(max(st["age_s"] or 0.0, 0.0) * 1e9), 0, False,
                              attrs))
    return specs


def _place_event(root: SpanSpec, stages: list[SpanSpec], event: dict[str, Any], t_ns: int, first: bool) -> None:
    """A timeline event onto its span: the API's HTTP events onto the root (once: every choice's row has them),
    the stage's own events onto its span (``EVENT_STAGE``; the handoff is recorded as the transfer ends), the rest
    onto the stage span it happened in; the KV handoff's and cache hit's figures also as its attributes."""
    kind, attrs = event["kind"], _event_attributes(event)
    if kind in HTTP_EVENT_KINDS or not stages:
        if first:
            root.add_event(kind, t_ns, attrs)
        return
    home = EVENT_STAGE.get(kind)
    target = next((s for s in reversed(stages) if s.name == home), None) or \
        next((s for s in reversed(stages) if s.start_ns <= t_ns), stages[0])
    target.add_event(kind, t_ns, attrs)
    if kind == "kv_handoff":
        target.attributes.update({"pdserve.kv.bytes": event["bytes"], "pdserve.kv.blocks": event["blocks"],
                                  "pdserve.kv.duration_s": event["duration_s"],
                                  "pdserve.kv.local_copy": event["local_copy"]})
    elif kind == "cache_hit":
        target.attributes["pdserve.cached_tokens"] = event["cached_tokens"]


def _mark_ending(root: SpanSpec, stages: list[SpanSpec], timeline: dict[str, Any]) -> None:
    """A timed-out or failed row: its stage span and the root carry the error and the stage it happened in."""
    final, timeout = timeline["final"], timeline["timeout"]
    if final:
        root.attributes["pdserve.final_state"] = final
    if timeout is not None:
        text = (f"TIMED_OUT in stage {timeout['stage']}: {timeout['deadline_field']}={timeout['limit_s']:g} s "
                f"fired after {timeout['age_s']:.3f} s ({timeout['reason']})")
        stage = next((s for s in reversed(stages) if s.name == timeout["stage"]), None)
    elif final == "FAILED":
        stage = stages[-1] if stages else None
        text = f"FAILED in stage {stage.name if stage else '?'}"
    else:
        return
    if stage is not None:
        stage.error = text
        root.attributes["pdserve.error_stage"] = stage.name
    root.error = text
    root.attributes["error.type"] = final or "TIMED_OUT"


def span_plan(facts: RequestFacts, timelines: list[tuple[int, dict[str, Any], int]]) -> list[SpanSpec]:
    """The spans of one request: the root (its HTTP exchange) first, then each choice's stage spans.
    ``timelines``: ``(choice index, ipc.timeline timeline, the timeline's start in time.monotonic_ns())``."""
    root = SpanSpec(f"{facts.method} {facts.path}", facts.start_ns, facts.end_ns, None, True,
                    _root_attributes(facts))
    plan = [root]
    queue_s = 0.0
    for n, (index, timeline, t0_ns) in enumerate(timelines):
        stages = _stage_specs(index, timeline, t0_ns)
        for event in timeline["events"]:
            if event["kind"] not in ROW_LIFE_KINDS:
                _place_event(root, stages, event, t0_ns + round(event["t_s"] * 1e9), n == 0)
        _mark_ending(root, stages, timeline)
        if timeline.get("partial"):   # the flight recorder's ring lost part of it (ipc/timeline.py)
            root.attributes["pdserve.timeline.partial"] = timeline["partial"]
        queue_s = max([queue_s] + [(s.end_ns - s.start_ns) / 1e9 for s in stages if s.name == "queued"])
        plan += stages
    if timelines:
        root.attributes["gen_ai.latency.time_in_queue"] = queue_s
    if root.error is None and facts.status >= 500:
        root.error = f"HTTP {facts.status}"
        root.attributes["error.type"] = str(facts.status)
    root.start_ns = min([root.start_ns] + [s.start_ns for s in plan[1:]])
    root.end_ns = max([root.end_ns] + [s.end_ns for s in plan[1:]])
    return plan


# ---- the recorder's events, per row life ------------------------------------------------------------------------

class EventBuffer:
    """New flight-recorder events (ipc/recorder.py EVENT_DTYPE) per row life ``(slot, generation)``, until a
    request claims them (``take``) or they go stale: a released life after ``keep_released_s``, any life whose
    newest event is older than ``keep_live_s``; past ``max_lives`` the oldest go first."""

    def __init__(self, keep_live_s: float, keep_released_s: float = KEEP_RELEASED_S, max_lives: int = 16384):
        self.keep_live_ns = int(keep_live_s * 1e9)
        self.keep_released_ns = int(keep_released_s * 1e9)
        self.max_lives = max_lives
        self.lives: dict[tuple[int, int], list[np.ndarray]] = {}
        self.newest_ns: dict[tuple[int, int], int] = {}
        self.released_ns: dict[tuple[int, int], int] = {}

    def add(self, events: np.ndarray) -> None:
        events = events[events["slot"] >= 0]
        if not events.size:
            return
        ids = (events["slot"].astype(np.int64) << 32) | events["generation"].astype(np.int64)
        order = np.argsort(ids, kind="stable")
        ids, events = ids[order], events[order]
        starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
        for life_id, chunk in zip(ids[starts].tolist(), np.split(events, starts[1:])):
            life = (life_id >> 32, life_id & 0xFFFFFFFF)
            self.lives.setdefault(life, []).append(chunk)
            self.newest_ns[life] = max(self.newest_ns.get(life, 0), int(chunk["t_ns"].max()))
            released = chunk["t_ns"][chunk["kind"] == EventKind.RELEASE]
            if released.size:
                self.released_ns[life] = int(released.max())

    def released(self, life: tuple[int, int]) -> bool:
        return life in self.released_ns

    def take(self, life: tuple[int, int]) -> np.ndarray | None:
        """The life's events, time-sorted, forgotten here; None when none were seen."""
        chunks = self.lives.pop(life, None)
        self.newest_ns.pop(life, None)
        self.released_ns.pop(life, None)
        if not chunks:
            return None
        events = np.concatenate(chunks)
        return events[np.argsort(events["t_ns"], kind="stable")]

    def prune(self, now_ns: int) -> None:
        stale = [life for life, t in self.released_ns.items() if now_ns - t > self.keep_released_ns]
        stale += [life for life, t in self.newest_ns.items() if now_ns - t > self.keep_live_ns]
        if len(self.lives) - len(stale) > self.max_lives:
            stale += sorted(self.newest_ns, key=self.newest_ns.get)[:len(self.lives) - self.max_lives]
        for life in stale:
            self.take(life)


# ---- the thread ---------------------------------------------------------------------------------------------------

class RequestTracer:
    """Builds and emits the traces of finished requests on its own thread (``start``/``stop``).

    ``tracer``: an OpenTelemetry Tracer; ``recorder``: the flight recorder (ipc.recorder.Recorder) or None (then
    a trace is its root span only); ``config``: the EngineConfig (stage deadlines, ``request_timeout_s``);
    ``actor_names``: the actor table's names by index. ``counts``: ``traced`` requests, ``dropped`` ones (the
    pending deque was full), ``failed`` ones (building or emitting raised), and the exporter's ``spans_exported``
    / ``spans_failed`` (``CountingExporter``)."""

    def __init__(self, tracer, recorder, config, actor_names: tuple[str, ...] = (), provider=None,
                 poll_s: float = POLL_S, settle_s: float = SETTLE_S, max_pending: int = MAX_PENDING):
        import dataclasses

        from ipc.timeline import stage_deadlines

        self.tracer, self.recorder, self.provider = tracer, recorder, provider
        self.actor_names = actor_names
        self.limits = stage_deadlines(dataclasses.asdict(config))
        self.poll_s, self.settle_ns, self.max_pending = poll_s, int(settle_s * 1e9), max_pending
        self.buffer = EventBuffer(config.request_timeout_s + 60.0)
        self.counts = collections.Counter({"traced": 0, "dropped": 0, "failed": 0, "spans_exported": 0,
                                           "spans_failed": 0, "recorder_lapped": 0})
        self._incoming: collections.deque[RequestFacts] = collections.deque()
        self._pending: list[RequestFacts] = []
        self._seen: list[int] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def submit(self, facts: RequestFacts) -> None:
        """Queue a finished request (any thread; never blocks): over ``max_pending`` waiting, it is dropped."""
        if len(self._incoming) + len(self._pending) >= self.max_pending:
            self.counts["dropped"] += 1
            return
        self._incoming.append(facts)

    def start(self) -> None:
        if self.recorder is not None:   # from now on: earlier events belong to no request traced here
            _, self._seen, _ = self.recorder.events_since(None)
        self._thread = threading.Thread(target=self._run, name="otel-traces", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Trace what is pending (without waiting for releases), stop the thread, then flush and shut the SDK
        down, giving up after ``timeout_s`` (a collector that is down must not hold the process)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self.provider is not None:
            done = threading.Thread(target=self.provider.shutdown, name="otel-shutdown", daemon=True)
            done.start()
            done.join(timeout_s)

    def _run(self) -> None:
        while True:
            stopping = self._stop.wait(self.poll_s)
            try:
                self.step(time.monotonic_ns(), final=stopping)
            except Exception:  # noqa: BLE001 - the tracer must never die; the next poll retries
                log.exception("tracing: reading the flight recorder failed")
            if stopping:
                return

    def step(self, now_ns: int, final: bool = False) -> None:
        """One poll: read the recorder's new events, emit each pending request whose rows are all released (or
        that waited ``settle_s``; every one when ``final``), forget stale events."""
        if self.recorder is not None:
            events, self._seen, lost = self.recorder.events_since(self._seen)
            self.counts["recorder_lapped"] += lost
            self.buffer.add(events)
        while self._incoming:
            self._pending.append(self._incoming.popleft())
        waiting = []
        for facts in self._pending:
            lives = [(slot, gen) for _, slot, gen, _, _ in facts.choices]
            if final or self.recorder is None or now_ns - facts.end_ns > self.settle_ns or \
                    all(self.buffer.released(life) for life in lives):
                self._emit(facts, now_ns)
            else:
                waiting.append(facts)
        self._pending = waiting
        self.buffer.prune(now_ns)

    def timelines(self, facts: RequestFacts, now_ns: int) -> list[tuple[int, dict[str, Any], int]]:
        from ipc.timeline import build_timeline

        out = []
        for index, slot, gen, _, _ in sorted(facts.choices):
            events = self.buffer.take((slot, gen))
            if events is not None:
                timeline = build_timeline(events, now_ns, self.limits, self.actor_names, facts.request_id)
                out.append((index, timeline, now_ns - round(timeline["started_ago_s"] * 1e9)))
        return out

    def _emit(self, facts: RequestFacts, now_ns: int) -> None:
        try:
            emit(self.tracer, span_plan(facts, self.timelines(facts, now_ns)), facts)
            self.counts["traced"] += 1
        except Exception:  # noqa: BLE001 - one request's trace, never the thread
            self.counts["failed"] += 1
            log.exception("tracing: the trace of request %s could not be built", facts.request_id)

    def collector(self):
        """A prometheus_client collector of ``counts``: pdserve_traces_total{outcome} and
        pdserve_trace_spans_total{outcome}, pdserve_trace_recorder_events_lost_total."""
        from prometheus_client.core import CounterMetricFamily

        counts = self.counts

        class Collector:
            def collect(self):
                traces = CounterMetricFamily("pdserve_traces", "requests' OpenTelemetry traces by outcome "
                                             "(dropped: the tracer's queue was full)", labels=["outcome"])
                for outcome in ("traced", "dropped", "failed"):
                    traces.add_metric([outcome], counts[outcome])
                spans = CounterMetricFamily("pdserve_trace_spans", "spans the OTLP exporter sent, by outcome",
                                            labels=["outcome"])
                spans.add_metric(["exported"], counts["spans_exported"])
                spans.add_metric(["failed"], counts["spans_failed"])
                lapped = CounterMetricFamily("pdserve_trace_recorder_events_lost", "flight-recorder events "
                                             "overwritten before the tracer read them (their spans miss stages)")
                lapped.add_metric([], counts["recorder_lapped"])
                return [traces, spans, lapped]

        return Collector()


def emit(tracer, plan: list[SpanSpec], facts: RequestFacts) -> None:
    """Start and end ``plan``'s spans on an OpenTelemetry ``tracer`` (times converted to the wall clock), the
    root's parent being the caller's ``traceparent`` when it sent a valid one."""
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    caller = TraceContextTextMapPropagator().extract(facts.carrier)
    wall = facts.wall_offset_ns
    spans = []
    for spec in plan:
        context = caller if spec.parent is None else trace.set_span_in_context(spans[spec.parent])
        span = tracer.start_span(spec.name, context=context, kind=SpanKind.SERVER if spec.server else
                                 SpanKind.INTERNAL, attributes=spec.attributes, start_time=spec.start_ns + wall)
        for name, t_ns, attributes in spec.events:
            span.add_event(name, attributes, timestamp=t_ns + wall)
        if spec.error is not None:
            span.set_status(Status(StatusCode.ERROR, spec.error))
        spans.append(span)
    for span, spec in reversed(list(zip(spans, plan))):
        span.end(end_time=spec.end_ns + wall)


# ---- the HTTP side ------------------------------------------------------------------------------------------------

class TraceContextMiddleware:
    """Plain ASGI for `pdserve router`: sets ``INCOMING`` to the trace headers the router's calls to the nodes
    (api/router_client.py) carry while the request is served. With ``tracer`` (an OpenTelemetry tracer: the
    router's ``--otlp-traces-endpoint``), each ``/v1/`` request gets the router's own SERVER span, the client's
    ``traceparent`` as its parent, and the nodes' traces join it as its children: one trace per request, with or
    without a client ``traceparent``. Without one, the client's headers are forwarded as they came."""

    def __init__(self, app, tracer=None):
        self.app, self.tracer = app, tracer

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        carrier = trace_headers(scope)
        span = self._start_span(scope, carrier) if self.tracer is not None else None
        outgoing = carrier if span is None else _context_headers(span)
        token = INCOMING.set(outgoing)

        async def send_noting(message: dict) -> None:
            if span is not None and message["type"] == "http.response.start":
                span.set_attribute("http.response.status_code", int(message["status"]))
                if int(message["status"]) >= 500:
                    from opentelemetry.trace import Status, StatusCode

                    span.set_status(Status(StatusCode.ERROR))
            await send(message)

        try:
            await self.app(scope, receive, send_noting)
        finally:
            INCOMING.reset(token)
            if span is not None:
                span.end()

    def _start_span(self, scope: dict, carrier: dict[str, str]):
        """The router's SERVER span of a ``/v1/`` request (None for other paths, or when it cannot start: tracing
        never costs an answer)."""
        path = scope.get("path", "")
        if not path.startswith("/v1/"):
            return None
        try:
            from opentelemetry.trace import SpanKind
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

            method = scope.get("method", "")
            request_id = dict(scope.get("headers") or ()).get(b"x-request-id", b"").decode("latin-1")
            attributes = {"http.request.method": method, "url.path": path, "pdserve.role": "router"}
            if request_id:
                attributes["gen_ai.request.id"] = request_id
            return self.tracer.start_span(f"{method} {path}", context=TraceContextTextMapPropagator().extract(carrier),
                                          kind=SpanKind.SERVER, attributes=attributes)
        except Exception:  # noqa: BLE001 - tracing never costs an answer
            log.exception("tracing: the router's span of %s could not start", path)
            return None


def _context_headers(span) -> dict[str, str]:
    """The W3C headers (``traceparent``, ``tracestate``) that make ``span`` the parent of a node's trace."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    headers: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(headers, context=trace.set_span_in_context(span))
    return headers


class TraceMiddleware:
    """Plain ASGI: a ``TraceNote`` per HTTP request in ``scope["pdserve.trace"]``; when the exchange ends (the
    app returned), a request the engine admitted goes to ``tracer.submit``."""

    def __init__(self, app, tracer: RequestTracer):
        self.app, self.tracer = app, tracer

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start_ns = time.monotonic_ns()
        carrier = trace_headers(scope)
        note = TraceNote(start_ns, time.time_ns() - start_ns, scope.get("method", ""), scope.get("path", ""),
                         carrier)
        scope["pdserve.trace"] = note

        async def send_noting(message: dict) -> None:
            if message["type"] == "http.response.start":
                note.status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_noting)
        finally:
            if note.handles:
                try:
                    self.tracer.submit(request_facts(note, time.monotonic_ns()))
                except Exception:  # noqa: BLE001 - tracing never costs an answer
                    log.exception("tracing: request %s not traced", note.path)


# ---- the SDK --------------------------------------------------------------------------------------------------------

class QuietSdkLog(logging.Filter):
    """On a log handler: lets one record of the OpenTelemetry SDK's loggers (names starting ``opentelemetry``)
    through per ``interval_s`` (a collector that is down makes the exporter log every retry and every failed
    batch); the next one let through says how many were left out. Other records pass untouched."""

    def __init__(self, interval_s: float = 60.0, clock=time.monotonic):
        super().__init__()
        self.interval_s, self.clock = interval_s, clock
        self.last_s = -float("inf")
        self.left_out = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("opentelemetry"):
            return True
        now = self.clock()
        if now - self.last_s < self.interval_s:
            self.left_out += 1
            return False
        if self.left_out:   # no "%" in the suffix: the record's own formatting is untouched
            record.msg = f"{record.msg} (and {self.left_out} more OpenTelemetry log records left out in the last " \
                         f"{now - self.last_s:.0f} s)"
        self.last_s, self.left_out = now, 0
        return True


def otlp_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of ``endpoint``: as given, or with ``/v1/traces`` when it has no path."""
    scheme, _, rest = endpoint.partition("://")
    return endpoint if "/" in rest.strip("/") else f"{scheme}://{rest.rstrip('/')}/v1/traces"


def counting_exporter(inner, counts: collections.Counter):
    """``inner`` (an SDK SpanExporter) counting the spans each export sent or failed into ``counts``."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class CountingExporter(SpanExporter):
        def export(self, spans):
            result = inner.export(spans)
            counts["spans_exported" if result is SpanExportResult.SUCCESS else "spans_failed"] += len(spans)
            return result

        def shutdown(self):
            inner.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return inner.force_flush(timeout_millis)

    return CountingExporter()


def start_router_tracer(config):
    """``(tracer, provider)`` of `pdserve router`'s own spans (``TraceContextMiddleware``), exporting to
    ``config.otlp_traces_endpoint`` in batches (never on the request path); None when that is empty. The
    resource's ``service.name`` is ``OTEL_SERVICE_NAME`` or "pdserve-router". ``provider.shutdown()`` flushes."""
    if not config.otlp_traces_endpoint:
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or "pdserve-router",
                                "service.instance.id": str(os.getpid())})
    provider = TracerProvider(resource=resource)
    exporter = OTLPSpanExporter(endpoint=otlp_url(config.otlp_traces_endpoint), timeout=EXPORT_TIMEOUT_S)
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    quiet = QuietSdkLog()
    for handler in logging.getLogger().handlers:
        handler.addFilter(quiet)
    log.info("tracing: the router's spans go to %s (OTLP/HTTP)", otlp_url(config.otlp_traces_endpoint))
    return provider.get_tracer("pdserve.router"), provider


def start_tracer(config, recorder, actor_names: tuple[str, ...], engine_id: str = "") -> RequestTracer | None:
    """A started RequestTracer exporting to ``config.otlp_traces_endpoint``; None when that is empty. The
    resource's ``service.name`` is ``OTEL_SERVICE_NAME`` or "pdserve"."""
    if not config.otlp_traces_endpoint:
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or "pdserve",
                                "service.instance.id": engine_id or str(os.getpid())})
    provider = TracerProvider(resource=resource)
    tracer = RequestTracer(provider.get_tracer("pdserve"), recorder, config, actor_names, provider)
    exporter = OTLPSpanExporter(endpoint=otlp_url(config.otlp_traces_endpoint), timeout=EXPORT_TIMEOUT_S)
    provider.add_span_processor(BatchSpanProcessor(counting_exporter(exporter, tracer.counts),
                                                   schedule_delay_millis=500))
    tracer.start()
    quiet = QuietSdkLog()
    for handler in logging.getLogger().handlers:   # the process's log lines (api/server.py's basicConfig)
        handler.addFilter(quiet)
    if recorder is None:
        log.warning("tracing: the flight recorder is off (recorder_events=0): traces carry the HTTP span only")
    log.info("tracing: requests' traces go to %s (OTLP/HTTP)", otlp_url(config.otlp_traces_endpoint))
    return tracer
