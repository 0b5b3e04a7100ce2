"""End-to-end: pdserve started in llama-server's place by tools/llama_server_shim.py with the flags llama.cpp's
server test suite passes (tools/llama_suite.sh runs that suite; this module keeps what it found fixed): the flags
mapped or dropped, any ``model`` name accepted (``--served-model-name ALIAS,*``), ``system_fingerprint`` on chat
and completions answers and chunks, llama.cpp's embedding input shapes, and a clean stop on the suite's SIGTERM
(no process, no /dev/shm segment); llama.cpp's /apply-template; its ``timings_per_token`` and
``return_progress`` stream telemetry."""
from __future__ import annotations

import json
import sys

import httpx
import pytest

from tests.conftest import ROOT, cleanup_engine, descendants, shm_segments, start_engine, wait_until

# what llama.cpp's tests/utils.py passes for its tinyllama2 preset with embeddings on (its order)
LLAMA_FLAGS = ("--temp", "0.8", "--seed", "42", "--host", "127.0.0.1", "--offline", "--hf-repo",
               "ggml-org/test-model-stories260K", "--batch-size", "32", "--embedding", "--no-slots", "--pooling",
               "last", "--alias", "tinyllama-2", "--ctx-size", "512", "--parallel", "2", "--n-predict", "64",
               "--no-jinja")
BOOK = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = start_engine(tmp_path_factory.mktemp("llama"), *LLAMA_FLAGS,
                       command=[sys.executable, str(ROOT / "tools" / "llama_server_shim.py")])
    yield eng
    cleanup_engine(eng)


@pytest.fixture(scope="module")
def http(engine):
    with httpx.Client(base_url=engine.base_url, timeout=120) as client:
        yield client


def test_the_shim_maps_host_port_alias_and_context_and_names_what_it_dropped(engine, http):
    dropped = [line for line in engine.log_text().splitlines() if "dropped llama.cpp-only flags" in line]
    assert dropped == ["llama_server_shim: dropped llama.cpp-only flags: --temp 0.8 --seed 42 --hf-repo "
                       "ggml-org/test-model-stories260K --batch-size 32 --n-predict 64"]
    models = http.get("/v1/models").json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [("tinyllama-2", 512)]


def test_any_model_name_is_served_under_the_alias_as_llama_server_does(http):
    chat = http.post("/v1/chat/completions", json={"model": "gpt-3.5-turbo", "messages": BOOK, "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["model"] == "tinyllama-2", chat.text
    messages = http.post("/v1/messages", json={"model": "test", "max_tokens": 2, "messages": BOOK[1:]})
    assert messages.status_code == 200 and messages.json()["type"] == "message", messages.text
    embedded = http.post("/v1/embeddings", json={"model": "text-embedding-3-small", "input": "a"})
    assert embedded.status_code == 200 and embedded.json()["model"] == "tinyllama-2", embedded.text
    assert http.get("/v1/models/gpt-4.1").status_code == 200


def test_chat_and_completions_answers_and_chunks_carry_a_system_fingerprint(http):
    chat = http.post("/chat/completions", json={"messages": BOOK, "max_tokens": 2}).json()
    comp = http.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2}).json()
    assert chat["system_fingerprint"] == comp["system_fingerprint"]
    assert chat["system_fingerprint"].startswith("pdserve-")
    stream = http.post("/v1/chat/completions", json={"messages": BOOK, "max_tokens": 2, "stream": True,
                                                     "stream_options": {"include_usage": True}})
    chunks = [json.loads(line[6:]) for line in stream.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert chunks and all(c["system_fingerprint"] == chat["system_fingerprint"] for c in chunks)


def test_llama_cpp_embedding_inputs_mixed_lists_and_prompt_objects(http):
    parts = {"content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}
    body = http.post("/v1/embeddings", json={"input": ["hello world", parts, [12, 34, "string", 56],
                                                       {"prompt_string": "x"}]})
    assert body.status_code == 200, body.text
    data = body.json()["data"]
    assert [d["index"] for d in data] == [0, 1, 2, 3] and data[0]["embedding"] == data[1]["embedding"]
    image = {"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
    refused = http.post("/v1/embeddings", json={"input": image})
    assert refused.status_code == 400 and "text only" in refused.json()["error"]["message"]
    too_long = http.post("/v1/embeddings", json={"input": "This is a test " * 512})
    assert too_long.status_code == 400 and "too large" in too_long.json()["error"]["message"]


def test_apply_template_answers_the_chat_prompt_as_llama_server_does(http):
    answer = http.post("/apply-template", json={"messages": BOOK})
    assert answer.status_code == 200 and "What is the best book" in answer.json()["prompt"], answer.text
    assert http.post("/apply-template", json={"messages": []}).status_code == 400


def sse_data(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def test_timings_per_token_and_return_progress_as_llama_server_streams_them(http):
    """llama.cpp's telemetry extensions (api/llama_timings.py) on chat, completions and Responses (``ignore_eos``:
    the counts are the limits whatever the greedy answer): two
    prompt_progress chunks before the first token (cache == processed, then processed == total), ``timings`` in
    every chunk and in a full answer; a non-boolean value is a 400 naming the field."""
    prompt = "This is a test " * 10
    chat = sse_data(http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 4, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}, "timings_per_token": True, "return_progress": True}).text)
    progress = [c["prompt_progress"] for c in chat if "prompt_progress" in c]
    assert [c["choices"] for c in chat if "prompt_progress" in c] == [[], []]
    assert len(progress) == 2 and progress[0]["processed"] == progress[0]["cache"] < progress[1]["processed"]
    assert progress[1]["processed"] == progress[1]["total"] == chat[-1]["usage"]["prompt_tokens"]
    assert progress[0]["time_ms"] == 0 < progress[1]["time_ms"]
    assert all("timings" in c for c in chat), chat
    last = chat[-1]["timings"]
    assert last["predicted_n"] == chat[-1]["usage"]["completion_tokens"] == 4
    assert last["prompt_n"] + last["cache_n"] == progress[1]["total"] and last["predicted_per_second"] > 0
    assert last["prompt_per_second"] > 0 and all(v >= 0 for v in last.values())

    full = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "ignore_eos": True,
                                              "timings_per_token": True}).json()
    assert full["timings"]["predicted_n"] == 3 and full["timings"]["prompt_per_token_ms"] > 0, full
    plain = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3}).json()
    assert "timings" not in plain

    events = sse_data(http.post("/v1/responses", json={
        "input": prompt, "max_output_tokens": 4, "stream": True, "timings_per_token": True,
        "return_progress": True}).text)
    shown = [e for e in events if "prompt_progress" in e]
    assert [e["type"] for e in shown] == ["response.in_progress"] * 2
    assert any(e["type"] == "response.output_text.delta" and "prompt_per_second" in e["timings"] for e in events)
    ended = events[-1]   # response.incomplete: max_output_tokens reached
    assert ended["type"] in ("response.completed", "response.incomplete"), ended
    assert ended["timings"]["predicted_n"] == ended["response"]["usage"]["output_tokens"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))

    bad = http.post("/v1/chat/completions", json={"messages": BOOK, "max_tokens": 2, "timings_per_token": "yes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "timings_per_token", bad.text


def test_sigterm_to_the_shims_pid_stops_the_engine_leaving_no_process_or_segment(engine):
    """llama.cpp's suite stops its server with SIGTERM and SIGKILLs it 5 s later: the shim exec'd pdserve, so
    the supervisor itself gets the signal and drains (--drain-timeout-s 2) well within that."""
    import psutil

    children = descendants(engine.proc.pid)
    assert children and engine.engine_id
    assert engine.stop(timeout_s=5) == 0, engine.log_text()[-3000:]

    def exited(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
    # the multiprocessing resource tracker (one of the children) exits last, by itself
    wait_until(lambda: all(exited(pid) for pid in children), 10, 0.1, "the engine's processes to exit")
    assert shm_segments(engine.engine_id) == []
    assert "Traceback" not in engine.log_text() and "leaked" not in engine.log_text(), engine.log_text()[-3000:]
