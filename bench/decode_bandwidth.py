"""bench.decode_bandwidth: how close a one-row decode step of ``--weights auto`` comes to the machine's read
bandwidth (issue 28: ">= 0.5 of the machine's measured read bandwidth over the weights it streams").

Run from the repository root (about 30 s)::

    python -m bench.decode_bandwidth [--model M.gguf] [--steps 60] [--read-mib 512] [--itl-ms 8.6]

In one process with one torch thread (the decode actor's setting): the model's one-call decode step
(``lowbit_cpu.decode_layers`` plus the output projection) at one row, median over ``--steps`` steps at positions
100-150; the bytes such a step streams (every layer's stacked tiles, scales and norms, and the output projection's
int8 groups; the KV rows it reads are not counted); and, in the same command, the read bandwidth of one thread two
ways: ``numpy.sum`` over a ``--read-mib`` float32 array (best of 5: a pure stream) and ``torch.mv`` over a matrix
as large as the weights (bench/engine's ceiling). Prints the step's bytes/s and its ratio to each;
``--itl-ms`` also prints the ratio an engine's measured ITL p50 gives (the step plus the serving path).
"""
from __future__ import annotations

import argparse
import statistics
import time


def streamed_bytes(model) -> tuple[int, int]:
    """``(layer bytes, output-projection bytes)`` one one-row decode step of ``model`` reads (its stacked layers,
    built on first use: ``LlamaModel._stack_layers``). Raises ValueError for a model without the one-call step."""
    stacked = model._stack_layers()
    if not stacked:
        raise ValueError("the model has no one-call decode step (weights auto on a Llama-architecture GGUF)")
    def nbytes(part) -> int:   # the norms' stacks, and per role tuples (tiles, scales, mins) of the layers' arrays
        return sum(nbytes(p) for p in part) if isinstance(part, tuple) else part.nbytes

    layers = nbytes(stacked)
    return layers, model.lm_head.weight_bytes


def numpy_read_bandwidth(mib: int, reps: int = 5) -> float:
    """Bytes/s of ``numpy.sum`` over a float32 array of ``mib`` MiB, best of ``reps``."""
    import numpy as np

    data = np.ones((mib << 20) // 4, np.float32)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - t0)
    return data.nbytes / best


def step_seconds(model, steps: int) -> float:
    """Median seconds of a one-row decode step of ``model`` at positions 100.. (a 100-token prompt prefilled)."""
    import torch

    from gpu.model import kv_pool_shape

    kv = torch.zeros(kv_pool_shape(model.config, 16, 16), dtype=model.dtype)
    table = list(range(16))
    model.prefill(kv, list(range(5, 105)), table)
    model.decode(kv, [7], [100], [table])   # compiles or loads the kernels
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        model.decode(kv, [7], [101 + i % 50], [table])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="GGUF file; empty = the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--steps", type=int, default=60, help="decode steps timed")
    ap.add_argument("--read-mib", type=int, default=512, help="size of the numpy read-bandwidth array")
    ap.add_argument("--itl-ms", type=float, default=0.0, help="an engine's measured ITL p50 at one request")
    args = ap.parse_args(argv)

    import torch

    from gpu.model import LlamaModel
    from bench.engine import gemv_bandwidth

    torch.set_num_threads(1)
    model = LlamaModel.from_path(args.model or None, progress=False, weights="auto")
    layers, head = streamed_bytes(model)
    total = layers + head
    step = step_seconds(model, args.steps)
    read = numpy_read_bandwidth(args.read_mib)
    mv = gemv_bandwidth(max(total, args.read_mib << 20), threads=1)
    rate = total / step
    print(f"one-row decode step streams {total / 1e6:.1f} MB (layers {layers / 1e6:.1f}, output projection "
          f"{head / 1e6:.1f}); median step {step * 1e3:.2f} ms over {args.steps} -> {rate / 1e9:.1f} GB/s")
    print(f"one thread reads {read / 1e9:.1f} GB/s (numpy.sum over {args.read_mib} MiB), torch.mv {mv / 1e9:.1f} GB/s")
    print(f"decode step / read bandwidth: {rate / read:.2f} (numpy.sum), {rate / mv:.2f} (torch.mv)")
    if args.itl_ms:
        itl = total / (args.itl_ms / 1e3)
        print(f"engine ITL {args.itl_ms:.2f} ms -> {itl / 1e9:.1f} GB/s: {itl / read:.2f} of numpy.sum's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
