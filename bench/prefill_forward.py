"""bench.prefill_forward: one prefill forward of the model, in-process (no engine), this checkout against a
baseline checkout, in one command.

Each checkout gets a worker process (``torch.set_num_threads(1)`` unless ``--threads``) that loads the model once
(``--weights``, default ``auto``) and times ``LlamaModel.prefill`` of a random prompt of each ``--lengths`` into a
fresh block table (with ``--context C``: after a prefill of C other tokens, untimed, as a cached prefix: the
prompt then runs at positions C..C+n-1, as a multi-round turn does; with ``--decode-rows B``: a decode step of B
rows instead, each at position n over n prompt tokens of its own, prefilled untimed); the driver alternates the
two workers prompt by prompt (baseline, this, baseline, ...), so load from neighbours hits both alike, and
reports the medians and their ratio::

    python -m bench.prefill_forward --baseline-root /path/to/main [--lengths 16,200,1000] [--reps 3]
        [--context 0] [--decode-rows 0]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_WORKER = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[2]))
from gpu.model import LlamaModel, kv_pool_shape
m = LlamaModel.from_path(sys.argv[3] or None, progress=False, weights=sys.argv[1])
c, bt = m.config, 16
g = torch.Generator().manual_seed(0)
ctx, rows, per_row = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]) // bt + 2   # blocks per decode row
kv = torch.zeros(kv_pool_shape(c, max(4096 // bt, rows * per_row), bt), dtype=m.dtype)
m.prefill(kv, [5, 6, 7], [0])   # compiles / loads the kernels
if rows:
    m.decode(kv, [5] * rows, [3] * rows, [[0]] * rows)
print("ready", flush=True)
done = None
for line in sys.stdin:
    n = int(line)
    if rows:   # a decode step of `rows` rows, each at position n over its own n prompt tokens
        tables = [list(range(b * per_row, (b + 1) * per_row)) for b in range(rows)]
        if done != n:
            for table in tables:
                m.prefill(kv, torch.randint(3, c.vocab_size, (n,), generator=g).tolist(), table)
            done = n
        ids = torch.randint(3, c.vocab_size, (rows,), generator=g).tolist()
        t0 = time.perf_counter()
        m.decode(kv, ids, [n] * rows, tables)
        print(json.dumps(time.perf_counter() - t0), flush=True)
        continue
    table = list(range((ctx + n) // bt + 1))
    if ctx:
        m.prefill(kv, torch.randint(3, c.vocab_size, (ctx,), generator=g).tolist(), table)
    ids = torch.randint(3, c.vocab_size, (n,), generator=g).tolist()
    t0 = time.perf_counter()
    m.prefill(kv, ids, table, start_pos=ctx)
    print(json.dumps(time.perf_counter() - t0), flush=True)
"""


def _worker(root: Path, args) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _WORKER, args.weights, str(args.threads), args.model,
                             str(args.context), str(args.decode_rows),
                             str(max(int(n) for n in args.lengths.split(",")))], cwd=root,
                            env={**os.environ, "PYTHONPATH": str(root)}, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise RuntimeError(f"the worker in {root} did not start (see its stderr)")
    return proc


def _time(proc: subprocess.Popen, n: int) -> float:
    proc.stdin.write(f"{n}\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.prefill_forward", description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-root", required=True, help="the other checkout")
    ap.add_argument("--lengths", default="16,200,1000", help="prompt lengths in tokens (with the context at most 4000)")
    ap.add_argument("--context", type=int, default=0, help="tokens prefilled before each timed prompt, untimed")
    ap.add_argument("--decode-rows", type=int, default=0,
                    help="time a decode step of this many rows instead, each at position n after n prompt tokens")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--model", default="", help="GGUF file; empty = the embedded model")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    workers = {}
    try:
        workers = {"baseline": _worker(Path(args.baseline_root).resolve(), args), "this": _worker(ROOT, args)}
        seconds = {n: {name: [] for name in workers} for n in lengths}
        for n in lengths:
            for _ in range(args.reps):
                for name, proc in workers.items():
                    seconds[n][name].append(_time(proc, n))
    finally:
        for proc in workers.values():
            proc.stdin.close()
            proc.wait(timeout=60)
    print(f"# bench_prefill_forward {time.strftime('%Y-%m-%d %H:%M:%S')}, load average "
          f"{os.getloadavg()[0]:.1f}, --weights {args.weights}, {args.threads} thread(s), --context {args.context}, "
          f"--decode-rows {args.decode_rows}, "
          f"median of {args.reps}")
    result = {}
    for n in lengths:
        base, this = (statistics.median(seconds[n][k]) for k in ("baseline", "this"))
        result[n] = {"baseline_s": base, "this_s": this, "ratio": this / base}
        what = f"decode step of {args.decode_rows} rows at {n:5d}" if args.decode_rows else f"prefill of {n:5d} tokens"
        print(f"{what}: baseline {base * 1e3:8.1f} ms, this {this * 1e3:8.1f} ms, "
              f"this / baseline {this / base:.2f}")
    return result


if __name__ == "__main__":
    main()
