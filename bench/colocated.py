"""bench.colocated: disaggregated pdserve (prefill actor -> KV handoff -> decode actor) vs colocated pdserve
(``--colocated true``: the decode actor also prefills, no handoff), same prompts, one invocation. ``--compare
recorder`` compares the flight recorder on (the default) vs off (``--recorder-events 0``) the same way.

All engines are up at once (an idle engine blocks on its queues' semaphores) and bench/serving drives them
in turn, never together. Low load (concurrency 1) is interleaved request by request: prompt ``i`` (its own
seed) goes to every engine in turn, the order rotating per prompt, so the machine's drift (a busy shared host
changes speed within seconds) hits both modes alike; the report gives each mode's TTFT p50 and the per-prompt
ratios disaggregated / colocated (median and quartiles) and output tok/s. Then two runs per engine at high load
(concurrency 16, in the order A B B A): the mean TTFT p50 and output throughput. ``--baseline-root DIR`` also
starts both modes from another checkout (e.g. the code before a change) and interleaves them with the same
prompts. Load average (1 min) before and after.

    python -m bench.colocated [--num-prompts 16] [--input-len 64] [--output-len 16] [--baseline-root DIR]
    python -m bench.colocated --compare recorder      # recorder on vs off
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

from bench.engine_process import engine

MODES = (("disaggregated", ()), ("colocated", ("--colocated", "true")))
COMPARISONS = {"colocated": (MODES, "target (issue 13): disaggregated TTFT p50 <= 1.05x colocated at concurrency 1"),
               "recorder": ((("recorder on", ()), ("recorder off", ("--recorder-events", "0"))),
                            "target (issue 26): recorder on >= 0.98x off in output tok/s, TTFT p50 <= 1.02x")}


def run_serving(base: str, args, concurrency: int, num_prompts: int, seed: int, warmup: int) -> dict:
    """One bench_serving run; ``seed`` picks the random prompts (a repeated prompt would be served from the
    prefix cache)."""
    from bench import serving as bench_serving

    return bench_serving.main([
        "--base-url", base, "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
        "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--ignore-eos",
        "--seed", str(seed), "--warmup-requests", str(warmup), "--disable-progress", "--json"])


def low_load_plan(num_prompts: int, labels: list[str]) -> list[list[tuple[str, int]]]:
    """Per prompt, the ``(engine label, prompt seed)`` requests in the order they go: every engine gets the
    prompt's seed, the order rotating by one engine per prompt."""
    return [[(labels[(i + j) % len(labels)], 1 + i) for j in range(len(labels))] for i in range(num_prompts)]


def ratio_summary(dis_ms: list[float], col_ms: list[float]) -> dict:
    """Paired per-prompt TTFT ratios disaggregated / colocated: ``{"median", "q1", "q3"}``, and each mode's p50
    in ms (``dis_p50``, ``col_p50``)."""
    ratios = [d / c for d, c in zip(dis_ms, col_ms)]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return {"median": statistics.median(ratios), "q1": q1, "q3": q3,
            "dis_p50": statistics.median(dis_ms), "col_p50": statistics.median(col_ms)}


def mean_run(runs: list[dict]) -> dict:
    """The mean of bench_serving summaries' TTFT p50 and output throughput (the fields the report prints)."""
    return {"ttft_ms": {"p50": statistics.mean(r["ttft_ms"]["p50"] for r in runs)},
            "output_throughput": statistics.mean(r["output_throughput"] for r in runs)}


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=16, help="concurrency-1 prompts, each to every engine")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--baseline-root", default="", help="another checkout whose two modes run beside these")
    parser.add_argument("--compare", choices=tuple(COMPARISONS), default="colocated",
                        help="which two modes: disaggregated vs colocated, or the flight recorder on vs off")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    roots = {"": None} if not args.baseline_root else {"": None, "baseline ": args.baseline_root}
    modes, target = COMPARISONS[args.compare]
    (first, _), (second, _) = modes
    load_before = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        bases = {prefix + mode: stack.enter_context(engine("--kv-pool-tokens", "4096", *flags, cwd=root)).base_url
                 for prefix, root in roots.items() for mode, flags in modes}
        labels = list(bases)
        for label in labels:   # first requests pay one-off costs
            run_serving(bases[label], args, 1, 1, seed=10_000, warmup=1)
        ttft_ms = {label: [] for label in labels}
        tok_s = {label: [] for label in labels}   # each concurrency-1 request's output tok/s
        for runs in low_load_plan(args.num_prompts, labels):
            for label, seed in runs:
                one = run_serving(bases[label], args, 1, 1, seed, warmup=0)
                ttft_ms[label].append(one["ttft_ms"]["p50"])
                tok_s[label].append(one["output_throughput"])
        runs16: dict[str, list[dict]] = {label: [] for label in labels}
        for label in labels + labels[::-1]:   # A B B A: the machine's drift hits both modes alike
            runs16[label].append(run_serving(bases[label], args, 16, 2 * args.num_prompts, seed=1000, warmup=1))
        high = {label: mean_run(runs) for label, runs in runs16.items()}
    load_after = os.getloadavg()[0]
    print(f"\n# {first} vs {second}, {time.strftime('%Y-%m-%d %H:%M:%S')}, input {args.input_len} "
          f"tokens, output {args.output_len}, greedy with ignore_eos; load average (1 min) {load_before:.1f} "
          f"before, {load_after:.1f} after")
    for prefix in roots:
        low = ratio_summary(ttft_ms[prefix + first], ttft_ms[prefix + second])
        d, k = high[prefix + first], high[prefix + second]
        print(f"{prefix or 'this checkout '}concurrency 1 ({args.num_prompts} prompts, interleaved): TTFT p50 "
              f"{low['dis_p50']:.0f} / {low['col_p50']:.0f} ms; per-prompt ratio median {low['median']:.2f}x "
              f"(quartiles {low['q1']:.2f}-{low['q3']:.2f}x); output tok/s median "
              f"{statistics.median(tok_s[prefix + first]):.1f} / {statistics.median(tok_s[prefix + second]):.1f} "
              f"({statistics.median(tok_s[prefix + first]) / statistics.median(tok_s[prefix + second]):.2f}x)")
        print(f"{prefix or 'this checkout '}concurrency 16: TTFT p50 {d['ttft_ms']['p50']:.0f} / "
              f"{k['ttft_ms']['p50']:.0f} ms ({d['ttft_ms']['p50'] / k['ttft_ms']['p50']:.2f}x), output tok/s "
              f"{d['output_throughput']:.1f} / {k['output_throughput']:.1f} "
              f"({d['output_throughput'] / k['output_throughput']:.2f}x)")
    print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
