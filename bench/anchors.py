"""bench.anchors: pdserve beside llama.cpp's ``llama-server`` and HF transformers ``generate`` on the same GGUF,
in one run, interleaved, so the ratios survive the load of a shared machine.

Run from the repository root (about 10-15 minutes on a loaded 2-core VM)::

    bash bench/build_llama_server.sh                 # once, outside the repository (never in CI)
    python -m bench.anchors                    # every part; --json for one JSON object at the end
    python -m bench.anchors --only single,concurrent --reps 2
    python -m bench.anchors --variant pdserve= --variant "pdserve-nocache=--no-prefix-cache"

Systems:
- **pdserve** variants (``--variant NAME=FLAGS``, flags added to ``--pdserve-args``): the first runs every part,
  the others only the parts in ``--variant-parts`` (default: multiround). A variant whose flags this pdserve's
  ``serve --help`` does not list is skipped with a note (e.g. ``--no-prefix-cache`` before the prefix cache
  lands). Each is a ``pdserve serve`` subprocess (bench/engine_process.py).
- **llama-server** (``-t 2 -np 16 -c --llama-ctx --kv-unified``: 16 slots sharing one KV cache; its prompt cache
  is on, as it is by default). Refuses to run without the binary (bench/build_llama_server.sh builds it).
- **hf**: ``AutoModelForCausalLM.from_pretrained(gguf_file=...)``, fp32, ``--hf-threads`` torch threads, in this
  process; 1 request = one ``generate`` per prompt in turn, 16 concurrent = one left-padded batched ``generate``;
  a streamer times each step, so TTFT is the prefill and ITL the gap between steps. HF keeps no cache between
  calls, so its one run per repetition stands for both cold and warm. No multiround for HF.

Parts (``--only``), each with random prompts of token ids decoded to text (bench_serving's sampler; the same
texts for every system within a repetition, fresh ones per repetition), ``ignore_eos``, greedy:
- **single**: ``--single-prompts`` requests one at a time, ``--input-len`` tokens in, ``--output-len`` out;
  **cold** (prompts new to the server), then **warm** (the same prompts again at once).
- **concurrent**: ``--concurrency`` requests at once, same shapes, cold then warm.
- **multiround**: ``--mr-sessions`` sessions of ``--mr-rounds`` rounds each, run side by side; every round sends
  the whole conversation so far plus ``--mr-input-len`` new tokens and asks for ``--mr-output-len`` (the
  agentic shape; tools/multiround.py is the chat-endpoint version). Round latency = request e2e; cached share =
  ``usage.prompt_tokens_details.cached_tokens`` over the prompt tokens of every round after each session's first.

Printed per scenario and system: output tokens/s, TTFT p50, ITL p50 (ms), round-latency p50 for multiround,
and the ratios pdserve/llama-server and pdserve/HF (tokens/s: higher is better for pdserve; TTFT and latency:
lower is better). Medians over ``--reps`` repetitions; the order of systems rotates per repetition.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from bench import serving as bs

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("single", "concurrent", "multiround")
LLAMA = "llama-server"
HF = "hf"
CACHE_DIR = Path(os.environ.get("LLAMA_ANCHORS_CACHE", Path.home() / ".cache" / "pdserve-anchors"))
BUILD_HINT = "bash bench/build_llama_server.sh   (builds it once into ~/.cache/pdserve-anchors; never in CI)"
FIGURES = ("output_tok_s", "ttft_p50_ms", "itl_p50_ms", "e2e_p50_ms", "cached_share")
# ratio names: (figure, pdserve is better when the ratio is) -- tokens/s higher, times lower
RATIO_FIGURES = {"output_tok_s": "higher", "ttft_p50_ms": "lower", "itl_p50_ms": "lower", "e2e_p50_ms": "lower"}


# --------------------------------------------------------------------------- arguments and binaries


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.anchors", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts among {', '.join(PARTS)}")
    ap.add_argument("--reps", type=int, default=1, help="interleaved repetitions (medians reported)")
    ap.add_argument("--llama-server", default="", help="llama-server binary; default: $LLAMA_SERVER, else the "
                    "newest build under $LLAMA_ANCHORS_CACHE (~/.cache/pdserve-anchors)")
    ap.add_argument("--llama-threads", type=int, default=2, help="llama-server -t and -tb")
    ap.add_argument("--llama-ctx", type=int, default=16384, help="llama-server -c (one KV cache for all slots)")
    ap.add_argument("--pdserve-args", default="", help="flags for every pdserve engine")
    ap.add_argument("--variant", action="append", default=None,
                    help="NAME=FLAGS, a pdserve engine (repeatable; default: 'pdserve=' and "
                         "'pdserve-nocache=--no-prefix-cache')")
    ap.add_argument("--variant-parts", default="multiround", help="parts the variants after the first run")
    ap.add_argument("--no-hf", action="store_true", help="leave HF generate out")
    ap.add_argument("--hf-threads", type=int, default=1,
                    help="torch threads for HF generate (1: like pdserve's decode actor; see bench_engine)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--single-prompts", type=int, default=4, help="requests of the 1-at-a-time runs")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--mr-sessions", type=int, default=4)
    ap.add_argument("--mr-rounds", type=int, default=16)
    ap.add_argument("--mr-input-len", type=int, default=32, help="new tokens each round adds")
    ap.add_argument("--mr-output-len", type=int, default=16)
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per-request read timeout")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="", help="GGUF every system serves (default: the embedded model), e.g. a "
                                                "Q4_K_M file from tools/kquantize")
    ap.add_argument("--json", action="store_true", help="also print every figure as one JSON object")
    return ap


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line with ``parts`` (list), ``variants`` ([(name, flags)]) and ``variant_parts`` (set).

    Raises:
        SystemExit: an unknown part, a malformed or duplicate variant, or a non-positive size (argparse's
            usage error, status 2).
    """
    ap = build_parser()
    args = ap.parse_args(argv)
    args.parts = [p.strip() for p in args.only.split(",") if p.strip()]
    bad = [p for p in args.parts + args.variant_parts.split(",") if p.strip() and p.strip() not in PARTS]
    if bad or not args.parts:
        ap.error(f"--only/--variant-parts take parts among {', '.join(PARTS)}; got {bad or args.only!r}")
    args.variant_parts = {p.strip() for p in args.variant_parts.split(",") if p.strip()}
    args.variants = []
    for spec in args.variant or ["pdserve=", "pdserve-nocache=--no-prefix-cache"]:
        name, eq, flags = spec.partition("=")
        if not eq or not name.strip() or name.strip() in (LLAMA, HF):
            ap.error(f"--variant wants NAME=FLAGS with a NAME other than {LLAMA}/{HF}; got {spec!r}")
        model = ["--model", args.model] if args.model else []
        args.variants.append((name.strip(), model + shlex.split(args.pdserve_args) + shlex.split(flags)))
    if len({n for n, _ in args.variants}) != len(args.variants):
        ap.error("--variant names must differ")
    for name in ("reps", "input_len", "output_len", "single_prompts", "concurrency", "mr_sessions", "mr_rounds",
                 "mr_input_len", "mr_output_len", "llama_threads", "llama_ctx", "hf_threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def find_llama_server(explicit: str = "") -> Path | None:
    """The llama-server to use: ``explicit``, else ``$LLAMA_SERVER``, else the newest
    ``$LLAMA_ANCHORS_CACHE/llama.cpp-*/build/bin/llama-server``; None when that is not an executable file."""
    given = explicit or os.environ.get("LLAMA_SERVER", "")
    if given:
        return Path(given) if os.access(given, os.X_OK) and Path(given).is_file() else None
    built = sorted(glob.glob(str(CACHE_DIR / "llama.cpp-*" / "build" / "bin" / "llama-server")),
                   key=os.path.getmtime)
    return Path(built[-1]) if built else None


def require_llama_server(explicit: str = "") -> Path:
    """``find_llama_server`` or SystemExit with a message that says how to build it."""
    path = find_llama_server(explicit)
    if path is None:
        where = explicit or os.environ.get("LLAMA_SERVER") or str(CACHE_DIR / "llama.cpp-*/build/bin")
        raise SystemExit(f"bench_anchors: no llama-server binary ({where}); build it with\n    {BUILD_HINT}\n"
                         "or pass --llama-server PATH")
    return path


def unknown_flags(flags: Sequence[str], help_text: str) -> list[str]:
    """The ``--long`` options in ``flags`` that ``help_text`` (a ``--help`` output) does not mention."""
    names = [f.split("=", 1)[0] for f in flags if f.startswith("--")]
    words = set(help_text.replace("[", " ").replace("]", " ").replace(",", " ").split())
    return [n for n in names if n not in words]


def pdserve_help() -> str:
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    return out.stdout + out.stderr


# --------------------------------------------------------------------------- figures and ratios


def figures_from_summary(summary: dict[str, Any], first_round_prompt_tokens: int = 0) -> dict[str, Any]:
    """The figures of one bench_serving run (``bs.summarize``'s dict). ``cached_share`` = cached prompt tokens
    over the prompt tokens after each session's first round (``first_round_prompt_tokens`` of them are left
    out); None when the server reports no cached tokens at all. Every figure is None when no request completed."""
    cached = summary.get("total_cached_tokens")
    later = summary["total_input_tokens"] - first_round_prompt_tokens
    done = summary["completed"] > 0  # a run where every request failed has no figures, not zeros

    def fig(value: float) -> float | None:
        return value if done and value == value else None

    return {"output_tok_s": fig(summary["output_throughput"]), "ttft_p50_ms": fig(summary["ttft_ms"]["p50"]),
            "itl_p50_ms": fig(summary["itl_ms"]["p50"]), "e2e_p50_ms": fig(summary["e2e_ms"]["p50"]),
            "cached_share": (cached / later) if cached and later > 0 else None,
            "completed": summary["completed"], "failed": summary["failed"], "errors": summary["errors"]}


def median_figures(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per-figure median over repetitions (None figures left out; None if all are); counts summed."""
    out: dict[str, Any] = {}
    for key in FIGURES:
        vals = [r[key] for r in runs if r.get(key) is not None]
        out[key] = statistics.median(vals) if vals else None
    out["completed"] = sum(r.get("completed", 0) for r in runs)
    out["failed"] = sum(r.get("failed", 0) for r in runs)
    out["errors"] = sorted({e for r in runs for e in r.get("errors", [])})[:5]
    out["reps"] = len(runs)
    return out


def ratio_rows(results: dict[str, dict[str, dict[str, Any]]], pdserve_names: Sequence[str],
               baselines: Sequence[str] = (LLAMA, HF)) -> list[dict[str, Any]]:
    """One row per (scenario, system) of ``results[scenario][system]`` (figures as ``median_figures`` makes
    them), in insertion order, with ``ratios[f"{figure}_vs_{base}"]`` = pdserve's figure / the base's, for every
    pdserve system and every base among ``baselines`` and the other pdserve systems present in that scenario
    with a usable (non-zero) figure."""
    rows = []
    for scenario, systems in results.items():
        for system, figs in systems.items():
            ratios: dict[str, float] = {}
            if system in pdserve_names:
                bases = [b for b in list(baselines) + list(pdserve_names) if b != system and b in systems]
                for base in bases:
                    for fig in RATIO_FIGURES:
                        mine, theirs = figs.get(fig), systems[base].get(fig)
                        if mine is not None and theirs:
                            ratios[f"{fig}_vs_{base}"] = mine / theirs
            rows.append({"scenario": scenario, "system": system, **figs, "ratios": ratios})
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The printed table: figures per row, then pdserve's ratios to llama-server and HF (and between pdserve
    variants for the round latency)."""
    def num(v: Any, fmt: str) -> str:
        return "-" if v is None or v != v else fmt.format(v)

    head = (f"{'scenario':18} {'system':16} {'out tok/s':>9} {'TTFT p50':>9} {'ITL p50':>8} {'round p50':>9} "
            f"{'cached':>6}  ratios (pdserve / other: tok/s higher is better, times lower)")
    lines = [head, "-" * len(head)]
    for r in rows:
        rat = r["ratios"]
        parts = []
        for base in [LLAMA, HF] + sorted({k.rsplit("_vs_", 1)[1] for k in rat} - {LLAMA, HF}):
            bits = [f"{label} {rat[f'{fig}_vs_{base}']:.2f}x" for fig, label in
                    (("output_tok_s", "tok/s"), ("ttft_p50_ms", "TTFT"), ("e2e_p50_ms", "round"))
                    if f"{fig}_vs_{base}" in rat and (fig != "e2e_p50_ms" or r["scenario"] == "multiround")]
            if bits:
                parts.append(f"vs {base}: " + " ".join(bits))
        failed = f"  [{r['failed']} failed: {'; '.join(r['errors'])}]" if r.get("failed") else ""
        round_p50 = r["e2e_p50_ms"] if r["scenario"] == "multiround" else None
        cached = None if r.get("cached_share") is None else 100 * r["cached_share"]
        lines.append(f"{r['scenario']:18} {r['system']:16} {num(r['output_tok_s'], '{:.1f}'):>9} "
                     f"{num(r['ttft_p50_ms'], '{:.0f}'):>9} {num(r['itl_p50_ms'], '{:.1f}'):>8} "
                     f"{num(round_p50, '{:.0f}'):>9} {num(cached, '{:.0f}%'):>6}  {'; '.join(parts)}{failed}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- llama-server process


@contextlib.contextmanager
def llama_server(binary: Path, model: Path, threads: int, ctx_tokens: int, slots: int,
                 ready_timeout_s: float = 300.0) -> Iterator[tuple[str, float]]:
    """A llama-server on a free port serving ``model``; yields (base URL, seconds until /health was 200);
    SIGTERM (then SIGKILL) on exit.

    Raises:
        RuntimeError: it exited or was not ready within ``ready_timeout_s`` (the message names its log).
    """
    from bench.engine_process import _free_port, healthy, terminate

    port = _free_port()
    log_path = f"/tmp/pdserve_anchors_llama_{port}.log"
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "-np", str(slots), "-c", str(ctx_tokens), "--kv-unified"]
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({proc.returncode}); see {log_path}")
            if time.monotonic() - t0 > ready_timeout_s:
                raise RuntimeError(f"llama-server not ready in {ready_timeout_s} s; see {log_path}")
            if healthy(base):
                break
            time.sleep(0.2)
        yield base, time.monotonic() - t0
    finally:
        terminate(proc, 30)


@contextlib.contextmanager
def pdserve_engine(flags: Sequence[str]) -> Iterator[tuple[str, float]]:
    """bench/engine_process.engine with ``flags``; yields (base URL, seconds until /health was 200)."""
    from bench.engine_process import engine

    t0 = time.monotonic()
    with engine(*flags) as running:
        yield running.base_url, time.monotonic() - t0


def warm_up(base_url: str) -> None:
    """One short request of a prompt no scenario uses, so first-call costs stay out of the cold runs."""
    import httpx

    body = {"prompt": "Warm-up: count from one to five.", "max_tokens": 4, "temperature": 0.0}
    model = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    resp = httpx.post(base_url + "/v1/completions", json={**body, "model": model}, timeout=300)
    resp.raise_for_status()


# --------------------------------------------------------------------------- measurements


def serving_run(base_url: str, sessions: list[bs.Session], concurrency: int, tokenizer,
                timeout_s: float) -> dict[str, Any]:
    """bench_serving's client over ``sessions`` at ``concurrency`` requests in flight; the figures."""
    ns = bs.parse_args(["--base-url", base_url, "--max-concurrency", str(concurrency), "--ignore-eos",
                        "--warmup-requests", "0", "--disable-progress", "--timeout-s", str(timeout_s)])
    results, duration = asyncio.run(bs.run_benchmark(ns, sessions, tokenizer))
    first = sum(s.turns[0].prompt_len for s in sessions if len(s.turns) > 1)
    return figures_from_summary(bs.summarize(results, duration), first)


class _StepClock:
    """A ``generate`` streamer that notes the time of every step (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_generate(model, prompts: list[list[int]], n: int, pad_id: int) -> tuple[float, list[float], int]:
    """One greedy ``generate`` of exactly ``n`` tokens over ``prompts`` (left padded when several); returns
    (TTFT s = call to first new token, step gaps in s, new tokens)."""
    import torch

    from bench.engine import left_padded

    clock = _StepClock()
    ids, mask = left_padded(prompts, pad_id)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                             pad_token_id=pad_id, streamer=clock)
    steps = clock.times[1:]
    return steps[0] - t0, [b - a for a, b in zip(steps, steps[1:])], int(out[:, ids.shape[1]:].numel())


def hf_run(model, prompts: list[list[int]], n: int, pad_id: int, batched: bool) -> dict[str, Any]:
    """HF's figures: one batched ``generate`` over ``prompts``, or one ``generate`` per prompt in turn."""
    groups = [prompts] if batched else [[p] for p in prompts]
    ttfts: list[float] = []
    gaps: list[float] = []
    tokens = 0
    t0 = time.perf_counter()
    for group in groups:
        ttft, g, k = hf_generate(model, group, n, pad_id)
        ttfts += [ttft] * len(group)
        gaps += g
        tokens += k
    wall = time.perf_counter() - t0
    return {"output_tok_s": tokens / wall, "ttft_p50_ms": 1e3 * statistics.median(ttfts),
            "itl_p50_ms": 1e3 * statistics.median(gaps) if gaps else None, "e2e_p50_ms": None,
            "cached_share": None, "completed": len(prompts), "failed": 0, "errors": []}


# --------------------------------------------------------------------------- the run


def _sessions(args, tokenizer, part: str, rep: int) -> list[bs.Session]:
    """This repetition's prompts for ``part`` (a seed per part and repetition: cold for every server)."""
    rng = random.Random(args.seed * 1_000_003 + PARTS.index(part) * 1009 + rep)
    if part == "multiround":
        return bs.sample_random_requests(args.mr_sessions, args.mr_input_len, args.mr_output_len, 0.0, rng,
                                         tokenizer, num_rounds=args.mr_rounds)
    num = args.single_prompts if part == "single" else args.concurrency
    return bs.sample_random_requests(num, args.input_len, args.output_len, 0.0, rng, tokenizer)


def _run_part(ctx: dict, args, part: str, rep: int, runs: dict) -> None:
    """Every system on ``part`` once (cold, then warm for single/concurrent), in an order rotated by ``rep``;
    figures appended to ``runs[scenario][system]``."""
    tok = ctx["tokenizer"]
    sessions = _sessions(args, tok, part, rep)
    conc = {"single": 1, "concurrent": args.concurrency, "multiround": args.mr_sessions}[part]
    systems = [s for s in ctx["urls"] if s == ctx["main"] or part in args.variant_parts] + [LLAMA]
    if part != "multiround" and ctx["hf"] is not None:
        systems.append(HF)
    shift = rep % len(systems)
    for system in systems[shift:] + systems[:shift]:
        print(f"  rep {rep + 1} {part:10} {system} ...", end="", flush=True)
        if system == HF:
            ids = [tok.encode(s.turns[0].text) for s in sessions]
            fig = hf_run(ctx["hf"], ids, args.output_len, ctx["pad_id"], batched=(part == "concurrent"))
            for phase in ("cold", "warm"):
                runs.setdefault(f"{part} {phase}", {}).setdefault(HF, []).append(fig)
            print(f" {fig['output_tok_s']:.1f} tok/s", flush=True)
            continue
        url = ctx["llama_url"] if system == LLAMA else ctx["urls"][system]
        phases = ("",) if part == "multiround" else ("cold", "warm")
        for phase in phases:
            fig = serving_run(url, sessions, conc, tok, args.timeout_s)
            runs.setdefault(f"{part} {phase}".strip(), {}).setdefault(system, []).append(fig)
            failed = f" ({fig['failed']} failed: {'; '.join(fig['errors'])[:200]})" if fig["failed"] else ""
            rate = "-" if fig["output_tok_s"] is None else f"{fig['output_tok_s']:.1f}"
            print(f" {phase or 'run'} {rate} tok/s{failed}", end="", flush=True)
        print(flush=True)


def _git_commit() -> str:
    out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def _start_systems(stack: contextlib.ExitStack, args, binary: Path, model_path: Path, meta: dict) -> dict:
    """Starts the pdserve variants whose flags this pdserve knows, llama-server, and HF; notes start-up
    times and skipped variants in ``meta``."""
    help_text = pdserve_help()
    urls: dict[str, str] = {}
    for i, (name, flags) in enumerate(args.variants):
        if i and not (args.variant_parts & set(args.parts)):
            continue
        unknown = unknown_flags(flags, help_text)
        if unknown:
            meta["skipped"][name] = f"this pdserve does not know {' '.join(unknown)}"
            print(f"# skipping {name}: {meta['skipped'][name]}", flush=True)
            continue
        print(f"# starting {name}: pdserve serve {' '.join(flags)}", flush=True)
        urls[name], meta["startup_s"][name] = stack.enter_context(pdserve_engine(flags))
        warm_up(urls[name])
    if args.variants[0][0] not in urls:
        raise SystemExit(f"bench_anchors: the first variant {args.variants[0][0]!r} cannot run: "
                         f"{meta['skipped'][args.variants[0][0]]}")
    print(f"# starting {binary} -t {args.llama_threads} -np {args.concurrency} -c {args.llama_ctx}", flush=True)
    llama_url, meta["startup_s"][LLAMA] = stack.enter_context(
        llama_server(binary, model_path, args.llama_threads, args.llama_ctx, args.concurrency))
    warm_up(llama_url)
    hf = None
    if not args.no_hf and set(args.parts) & {"single", "concurrent"}:
        import torch

        from bench.engine import load_hf

        torch.set_num_threads(args.hf_threads)
        hf = load_hf(model_path)
    return {"urls": urls, "main": args.variants[0][0], "llama_url": llama_url, "hf": hf}


def run(args) -> dict[str, Any]:
    """The whole benchmark: systems up, every part ``args.reps`` times, systems down; the report dict."""
    from gpu.model_files import default_model_path
    from gpu.tokenizer import Tokenizer

    binary = require_llama_server(args.llama_server)
    model_path = Path(args.model) if args.model else default_model_path()
    tok = Tokenizer.load(model_path)
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    meta = {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "host": os.uname().nodename,
            "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(), "commit": _git_commit(),
            "model": model_path.name, "llama_server": str(binary),
            "llama_version": (version.stdout + version.stderr).strip().splitlines()[:2],
            "args": {k: v for k, v in vars(args).items() if k != "variant"}, "startup_s": {}, "skipped": {}}
    print(f"# bench_anchors {meta['date_utc']} UTC, host {meta['host']}, {meta['cpus']} CPUs, load average "
          f"{meta['loadavg_start'][0]:.2f}, commit {meta['commit']}, model {model_path.name}", flush=True)
    runs: dict[str, dict[str, list]] = {}
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        ctx = _start_systems(stack, args, binary, model_path, meta)
        ctx["tokenizer"] = tok
        ctx["pad_id"] = tok.eos_token_ids[0] if tok.eos_token_ids else 0
        for rep in range(args.reps):
            for part in args.parts:
                _run_part(ctx, args, part, rep, runs)
    meta["loadavg_end"] = os.getloadavg()
    meta["wall_s"] = time.monotonic() - t0
    results = {sc: {sy: median_figures(r) for sy, r in systems.items()} for sc, systems in runs.items()}
    rows = ratio_rows(results, [n for n, _ in args.variants])
    return {"meta": meta, "results": results, "rows": rows}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    report = run(args)
    meta = report["meta"]
    print(f"\n# {meta['wall_s']:.0f} s; load average {meta['loadavg_start'][0]:.2f} at start, "
          f"{meta['loadavg_end'][0]:.2f} at end; start-up to healthy: "
          + ", ".join(f"{k} {v:.1f} s" for k, v in meta["startup_s"].items())
          + "".join(f"; skipped {k}: {v}" for k, v in meta["skipped"].items()))
    print(format_table(report["rows"]))
    if args.json:
        print(json.dumps(report, default=str))
    return report


if __name__ == "__main__":
    main()
