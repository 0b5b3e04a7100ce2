"""bench.ledger: the connection ledger's write cost: output tok/s of one engine with the ledger (the default) and
one without (``--connection-ledger-rows 0``), same streamed prompts, one invocation.

Both engines are up at once (an idle engine blocks on its queues' semaphores); bench/serving drives them in
turn, never together, for ``--rounds`` rounds whose order alternates (on, off / off, on ...) so a busy shared
host's drift hits both alike. Each round sends the same seeded random prompts to both. Prints each round's tok/s,
the ratio on / off per round, and the median ratio (the figure docs/performance.md quotes); load average before and
after.

    python -m bench.ledger [--rounds 4] [--num-prompts 16] [--concurrency 8] [--input-len 32] [--output-len 64]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys

from bench.engine_process import engine

MODES = (("ledger on", ()), ("ledger off", ("--connection-ledger-rows", "0")))


def run_serving(base: str, args, seed: int) -> dict:
    from bench import serving as bench_serving

    return bench_serving.main([
        "--base-url", base, "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
        "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--ignore-eos",
        "--seed", str(seed), "--warmup-requests", "2", "--disable-progress", "--json"])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="bench_ledger", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args(argv)
    print(f"load average before: {os.getloadavg()[0]:.1f}", flush=True)
    tok_s: dict[str, list[float]] = {label: [] for label, _ in MODES}
    with contextlib.ExitStack() as stack:
        bases = {label: stack.enter_context(engine(*flags)).base_url for label, flags in MODES}
        for r in range(args.rounds):
            order = MODES if r % 2 == 0 else MODES[::-1]
            for label, _ in order:
                summary = run_serving(bases[label], args, seed=1000 + r)
                tok_s[label].append(summary["output_throughput"])
                print(f"round {r}: {label}: {summary['output_throughput']:.1f} tok/s", flush=True)
    ratios = [on / off for on, off in zip(tok_s["ledger on"], tok_s["ledger off"])]
    result = {"tok_s": tok_s, "ratios_on_off": ratios, "median_ratio_on_off": statistics.median(ratios),
              "load_average_after": os.getloadavg()[0]}
    print(f"ratio on/off per round: {', '.join(f'{x:.3f}' for x in ratios)}; "
          f"median {result['median_ratio_on_off']:.3f}")
    print(f"load average after: {result['load_average_after']:.1f}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
