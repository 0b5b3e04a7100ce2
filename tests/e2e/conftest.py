"""The session-wide fault-injection engine shared by the scenario, inspect and metrics tests: faults are
aimed at single requests through X-Request-Id prefixes, deadlines are short. Tests that restart actors run
last (test_watchdog.py sorts after the others)."""
from __future__ import annotations

import pytest

from pdserve.faults import EXCHANGE_STEPS
from tests.conftest import cleanup_engine, probe_fixture, start_engine

TICK_S = 0.5
INFLIGHT_TIMEOUT_S = 2.0
BOOTSTRAP_TIMEOUT_S = 4.0   # above the hang timeout: a hung decode is reported as hung, not as a bootstrap timeout
HANG_TIMEOUT_S = 2.5
STUCK_GAUGE_S = 1.0
HTTP_SLACK_S = 0.75   # client-side overhead on a loaded 2-core machine
FAULTS = ";".join([
    "drop_transfer_done:match=drop-",
    "delay_transfer_done:seconds=2,match=late-",
    "transfer_stuck:match=stuck-",
    "transfer_unknown_status:match=unknown-",
    "bootstrap_silent:match=silent-",
    "decode_reject:match=reject-",
    "stall:actor=decode0,seconds=120,match=hang-",
    "stop_holding_lock:actor=decode0,match=lockstop-",
    "stall:actor=prefill0,seconds=120,match=hold-",
    "stall:actor=prefill0,seconds=1.5,match=slowp-",
    "slow_prefill:seconds=1.5,match=longp-",
    "stall_prefill:seconds=120,match=stallp-",
    *(f"exchange_bug:step={step},match=xbug-{step}-" for step in EXCHANGE_STEPS),
])
PREFILL_TIMEOUT_S = 4.0     # above the hang timeout, like the bootstrap deadline
PREFILL_CHUNK_TOKENS = 64


@pytest.fixture(scope="session")
def fault_engine(tmp_path_factory):
    # float32 weights: the deadlines and fills of these tests are sized for its step time (a batch that keeps the
    # decode pool full for longer than bootstrap_timeout_s); `auto` decodes several times faster
    eng = start_engine(tmp_path_factory.mktemp("watchdog"), "--kv-pool-tokens", "1024", "--weights", "float32",
                       env={"PDSERVE_FAULTS": FAULTS, "PDSERVE_INFLIGHT_TIMEOUT_S": str(INFLIGHT_TIMEOUT_S),
                            "PDSERVE_BOOTSTRAP_TIMEOUT_S": str(BOOTSTRAP_TIMEOUT_S),
                            "PDSERVE_PREFILL_TIMEOUT_S": str(PREFILL_TIMEOUT_S),
                            "PDSERVE_PREFILL_CHUNK_TOKENS": str(PREFILL_CHUNK_TOKENS),
                            "PDSERVE_MONITOR_TICK_S": str(TICK_S),
                            "PDSERVE_ACTOR_HANG_TIMEOUT_S": str(HANG_TIMEOUT_S),
                            "PDSERVE_QUEUE_TIMEOUT_S": "5", "PDSERVE_DECODE_WAITING_TIMEOUT_S": "5",
                            "PDSERVE_STUCK_GAUGE_S": str(STUCK_GAUGE_S)})
    yield eng
    cleanup_engine(eng)


fault_probe = probe_fixture("fault_engine", scope="session")
