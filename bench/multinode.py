"""bench.multinode: TTFT, ITL and output throughput of the two-node setup (a prefill node and a decode node in two
network namespaces, KV over Mooncake TCP on their data veth, ``pdserve router`` in the root namespace) next to a
single-node engine (``pdserve serve``, root namespace, cpu-shm handoff), in one run, interleaved.

Run from the repository root as root (network namespaces, bench/netns.py) with the mooncake extra::

    python -m bench.multinode                  # concurrency 1 and 8, 3 repetitions
    python -m bench.multinode --reps 1 --json

The three servers start at once and stay up; bench/serving's client drives them in turn (the order swaps
every repetition, so a neighbour's burst hits both alike): per repetition and concurrency, ``--num-prompts`` fresh
random prompts of ``--input-len`` tokens (bench_serving's sampler; the same texts for both systems),
``--output-len`` tokens out, greedy, ``ignore_eos``, streaming. Printed: TTFT p50/p90, ITL p50 (ms) and output
tok/s per system (medians over repetitions), the ratios two-node / single-node (TTFT and ITL: lower is better
for the two-node setup; tok/s: higher) and the per-repetition TTFT p50 ratios (each pair ran back to back)
with their median, which show the noise.
Every process is stopped, the namespaces deleted and the engines' shm unlinked whatever happens (SIGTERM too).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from bench import serving as bs

SYSTEMS = ("single-node", "two-node")
FIGURES = ("ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "output_tok_s")
NODE_PORT = 8000   # free in a fresh namespace
DEFAULT_FLAGS = "--kv-pool-tokens 4096 --actor-hang-timeout-s 60"   # a loaded 2-core VM stalls actors for seconds


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.multinode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, action="append", help="requests in flight (repeatable; default 1, 8)")
    ap.add_argument("--num-prompts", type=int, default=0,
                    help="requests per run (default: 4 at concurrency 1, 2 x concurrency above)")
    ap.add_argument("--input-len", type=int, default=64, help="prompt tokens")
    ap.add_argument("--output-len", type=int, default=16, help="output tokens (ignore_eos)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions; medians are reported")
    ap.add_argument("--flags", default=DEFAULT_FLAGS, help="pdserve flags of every server (nodes and single node)")
    ap.add_argument("--ready-timeout-s", type=float, default=600.0, help="start-up limit of each server")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="per-request read timeout")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the rows as one JSON object after the table")
    return ap


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line with ``concurrency`` defaulted to [1, 8]. Raises SystemExit (argparse) for a value < 1."""
    ap = build_parser()
    args = ap.parse_args(argv)
    args.concurrency = args.concurrency or [1, 8]
    for name in ("input_len", "output_len", "reps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.concurrency) < 1:
        ap.error("--concurrency must be >= 1")
    return args


def num_prompts(args: argparse.Namespace, concurrency: int) -> int:
    return args.num_prompts or (4 if concurrency == 1 else 2 * concurrency)


# --------------------------------------------------------------------------- figures, ratios, table


def figures(summary: dict[str, Any]) -> dict[str, Any]:
    """The figures of one bench_serving run (``bs.summarize``'s dict); None figures when nothing completed."""
    done = summary["completed"] > 0
    raw = {"ttft_p50_ms": summary["ttft_ms"]["p50"], "ttft_p90_ms": summary["ttft_ms"]["p90"],
           "itl_p50_ms": summary["itl_ms"]["p50"], "output_tok_s": summary["output_throughput"]}
    out: dict[str, Any] = {k: (v if done and v == v else None) for k, v in raw.items()}   # v != v: NaN
    out.update(completed=summary["completed"], failed=summary["failed"], errors=summary["errors"])
    return out


def _ratio(mine: float | None, base: float | None) -> float | None:
    return mine / base if mine is not None and base else None


def build_rows(runs: dict[int, dict[str, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """One row per concurrency from ``runs[concurrency][system]`` = that system's figures per repetition (same
    order for both systems): per system the median of each figure over repetitions (None ones left out) and the
    failures summed; ``ratios[figure]`` = two-node median / single-node median; ``ttft_p50_ratio_per_rep`` and
    their median, ``ttft_p50_ratio_paired_median`` (steadier than the ratio of medians when the load drifts)."""
    rows = []
    for concurrency, by_system in runs.items():
        row: dict[str, Any] = {"concurrency": concurrency}
        for system in SYSTEMS:
            reps = by_system[system]
            med = {}
            for fig in FIGURES:
                vals = [r[fig] for r in reps if r.get(fig) is not None]
                med[fig] = statistics.median(vals) if vals else None
            med["failed"] = sum(r.get("failed", 0) for r in reps)
            med["errors"] = sorted({e for r in reps for e in r.get("errors", [])})[:3]
            row[system] = med
        row["ratios"] = {fig: _ratio(row["two-node"][fig], row["single-node"][fig]) for fig in FIGURES}
        per_rep = [_ratio(b.get("ttft_p50_ms"), a.get("ttft_p50_ms"))
                   for a, b in zip(by_system["single-node"], by_system["two-node"])]
        row["ttft_p50_ratio_per_rep"] = per_rep
        paired = [x for x in per_rep if x is not None]   # each repetition's pair ran back to back: same load
        row["ttft_p50_ratio_paired_median"] = statistics.median(paired) if paired else None
        rows.append(row)
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else fmt.format(v)

    head = (f"{'concurrency':>11}  {'system':<13} {'TTFT p50 ms':>11} {'TTFT p90 ms':>11} {'ITL p50 ms':>10} "
            f"{'out tok/s':>9}")
    lines = [head, "-" * len(head)]
    for row in rows:
        for system in SYSTEMS:
            f = row[system]
            failed = f"  [{f['failed']} failed: {'; '.join(f['errors'])}]" if f["failed"] else ""
            lines.append(f"{row['concurrency']:>11}  {system:<13} {num(f['ttft_p50_ms'], '{:.0f}'):>11} "
                         f"{num(f['ttft_p90_ms'], '{:.0f}'):>11} {num(f['itl_p50_ms'], '{:.1f}'):>10} "
                         f"{num(f['output_tok_s'], '{:.1f}'):>9}{failed}")
        r = row["ratios"]
        lines.append(f"{'':>11}  {'two / single':<13} {num(r['ttft_p50_ms'], '{:.2f}x'):>11} "
                     f"{num(r['ttft_p90_ms'], '{:.2f}x'):>11} {num(r['itl_p50_ms'], '{:.2f}x'):>10} "
                     f"{num(r['output_tok_s'], '{:.2f}x'):>9}")
        per_rep = ", ".join(num(x, "{:.2f}x") for x in row["ttft_p50_ratio_per_rep"])
        lines.append(f"{'':>11}  TTFT p50 two / single per repetition: {per_rep} (median "
                     f"{num(row['ttft_p50_ratio_paired_median'], '{:.2f}x')})")
    return "\n".join(lines)


# --------------------------------------------------------------------------- processes


@dataclass
class NodeProcess:
    """One ``pdserve serve --role ROLE`` started inside a namespace of a TwoHostNet."""

    role: str
    url: str
    proc: subprocess.Popen
    log_path: Path


def start_node(net, role: str, flags: Sequence[str], log_dir: Path) -> NodeProcess:
    """``pdserve serve --role ROLE --kv-transport mooncake`` in ``role``'s namespace, its API on the control
    address (port NODE_PORT), its Mooncake engine on the data address; returns at once (not yet ready)."""
    from bench.netns import start_in_namespace

    ns, addr, data_addr = ((net.prefill_ns, net.prefill_addr, net.prefill_data_addr) if role == "prefill" else
                           (net.decode_ns, net.decode_addr, net.decode_data_addr))
    log_path = log_dir / f"{role}.log"
    argv = [sys.executable, "-m", "pdserve.cli", "serve", "--role", role, "--host", addr, "--port", str(NODE_PORT),
            "--kv-transport", "mooncake", "--kv-transfer-host", data_addr, "--node-secret-file",
            str(node_secret_file(log_dir)), *flags]
    return NodeProcess(role, f"http://{addr}:{NODE_PORT}", start_in_namespace(ns, argv, log_path), log_path)


def node_secret_file(log_dir: Path) -> Path:
    """The router <-> node secret of this run (``log_dir/node-secret``, made on the first call)."""
    import secrets

    path = log_dir / "node-secret"
    if not path.exists():
        path.write_text(secrets.token_hex(32) + "\n")
        path.chmod(0o600)
    return path


def stop_node(node: NodeProcess) -> None:
    """SIGTERM (then SIGKILL) the node's supervisor, then unlink every segment of the engine ids its log names
    (a supervisor killed before its own cleanup leaves them)."""
    from ipc.naming import unlink_all
    from bench.netns import stop_process

    stop_process(node.proc, 60)
    text = node.log_path.read_text(errors="replace") if node.log_path.exists() else ""
    for engine_id in sorted(set(re.findall(r"\bengine ([0-9a-f]{8})\b", text))):
        unlink_all(engine_id)


def start_router(prefill_url: str, decode_url: str, flags: Sequence[str], log_dir: Path
                 ) -> tuple[subprocess.Popen, str]:
    """``pdserve router`` on a free loopback port of the root namespace; (process, base URL), not yet ready. Its
    nodes are reached in cleartext (``--insecure-nodes``: namespaces on one host; TLS would add its cost to what
    the benchmark compares) with the run's node secret."""
    from bench.engine_process import _free_port
    from bench.netns import ROOT

    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    with open(log_dir / "router.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "router", "--port", str(port),
                                 "--prefill-node", prefill_url, "--decode-node", decode_url, "--node-secret-file",
                                 str(node_secret_file(log_dir)), "--insecure-nodes", *flags],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def start_systems(stack: contextlib.ExitStack, args: argparse.Namespace, log_dir: Path) -> dict[str, str]:
    """Both systems up (the nodes boot while the single node does), each registered on ``stack`` to be stopped;
    {system: base URL}. Raises RuntimeError/AssertionError (with the log's name) when one does not come up."""
    from bench.engine_process import engine
    from bench.netns import TwoHostNet, stop_process, sweep_stale, wait_http_ok

    flags = shlex.split(args.flags)
    sweep_stale()
    net = stack.enter_context(TwoHostNet())
    nodes = []
    for role in ("prefill", "decode"):
        nodes.append(start_node(net, role, flags, log_dir))
        stack.callback(stop_node, nodes[-1])
    t0 = time.monotonic()
    single = stack.enter_context(engine(*flags, ready_timeout_s=args.ready_timeout_s))
    print(f"# single node ready after {time.monotonic() - t0:.0f} s ({single.log_path})", flush=True)
    for node in nodes:
        wait_http_ok(node.url + "/health", max(1.0, args.ready_timeout_s - (time.monotonic() - t0)), node.proc)
    print(f"# prefill and decode nodes ready after {time.monotonic() - t0:.0f} s (logs in {log_dir})", flush=True)
    router, router_url = start_router(nodes[0].url, nodes[1].url, flags, log_dir)
    stack.callback(stop_process, router, 30)
    wait_http_ok(router_url + "/health", 120, router)
    return {"single-node": single.base_url, "two-node": router_url}


# --------------------------------------------------------------------------- measurements


def serving_run(base_url: str, sessions: list[bs.Session], concurrency: int, tokenizer,
                timeout_s: float) -> dict[str, Any]:
    """bench_serving's client over ``sessions`` at ``concurrency`` requests in flight; ``figures`` of the run."""
    ns = bs.parse_args(["--base-url", base_url, "--max-concurrency", str(concurrency), "--ignore-eos",
                        "--warmup-requests", "0", "--disable-progress", "--timeout-s", str(timeout_s)])
    results, duration_s = asyncio.run(bs.run_benchmark(ns, sessions, tokenizer))
    return figures(bs.summarize(results, duration_s))


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def measure(urls: dict[str, str], args: argparse.Namespace, tokenizer) -> dict[int, dict[str, list[dict]]]:
    """Every repetition, concurrency and system in turn (order swapped each repetition); the figures."""
    from bench.anchors import warm_up

    for url in urls.values():   # first requests pay lazy initialisation (and the nodes' first Mooncake dial)
        warm_up(url)
    runs: dict[int, dict[str, list[dict]]] = {c: {s: [] for s in SYSTEMS} for c in args.concurrency}
    for rep in range(args.reps):
        for concurrency in args.concurrency:
            seed = args.seed + 1000 * rep + concurrency
            order = SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]
            for system in order:
                # fresh texts per repetition and concurrency (no prefix-cache hits), the same for both systems
                sessions = bs.sample_random_requests(num_prompts(args, concurrency), args.input_len,
                                                     args.output_len, 0.0, random.Random(seed), tokenizer)
                figs = serving_run(urls[system], sessions, concurrency, tokenizer, args.timeout_s)
                runs[concurrency][system].append(figs)
                print(f"# rep {rep + 1} concurrency {concurrency:>2} {system:<11}: TTFT p50 "
                      f"{figs['ttft_p50_ms'] or float('nan'):.0f} ms, ITL p50 {figs['itl_p50_ms'] or float('nan'):.1f}"
                      f" ms, {figs['output_tok_s'] or 0:.1f} tok/s, {figs['failed']} failed; load {_load()}",
                      flush=True)
    return runs


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from bench.kv_network import skip_reason

    if reason := skip_reason(netns=True):
        print(f"bench_multinode skipped: {reason}", flush=True)
        return {"skipped": reason}
    # SIGTERM unwinds like Ctrl-C: every `finally` and ExitStack callback runs (processes, namespaces, shm)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    print(f"# bench_multinode {started}, load average {_load()}, {os.cpu_count()} CPUs; flags {args.flags!r}",
          flush=True)
    tokenizer = bs.load_tokenizer("pdserve")
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-multinode-"))   # kept: the servers' logs, to read a failure
    with contextlib.ExitStack() as stack:
        urls = start_systems(stack, args, log_dir)
        runs = measure(urls, args, tokenizer)
    rows = build_rows(runs)
    print(f"\n# two-node (router + prefill node + decode node, Mooncake TCP over a veth) vs single node (cpu-shm); "
          f"{args.input_len}-token prompts, {args.output_len} output tokens, greedy, ignore_eos; median of "
          f"{args.reps}; load average at the end {_load()}")
    print(format_table(rows))
    result = {"started": started, "args": {k: v for k, v in vars(args).items()}, "rows": rows}
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
