"""bench.engine: pdserve (served over HTTP) vs Hugging Face transformers ``generate`` on the same prompts and
model, greedy, fp32, with the memory-bandwidth ceiling measured in the same run.

Run from the repository root (about 2-3 minutes on a 2-core VM)::

    python -m bench.engine                      # starts its own engine on a free port, stops it after
    python -m bench.engine --base-url http://127.0.0.1:8000   # an engine you started (same model!)
    python -m bench.engine --profile            # where LlamaModel.decode spends its time (no engine)
    python -m bench.engine --start-up-only      # time to /health 200 with the caches warm, median of 3

What it measures (medians of interleaved repetitions, so load from neighbours hits both sides alike):
- **1 request**: output tokens/s end to end (request sent -> last token; the prompt's prefill included) of one
  streaming pdserve request vs one ``model.generate`` call; and TTFT at this low load vs HF's prefill forward.
- **16 concurrent**: aggregate output tokens/s of 16 concurrent pdserve requests vs one batched, left-padded
  ``generate`` over the same 16 prompts (HF's own batching as its baseline).
- **in-process** (on unless ``--no-in-process``): pdserve's ``gpu.model.LlamaModel`` driven directly at batch
  1 and 16, which separates the model code's speed from the serving path's overhead; and the **matmul floor**:
  only the step's matrix products on the same weights (``F.linear`` per projection), the best this eager-torch
  design could do.
- **ceiling**: a torch fp32 matrix-vector product over a matrix as large as the model's weights (same torch
  thread count as the decode actor) gives the streaming bandwidth B; decode at 1 request reads every weight once
  per token, so ``B / weight_bytes`` tokens/s is the memory-bandwidth ceiling printed next to the figures.

- **start-up** (``--start-ups K`` or ``--start-up-only``): one unmeasured start warms the model cache (prepared
  model, GGUF header) and the page cache, then K starts (default 3) are timed from process start to /health 200,
  each stopped before the next; the median is printed with the load average before each start and as a ratio to
  ``python -c "import torch"`` timed just before each start (the floor every engine actor pays);
  ``--baseline-root DIR`` interleaves starts of the checkout in DIR (e.g. main before a change) and prints the
  ratio of the medians.

Every request asks for exactly ``--output-len`` tokens (``ignore_eos`` on pdserve, ``min_new_tokens`` on HF) and
sends the prompt as token ids, so both sides see the same ids. HF runs with ``torch.set_num_threads`` equal to the
engine's ``--torch-threads`` (default 1: pdserve's decode actor computes on one thread while its prefill actor
has the other core); ``--hf-threads`` changes that. The disaggregation overhead (disaggregated vs colocated
TTFT) is measured by ``bench.colocated``; here the in-process TTFT is the reference.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village by the sea,",
    "Explain in simple words why the sky is blue and why sunsets are red.",
    "Write a short poem about a cat that likes to sit in the sun on a warm afternoon.",
    "List three reasons why regular exercise is good for your health and well-being.",
    "The history of the Roman Empire begins with the founding of the city of Rome, which",
    "In computer science, a hash table is a data structure that",
    "Translate the following sentence into French: I would like a cup of coffee, please.",
    "What are the main differences between a violin and a cello? Describe their sound.",
    "The recipe for a simple tomato soup starts with onions, garlic and olive oil. First,",
    "Describe the water cycle, from evaporation to precipitation, for a ten year old.",
    "A good night's sleep matters because the brain uses that time to",
    "Summarize the plot of a detective story where the butler is innocent.",
    "The first step in learning to play chess is to understand how each piece moves:",
    "Why do leaves change color in autumn? The answer involves chlorophyll and",
    "Give me some tips for writing a clear and friendly email to a new colleague.",
    "Mountains are formed over millions of years when tectonic plates",
]


# --------------------------------------------------------------------------- engine process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    """`python -m pdserve.cli serve` as a subprocess; ready when it prints its banner and /health is 200."""

    def __init__(self, args: list[str], log_path: Path, ready_timeout_s: float = 240.0, cwd: Path = ROOT):
        import httpx

        started = time.monotonic()
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", "--port", str(self.port), *args],
                                     cwd=cwd, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited ({self.proc.returncode}): {log_path.read_text()[-2000:]}")
            if re.search(r"pdserve engine \w+ serving", log_path.read_text(errors="replace")):
                try:
                    if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                        self.ready_s = time.monotonic() - started   # process start -> /health 200
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"engine not ready after {ready_timeout_s} s; log: {log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


# --------------------------------------------------------------------------- pdserve over HTTP


async def _stream_one(client, base_url: str, ids: list[int], n: int) -> dict[str, Any]:
    body = {"prompt": ids, "max_tokens": n, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    parts: list[str] = []
    tokens = 0
    async with client.stream("POST", base_url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            obj = json.loads(line[5:])
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
            for c in obj.get("choices") or []:
                if c.get("text"):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    parts.append(c["text"])
    return {"ttft": ttft, "e2e": time.perf_counter() - t0, "tokens": tokens, "text": "".join(parts)}


async def _pdserve_concurrent(base_url: str, prompts: list[list[int]], n: int) -> tuple[float, list[dict]]:
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        t0 = time.perf_counter()
        out = await asyncio.gather(*(_stream_one(client, base_url, p, n) for p in prompts))
        return time.perf_counter() - t0, list(out)


def pdserve_run(base_url: str, prompts: list[list[int]], n: int) -> dict[str, Any]:
    wall, outs = asyncio.run(_pdserve_concurrent(base_url, prompts, n))
    tokens = sum(o["tokens"] for o in outs)
    ttft = statistics.median(o["ttft"] for o in outs)
    decode = [(o["tokens"] - 1) / (o["e2e"] - o["ttft"]) for o in outs if o["tokens"] > 1]
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "ttft_s": ttft,
            "decode_tok_s": statistics.median(decode) if decode else float("nan"),
            "texts": [o["text"] for o in outs]}


# --------------------------------------------------------------------------- HF transformers


def load_hf(path: Path):
    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF de-quantization progress bar
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             torch_dtype=torch.float32).eval()


def left_padded(prompts: list[list[int]], pad_id: int):
    """HF's batch input for ``prompts``: (ids ``[B, max_len]`` left padded with ``pad_id``, attention mask)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def hf_run(model, prompts: list[list[int]], n: int, pad_id: int) -> dict[str, Any]:
    """One ``generate`` over all prompts (left padded when there are several)."""
    ids, mask = left_padded(prompts, pad_id)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                             pad_token_id=pad_id)
        wall = time.perf_counter() - t0
    new = out[:, ids.shape[1]:]
    return {"wall_s": wall, "tokens": int(new.numel()), "tok_s": new.numel() / wall, "ids": new.tolist()}


def hf_prefill_s(model, ids: list[int]) -> float:
    x = torch.tensor([ids])
    with torch.inference_mode():
        t0 = time.perf_counter()
        model(x, attention_mask=torch.ones_like(x))
        return time.perf_counter() - t0


# --------------------------------------------------------------------------- pdserve model in process


def ours_run(model, prompts: list[list[int]], n: int, block_tokens: int = 16) -> dict[str, Any]:
    """Prefill each prompt, then ``n - 1`` batched decode steps (n new tokens each, as the engine makes)."""
    from gpu.model import kv_pool_shape

    per = (max(len(p) for p in prompts) + n) // block_tokens + 1
    kv = torch.zeros(kv_pool_shape(model.config, per * len(prompts), block_tokens))
    tables = [list(range(b * per, (b + 1) * per)) for b in range(len(prompts))]
    t0 = time.perf_counter()
    last = torch.stack([model.prefill(kv, p, t) for p, t in zip(prompts, tables)])
    t_prefill = time.perf_counter() - t0
    positions = [len(p) for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    for step in range(n):
        toks = last.argmax(-1).tolist()
        for o, t in zip(outs, toks):
            o.append(t)
        if step < n - 1:
            last = model.decode(kv, toks, positions, tables)
            positions = [p + 1 for p in positions]
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "prefill_s": t_prefill, "tokens": n * len(prompts), "tok_s": n * len(prompts) / wall,
            "decode_tok_s": (n - 1) / (wall - t_prefill), "ids": outs}


# --------------------------------------------------------------------------- bandwidth ceiling


def gemv_bandwidth(weight_bytes: int, reps: int = 5, threads: int = 0) -> float:
    """Bytes/s of ``W @ x`` (torch fp32) with W as large as the model's weights, on ``threads`` torch threads
    (0 = the current setting, which is restored afterwards)."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    cols = 1536
    rows = max(1, weight_bytes // 4 // cols)
    w = torch.randn(rows, cols)
    x = torch.randn(cols)
    torch.mv(w, x)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mv(w, x)
        times.append(time.perf_counter() - t0)
    del w
    torch.set_num_threads(before)
    return rows * cols * 4 / statistics.median(times)


def matmul_floor_s(model, batch: int, reps: int = 3) -> float:
    """Seconds per decode step of only the step's matrix products (every layer's QKV, O, gate-up and down
    projections and the LM head, on ``model``'s own weights) for ``batch`` tokens: what a step costs in bare
    torch before attention, norms, RoPE, sampling and Python (a native model's low-bit steps run them inside one
    numba call with the rest of the step, ``lowbit_cpu.decode_layers``, so its floor is these calls one by one)."""
    # the paths LlamaModel.decode takes at this batch size: low-bit below decode_stacked_max_rows when native
    layers = not (model.native and batch < model.decode_stacked_max_rows)
    calls = [(lin.big if layers else lin.fn, lin.in_features) for layer in model.layers
             for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    head = model.lm_head
    calls.append((head.big if batch >= model.head_dense_min_rows else head.fn, head.in_features))
    xs = {k: torch.randn(batch, k) for _, k in calls}
    times = []
    with torch.inference_mode():
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            for fn, k in calls:
                fn(xs[k])
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


# --------------------------------------------------------------------------- profile


def profile_decode(steps: int = 8, batches: tuple[int, ...] = (1, 16), weights: str = "auto") -> str:
    """torch.profiler and cProfile over LlamaModel.decode at each batch size; returns a text report."""
    import cProfile
    import io
    import pstats

    from gpu.model import LlamaModel, kv_pool_shape
    from gpu.model_files import default_model_path
    from gpu.tokenizer import Tokenizer

    path = default_model_path()
    tok = Tokenizer.load(path)
    model = LlamaModel.from_path(path, progress=False, weights=weights)
    prompts = [tok.encode(p) for p in PROMPTS]
    out = [f"# decode profile, weights {model.weights_mode}, torch threads {torch.get_num_threads()}, {steps} steps "
           "after a warm-up"]
    for B in batches:
        ps = prompts[:B]
        per = (max(len(p) for p in ps) + steps + 8) // 16 + 1
        kv = torch.zeros(kv_pool_shape(model.config, per * B, 16))
        tables = [list(range(b * per, (b + 1) * per)) for b in range(B)]
        last = torch.stack([model.prefill(kv, p, t) for p, t in zip(ps, tables)])
        pos = [len(p) for p in ps]

        def steps_fn(k: int) -> None:
            nonlocal last, pos
            for _ in range(k):
                last = model.decode(kv, last.argmax(-1).tolist(), pos, tables)
                pos = [p + 1 for p in pos]

        steps_fn(2)
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            steps_fn(steps)
        dt = time.perf_counter() - t0
        out.append(f"\n## batch {B}: {1e3 * dt / steps:.1f} ms/step under the profiler; torch.profiler top ops "
                   f"by self CPU time")
        out.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
        pr = cProfile.Profile()
        pr.enable()
        steps_fn(steps)
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(12)
        out.append(f"## batch {B}: cProfile, top functions by own time")
        out.append("\n".join(line for line in s.getvalue().splitlines() if line.strip())[:4000])
    return "\n".join(out)


# --------------------------------------------------------------------------- main


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="", help="use this running pdserve (serving the default model)")
    ap.add_argument("--engine-args", default="--max-num-seqs 32 --kv-pool-tokens 4096 --weights auto",
                    help="flags for the engine this tool starts")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--reps", type=int, default=2, help="interleaved repetitions (median reported)")
    ap.add_argument("--hf-threads", type=int, default=0, help="torch threads for HF and in-process runs; "
                    "0 = the engine's --torch-threads (1 unless set in --engine-args)")
    ap.add_argument("--no-in-process", action="store_true", help="skip pdserve's model driven in process")
    ap.add_argument("--profile", action="store_true", help="only profile LlamaModel.decode and exit")
    ap.add_argument("--start-ups", type=int, default=0, help="time this many warm starts of the engine (median; "
                    "after one unmeasured start that warms the caches) before the throughput runs")
    ap.add_argument("--start-up-only", action="store_true", help="only the warm start-up measurement "
                    "(--start-ups, default 3), then exit")
    ap.add_argument("--baseline-root", default="", help="with --start-up-only: also time the engine of the "
                    "checkout in this directory, interleaved, and print the ratio")
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


def _summarize(runs: dict, weight_bytes: int, threads: int, n: int, concurrency: int,
               same) -> tuple[dict, float, float]:
    """Medians over the repetitions, per-repetition ratios, and the GEMV bandwidth and its tok/s ceiling."""
    def med(key: str, field: str = "tok_s") -> float:
        return statistics.median(r[field] for r in runs[key]) if runs[key] else float("nan")

    bw = med("bw", "bytes_s")
    ceiling = bw / weight_bytes
    res = {
        "weight_bytes": weight_bytes, "gemv_gb_s": bw / 1e9, "gemv_all_threads_gb_s": med("bw", "all_bytes_s") / 1e9,
        "ceiling_tok_s": ceiling, "threads": threads,
        "pdserve_1_tok_s": med("pd1"), "hf_1_tok_s": med("hf1"), "inproc_1_tok_s": med("us1"),
        "pdserve_N_tok_s": med("pdN"), "hf_N_tok_s": med("hfN"), "inproc_N_tok_s": med("usN"),
        "pdserve_ttft_s": med("pd1", "ttft_s"), "hf_prefill_s": med("hfpre", "s"),
        "inproc_prefill_s": med("us1", "prefill_s"), "pdserve_1_decode_tok_s": med("pd1", "decode_tok_s"),
        "inproc_1_decode_tok_s": med("us1", "decode_tok_s"),
        "hf_1_decode_tok_s": (n - 1) / (med("hf1", "wall_s") - med("hfpre", "s")),
        "matmul_floor_1_tok_s": 1 / med("mm1", "s"), "matmul_floor_N_tok_s": concurrency / med("mmN", "s"),
        "concurrency": concurrency, "output_len": n,
        "same_greedy_text_as_hf": same,
    }

    def per_rep(a: str, b: str) -> list[float]:
        return [x["tok_s"] / y["tok_s"] for x, y in zip(runs[a], runs[b])]

    res["per_rep_ratios"] = {"pdserve_1_vs_hf": per_rep("pd1", "hf1"),
                             "pdserve_N_vs_hf_batched": per_rep("pdN", "hfN"),
                             "inproc_N_vs_hf_batched": per_rep("usN", "hfN"),
                             "pdserve_N_vs_inproc_N": per_rep("pdN", "usN")}
    res["per_rep_tok_s"] = {k: [round(r["tok_s"], 2) for r in runs[k]]
                            for k in ("pd1", "hf1", "us1", "pdN", "hfN", "usN")}
    return res, bw, ceiling


def _report(res: dict, weight_bytes: int, bw: float, ceiling: float, threads: int, N: int, same) -> str:
    """bench_engine's printed table: rates, ratios to HF and to the bandwidth ceiling, TTFT, targets."""
    lines = [
        f"\nweights {weight_bytes / 1e9:.3f} GB fp32; torch.mv over {weight_bytes / 1e9:.2f} GB streams "
        f"{bw / 1e9:.1f} GB/s on {threads} thread(s) -> bandwidth ceiling at 1 request {ceiling:.1f} tok/s "
        f"(on all {os.cpu_count()} threads: {res['gemv_all_threads_gb_s']:.1f} GB/s, "
        f"{res['gemv_all_threads_gb_s'] * 1e9 / weight_bytes:.1f} tok/s)",
        f"{'':34} {'tok/s':>8} {'vs HF':>7} {'decode-only tok/s':>18} {'vs HF':>7} {'vs ceiling':>11}",
    ]
    for label, a, d in (("1 request   pdserve (HTTP)", "pdserve_1_tok_s", "pdserve_1_decode_tok_s"),
                        ("1 request   pdserve model in-proc", "inproc_1_tok_s", "inproc_1_decode_tok_s"),
                        ("1 request   HF generate", "hf_1_tok_s", "hf_1_decode_tok_s")):
        lines.append(f"{label:34} {res[a]:>8.1f} {res[a] / res['hf_1_tok_s']:>6.2f}x {res[d]:>18.1f} "
                     f"{res[d] / res['hf_1_decode_tok_s']:>6.2f}x {res[d] / ceiling:>10.2f}x")
    lines.append(f"{'1 request   matmuls only (floor)':34} {'':>8} {'':>7} {res['matmul_floor_1_tok_s']:>18.1f} "
                 f"{res['matmul_floor_1_tok_s'] / res['hf_1_decode_tok_s']:>6.2f}x "
                 f"{res['matmul_floor_1_tok_s'] / ceiling:>10.2f}x")
    lines += [
        f"{f'{N} concurrent matmuls only (floor)':34} {res['matmul_floor_N_tok_s']:>8.1f} "
        f"{res['matmul_floor_N_tok_s'] / res['hf_N_tok_s']:>6.2f}x",
        f"{f'{N} concurrent pdserve (HTTP)':34} {res['pdserve_N_tok_s']:>8.1f} "
        f"{res['pdserve_N_tok_s'] / res['hf_N_tok_s']:>6.2f}x",
        f"{f'{N} concurrent pdserve model in-proc':34} {res['inproc_N_tok_s']:>8.1f} "
        f"{res['inproc_N_tok_s'] / res['hf_N_tok_s']:>6.2f}x",
        f"{f'{N} concurrent HF batched generate':34} {res['hf_N_tok_s']:>8.1f} {1:>6.2f}x",
        f"TTFT at 1 request: pdserve {1e3 * res['pdserve_ttft_s']:.0f} ms (HTTP, queue, prefill actor, KV handoff, "
        f"decode actor) vs in-process prefill {1e3 * res['inproc_prefill_s']:.0f} ms "
        f"({res['pdserve_ttft_s'] / res['inproc_prefill_s']:.2f}x) vs HF prefill forward "
        f"{1e3 * res['hf_prefill_s']:.0f} ms ({res['pdserve_ttft_s'] / res['hf_prefill_s']:.2f}x)",
        "ratios within each repetition (robust to load changing between repetitions): "
        + "; ".join(f"{k} " + " ".join(f"{v:.2f}x" for v in vs) for k, vs in res["per_rep_ratios"].items()),
        f"greedy text of pdserve equal to HF's: {same}; decode-only = (tokens - 1) / (e2e - TTFT or prefill)",
        f"pdserve weights {res['weights']}: {res['pdserve_weight_bytes'] / 1e6:.0f} MB read per decode step "
        f"(HF fp32: {weight_bytes / 1e6:.0f} MB); start-up to /health 200: {res['start_up_s']:.1f} s",
        f"targets: pdserve >= 3x HF at 1 request -> {res['pdserve_1_tok_s'] / res['hf_1_tok_s']:.2f}x; "
        f">= 3x HF batched at {N} -> {res['pdserve_N_tok_s'] / res['hf_N_tok_s']:.2f}x "
        f"(disaggregated vs colocated TTFT: python -m bench.colocated)",
    ]
    return "\n".join(lines)


def _start_engine(engine_args: str, path: Path, weights: str) -> Engine:
    """Start the engine and print how long it took to answer /health 200, and whether the prepared-model
    cache was warm."""
    from gpu.model import resolve_weights_mode
    from gpu.prepared import cache_path, default_cache_dir, prepared_key

    warm = cache_path(default_cache_dir(), prepared_key(path, resolve_weights_mode(weights))).is_file()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_engine_{os.getpid()}.log"
    print(f"starting: python -m pdserve.cli serve {engine_args}  (log {log})", flush=True)
    engine = Engine(engine_args.split(), log)
    print(f"start-up: /health 200 {engine.ready_s:.1f} s after the process started (prepared-model cache "
          f"{'warm' if warm else 'cold: built during this start'}; target <= 10 s warm)", flush=True)
    return engine


def torch_import_s() -> float:
    """Seconds a fresh interpreter takes to ``import torch`` (each engine actor pays at least this)."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.monotonic() - started


def start_up_runs(engine_args: str, starts: int, baseline_root: str = "") -> dict[str, Any]:
    """Time ``starts`` warm starts of the engine (process start -> /health 200), after one unmeasured start that
    fills the model cache and the page cache; prints each and the median. ``baseline_root``: also time a
    checkout there (its code, same flags), interleaved start by start, and print the ratio of the medians."""
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_engine_start_up_{os.getpid()}.log"
    sides = {"this checkout": ROOT, **({"baseline": Path(baseline_root)} if baseline_root else {})}
    print(f"start-up: python -m pdserve.cli serve {engine_args}  (log {log}); one start each to warm the caches",
          flush=True)
    for root in sides.values():
        Engine(engine_args.split(), log, cwd=root).stop()
    healthy_s: dict[str, list[float]] = {side: [] for side in sides}
    floor_s, loads = [], []
    for i in range(starts):
        loads.append(os.getloadavg()[0])
        floor_s.append(torch_import_s())
        for side, root in sides.items():
            engine = Engine(engine_args.split(), log, cwd=root)
            engine.stop()
            healthy_s[side].append(engine.ready_s)
        print(f"  start {i + 1}/{starts}: /health 200 after "
              + ", ".join(f"{v[-1]:.1f} s ({k})" for k, v in healthy_s.items())
              + f"; `import torch` alone {floor_s[-1]:.1f} s; load average {loads[-1]:.2f}", flush=True)
    med = {side: statistics.median(v) for side, v in healthy_s.items()}
    res = {"start_up_warm_s": med["this checkout"], "start_up_warm_each_s": healthy_s["this checkout"],
           "torch_import_s": statistics.median(floor_s), "start_up_load_avg": loads}
    print(f"start-up with the caches warm, median of {starts}: {res['start_up_warm_s']:.1f} s to /health 200 "
          f"({res['start_up_warm_s'] / res['torch_import_s']:.1f}x a bare `import torch`, "
          f"{res['torch_import_s']:.1f} s, in the same run); load average {min(loads):.2f}-{max(loads):.2f}; "
          f"target <= 10 s", flush=True)
    if baseline_root:
        res.update(start_up_baseline_warm_s=med["baseline"], start_up_baseline_each_s=healthy_s["baseline"])
        print(f"baseline {baseline_root}: median {med['baseline']:.1f} s; this checkout / baseline = "
              f"{med['this checkout'] / med['baseline']:.2f}x", flush=True)
    return res


def _start_up_only(args: argparse.Namespace) -> dict[str, Any]:
    print(f"# bench_engine --start-up-only {time.strftime('%Y-%m-%d %H:%M:%S')} host {os.uname().nodename}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}", flush=True)
    res = start_up_runs(args.engine_args, args.start_ups or 3, args.baseline_root)
    if args.json:
        print(json.dumps(res))
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    if args.start_up_only:
        return _start_up_only(args)
    m = re.search(r"--torch-threads[ =](\d+)", args.engine_args)
    threads = args.hf_threads or (int(m.group(1)) if m else 1)
    torch.set_num_threads(threads)
    m = re.search(r"--weights[ =](\S+)", args.engine_args)
    weights = m.group(1) if m else "float32"   # the engine's default (the Engine subprocess drops PDSERVE_* vars)
    if args.profile:
        print(profile_decode(weights=weights))
        return {}

    from gpu.model_files import default_model_path
    from gpu.tokenizer import Tokenizer

    path = default_model_path()
    tok = Tokenizer.load(path)
    n = args.output_len
    prompts = [tok.encode(p) for p in (PROMPTS * (args.concurrency // len(PROMPTS) + 1))[:args.concurrency]]
    one = [prompts[0]]
    print(f"# bench_engine {time.strftime('%Y-%m-%d %H:%M:%S')} host {os.uname().nodename}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f}; model {path.name} (pdserve weights {weights}, HF fp32); {n} output "
          f"tokens per request; prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens; HF/in-process "
          f"torch threads {threads}; torch {torch.__version__}", flush=True)

    start_ups = start_up_runs(args.engine_args, args.start_ups) if args.start_ups > 0 else {}
    engine = None
    start_up_s = float("nan")
    if not args.base_url:
        engine = _start_engine(args.engine_args, path, weights)
        start_up_s = engine.ready_s
        args.base_url = engine.base_url
    try:
        hf = load_hf(path)
        weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
        ours = None
        if not args.no_in_process:
            from gpu.model import LlamaModel

            ours = LlamaModel.from_path(path, progress=False, weights=weights)
        pad = tok.eos_token_ids[0] if tok.eos_token_ids else 0
        # warm-up (first-call allocations, connection setup)
        pdserve_run(args.base_url, one, 4)
        hf_run(hf, one, 4, pad)
        if ours is not None:
            ours_run(ours, one, 4)
        keys = ("pd1", "hf1", "pdN", "hfN", "us1", "usN", "hfpre", "bw", "mm1", "mmN")
        runs: dict[str, list[dict]] = {k: [] for k in keys}
        for rep in range(args.reps):
            runs["bw"].append({"bytes_s": gemv_bandwidth(weight_bytes),
                               "all_bytes_s": gemv_bandwidth(weight_bytes, threads=os.cpu_count() or 1)})
            if ours is not None:
                runs["mm1"].append({"s": matmul_floor_s(ours, 1)})
                runs["mmN"].append({"s": matmul_floor_s(ours, args.concurrency)})
            runs["pd1"].append(pdserve_run(args.base_url, one, n))
            runs["hf1"].append(hf_run(hf, one, n, pad))
            runs["hfpre"].append({"s": hf_prefill_s(hf, one[0])})
            if ours is not None:
                runs["us1"].append(ours_run(ours, one, n))
            runs["pdN"].append(pdserve_run(args.base_url, prompts, n))
            runs["hfN"].append(hf_run(hf, prompts, n, pad))
            if ours is not None:
                runs["usN"].append(ours_run(ours, prompts, n))
            print(f"  rep {rep + 1}/{args.reps}: pdserve 1 req {runs['pd1'][-1]['tok_s']:.1f} tok/s, "
                  f"HF {runs['hf1'][-1]['tok_s']:.1f}; {args.concurrency} conc. pdserve "
                  f"{runs['pdN'][-1]['tok_s']:.1f}, HF batched {runs['hfN'][-1]['tok_s']:.1f}", flush=True)
        same = tok.decode(runs["hf1"][0]["ids"][0]) == runs["pd1"][0]["texts"][0]
    finally:
        if engine is not None:
            engine.stop()

    res, bw, ceiling = _summarize(runs, weight_bytes, threads, n, args.concurrency, same)
    res.update(start_ups, start_up_s=start_up_s, weights=weights,
               pdserve_weight_bytes=ours.weight_bytes() if ours is not None else float("nan"))
    N = args.concurrency
    print(_report(res, weight_bytes, bw, ceiling, threads, N, same))
    if args.json:
        print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
