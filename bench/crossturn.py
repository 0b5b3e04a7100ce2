"""bench.crossturn: cross-turn KV reuse (decode hands finished answers back to the prefill cache) on and off, in one
run: tools/multiround.py's chat sessions against one engine per variant, started one after the other with the same
flags but ``--no-kv-hand-back`` (docs/architecture.md, "Cross-turn reuse").

    python -m bench.crossturn --sessions 4 --rounds 16            # 1 x 1
    python -m bench.crossturn --sessions 4 --rounds 16 --engine-args "--prefill-actors 2 --decode-actors 2"

Prints, per variant, the cached share of the prompt tokens of every round (round index 0 = each session's first;
``cached_tokens / prompt_tokens`` over all sessions), the share of the previous turn reused (round r's cached tokens
over round r-1's prompt + completion tokens: what a cache could hold of it; the new user turn cannot be cached),
the round latency p50, and the ratio on/off.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.engine_process import engine

ROOT = Path(__file__).resolve().parent.parent


def run_variant(flags: list[str], args) -> dict:
    with engine(*flags) as eng, tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "tools.multiround", "--base-url", eng.base_url, "--sessions",
                        str(args.sessions), "--rounds", str(args.rounds), "--max-tokens", str(args.max_tokens),
                        "--round-timeout-s", "600", "--json", str(report)], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)
        return json.loads(report.read_text())


def previous_turn_reuse(report: dict) -> list[float | None]:
    """Per round index r >= 1: cached tokens over the previous round's prompt + completion tokens, all sessions."""
    out = []
    for r in range(1, report["rounds_n"]):
        cached = previous = 0
        for session in report["sessions"]:
            rounds = {x["round"]: x for x in session["rounds"] if not x["error"]}
            if r in rounds and r - 1 in rounds:
                cached += rounds[r]["cached_tokens"]
                previous += rounds[r - 1]["prompt_tokens"] + rounds[r - 1]["completion_tokens"]
        out.append(cached / previous if previous else None)
    return out


def pct(values) -> str:
    return " ".join("-" if v is None else f"{100 * v:.0f}" for v in values)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--engine-args", default="", help="flags for both engines")
    args = ap.parse_args(argv)
    base = shlex.split(args.engine_args)
    reports = {"on": run_variant(base, args), "off": run_variant(base + ["--no-kv-hand-back"], args)}
    for name, r in reports.items():
        later = [s for s in r["cached_share_by_round"][1:] if s is not None]
        print(f"hand-back {name:3}: rounds ok {r['rounds_ok']}, round latency p50 {r['latency_s']['p50']:.3f} s, "
              f"cached share after round 0 {100 * (r['cached_share_after_first_round'] or 0):.1f}% (lowest round "
              f"{100 * min(later, default=0):.1f}%)")
        print(f"  cached % of the prompt by round: {pct(r['cached_share_by_round'])}")
        print(f"  % of the previous turn reused, rounds 1..: {pct(previous_turn_reuse(r))}")
    on, off = reports["on"]["latency_s"]["p50"], reports["off"]["latency_s"]["p50"]
    print(f"round latency p50 on/off: {on / off:.2f}")
    print(json.dumps({k: {"cached_share_by_round": v["cached_share_by_round"], "latency_s": v["latency_s"],
                          "previous_turn_reuse": previous_turn_reuse(v), "rounds_ok": v["rounds_ok"]}
                      for k, v in reports.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
