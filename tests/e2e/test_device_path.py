"""End to end, the device path on CPU: `pdserve serve --kv-transport torch-ipc` (each actor's KV pool a tensor,
the prefill pool exported once through torch's reduce_tensor/rebuild path, the KVPool segments tables without
data) answers greedy prompts as the default cpu-shm engine does, serves again after its prefill actor is
SIGKILLed and restarted (the export's epoch path), and leaves no shm file once stopped. (`--device cuda` on a host
without a GPU: tests/actors/test_start_up.py.)"""
from __future__ import annotations

import os
import signal

import httpx
import pytest

from tests.conftest import EngineProbe, cleanup_engine, fully_healthy, start_engine, wait_until

PROMPTS = ["The three primary colors are", "def fibonacci(n):", "Once upon a time", "List the planets:"]


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    # no prefix cache: a prompt's blocks are reused by the next one (the restart test relies on it)
    eng = start_engine(tmp_path_factory.mktemp("twin"), "--kv-transport", "torch-ipc", "--kv-pool-tokens", "4096",
                       "--drain-timeout-s", "2", "--prefix-cache", "false")
    yield eng
    cleanup_engine(eng)


def greedy(engine, prompt: str, max_tokens: int = 24) -> str:
    response = httpx.post(engine.base_url + "/v1/completions", timeout=120,
                          json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def torch_files(pids) -> list[str]:
    """/dev/shm files torch's file_system sharing made in processes ``pids``."""
    return sorted(e for e in os.listdir("/dev/shm") if any(e.startswith(f"torch_{p}_") for p in pids))


def test_the_cpu_twin_transport_answers_greedy_prompts_as_the_cpu_shm_transport_does(twin, engine_factory):
    from gpu.cuda_ipc import open_export_segment, read_export
    from ipc.kv_pool import KVPool
    from ipc.naming import segment_name

    twin_texts = [greedy(twin, p) for p in PROMPTS]
    pool = KVPool.attach(segment_name(twin.engine_id, "kv_prefill0"), readonly=True)
    try:
        assert pool.data_bytes == 0   # the KV table only: the data is the actor's tensor
        export = open_export_segment(segment_name(twin.engine_id, "kv_prefill0.tipc"), create=False)
        record = read_export(export)
        export.close()
        probe = EngineProbe(twin.engine_id)
        assert (record.pid, record.pool_epoch, record.device) == (probe.pid("prefill0"), pool.epoch, -1)
        probe.close()
    finally:
        pool.close()
    shm = engine_factory("--kv-pool-tokens", "4096")
    assert [greedy(shm, p) for p in PROMPTS] == twin_texts
    assert all(len(t) > 20 for t in twin_texts), twin_texts


def test_a_request_completes_after_the_prefill_actor_is_killed_and_restarted_and_nothing_is_left(twin):
    probe = EngineProbe(twin.engine_id)
    try:
        before = greedy(twin, "The capital of Italy is")
        # a longer prompt then overwrites those blocks of the pool the killed actor exported, which stays mapped
        # in decode: a copy from it instead of the re-exported pool would give this prompt's KV to the next one
        greedy(twin, "A dragon slept on a hill of gold, and the villagers below told stories about it. " * 10, 2)
        pids = [probe.pid("prefill0"), probe.pid("decode0")]
        os.kill(pids[0], signal.SIGKILL)
        wait_until(lambda: probe.pid("prefill0") not in (0, pids[0]), 30, 0.1, "prefill0 restarted")
        wait_until(lambda: fully_healthy(twin.base_url), 300, 0.2, "/health 200 with the new prefill0 ready")
        pids.append(probe.pid("prefill0"))
        assert greedy(twin, "The capital of Italy is") == before   # read from the re-exported pool of the new epoch
    finally:
        probe.close()
    cleanup_engine(twin)
    wait_until(lambda: not torch_files(pids), 30, 0.1,
               "torch's shm manager to unlink the killed and the restarted prefill's pools")
