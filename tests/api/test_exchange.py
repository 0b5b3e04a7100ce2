"""api/exchange.py's Exchange over a fake engine client (scripted token events, a count of the rows it holds) and
the real renderers of each dialect, driven as an ASGI app: admission refused, the client gone mid-stream and
mid-answer, an engine error mid-stream, a renderer's bug after admission, each renderer called in order."""
from __future__ import annotations

import asyncio
import types

import orjson
import pytest
from starlette.applications import Starlette
from starlette.routing import Route

from api.admission import RequestHandle
from api.dialects import anthropic, openai, responses
from api.exchange import Engine, Exchange
from api.protocol import GenerationRequest, error_body
from ipc.recorder import ClosedBy, EventKind, request_key
from pdserve.errors import EngineOverloadedError, RequestFailedError
from pdserve.sampling import Sampling

WORDS = ["Hello", " there", ",", " friend", "."]
HANG = "hang"   # a script's last entry: no more events (the engine is still working)


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True, keep=frozenset()) -> str:
        return "".join(WORDS[i] for i in ids)

    def special_ids_of(self, texts) -> frozenset:
        return frozenset()


class FakeClient:
    """The engine client's interface; ``script``: the events each admitted sequence gets (HANG: then none)."""

    def __init__(self, script: list, refuse: Exception | None = None):
        self.config = types.SimpleNamespace(body_read_timeout_s=5.0, sse_ping_interval_s=0.0)
        self.script, self.refuse = script, refuse
        self.held: set[tuple[int, int]] = set()   # rows admitted and not finished: the admission gauge
        self.finished: list[list] = []
        self.next_slot = 0

    def check_room(self, sequences: int) -> None:
        pass

    def submit(self, request: GenerationRequest) -> list[RequestHandle]:
        if self.refuse is not None:
            raise self.refuse
        handles = []
        for k in range(request.n):
            self.next_slot += 1
            handle = RequestHandle(request, self.next_slot, 1, index=request.first_index + k)
            for event in self.script:
                if event == HANG:
                    break
                handle.events.put_nowait(event)
            self.held.add(handle.key)
            handles.append(handle)
        return handles

    async def next_event(self, handle: RequestHandle) -> tuple:
        return await handle.events.get()

    def stop_generation(self, handle: RequestHandle) -> None:
        pass

    def finish_all(self, handles: list[RequestHandle]) -> None:
        self.finished.append(list(handles))
        for h in handles:
            self.held.discard(h.key)


class FakeMetrics:
    def __init__(self):
        self.admitted, self.counted = 0, []

    def on_admitted(self) -> None:
        self.admitted += 1

    def on_token(self, gap_s: float) -> None:
        pass

    def on_finished(self, handle, reason, status: int = 200) -> None:
        self.counted.append((reason, status))


def tokens(*ids: int, reason: str = "stop") -> list[tuple]:
    return [("token", i, reason if k == len(ids) - 1 else None, None) for k, i in enumerate(ids)]


def chat_request(stream: bool, n: int = 1, request_id: str = "x-1") -> GenerationRequest:
    return GenerationRequest("chat", request_id, "m", [1, 2, 3], Sampling(max_tokens=8), stream=stream, n=n)


class Spy:
    """A real renderer, its calls noted in ``calls`` (the method names, in order); ``broken``: a method that
    raises (a renderer's bug)."""

    def __init__(self, renderer, calls: list, broken: str | None = None):
        self.renderer, self.calls, self.broken = renderer, calls, broken

    def __getattr__(self, name):
        value = getattr(self.renderer, name)
        if name not in ("start", "event", "finish", "failed"):
            return value

        def call(*args):
            self.calls.append(name)
            if name == self.broken:
                raise RuntimeError(f"{name} broke")
            return value(*args)
        return call


class SpyDialect:
    """A dialect whose body is ignored: ``request`` is admitted and rendered by ``make(handles)``, spied on."""

    def __init__(self, request: GenerationRequest, make, broken: str | None = None,
                 error_shape=error_body):
        self.request, self.make, self.broken, self.error_body = request, make, broken, error_shape
        self.calls: list[str] = []

    def build(self, body) -> list[GenerationRequest]:
        return [self.request]

    def renderer(self, handles):
        return Spy(self.make(handles), self.calls, self.broken)


def app_of(client: FakeClient, dialect, metrics: FakeMetrics | None = None) -> Starlette:
    engine = Engine(client, FakeTokenizer(), None, metrics or FakeMetrics())

    async def endpoint(request):
        return await Exchange(engine, request, dialect).run()
    return Starlette(routes=[Route("/x", endpoint, methods=["POST"])])


async def drive(app, gone_after: int | None = None, deadline_s: float = 5.0) -> tuple[int, list[bytes]]:
    """POST ``{}`` to ``app``; the client goes away (``http.disconnect``) once it has ``gone_after`` body pieces
    (None: it stays). Returns the status and the body pieces."""
    gone = asyncio.Event()
    sent: list[dict] = []
    body = b"{}"
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/x", "raw_path": b"/x", "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    requests = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        if requests:
            return requests.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        pieces = [m for m in sent if m["type"] == "http.response.body" and m.get("body")]
        if gone_after is not None and len(pieces) >= gone_after:
            gone.set()

    if gone_after == 0:
        gone.set()
    await asyncio.wait_for(app(scope, receive, send), deadline_s)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, [m["body"] for m in sent if m["type"] == "http.response.body" and m.get("body")]


def closed(ring, request_id: str) -> list[tuple[int, int]]:
    """``(aux, a)`` of the request's CLOSED events: who closed it, and the status."""
    events = ring.events()
    mine = events[(events["key"] == request_key(request_id)) & (events["kind"] == EventKind.CLOSED)]
    return [(int(e["aux"]), int(e["a"])) for e in mine]


def test_a_refused_admission_is_the_dialects_error_and_nothing_is_held():
    client = FakeClient(tokens(0), refuse=EngineOverloadedError("the queues are full; retry"))
    dialect = SpyDialect(chat_request(stream=False), lambda h: openai.ChatAnswer(FakeTokenizer(), h),
                         error_shape=anthropic.error_body)
    status, body = asyncio.run(drive(app_of(client, dialect)))
    assert status == 503
    answer = orjson.loads(b"".join(body))
    assert answer["type"] == "error" and answer["error"]["type"] == "overloaded_error"   # the dialect's shape
    assert dialect.calls == [] and client.held == set()


def test_a_full_answer_is_collected_counted_and_released(ring):
    client, metrics = FakeClient(tokens(0, 1, 2, 3)), FakeMetrics()
    dialect = SpyDialect(chat_request(stream=False, n=2), lambda h: openai.ChatAnswer(FakeTokenizer(), h))
    status, body = asyncio.run(drive(app_of(client, dialect, metrics)))
    answer = orjson.loads(b"".join(body))
    assert status == 200 and [c["message"]["content"] for c in answer["choices"]] == ["Hello there, friend"] * 2
    assert dialect.calls == ["event"] * 8 + ["finish"]
    assert client.held == set() and metrics.admitted == 2 and metrics.counted == [("stop", 200)] * 2
    assert closed(ring, "x-1") == [(ClosedBy.SERVER, 200)] * 2


def test_a_client_gone_before_the_full_answer_gets_499_and_the_rows_are_released(ring):
    client, metrics = FakeClient(tokens(0, reason=None) + [HANG]), FakeMetrics()
    dialect = SpyDialect(chat_request(stream=False), lambda h: openai.ChatAnswer(FakeTokenizer(), h))
    status, _ = asyncio.run(drive(app_of(client, dialect, metrics), gone_after=0))
    assert status == 499 and "finish" not in dialect.calls
    assert client.held == set() and metrics.counted == [("abort", 499)]
    assert closed(ring, "x-1") == [(ClosedBy.CLIENT, 499)]


def test_a_client_gone_mid_stream_aborts_the_request(ring):
    client, metrics = FakeClient(tokens(0, 1, reason=None) + [HANG]), FakeMetrics()
    dialect = SpyDialect(chat_request(stream=True), lambda h: openai.ChatStream(FakeTokenizer(), h))
    status, body = asyncio.run(drive(app_of(client, dialect, metrics), gone_after=2))
    assert status == 200 and len(body) == 2 and b"Hello" in body[0]
    assert dialect.calls == ["start", "event", "event"]
    assert client.held == set() and client.finished and metrics.counted == [("abort", 499)]
    assert closed(ring, "x-1") == [(ClosedBy.CLIENT, 499)]


def test_an_engine_error_mid_stream_is_the_dialects_error_event_and_the_rows_are_released(ring):
    error = RequestFailedError("the decode actor died; retry")
    client, metrics = FakeClient(tokens(0, 1, reason=None) + [("error", error)]), FakeMetrics()
    request = chat_request(stream=True, request_id="msg-1")
    dialect = SpyDialect(request, lambda h: anthropic.MessagesRenderer(h, "msg_1"))
    status, body = asyncio.run(drive(app_of(client, dialect, metrics)))
    frames = b"".join(body).decode()
    assert status == 200 and frames.startswith("event: message_start")
    last = orjson.loads(frames.strip().rsplit("data: ", 1)[1])
    assert last["type"] == "error" and last["error"]["type"] == "overloaded_error"
    assert "tools/inspect --request msg-1" in last["error"]["message"]   # the timeline hint, as chat's has
    assert dialect.calls == ["start", "event", "event", "failed"]
    assert client.held == set() and metrics.counted == [("error", 503)]
    assert closed(ring, "msg-1") == [(ClosedBy.SERVER, 503)]


@pytest.mark.parametrize("stream, broken", [(True, "start"), (True, "event"), (True, "finish"), (False, "event"),
                                            (False, "finish")])
def test_a_renderer_that_breaks_after_admission_releases_every_row(ring, broken, stream):
    """A bug met after admission (rendering, serialising) still releases the rows: the admission gauge is 0. A
    stream ends with the dialect's error event (its headers are out); a full answer is a 500 in the dialect's shape."""
    client, metrics = FakeClient(tokens(0, 1)), FakeMetrics()
    request = chat_request(stream=stream)
    dialect = SpyDialect(request, lambda h: (openai.ChatStream if stream else openai.ChatAnswer)(FakeTokenizer(), h),
                         broken=broken)
    status, pieces = asyncio.run(drive(app_of(client, dialect, metrics)))
    assert status == (200 if stream else 500) and b'"internal error; see the server log"' in b"".join(pieces)
    assert client.held == set() and metrics.admitted == 1 and metrics.counted == [("error", 500)]
    assert closed(ring, "x-1") == [(ClosedBy.SERVER, 500)]


def responses_renderer(handles, stream: bool, kept: list):
    meta = responses.ResponseMeta("resp_1", "m", {"stream": stream})
    return responses.ResponsesRenderer(handles, meta, stream, lambda outcome, response: kept.append(response))


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("dialect_name", ["chat", "responses", "messages"])
def test_each_dialects_renderer_is_called_in_order(dialect_name, stream):
    kept: list = []
    make = {"chat": lambda h: (openai.ChatStream if stream else openai.ChatAnswer)(FakeTokenizer(), h),
            "responses": lambda h: responses_renderer(h, stream, kept),
            "messages": lambda h: anthropic.MessagesRenderer(h, "msg_1")}[dialect_name]
    client = FakeClient(tokens(0, 1, 2, 3, 4))
    dialect = SpyDialect(chat_request(stream=stream), make)
    status, body = asyncio.run(drive(app_of(client, dialect)))
    assert status == 200 and client.held == set()
    assert dialect.calls == (["start"] if stream else []) + ["event"] * 5 + ["finish"]
    text = b"".join(body).decode()
    assert "Hello" in text and " friend" in text
    if stream:
        assert {"chat": "data: [DONE]", "responses": "event: response.completed",
                "messages": "event: message_stop"}[dialect_name] in text
    if dialect_name == "responses":
        assert kept and kept[0]["status"] == "completed"
