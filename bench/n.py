"""bench.n: ``n`` choices in one request (the prompt prefilled once, its KV shared by the children) against the
same ``n`` sequences sent as ``n`` concurrent single requests (``n`` prefills of the same prompt), one engine,
one invocation, alternating the two shapes so machine noise hits both alike.

Reports the median wall time of each shape, time to the first byte of the streamed response, the most decode KV
blocks the shape held at once (the decode actors' free-block count in the engine's actor table, read from shm as
tools/inspect does, every few ms; the pool is otherwise idle) and the ratio ``single / shared`` (above 1 = sharing
the prefill is faster). ``--baseline-root DIR`` also runs the engine of the checkout in DIR (e.g. main before a
change) in the same invocation, interleaved, and prints this checkout's figures against it.

    python -m bench.n [--n 8] [--input-len 512] [--output-len 8] [--reps 3] [--baseline-root DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time

import httpx

from bench.engine_process import engine

TOKEN_IDS = (1000, 2000, 3000, 4000)   # in-vocabulary ids; a prompt of an exact length is built from them
SAMPLE_S = 0.002                       # how often the decode pool's free blocks are read while a shape runs


class DecodePoolWatch:
    """The free KV blocks of an engine's decode actors (their actor-table rows, mapped read-only)."""

    def __init__(self, engine_id: str):
        from ipc.actor_table import ActorTable
        from ipc.naming import segment_name

        self.actors = ActorTable.attach(segment_name(engine_id, "actors"), readonly=True)

    def free(self) -> int:
        return sum(int(r["kv_blocks_free"]) for r in self.actors.rows() if str(r["name"]).startswith("decode"))

    def close(self) -> None:
        self.actors.close()


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


async def most_held(watch: DecodePoolWatch, work) -> tuple[object, int]:
    """Run ``work`` (a coroutine) while sampling the decode pool; returns (its result, the most blocks held at
    once beyond what was held before it started)."""
    idle_free = least_free = watch.free()
    task = asyncio.ensure_future(work)
    while not task.done():
        least_free = min(least_free, watch.free())
        await asyncio.sleep(SAMPLE_S)
    return task.result(), idle_free - least_free


async def run(engines: dict[str, tuple[str, DecodePoolWatch]], args) -> dict[str, dict[str, list[tuple]]]:
    """Per engine label, per shape: one (first byte s, all done s, decode blocks held) per repetition."""
    prompt = [TOKEN_IDS[i % len(TOKEN_IDS)] for i in range(args.input_len)]
    body = {"prompt": prompt, "max_tokens": args.output_len, "ignore_eos": True, "temperature": 0}
    results = {label: {"shared": [], "single": []} for label in engines}

    async def singles(client, base):
        start = time.perf_counter()
        parts = await asyncio.gather(*(timed(client, base, body) for _ in range(args.n)))
        return min(p[0] for p in parts), time.perf_counter() - start

    async with httpx.AsyncClient(timeout=600) as client:
        for base, _ in engines.values():
            await timed(client, base, {**body, "max_tokens": 1})   # warm-up
        for rep in range(args.reps):
            order = list(engines.items())
            for label, (base, watch) in order[::-1] if rep % 2 else order:   # each engine first every other rep
                (first, total), held = await most_held(watch, timed(client, base, {**body, "n": args.n}))
                results[label]["shared"].append((first, total, held))
                (first, total), held = await most_held(watch, singles(client, base))
                results[label]["single"].append((first, total, held))
    return results


def report(results: dict[str, dict[str, list[tuple]]], args) -> None:
    med = {label: {shape: [statistics.median(r[i] for r in rows) for i in range(3)] for shape, rows in by.items()}
           for label, by in results.items()}
    print(f"\n# n={args.n} choices in one request vs {args.n} concurrent requests, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"prompt {args.input_len} tokens, {args.output_len} output tokens each, greedy, {args.reps} reps (median)")
    print(f"{'engine':<10}{'shape':<34}{'first byte s':>14}{'all done s':>12}{'decode blocks held':>20}")
    for label, by in med.items():
        for shape, name in (("shared", f"one request, n={args.n} (one prefill)"),
                            ("single", f"{args.n} requests, n=1 ({args.n} prefills)")):
            first, total, held = by[shape]
            print(f"{label:<10}{name:<34}{first:>14.3f}{total:>12.3f}{held:>20.0f}")
    for label, by in med.items():
        print(f"{label}: ratio single / shared: all done {by['single'][1] / by['shared'][1]:.2f}x, "
              f"decode blocks held {by['single'][2] / max(by['shared'][2], 1):.2f}x")
    if "baseline" in med:
        this, base = med["this"]["shared"], med["baseline"]["shared"]
        print(f"one request n={args.n}, this / baseline: decode blocks held {this[2] / max(base[2], 1):.2f}x, "
              f"all done {this[1] / base[1]:.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--baseline-root", default="", help="also run the engine of the checkout in this directory")
    args = parser.parse_args(argv)
    roots = {"this": None, **({"baseline": args.baseline_root} if args.baseline_root else {})}
    with contextlib.ExitStack() as stack:
        engines = {}
        for label, root in roots.items():
            running = stack.enter_context(engine("--kv-pool-tokens", "8192", cwd=root))
            watch = DecodePoolWatch(running.engine_id)
            stack.callback(watch.close)
            engines[label] = (running.base_url, watch)
        results = asyncio.run(run(engines, args))
    report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
