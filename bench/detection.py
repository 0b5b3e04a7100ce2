"""Detection latency of the watchdog in the idle case: one transfer completion dropped, no other traffic.

Starts ``pdserve serve`` with ``drop_transfer_done`` aimed at requests whose id starts with ``drop-``, then
sends N such requests one at a time. For each it records when the request's row entered TRANSFERRING (read
from the state table in shm, read-only) and when the client got its 504, and prints the fault-to-client
latency and how far past the deadline (inflight_timeout_s) the answer came, median and max.

    python -m bench.detection --runs 20 --inflight-timeout-s 2 --monitor-tick-s 0.5
"""
from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import time

import httpx

from bench.engine_process import engine


def _wait(predicate, timeout_s: float, interval_s: float = 0.01):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError("condition not met in time")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--inflight-timeout-s", type=float, default=2.0)
    parser.add_argument("--monitor-tick-s", type=float, default=0.5)
    args = parser.parse_args(argv)

    from ipc.naming import segment_name
    from ipc.state_table import RequestState, StateTable

    env = {"PDSERVE_FAULTS": "drop_transfer_done:match=drop-",
           "PDSERVE_INFLIGHT_TIMEOUT_S": str(args.inflight_timeout_s),
           "PDSERVE_MONITOR_TICK_S": str(args.monitor_tick_s)}
    with engine(env=env) as running:
        base = running.base_url
        table = StateTable.attach(segment_name(running.engine_id, "state"), readonly=True)
        latencies, past_deadline = [], []
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                for i in range(args.runs):
                    rid = f"drop-{i}"
                    future = pool.submit(httpx.post, base + "/v1/completions", timeout=60,
                                         json={"prompt": "ping", "max_tokens": 2}, headers={"X-Request-Id": rid})

                    def entered():
                        for slot, _ in table.find(rid):
                            row = table.row(slot)
                            if row["state"] == RequestState.TRANSFERRING:
                                return row["state_since_ns"]
                        return None
                    since_ns = _wait(entered, 30, 0.002)
                    response = future.result(timeout=60)
                    latency = (time.monotonic_ns() - since_ns) / 1e9
                    if response.status_code != 504:
                        print(f"unexpected answer {response.status_code}: {response.text}", file=sys.stderr)
                        return 1
                    latencies.append(latency)
                    past_deadline.append(latency - args.inflight_timeout_s)
        finally:
            table.close()
    print(f"runs={args.runs} inflight_timeout_s={args.inflight_timeout_s} monitor_tick_s={args.monitor_tick_s}")
    print(f"fault (row entered TRANSFERRING) -> client 504: median {statistics.median(latencies):.3f} s, "
          f"max {max(latencies):.3f} s")
    print(f"past the deadline: median {statistics.median(past_deadline):.3f} s, max {max(past_deadline):.3f} s "
          f"(bound: one tick = {args.monitor_tick_s} s plus HTTP delivery)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
