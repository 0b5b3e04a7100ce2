"""llama.cpp's stream telemetry (api/llama_timings.py): the timings object, fields added to SSE frames, and an
exchange's progress chunks and timings from real RequestHandles over a fake clock."""
from __future__ import annotations

import orjson
import pytest

from api.admission import RequestHandle
from api.llama_timings import Telemetry, timings, with_fields
from api.protocol import GenerationRequest, Sampling


def test_rates_are_over_the_steps_after_the_first_token_and_zero_never_divides():
    t = timings(prompt_n=100, prompt_ms=50.0, predicted_n=11, predicted_ms=200.0, cache_n=28)
    assert t["prompt_per_second"] == pytest.approx(2000.0) and t["prompt_per_token_ms"] == pytest.approx(0.5)
    assert t["predicted_per_second"] == pytest.approx(50.0) and t["predicted_per_token_ms"] == pytest.approx(20.0)
    assert t["cache_n"] == 28
    one = timings(0, 0.0, 1, 0.0, 0)   # one token: it came with the prompt, no decode step to rate
    assert one["predicted_per_second"] == one["prompt_per_second"] == one["predicted_per_token_ms"] == 0.0


def test_fields_go_into_the_data_lines_object_and_nothing_else_changes():
    chat = b'data: {"id":"x","choices":[]}\n\n'
    assert orjson.loads(with_fields(chat, {"timings": {"a": 1}})[6:]) == {"id": "x", "choices": [],
                                                                            "timings": {"a": 1}}
    event = b'event: response.completed\ndata: {"type":"response.completed"}\n\n'
    out = with_fields(event, {"timings": {}})
    assert out.startswith(b"event: response.completed\ndata: ") and out.endswith(b"}\n\n")
    assert orjson.loads(out.split(b"data: ", 1)[1]) == {"type": "response.completed", "timings": {}}
    for frame in (b"data: [DONE]\n\n", b": ping\n\n"):
        assert with_fields(frame, {"timings": {}}) == frame


def handle(per_token: bool, progress: bool) -> RequestHandle:
    request = GenerationRequest("chat", "r1", "m", list(range(40)), Sampling(max_tokens=8), stream=True,
                                timings_per_token=per_token, return_progress=progress)
    return RequestHandle(request, slot=0, generation=1, admitted_ns=1_000_000_000)


class Clock:
    def __init__(self):
        self.ns = 0

    def __call__(self) -> int:
        return self.ns


def test_progress_before_the_first_token_then_timings_in_every_frame():
    h, clock = handle(True, True), Clock()
    telemetry = Telemetry.of([h], clock)
    h.first_token_ns, h.completion_tokens = 1_300_000_000, 1
    h.timings = {"prefill_s": 0.2, "cached_tokens": 16}
    clock.ns = 1_300_000_000
    made = []

    def progress_frames(p):
        made.append(p)
        return [b'data: {"progress":' + orjson.dumps(p) + b"}\n\n"]

    frames = telemetry.opening(progress_frames) + telemetry.decorate([b'data: {"n":1}\n\n'])
    assert made == [{"total": 40, "cache": 16, "processed": 16, "time_ms": 0.0},
                    {"total": 40, "cache": 16, "processed": 40, "time_ms": pytest.approx(200.0)}]
    bodies = [orjson.loads(f[6:]) for f in frames]
    assert [b["timings"]["prompt_n"] for b in bodies] == [0, 24, 24]
    assert bodies[0]["timings"]["prompt_ms"] == 0.0 and bodies[2]["timings"]["prompt_ms"] == pytest.approx(200.0)
    h.completion_tokens, clock.ns = 5, 1_400_000_000
    assert telemetry.opening(progress_frames) == []   # progress once
    later = orjson.loads(telemetry.decorate([b'data: {"n":2}\n\n'])[0][6:])
    assert len(made) == 2   # progress once
    assert later["timings"]["predicted_n"] == 5 and later["timings"]["predicted_ms"] == pytest.approx(100.0)
    assert later["timings"]["predicted_per_second"] == pytest.approx(40.0)


def test_only_what_was_asked_for():
    assert Telemetry.of([handle(False, False)]) is None
    h = handle(False, True)
    h.first_token_ns = h.admitted_ns + 5_000_000   # no prefill_s: admission to first token
    telemetry = Telemetry.of([h])
    frames = telemetry.opening(lambda p: [orjson.dumps(p)]) + telemetry.decorate([b'data: {"n":1}\n\n'])
    assert [orjson.loads(f) for f in frames[:2]][1]["time_ms"] == pytest.approx(5.0)
    assert frames[2] == b'data: {"n":1}\n\n'   # no timings unless timings_per_token
