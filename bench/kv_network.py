"""bench.kv_network: KV handoff bandwidth of the ``mooncake`` transport (Mooncake Transfer Engine, TCP) next to
the ``cpu-shm`` transport and a plain TCP socket copy of the same bytes: between two processes on loopback, or
(``--netns``) between two network namespaces over their data veth, a prefill "host" and a decode "host".

Run from the repository root: ``python -m bench.kv_network [--reps 5] [--netns] [--json]`` (needs the
mooncake extra: ``make install-mooncake``; ``--netns`` needs root, bench/netns.py). A source process owns a KV
pool of the default model's geometry (SmolLM2-135M: 30 layers, 3 KV heads of 64, fp32, 16-token blocks: 720 KiB a
block), publishes it through Mooncake on its address, and serves a socket there. A reader process (this one on
loopback; one started in the decode namespace with ``--netns``, the source in the prefill namespace) times, for one
request of 128/512/2048 tokens (consecutive and scattered block ids):

* ``mooncake``: ``MooncakeTransport.start_copy`` then ``poll`` every 0.5 ms until DONE (one batched read, a
  worker thread); with ``--netns`` the bytes cross the data veth (10.78.k.2 -> 10.78.k.3);
* ``cpu-shm``: ``CpuShmTransport.start_copy`` of the same ids from the same pool (one host: /dev/shm, which
  network namespaces share, so this is the same-host baseline in both modes);
* ``socket``: the source sends the same number of bytes straight from its pool over one TCP connection (on the
  data veth with ``--netns``) and the reader ``recv_into``s them into its pool (no framing, one stream: the floor
  of a TCP handoff).

Repetitions are interleaved and the median is reported; ratios are what to compare on a shared machine.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.engine_process import terminate, wait_until

GEOMETRY = dict(num_layers=30, num_blocks=160, block_tokens=16, num_kv_heads=3, head_dim=64)
TOKENS = (128, 512, 2048)


def serve_source(pool_name: str, host: str, port_file: str) -> None:
    """The prefill-like side (``--serve-source``): a filled pool published through Mooncake on ``host``, and a
    TCP server on ``host`` (port written to ``port_file`` once both are up) that sends ``n`` bytes of the pool's
    data section per 8-byte little-endian request; n = 0 or the reader closing ends it. Unlinks its segments."""
    from ipc.kv_pool import KVPool
    from ipc.mooncake_transport import MooncakeSource, process_engine

    process_engine(host)   # the session id readers dial: this namespace's data address
    pool = KVPool.create(pool_name, **GEOMETRY)
    source = None
    try:
        pool.array()[:] = np.random.default_rng(1).standard_normal(pool.shape, dtype=np.float32)
        source = MooncakeSource(pool)
        data = memoryview(pool.array().reshape(-1).view(np.uint8))
        with socket.create_server((host, 0)) as server:
            tmp = port_file + ".tmp"
            Path(tmp).write_text(str(server.getsockname()[1]))
            os.replace(tmp, port_file)   # atomic: the parent never reads half a number
            conn, _ = server.accept()
            with conn:
                while (n := int.from_bytes(_recv_exact(conn, 8), "little")) > 0:
                    conn.sendall(data[:n])
    except ConnectionError:
        pass   # the reader went away: nothing more to serve
    finally:
        if source is not None:
            source.close(unlink=True)
        pool.close()
        pool.unlink()


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("source closed the socket")
        buf += chunk
    return bytes(buf)


def _socket_copy(conn: socket.socket, into: memoryview) -> None:
    conn.sendall(len(into).to_bytes(8, "little"))
    got = 0
    while got < len(into):
        n = conn.recv_into(into[got:])
        if n == 0:
            raise ConnectionError("source closed the socket")
        got += n


def _mooncake_copy(xfer, s_ids, d_ids, tokens) -> None:
    from ipc.kv_transport import TransferStatus

    h = xfer.start_copy(s_ids, d_ids, num_tokens=tokens)
    while (status := xfer.poll(h)) is TransferStatus.IN_PROGRESS:
        time.sleep(0.0005)   # the decode actor polls every ~1 ms; spinning would take a core from Mooncake's I/O
    xfer.release(h)
    if status is not TransferStatus.DONE:
        raise RuntimeError(f"mooncake transfer {status.name}")


def _ids(tokens: int, layout: str, rng) -> tuple[list[int], list[int]]:
    n = tokens // GEOMETRY["block_tokens"]
    if layout == "scattered":
        return rng.choice(GEOMETRY["num_blocks"], n, replace=False).tolist(), \
            rng.choice(GEOMETRY["num_blocks"], n, replace=False).tolist()
    return list(range(n)), list(range(n))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def read_side(src_name: str, src_addr: tuple[str, int], host: str, engine_id: str, reps: int,
              tokens_list: tuple[int, ...] = TOKENS) -> list[dict]:
    """The decode-like side: its own pool, Mooncake on ``host``, the cpu-shm transport on the source's pool
    ``src_name`` and a socket to ``src_addr``; one row per (layout, tokens). Its pool is named after
    ``engine_id`` (``naming.unlink_all(engine_id)`` removes it). Raises AssertionError if a Mooncake copy
    differs from the source blocks, RuntimeError if a transfer fails."""
    from ipc import naming
    from ipc.kv_pool import KVPool
    from ipc.kv_transport import CpuShmTransport
    from ipc.mooncake_transport import MooncakeTransport, process_engine

    process_engine(host)
    dst = KVPool.create(naming.segment_name(engine_id, "kvdst"), **GEOMETRY)
    conn = mc = shm = None
    rows = []
    try:
        conn = socket.create_connection(src_addr, timeout=60)
        mc, shm = MooncakeTransport(dst), CpuShmTransport(dst)
        mc.open_peer(src_name)
        shm.open_peer(src_name)
        sink = memoryview(dst.array().reshape(-1).view(np.uint8))
        rng = np.random.default_rng(0)
        for layout in ("consecutive", "scattered"):
            for tokens in tokens_list:
                rows.append(_bench_one(tokens, layout, rng, mc, shm, conn, sink, dst, reps))
    finally:
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall((0).to_bytes(8, "little"))
            conn.close()
        for xfer in (mc, shm):
            if xfer is not None:
                xfer.close()
        dst.close()
        dst.unlink()
    return rows


def _module_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "bench.kv_network", *args]


def _start_source(src_name: str, host: str, log_dir: str, ns: str | None = None) -> tuple[subprocess.Popen, int]:
    """The source process (inside network namespace ``ns`` if given) and its socket's port, once it is up.
    Raises RuntimeError (naming its log) if it exits or takes over 180 s."""
    from bench.netns import ROOT, start_in_namespace

    port_file, log_path = os.path.join(log_dir, "port"), os.path.join(log_dir, "source.log")
    argv = _module_argv("--serve-source", src_name, "--host", host, "--port-file", port_file)
    if ns is not None:
        proc = start_in_namespace(ns, argv, log_path)
    else:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: proc.poll() is not None or os.path.exists(port_file), 180, 0.05, "the source")
    except AssertionError:
        terminate(proc, 10)
        raise RuntimeError(f"the source process did not start in 180 s; see {log_path}") from None
    if proc.poll() is not None:
        raise RuntimeError(f"the source process exited ({proc.returncode}): {Path(log_path).read_text()[-2000:]}")
    return proc, int(Path(port_file).read_text())


def bench(reps: int, tokens_list: tuple[int, ...] = TOKENS, netns: bool = False) -> list[dict]:
    """Start the source, run ``read_side`` (here, or in the decode namespace with ``netns``), stop everything;
    the rows. Raises RuntimeError if a process fails (its output in the message), NetnsError from bench/netns."""
    from ipc import naming

    eid = naming.new_engine_id()
    src_name = naming.segment_name(eid, "kvsrc")
    proc = None
    with tempfile.TemporaryDirectory(prefix="pdserve-kvnet-") as log_dir, contextlib.ExitStack() as stack:
        stack.callback(naming.unlink_all, eid)   # runs last: whatever a killed process left
        try:
            if not netns:
                proc, port = _start_source(src_name, "127.0.0.1", log_dir)
                return read_side(src_name, ("127.0.0.1", port), "127.0.0.1", eid, reps, tokens_list)
            from bench.netns import TwoHostNet, exec_argv

            net = stack.enter_context(TwoHostNet())
            proc, port = _start_source(src_name, net.prefill_data_addr, log_dir, net.prefill_ns)
            argv = _module_argv("--read", src_name, "--source-addr", f"{net.prefill_data_addr}:{port}", "--host",
                                net.decode_data_addr, "--engine-id", eid, "--reps", str(reps),
                                *(f"--tokens={t}" for t in tokens_list))
            done = subprocess.run(exec_argv(net.decode_ns, argv), capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                raise RuntimeError(f"the reader in {net.decode_ns} failed ({done.returncode}): "
                                   f"{done.stderr[-3000:]}")
            return json.loads(done.stdout.strip().splitlines()[-1])
        finally:
            if proc is not None:
                terminate(proc, 30)


def _bench_one(tokens, layout, rng, mc, shm, conn, sink, dst, reps) -> dict:
    s_ids, d_ids = _ids(tokens, layout, rng)
    nbytes = len(s_ids) * dst.block_bytes
    contenders = {
        "mooncake": lambda: _mooncake_copy(mc, s_ids, d_ids, tokens),
        "cpu-shm": lambda: shm.release(shm.start_copy(s_ids, d_ids, num_tokens=tokens)),
        "socket": lambda: _socket_copy(conn, sink[:nbytes]),
    }
    for fn in contenders.values():  # warm-up: connections, page faults
        fn()
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(reps * max(1, 2048 // tokens // 2)):
        for k, fn in contenders.items():
            times[k].append(_timed(fn))
    _mooncake_copy(mc, s_ids, d_ids, tokens)
    src_view = shm.peer.array()   # the bytes mooncake wrote must be the source's
    if not np.array_equal(dst.array()[:, :, d_ids], src_view[:, :, s_ids]):
        raise AssertionError("mooncake copy differs from the source blocks")
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"tokens": tokens, "layout": layout, "blocks": len(s_ids), "mib": nbytes / 2**20,
            **{f"{k}_gb_s": nbytes / t / 1e9 for k, t in med.items()},
            **{f"{k}_ms": t * 1e3 for k, t in med.items()},
            "mooncake_vs_socket": med["socket"] / med["mooncake"],
            "mooncake_vs_cpu_shm": med["cpu-shm"] / med["mooncake"]}


def report(rows: list[dict]) -> str:
    head = (f"{'tokens':>6} {'layout':<11} {'MiB':>6} {'mooncake GB/s':>13} {'cpu-shm GB/s':>12} "
            f"{'socket GB/s':>11} {'mc/socket':>9} {'mc/cpu-shm':>10} {'mc ms':>7}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['tokens']:>6} {r['layout']:<11} {r['mib']:>6.1f} {r['mooncake_gb_s']:>13.2f} "
                     f"{r['cpu-shm_gb_s']:>12.2f} {r['socket_gb_s']:>11.2f} {r['mooncake_vs_socket']:>8.2f}x "
                     f"{r['mooncake_vs_cpu_shm']:>9.2f}x {r['mooncake_ms']:>7.1f}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.kv_network", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions per contender (x4 at 128 tokens)")
    ap.add_argument("--tokens", type=int, action="append", choices=TOKENS, help="request sizes (default all)")
    ap.add_argument("--netns", action="store_true",
                    help="source in one network namespace, reader in another, over their data veth (needs root)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON after the table")
    internal = ap.add_argument_group("internal (the processes this tool starts)")
    internal.add_argument("--serve-source", metavar="POOL", help="run the source side with a pool of this name")
    internal.add_argument("--read", metavar="POOL", help="run the reader side against this source pool; "
                          "prints its rows as one JSON line")
    internal.add_argument("--host", default="127.0.0.1", help="address this side's Mooncake engine listens on")
    internal.add_argument("--port-file", help="--serve-source: where to write its socket's port")
    internal.add_argument("--source-addr", help="--read: the source's socket, HOST:PORT")
    internal.add_argument("--engine-id", help="--read: names its pool (the parent unlinks it)")
    return ap


def skip_reason(netns: bool) -> str:
    """Why this run cannot happen here ("" if it can): the mooncake extra missing, or (``netns``) no root."""
    try:
        import ipc.mooncake_transport  # noqa: F401
    except ImportError as exc:
        return f"the mooncake extra is missing: {exc}"
    if netns:
        from bench.netns import can_create_netns

        return can_create_netns()[1]
    return ""


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    tokens = tuple(args.tokens or TOKENS)
    if args.serve_source:
        serve_source(args.serve_source, args.host, args.port_file)
        return []
    if args.read:
        host, port = args.source_addr.rsplit(":", 1)
        rows = read_side(args.read, (host, int(port)), args.host, args.engine_id, args.reps, tokens)
        print(json.dumps(rows))
        return rows
    if reason := skip_reason(args.netns):
        print(f"bench_kv_network skipped: {reason}", flush=True)
        return []
    where = "between two network namespaces over the data veth" if args.netns else "two processes on loopback"
    print(f"KV handoff {where}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}, "
          f"{os.cpu_count()} CPUs", flush=True)
    rows = bench(args.reps, tokens, args.netns)
    print(report(rows))
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        print(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
