"""bench.kquants: K-quant files of the embedded model (tools/kquantize.py) on ``--weights auto``: quality per type
(bench/quality, decode steps) and served decode output tokens/s against the embedded Q4_1 file, in one run.

Run from the repository root, under ``e2e-slot`` (it starts engines; 15-25 minutes on a loaded 2-core VM)::

    e2e-slot python -m bench.kquants                      # Q4_K_M, Q4_K, Q5_K, Q6_K; quality and speed
    e2e-slot python -m bench.kquants --types Q4_K_M --quality-tokens 512 --reps 1

Quality: each file's native path (one decode step per token) against the same file dequantized to float32, on
bench/data/quality_text.txt (first ``--quality-tokens``): top-1 agreement, perplexity ratio, mean KL. Speed: one
``pdserve serve --weights auto`` per file, ``--prompts`` random prompts of ``--input-len`` tokens asking for
``--output-len`` tokens (ignore_eos), one at a time and then ``--concurrency`` at once; output tokens/s, the
order of the files alternating per repetition, medians over ``--reps``; the ratio is K-quant file / Q4_1 file.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any


def _serve_rate(path: Path, args, concurrency: int) -> float:
    from bench import serving as bench_serving
    from bench.engine_process import engine

    with engine("--model", str(path), "--weights", "auto", "--max-num-seqs", str(max(concurrency, 1)),
                "--kv-pool-tokens", "4096", *args.engine_args.split()) as eng:
        common = ["--base-url", eng.base_url, "--input-len", str(args.input_len), "--output-len",
                  str(args.output_len), "--max-concurrency", str(concurrency), "--json", "--seed", "1",
                  "--ignore-eos"]
        bench_serving.main(common + ["--num-prompts", "2"])   # warm-up (kernels, caches)
        summary = bench_serving.main(common + ["--num-prompts", str(args.prompts * concurrency)])
    return float(summary["output_throughput"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from gpu.model_files import default_model_path
    from bench import quality as bench_quality
    from tools.kquantize import requantize

    ap = argparse.ArgumentParser(prog="python -m bench.kquants", description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="Q4_K_M,Q4_K,Q5_K,Q6_K", help="kquantize mixes to build and measure")
    ap.add_argument("--speed-types", default="Q4_K_M", help="the mixes also served for tokens/s")
    ap.add_argument("--quality-tokens", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4, help="requests per concurrency slot")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--dir", default="", help="where the files are written; default a temporary directory")
    ap.add_argument("--no-quality", action="store_true", help="only the served tokens/s")
    ap.add_argument("--engine-args", default="--actor-hang-timeout-s 120",
                    help="more flags for each engine (default: a loaded VM's prefill of 8 prompts can pass the "
                         "10 s heartbeat timeout)")
    args = ap.parse_args(argv)

    out: dict[str, Any] = {"quality": {}, "speed": {}}
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(args.dir or tmp)
        files = {"Q4_1": default_model_path()}
        for mix in args.types.split(","):
            files[mix] = where / f"SmolLM2-135M-Instruct.{mix}.gguf"
            if args.dir and files[mix].exists():   # kept from an earlier run
                continue
            counts = requantize(files["Q4_1"], files[mix], mix)
            print(f"{mix}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())), flush=True)
        for mix, path in files.items():
            if args.no_quality:
                break
            res = bench_quality.main(["--model", str(path), "--decode-steps", "--json",
                                      "--max-tokens", str(args.quality_tokens)])
            out["quality"][mix] = res
        runs: dict[str, dict[int, list[float]]] = {}
        names = ["Q4_1", *args.speed_types.split(",")]
        for rep in range(args.reps):
            for name in (names if rep % 2 == 0 else names[::-1]):
                for conc in (1, args.concurrency):
                    rate = _serve_rate(files[name], args, conc)
                    runs.setdefault(name, {}).setdefault(conc, []).append(rate)
                    print(f"rep {rep} {name} concurrency {conc}: {rate:.1f} output tok/s", flush=True)
    med = {n: {c: statistics.median(v) for c, v in by.items()} for n, by in runs.items()}
    # per repetition (the files alternate within one): the ratio of each K-quant mix to Q4_1
    out["ratios_per_rep"] = {n: {c: [a / b for a, b in zip(v, runs["Q4_1"][c])] for c, v in by.items()}
                             for n, by in runs.items() if n != "Q4_1"}
    out["speed"] = med
    print("\nquality (native decode steps vs the same file in float32):")
    for mix, r in out["quality"].items():
        print(f"  {mix:7s} top-1 {r['top1_agreement']:.3f}  ppl x{r['ppl_candidate'] / r['ppl_reference']:.4f}"
              f"  KL {r['kl_mean']:.4f}  ppl(float32) {r['ppl_reference']:.2f}")
    print("served output tok/s (median), ratio to Q4_1:")
    for n, by in med.items():
        print("  " + n + "  " + "  ".join(f"c={c}: {v:.1f} ({v / med['Q4_1'][c]:.2f}x)" for c, v in by.items()))
    for n, by in out["ratios_per_rep"].items():
        print(f"  {n} / Q4_1 per repetition: " + "  ".join(
            f"c={c}: " + ", ".join(f"{r:.2f}x" for r in rs) for c, rs in by.items()))
    print(json.dumps(out, default=str))
    return out


if __name__ == "__main__":
    main()
