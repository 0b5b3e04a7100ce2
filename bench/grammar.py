"""bench.grammar: decode throughput of a full batch with a grammar on every row against the same batch without one,
in one process, alternating the two so machine noise hits both alike.

Each step is what DecodeActor.step does: ``model.decode`` over the batch's paged KV, then
``gpu.grammar.batch_allowed`` (constrained rounds only), ``Sampler.sample`` and ``gpu.grammar.accept_tokens``. Rows
run at temperature 0.8 under the JSON schema of tests/e2e/test_structured.py; a row whose answer is complete starts
a new one (a fresh matcher) so the batch stays full. Reports output tokens per second of each mode (median over
``--reps`` rounds of ``--steps`` steps) and the ratio constrained / unconstrained (target >= 0.8).

    python -m bench.grammar [--batch 16] [--steps 48] [--reps 3] [--prompt-len 64]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "color", "tags", "address"],
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                    "properties": {"city": {"type": "string", "maxLength": 20},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
    },
}


def run_round(model, kv, tables, prompt_len: int, batch: int, steps: int, compiler, grammar: str | None,
              seed: int) -> float:
    """Tokens per second of ``steps`` batched decode steps (constrained when ``grammar`` is set)."""
    from gpu.grammar import accept_tokens, batch_allowed
    from gpu.sampling import Sampler, Sampling, make_generator

    sampler = Sampler()
    params = [Sampling(temperature=0.8, seed=seed + i, max_tokens=10**6) for i in range(batch)]
    gens = [make_generator(p.seed) for p in params]
    matchers = [compiler.matcher(grammar) if grammar else None for _ in range(batch)]
    tokens = [1] * batch
    start = time.perf_counter()
    for step in range(steps):
        positions = [prompt_len + step] * batch
        logits = model.decode(kv, tokens, positions, tables)   # [batch, vocab]
        allowed = batch_allowed(matchers, logits.shape[-1], [10**6] * batch)
        tokens = sampler.sample(logits, params, gens, None, allowed)
        accept_tokens(matchers, tokens)
        for i, m in enumerate(matchers):
            if m is not None and m.is_terminated():
                matchers[i] = compiler.matcher(grammar)   # a new answer, so the row stays constrained
    return batch * steps / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the decode actor's torch_threads)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from gpu.grammar import GrammarCompiler, json_schema_grammar
    from gpu.model import LlamaModel, kv_pool_shape
    from gpu.tokenizer import Tokenizer

    model = LlamaModel.from_path(None, progress=False)
    tokenizer = Tokenizer.load(None)
    compiler = GrammarCompiler(tokenizer=tokenizer)
    compiler.warm_up(background=False)
    grammar = json_schema_grammar(SCHEMA)
    compiler.check(grammar)
    block = 16
    per_row = -(-(args.prompt_len + args.steps + 1) // block)
    kv = torch.zeros(kv_pool_shape(model.config, per_row * args.batch, block))
    tables = [list(range(r * per_row, (r + 1) * per_row)) for r in range(args.batch)]
    prompt = tokenizer.encode("Describe a person as JSON. " * 64)[:args.prompt_len]
    for table in tables:   # a real prompt's KV in every row, so attention reads what decode would read
        model.prefill(kv, prompt, table)
    run_round(model, kv, tables, args.prompt_len, args.batch, 4, compiler, grammar, 0)   # warm-up
    results: dict[str, list[float]] = {"unconstrained": [], "grammar": []}
    for rep in range(args.reps):
        results["unconstrained"].append(run_round(model, kv, tables, args.prompt_len, args.batch, args.steps,
                                                  compiler, None, rep))
        results["grammar"].append(run_round(model, kv, tables, args.prompt_len, args.batch, args.steps,
                                            compiler, grammar, rep))
    free = statistics.median(results["unconstrained"])
    constrained = statistics.median(results["grammar"])
    summary = {"batch": args.batch, "steps": args.steps, "reps": args.reps,
               "unconstrained_tok_s": round(free, 1), "grammar_tok_s": round(constrained, 1),
               "ratio_grammar_over_unconstrained": round(constrained / free, 3),
               "rounds": {k: [round(v, 1) for v in vs] for k, vs in results.items()}}
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
