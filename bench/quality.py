"""bench.quality: how far the native low-bit weights (``--weights auto``) move the model from its float32 path.

Run from the repository root (about 1-2 minutes on a 2-core VM)::

    python -m bench.quality                          # the default model, bench/data/quality_text.txt
    python -m bench.quality --model M.gguf --text my.txt --json

Both models read the same text teacher-forced (chunked prefill over a paged KV pool, every position's logits
kept), and at every position the tool compares them: **top-1 agreement** (the share of positions where the two
argmax tokens are equal), **perplexity** of each on the text (``exp`` of the mean negative log-likelihood of the
next token), and the mean **KL divergence** ``KL(p_float32 || p_native)`` in nats. It also times the prefill
forward of each (a chunk of ``--chunk`` tokens). The candidate runs every forward on its low-bit kernels,
output projection included (as decode steps do, and as the engine's default ``--prefill-low-bit`` prefill with
its last token as a decode step scores what it samples); ``--engine-prefill`` runs it as the model's own
``prefill`` (the layers' and the output projection's float32 copies: the engine's ``--no-prefill-low-bit``);
``--decode-steps`` feeds it one decode step per token instead,
the path output tokens take; ``--kv-cache-dtype float16`` gives the candidate a float16 KV cache (with ``--weights
float32`` it isolates the cache's share).

The default text (bench/data/quality_text.txt) is plain English prose written for this project (public
domain), about 2,650 tokens.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TEXT = ROOT / "bench" / "data" / "quality_text.txt"


def _forward(model, kv: torch.Tensor, chunk: list[int], table: list[int], start: int, by_decode: bool):
    """Logits ``[len(chunk), vocab]`` of ``chunk`` at positions ``start..``: one prefill forward, or one decode
    step per token (``by_decode``: the path a served request's output tokens take)."""
    if not by_decode:
        return model.prefill(kv, chunk, table, start_pos=start, all_logits=True)
    return torch.cat([model.decode(kv, [tok], [start + i], [table]) for i, tok in enumerate(chunk)])


def compare(reference, candidate, ids: list[int], chunk_tokens: int = 256, block_tokens: int = 16,
            candidate_by_decode: bool = False, candidate_kv_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Teacher-force ``ids`` through two ``gpu.model.LlamaModel``s chunk by chunk and compare their next-token
    distributions at each of the ``len(ids) - 1`` scored positions. ``candidate_by_decode``: the candidate reads
    the text one decode step per token instead of prefill forwards (the reference always prefills).
    ``candidate_kv_dtype``: the candidate's KV cache element type (default: its model's dtype, as the reference's).

    Returns ``{"tokens", "top1_agreement", "ppl_reference", "ppl_candidate", "kl_mean", "prefill_s_reference",
    "prefill_s_candidate"}``; the two ``prefill_s`` are seconds per chunk (medians).
    Raises:
        ValueError: fewer than two ids.
    """
    from gpu.model import kv_pool_shape

    if len(ids) < 2:
        raise ValueError("need at least two tokens to score")
    n_blocks = len(ids) // block_tokens + 1
    table = list(range(n_blocks))
    pools = [torch.zeros(kv_pool_shape(m.config, n_blocks, block_tokens), dtype=dtype or m.dtype)
             for m, dtype in ((reference, None), (candidate, candidate_kv_dtype))]
    agree = 0
    nll = [0.0, 0.0]
    kl = 0.0
    seconds: list[list[float]] = [[], []]
    scored = 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, chunk_tokens):
            chunk = ids[start:start + chunk_tokens]
            targets = torch.tensor(ids[start + 1:start + 1 + len(chunk)])  # [n] next tokens
            logps = []
            for i, (model, kv) in enumerate(zip((reference, candidate), pools)):
                t0 = time.perf_counter()
                logits = _forward(model, kv, chunk, table, start, candidate_by_decode and i == 1)  # [T, vocab]
                seconds[i].append(time.perf_counter() - t0)
                logps.append(torch.log_softmax(logits[:len(targets)].float(), dim=-1))  # [n, vocab]
            for i, lp in enumerate(logps):
                nll[i] -= lp.gather(1, targets[:, None]).sum().item()
            agree += (logps[0].argmax(-1) == logps[1].argmax(-1)).sum().item()
            kl += (logps[0].exp() * (logps[0] - logps[1])).sum().item()
            scored += len(targets)
    med = [sorted(s)[len(s) // 2] for s in seconds]
    return {"tokens": scored, "top1_agreement": agree / scored, "ppl_reference": math.exp(nll[0] / scored),
            "ppl_candidate": math.exp(nll[1] / scored), "kl_mean": kl / scored,
            "prefill_s_reference": med[0], "prefill_s_candidate": med[1]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="GGUF file; empty = the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--text", default=str(DEFAULT_TEXT), help="plain text file to teacher-force")
    ap.add_argument("--weights", default="auto", help="the candidate's weights mode (reference: float32)")
    ap.add_argument("--chunk", type=int, default=256, help="tokens per prefill forward")
    ap.add_argument("--decode-steps", action="store_true",
                    help="the candidate reads the text one decode step per token (as output tokens are made)")
    ap.add_argument("--engine-prefill", action="store_true",
                    help="the candidate prefills on its float32 copies (the engine with --no-prefill-low-bit)")
    ap.add_argument("--kv-cache-dtype", default="float32", choices=("float32", "float16"),
                    help="the candidate's KV cache (the reference's: float32); the engine's default with weights "
                         "auto on CPU is float16")
    ap.add_argument("--max-tokens", type=int, default=0, help="score only the first N tokens (0 = all)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from gpu.model import LlamaModel
    from gpu.tokenizer import Tokenizer

    path = args.model or None
    ids = Tokenizer.load(path).encode(Path(args.text).read_text(encoding="utf-8"))
    if args.max_tokens:
        ids = ids[:args.max_tokens]
    reference = LlamaModel.from_path(path, progress=False, weights="float32")
    candidate = LlamaModel.from_path(path, progress=False, weights=args.weights)
    if not args.engine_prefill:   # every forward on the low-bit kernels: the numerics of a decode step
        candidate.dense_min_tokens = candidate.head_dense_min_rows = 1 << 30
        candidate.prefill_head_dense = False
    res = compare(reference, candidate, ids, args.chunk, candidate_by_decode=args.decode_steps,
                  candidate_kv_dtype=getattr(torch, args.kv_cache_dtype))
    mode = candidate.weights_mode + ("" if args.kv_cache_dtype == "float32" else f"+{args.kv_cache_dtype} KV")
    res.update(candidate_mode=mode, reference_weight_bytes=reference.weight_bytes(),
               candidate_weight_bytes=candidate.weight_bytes(), load_average=os.getloadavg()[0],
               text=Path(args.text).name)
    print(f"# bench_quality {time.strftime('%Y-%m-%d %H:%M:%S')} host {os.uname().nodename}, {os.cpu_count()} CPUs, "
          f"load average {res['load_average']:.2f}; torch {torch.__version__}, {args.threads} thread(s)")
    how = "decode steps" if args.decode_steps else f"chunks of {args.chunk}" + (
        ", the engine's prefill" if args.engine_prefill else "")
    print(f"text {res['text']}: {res['tokens']} scored tokens (teacher-forced; candidate in {how})")
    print(f"weights: float32 {res['reference_weight_bytes'] / 1e6:.0f} MB, {res['candidate_mode']} "
          f"{res['candidate_weight_bytes'] / 1e6:.0f} MB")
    print(f"top-1 agreement {res['candidate_mode']} vs float32: {res['top1_agreement']:.4f}")
    print(f"perplexity: float32 {res['ppl_reference']:.3f}, {res['candidate_mode']} {res['ppl_candidate']:.3f} "
          f"({res['ppl_candidate'] / res['ppl_reference']:.4f}x); mean KL(float32 || {res['candidate_mode']}) "
          f"{res['kl_mean']:.5f} nats")
    how = f"{args.chunk} decode steps" if args.decode_steps else f"one forward of {args.chunk} tokens"
    print(f"{args.chunk} tokens: float32 {1e3 * res['prefill_s_reference']:.0f} ms (one forward), "
          f"{res['candidate_mode']} {1e3 * res['prefill_s_candidate']:.0f} ms ({how})")
    if args.json:
        print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
