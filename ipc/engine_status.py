"""Engine-wide status record in POSIX shm: the watchdog's counters and stuck-gauge flags, the drain and stop flags.

One segment per engine (``/pdserve_<id>_status``), created and unlinked by the supervisor. Each field has
exactly one writer (named below); everyone else reads. Values are plain numbers so the API's /metrics and
tools/inspect can read them without going through any process. Per-actor facts (health, restarts, late
messages, the actors' own counts) live in the actor table (ipc/actor_table.py), one row per actor.

Layout (little endian)::

    offset  size  field
    0       4     magic         b"PDES"
    4       4     version       u4 = 4
    8       4     record_bytes  u4 = STATUS_DTYPE.itemsize
    64      ...   one record of STATUS_DTYPE (aligned: no field straddles its own size)

Record (``STATUS_DTYPE``; ``S`` = len(RequestState), indexed by state; ``G`` = len(GAUGES), GAUGES order;
``C`` = len(CONSERVATION_KINDS))::

    field                  type    writer      meaning
    watchdog_ticks         u8      monitor     ticks since start (pdserve_watchdog_ticks_total)
    watchdog_last_tick_ns  i8      monitor     CLOCK_MONOTONIC of the last tick
    watchdog_last_tick_s   f8      monitor     wall clock (unix s) of the last tick
    watchdog_tick_cpu_ns   i8      monitor     CPU time the last tick took
    timeouts               u8[S]   monitor     requests timed out, by the RequestState they were in
    actor_failures         u8[S]   monitor     requests failed because their actor was dead or hung
    exit_failures          u8[S]   supervisor  the same, failed by the supervisor the moment the process exited
                                               (each counter has one writer; readers add them: ``actor_failures``)
    gauge_nonzero_since_ns i8[G]   monitor     since when each gauge has been > 0 (0 = it is 0)
    gauge_moved_ns         i8[G]   monitor     last time a request left that stage
    stuck                  u1[G]   monitor     1 = gauge > 0 and nothing left the stage for stuck_gauge_s
    mismatch               u1[G]   monitor     1 = the actors' own count disagrees with the table
    drill_runs             u8[S]   api         watchdog drills run, by the stage drilled (api/drill.py)
    drill_failures         u8[S]   api         of those, failed
    drill_last_success_s   f8[S]   api         wall clock (unix s) of the stage's last passed drill (0 = none yet)
    drill_failing          u1[S]   api         the stage's last drill failed: 1 + its index in DRILL_FAILURES
                                               (0 = it passed, or none ran)
    conservation           u8[C]   see below   conservation violations reported, by CONSERVATION_KINDS: "blocks"
                                               written by the monitor (actors/watchdog.BlockConservation), the
                                               others by the API (api/conservation.py); one writer per element
    draining               u1      supervisor  1 = stop admitting (SIGTERM received)
    stopping               u1      supervisor  1 = every actor leaves its loop (the supervisor's stop)

The stop flag is a field here rather than a multiprocessing.Event, whose named semaphores (``sem.mp-*``, random
names) only the creating process or its resource tracker unlinks: a SIGKILL of every engine process at once
(docker kill, systemd's final SIGKILL, an OOM kill of the cgroup) left them in /dev/shm for good. Everything the
engine maps is named with its engine id, so the next start reclaims it (ipc/manifest.py).
"""
from __future__ import annotations

import struct

import numpy as np

from ipc import _shm
from ipc.lifecycle import RequestState

GAUGES = ("running", "queued", "prefill_inflight", "decode_transfer")
GAUGE_METRIC = {"running": "pdserve_num_running_reqs", "queued": "pdserve_num_queue_reqs",
                "prefill_inflight": "pdserve_num_prefill_inflight_queue_reqs",
                "decode_transfer": "pdserve_num_decode_transfer_queue_reqs"}

# pdserve_conservation_violations_total{kind}: a leaked KV block; a row life held twice in a layer (or an id with
# more live rows than API handles); a live row no API handle holds; a connection whose ledger count is not the API's
CONSERVATION_KINDS = ("blocks", "id_twice", "id_orphan", "inflight")

_S, _G, _C = len(RequestState), len(GAUGES), len(CONSERVATION_KINDS)
STATUS_DTYPE = np.dtype([
    ("watchdog_ticks", "<u8"),
    ("watchdog_last_tick_ns", "<i8"),
    ("watchdog_last_tick_s", "<f8"),
    ("watchdog_tick_cpu_ns", "<i8"),
    ("timeouts", "<u8", (_S,)),
    ("actor_failures", "<u8", (_S,)),
    ("exit_failures", "<u8", (_S,)),
    ("gauge_nonzero_since_ns", "<i8", (_G,)),
    ("gauge_moved_ns", "<i8", (_G,)),
    ("stuck", "u1", (_G,)),
    ("mismatch", "u1", (_G,)),
    ("drill_runs", "<u8", (_S,)),
    ("drill_failures", "<u8", (_S,)),
    ("drill_last_success_s", "<f8", (_S,)),
    ("drill_failing", "u1", (_S,)),
    ("conservation", "<u8", (_C,)),
    ("draining", "u1"),
    ("stopping", "u1"),
], align=True)

MAGIC = b"PDES"
VERSION = 4
HEADER = struct.Struct("<4sII")  # magic, version, record_bytes
RECORD_OFFSET = 64


# why a watchdog drill failed (``drill_failing`` - 1); api/drill.py decides which
DRILL_FAILURES = (
    "the stage deadline did not fire within drill_timeout_s + one tick",
    "the stage deadline fired before drill_timeout_s",
    "the request never reached the stage",
    "its KV blocks (or the actors' own counts) were not freed after the deadline",
    "it ended otherwise than by the stage deadline",
)


def drill_problems(rec) -> list[str]:
    """/health and tools/inspect problems from the drill fields: one per stage whose last drill failed (``rec``:
    the record, or ``EngineStatus.snapshot()``'s dict)."""
    from ipc.lifecycle import STAGE_NAME

    return [f"watchdog drill of stage {stage} failed: {DRILL_FAILURES[int(rec['drill_failing'][int(state)]) - 1]}"
            for state, stage in STAGE_NAME.items() if rec["drill_failing"][int(state)]]


def actor_failures(rec) -> np.ndarray:
    """Requests failed because their actor was dead or hung, by state (u8[S]): the monitor's count plus the
    supervisor's (``rec``: the record, or ``EngineStatus.snapshot()``'s dict of lists)."""
    return np.add(rec["actor_failures"], rec["exit_failures"])


class EngineStatus(_shm.ShmSegment):
    """The status record. ``rec`` is a numpy record view over the shm (writes go straight to shm; a read-only
    attach gives a read-only view). Segment plumbing: ``ipc._shm.ShmSegment``."""

    MAGIC = MAGIC
    VERSION = VERSION
    KIND = "engine status record"

    def __init__(self) -> None:  # use create() / attach()
        super().__init__()
        self.rec = None

    @classmethod
    def create(cls, name: str) -> "EngineStatus":
        """Create (O_CREX, mode 0600) and own a zeroed record. Raises FileExistsError if ``name`` exists."""

        def init(mm) -> None:
            HEADER.pack_into(mm, 0, b"\0\0\0\0", VERSION, STATUS_DTYPE.itemsize)

        return cls._create(name, RECORD_OFFSET + STATUS_DTYPE.itemsize, init)

    def _check_layout(self, name: str, mm) -> None:
        record_bytes = HEADER.unpack_from(mm, 0)[2] if len(mm) >= HEADER.size else 0
        if record_bytes != STATUS_DTYPE.itemsize or len(mm) < RECORD_OFFSET + record_bytes:
            raise ValueError(f"engine status record {name!r} is {record_bytes} B; this code expects "
                             f"{STATUS_DTYPE.itemsize} B (RequestState or GAUGES changed)")

    def _setup(self, mm) -> None:
        self.rec = _shm.shm_array(mm, STATUS_DTYPE, 1, RECORD_OFFSET)[0]

    def _teardown(self) -> None:
        self.rec = None

    def snapshot(self) -> dict:
        """A copy of every field as plain Python values."""
        self._require_open()
        copy = np.array(self.rec)
        return {name: copy[name].tolist() for name in STATUS_DTYPE.names}
