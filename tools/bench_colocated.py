"""bench_colocated: disaggregated pdserve (prefill actor -> KV handoff -> decode actor) vs colocated pdserve
(``--colocated true``: the decode actor also prefills, no handoff), same prompts, one invocation.

The two engines run one after the other (two engines at once would share 2 cores and measure each other), each
driven by tools/bench_serving at low load (concurrency 1) and high load (concurrency 16); the report gives
TTFT p50 and output throughput with colocated as the baseline, so ``TTFT ratio 1.05x`` = disaggregation
costs 5% more time to first token.

    python -m tools.bench_colocated [--num-prompts 12] [--input-len 64] [--output-len 16]
"""
from __future__ import annotations

import argparse
import sys
import time

from tools.engine_process import engine


def measure(base: str, args, concurrency: int) -> dict:
    from tools import bench_serving

    return bench_serving.main([
        "--base-url", base, "--num-prompts", str(args.num_prompts if concurrency == 1 else args.num_prompts * 2),
        "--max-concurrency", str(concurrency), "--input-len", str(args.input_len), "--output-len",
        str(args.output_len), "--ignore-eos", "--seed", "1", "--disable-progress", "--json"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    args = parser.parse_args(argv)
    results = {}
    for mode, flags in (("disaggregated", ()), ("colocated", ("--colocated", "true"))):
        with engine("--kv-pool-tokens", "4096", *flags) as running:
            results[mode] = {c: measure(running.base_url, args, c) for c in (1, 16)}
    print(f"\n# disaggregated vs colocated, {time.strftime('%Y-%m-%d %H:%M:%S')}, input {args.input_len} "
          f"tokens, output {args.output_len}, greedy with ignore_eos")
    print(f"{'load':<22}{'TTFT p50 ms (dis / col)':>28}{'ratio':>8}{'output tok/s (dis / col)':>28}{'ratio':>8}")
    for c, label in ((1, "low (concurrency 1)"), (16, "high (concurrency 16)")):
        d, k = results["disaggregated"][c], results["colocated"][c]
        ttft_d, ttft_k = d["ttft_ms"]["p50"], k["ttft_ms"]["p50"]
        tput_d, tput_k = d["output_throughput"], k["output_throughput"]
        print(f"{label:<22}{ttft_d:>14.0f} / {ttft_k:<11.0f}{ttft_d / ttft_k:>7.2f}x"
              f"{tput_d:>14.1f} / {tput_k:<11.1f}{tput_d / tput_k:>7.2f}x")
    print("target (issue 7): disaggregation TTFT overhead <= 1.10x colocated at low load")
    return 0


if __name__ == "__main__":
    sys.exit(main())
