"""The monitor tick's cost of incident bundles (actors/incidents.py), in one process, as ratios in one run.

A tick-like workload (a state-table snapshot and a pass over its rows, what the monitor's tick reads) runs every
20 ms, first without a bundle writer, then with one that is asked for a bundle every 25th tick (limit 0 s: each
one it can take), then without again; prints the tick's p50/p99 with bundles over without, what
``IncidentWriter.report`` costs the tick, how many bundles were written and their size. The engine is a manifest,
a state table and a flight recorder holding 7,000 request lives, without processes.

    python -m bench.incidents
"""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

import numpy as np


def main() -> int:
    from actors.incidents import Incident, IncidentWriter, LogTail
    from ipc import naming
    from ipc.manifest import write_manifest
    from ipc.recorder import EventKind, Recorder, request_key
    from ipc.state_table import RequestState as S
    from ipc.state_table import StateTable

    eid = naming.new_engine_id()
    seg = {"state": naming.segment_name(eid, "state"), "recorder": naming.segment_name(eid, "recorder")}
    manifest = write_manifest(eid, {"engine_id": eid, "pid": os.getpid(), "created_unix_s": time.time(),
                                    "segments": seg, "actors": ["prefill0", "decode0", "api", "monitor"],
                                    "config": {}})
    ring = Recorder.create(seg["recorder"], 5, 52428)
    table = StateTable.create(seg["state"], 32)
    directory = tempfile.mkdtemp(prefix="pdserve-incidents-")
    try:
        writer = ring.open_writer(0, actor=2)
        for i in range(7000):   # a row life's events, as the state table records them
            key, slot, gen = request_key(f"req-{i}"), i % 32, i // 32 + 1
            writer.append(EventKind.ALLOCATE, slot, gen, key, new=int(S.QUEUED))
            writer.append(EventKind.TRANSITION, slot, gen, key, old=int(S.QUEUED), new=int(S.PREFILLING))
            writer.append(EventKind.TRANSITION, slot, gen, key, old=int(S.PREFILLING), new=int(S.FAILED))
            writer.append(EventKind.RELEASE, slot, gen, key, old=int(S.FAILED))

        def tick() -> None:
            rows = table.snapshot()
            np.flatnonzero(rows["state"] > 0)
            [int(x) for x in rows["generation"]]

        def run(writer: IncidentWriter | None, n: int = 300) -> tuple[list[float], list[float]]:
            ticks, reports = [], []
            for i in range(n):
                t0 = time.perf_counter()
                tick()
                if writer is not None and i % 25 == 0:
                    t1 = time.perf_counter()
                    writer.report(Incident("timeout", "bench", ["req-5"], "transfer", "inflight_timeout_s"))
                    reports.append(time.perf_counter() - t1)
                ticks.append(time.perf_counter() - t0)
                time.sleep(0.02)
            return ticks, reports

        off, _ = run(None)
        writer = IncidentWriter(eid, directory, 0.0, 1 << 30, LogTail())
        on, reports = run(writer)
        writer.close(timeout_s=60)
        off += run(None)[0]
        sizes = [os.path.getsize(p) for p in writer.written]

        def ms(xs: list[float], q: float) -> float:
            return float(np.percentile(xs, q)) * 1e3
        print(f"tick without bundles: p50 {ms(off, 50):.3f} ms p99 {ms(off, 99):.3f} ms")
        print(f"tick with bundles:    p50 {ms(on, 50):.3f} ms p99 {ms(on, 99):.3f} ms")
        print(f"ratio with/without: p50 {statistics.median(on) / statistics.median(off):.3f}x "
              f"p99 {np.percentile(on, 99) / np.percentile(off, 99):.3f}x")
        print(f"report(): p50 {ms(reports, 50) * 1e3:.0f} us max {max(reports) * 1e6:.0f} us; "
              f"{len(writer.written)} bundles of {len(reports)} asked, {statistics.mean(sizes) / 1e3:.0f} kB each")
        return 0
    finally:
        for segment in (table, ring, manifest):
            segment.close()
            segment.unlink()
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
