"""Which actor sits where, and the addresses messages carry between them.

| name | what |
|---|---|
| `Topology`, `topology(config)` | actor-table index of every actor: `prefill0..N-1`, `decode0..M-1`, `api`, `monitor` |
| `ROLE_CLASSES` | what each role runs, as "module:Class" (imported in the child by `actors.base.run_actor`) |
| addresses | `"prefill1"`, `"decode0"`, `API`; `LOCAL_PREFILL` / `LOCAL_DECODE` (a core in the same process); `REMOTE` (the other side is another node: through the API); `peer_address(k)` (a decode actor's k-th remote prefill pool) |
| `NO_ACTOR`, `REMOTE_ACTOR` | the state row's `prefill_actor` / `decode_actor` values that name no actor of this engine |

Every negative actor value and every address kind is declared here (tests/core/test_structure.py keeps it so);
``actors.ports.QueueOutbox`` is the per-process directory that resolves an address to an shm inbox or a local core.
"""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.config import EngineConfig

# The default 1 x 1 topology's indices (``topology(config)`` gives any N x M one); also the ``owner`` values.
PREFILL_INDEX = 0
DECODE_INDEX = 1
API_INDEX = 2
MONITOR_INDEX = 3
# What each role runs, as "module:Class", imported in the child by run_actor: the supervisor imports no actor's
# heavy code (torch, the model, HTTP), and the actors package does not depend on the api package.
ROLE_CLASSES = {"prefill": "actors.prefill:PrefillActor", "decode": "actors.decode:DecodeActor",
                "api": "api.server:ApiActor", "monitor": "actors.monitor:HeartbeatMonitor"}

# ---- addresses (the destinations in messages and in an outbox) ----------------------------------------------
API = "api"
LOCAL_PREFILL = "local:prefill"   # colocated: the prefill core inside the decode actor
LOCAL_DECODE = "local:decode"     # colocated: the decode core the prefill core hands its KVReady to
REMOTE = "remote"                 # the other side runs on another node: the message goes through this node's API


def peer_address(k: int) -> str:
    """The address a decode actor gives the ``k``-th remote prefill pool it opened (its KVReadies' holder; its
    TransferDone goes through the API)."""
    return f"peer:{k}"


def is_remote(address: str) -> bool:
    """``address`` is on another node (``REMOTE`` or a ``peer_address``): its pool is out of this host's reach."""
    return address == REMOTE or address.startswith("peer:")


# ---- the state row's actor fields (i1 actor-table indices) -----------------------------------------------------
NO_ACTOR = -1       # none: colocated (no prefill actor), or not routed
REMOTE_ACTOR = -2   # the other side runs on another node (`pdserve router`)


@dataclass(frozen=True)
class Topology:
    """Which actor sits at which actor-table index: ``prefill0..N-1``, ``decode0..M-1``, ``api``, ``monitor``
    (in that order; colocated mode has no prefill actor). Indices are also the values of the state row's
    ``owner``, ``prefill_actor`` and ``decode_actor`` fields; an actor's address is its name."""

    num_prefill: int
    num_decode: int

    @property
    def prefill(self) -> tuple[int, ...]:
        return tuple(range(self.num_prefill))

    @property
    def decode(self) -> tuple[int, ...]:
        return tuple(range(self.num_prefill, self.num_prefill + self.num_decode))

    @property
    def api(self) -> int:
        return self.num_prefill + self.num_decode

    @property
    def monitor(self) -> int:
        return self.api + 1

    @property
    def names(self) -> tuple[str, ...]:
        return tuple([f"prefill{i}" for i in range(self.num_prefill)] + [f"decode{j}" for j in range(self.num_decode)]
                     + ["api", "monitor"])

    def role(self, index: int) -> str:
        """"prefill", "decode", "api" or "monitor". Raises IndexError outside the table."""
        return self.names[index].rstrip("0123456789")

    def class_path(self, index: int) -> str:
        return ROLE_CLASSES[self.role(index)]

    def segment(self, what: str, index: int) -> str:
        """The segment key (``EngineLayout.segments``) of actor ``index``'s ``what`` ("q" inbox or "kv" pool):
        e.g. ``q_prefill0``, ``kv_decode1``; the API's inbox is ``q_api``."""
        return f"{what}_{self.names[index]}"

    def address(self, index: int) -> str:
        """The address of the actor a state row's field names: its name (``"prefill0"``); ``REMOTE`` for
        ``REMOTE_ACTOR``. Raises ValueError for ``NO_ACTOR`` or an index outside the table."""
        if index == REMOTE_ACTOR:
            return REMOTE
        if not 0 <= index < len(self.names):
            raise ValueError(f"actor index {index} names no actor of this engine")
        return self.names[index]

    def index(self, address: str) -> int:
        """The actor-table index of the actor at ``address`` (its name). Raises ValueError for any other address."""
        try:
            return self.names.index(address)
        except ValueError:
            raise ValueError(f"address {address!r} names no actor of this engine") from None


def topology(config: EngineConfig) -> Topology:
    """The actors ``config`` asks for: ``prefill_actors`` x ``decode_actors``, or one per listed GPU
    (``prefill_devices`` / ``decode_devices``); no prefill actor when colocated (actors/placement.py). Raises
    ConfigError for a refused placement."""
    from actors.placement import role_counts

    return Topology(*role_counts(config))
