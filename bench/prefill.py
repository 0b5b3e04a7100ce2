"""bench.prefill: batched prefill (this checkout: the prefill actor packs every queued prompt, up to
``--max-prefill-batch-tokens``, into one forward pass) vs one prompt per forward pass (a baseline checkout
without batched prefill, e.g. ``main`` before it was merged), same prompts, one invocation.

Both engines run at once, idle between their turns, and bench/serving drives them in turn (baseline,
batched, baseline, batched, ...) so load from neighbours hits both alike; the report gives the medians of the
repetitions' TTFT p50 and output throughput at concurrency 16 (and 1, with ``--low``) with the baseline as 1.00x.

    python -m bench.prefill --baseline-root /path/to/old/checkout [--input-len 32] [--repeats 2]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import time

from bench.engine_process import engine


def measure(base: str, args, concurrency: int, seed: int, num_prompts: int) -> dict:
    """One bench/serving run (its report silenced); returns its summary."""
    from bench import serving as bench_serving

    with contextlib.redirect_stdout(io.StringIO()):
        return bench_serving.main([
            "--base-url", base, "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
            "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--ignore-eos", "--seed",
            str(seed), "--disable-progress"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-root", required=True, help="checkout of the engine without batched prefill")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--low", action="store_true", help="also measure concurrency 1")
    parser.add_argument("--flags", default="--kv-pool-tokens 8192 --max-num-seqs 32",
                        help="flags of both engines")
    parser.add_argument("--batched-flags", default="", help="extra flags of the batched engine")
    args = parser.parse_args(argv)
    concurrencies = (16, 1) if args.low else (16,)
    runs: dict[str, dict[int, list[dict]]] = {m: {c: [] for c in concurrencies} for m in ("baseline", "batched")}
    with contextlib.ExitStack() as stack:
        engines = {"baseline": stack.enter_context(engine(*args.flags.split(), cwd=args.baseline_root)),
                   "batched": stack.enter_context(engine(*args.flags.split(), *args.batched_flags.split()))}
        for name, running in engines.items():   # warm-up: first requests pay lazy initialization
            measure(running.base_url, args, 1, seed=99, num_prompts=2)
        for rep in range(args.repeats):
            for c in concurrencies:
                for name, running in engines.items():
                    result = measure(running.base_url, args, c, seed=rep + 1,
                                     num_prompts=args.num_prompts if c > 1 else 4)
                    runs[name][c].append(result)
                    print(f"# rep {rep + 1} {name:<9} concurrency {c:>2}: TTFT p50 {result['ttft_ms']['p50']:.0f} ms, "
                          f"output {result['output_throughput']:.1f} tok/s, {result['failed']} failed", flush=True)
    print(f"\n# batched prefill vs one prompt per forward, {time.strftime('%Y-%m-%d %H:%M:%S')}, input "
          f"{args.input_len} tokens, output {args.output_len}, greedy with ignore_eos, median of {args.repeats}")
    print(f"{'concurrency':<13}{'TTFT p50 ms (batched / base)':>31}{'ratio':>8}{'output tok/s (batched / base)':>33}"
          f"{'ratio':>8}")
    for c in concurrencies:
        ttft = {m: statistics.median(r["ttft_ms"]["p50"] for r in runs[m][c]) for m in runs}
        tput = {m: statistics.median(r["output_throughput"] for r in runs[m][c]) for m in runs}
        print(f"{c:<13}{ttft['batched']:>15.0f} / {ttft['baseline']:<14.0f}{ttft['batched'] / ttft['baseline']:>7.2f}x"
              f"{tput['batched']:>17.1f} / {tput['baseline']:<14.1f}{tput['batched'] / tput['baseline']:>7.2f}x")
        per_rep = [f"{b['ttft_ms']['p50'] / a['ttft_ms']['p50']:.2f}x" for a, b in zip(runs["baseline"][c],
                                                                                    runs["batched"][c])]
        print(f"  per-repetition TTFT p50 ratios at concurrency {c}: {', '.join(per_rep)}")
    print("target (issue 18): TTFT p50 at concurrency 16 <= 0.5x one prompt per forward")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
