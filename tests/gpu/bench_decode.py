"""Decode throughput of gpu.model.LlamaModel against Hugging Face generate, same process, fp32, greedy.

Run from the repository root: ``python tests/gpu/bench_decode.py [--tokens 32] [--batch 8]``.
Not collected by pytest (the file name does not start with ``test_``). Runs are interleaved and the median is
reported: on a small shared VM, OpenMP with 2 threads sometimes falls into a mode 4-5x slower for a while
(other load on the second core), which hits both implementations alike.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from gpu.model import LlamaModel, kv_pool_shape
from gpu.model_files import default_model_path
from gpu.tokenizer import Tokenizer

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village by the sea,"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-hf", action="store_true")
    args = ap.parse_args()
    n = args.tokens
    path = default_model_path()
    tok = Tokenizer.load(path)
    model = LlamaModel.from_path(path, progress=False)
    ids = tok.encode(PROMPT)
    bt = 16
    blocks = (len(ids) + n) // bt + 1

    reps = args.repeats

    def run_single() -> tuple[float, float, list[int]]:
        kv = torch.zeros(kv_pool_shape(model.config, blocks, bt))
        table = list(range(blocks))
        t0 = time.perf_counter()
        logits = model.prefill(kv, ids, table)
        t1 = time.perf_counter()
        out: list[int] = []
        pos = len(ids)
        for _ in range(n):  # n new tokens: the prefill's plus n - 1 decode steps; EOS ignored
            t = int(logits.argmax())
            out.append(t)
            if len(out) < n:
                logits = model.decode(kv, [t], [pos], [table])[0]
                pos += 1
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, out

    def run_batch(B: int) -> float:
        prompts = [ids[: len(ids) - i] for i in range(B)]  # different lengths: the masked path
        kvb = torch.zeros(kv_pool_shape(model.config, B * blocks, bt))
        tables = [list(range(b * blocks, (b + 1) * blocks)) for b in range(B)]
        last = torch.stack([model.prefill(kvb, p, tb) for p, tb in zip(prompts, tables)])
        positions = [len(p) for p in prompts]
        t0 = time.perf_counter()
        for _ in range(n):
            last = model.decode(kvb, last.argmax(-1).tolist(), positions, tables)
            positions = [p + 1 for p in positions]
        return time.perf_counter() - t0

    hf = None
    if not args.no_hf:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                               dtype=torch.float32).eval()
    x = torch.tensor([ids])
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n, min_new_tokens=n)

    def run_hf() -> tuple[float, float, list[int]]:
        with torch.inference_mode():
            t0 = time.perf_counter()
            hf(x)
            t1 = time.perf_counter()
            g = hf.generate(x, **kw)
            t2 = time.perf_counter()
        return t1 - t0, t2 - t1, g[0, len(ids):].tolist()

    run_single()  # warm-up
    run_batch(args.batch)
    if hf is not None:
        run_hf()
    ours, batch, theirs = [], [], []
    for _ in range(reps):  # interleaved, so machine noise hits both sides alike
        ours.append(run_single())
        batch.append(run_batch(args.batch))
        if hf is not None:
            theirs.append(run_hf())
    med = statistics.median
    print("single-request decode seconds per run, ours:", " ".join(f"{r[1]:.2f}" for r in ours),
          "| hf:", " ".join(f"{r[1]:.2f}" for r in theirs))
    p_ms = 1e3 * med(r[0] for r in ours)
    d_s = med(r[1] for r in ours)
    print(f"prompt {len(ids)} tokens, {n} new tokens, fp32, torch threads {torch.get_num_threads()}, "
          f"median of {reps}")
    print(f"ours single : prefill {p_ms:.1f} ms; {n} tokens after prefill in {1e3 * d_s:.0f} ms = "
          f"{n / d_s:.1f} tok/s (end to end {n / (d_s + p_ms / 1e3):.1f} tok/s)")
    b_s = med(batch)
    print(f"ours batch {args.batch}: {args.batch * n / b_s:.1f} tok/s total, {1e3 * b_s / n:.1f} ms/step")
    if hf is not None:
        hp = med(r[0] for r in theirs)
        hg = med(r[1] for r in theirs)
        print(f"hf generate : {n} tokens in {1e3 * hg:.0f} ms = {n / hg:.1f} tok/s end to end "
              f"(prefill forward {1e3 * hp:.1f} ms; {n / (hg - hp):.1f} tok/s excluding it)")
        print(f"same tokens as ours: {theirs[0][2] == ours[0][2]}")


if __name__ == "__main__":
    main()
