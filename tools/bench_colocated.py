"""bench_colocated: disaggregated pdserve (prefill actor -> KV handoff -> decode actor) vs colocated pdserve
(``--colocated true``: the decode actor also prefills, no handoff), same prompts, one invocation.

Both engines are up at once (an idle engine blocks on its queues' semaphores) and tools/bench_serving drives
them in turn, never together: ``--reps`` repetitions at low load (concurrency 1), the order of the two modes
alternating per repetition so a drift in the machine's load hits both, each repetition with new prompts (both
modes get the same ones; a repeated prompt would be served from the prefix cache), then one run each at high
load (concurrency 16). The report gives TTFT p50 and output throughput with colocated as the baseline, so
``TTFT ratio 1.05x`` = disaggregation costs 5% more time to first token; at low load the ratio of each
repetition and their median, with the load average (1 min) before and after.

    python -m tools.bench_colocated [--reps 5] [--num-prompts 12] [--input-len 64] [--output-len 16]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

from tools.engine_process import engine

MODES = (("disaggregated", ()), ("colocated", ("--colocated", "true")))


def measure(base: str, args, concurrency: int, seed: int) -> dict:
    """One bench_serving run; ``seed`` picks the random prompts (a new seed per repetition: a repeated prompt
    would be served from the prefix cache)."""
    from tools import bench_serving

    return bench_serving.main([
        "--base-url", base, "--num-prompts", str(args.num_prompts if concurrency == 1 else args.num_prompts * 2),
        "--max-concurrency", str(concurrency), "--input-len", str(args.input_len), "--output-len",
        str(args.output_len), "--ignore-eos", "--seed", str(seed), "--disable-progress", "--json"])


def low_load_plan(reps: int) -> list[list[tuple[str, int]]]:
    """Per repetition, the ``(mode, prompt seed)`` runs in the order they go: the two modes alternate which goes
    first; both get the repetition's seed, a new one each repetition."""
    modes = [mode for mode, _ in MODES]
    return [[(mode, 1 + rep) for mode in (modes if rep % 2 == 0 else modes[::-1])] for rep in range(reps)]


def low_load_rows(low: list[dict]) -> list[tuple[float, float, float]]:
    """Per repetition ``(disaggregated TTFT p50 ms, colocated TTFT p50 ms, ratio)``; ``low``: one
    ``{mode: bench_serving result}`` per repetition."""
    rows = []
    for rep in low:
        d, k = rep["disaggregated"]["ttft_ms"]["p50"], rep["colocated"]["ttft_ms"]["p50"]
        rows.append((d, k, d / k))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="low-load repetitions per mode (interleaved)")
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        bases = {mode: stack.enter_context(engine("--kv-pool-tokens", "4096", *flags)).base_url
                 for mode, flags in MODES}
        low = []
        for runs in low_load_plan(args.reps):
            low.append({mode: measure(bases[mode], args, 1, seed) for mode, seed in runs})
        high = {mode: measure(bases[mode], args, 16, seed=1000) for mode, _ in MODES}
    load_after = os.getloadavg()[0]
    print(f"\n# disaggregated vs colocated, {time.strftime('%Y-%m-%d %H:%M:%S')}, input {args.input_len} "
          f"tokens, output {args.output_len}, greedy with ignore_eos; load average (1 min) {load_before:.1f} "
          f"before, {load_after:.1f} after")
    rows = low_load_rows(low)
    print(f"{'concurrency 1, rep':<22}{'TTFT p50 ms (dis / col)':>28}{'ratio':>8}")
    for i, (d, k, ratio) in enumerate(rows):
        print(f"{i:<22}{d:>14.0f} / {k:<11.0f}{ratio:>7.2f}x")
    median_d = statistics.median(r[0] for r in rows)
    median_k = statistics.median(r[1] for r in rows)
    print(f"{'median':<22}{median_d:>14.0f} / {median_k:<11.0f}{statistics.median(r[2] for r in rows):>7.2f}x"
          "  (median of the per-repetition ratios)")
    d, k = high["disaggregated"], high["colocated"]
    print(f"concurrency 16: TTFT p50 {d['ttft_ms']['p50']:.0f} / {k['ttft_ms']['p50']:.0f} ms "
          f"({d['ttft_ms']['p50'] / k['ttft_ms']['p50']:.2f}x), output tok/s {d['output_throughput']:.1f} / "
          f"{k['output_throughput']:.1f} ({d['output_throughput'] / k['output_throughput']:.2f}x)")
    print("target (issue 13): disaggregated TTFT p50 <= 1.05x colocated at concurrency 1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
