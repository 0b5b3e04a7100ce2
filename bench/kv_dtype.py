"""bench.kv_dtype: one request's decode speed and TTFT at long prompts with a float16 vs a float32 KV cache.

Run alone from the repository root (a few minutes on a 2-core VM)::

    python -m bench.kv_dtype                        # prompts of ~1,000 and ~4,000 tokens, 2 rounds
    python -m bench.kv_dtype --input-lens 4000 --rounds 3 --output-len 128

Per round and prompt length, one engine per KV dtype (``pdserve serve --kv-cache-dtype X``, the embedded model,
``--weights auto``), the two interleaved; each gets one warm-up request, then one streamed request of a fresh
prompt (random words, so nothing is cached) with ``ignore_eos`` and ``--output-len`` tokens. Decode tok/s =
(output tokens - 1) / (end - first token); TTFT from sending to the first text chunk. Prints the medians per dtype
and the ratio float16 / float32 of each (> 1 = float16 decodes faster; < 1 = its TTFT is shorter).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import httpx

from bench.engine_process import engine

WORDS = ("river stone quiet market winter orange signal harbor paper engine garden silver letter morning "
         "window circle bridge forest number yellow doctor island mirror travel pocket summer").split()


def one_request(base_url: str, words: int, output_len: int, seed: int) -> dict:
    """One streamed /v1/completions of ``words`` random words: prompt tokens, TTFT s, decode tok/s."""
    rng = random.Random(seed)
    prompt = " ".join(rng.choice(WORDS) for _ in range(words))
    body = {"prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    sent, first, usage = time.perf_counter(), None, {}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and any(c.get("text") for c in event.get("choices", [])):
                first = time.perf_counter()
            usage = event.get("usage") or usage
    end = time.perf_counter()
    out = usage.get("completion_tokens", output_len)
    return {"prompt_tokens": usage.get("prompt_tokens", 0), "ttft_s": first - sent,
            "decode_tok_s": (out - 1) / (end - first)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.kv_dtype", description=__doc__.split("\n\n")[0])
    ap.add_argument("--input-lens", default="1000,4000", help="prompt lengths in words (~tokens), comma-separated")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kv-pool-tokens", type=int, default=8192)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    lens = [int(x) for x in args.input_lens.split(",")]
    results: dict = {}
    for rnd in range(args.rounds):
        for dtype in (("float32", "float16") if rnd % 2 == 0 else ("float16", "float32")):
            with engine("--kv-cache-dtype", dtype, "--kv-pool-tokens", str(args.kv_pool_tokens)) as eng:
                one_request(eng.base_url, 20, 8, seed=-1)   # warm-up
                for n in lens:
                    res = one_request(eng.base_url, n, args.output_len, seed=1000 * rnd + n)
                    results.setdefault((n, dtype), []).append(res)
    load = os.getloadavg()[0]
    print(f"# bench_kv_dtype {time.strftime('%Y-%m-%d %H:%M:%S')}, {os.cpu_count()} CPUs, load average {load:.2f}; "
          f"{args.rounds} rounds, {args.output_len} output tokens, medians")
    summary = {}
    for n in lens:
        med = {d: {k: statistics.median(r[k] for r in results[(n, d)]) for k in ("prompt_tokens", "ttft_s",
                                                                                 "decode_tok_s")}
               for d in ("float32", "float16")}
        f32, f16 = med["float32"], med["float16"]
        summary[n] = med | {"decode_ratio": f16["decode_tok_s"] / f32["decode_tok_s"],
                            "ttft_ratio": f16["ttft_s"] / f32["ttft_s"]}
        print(f"~{f32['prompt_tokens']:.0f} prompt tokens: decode float32 {f32['decode_tok_s']:.1f} tok/s, float16 "
              f"{f16['decode_tok_s']:.1f} tok/s ({summary[n]['decode_ratio']:.2f}x); TTFT float32 "
              f"{f32['ttft_s']:.2f} s, float16 {f16['ttft_s']:.2f} s ({summary[n]['ttft_ratio']:.2f}x)")
    if args.json:
        print(json.dumps({"load_average": load, "results": {str(k): v for k, v in summary.items()}}))
    return summary


if __name__ == "__main__":
    main()
