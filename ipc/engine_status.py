"""Engine-wide status record in POSIX shm: the watchdog's counters, stuck-gauge flags, drain flag.

One segment per engine (``/pdserve_<id>_status``), created and unlinked by the supervisor. Each field has
exactly one writer (named below); everyone else reads. Values are plain numbers so the API's /metrics and
tools/inspect can read them without going through any process.

Layout (one record of ``STATUS_DTYPE``, little-endian, fields in this order)::

    field                 type        writer      meaning
    draining              u1          supervisor  1 = stop admitting (SIGTERM received)
    watchdog_ticks        u8          monitor     ticks since start (pdserve_watchdog_ticks_total)
    watchdog_last_tick_ns i8          monitor     CLOCK_MONOTONIC of the last tick
    watchdog_last_tick_s  f8          monitor     wall clock (unix s) of the last tick
    watchdog_tick_cpu_ns  i8          monitor     CPU time the last tick took
    timeouts              u8[16]      monitor     requests timed out, by the RequestState they were in
    actor_failures        u8[16]      monitor     requests failed because their actor was dead or hung
    bad_timestamps        u8          monitor     rows seen with a zero or future state_since_ns
    rows_reclaimed        u8          monitor     final rows released because nobody released them
    gauge_value           i4[8]       monitor     queue gauges at the last tick (GAUGES order)
    gauge_nonzero_since_ns i8[8]      monitor     since when each gauge has been > 0 (0 = it is 0)
    gauge_moved_ns        i8[8]       monitor     last time a request left that stage
    stuck                 u1[8]       monitor     1 = gauge > 0 and nothing left the stage for stuck_gauge_s
    mismatch              u1[8]       monitor     1 = an actor's own count disagrees with the table
    actor_health          u1[8]       monitor     per actor index: 0 unknown, 1 ok, 2 hung, 3 dead
    actor_restarts        u4[8]       supervisor  per actor index: restarts so far
    late_messages         u8[8]       each actor  per actor index: messages for final/stale requests dropped
    api_active_requests   i4          api         requests the API process is waiting on (its own view)
    own_gauges            i4[8,4]     each actor  per actor index, per gauge (GAUGES order): the actor's own
                                                  count, -1 = the actor keeps none (cross-checked by the monitor)
"""
from __future__ import annotations

import enum

import numpy as np

from ipc._shm import attach_segment, close_mapping, create_segment, shm_array, unlink_segment_quiet

GAUGES = ("running", "queued", "prefill_inflight", "decode_transfer")
GAUGE_METRIC = {"running": "pdserve_num_running_reqs", "queued": "pdserve_num_queue_reqs",
                "prefill_inflight": "pdserve_num_prefill_inflight_queue_reqs",
                "decode_transfer": "pdserve_num_decode_transfer_queue_reqs"}


class ActorHealth(enum.IntEnum):
    UNKNOWN = 0
    OK = 1
    HUNG = 2
    DEAD = 3


STATUS_DTYPE = np.dtype([
    ("draining", "u1"),
    ("watchdog_ticks", "<u8"),
    ("watchdog_last_tick_ns", "<i8"),
    ("watchdog_last_tick_s", "<f8"),
    ("watchdog_tick_cpu_ns", "<i8"),
    ("timeouts", "<u8", (16,)),
    ("actor_failures", "<u8", (16,)),
    ("bad_timestamps", "<u8"),
    ("rows_reclaimed", "<u8"),
    ("gauge_value", "<i4", (8,)),
    ("gauge_nonzero_since_ns", "<i8", (8,)),
    ("gauge_moved_ns", "<i8", (8,)),
    ("stuck", "u1", (8,)),
    ("mismatch", "u1", (8,)),
    ("actor_health", "u1", (8,)),
    ("actor_restarts", "<u4", (8,)),
    ("late_messages", "<u8", (8,)),
    ("api_active_requests", "<i4"),
    ("own_gauges", "<i4", (8, 4)),
])


class EngineStatus:
    """The status record. ``rec`` is a numpy record view over the shm (writes go straight to shm)."""

    def __init__(self, name: str, mm, owner: bool):
        self.name = name
        self._mm = mm
        self._owner = owner
        self.rec = shm_array(mm, STATUS_DTYPE, 1)[0]

    @classmethod
    def create(cls, name: str) -> "EngineStatus":
        status = cls(name, create_segment(name, STATUS_DTYPE.itemsize), owner=True)
        status.rec["own_gauges"] = -1
        return status

    def set_own_gauges(self, actor_index: int, **counts: int) -> None:
        """An actor publishes its own counts (keys from GAUGES); called once per loop iteration."""
        row = self.rec["own_gauges"][actor_index]
        for gauge, value in counts.items():
            row[GAUGES.index(gauge)] = value

    def own_gauges(self) -> list[int]:
        """Per gauge, the sum of the actors' own counts, or -1 where no actor keeps that gauge."""
        table = np.array(self.rec["own_gauges"])
        kept = table >= 0
        return [int(table[:, i][kept[:, i]].sum()) if kept[:, i].any() else -1 for i in range(len(GAUGES))]

    def count_late_message(self, actor_index: int) -> None:
        self.rec["late_messages"][actor_index] += 1

    @classmethod
    def attach(cls, name: str, readonly: bool = False) -> "EngineStatus":
        return cls(name, attach_segment(name, readonly=readonly), owner=False)

    def snapshot(self) -> dict:
        """A copy of every field as plain Python values."""
        copy = np.array(self.rec)
        return {name: copy[name].tolist() for name in STATUS_DTYPE.names}

    def close(self) -> None:
        self.rec = None
        close_mapping(self._mm)
        self._mm = None

    def unlink(self) -> None:
        if self._owner:
            unlink_segment_quiet(self.name)
