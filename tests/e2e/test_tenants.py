"""Issue 39 item 3: two API keys on one engine, as an attacker holding key B would try them against key A's
request, and the node routes' own credential.

Two real engines for the module: a plain one (keys A and B, an admin key) where ``/internal/*`` is not mounted, and
a prefill node on loopback (``--role prefill``, the same client keys, a node secret) where it is and takes only the
secret. The node is never given a request (its decode side would be another node): what is tested there is who
may call what, and the body limit.
"""
from __future__ import annotations

import concurrent.futures
import gzip

import httpx
import orjson
import pytest

from tests.conftest import EngineProbe, cleanup_engine, start_engine, wait_until

KEY_A, KEY_B, ADMIN = "sk-tenant-a", "sk-tenant-b", "sk-admin-only"
NODE_SECRET = "node-secret-e2e-0123456789abcdef"


def auth(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = start_engine(tmp_path_factory.mktemp("tenants"), "--kv-pool-tokens", "2048", "--api-key", KEY_A,
                       "--api-key", KEY_B, "--admin-key", ADMIN)
    yield eng
    cleanup_engine(eng)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    pytest.importorskip("mooncake.engine", reason="a prefill node moves its KV over the mooncake extra")
    tmp = tmp_path_factory.mktemp("tenant-node")
    secret = tmp / "node-secret"
    secret.write_text(NODE_SECRET + "\n")
    eng = start_engine(tmp, "--role", "prefill", "--kv-transport", "mooncake", "--kv-pool-tokens", "1024",
                       "--api-key", KEY_A, "--api-key", KEY_B, "--node-secret-file", str(secret))
    yield eng
    cleanup_engine(eng)


def stream_completion(base_url: str, key: str, request_id: str, max_tokens: int) -> tuple[list[dict], str]:
    """A streamed completion's chunks and its end (the finish reason, or the error the stream carried)."""
    body = {"prompt": "Count slowly from one to one hundred:", "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    chunks, end = [], "no end"
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=120,
                      headers={**auth(key), "x-request-id": request_id}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            if "error" in chunk:
                return chunks, f"error: {chunk['error']}"
            chunks.append(chunk)
            end = chunk["choices"][0].get("finish_reason") or end
    return chunks, end


def test_key_b_can_neither_see_nor_end_key_as_request(engine):
    """B's try at A's stream: the debug views are an admin's (403), the internal routes are not mounted on an
    engine that is no node (404 in the app's JSON shape); A's stream runs to its last token."""
    base = engine.base_url
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(stream_completion, base, KEY_A, "tenant-a-1", 64)
        probe = EngineProbe(engine.engine_id)
        try:
            rows = wait_until(lambda: probe.rows_with_id("tenant-a-1"), 60, 0.02, "A's request to hold a row")
        finally:
            probe.close()
        slot, generation = int(rows[0]["slot"]), int(rows[0]["generation"])
        for path in ("/debug/state", "/debug/requests/tenant-a-1"):
            seen = httpx.get(base + path, headers=auth(KEY_B), timeout=10)
            assert seen.status_code == 403 and "tenant-a-1" not in seen.text, (path, seen.text)
            assert seen.json()["error"]["code"] == "admin_key_required"
        for path, body in (("/internal/abort", {"rows": [[slot, generation]]}),
                           ("/internal/transfer_done", {"slot": slot, "generation": generation})):
            answer = httpx.post(base + path, json=body, headers=auth(KEY_B), timeout=10)
            assert answer.status_code == 404, (path, answer.text)
            assert answer.json()["error"]["type"] == "not_found_error"
        admin_view = httpx.get(base + "/debug/state", headers=auth(ADMIN), params={"sample_s": "0"}, timeout=10)
        assert admin_view.status_code == 200
        chunks, end = pending.result(timeout=120)
    assert end == "length" and sum(len(c["choices"][0]["text"]) > 0 for c in chunks) >= 32, (end, len(chunks))
    timeline = httpx.get(base + "/debug/requests/tenant-a-1", headers=auth(ADMIN), timeout=10)
    assert timeline.status_code == 200 and timeline.json()["timelines"]
    assert httpx.get(base + "/debug/requests/tenant-a-1", headers=auth(KEY_A), timeout=10).status_code == 403


def test_a_nodes_internal_routes_take_its_secret_and_no_client_key(node):
    base = node.base_url
    for headers in ({}, auth(KEY_A), auth(KEY_B), {"x-api-key": KEY_A}):
        assert httpx.get(base + "/internal/status", headers=headers, timeout=10).status_code == 401
        refused = httpx.post(base + "/internal/abort", json={"rows": [[0, 1]]}, headers=headers, timeout=10)
        assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Bearer")
    status = httpx.get(base + "/internal/status", headers=auth(NODE_SECRET), timeout=10)
    assert status.status_code == 200 and status.json()["role"] == "prefill"
    assert httpx.get(base + "/internal/state", headers=auth(NODE_SECRET), timeout=10).json()["role"] == "prefill"
    # the node secret opens nothing public, and a client key reads no debug view there either
    assert httpx.get(base + "/v1/models", headers=auth(NODE_SECRET), timeout=10).status_code == 401
    assert httpx.get(base + "/debug/state", headers=auth(NODE_SECRET), timeout=10).status_code == 401
    assert httpx.get(base + "/v1/models", headers=auth(KEY_A), timeout=10).status_code == 200


def test_an_internal_body_over_the_limit_is_a_413_plain_or_inflated(node):
    """MAX_BODY_BYTES (4 MiB, decoded) holds on the node routes as on the public ones: a 5 MiB body and a 20 KiB
    gzip body that inflates to 5 MiB are refused without being held."""
    base = node.base_url
    big = b'{"rows": [' + b"[0, 1], " * (5 * 1024 * 1024 // 8) + b"[0, 1]]}"
    plain = httpx.post(base + "/internal/abort", content=big, timeout=30,
                       headers={**auth(NODE_SECRET), "content-type": "application/json"})
    assert plain.status_code == 413, plain.text[:300]
    inflated = httpx.post(base + "/internal/transfer_done", content=gzip.compress(big), timeout=30,
                          headers={**auth(NODE_SECRET), "content-type": "application/json",
                                   "content-encoding": "gzip"})
    assert inflated.status_code == 413, inflated.text[:300]
    assert httpx.get(base + "/internal/status", headers=auth(NODE_SECRET), timeout=10).status_code == 200
