"""bench.serving: an OpenAI-API load generator (in the spirit of ``sglang.bench_serving`` and vLLM's
``benchmark_serving``) for pdserve or any OpenAI-compatible server.

Examples (from the repository root)::

    # fixed concurrency, random prompts of 128 +- 50% tokens, 64 output tokens each
    python -m bench.serving --base-url http://127.0.0.1:8000 --num-prompts 32 \\
        --max-concurrency 4 --input-len 128 --output-len 64 --range-ratio 0.5 --ignore-eos
    # Poisson arrivals at 2 req/s on the chat endpoint, goodput against an SLO, JSON out
    python -m bench.serving --base-url http://127.0.0.1:8000 --endpoint chat --request-rate 2 \\
        --num-prompts 40 --slo-ttft-ms 2000 --slo-tpot-ms 200 --json
    # a JSONL file of conversations (ShareGPT "conversations" or OpenAI "messages"), 3 rounds per session
    python -m bench.serving --base-url ... --endpoint chat --dataset convs.jsonl --multi-turn

What is measured, per request (client side, ``time.perf_counter``, streaming responses):
    TTFT   time from sending the request to the first chunk that carries text
    ITL    gaps between consecutive text-carrying chunks (one chunk may carry several tokens)
    TPOT   (e2e - TTFT) / (output_tokens - 1), for requests with more than one output token
    e2e    time from sending the request to the end of the stream
Output tokens come from the server's ``usage`` (we ask for it with ``stream_options.include_usage``); a server
that sends none is measured with the client tokenizer over the returned text (``--tokenizer``), or, without a
tokenizer, one token per text chunk. Goodput (vLLM's definition) is the rate of finished requests that met every
SLO given. Absolute numbers depend on the machine; on a shared host compare runs made back to back.

The pure functions (``percentiles``, ``summarize``, ``sample_random_requests``, ``load_dataset``,
``poisson_delays``) have no I/O and are unit tested in tests/bench/test_serving.py.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

# --------------------------------------------------------------------------- data model


@dataclass
class Turn:
    """One user message of a session; ``output_len`` is the max_tokens asked for it."""

    text: str
    prompt_len: int          # client-side estimate (tokens), -1 if unknown
    output_len: int


@dataclass
class Session:
    """A conversation of one or more turns, sent one after the other, each with the previous turns' real
    replies as history. Single-round benchmarks have one turn per session."""

    turns: list[Turn]


@dataclass
class RequestResult:
    """What the client saw for one request. Times in seconds (perf_counter differences)."""

    ok: bool = False
    error: str = ""
    prompt_len: int = 0          # server usage.prompt_tokens when given, else the client estimate
    output_len: int = 0          # output tokens (see module docstring for the source)
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0           # perf_counter at send, relative to the benchmark start
    text: str = ""
    usage_reported: bool = False
    cached_tokens: int = 0       # usage.prompt_tokens_details.cached_tokens (prompt tokens the server reused)

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_len <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)


# --------------------------------------------------------------------------- pure statistics


def percentiles(values: Sequence[float], ps: Iterable[float] = (50, 90, 99)) -> dict[str, float]:
    """{"mean", "p50", "p90", ...} of ``values`` with linear interpolation between closest ranks (numpy's
    default method). Empty input gives NaN everywhere."""
    ps = list(ps)
    xs = sorted(float(v) for v in values)
    out: dict[str, float] = {"mean": (sum(xs) / len(xs)) if xs else math.nan}
    for p in ps:
        if not 0 <= p <= 100:
            raise ValueError(f"percentile {p} must be in 0..100")
        if not xs:
            out[f"p{p:g}"] = math.nan
            continue
        rank = (len(xs) - 1) * p / 100.0
        lo = math.floor(rank)
        hi = min(lo + 1, len(xs) - 1)
        out[f"p{p:g}"] = xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)
    return out


def summarize(results: Sequence[RequestResult], duration_s: float, *, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None, slo_e2e_ms: float | None = None,
              ps: Iterable[float] = (50, 90, 99)) -> dict[str, Any]:
    """Aggregate per-request results over a run of ``duration_s`` seconds (wall time, first send to last
    finish). Latencies in the result are in milliseconds; throughputs per second.

    Goodput counts finished requests whose TTFT, TPOT and e2e are within every SLO given (a request with a
    single output token has no TPOT and passes that SLO). Raises ValueError for a non-positive duration.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s={duration_s} must be > 0")
    ps = list(ps)
    ok = [r for r in results if r.ok]
    ms = 1000.0

    def dist(values: list[float]) -> dict[str, float]:
        return {k: v * ms for k, v in percentiles(values, ps).items()}

    tpots = [t for t in (r.tpot for r in ok) if t is not None]
    itls = [x for r in ok for x in r.itl]
    good = 0
    for r in ok:
        if slo_ttft_ms is not None and r.ttft * ms > slo_ttft_ms:
            continue
        if slo_tpot_ms is not None and r.tpot is not None and r.tpot * ms > slo_tpot_ms:
            continue
        if slo_e2e_ms is not None and r.e2e * ms > slo_e2e_ms:
            continue
        good += 1
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    any_slo = any(s is not None for s in (slo_ttft_ms, slo_tpot_ms, slo_e2e_ms))
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "total_cached_tokens": sum(r.cached_tokens for r in ok),
        "request_throughput": len(ok) / duration_s,
        "input_throughput": total_in / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "goodput": (good / duration_s) if any_slo else None,
        "good_requests": good if any_slo else None,
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms, "e2e_ms": slo_e2e_ms},
        "ttft_ms": dist([r.ttft for r in ok]),
        "tpot_ms": dist(tpots),
        "itl_ms": dist(itls),
        "e2e_ms": dist([r.e2e for r in ok]),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
    }


def poisson_delays(n: int, rate: float, rng: random.Random) -> list[float]:
    """Gaps (s) before each of ``n`` arrivals of a Poisson process of ``rate`` requests/s; ``inf`` (or <= 0
    interpreted as no limit) gives all zeros: every request sent at once."""
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    if not math.isfinite(rate) or rate <= 0:
        return [0.0] * n
    return [rng.expovariate(rate) for _ in range(n)]


def _lengths(n: int, mean: int, range_ratio: float, rng: random.Random) -> list[int]:
    """``n`` integers uniform in [mean * (1 - range_ratio), mean * (1 + range_ratio)], at least 1."""
    if not 0 <= range_ratio <= 1:
        raise ValueError(f"range_ratio={range_ratio} must be in 0..1")
    lo = max(1, int(round(mean * (1 - range_ratio))))
    hi = max(lo, int(round(mean * (1 + range_ratio))))
    return [rng.randint(lo, hi) for _ in range(n)]


WORDS = ("the quick brown fox jumps over lazy dog time people year way day man thing woman life child world "
         "school state family student group country problem hand part place case week company system program "
         "question work government number night point home water room mother area money story fact month lot "
         "right study book eye job word business issue side kind head house service friend father power hour "
         "game line end member law car city community name president team minute idea kid body information").split()


def sample_random_requests(num: int, input_len: int, output_len: int, range_ratio: float, rng: random.Random,
                           tokenizer=None, num_rounds: int = 1) -> list[Session]:
    """``num`` sessions of ``num_rounds`` turns with random prompts.

    With a ``tokenizer`` (``encode``/``decode``/``vocab_size``), a prompt is ``input_len``-ish random token ids
    decoded to text (re-encoded to report its real length, which may differ by a few tokens after the round
    trip); without one, random English words (about one token each for a BPE tokenizer; length -1 = unknown).
    """
    if num_rounds < 1:
        raise ValueError(f"num_rounds={num_rounds} must be >= 1")
    sessions = []
    in_lens = _lengths(num * num_rounds, input_len, range_ratio, rng)
    out_lens = _lengths(num * num_rounds, output_len, range_ratio, rng)
    for i in range(num):
        turns = []
        for j in range(num_rounds):
            k = i * num_rounds + j
            if tokenizer is not None:
                # avoid the first ids (special tokens in most vocabularies)
                ids = [rng.randrange(100, tokenizer.vocab_size) for _ in range(in_lens[k])]
                text = tokenizer.decode(ids)
                turns.append(Turn(text, len(tokenizer.encode(text)), out_lens[k]))
            else:
                text = " ".join(rng.choice(WORDS) for _ in range(in_lens[k]))
                turns.append(Turn(text, -1, out_lens[k]))
        sessions.append(Session(turns))
    return sessions


def _conversation(obj: dict) -> list[tuple[str, str]]:
    """(role, text) pairs of one JSONL record: ShareGPT ``conversations`` [{from, value}], OpenAI ``messages``
    [{role, content}], or a bare {"prompt": ..., "completion"/"response": ...}."""
    roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
             "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system"}
    if isinstance(obj.get("conversations"), list):
        return [(roles.get(str(m.get("from", "")).lower(), "user"), str(m.get("value", "")))
                for m in obj["conversations"] if isinstance(m, dict)]
    if isinstance(obj.get("messages"), list):
        return [(roles.get(str(m.get("role", "")).lower(), "user"), str(m.get("content", "")))
                for m in obj["messages"] if isinstance(m, dict)]
    if "prompt" in obj:
        out = [("user", str(obj["prompt"]))]
        reply = obj.get("completion", obj.get("response"))
        if reply is not None:
            out.append(("assistant", str(reply)))
        return out
    raise ValueError("a record needs 'conversations', 'messages' or 'prompt'")


def load_dataset(lines: Iterable[str], num: int, rng: random.Random, *, tokenizer=None,
                 output_len: int | None = None, multi_turn: bool = False, max_rounds: int = 0,
                 default_output_len: int = 128, min_output_len: int = 4, shuffle: bool = True) -> list[Session]:
    """Sessions from JSONL conversation records (see ``_conversation``); blank lines and records without a
    user message are skipped.

    Each user message is a turn; its max_tokens is ``output_len`` when given, else the token length of the
    dataset's reply to it (with a tokenizer; at least ``min_output_len``), else ``default_output_len``. Without
    ``multi_turn`` only the first user turn of each record is used (single round, like ShareGPT benchmarks);
    ``max_rounds`` > 0 caps the turns per session. Records are cycled if the file has fewer than ``num``.
    Raises ValueError naming the line of a malformed record, or when no usable record exists.
    """
    records: list[Session] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            conv = _conversation(json.loads(line))
        except (ValueError, AttributeError) as exc:
            raise ValueError(f"dataset line {lineno}: {exc}") from exc
        turns: list[Turn] = []
        for i, (role, text) in enumerate(conv):
            if role != "user" or not text.strip():
                continue
            reply = conv[i + 1][1] if i + 1 < len(conv) and conv[i + 1][0] == "assistant" else None
            if output_len is not None:
                olen = output_len
            elif reply is not None and tokenizer is not None:
                olen = max(min_output_len, len(tokenizer.encode(reply)))
            else:
                olen = default_output_len
            plen = len(tokenizer.encode(text)) if tokenizer is not None else -1
            turns.append(Turn(text, plen, olen))
            if not multi_turn or (max_rounds and len(turns) >= max_rounds):
                break
        if turns:
            records.append(Session(turns))
    if not records:
        raise ValueError("the dataset has no record with a user message")
    if shuffle:
        rng.shuffle(records)
    return [records[i % len(records)] for i in range(num)]


# --------------------------------------------------------------------------- client


def _payload(endpoint: str, model: str, history: list[tuple[str, str]], turn: Turn, args) -> tuple[str, dict]:
    body: dict[str, Any] = {"model": model, "max_tokens": turn.output_len, "temperature": args.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.extra_body:
        body.update(json.loads(args.extra_body))
    if endpoint == "chat":
        msgs = [{"role": r, "content": t} for r, t in history] + [{"role": "user", "content": turn.text}]
        body["messages"] = msgs
        return "/v1/chat/completions", body
    body["prompt"] = "".join(t for _, t in history) + turn.text
    return "/v1/completions", body


def _chunk_text(obj: dict, endpoint: str) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if endpoint == "chat":
        return (c.get("delta") or {}).get("content") or ""
    return c.get("text") or ""


async def send_request(client, base_url: str, endpoint: str, model: str, history: list[tuple[str, str]],
                       turn: Turn, args, t_zero: float, tokenizer=None) -> RequestResult:
    """One streaming request; never raises for a server or network error (it lands in ``result.error``)."""
    path, body = _payload(endpoint, model, history, turn, args)
    res = RequestResult(prompt_len=turn.prompt_len)
    t0 = time.perf_counter()
    res.start = t0 - t_zero
    last = t0
    parts: list[str] = []
    chunks = 0
    try:
        async with client.stream("POST", base_url + path, json=body, headers=args.headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200].decode(errors='replace')}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj and not obj.get("choices"):
                    err = obj["error"]
                    res.error = str(err.get("message", err) if isinstance(err, dict) else err)[:200]
                    return res
                usage = obj.get("usage")
                if usage:
                    res.usage_reported = True
                    res.output_len = int(usage.get("completion_tokens") or 0)
                    if usage.get("prompt_tokens") is not None:
                        res.prompt_len = int(usage["prompt_tokens"])
                    res.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                text = _chunk_text(obj, endpoint)
                if text:
                    now = time.perf_counter()
                    if not parts:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                    parts.append(text)
                    chunks += 1
        res.e2e = time.perf_counter() - t0
        res.text = "".join(parts)
        if not res.usage_reported:
            res.output_len = len(tokenizer.encode(res.text)) if tokenizer is not None else chunks
        if not parts:  # no text at all (e.g. EOS first): TTFT is the whole request
            res.ttft = res.e2e
        res.ok = True
    except Exception as exc:  # noqa: BLE001 - a benchmark reports errors, it does not stop on them
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    return res


async def run_benchmark(args, sessions: list[Session], tokenizer=None) -> tuple[list[RequestResult], float]:
    """Send every session's turns (Poisson arrivals of sessions, ``--max-concurrency`` requests in flight at
    most); returns the results and the wall duration from first send to last finish."""
    import httpx

    rng = random.Random(args.seed + 1)
    delays = poisson_delays(len(sessions), args.request_rate, rng)
    limit = args.max_concurrency or None
    sem = asyncio.Semaphore(limit) if limit else None
    total = sum(len(s.turns) for s in sessions)
    bar = _progress(total, args.disable_progress)
    results: list[RequestResult] = []
    timeout = httpx.Timeout(args.timeout_s, connect=30.0)
    limits = httpx.Limits(max_connections=max(limit or total, 1) + 8, max_keepalive_connections=max(limit or 0, 64))
    async with httpx.AsyncClient(timeout=timeout, limits=limits, http2=args.http2) as client:
        model = args.model or await _served_model(client, args.base_url)

        async def one_session(session: Session) -> None:
            history: list[tuple[str, str]] = []
            for turn in session.turns:
                if sem is not None:
                    async with sem:
                        r = await send_request(client, args.base_url, args.endpoint, model, history, turn, args,
                                               t_zero, tokenizer)
                else:
                    r = await send_request(client, args.base_url, args.endpoint, model, history, turn, args,
                                           t_zero, tokenizer)
                results.append(r)
                bar.update(1)
                if not r.ok:
                    return  # the rest of a session depends on this reply
                history += [("user", turn.text), ("assistant", r.text)]

        if args.warmup_requests:
            w = sessions[0].turns[0]
            for _ in range(args.warmup_requests):
                await send_request(client, args.base_url, args.endpoint, model, [],
                                   Turn(w.text, w.prompt_len, min(w.output_len, 8)), args, time.perf_counter())
        t_zero = time.perf_counter()
        tasks = []
        for session, delay in zip(sessions, delays):
            if delay:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one_session(session)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t_zero
    bar.close()
    return results, duration


async def _served_model(client, base_url: str) -> str:
    resp = await client.get(base_url + "/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, disabled: bool):
    if disabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", file=sys.stderr, dynamic_ncols=True)


# --------------------------------------------------------------------------- tokenizer and report


def load_tokenizer(spec: str):
    """``pdserve`` = pdserve's tokenizer of its default model (or of a GGUF/HF dir given as ``pdserve:PATH``);
    ``none`` = no tokenizer; anything else = ``transformers.AutoTokenizer.from_pretrained(spec)``."""
    if spec == "none":
        return None
    if spec == "pdserve" or spec.startswith("pdserve:"):
        from gpu.tokenizer import Tokenizer

        return Tokenizer.load(spec.partition(":")[2] or None)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(spec)

    class _Wrap:
        vocab_size = tok.vocab_size

        def encode(self, text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=False)

        def decode(self, ids) -> str:
            return tok.decode(ids, skip_special_tokens=True)

    return _Wrap()


def format_report(s: dict[str, Any], title: str = "Serving benchmark") -> str:
    lines = [f"{'=' * 18} {title} {'=' * 18}"]

    def row(label: str, value: Any, fmt: str = "{:.2f}") -> None:
        text = "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)
        lines.append(f"{label:<40}{text:>14}" if len(label) <= 40 else f"{label} {text}")

    row("Successful requests:", s["completed"], "{}")
    row("Failed requests:", s["failed"], "{}")
    row("Benchmark duration (s):", s["duration_s"])
    row("Total input tokens:", s["total_input_tokens"], "{}")
    row("Total output tokens:", s["total_output_tokens"], "{}")
    row("Cached prompt tokens (server-reported):", s.get("total_cached_tokens", 0), "{}")
    row("Request throughput (req/s):", s["request_throughput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Total token throughput (tok/s):", s["total_token_throughput"])
    if s["goodput"] is not None:
        slo = ", ".join(f"{k}<={v:g}" for k, v in s["slo"].items() if v is not None)
        row(f"Goodput (req/s) [{slo}]:", s["goodput"])
    for key, name in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st)"),
                      ("itl_ms", "Inter-token Latency"), ("e2e_ms", "End-to-end Latency")):
        lines.append(f"{'-' * 12} {name} {'-' * 12}")
        for stat, v in s[key].items():
            row(f"{stat.capitalize() if stat == 'mean' else stat.upper()} {key.split('_')[0].upper()} (ms):", v)
    if s["errors"]:
        lines.append("errors: " + "; ".join(s["errors"]))
    lines.append("=" * (38 + len(title)))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    ap.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    ap.add_argument("--model", default="", help="model name to send; empty = the first of /v1/models")
    ap.add_argument("--num-prompts", type=int, default=32, help="sessions to send (= requests when single-round)")
    ap.add_argument("--request-rate", type=float, default=math.inf,
                    help="Poisson arrival rate of sessions per second; inf = all at once")
    ap.add_argument("--max-concurrency", type=int, default=0, help="most requests in flight; 0 = no limit")
    ap.add_argument("--input-len", type=int, default=128, help="random prompts: mean input tokens")
    ap.add_argument("--output-len", type=int, default=None,
                    help="max_tokens per request (random prompts: mean, default 128; dataset: overrides the "
                         "length of the dataset's reply)")
    ap.add_argument("--range-ratio", type=float, default=0.0,
                    help="random lengths are uniform in mean*(1-r) .. mean*(1+r)")
    ap.add_argument("--dataset", default="", help="JSONL of conversations instead of random prompts")
    ap.add_argument("--multi-turn", action="store_true",
                    help="dataset: send every user turn of a record as one session, with the real replies "
                         "as history")
    ap.add_argument("--num-rounds", type=int, default=None,
                    help="random prompts: turns per session (multi-round; history grows each round); dataset "
                         "with --multi-turn: the most turns per session (default: all)")
    ap.add_argument("--tokenizer", default="pdserve",
                    help="'pdserve' (the default model's), 'pdserve:PATH', an HF name/path, or 'none'")
    ap.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true (a vLLM/SGLang extension)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--extra-body", default="", help="JSON object merged into every request body")
    ap.add_argument("--header", action="append", default=[], help="extra HTTP header 'Name: value' (repeatable)")
    ap.add_argument("--http2", action="store_true", help="use HTTP/2 (h2c prior knowledge on http://)")
    ap.add_argument("--slo-ttft-ms", type=float, default=None)
    ap.add_argument("--slo-tpot-ms", type=float, default=None)
    ap.add_argument("--slo-e2e-ms", type=float, default=None)
    ap.add_argument("--percentiles", default="50,90,99")
    ap.add_argument("--warmup-requests", type=int, default=1, help="short requests sent (and not counted) first")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per-request read timeout")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON object instead of a table")
    ap.add_argument("--output-file", default="", help="append the JSON summary (one line) to this file")
    ap.add_argument("--disable-progress", action="store_true")
    return ap


def build_sessions(args, tokenizer) -> list[Session]:
    rng = random.Random(args.seed)
    if args.dataset:
        with open(args.dataset, encoding="utf-8") as f:
            return load_dataset(f, args.num_prompts, rng, tokenizer=tokenizer, output_len=args.output_len,
                                multi_turn=args.multi_turn, max_rounds=args.num_rounds or 0)
    return sample_random_requests(args.num_prompts, args.input_len, args.output_len or 128, args.range_ratio, rng,
                                  tokenizer, num_rounds=args.num_rounds or 1)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, normalised: ``base_url`` without a trailing ``/`` or ``/v1``, ``headers`` a dict."""
    args = build_parser().parse_args(argv)
    args.base_url = args.base_url.rstrip("/")
    if args.base_url.endswith("/v1"):
        args.base_url = args.base_url[:-3]
    args.headers = dict(h.split(":", 1) for h in args.header)
    args.headers = {k.strip(): v.strip() for k, v in args.headers.items()}
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    ps = [float(p) for p in args.percentiles.split(",") if p.strip()]
    tokenizer = load_tokenizer(args.tokenizer)
    sessions = build_sessions(args, tokenizer)
    results, duration = asyncio.run(run_benchmark(args, sessions, tokenizer))
    summary = summarize(results, duration, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
                        slo_e2e_ms=args.slo_e2e_ms, ps=ps)
    summary["config"] = {k: v for k, v in vars(args).items() if k not in ("headers",)}
    summary["config"]["request_rate"] = str(args.request_rate)
    summary["output_len_source"] = ("server usage" if results and all(r.usage_reported for r in results if r.ok)
                                    else "client tokenizer" if tokenizer is not None else "text chunks")
    if args.json:
        print(json.dumps(summary, default=str))
    else:
        print(format_report(summary))
    if args.output_file:
        with open(args.output_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(summary, default=str) + "\n")
    return summary


if __name__ == "__main__":
    main()
