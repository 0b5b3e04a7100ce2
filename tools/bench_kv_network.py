"""bench_kv_network: KV handoff bandwidth of the ``mooncake`` transport (Mooncake Transfer Engine, TCP) between
two processes on loopback, next to the ``cpu-shm`` transport and a plain TCP socket copy of the same bytes.

Run from the repository root: ``python -m tools.bench_kv_network [--reps 5] [--json]`` (needs the mooncake
extra: ``make install-mooncake``). A source process owns a KV pool of the default model's geometry (SmolLM2-135M:
30 layers, 3 KV heads of 64, fp32, 16-token blocks: 720 KiB a block), publishes it through Mooncake, and serves a
socket. For one request of 128/512/2048 tokens (consecutive and scattered block ids) the parent times:

* ``mooncake``: ``MooncakeTransport.start_copy`` then ``poll`` every 0.5 ms until DONE (one batched read, a
  worker thread);
* ``cpu-shm``: ``CpuShmTransport.start_copy`` of the same ids from the same pool (one host: shm);
* ``socket``: the source sends the same number of bytes straight from its pool over a loopback TCP socket and
  the parent ``recv_into``s them into its pool (no framing, one stream: the floor of a TCP handoff).

Repetitions are interleaved and the median is reported; ratios are what to compare on a shared machine.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import time

import numpy as np

GEOMETRY = dict(num_layers=30, num_blocks=160, block_tokens=16, num_kv_heads=3, head_dim=64)
TOKENS = (128, 512, 2048)


def _source(pool_name: str, ready, done, port_out) -> None:
    """The prefill-like side: a filled pool published through Mooncake, and a socket that sends ``n`` bytes of
    the pool's data section per 8-byte request (n = 0 ends)."""
    from ipc.kv_pool import KVPool
    from ipc.mooncake_transport import MooncakeSource

    pool = KVPool.create(pool_name, **GEOMETRY)
    source = None
    try:
        pool.array()[:] = np.random.default_rng(1).standard_normal(pool.shape, dtype=np.float32)
        source = MooncakeSource(pool)
        data = memoryview(pool.array().reshape(-1).view(np.uint8))
        with socket.create_server(("127.0.0.1", 0)) as server:
            port_out.put(server.getsockname()[1])
            ready.set()
            conn, _ = server.accept()
            with conn:
                while True:
                    n = int.from_bytes(_recv_exact(conn, 8), "little")
                    if n == 0:
                        break
                    conn.sendall(data[:n])
        done.wait(60)
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


def bench(reps: int, tokens_list: tuple[int, ...] = TOKENS) -> list[dict]:
    from ipc import naming
    from ipc.kv_pool import KVPool
    from ipc.kv_transport import CpuShmTransport
    from ipc.mooncake_transport import MooncakeTransport

    ctx = mp.get_context("spawn")
    eid = naming.new_engine_id()
    ready, done, port_q = ctx.Event(), ctx.Event(), ctx.Queue()
    src_name = naming.segment_name(eid, "kvsrc")
    proc = ctx.Process(target=_source, args=(src_name, ready, done, port_q))
    proc.start()
    dst = conn = mc = shm = None
    rows = []
    try:
        if not ready.wait(120):
            raise RuntimeError("the source process did not start")
        dst = KVPool.create(naming.segment_name(eid, "kvdst"), **GEOMETRY)
        conn = socket.create_connection(("127.0.0.1", port_q.get(timeout=10)))
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
            conn.sendall((0).to_bytes(8, "little"))
            conn.close()
        for xfer in (mc, shm):
            if xfer is not None:
                xfer.close()
        done.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        if dst is not None:
            dst.close()
        naming.unlink_all(eid)
    return rows


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


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_kv_network", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions per contender (x4 at 128 tokens)")
    ap.add_argument("--tokens", type=int, action="append", choices=TOKENS, help="request sizes (default all)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON after the table")
    args = ap.parse_args(argv)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}, {os.cpu_count()} CPUs", flush=True)
    rows = bench(args.reps, tuple(args.tokens or TOKENS))
    print(report(rows))
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        print(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
