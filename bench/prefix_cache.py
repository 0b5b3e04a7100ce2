"""bench.prefix_cache: the multi-round agentic load (tools/multiround) against pdserve with its prefix cache on and
off, in one run: each side gets its own engine (started here on a free port, stopped after), sides alternate
``--repeats`` times so neighbours' load hits both alike.

    python -m bench.prefix_cache                      # 4 sessions x 16 rounds, max_tokens 16, one repeat
    python -m bench.prefix_cache --sessions 4 --rounds 16 --repeats 2 --json out.json

Prints per side the round latency percentiles and the share of prompt tokens the engine reported cached
(``usage.prompt_tokens_details.cached_tokens``): overall, after each session's first round, and per round index;
then the ratio p50(cache on) / p50(cache off). Also the 1-minute load average before and after each side.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def run_side(cache: bool, args, log_dir: Path) -> dict:
    from tools import multiround
    from bench.engine import Engine

    flags = ["--kv-pool-tokens", str(args.kv_pool_tokens)] + ([] if cache else ["--no-prefix-cache"])
    engine = Engine(flags, log_dir / f"engine-{'cache' if cache else 'nocache'}-{time.monotonic_ns()}.log")
    try:
        load_before = os.getloadavg()[0]
        margs = argparse.Namespace(base_url=engine.base_url, sessions=args.sessions, rounds=args.rounds, http="1.1",
                                   max_tokens=args.max_tokens, model="", stream=False, round_timeout_s=600.0,
                                   slow_s=1e9, keepalive_expiry_s=600.0, inject_round=-1, inject_id_prefix="drop-",
                                   api_key="", insecure=False)
        report = asyncio.run(multiround.run(margs))
        report["load_avg_1m"] = [load_before, os.getloadavg()[0]]
        report["prefix_cache"] = cache
        return report
    finally:
        engine.stop()


def summary_line(report: dict) -> str:
    lat = report["latency_s"]
    share = report["cached_share"]
    after = report["cached_share_after_first_round"]
    by_round = " ".join("-" if s is None else f"{s:.0%}" for s in report["cached_share_by_round"])
    return (f"prefix cache {'on ' if report['prefix_cache'] else 'off'}: {report['rounds_ok']} rounds ok, "
            f"{len(report['errors'])} errors; p50 {lat['p50']:.2f} s p90 {lat['p90']:.2f} s max {lat['max']:.2f} s; "
            f"cached {0 if share is None else share:.1%} of prompt tokens, "
            f"{0 if after is None else after:.1%} after round 0; by round: {by_round}; "
            f"load {report['load_avg_1m'][0]:.1f} -> {report['load_avg_1m'][1]:.1f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prefix_cache", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1, help="off/on pairs, alternating which side goes first")
    ap.add_argument("--kv-pool-tokens", type=int, default=16384, help="each actor's KV pool (the sessions' "
                    "prompts grow to ~1,000 tokens)")
    ap.add_argument("--json", default="", help="write every report as JSON here")
    args = ap.parse_args(argv)
    reports = []
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-prefix-") as tmp:
        for rep in range(args.repeats):
            for cache in ((False, True) if rep % 2 == 0 else (True, False)):
                report = run_side(cache, args, Path(tmp))
                print(summary_line(report), flush=True)
                reports.append(report)
    on = [r["latency_s"]["p50"] for r in reports if r["prefix_cache"]]
    off = [r["latency_s"]["p50"] for r in reports if not r["prefix_cache"]]
    ratio = statistics.median(on) / statistics.median(off)
    after = [r["cached_share_after_first_round"] or 0.0 for r in reports if r["prefix_cache"]]
    print(f"p50 round latency, cache on / off: {ratio:.2f}x (target <= 0.4x); cached prompt tokens after each "
          f"session's first round: {min(after):.1%} (target >= 85%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ratio_p50": ratio, "reports": reports}, f, indent=1)
    failed = any(r["errors"] or r["hangs"] for r in reports)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
