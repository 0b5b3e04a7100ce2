"""bench.diagnostics: what the diagnostics cost under load (issue 42's cost target). Three engines of this checkout
up at once: two with every diagnostic on (the defaults, plus an incident directory) and one with every one that can
be turned off turned off (``OFF_FLAGS``); bench/serving drives them in turn at concurrency 16, never together.

Each round runs every engine once with the same prompts (its own seed per round), the order rotating per round so
the machine's drift (a shared host changes speed within seconds) hits every engine alike. A round's ratio pairs the
two engines that ran next to each other: ``on / off`` for each "on" engine, and ``on A / on B`` (the A/A ratio: two
identical engines, so its spread is what the machine alone does to a ratio). The report: the median of the on/off
ratios over all rounds with their range, beside the A/A median and range, and the load average (1 min) before and
after.

    python -m bench.diagnostics [--rounds 6] [--num-prompts 32] [--input-len 64] [--output-len 32]

What "off" leaves on, having no switch: the connection ledger (its write cost: docs/performance.md section 17), the
conservation checks (section 32), the monitor's deadlines and its other per-tick checks (they are the watchdog).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time

from bench.colocated import run_serving
from bench.engine_process import engine

OFF_FLAGS = ("--recorder-events", "0", "--arrival-index-entries", "0", "--drill-interval-s", "0", "--eject-timeouts",
             "0")
TARGET = "target (issue 42): everything on >= 0.97x everything off in output tok/s at concurrency 16"


def rotation(labels: list[str], rounds: int) -> list[list[str]]:
    """Per round, the order the engines run in: ``labels`` rotated by one per round."""
    return [[labels[(r + j) % len(labels)] for j in range(len(labels))] for r in range(rounds)]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f}x (range {min(values):.3f}-{max(values):.3f}x, {len(values)} ratios)"


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6, help="runs per engine at concurrency 16")
    parser.add_argument("--num-prompts", type=int, default=32, help="requests per run")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        incidents = stack.enter_context(tempfile.TemporaryDirectory(prefix="pdserve-bench-incidents-"))
        on = ("--incident-dir", incidents)
        flags = {"on A": on, "on B": on, "off": OFF_FLAGS}
        bases = {label: stack.enter_context(engine("--kv-pool-tokens", "4096", *f)).base_url
                 for label, f in flags.items()}
        for base in bases.values():   # the first requests pay one-off costs
            with contextlib.redirect_stdout(io.StringIO()):
                run_serving(base, args, 16, 16, seed=10_000, warmup=1)
        tok_s: dict[str, list[float]] = {label: [] for label in bases}
        for r, order in enumerate(rotation(list(bases), args.rounds)):
            for label in order:
                with contextlib.redirect_stdout(io.StringIO()):   # bench/serving's own JSON line
                    one = run_serving(bases[label], args, 16, args.num_prompts, 1 + r, warmup=0)
                tok_s[label].append(one["output_throughput"])
    load_after = os.getloadavg()[0]
    on_off = [a / b for label in ("on A", "on B") for a, b in zip(tok_s[label], tok_s["off"])]
    a_a = [a / b for a, b in zip(tok_s["on A"], tok_s["on B"])]
    print(f"\n# diagnostics on vs off, {time.strftime('%Y-%m-%d %H:%M:%S')}, concurrency 16, {args.num_prompts} "
          f"requests per run, {args.rounds} rounds, input {args.input_len} tokens, output {args.output_len}, "
          f"greedy with ignore_eos; load average (1 min) {load_before:.1f} before, {load_after:.1f} after")
    for label, values in tok_s.items():
        print(f"{label}: output tok/s median {statistics.median(values):.1f} "
              f"(runs {', '.join(f'{v:.1f}' for v in values)})")
    print(f"on / off, per round: {spread(on_off)}")
    print(f"on A / on B (A/A), per round: {spread(a_a)}")
    print(f"off flags: {' '.join(OFF_FLAGS)}")
    print(TARGET)
    return 0


if __name__ == "__main__":
    sys.exit(main())
