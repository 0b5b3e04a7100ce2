"""Multi-round agentic reproducer: S sessions, each R chat rounds over one persistent connection.

Each session is a conversation that grows: every round appends a user turn and, once answered, the assistant's
answer, so the prompt gets longer round after round (what agent harnesses do). Over HTTP/1.1 every session keeps
its own keep-alive connection; with ``--http 2`` all sessions share ONE HTTP/2 connection (streams multiplexed).

Reports per-round latency percentiles, the slowest round, every error, and flags rounds slower than
``--slow-s``. Exit code: 0 all rounds answered; 1 a round got an error (HTTP status, bad body, reset connection);
2 a round hung (no answer within ``--round-timeout-s``). ``--base-url`` points it at a reverse proxy or any other
OpenAI-compatible server.

``--inject-round K --inject-id-prefix drop-`` sends round K of every session with ``X-Request-Id: drop-...`` so a
fault-injection engine (PDSERVE_FAULTS) can aim at it; that round's error is reported as expected (not a failure)
as long as it arrives within ``--round-timeout-s``, and the later rounds must still succeed on the same connection.

    python -m tools.multiround --base-url http://127.0.0.1:8000 --sessions 4 --rounds 24 --http 2
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

TOPICS = ["a file system", "a compiler", "a database", "a web server", "a scheduler", "a cache", "a network",
          "a shell"]


@dataclass
class Round:
    session: int
    round: int
    latency_s: float = 0.0
    status: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0   # usage.prompt_tokens_details.cached_tokens (the server's prefix cache)
    error: str = ""
    hang: bool = False
    injected: bool = False
    slow: bool = False


@dataclass
class Session:
    index: int
    rounds: list[Round] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


class ConnectionCounter:
    """Counts TCP connections the client opens (to show sessions really stay on one connection)."""

    def __init__(self):
        self.opened = 0

    async def __call__(self, event_name: str, info: dict) -> None:
        if event_name == "connection.connect_tcp.complete":
            self.opened += 1


async def one_round(client: httpx.AsyncClient, args, session: Session, r: int, messages: list[dict]) -> Round:
    result = Round(session.index, r, injected=(args.inject_round == r))
    body = {"messages": messages, "max_tokens": args.max_tokens, "temperature": 0}
    if args.model:
        body["model"] = args.model
    if args.stream:
        body.update(stream=True, stream_options={"include_usage": True})
    headers = {}
    if result.injected:
        headers["X-Request-Id"] = f"{args.inject_id_prefix}s{session.index}r{r}"[:40]
    start = time.monotonic()
    try:
        response = await asyncio.wait_for(client.post("/v1/chat/completions", json=body, headers=headers),
                                          timeout=args.round_timeout_s)
        result.status = response.status_code
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {response.text[:300]}"
        elif args.stream:
            text, usage = parse_stream(response.text)
            messages.append({"role": "assistant", "content": text})
            take_usage(result, usage)
        else:
            data = response.json()
            messages.append({"role": "assistant", "content": data["choices"][0]["message"]["content"]})
            take_usage(result, data["usage"])
    except (asyncio.TimeoutError, httpx.TimeoutException):
        result.hang = True
        result.error = f"no answer within {args.round_timeout_s} s (hang)"
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.latency_s = time.monotonic() - start
    result.slow = result.latency_s > args.slow_s
    if result.error and messages and messages[-1]["role"] == "user":
        messages.pop()   # the failed turn is not part of the conversation; the next round asks again
    return result


def take_usage(result: Round, usage: dict) -> None:
    result.prompt_tokens = usage.get("prompt_tokens", 0)
    result.completion_tokens = usage.get("completion_tokens", 0)
    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def cached_share(rounds: list[Round]) -> float | None:
    """Cached prompt tokens over prompt tokens of ``rounds`` (None: no prompt tokens)."""
    prompt = sum(r.prompt_tokens for r in rounds)
    return sum(r.cached_tokens for r in rounds) / prompt if prompt else None


def parse_stream(text: str) -> tuple[str, dict]:
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    if not lines or lines[-1] != "[DONE]":
        raise ValueError("the stream did not end with data: [DONE]")
    pieces, usage = [], {}
    for line in lines[:-1]:
        event = json.loads(line)
        if "error" in event:
            raise ValueError(f"error event in the stream: {event['error']}")
        if event.get("usage"):
            usage = event["usage"]
        for choice in event.get("choices", []):
            pieces.append(choice.get("delta", {}).get("content") or "")
    return "".join(pieces), usage


async def run_session(client: httpx.AsyncClient, args, index: int) -> Session:
    session = Session(index)
    messages = [{"role": "system", "content": "You are a terse assistant helping to design software."}]
    for r in range(args.rounds):
        messages.append({"role": "user", "content": f"Round {r}: give one more design tip for "
                                                    f"{TOPICS[(index + r) % len(TOPICS)]}."})
        session.rounds.append(await one_round(client, args, session, r, messages))
    return session


def make_client(args, counter: ConnectionCounter) -> httpx.AsyncClient:
    """One client = one connection (max_connections=1); every TCP connect is counted through httpcore's trace."""
    http2 = args.http == "2"
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1, keepalive_expiry=args.keepalive_expiry_s)
    return _client(args, http2, limits, counter)


def _client(args, http2: bool, limits: httpx.Limits, counter: ConnectionCounter) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    client = httpx.AsyncClient(base_url=args.base_url.rstrip("/"), http1=not http2, http2=http2, limits=limits,
                               timeout=httpx.Timeout(args.round_timeout_s + 5), verify=not args.insecure,
                               headers=headers)

    async def trace_request(request: httpx.Request) -> None:
        request.extensions["trace"] = counter

    client.event_hooks["request"] = [trace_request]
    return client


async def run(args) -> dict:
    counter = ConnectionCounter()
    started = time.monotonic()
    if args.http == "2":
        async with make_client(args, counter) as client:   # one connection, every session a stream on it
            sessions = await asyncio.gather(*(run_session(client, args, i) for i in range(args.sessions)))
    else:
        clients = [make_client(args, counter) for _ in range(args.sessions)]
        try:
            sessions = await asyncio.gather(*(run_session(c, args, i) for i, c in enumerate(clients)))
        finally:
            for c in clients:
                await c.aclose()
    rounds = [r for s in sessions for r in s.rounds]
    ok = [r for r in rounds if not r.error]
    latencies = [r.latency_s for r in ok]
    failures = [r for r in rounds if r.error and not (r.injected and not r.hang)]
    slowest = max(rounds, key=lambda r: r.latency_s) if rounds else None
    return {
        "base_url": args.base_url, "http": args.http, "sessions_n": args.sessions, "rounds_n": args.rounds,
        "wall_s": time.monotonic() - started, "rounds_ok": len(ok), "hangs": sum(r.hang for r in rounds),
        "connections_opened": counter.opened,
        "latency_s": {"p50": percentile(latencies, 0.5), "p90": percentile(latencies, 0.9),
                      "p99": percentile(latencies, 0.99), "max": max(latencies, default=0.0)},
        "slowest": asdict(slowest) if slowest else None,
        "cached_share": cached_share(ok), "cached_share_after_first_round": cached_share([r for r in ok if r.round]),
        "cached_share_by_round": [cached_share([r for r in ok if r.round == i]) for i in range(args.rounds)],
        "slow_rounds": [asdict(r) for r in rounds if r.slow],
        "errors": [asdict(r) for r in failures],
        "expected_errors": [asdict(r) for r in rounds if r.error and r.injected and not r.hang],
        "sessions": [{"index": s.index, "rounds": [asdict(r) for r in s.rounds]} for s in sessions],
    }


def print_report(report: dict, slow_s: float) -> None:
    lat = report["latency_s"]
    print(f"{report['sessions_n']} sessions x {report['rounds_n']} rounds over HTTP/{report['http']} to "
          f"{report['base_url']}: {report['rounds_ok']} ok, {len(report['errors'])} errors, {report['hangs']} hangs, "
          f"{report['connections_opened']} connections opened, {report['wall_s']:.1f} s")
    print(f"round latency p50 {lat['p50']:.3f} s  p90 {lat['p90']:.3f} s  p99 {lat['p99']:.3f} s  "
          f"max {lat['max']:.3f} s")
    if report["cached_share"] is not None:
        after = report["cached_share_after_first_round"]
        print(f"cached prompt tokens: {report['cached_share']:.1%} of all, "
              + (f"{after:.1%} after each session's first round" if after is not None else "-"))
    if report["slowest"]:
        s = report["slowest"]
        print(f"slowest: session {s['session']} round {s['round']} {s['latency_s']:.3f} s "
              f"(prompt {s['prompt_tokens']} tokens) {s['error'] or 'ok'}")
    for r in report["slow_rounds"]:
        print(f"SLOW (> {slow_s} s): session {r['session']} round {r['round']} {r['latency_s']:.3f} s")
    for r in report["expected_errors"]:
        print(f"injected fault, expected error: session {r['session']} round {r['round']} after "
              f"{r['latency_s']:.3f} s: {r['error']}")
    for r in report["errors"]:
        kind = "HANG" if r["hang"] else "ERROR"
        print(f"{kind}: session {r['session']} round {r['round']} after {r['latency_s']:.3f} s: {r['error']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.multiround", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server (or reverse proxy) root URL")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--http", choices=("1.1", "2"), default="1.1",
                        help="1.1: one keep-alive connection per session; 2: one HTTP/2 connection for all")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", default="", help="model name (default: the server's default)")
    parser.add_argument("--stream", action="store_true", help="stream every answer (SSE)")
    parser.add_argument("--round-timeout-s", type=float, default=120.0, help="a round with no answer by then hung")
    parser.add_argument("--slow-s", type=float, default=10.0, help="flag rounds slower than this")
    parser.add_argument("--keepalive-expiry-s", type=float, default=300.0,
                        help="client-side idle expiry of the connection")
    parser.add_argument("--inject-round", type=int, default=-1, help="round to aim a fault at (X-Request-Id)")
    parser.add_argument("--inject-id-prefix", default="drop-", help="X-Request-Id prefix of the injected round")
    parser.add_argument("--api-key", default="", help="sent as a Bearer token (for other servers)")
    parser.add_argument("--insecure", action="store_true", help="do not verify TLS certificates")
    parser.add_argument("--json", default="", help="also write the full report as JSON to this path")
    args = parser.parse_args(argv)
    if args.sessions < 1 or args.rounds < 1:
        parser.error("--sessions and --rounds must be >= 1")
    report = asyncio.run(run(args))
    print_report(report, args.slow_s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if report["hangs"]:
        return 2
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
