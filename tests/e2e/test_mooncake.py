"""The engine with ``--kv-transport mooncake`` (1 prefill x 1 decode, one host): the KV handoff goes through
the Mooncake Transfer Engine over loopback TCP, and the greedy answer is the one the cpu-shm engine gives
(tests/e2e/test_serve.py). Skipped, with the import error as the reason, without the mooncake extra."""
from __future__ import annotations

import httpx
import pytest

try:   # an optional extra: the one place a missing library is a skip
    import mooncake.engine  # noqa: F401
except ImportError as exc:
    pytest.skip(f"the mooncake extra is missing ({exc}); make test-mooncake installs it", allow_module_level=True)

from tests.conftest import EngineProbe, FRANCE_QUESTION, assert_recovered, cleanup_engine, scrape, start_engine  # noqa: E402

FRANCE = [{"role": "user", "content": FRANCE_QUESTION}]
LONG = [{"role": "system", "content": "You are a geography tutor. Answer in one short sentence, naming the city "
                                      "first, and do not add any other facts, dates or numbers to the answer."},
        *FRANCE]


def test_a_mooncake_handoff_serves_the_cpu_shm_greedy_answer(tmp_path):
    engine = start_engine(tmp_path, "--kv-transport", "mooncake", "--kv-pool-tokens", "2048")
    probe = EngineProbe(engine.engine_id)
    try:
        answer = httpx.post(engine.base_url + "/v1/chat/completions", timeout=120,
                            json={"messages": FRANCE, "temperature": 0, "max_tokens": 32}).json()
        assert answer["choices"][0]["message"]["content"].startswith("The capital of France is Paris."), answer
        long = httpx.post(engine.base_url + "/v1/chat/completions", timeout=120,
                          json={"messages": LONG, "temperature": 0, "max_tokens": 16}).json()
        assert long["usage"]["prompt_tokens"] > 3 * 16   # the handoff carries several blocks
        assert "Paris" in long["choices"][0]["message"]["content"], long
        metrics = scrape(engine.base_url)
        assert metrics["pdserve_kv_handoffs_total"] == 2
        assert metrics["pdserve_kv_transfer_bytes_total"] > 0
        assert_recovered(engine, probe)
        assert "Traceback" not in engine.log_text()
    finally:
        probe.close()
        cleanup_engine(engine)
