"""Fault injection: off by default, on only through the ``faults`` config field (``PDSERVE_FAULTS``).

Spec: faults separated by ``;``, each ``name`` or ``name:key=value,key=value``. Unknown names or keys are a
ConfigError at start-up. Every fault takes ``count=N`` (apply to the next N eligible events; default all),
``fraction=P`` (apply to each eligible event with probability P, seeded by ``seed=S``; default 1) and
``match=PREFIX`` (only requests whose id starts with PREFIX; clients set the id with the ``X-Request-Id``
header, so a test or an operator can aim a fault at one request). A fault an engine actor applies also takes
``actor=NAME`` (only that actor applies it, e.g. ``transfer_stuck:actor=decode1``: one sick decode actor among
several; not the API's or the monitor's faults, ``NOT_IN_ACTORS``).

| fault | where | effect |
|---|---|---|
| ``drop_transfer_done`` | decode | TransferDone is never sent: the request stays in the prefill inflight queue |
| ``delay_transfer_done:seconds=S`` | decode | TransferDone is sent S seconds late |
| ``transfer_stuck`` | decode | the transport reports IN_PROGRESS forever for the request |
| ``transfer_unknown_status`` | decode | the transport reports a status value the code does not know |
| ``decode_reject`` | decode | decode drops the request at bootstrap and reports a retryable failure |
| ``bootstrap_silent`` | decode | decode never reserves blocks nor answers for the request (stays BOOTSTRAP) |
| ``slow_prefill:seconds=S`` | prefill | every prompt chunk takes S seconds longer (still heartbeating): slow, progressing |
| ``stall_prefill:seconds=S`` | prefill | after its first chunk the prompt makes no progress for S seconds (still heartbeating) |
| ``stall:actor=NAME,seconds=S`` | that actor | its loop blocks S seconds (a hang), once per eligible request |
| ``crash:actor=NAME`` | that actor | the process exits abruptly (os._exit) when it takes an eligible request |
| ``stop_holding_lock:actor=decodeJ`` | decode | takes the state table lock and SIGSTOPs itself (a stuck holder) |
| ``leak_blocks`` | prefill | the request's prompt blocks are never freed (a leak the monitor's conservation check names) |
| ``exchange_bug:step=STEP`` | api | the request's exchange raises an error as a bug would, at STEP (one of ``EXCHANGE_STEPS``: after admission, making the renderer, its start, its first event, its finish, sending the answer) |
| ``duplicate_row`` | api | on admitting an eligible request, a second row with its id that no handle holds (an id held twice: api/conservation.py names it) |
| ``ledger_count_drift`` | api | an eligible request's start is recorded twice in the connection ledger: its connection's count drifts one above the API's |
| ``router_count_drift:count_delta=K`` | api | on admitting an eligible request, the router's per-actor active counts drift K off for good (the monitor flags it) |
| ``drop_prefill_request`` | prefill (colocated: decode) | the PrefillRequest is dropped on arrival: the row stays QUEUED, nobody holds it |
| ``hold_prefill`` | prefill (colocated: decode) | the prompt is begun (PREFILLING, blocks allocated) but none of its chunks is computed; other prompts pass |
| ``hold_decode_waiting`` | decode | the request never joins the running batch (stays DECODE_WAITING); others join |
| ``hold_decode`` | decode | after its first token the request gets no more (stays DECODING); the rest of the batch steps on |
| ``monitor_blind`` | monitor | the monitor does not time the request out (a watchdog that cannot fire) |

Watchdog drills (api/drill.py, ``drill_interval_s`` > 0) add ``DRILL_FAULTS`` to every actor's plan: each holds a
request whose id starts with ``drill-<stage>-`` in that stage. The API never admits a client's id with the
``DRILL_PREFIX`` (api/protocol.py ``check_request_id``), so these never touch client traffic.

Example: ``PDSERVE_FAULTS="drop_transfer_done:count=1;stall:actor=decode0,seconds=20,count=1"``.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from pdserve.errors import ConfigError

FAULT_KEYS = {
    "drop_transfer_done": set(),
    "delay_transfer_done": {"seconds"},
    "transfer_stuck": set(),
    "transfer_unknown_status": set(),
    "decode_reject": set(),
    "bootstrap_silent": set(),
    "slow_prefill": {"seconds"},
    "stall_prefill": {"seconds"},
    "stall": {"actor", "seconds"},
    "crash": {"actor"},
    "stop_holding_lock": {"actor"},
    "router_count_drift": {"count_delta"},
    "duplicate_row": set(),
    "ledger_count_drift": set(),
    "leak_blocks": set(),
    "exchange_bug": {"step"},
    "drop_prefill_request": set(),
    "hold_prefill": set(),
    "hold_decode_waiting": set(),
    "hold_decode": set(),
    "monitor_blind": set(),
}
NOT_IN_ACTORS = {"router_count_drift", "exchange_bug", "monitor_blind"}   # applied by the API or the monitor
EXCHANGE_STEPS = ("admitted", "renderer", "start", "event", "finish", "send")   # api/exchange.py's Exchange
COMMON_KEYS = {"count", "fraction", "seed", "match"}
DRILL_PREFIX = "drill-"
# `pdserve router`'s readmission probes (api/router_client.py): their timeouts never count toward ejection
PROBE_PREFIX = "eject-probe-"
# stage name (ipc.lifecycle.STAGE_NAME) -> the fault that holds a drill request in it, aimed at drill-<stage>-
DRILL_HOLDS = {"queued": "drop_prefill_request", "prefill": "hold_prefill", "bootstrap": "bootstrap_silent",
               "transfer": "transfer_stuck", "decode_waiting": "hold_decode_waiting", "decode": "hold_decode"}
DRILL_FAULTS = ";".join(f"{fault}:match={DRILL_PREFIX}{stage}-" for stage, fault in DRILL_HOLDS.items())
ACTOR_NAME_RE = re.compile(r"^(prefill|decode)[0-9]{1,3}$")   # an engine actor (see actors.topology.Topology)


@dataclass
class Fault:
    name: str
    params: dict[str, str] = field(default_factory=dict)
    remaining: int | None = None
    fraction: float = 1.0
    rng: random.Random = field(default_factory=random.Random)

    def fires(self, request_id: str = "") -> bool:
        """Consume one eligible event; True if the fault applies to it."""
        if not request_id.startswith(self.params.get("match", "")):
            return False
        if self.remaining is not None and self.remaining <= 0:
            return False
        if self.fraction < 1.0 and self.rng.random() >= self.fraction:
            return False
        if self.remaining is not None:
            self.remaining -= 1
        return True

    def number(self, key: str) -> float:
        return float(self.params[key])


def parse_faults(spec: str) -> list[Fault]:
    """Parse and validate a fault spec (see the module docstring).

    Raises:
        ConfigError: unknown fault or key, a missing required key, or a value of the wrong type.
    """
    faults = []
    for part in filter(None, (p.strip() for p in (spec or "").split(";"))):
        name, _, rest = part.partition(":")
        name = name.strip()
        if name not in FAULT_KEYS:
            raise ConfigError(f"config field faults: unknown fault {name!r}; known: {', '.join(FAULT_KEYS)}",
                              param="faults")
        params: dict[str, str] = {}
        for item in filter(None, (i.strip() for i in rest.split(","))):
            key, eq, value = item.partition("=")
            keys = FAULT_KEYS[name] | COMMON_KEYS | ({"actor"} if name not in NOT_IN_ACTORS else set())
            if not eq or key not in keys:
                raise ConfigError(f"config field faults: {name} takes {sorted(keys)}, not {item!r}",
                                  param="faults")
            params[key] = value
        missing = FAULT_KEYS[name] - params.keys()
        if missing:
            raise ConfigError(f"config field faults: {name} needs {sorted(missing)}", param="faults")
        if "actor" in params and not ACTOR_NAME_RE.match(params["actor"]):
            raise ConfigError(f"config field faults: {name} actor must be an engine actor (prefill<i> or "
                              f"decode<j>), not {params['actor']!r}", param="faults")
        if name == "exchange_bug" and params["step"] not in EXCHANGE_STEPS:
            raise ConfigError(f"config field faults: {name} step must be one of {', '.join(EXCHANGE_STEPS)}, not "
                              f"{params['step']!r}", param="faults")
        if name == "stop_holding_lock" and not params["actor"].startswith("decode"):
            raise ConfigError(f"config field faults: {name} is wired in decode actors only (on taking a KVReady), "
                              f"not {params['actor']!r}", param="faults")
        try:
            fault = Fault(name, params,
                          remaining=int(params["count"]) if "count" in params else None,
                          fraction=float(params.get("fraction", 1.0)),
                          rng=random.Random(int(params.get("seed", 0))))
            for key in ("seconds", "count_delta"):
                if key in params:
                    fault.number(key)
        except ValueError as exc:
            raise ConfigError(f"config field faults: bad number in {part!r}: {exc}", param="faults") from None
        if not 0.0 <= fault.fraction <= 1.0:
            raise ConfigError(f"config field faults: fraction must be in [0, 1] in {part!r}", param="faults")
        faults.append(fault)
    return faults


class FaultPlan:
    """The faults that apply in one actor process. ``fires(name)`` is False for every name when none are set."""

    def __init__(self, spec: str, actor_name: str, drills: bool = False):
        """``drills``: watchdog drills are on (``drill_interval_s`` > 0): ``DRILL_FAULTS`` join the plan."""
        spec = f"{spec};{DRILL_FAULTS}" if drills else spec
        self.faults = [f for f in parse_faults(spec)
                       if f.params.get("actor", actor_name) == actor_name]

    def fires(self, name: str, request_id: str = "", **where: str) -> Fault | None:
        """The fault ``name`` whose parameters include ``where`` if it applies to this event (consuming one count),
        else None."""
        for fault in self.faults:
            if (fault.name == name and all(fault.params.get(k) == v for k, v in where.items())
                    and fault.fires(request_id)):
                return fault
        return None

    def __bool__(self) -> bool:
        return bool(self.faults)
