"""bench_n: ``n`` choices in one request (the prompt prefilled once, its KV shared by the children) against the
same ``n`` sequences sent as ``n`` concurrent single requests (``n`` prefills of the same prompt), one engine,
one invocation, alternating the two shapes so machine noise hits both alike.

Reports the median wall time of each shape, time to the first byte of the streamed response, and the ratio
``single / shared`` (above 1 = sharing the prefill is faster).

    python -m tools.bench_n [--n 8] [--input-len 512] [--output-len 8] [--reps 3]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import httpx

from tools.engine_process import engine

TOKEN_IDS = (1000, 2000, 3000, 4000)   # in-vocabulary ids; a prompt of an exact length is built from them


async def timed(client: httpx.AsyncClient, base: str, body: dict) -> tuple[float, float]:
    """(seconds to the first streamed byte, seconds to the end) of one streamed completion."""
    start = time.perf_counter()
    first = 0.0
    async with client.stream("POST", base + "/v1/completions", json={**body, "stream": True}) as response:
        response.raise_for_status()
        async for _ in response.aiter_bytes():
            if not first:
                first = time.perf_counter() - start
    return first, time.perf_counter() - start


async def run(base: str, args) -> dict[str, list[tuple[float, float]]]:
    prompt = [TOKEN_IDS[i % len(TOKEN_IDS)] for i in range(args.input_len)]
    body = {"prompt": prompt, "max_tokens": args.output_len, "ignore_eos": True, "temperature": 0}
    results: dict[str, list[tuple[float, float]]] = {"shared": [], "single": []}
    async with httpx.AsyncClient(timeout=600) as client:
        await timed(client, base, {**body, "max_tokens": 1})   # warm-up
        for _ in range(args.reps):
            results["shared"].append(await timed(client, base, {**body, "n": args.n}))
            start = time.perf_counter()
            parts = await asyncio.gather(*(timed(client, base, body) for _ in range(args.n)))
            results["single"].append((min(p[0] for p in parts), time.perf_counter() - start))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    with engine("--kv-pool-tokens", "8192") as running:
        results = asyncio.run(run(running.base_url, args))
    shared_first = statistics.median(r[0] for r in results["shared"])
    shared_total = statistics.median(r[1] for r in results["shared"])
    single_first = statistics.median(r[0] for r in results["single"])
    single_total = statistics.median(r[1] for r in results["single"])
    print(f"\n# n={args.n} choices in one request vs {args.n} concurrent requests, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"prompt {args.input_len} tokens, {args.output_len} output tokens each, greedy, {args.reps} reps (median)")
    print(f"{'shape':<34}{'first byte s':>14}{'all done s':>12}")
    print(f"{'one request, n=' + str(args.n) + ' (one prefill)':<34}{shared_first:>14.3f}{shared_total:>12.3f}")
    print(f"{str(args.n) + ' requests, n=1 (' + str(args.n) + ' prefills)':<34}{single_first:>14.3f}"
          f"{single_total:>12.3f}")
    print(f"ratio single / shared: all done {single_total / shared_total:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
